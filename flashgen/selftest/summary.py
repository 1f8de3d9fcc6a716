"""The selftest summary: one record of a run, as JSON (selftest.json) and text (stdout and
selftest.txt). It says what was tested (commit and whether the tree was dirty, flashgen,
torch, triton, Python, the GPUs, driver and CUDA), what ran and how long, and every failure
with a command that reproduces it: enough to fill docs/TESTING.md's "Last green" table
and to act on a red run without its logs.
"""
from __future__ import annotations

import dataclasses
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from .. import __version__

SCHEMA = 1
TEXT_MESSAGES = 10          # failures a shard shows with their message in the text
TEXT_MESSAGE_LINES = 8      # the last lines of each (selftest.json keeps 15)
# the environment variables that change what the suite runs (recorded with the run)
_ENV_PREFIXES = ("FLASHGEN_", "TRITON_", "CUDA_VISIBLE_DEVICES", "PYTORCH_")
_INTERNAL_ENV = ("FLASHGEN_SELFTEST_GPUS", "FLASHGEN_SELFTEST_PROGRESS")


def _run(argv: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def checkout(root: Path | None) -> dict | None:
    """The commit of the checkout the tests came from, and whether its tracked files or
    new unignored files differ from it. FLASHGEN_SELFTEST_COMMIT names the commit instead,
    for a tree copied to the GPU machine without its current `.git` (its HEAD is stale)."""
    told = os.environ.get("FLASHGEN_SELFTEST_COMMIT")
    if told:
        return {"root": str(root), "commit": f"{told} (FLASHGEN_SELFTEST_COMMIT)",
                "dirty": None, "branch": None}
    if root is None or shutil.which("git") is None:
        return None
    commit = _run(["git", "rev-parse", "HEAD"], cwd=root)
    if commit is None:
        return {"root": str(root), "commit": None, "dirty": None, "branch": None}
    status = _run(["git", "status", "--porcelain"], cwd=root)
    return {"root": str(root), "commit": commit,
            "dirty": None if status is None else bool(status),
            "branch": _run(["git", "rev-parse", "--abbrev-ref", "HEAD"], cwd=root)}


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def gpus() -> list[dict]:
    import torch

    if not torch.cuda.is_available():
        return []
    found = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        found.append({"index": i, "name": torch.cuda.get_device_name(i),
                      "capability": f"{props.major}.{props.minor}",
                      "memory_gib": round(props.total_memory / 2**30, 1)})
    return found


def driver() -> dict:
    """The driver and the CUDA version it supports, from nvidia-smi's header."""
    text = _run(["nvidia-smi"]) if shutil.which("nvidia-smi") else None
    found = {"driver": None, "driver_cuda": None}
    if text:
        m = re.search(r"Driver Version:\s*([\d.]+)", text)
        found["driver"] = m.group(1) if m else None
        m = re.search(r"CUDA Version:\s*([\d.]+)", text)
        found["driver_cuda"] = m.group(1) if m else None
    return found


def environment(root: Path | None, argv: list[str] | None = None) -> dict:
    import torch

    import flashgen

    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "argv": argv,
        "checkout": checkout(root),
        "flashgen": __version__,
        "flashgen_path": str(Path(flashgen.__file__).resolve().parent),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": getattr(torch, "__version__", None),
        "torch_cuda": torch.version.cuda,
        "triton": _version("triton"),
        "gpus": gpus(),
        **driver(),
        "env": {k: v for k, v in sorted(os.environ.items())
                if k.startswith(_ENV_PREFIXES) and k not in _INTERNAL_ENV},
    }


# ---------------------------------------------------------------------------------------
# the record
# ---------------------------------------------------------------------------------------

def _failure(item) -> tuple:
    """(case, message, reproducer) from a FuzzReport failure: a tuple or a record."""
    if hasattr(item, "reproducer"):
        return item.case, item.message, item.reproducer
    case, message, reproducer = item
    return case, message, reproducer


