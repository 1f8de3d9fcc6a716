"""The Gluon forward's tile-boundary knobs against the package's own config, on one GPU.

    python benchmarks/gluon_overlap_ab.py [--out results.json] [--rounds 8] [--reps 4]
                                          [--base package|gluon] [--jobs 8]
                                          [--causal both|yes|no] [--knobs LABEL=JSON ...]

For d in (64, 128), causal and not, (B, N) in (8, 2048), (4, 4096), (1, 16384) with
H = 2048 // d (the training anchors: B*N = 16k, H*d = 2048, bf16), it times the forward
as the package launches it (`--base package`: its tuned config for this GPU and bucket;
`--base gluon`: the untuned Gluon default) and the same config with each knob of
families.GLUON_DEFAULT's tile boundary turned on: `q_buffers=2` (a second Q slot per
consumer, so the next tile's Q loads during this one), `overlap` (a tile's stores behind
the next tile's first S = Q K^T), both, and `diag_first` (a tile's key blocks from the
last down: a causal tile starts on its masked diagonal). The packages are the
repository's generated/llama_attn (d=128) and generated/gpt2_attn (d=64).

Every binary is compiled first, in parallel worker processes (Triton's disk cache hands
them to this process), so the timed loop compiles nothing. Then per shape, rounds of
A/B/C/D in one process: each config gets one untimed call (its launch plan) and `--reps`
calls timed one by one with CUDA events; the median over all rounds is reported, so clock
drift hits every config alike. Each knob's output and LSE are compared with the base
config's (max abs difference: q_buffers and overlap move no arithmetic, so expect 0;
diag_first adds the key blocks in another order, so expect bf16 rounding, ~1e-2 at most).
Prints a TFLOP/s table (4 B H N^2 d FLOPs, halved when causal) and writes JSON to --out.
`--knobs` replaces the four knob sets by others, e.g. the persistent grid's deal under a
causal mask: `--causal yes --knobs 'device_deal={"host_deal": false}'
'persistent={"persistent": true}' 'one_per_tile={"persistent": false}'`.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ((8, 2048), (4, 4096), (1, 16384))
CASES = [(d, causal, b, n) for d in (64, 128) for causal in (False, True) for b, n in SHAPES]
KNOBS = {"q_buffers=2": {"q_buffers": 2}, "overlap": {"overlap": True},
         "overlap+q_buffers=2": {"overlap": True, "q_buffers": 2},
         "diag_first": {"diag_first": True}}
# the config keys a Gluon forward binary depends on (the rest are run-time arguments or grid)
BINARY = ("block_n", "num_stages", "pingpong", "regs", "q_buffers", "overlap", "diag_first",
          "persistent", "host_deal", "stream_k")
PACKAGES = {64: "gpt2_attn", 128: "llama_attn"}


def _package(d):
    import importlib

    return importlib.import_module(f"generated.{PACKAGES[d]}")


def _cases(args):
    want = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    return [c for c in CASES if c[1] in want]


def _inputs(d, b, n, seed=0):
    import torch

    h = 2048 // d
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, generator=g)
            for _ in range(3)]


def _name(d, causal):
    return f"fwd{'_causal' if causal else ''}_d{d}_bf16"


def _base(pkg, d, causal, n, which):
    import torch

    rt = pkg._runtime
    if which == "gluon":
        return {**rt.PLANNED[_name(d, causal)], **rt._families.gluon_default(d)}
    return dict(rt.launch_config(_name(d, causal), torch.device("cuda"), n))


def _call(pkg, q, k, v, causal):
    return pkg.flash_attn_func(q, k, v, causal=causal, return_lse=True)


def _configs(pkg, d, causal, n, which):
    base = _base(pkg, d, causal, n, which)
    return {"base": base, **{label: {**base, **change} for label, change in KNOBS.items()}}


def _knob_sets(specs) -> dict:
    """--knobs LABEL=JSON arguments as {label: config changes}."""
    out = {}
    for spec in specs:
        label, _, text = spec.partition("=")
        out[label] = json.loads(text)
    return out


def _compile_one(job):
    """Worker: one call of one (shape, config), so its binary lands in Triton's cache."""
    import torch

    d, causal, b, n, cfg = job
    pkg = _package(d)
    q, k, v = _inputs(d, b, n)
    with pkg._runtime.override_config(**cfg):
        _call(pkg, q, k, v, causal)
    torch.cuda.synchronize()
    return job


