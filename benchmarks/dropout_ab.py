"""Dropout's cost: the same kernels at p = 0 and p = 0.1, side by side. On an H100:

    python benchmarks/dropout_ab.py [--d 128 64] [--n 1024 4096] [--out FILE.json]

Causal, bf16, H = 16, B * N = 16k tokens, (B, N, H, d) tensors through flash_attn_func.
d = 128 is specs/bench/dropout_d128.yaml's package (what `flashgen bench --suite dropout`
builds; the shipped specs have no d = 128 dropout variant), d = 64 is specs/gpt2.yaml's;
both are built from this checkout's templates into a temporary folder, with their tuned
configs. Rows, each at p = 0 and p = 0.1 with the same family forced (`use_family`):

  fwd gluon -- the Gluon forward (d = 128 only: d <= 64 has no Gluon dropout forward)
  fwd tl    -- the `tl` forward (what a p = 0.1 call runs by default)
  bwd tl    -- the `tl` backward (dK/dV + dQ; the only backward with dropout)

TFLOP/s (causal FLOPs halved, the backward counted as 2.5 forwards) from CUDA events around
each call, median over three interleaved rounds of p = 0 and p = 0.1 (warm-up calls first,
so compilation is not timed; the first run compiles ~25 kernels), and the ratio
p = 0.1 / p = 0 that issue 14's bar is about (>= 0.85).
"""
import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.bench.providers import load_package  # noqa: E402

SPECS = {128: ROOT / "specs/bench/dropout_d128.yaml", 64: ROOT / "specs/gpt2.yaml"}
H, TOKENS, P = 16, 16384, 0.1
WARMUP, REPS, ROUNDS = 5, 20, 3


def flops(b, n, d, mode):
    f = 4 * b * H * n * n * d / 2
    return 2.5 * f if mode == "bwd" else f


def call(pkg, mode, b, n, d, p):
    """A no-argument callable running one forward, or one backward of a saved forward."""
    q, k, v = (torch.randn(b, n, H, d, device="cuda", dtype=torch.bfloat16,
                           requires_grad=mode == "bwd") for _ in range(3))
    if mode == "fwd":
        return lambda: pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    out = pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    do = torch.randn_like(out)
    # autograd.grad, not backward: no accumulation into .grad inside the timed call
    return lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)


def times_ms(fn, reps):
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def measure(pkg, family, mode, b, n, d):
    """{p: median ms} at p = 0 and P, rounds interleaved so drift hits both alike."""
    pkg._runtime.use_family(family)
    try:
        fns = {p: call(pkg, mode, b, n, d, p) for p in (0.0, P)}
        samples = {p: [] for p in fns}
        for fn in fns.values():
            fn()  # compiles
        torch.cuda.synchronize()
        for _ in range(ROUNDS):
            for p, fn in fns.items():
                for _ in range(WARMUP):
                    fn()
                samples[p] += times_ms(fn, REPS)
        return {p: statistics.median(s) for p, s in samples.items()}
    finally:
        pkg._runtime.use_family("")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[128, 64], choices=sorted(SPECS))
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--cases", nargs="+", default=["fwd-gluon", "fwd-tl", "bwd-tl"],
                    choices=["fwd-gluon", "fwd-tl", "bwd-tl"], help="which rows to run")
    ap.add_argument("--out", help="write the rows as JSON here")
    args = ap.parse_args()
    started = time.perf_counter()
    rows = []
    print("| d | N | B | kernel | p=0 TFLOP/s | p=0.1 TFLOP/s | p=0.1 / p=0 |\n"
          "|---|---|---|---|---|---|---|", flush=True)
    for d in args.d:
        pkg, sha = load_package(SPECS[d])
        gluon_fwd = pkg._registry.GLUON.get(f"fwd_causal_dropout_d{d}_bf16", "absent") is None
        cases = [tuple(c.split("-")) for c in args.cases
                 if c != "fwd-gluon" or gluon_fwd]
        for n in args.n:
            b = TOKENS // n
            for mode, family in cases:
                ms = measure(pkg, family, mode, b, n, d)
                tf = {p: flops(b, n, d, mode) / (t * 1e-3) / 1e12 for p, t in ms.items()}
                ratio = tf[P] / tf[0.0]
                rows.append(dict(d=d, n=n, b=b, h=H, mode=mode, family=family, spec_sha=sha,
                                 ms_p0=ms[0.0], ms_p01=ms[P], tflops_p0=tf[0.0],
                                 tflops_p01=tf[P], ratio=ratio))
                print(f"| {d} | {n} | {b} | {mode} {family} | {tf[0.0]:.1f} | {tf[P]:.1f} | "
                      f"{ratio:.3f} |", flush=True)
    print(f"({time.perf_counter() - started:.0f} s)")
    if args.out:
        import triton
        Path(args.out).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
             "torch": torch.__version__, "dropout_p": P, "causal": True, "dtype": "bf16",
             "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
