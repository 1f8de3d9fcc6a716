"""Time every launch config of one kernel kind by brute force (a quick look before the
Optuna tuner exists; `flashgen tune` replaces it). On the GPU:

    python benchmarks/sweep.py --mode bwd --d 64 --n 4096
"""
import argparse
import importlib
import itertools
import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
PACKAGES = {64: "generated.gpt2_attn", 128: "generated.llama_attn"}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="bwd", choices=["fwd", "bwd"])
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--block-m", type=int, nargs="*", default=[16, 32, 64, 128])
    ap.add_argument("--block-n", type=int, nargs="*", default=[32, 64, 128])
    ap.add_argument("--warps", type=int, nargs="*", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="*", default=[2, 3, 4])
    ap.add_argument("--tile", action="append", default=[],
                    help="explicit tile m,n,w,s (repeatable; replaces the product above)")
    ap.add_argument("--dq", action="append", default=[],
                    help="bwd: the dq_tile knob, e.g. 128x64w8s3 or mirror (repeatable)")
    ap.add_argument("--fused", nargs="*", default=[],
                    help="bwd: fused_dq knob values to try (0, 1, loop, ptx, unordered, ptx_t, "
                         "unordered_t)")
    ap.add_argument("--tma", type=int, nargs="*", default=[],
                    help="fwd: tma knob values to try (0, 1)")
    ap.add_argument("--ws", type=int, nargs="*", default=[],
                    help="fwd: warp_specialize knob values to try (0, 1)")
    ap.add_argument("--causal", choices=["both", "yes", "no"], default="both")
    ap.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    ap.add_argument("--out")
    args = ap.parse_args()
    pkg = importlib.import_module(PACKAGES[args.d])
    h, b = 2048 // args.d, max(16384 // args.n, 1)
    rows = []
    tiles = ([tuple(int(x) for x in t.split(",")) for t in args.tile] or
             list(itertools.product(args.block_m, args.block_n, args.warps, args.stages)))
    dqs = [dict(dq_tile=t) for t in args.dq] or [{}]
    if args.tma:
        dqs = [dict(dq, tma=bool(t)) for dq in dqs for t in args.tma]
    if args.ws:
        dqs = [dict(dq, warp_specialize=bool(w)) for dq in dqs for w in args.ws]
    if args.fused:
        knob = {"0": False, "1": True}
        dqs = [dict(dq, fused_dq=knob.get(f, f)) for dq in dqs for f in args.fused]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    for causal in causals:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        q, k, v = (torch.randn(b, h, args.n, args.d, device="cuda", dtype=dtype,
                               requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        flops = 4 * b * h * args.n * args.n * args.d * (0.5 if causal else 1) * (2.5 if args.mode == "bwd" else 1)
        ref = None
        for (bm, bn, w, s), dq in itertools.product(tiles, dqs):
            cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s, **dq)
            try:
                # a backward config applies to the backward only (the forward runs on the
                # package's own config, as in the tuner's measure)
                out = None if args.mode == "fwd" else pkg.scaled_dot_product_attention(
                    q, k, v, is_causal=causal)
                with pkg._runtime.override_config(**cfg):
                    if out is None:
                        out = pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)
                    if args.mode == "fwd":
                        fn = lambda: pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                        result = out
                    else:
                        q.grad = None
                        out.backward(do, retain_graph=True)
                        result = q.grad.clone()
                        q.grad = None  # a second run: are the gradients bitwise the same?
                        out.backward(do, retain_graph=True)
                        repeat = torch.equal(q.grad, result)
                        fn = lambda: out.backward(do, retain_graph=True)  # noqa: E731
                    if ref is None:
                        ref = result
                    err = (result.float() - ref.float()).abs().max().item()
                    ms = triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median")
                row = dict(causal=causal, **cfg, tflops=round(flops / ms / 1e9, 1), err=err)
                if args.mode == "bwd":
                    row["bitwise_repeat"] = repeat
            except Exception as e:
                row = dict(causal=causal, **cfg, tflops=0.0, err=f"{type(e).__name__}")
            rows.append(row)
        best = sorted((r for r in rows if r["causal"] == causal), key=lambda r: -r["tflops"])[:8]
        print(f"== {args.mode} d={args.d} N={args.n} causal={causal}: best configs")
        for r in best:
            print(json.dumps(r))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
