"""The forward against cuDNN at the training anchors, interleaved: a ratio that survives
the clock drift between two `flashgen bench` runs.

    python benchmarks/fwd_vs_cudnn_interleaved.py [--rounds 8] [--out results.json]

`flashgen bench` measures one provider after another, so its ratios move with the GPU's
clock between the two blocks (cuDNN's own d=128 non-causal 4k read 598 and 630 TFLOP/s in
two runs of one session). Here, for d in (64, 128), causal and not, (B, N) in (8, 2048),
(4, 4096), (1, 16384) with H = 2048 // d (bf16, SDPA layout), each round times the
package's `scaled_dot_product_attention` and SDPA's cuDNN backend back to back (the order
alternating per round) with `triton.testing.do_bench` (L2 flushed, median), and the table
gives the median over rounds, the ratio, and each side's spread over rounds (max - min
over the median). The outputs are compared first (max abs difference). TFLOP/s as in
flashgen bench: 4 B H N^2 d, halved when causal.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ((8, 2048), (4, 4096), (1, 16384))
PACKAGES = {64: "gpt2_attn", 128: "llama_attn"}


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for d in (64, 128):
        pkg = importlib.import_module(f"generated.{PACKAGES[d]}")
        h = 2048 // d
        for causal in (False, True):
            for b, n in SHAPES:
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))

                def ours(q=q, k=k, v=v, causal=causal):
                    return pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)

                def cudnn(q=q, k=k, v=v, causal=causal):
                    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

                diff = (ours().float() - cudnn().float()).abs().max().item()
                ms = {"flashgen": [], "cudnn": []}
                for r in range(args.rounds):
                    order = (("flashgen", ours), ("cudnn", cudnn))
                    for name, fn in (order if r % 2 == 0 else order[::-1]):
                        ms[name].append(triton.testing.do_bench(fn, warmup=10, rep=40,
                                                                return_mode="median"))
                med = {name: statistics.median(t) for name, t in ms.items()}
                row = dict(d=d, causal=causal, B=b, N=n, H=h,
                           flashgen=round(flops / med["flashgen"] / 1e9, 1),
                           cudnn=round(flops / med["cudnn"] / 1e9, 1),
                           ratio=round(med["cudnn"] / med["flashgen"], 3), max_abs_diff=diff,
                           **{f"spread_{name}": round((max(t) - min(t)) / med[name], 3)
                              for name, t in ms.items()})
                rows.append(row)
                print(row, flush=True)
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, torch "
          f"{torch.__version__}; TFLOP/s, median of {args.rounds} interleaved rounds\n")
    print("| d | causal | B x N | flashgen | cuDNN | flashgen / cuDNN | spread flashgen / cuDNN |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['d']} | {r['causal']} | {r['B']} x {r['N']} | {r['flashgen']} | "
              f"{r['cudnn']} | {r['ratio']} | {r['spread_flashgen']} / {r['spread_cudnn']} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