def fuzz_record(report, device: str, seed: int, workers: int, n: int) -> dict:
    """fuzz.FuzzReport as plain data (its cases as their JSON)."""
    def case_json(case):
        to_json = getattr(case, "to_json", None)
        return to_json() if callable(to_json) else str(case)

    failed = []
    for item in report.failed:
        case, message, reproducer = _failure(item)
        failed.append({"case": case_json(case), "message": str(message),
                       "reproducer": reproducer})
    ran = getattr(report, "cases", None)
    if ran is None:
        ran = getattr(report, "cases_run", None)
    if isinstance(ran, (list, tuple)):
        ran = len(ran)
    rec = {"status": "failed" if failed else "ok", "device": device, "seed": seed,
           "workers": workers, "requested": n, "cases": ran, "passed": report.passed,
           "failed": failed,
           "skipped": [{"case": case_json(c), "reason": str(r)} for c, r in report.skipped],
           "seconds": round(float(report.seconds), 1)}
    coverage = getattr(report, "coverage", None)    # cases per kind, where the report has it
    if callable(coverage):
        rec["kinds"] = coverage()
    notes = getattr(report, "notes", None)          # cases run other than asked, by reason
    if isinstance(notes, dict) and notes:
        rec["notes"] = notes
    return rec


def build(env: dict, parts=None, unassigned=(), sanitize=None, fuzz=None) -> dict:
    parts = list(parts or [])
    totals = {k: sum(getattr(p, k) for p in parts)
              for k in ("passed", "failed", "errors", "skipped")}
    totals["seconds"] = round(sum(p.seconds for p in parts), 1)
    problems = []   # one line per thing that makes the run fail
    for p in parts:
        if p.bad:
            problems.append(f"shard {p.shard} ({p.part}): {p.status}"
                            + (f" ({p.note})" if p.note else ""))
    for s in sanitize or []:
        if s.bad:
            problems.append(f"compute-sanitizer {s.tool}: {s.status}"
                            + (f" ({s.note})" if s.note else ""))
    if fuzz is not None and fuzz["status"] != "ok":
        problems.append(f"fuzz: {len(fuzz['failed'])} failed" if fuzz.get("failed") else
                        f"fuzz: {fuzz['status']}: {fuzz.get('error', '')}".rstrip(": "))
    return {
        "flashgen_selftest": SCHEMA,
        **env,
        "shards": [dataclasses.asdict(p) for p in parts] if parts else None,
        "shard_totals": totals if parts else None,
        "unassigned_gpu_test_files": list(unassigned),
        "sanitize": [dataclasses.asdict(s) for s in sanitize] if sanitize is not None else None,
        "fuzz": fuzz,
        "problems": problems,
        "exit_status": 1 if problems else 0,
    }


# ---------------------------------------------------------------------------------------
# text
# ---------------------------------------------------------------------------------------

