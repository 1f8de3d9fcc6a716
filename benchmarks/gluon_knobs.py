"""One Gluon knob at a time against the package's own choice, interleaved, on the GPU.

    python benchmarks/gluon_knobs.py [--rounds 3]

For the training anchor shapes (B*N = 16k, H*d = 2048, bf16) of the example packages, times
the forward as the package launches it (tuned config) and with one Gluon knob changed
(`override_config(family="gluon", ...)` on top of the same tuned values), alternating the
two within each round so clock drift hits both alike. TFLOP/s, median over rounds.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CASES = [(128, True, 2048), (128, True, 16384), (128, False, 4096), (64, True, 2048),
         (64, False, 16384)]
VARIANTS = {"persistent=False": {"persistent": False}, "regs=232/40": {"regs": "232/40"},
            "regs=224/56": {"regs": "224/56"}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args(argv)

    import torch
    import triton

    from flashgen.bench.providers import load_package

    print("| d | causal | N | package's config | TFLOP/s | " + " | ".join(VARIANTS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(VARIANTS))
    for d, causal, n in CASES:
        pkg, _ = load_package(None, d)
        rt = pkg._runtime
        h, b = 2048 // d, 16384 // n
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * h * n * n * d / (2 if causal else 1)
        name = f"fwd{'_causal' if causal else ''}_d{d}_bf16"
        base = dict(rt.launch_config(name, q.device, n))

        def run(cfg):
            with rt.override_config(**cfg):
                return triton.testing.do_bench(
                    lambda: pkg.scaled_dot_product_attention(q, k, v, is_causal=causal),
                    warmup=25, rep=100, return_mode="median")

        times = {"base": []}
        for _ in range(args.rounds):
            times["base"].append(run(base))
            for label, change in VARIANTS.items():
                times.setdefault(label, []).append(run({**base, **change}))
        tf = {k_: flops / statistics.median(v_) / 1e9 for k_, v_ in times.items()}
        shown = {k_: v_ for k_, v_ in base.items() if k_ in ("family", "block_n", "num_stages",
                                                              "pingpong", "l2_share")}
        print(f"| {d} | {causal} | {n} | {shown} | {tf['base']:.1f} | "
              + " | ".join(f"{tf[k_]:.1f}" for k_ in VARIANTS) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
