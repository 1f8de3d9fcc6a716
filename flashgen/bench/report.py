"""The bench's output: markdown tables with flashgen's ratio to each peer, CSV, JSON, a
PNG plot, and where they go. Pure Python on result rows (dicts); matplotlib is imported
only to plot, and its absence skips the plot with a message."""
from __future__ import annotations

import csv
import io
import json
import math
import re
import sys
from pathlib import Path

from ..resources import CHECKOUT_DIR

CSV_FIELDS = ("gpu", "torch", "triton", "spec_sha", "suite", "mod", "mode", "d", "causal", "b", "h",
              "h_kv", "n", "p", "provider", "status", "ms", "tflops", "gbps", "host_us",
              "wall_us", "note")


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def default_out_base() -> Path:
    """benchmarks/results/ of the checkout flashgen runs from; from an installed wheel,
    ./flashgen-bench/ under the working directory. A run writes into <gpu-slug>/ below."""
    results = CHECKOUT_DIR / "benchmarks" / "results"
    return results if results.parent.is_dir() else Path.cwd() / "flashgen-bench"


def default_out_dir(gpu: str) -> Path:
    return default_out_base() / gpu_slug(gpu)


def _metric(row):
    """The number a table cell shows: TFLOP/s (training, dropout), GB/s (decode), ms (small)."""
    if row.get("status") != "ok":
        return None
    if row["suite"] == "decode":
        return row.get("gbps")
    if row["suite"] == "small":
        return row.get("ms")
    return row.get("tflops")


def cell_text(row):
    """A table cell (and the run's log line): the row's number, or its status."""
    if row is None:
        return "–"
    if str(row.get("status")).startswith("skipped"):
        return "skipped"  # the reason is listed once under the tables (markdown_tables)
    if row.get("status") != "ok":
        return str(row.get("status", "?"))[:40].replace("|", "/")
    v = _metric(row)
    text = "–" if v is None else (f"{v:.4f}" if row["suite"] == "small" else f"{v:.1f}")
    if row["suite"] == "small" and row.get("host_us") is not None:
        text += f" (host {row['host_us']:.1f} us)"
    return text


def _group_key(row):
    return (row["suite"], row.get("mod") or "", row["mode"], row["d"], row["causal"],
            row.get("p") or 0.0)


def markdown_tables(rows) -> str:
    """One markdown table per (suite, mode, d, causal, p): a line per shape, a column per
    provider, then flashgen's ratio to each peer (a speed ratio: > 1 means flashgen is
    faster; for the small suite's ms it is peer_ms / flashgen_ms)."""
    groups = {}
    for r in rows:
        groups.setdefault(_group_key(r), []).append(r)
    units = {"decode": "GB/s", "small": "ms per call"}
    out = []
    for (suite, mod, mode, d, causal, p), grp in groups.items():
        providers = list(dict.fromkeys(r["provider"] for r in grp))
        base = next((x for x in providers if x in ("flashgen", "flashgen_s0")), None)
        peers = [x for x in providers if not x.startswith("flashgen") or x == "flashgen_tl"]
        shapes = list(dict.fromkeys((r["b"], r["n"]) for r in grp))
        cell = {(r["b"], r["n"], r["provider"]): r for r in grp}
        title = (f"**{suite}: {mode}, d={d}, {'causal' if causal else 'not causal'}"
                 f"{f', p={p}' if p else ''}** ({units.get(suite, 'TFLOP/s')})")
        if mod:
            title = (f"**{suite}: {mod}, {mode}, d={d}** (TFLOP/s, "
                     f"{'causal' if causal else 'dense'} FLOP count)")
        head = ["B", "N", *providers] + ([f"{base} vs {x}" for x in peers] if base else [])
        out += [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for b, n in shapes:
            cells = [str(b), str(n)] + [cell_text(cell.get((b, n, x))) for x in providers]
            if base:
                mine = _metric(cell.get((b, n, base)) or {})
                for x in peers:
                    theirs = _metric(cell.get((b, n, x)) or {})
                    if mine and theirs:
                        ratio = theirs / mine if suite == "small" else mine / theirs
                        cells.append(f"{ratio:.2f}")
                    else:
                        cells.append("–")
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    skipped = dict.fromkeys((r["provider"], r["status"]) for r in rows
                            if str(r.get("status")).startswith("skipped"))
    if skipped:
        out += ["Skipped providers:", ""] + [f"- {p}: {s}" for p, s in skipped] + [""]
    return "\n".join(out)


def csv_text(rows) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in CSV_FIELDS})
    return buf.getvalue()


