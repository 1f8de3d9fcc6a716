"""A/B of the Gluon backward's program order for block-mask variants (issue 16's mods
bars): `_mods.BWD_ORDER_QUANTUM` = 0 (head-major, the order before PROG_ORDER) against
the longest-lists-first orders (classes 1.0 and 0.5 mean costs wide), interleaved in one
process at the mods suite's shape (B=4 H=16 N=4096 d=128 bf16), then FlexAttention's
backward on the same inputs (compiled once, outside the timing).

Each arm's gradients are checked against the head-major arm's (dK and dV do not depend on
the order: each program's work is the same; dQ's fp32 sum is added in another order, so
its last bits may move), and the backward plan is checked to be the Gluon kernel.

    PYTHONPATH=$PWD python benchmarks/bwd_order_ab.py [--cases document prefix_lm window_sinks]
        [--rounds 3] [--no-flex] [--flex-budget-s 150] [--json OUT.json]
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
    ap.add_argument("--flex-budget-s", type=float, default=150.0,
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
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        out = pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)
        do = torch.randn_like(out)
        grads = {}
        for qu in QUANTA:
            pkg._mods.BWD_ORDER_QUANTUM = qu
            for t in (q, k, v):
                t.grad = None
            out.backward(do, retain_graph=True)
            grads[qu] = [t.grad.float().clone() for t in (q, k, v)]
        plans = {p[7] for p in pkg._runtime._backward_plans.values() if p is not None}
        check = {}
        for qu in QUANTA[1:]:
            check[qu] = [round((a - b).abs().max().item(), 5) for a, b in zip(grads[qu], grads[0.0])]
        print(f"{case}: backward plans {plans}; max |grad - head-major grad| (dq, dk, dv): {check}",
              flush=True)
        ms = {qu: [] for qu in QUANTA}
        for r in range(args.rounds):
            for qu in (QUANTA if r % 2 == 0 else QUANTA[::-1]):
                pkg._mods.BWD_ORDER_QUANTUM = qu
                out.backward(do, retain_graph=True)  # the order's table made outside the timing
                ms[qu].append(triton.testing.do_bench(
                    lambda: out.backward(do, retain_graph=True), warmup=25, rep=100,
                    grad_to_none=[q, k, v], return_mode="median"))
        for qu in QUANTA:
            best = min(ms[qu])
            row = dict(case=case, provider=f"flashgen q={qu}", ms=[round(x, 4) for x in ms[qu]],
                       tflops=round(tflops(best, B, H, N, D, causal_count, "bwd"), 1),
                       vs_head_major=round(min(ms[0.0]) / best, 3))
            rows.append(row)
            print(row, flush=True)
        pkg._mods.BWD_ORDER_QUANTUM = 1.0
        del out, grads
        if not args.no_flex and time.time() - t0 < args.flex_budget_s:
            from torch.nn.attention.flex_attention import flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
            score_mod, block_mask = bm.flex_mods(case, kw, B, H, N, "cuda")
            fout = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
            fout.backward(do, retain_graph=True)
            fms = triton.testing.do_bench(lambda: fout.backward(do, retain_graph=True), warmup=25,
                                          rep=100, grad_to_none=[q, k, v], return_mode="median")
            row = dict(case=case, provider="flex", ms=[round(fms, 4)],
                       tflops=round(tflops(fms, B, H, N, D, causal_count, "bwd"), 1))
            for qu in QUANTA:
                row[f"flashgen q={qu} vs flex"] = round(fms / min(ms[qu]), 3)
            rows.append(row)
            print(row, flush=True)
            del fout
        elif not args.no_flex:
            print(f"{case}: flex skipped (run at {time.time() - t0:.0f} s)", flush=True)
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s; spec sha {sha}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
