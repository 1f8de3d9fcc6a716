"""A/B of the persistent Gluon forward's tile deal for block-mask variants (issue 16's mods
bars): `_mods.FWD_ORDER_QUANTUM` = 0 (the kernel's own LONGEST_FIRST deal, the order
before _mods._tile_table, through the same table) against the block lists' deal (classes
1.0 and 0.5 mean costs wide), interleaved in one process at the mods suite's shape
(B=4 H=16 N=4096 d=128 bf16), then FlexAttention's forward on the same inputs (compiled
once, outside the timing). benchmarks/fwd_order_model.py predicts the gain.

Each arm's output and LSE are checked to be bit-identical to the kernel-deal arm's (a
tile's work does not depend on which program runs it), and the forward plan is checked
to be the Gluon kernel walking a table (TILE_TABLE).

    PYTHONPATH=$PWD python benchmarks/fwd_order_ab.py [--cases document prefix_lm window_sinks]
        [--rounds 3] [--no-flex] [--flex-budget-s 120] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import triton

from flashgen.bench import mods as bm
from flashgen.bench.providers import load_package
from flashgen.bench.suites import tflops
from flashgen.resources import bundled_spec

B, H, N, D = 4, 16, 4096, 128
QUANTA = (0.0, 1.0, 0.5)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", nargs="+", default=["document", "prefix_lm", "window_sinks"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--flex-budget-s", type=float, default=120.0,
                    help="skip the flex rows once the run has taken this long")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    t0 = time.time()
    pkg, sha = load_package(bundled_spec(bm.MODS_SPEC))
    torch.manual_seed(0)
    rows = []
    for case in args.cases:
        band, mods, causal_count = bm.MOD_CASES[case]
        kw = bm.inputs(case, B, H, N, "cuda")
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))

        def run():
            return pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)

        outs = {}
        with torch.no_grad():
            for qu in QUANTA:
                pkg._mods.FWD_ORDER_QUANTUM = qu
                outs[qu] = run()
            plans = {(type(p[0].fn).__name__, p[0].meta.get("TILE_TABLE"))
                     for p in pkg._runtime._forward_plans.values() if p[0] is not None}
            same = {qu: bool(torch.equal(outs[qu], outs[0.0])) for qu in QUANTA[1:]}
            print(f"{case}: forward plans (kernel, TILE_TABLE) {plans}; output identical to "
                  f"the kernel deal's: {same}", flush=True)
            ms = {qu: [] for qu in QUANTA}
            for r in range(args.rounds):
                for qu in (QUANTA if r % 2 == 0 else QUANTA[::-1]):
                    pkg._mods.FWD_ORDER_QUANTUM = qu
                    run()  # the deal's table made outside the timing
                    ms[qu].append(triton.testing.do_bench(run, warmup=25, rep=100,
                                                          return_mode="median"))
        for qu in QUANTA:
            best = min(ms[qu])
            row = dict(case=case, provider=f"flashgen q={qu}", ms=[round(x, 4) for x in ms[qu]],
                       tflops=round(tflops(best, B, H, N, D, causal_count, "fwd"), 1),
                       vs_kernel_deal=round(min(ms[0.0]) / best, 3))
            rows.append(row)
            print(row, flush=True)
        pkg._mods.FWD_ORDER_QUANTUM = 1.0
        del outs
        if not args.no_flex and time.time() - t0 < args.flex_budget_s:
            from torch.nn.attention.flex_attention import flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
            score_mod, block_mask = bm.flex_mods(case, kw, B, H, N, "cuda")
            with torch.no_grad():
                flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
                fms = triton.testing.do_bench(
                    lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
                    warmup=25, rep=100, return_mode="median")
            row = dict(case=case, provider="flex", ms=[round(fms, 4)],
                       tflops=round(tflops(fms, B, H, N, D, causal_count, "fwd"), 1))
            for qu in QUANTA:
                row[f"flashgen q={qu} vs flex"] = round(fms / min(ms[qu]), 3)
            rows.append(row)
            print(row, flush=True)
        elif not args.no_flex:
            print(f"{case}: flex skipped (run at {time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s; spec sha {sha}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