def write_results(rows, out_dir, name, meta=None) -> dict:
    """<name>.json ({"meta", "rows"}), <name>.csv and <name>.md under out_dir; returns
    {kind: path}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / f"{name}.json", "csv": out_dir / f"{name}.csv",
             "md": out_dir / f"{name}.md"}
    paths["json"].write_text(json.dumps({"meta": meta or {}, "rows": rows}, indent=1) + "\n")
    paths["csv"].write_text(csv_text(rows))
    header = ""
    if meta:
        header = (f"# flashgen bench: {meta.get('gpu')}, torch {meta.get('torch')}, "
                  f"triton {meta.get('triton')}\n\n")
    paths["md"].write_text(header + markdown_tables(rows))
    return paths


def plot_point(r):
    """(panel key, x, y, y label) of a measured row, or None."""
    if r.get("status") != "ok":
        return None
    if r["suite"] in ("training", "dropout") and r.get("tflops") is not None:
        return (r["suite"], r["mode"], r["d"], r["causal"], 0), r["n"], r["tflops"], "TFLOP/s"
    if r["suite"] == "decode" and r.get("gbps") is not None:
        return (r["suite"], "fwd", r["d"], True, r["b"]), r["n"], r["gbps"], "GB/s"
    if r["suite"] == "small" and r.get("ms") is not None:
        return (r["suite"], r["mode"], r["d"], r["causal"], 0), r["b"] * r["n"], r["ms"], "ms"
    if r["suite"] == "mods" and r.get("tflops") is not None:
        # a panel per mod (the last key slot names it), TFLOP/s against N
        return (r["suite"], r["mode"], r["d"], r["causal"], r["mod"]), r["n"], r["tflops"], \
            "TFLOP/s"
    return None


def plot(rows, path) -> str | None:
    """One panel per (suite, mode, d, causal[, B or mod]) with a line per provider: TFLOP/s
    against N (training, dropout; mods, a panel per mod), GB/s against the KV length
    (decode, a panel per batch), ms against B*N tokens (small). Returns the path, or None
    (with a message) without matplotlib or without measured rows."""
    series, ylabels = {}, {}
    for r in rows:
        point = plot_point(r)
        if point is None:
            continue
        key, x, y, ylabel = point
        ylabels[key] = ylabel
        series.setdefault(key, {}).setdefault(r["provider"], []).append((x, y))
    if not series:
        return None
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("flashgen bench: matplotlib is not installed; skipping the plot", file=sys.stderr)
        return None
    order = {"training": 0, "dropout": 1, "decode": 2, "small": 3, "mods": 4}
    keys = sorted(series, key=lambda k: (order.get(k[0], 9), k))
    cols = min(4, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3.6 * nrows), squeeze=False)
    for ax, key in zip(axes.flat, keys):
        ax.set_prop_cycle(color=plt.cm.tab20.colors)  # decode panels hold up to 18 series
        for prov, pts in sorted(series[key].items()):
            pts.sort()
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=prov)
        suite, mode, d, causal, b = key
        last = f" {b}" if isinstance(b, str) else (f" B={b}" if b else "")
        ax.set_title(f"{'' if suite == 'training' else suite + ' '}{mode} d={d}"
                     f"{' causal' if causal else ''}{last}", fontsize=10)
        ax.set_xscale("log", base=2)
        ax.set_xlabel({"decode": "KV length", "small": "B*N tokens"}.get(suite, "N"))
        ax.set_ylabel(ylabels[key])
        # from zero (a panel's gap reads as its ratio), with room above the highest point
        top = max(y for pts in series[key].values() for _, y in pts)
        ax.set_ylim(0, top * 1.15 if top > 0 else 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7 if len(series[key]) <= 8 else 5)
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)