def _count(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _indent(text: str, pad: str = "      ") -> str:
    return "\n".join(pad + ln for ln in text.splitlines())


def format_text(rec: dict) -> str:
    out = []
    co = rec.get("checkout")
    out.append(f"flashgen selftest  {rec['date']}")
    if co:
        dirty = {True: " (dirty: uncommitted changes)", False: "", None: ""}[co.get("dirty")]
        out.append(f"commit    {co.get('commit') or '(not a git checkout)'}{dirty}  "
                   f"{co['root']}")
    else:
        out.append(f"commit    (no checkout: flashgen at {rec['flashgen_path']})")
    out.append(f"versions  flashgen {rec['flashgen']}  python {rec['python']}  torch "
               f"{rec['torch']} (CUDA {rec['torch_cuda']})  triton {rec['triton']}")
    gpus = rec.get("gpus") or []
    if gpus:
        names = {}
        for g in gpus:
            names[(g["name"], g["capability"])] = names.get((g["name"], g["capability"]), 0) + 1
        desc = ", ".join(f"{n} x {name} (sm{cap.replace('.', '')})"
                         for (name, cap), n in names.items())
        out.append(f"GPUs      {desc}  driver {rec.get('driver')}  (CUDA {rec.get('driver_cuda')})")
    else:
        out.append("GPUs      none (CUDA not available)")
    if rec.get("env"):
        out.append("env       " + " ".join(f"{k}={v}" for k, v in rec["env"].items()))

    shards = rec.get("shards")
    if shards:
        out.append("")
        out.append(f"{'shard':<14} {'part':<8} {'workers':>7} {'passed':>7} {'failed':>7} "
                   f"{'errors':>7} {'skipped':>8} {'seconds':>8}  status")
        for p in shards:
            nums = (f"{p['passed']:>7} {p['failed']:>7} {p['errors']:>7} {p['skipped']:>8} "
                    f"{p['seconds']:>8.1f}" if p["status"] not in ("skipped", "not run")
                    else f"{'-':>7} {'-':>7} {'-':>7} {'-':>8} {'-':>8}")
            status = p["status"] + (f": {p['note']}" if p["note"] else "")
            out.append(f"{p['shard']:<14} {p['part']:<8} {p['workers'] or '-':>7} {nums}  "
                       f"{status}")
        t = rec["shard_totals"]
        out.append(f"{'total':<14} {'':<8} {'':>7} {t['passed']:>7} {t['failed']:>7} "
                   f"{t['errors']:>7} {t['skipped']:>8} {t['seconds']:>8.1f}")
        failures = [(p, f) for p in shards for f in p["failures"]]
        if failures:
            root = (co or {}).get("root", ".")
            out.append("")
            out.append(f"failures ({len(failures)}; reproduce from {root}):")
            shown = {}
            for p, f in failures:
                # a shard that fails wholesale (a broken fixture, no GPU) shows its first
                # few messages; the rest are reproducer lines (selftest.json has them all)
                n = shown[p["shard"]] = shown.get(p["shard"], 0) + 1
                out.append(f"  [{p['shard']}] {f['nodeid'] or '(the shard)'}")
                out.append(f"    {f['reproducer']}")
                if f["message"] and n <= TEXT_MESSAGES:
                    tail = f["message"].splitlines()[-TEXT_MESSAGE_LINES:]
                    out.append(_indent("\n".join(tail)))
    if rec.get("unassigned_gpu_test_files"):
        out.append("")
        out.append("warning: GPU test files in no shard (run as shard 'unassigned'; give them "
                   "a shard in flashgen/selftest/shards.py): "
                   + ", ".join(rec["unassigned_gpu_test_files"]))

    if rec.get("sanitize") is not None:
        out.append("")
        out.append("compute-sanitizer:")
        for s in rec["sanitize"]:
            counts = "" if s["errors"] is None else _count(s["errors"], "error") + (
                "" if s["warnings"] is None else ", " + _count(s["warnings"], "warning"))
            out.append(f"  {s['tool']:<10} {s['status']:<12} {counts:<22} {s['seconds']:>6.0f} s"
                       + (f"  {s['note']}" if s["note"] else ""))
            if s["status"] != "ok" or s["warnings"]:
                if s["report"]:
                    out.append(_indent("\n".join(s["report"])))
                if s["app_tail"] and s["status"] != "unsupported":
                    out.append("      the cases' last lines:")
                    out.append(_indent(s["app_tail"], "        "))
                if s["log"]:
                    out.append(f"      log: {s['log']}")
                out.append(f"      command: {s['command']}")

    fz = rec.get("fuzz")
    if fz is not None:
        out.append("")
        if "error" in fz:
            out.append(f"fuzz: error: {fz['error']}")
        else:
            first = (f", cases {fz['start']}..{fz['start'] + fz['cases'] - 1}"
                     if fz.get("start") and isinstance(fz.get("cases"), int) else "")
            out.append(f"fuzz: {fz['cases']} cases on {fz['device']} (seed {fz['seed']}{first}, "
                       f"{_count(fz['workers'], 'worker')}): {fz['passed']} passed, "
                       f"{len(fz['failed'])} failed, {len(fz['skipped'])} skipped in "
                       f"{fz['seconds']:.0f} s")
            if fz.get("kinds"):
                kinds = sorted(fz["kinds"].items())
                out.append("  kinds: " + ", ".join(f"{k} {v}" for k, v in kinds))
            for note, count in sorted((fz.get("notes") or {}).items()):
                out.append(f"  note: {count} x {note}")
            for f in fz["failed"]:
                out.append(f"  {f['reproducer']}")
                out.append(_indent(f["message"], "    "))
            if fz["skipped"]:
                reasons = {}
                for s in fz["skipped"]:
                    reasons[s["reason"]] = reasons.get(s["reason"], 0) + 1
                for reason, n in reasons.items():
                    out.append(f"  skipped {n}: {reason}")

    out.append("")
    if rec["problems"]:
        out.append(f"FAILED ({len(rec['problems'])}):")
        out += [f"  {p}" for p in rec["problems"]]
    else:
        out.append("OK: everything ran and passed")
    return "\n".join(out) + "\n"


def write(folder: Path, rec: dict, text: str) -> tuple[Path, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    js, txt = folder / "selftest.json", folder / "selftest.txt"
    js.write_text(json.dumps(rec, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    txt.write_text(text, encoding="utf-8")
    return js, txt