def _precompile(args):
    import multiprocessing as mp

    jobs, seen = [], set()
    for d, causal, b, n in _cases(args):
        pkg = _package(d)
        for cfg in _configs(pkg, d, causal, n, args.base).values():
            key = (d, causal) + tuple(cfg.get(k) for k in BINARY)
            if key not in seen:  # one job per binary (the lengths are not specialised on)
                seen.add(key)
                jobs.append((d, causal, b, n, cfg))
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=args.jobs, mp_context=mp.get_context("spawn")) as ex:
        list(ex.map(_compile_one, jobs))
    print(f"compiled {len(jobs)} configs in {time.perf_counter() - t0:.1f} s", flush=True)


def _time_case(pkg, d, causal, b, n, configs, rounds, reps):
    import torch

    rt = pkg._runtime
    q, k, v = _inputs(d, b, n)
    times = {label: [] for label in configs}
    outputs = {}
    for r in range(rounds):
        for label, cfg in configs.items():
            with rt.override_config(**cfg):
                out = _call(pkg, q, k, v, causal)  # the launch plan for this config
                if r == 0:
                    outputs[label] = out
                events = [(torch.cuda.Event(enable_timing=True),
                           torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
                for start, end in events:
                    start.record()
                    _call(pkg, q, k, v, causal)
                    end.record()
                torch.cuda.synchronize()
                times[label] += [s.elapsed_time(e) for s, e in events]
    flops = 4 * b * (2048 // d) * n * n * d / (2 if causal else 1)
    ref_o, ref_lse = outputs["base"]
    row = {"d": d, "causal": causal, "B": b, "N": n, "H": 2048 // d,
           "base_config": configs["base"], "results": {}}
    for label in configs:
        ms = statistics.median(times[label])
        o, lse = outputs[label]
        row["results"][label] = {
            "ms": ms, "tflops": flops / ms / 1e9, "samples": len(times[label]),
            "max_abs_diff_out": (o.float() - ref_o.float()).abs().max().item(),
            "max_abs_diff_lse": (lse - ref_lse).abs().max().item()}
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--reps", type=int, default=4, help="timed calls per config per round")
    ap.add_argument("--base", choices=("package", "gluon"), default="package",
                    help="the config the knobs are turned on over: the package's (tuned) "
                         "launch config, or the untuned Gluon default")
    ap.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1),
                    help="parallel compile workers")
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--knobs", nargs="+", default=None, metavar="LABEL=JSON",
                    help="knob sets to time against the base instead of the four defaults")
    args = ap.parse_args(argv)
    if args.knobs:
        KNOBS.clear()
        KNOBS.update(_knob_sets(args.knobs))

    import torch
    import triton

    t0 = time.perf_counter()
    _precompile(args)
    labels = ["base", *KNOBS]
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, base = {args.base}; "
          f"TFLOP/s (median of {args.rounds} x {args.reps}), knob / base in parentheses\n")
    print("| d | causal | B | N | base config | " + " | ".join(labels)
          + " | max diff (q_buffers, overlap) | max diff (diag_first) |")
    print("|---|---|---|---|---|" + "---|" * len(labels) + "---|---|")
    rows = []
    for d, causal, b, n in _cases(args):
        pkg = _package(d)
        configs = _configs(pkg, d, causal, n, args.base)
        row = _time_case(pkg, d, causal, b, n, configs, args.rounds, args.reps)
        rows.append(row)
        res = row["results"]
        base_tf = res["base"]["tflops"]
        shown = {k: configs["base"].get(k) for k in ("block_n", "num_stages", "pingpong",
                                                     "l2_share", "persistent", "regs")}
        cells = [f"{res['base']['tflops']:.1f}"] + [
            f"{res[l]['tflops']:.1f} ({res[l]['tflops'] / base_tf:.3f})" for l in KNOBS]
        diff = {l: max(r["max_abs_diff_out"], r["max_abs_diff_lse"]) for l, r in res.items()}
        same = max(v for l, v in diff.items() if l != "diag_first")
        print(f"| {d} | {causal} | {b} | {n} | {shown} | " + " | ".join(cells)
              + f" | {same:.3g} | {diff.get('diag_first', float('nan')):.3g} |", flush=True)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "device": torch.cuda.get_device_name(), "triton": triton.__version__,
            "torch": torch.__version__, "base": args.base, "rounds": args.rounds,
            "reps": args.reps, "rows": rows}, indent=1))
    print(f"\n{time.perf_counter() - t0:.1f} s in all", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
