"""One benchmark run over every suite: flashgen's generated packages beside the peers
(SDPA flash, SDPA cuDNN, FlexAttention, naive PyTorch), measured side by side; the engine
behind `flashgen bench` (flashgen/bench.py is the CLI wrapper).

    flashgen bench [--suite training|decode|dropout|small|all] [--spec SPEC] [--dry-run] ...

The flashgen packages are built from their specs into a temporary folder at the start of a
run: specs/gpt2.yaml (d=64) and specs/llama.yaml (d=128), specs/bench/dropout_d128.yaml for
the dropout suite (the copies inside the installed package when flashgen is installed from a
wheel), or the user's `--spec`, which replaces them for the head dims it was built for.

Suites:
  training  the H100 anchor table's shapes (docs/H100_ANCHORS.md): bf16, B*N = 16k
            tokens, H*d = 2048, d = 64 (gpt2_attn) and 128 (llama_attn),
            N = 512 .. 16k, causal and not, fwd and bwd ("bwd" = `o.backward(do)` alone).
  dropout   causal d=128, H=16, B*N = 16k, N = 1k/4k, p=0.1: flashgen built from
            specs/bench/dropout_d128.yaml with and
            without dropout, and the SDPA backends that take dropout_p, and naive PyTorch.
  decode    flashgen/bench_decode.py's measurement (one query token, B=8, Hq=32, Hkv=8, d=128,
            KV length 4k/16k/64k), imported and run as is; GB/s.
  small     the seeds' small shapes: H=16, d=64, (B, N) = (4, 512), (8, 59), (1, 2048),
            causal and not, forward; ms per call, plus flashgen's host dispatch time.

Method: every provider's output is first checked against a float32 reference (SDPA's math
backend on a slice: batch 0, heads 0-1); a wrong provider is marked WRONG and not timed; a
provider that refuses a shape gets "error: ..." in its cell (never fatal). Times are
`triton.testing.do_bench(..., return_mode="median")` with the L2 flushed between calls.
FLOPs: forward 4*B*H*Nq*Nk*d, halved when causal; backward 2.5x the forward (the anchors'
and the FlashAttention papers' convention). With dropout, the check is the provider at p=0
against the reference, and at p>0 a finite output of the reference's magnitude.

Host dispatch (small suite, flashgen): `host_us` is the CPU time of one call, from a
perf_counter around 200 back-to-back calls after a synchronize, stopped *before* the final
`torch.cuda.synchronize` (Python, argument checks, dispatch and launches; no GPU wait);
`wall_us` is the same loop's time including the final synchronize, per call. When host_us
exceeds the do_bench GPU time, the eager call is host-bound.

Everything at module level is pure Python (the case list, the FLOP formula, the table, CSV
and JSON writers); torch, triton and matplotlib are imported only when measuring/plotting.
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import math
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .resources import CHECKOUT_DIR, bundled_spec

SUITES = ("training", "dropout", "decode", "small", "mods")
TRAINING_N = (512, 1024, 2048, 4096, 8192, 16384)
TRAINING_D = (64, 128)
DROPOUT_N = (1024, 4096)
DROPOUT_P = 0.1
DECODE_B = (8, 1)
DECODE_N = (4096, 16384, 65536)
SMALL_SHAPES = ((4, 512), (8, 59), (1, 2048))
SMALL_H, SMALL_D = 16, 64
NAIVE_MAX_N = 8192  # naive attention materialises the N x N scores
TOKENS, WIDTH = 16384, 2048  # B*N and H*d of the anchor table

# head dim -> the example spec whose package the training suite times
SPECS = {64: "gpt2.yaml", 128: "llama.yaml"}
DROPOUT_SPEC = "bench/dropout_d128.yaml"

# provider name -> what it is (the dry run and the table's headers)
PROVIDERS = {
    "flashgen": "the generated package (gpt2_attn for d=64, llama_attn for d=128; "
                "bench_dropout_attn for the dropout suite, mods_attn for the mods suite)",
    "flashgen_p0": "flashgen's dropout package at p=0 (dropout suite: its own baseline)",
    "flashgen_tl": "the same package with every call on the `tl` kernel family (on Hopper the "
                   "package's default is the Gluon family where a variant has one)",
    "sdpa_flash": "SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    "sdpa_cudnn": "SDPA, CUDNN_ATTENTION backend",
    "sdpa_efficient": "SDPA, EFFICIENT_ATTENTION backend (dropout suite)",
    "flex": "torch.compile(flex_attention), causal BlockMask from create_block_mask (mods suite: "
            "the same score_mod / mask_mod as flashgen's mod)",
    "naive": "PyTorch matmul-softmax-matmul (N <= 8192 only)",
}
MODS_PROVIDERS = ("flashgen", "flex")
TRAINING_PROVIDERS = ("flashgen", "flashgen_tl", "sdpa_flash", "sdpa_cudnn", "flex", "naive")
DROPOUT_PROVIDERS = ("flashgen_p0", "flashgen", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
                     "naive")
# bench_decode.py's own rows: flashgen_s0, flashgen_append_s0, flashgen_graph_s0, flashgen_paged_*,
# sdpa_flash, sdpa_cudnn, flex; --providers filters them by prefix
DECODE_PROVIDERS = ("flashgen", "sdpa_flash", "sdpa_cudnn", "flex")

CSV_FIELDS = ("gpu", "torch", "triton", "spec_sha", "suite", "mod", "mode", "d", "causal", "b", "h",
              "h_kv", "n", "p", "provider", "status", "ms", "tflops", "gbps", "host_us",
              "wall_us", "note")


# ----------------------------------------------------------------------------------------
# cases (pure)
# ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    suite: str
    mode: str  # fwd | bwd
    d: int
    causal: bool
    b: int
    h: int
    n: int
    p: float = 0.0
    providers: tuple = field(default=(), compare=False)
    mod: str = ""  # the mods suite's case (bench_mods.MOD_CASES)

    def label(self) -> str:
        causal = "causal" if self.causal else "full"
        p = f" p={self.p}" if self.p else ""
        if self.suite == "mods":
            return (f"{self.suite:8s} {self.mode} d={self.d} {self.mod:12s} B={self.b} "
                    f"H={self.h} N={self.n}")
        if self.suite == "decode":
            return (f"{self.suite:8s} 1 query token d={self.d} B={self.b} Hq={self.h} "
                    f"Hkv={self.h // 4} KV={self.n}")
        return (f"{self.suite:8s} {self.mode} d={self.d} {causal:6s} B={self.b} H={self.h} "
                f"N={self.n}{p}")


def _keep(names, wanted):
    return tuple(n for n in names if wanted is None or any(
        n == w or n.startswith(w + "_") for w in wanted))


def plan_cases(suite="training", ns=None, ds=None, modes=("fwd", "bwd"), providers=None,
               causals=(False, True)):
    """The cases a run measures, each with the providers it would try. `ns` overrides the
    N list of the training and dropout suites (and the KV lengths of decode); `ds` the head
    dims of training; `modes` applies to training and dropout; `providers` filters by name
    (a name also selects its variants, e.g. flashgen -> flashgen_p0, flashgen_s0); `causals`
    the causalities of the training and small suites (a user's spec may lack a mask)."""
    suites = SUITES if suite == "all" else (suite,)
    cases = []
    for s in suites:
        if s == "training":
            for mode in modes:
                for d in (ds or TRAINING_D):
                    h = WIDTH // d
                    for causal in causals:
                        for n in (ns or TRAINING_N):
                            names = [x for x in TRAINING_PROVIDERS
                                     if x != "naive" or n <= NAIVE_MAX_N]
                            cases.append(Case(s, mode, d, causal, max(TOKENS // n, 1), h, n,
                                              providers=_keep(names, providers)))
        elif s == "dropout":
            for n in (ns or DROPOUT_N):
                for mode in modes:
                    names = [x for x in DROPOUT_PROVIDERS if x != "naive" or n <= NAIVE_MAX_N]
                    cases.append(Case(s, mode, 128, True, max(TOKENS // n, 1), 16, n,
                                      DROPOUT_P, providers=_keep(names, providers)))
        elif s == "decode":
            for b in DECODE_B:
                for n in (ns or DECODE_N):
                    cases.append(Case(s, "fwd", 128, True, b, 32, n,
                                      providers=_keep(DECODE_PROVIDERS, providers)))
        elif s == "mods":
            from .bench_mods import MOD_CASES, MODS_D, MODS_H, MODS_N
            for mode in modes:
                for d in (ds or MODS_D):
                    for mod, (_, _, causal_flops) in MOD_CASES.items():
                        for n in (ns or MODS_N):
                            cases.append(Case(s, mode, d, causal_flops, max(TOKENS // n, 1),
                                              MODS_H, n, providers=_keep(MODS_PROVIDERS, providers),
                                              mod=mod))
        elif s == "small":
            for b, n in SMALL_SHAPES:
                for causal in causals:
                    cases.append(Case(s, "fwd", SMALL_D, causal, b, SMALL_H, n,
                                      providers=_keep(TRAINING_PROVIDERS, providers)))
        else:
            raise ValueError(f"unknown suite {s!r}; one of {', '.join(SUITES)} or all")
    return cases


def flops(b, h, nq, nk, d, causal, mode):
    """FLOPs of one call (docs/H100_ANCHORS.md): forward 4*B*H*Nq*Nk*d, halved when
    causal; backward 2.5x the forward. GQA counts query heads."""
    f = 4 * b * h * nq * nk * d
    if causal:
        f /= 2
    return 2.5 * f if mode == "bwd" else float(f)


def tflops(ms, b, h, n, d, causal, mode):
    return flops(b, h, n, n, d, causal, mode) / (ms * 1e-3) / 1e12


_packages = {}


def load_package(spec_path, d=None, dropout=False):
    """(module, spec sha) of the package built from spec_path (default: the example spec
    for head dim d, or the dropout suite's), built once per process into a temporary folder
    and imported under a name of its own (so a user's spec may reuse an example's package
    name)."""
    import importlib.util
    import tempfile

    from .build import build_spec
    from .spec import load_spec

    if spec_path is None:
        spec_path = bundled_spec(DROPOUT_SPEC if dropout else SPECS[d])
    spec = load_spec(spec_path)
    key = (str(Path(spec_path).resolve()), spec.sha)
    if key not in _packages:
        out = Path(tempfile.mkdtemp(prefix="flashgen-bench-"))
        root = build_spec(spec, out).root
        name = f"flashgen_bench_{spec.package}_{spec.sha}"
        mspec = importlib.util.spec_from_file_location(
            name, root / "__init__.py", submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        mspec.loader.exec_module(module)
        _packages[key] = (module, spec.sha)
    return _packages[key]


def spec_sha(package_dir) -> str | None:
    """The spec sha a generated package records in its header line."""
    init = Path(package_dir) / "__init__.py"
    if not init.is_file():
        return None
    m = re.search(r"\bsha ([0-9a-f]+)", init.read_text().split("\n", 1)[0])
    return m.group(1) if m else None


def gpu_slug(name: str) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia-h100-80gb-hbm3'."""
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "gpu"


def result_name(suite, ns=None, ds=None, modes=("fwd", "bwd"), providers=None,
                package=None) -> str:
    """bench_<suite>[_<package>][_<modes>][_d<D>][_n<N>][_<providers>]: runs split by filter
    (to fit a time limit), or of a user's spec (its package name), write separate files
    instead of overwriting each other."""
    parts = ["bench", suite] + ([package] if package else [])
    if modes and set(modes) != {"fwd", "bwd"}:
        parts.append("-".join(modes))
    if ds:
        parts.append("d" + "-".join(map(str, ds)))
    if ns:
        parts.append("n" + "-".join(map(str, ns)))
    if providers:
        parts.append("-".join(providers))
    return "_".join(parts)


def dry_run_text(cases) -> str:
    lines = [f"{len(cases)} cases"]
    for c in cases:
        lines.append(f"  {c.label()}: {', '.join(c.providers) or '(no provider selected)'}")
    used = sorted({p for c in cases for p in c.providers})
    lines.append("providers:")
    for p in used:
        desc = PROVIDERS.get(p) or PROVIDERS.get(p.split("_")[0], "")
        lines.append(f"  {p}: {desc}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------
# writers (pure)
# ----------------------------------------------------------------------------------------

def _metric(row):
    """The number a table cell shows: TFLOP/s (training, dropout), GB/s (decode), ms (small)."""
    if row.get("status") != "ok":
        return None
    if row["suite"] == "decode":
        return row.get("gbps")
    if row["suite"] == "small":
        return row.get("ms")
    return row.get("tflops")


def _cell(row):
    if row is None:
        return "–"
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
            cells = [str(b), str(n)] + [_cell(cell.get((b, n, x))) for x in providers]
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


def _plot_point(r):
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
        point = _plot_point(r)
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


# ----------------------------------------------------------------------------------------
# measuring (GPU)
# ----------------------------------------------------------------------------------------

TOL = 3e-2  # bf16 output against the float32 reference (as every suite)


def _raise_recompile_limit(limit=1024):
    """So that no FlexAttention shape silently falls back to eager after dynamo's default
    8 recompiles."""
    import torch._dynamo
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


class Providers:
    """Callables fn(q, k, v, causal, p) -> out for each provider name; built lazily.
    `spec`: the user's spec, whose package serves flashgen at its head dims."""

    def __init__(self, spec=None):
        import torch  # noqa: F401
        self.spec = spec
        self._flex = None
        self._masks = {}

    def package(self, d, dropout=False):
        if self.spec is not None and not dropout:
            return load_package(self.spec)
        return load_package(None, d, dropout)

    def mods_inputs(self, case, device="cuda"):
        """(flashgen kwargs, FlexAttention (score_mod, block_mask)) of a mods case."""
        from . import bench_mods
        key = (case.mod, case.b, case.h, case.n)
        if key not in self._masks:
            kw = bench_mods.inputs(case.mod, case.b, case.h, case.n, device)
            self._masks[key] = (kw, None)
        kw, flex = self._masks[key]
        return kw, flex

    def get(self, name, case):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.suite == "mods":
            return self._get_mods(name, case)

        if name in ("flashgen", "flashgen_p0", "flashgen_tl"):
            pkg, _ = self.package(case.d, dropout=case.suite == "dropout")
            fixed_p = 0.0 if name == "flashgen_p0" else None
            family = "tl" if name == "flashgen_tl" else ""

            def run(q, k, v, causal, p):
                pkg._runtime.use_family(family)  # a no-op unless the provider changed
                return pkg.scaled_dot_product_attention(
                    q, k, v, dropout_p=p if fixed_p is None else fixed_p, is_causal=causal)
            return run
        if name.startswith("sdpa_"):
            backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                       "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                       "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

            def run(q, k, v, causal, p):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
            return run
        if name == "flex":
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            if self._flex is None:
                _raise_recompile_limit()
                self._flex = torch.compile(flex_attention, dynamic=False)
            compiled = self._flex

            def run(q, k, v, causal, p):
                if p:
                    raise NotImplementedError("FlexAttention has no dropout")
                mask = None
                if causal:
                    key = (q.shape[2], k.shape[2])
                    if key not in self._masks:
                        self._masks[key] = create_block_mask(
                            lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=key[0],
                            KV_LEN=key[1], device=q.device)
                    mask = self._masks[key]
                return compiled(q, k, v, block_mask=mask)
            return run
        if name == "naive":
            def run(q, k, v, causal, p):
                s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
                if causal:
                    nq, nk = s.shape[-2:]
                    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
                    s = s.masked_fill(~keep, float("-inf"))
                a = torch.softmax(s.float(), dim=-1).to(q.dtype)
                if p:
                    a = F.dropout(a, p)
                return a @ v
            return run
        raise ValueError(f"unknown provider {name!r}")


    def _get_mods(self, name, case):
        import torch

        from . import bench_mods
        band, mods, _ = bench_mods.MOD_CASES[case.mod]
        kw, _ = self.mods_inputs(case)
        if name == "flashgen":
            pkg, _ = load_package(bundled_spec(bench_mods.MODS_SPEC))

            def run(q, k, v, causal, p):
                return pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)
            return run
        if name == "flex":
            from torch.nn.attention.flex_attention import flex_attention
            if self._flex is None:
                _raise_recompile_limit()
                self._flex = torch.compile(flex_attention, dynamic=False)
            compiled = self._flex
            key = ("flex", case.mod, case.b, case.h, case.n)
            if key not in self._masks:
                self._masks[key] = bench_mods.flex_mods(case.mod, kw, case.b, case.h, case.n, "cuda")
            score_mod, block_mask = self._masks[key]

            def run(q, k, v, causal, p):
                return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
            return run
        raise ValueError(f"provider {name!r} has no mods rows")


def _reference(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q[:1, :2].float(), k[:1, :2].float(),
                                              v[:1, :2].float(), is_causal=causal)


def _check(fn, q, k, v, case, ref):
    """None if fn's output matches the reference, else the WRONG status."""
    import torch
    if case.p:
        out0 = fn(q, k, v, case.causal, 0.0)
        err = (out0[:1, :2].float() - ref).abs().max().item()
        if not err < TOL:
            return f"WRONG (p=0 max err {err:.3g})"
        out = fn(q, k, v, case.causal, case.p)
        if not torch.isfinite(out).all():
            return "WRONG (non-finite output with dropout)"
        ratio = out[:1, :2].float().abs().mean().item() / max(ref.abs().mean().item(), 1e-12)
        if not 0.5 < ratio < 2.0:
            return f"WRONG (dropout output magnitude {ratio:.2f}x the reference)"
        return None
    out = fn(q, k, v, case.causal, 0.0)
    err = (out[:1, :2].float() - ref).abs().max().item()
    return None if err < TOL else f"WRONG (max err {err:.3g})"


def host_time_us(call, calls=200):
    """(host_us, wall_us) per call over `calls` back-to-back calls: the CPU timer stops
    before the final synchronize (host_us) and after it (wall_us)."""
    import torch
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return round(host / calls * 1e6, 2), round(wall / calls * 1e6, 2)


def _timed_call(fn, q, k, v, case):
    """(the callable do_bench times, the tensors whose .grad it clears before each call):
    the forward, or the backward of one saved forward. Clearing the gradients matters:
    left alone, every backward after the first adds its dQ, dK, dV into the previous ones
    (three elementwise kernels, ~0.2 ms at B*N = 16k, H*d = 2048 on the H100), which a
    training step never does with activations' gradients and which took every provider's
    backward 5-20% slower than its kernels, pulling their ratios towards 1."""
    import torch
    if case.mode == "fwd":
        return (lambda: fn(q, k, v, case.causal, case.p)), None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, case.causal, case.p)
    do = torch.randn_like(out)
    return (lambda: out.backward(do, retain_graph=True)), [q, k, v]


def interleaved_rounds(items, rounds, time_one):
    """{item: [ms of round 0, 1, ...]}: `time_one(item)` for every item in every round,
    the items in order in even rounds and in reverse order in odd ones, so that a clock
    that drifts during the run (the GPU warming, its power state moving) lands on every
    item alike instead of on whichever was timed last. An item whose `time_one` raises
    drops out of the later rounds; its exception is returned in place of its list."""
    times = {item: [] for item in items}
    live = list(items)
    for r in range(rounds):
        for item in (live if r % 2 == 0 else live[::-1]):
            try:
                times[item].append(time_one(item))
            except Exception as e:  # reported in the provider's cell, not fatal
                times[item] = e
        live = [item for item in live if not isinstance(times[item], Exception)]
    return times


def record_rounds(row, got, width=100):
    """Put interleaved_rounds' result for one provider into its row: its error as the
    status, or its median round as `ms` (and every round as `ms_rounds` when there were
    several). Returns the median, or None."""
    if isinstance(got, Exception):
        row["status"] = f"error: {type(got).__name__}: {str(got)[:width]}"
        return None
    if not got:
        return None
    ms = statistics.median(got)
    row["ms"] = round(ms, 4)
    if len(got) > 1:
        row["ms_rounds"] = [round(t, 4) for t in got]
    return ms


def measure_attention(cases, meta, log=print, spec=None, progress=None, rounds=1):
    """Rows for the training, dropout and small suites' cases. `spec`: a user's spec whose
    package is flashgen (see Providers); `progress` advances once per provider and round
    measured. With `rounds` > 1 the providers of a case are timed in alternating order
    `rounds` times (interleaved_rounds) and each row's ms is the median of its rounds
    (`ms_rounds` in the JSON keeps them all)."""
    import torch
    import triton

    provs = Providers(spec)
    rows = []
    torch.manual_seed(0)
    for case in cases:
        q, k, v = (torch.randn(case.b, case.h, case.n, case.d, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        if case.suite == "mods":
            from . import bench_mods
            ref = bench_mods.reference(case.mod, provs.mods_inputs(case)[0], q, k, v)
        else:
            ref = _reference(q, k, v, case.causal)
        case_rows, ready = [], {}
        for name in case.providers:
            row = {**meta, **{k_: v_ for k_, v_ in asdict(case).items() if k_ != "providers"},
                   "provider": name, "h_kv": case.h, "status": "ok"}
            case_rows.append(row)
            try:
                if name.startswith("flashgen") and case.suite != "mods":
                    row["spec_sha"] = provs.package(case.d, case.suite == "dropout")[1]
                fn = provs.get(name, case)
                if case.suite == "mods" and name == "flashgen":
                    from . import bench_mods
                    pkg, row["spec_sha"] = load_package(bundled_spec(bench_mods.MODS_SPEC))
                    before = bench_mods.triton_binaries(pkg)
                    fn(q, k, v, case.causal, 0.0)
                    row["note"] = (f"{bench_mods.triton_binaries(pkg) - before} new binaries "
                                   "at this shape")
                wrong = _check(fn, q, k, v, case, ref)
                if wrong:
                    row["status"] = wrong
                else:
                    ready[name] = fn
            except Exception as e:  # a provider that refuses a shape is reported, not fatal
                row["status"] = f"error: {type(e).__name__}: {str(e)[:100]}"
            if name not in ready and progress is not None:
                progress.advance(f"{case.label().strip()} {name}", steps=rounds)

        timed = dict.fromkeys(ready, 0)

        def time_one(name):
            timed[name] += 1
            call, grads = _timed_call(ready[name], q, k, v, case)
            try:
                return triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads,
                                               return_mode="median")
            finally:
                del call
                torch.cuda.empty_cache()
                if progress is not None:
                    progress.advance(f"{case.label().strip()} {name}")

        times = interleaved_rounds(list(ready), rounds, time_one)
        for row in case_rows:
            name = row["provider"]
            ms = record_rounds(row, times.get(name))
            if name in timed and progress is not None:  # the rounds a failure skipped
                progress.advance(f"{case.label().strip()} {name}", steps=rounds - timed[name])
            if ms is not None:
                row["tflops"] = round(tflops(ms, case.b, case.h, case.n, case.d,
                                             case.causal, case.mode), 1)
                if case.suite == "small" and name == "flashgen":
                    call, _ = _timed_call(ready[name], q, k, v, case)
                    row["host_us"], row["wall_us"] = host_time_us(call)
                    del call
            rows.append(row)
            log(f"{case.label()} {name:14s} {_cell(row)}")
        del q, k, v, ref, ready
        torch.cuda.empty_cache()
    return rows


def measure_decode(cases, meta, log=print):
    """Rows for the decode suite, from flashgen/bench_decode.py's own measurement."""
    from . import bench_decode as decode

    _raise_recompile_limit()  # bench_decode.py's FlexAttention rows compile one graph per shape

    wanted = set(p for c in cases for p in c.providers)
    by_b = {}
    for c in cases:
        by_b.setdefault(c.b, []).append(c.n)
    package, sha = load_package(None, 128)
    rows = []
    for b, ns in by_b.items():
        for drow in decode.bench(bs=[b], ns=ns, log=log, package=package):
            for name, val in drow.items():
                if name in decode.ROW_META or not _keep([name], wanted):
                    continue
                row = {**meta, "suite": "decode", "mode": "fwd", "d": decode.D,
                       "causal": True, "b": drow["b"], "h": decode.H_Q, "h_kv": decode.H_KV,
                       "n": drow["n"], "p": 0.0, "provider": name,
                       "spec_sha": sha if name.startswith("flashgen") else None}
                if isinstance(val, dict):
                    row.update(status="ok", ms=val["ms"], gbps=val["GB/s"],
                               note=f"gqa: {val['gqa']}" if val.get("gqa") else None)
                    if name == "flashgen_s0":
                        row["host_us"] = drow.get("host_us")
                    elif name == "flashgen_paged_s0":
                        row["host_us"] = drow.get("paged_host_us")
                    if "ms_read_flush" in val:  # the same call, L2 flushed by a read
                        rows.append(dict(row, provider=name + "_rf", ms=val["ms_read_flush"],
                                         gbps=val["GB/s_read_flush"], host_us=None))
                else:
                    row["status"] = str(val)
                rows.append(row)
    return rows


def environment():
    import torch
    import triton
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}


def default_out_dir(gpu: str) -> Path:
    """benchmarks/results/<gpu-slug>/ of the checkout flashgen runs from; from an installed
    wheel, ./flashgen-bench/<gpu-slug>/ under the working directory."""
    results = CHECKOUT_DIR / "benchmarks" / "results"
    base = results if results.parent.is_dir() else Path.cwd() / "flashgen-bench"
    return base / gpu_slug(gpu)


def run(suite="all", ns=None, ds=None, modes=("fwd", "bwd"), providers=None, out=None,
        plot_it=True, log=print, spec=None, progress=True, rounds=1):
    """Measure every case of the suite(s); write JSON/CSV/markdown (and a PNG) under out
    (default: see default_out_dir); print the tables. `spec`: a user's spec, whose package
    is timed as flashgen at its head dims (and only with its masks); `rounds`: see
    measure_attention. Returns (rows, paths)."""
    from .progress import Progress

    causals, package, case_ds = (False, True), None, ds
    if spec is not None:
        causals, package = spec_causals(spec), spec_package(spec)
        case_ds = ds or spec_head_dims(spec)
    cases = plan_cases(suite, ns, case_ds, modes, providers, causals)
    meta = environment()
    log(f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, bf16; "
        f"{len(cases)} cases" + (f", {rounds} interleaved rounds" if rounds > 1 else ""))
    attention = [c for c in cases if c.suite != "decode"]
    bar = Progress(sum(len(c.providers) for c in attention) * rounds, "flashgen bench") if (
        progress and attention) else None
    rows = []
    rows += measure_attention(attention, meta, log, spec=spec, progress=bar, rounds=rounds)
    if bar is not None:
        bar.close()
    decode_cases = [c for c in cases if c.suite == "decode"]
    if decode_cases:
        rows += measure_decode(decode_cases, meta, log)
    out_dir = Path(out) if out else default_out_dir(meta["gpu"])
    name = result_name(suite, ns, ds, modes, providers, package)
    paths = write_results(rows, out_dir, name, meta)
    if plot_it:
        png = plot(rows, out_dir / f"{name}.png")
        if png:
            paths["png"] = Path(png)
    log("")
    log(markdown_tables(rows))
    for kind, path in paths.items():
        log(f"wrote {path}")
    return rows, paths


def spec_causals(spec_path) -> tuple:
    """The causalities a spec's package serves (its `none` and `causal` masks)."""
    from .spec import load_spec
    masks = load_spec(spec_path).masks
    return tuple(c for c, m in ((False, "none"), (True, "causal")) if m in masks)


def spec_head_dims(spec_path) -> list:
    from .spec import load_spec
    return list(load_spec(spec_path).head_dims)


def spec_package(spec_path) -> str:
    from .spec import load_spec
    return load_spec(spec_path).package


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--suite", choices=(*SUITES, "all"), default="training",
                    help="which shapes to measure (default training: the H100 anchor table)")
    ap.add_argument("--spec", metavar="SPEC",
                    help="time the package of this spec as flashgen (training and small "
                    "suites, at its head dims and masks; it needs bf16) instead of the "
                    "example specs' packages")
    ap.add_argument("--n", type=int, nargs="+", metavar="N",
                    help="sequence lengths of the training and dropout suites, KV lengths of "
                    "decode (default: the anchor table's)")
    ap.add_argument("--d", type=int, nargs="+", metavar="D",
                    help="head dims of the training suite (default: 64 and 128, or the "
                    "--spec's head dims)")
    ap.add_argument("--mode", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"],
                    help="fwd and/or bwd (training and dropout suites; default both)")
    ap.add_argument("--providers", nargs="+", metavar="NAME",
                    help=f"only these providers ({', '.join(PROVIDERS)}; default all)")
    ap.add_argument("--out", metavar="DIR",
                    help="where the JSON, CSV, markdown and PNG go (default "
                    "benchmarks/results/<gpu-slug>/ in a checkout, ./flashgen-bench/<gpu-slug>/ "
                    "otherwise)")
    ap.add_argument("--no-plot", dest="plot", action="store_false",
                    help="skip the PNG (written whenever matplotlib is installed)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="time each case's providers R times in alternating order and report "
                    "each one's median round (default 1); use 3-5 when a ratio between "
                    "providers is what you read: the GPU's clock drifts during a run")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the cases and providers without running anything (no GPU needed)")
