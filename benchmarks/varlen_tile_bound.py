"""How close a packed causal batch can come to the dense kernel's throughput when both
compute whole tiles: the share of computed tile area that is useful (inside each
document's causal triangle), for `flashgen.bench.varlen`'s documents against the dense
(B, N) batch of the same token count, per tile shape. Zero per-tile cost, a perfect
schedule and no masking cost are assumed, so the ratio is an upper bound on varlen /
dense TFLOP/s for kernels that compute a tile whole (issue 17's 0.95x bar).

    python benchmarks/varlen_tile_bound.py [--docs 16 --total 16384 --lo 128 --hi 4096 --seed 0]
"""
import argparse
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from flashgen.bench.varlen import ragged_lengths  # noqa: E402


def useful_share(n: int, bm: int, bn: int) -> float:
    """Useful / computed area of a causal n x n attention in bm x bn tiles (a query block
    computes every key block up to its last row's diagonal)."""
    computed = sum(bm * bn * math.ceil(min(n, i * bm + bm) / bn) for i in range(math.ceil(n / bm)))
    return n * (n + 1) / 2 / computed


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--total", type=int, default=16384)
    ap.add_argument("--lo", type=int, default=128)
    ap.add_argument("--hi", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    docs = ragged_lengths(args.docs, args.total, args.lo, args.hi, args.seed)
    print(f"documents: {sorted(docs, reverse=True)} ({sum(docs)} tokens); dense: "
          f"{args.total // args.hi} x {args.hi}")
    for bm, bn in ((128, 128), (64, 128), (128, 64), (64, 64)):
        useful = sum(n * (n + 1) / 2 for n in docs)
        computed = sum(n * (n + 1) / 2 / useful_share(n, bm, bn) for n in docs)
        dense = useful_share(args.hi, bm, bn)
        print(f"  tiles {bm:3d} x {bn:3d}: varlen useful share {useful / computed:.3f}, dense "
              f"{dense:.3f}, bound on varlen / dense {useful / computed / dense:.3f}")


if __name__ == "__main__":
    main()
