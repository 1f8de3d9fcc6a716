"""Compile one kernel of a spec's package offline (no GPU) for an sm_XY target at many
tiles and print one JSON row per tile: the planner's register estimate next to what ptxas
allocated and spilled. How docs/OTHER_GPUS.md's sweeps were measured:

    python benchmarks/offline_sweep.py specs/gpus/rtx4090.yaml --arch 89 \
        --variant bwd_window_dropout_d128_bf16 --function dkdv_kernel \
        --tiles 16x64w4s1 32x64w4s2 > out.jsonl

A decode variant's kernel is compiled in its serving form (offline._launches: paged, split
with the in-launch reduction, LSE stored), with V read on its own, or as K's view with
--v-is-k (a latent cache); the estimates are the decode kind's:

    python benchmarks/offline_sweep.py specs/mla.yaml --arch 90 \
        --variant decode_causal_d576v512_bf16 --v-is-k --tiles 16x32w4s2 32x32w8s2
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen import offline, planner_core  # noqa: E402
from flashgen.build import build_spec  # noqa: E402
from flashgen.spec import load_spec  # noqa: E402
from flashgen.variants import variants_for  # noqa: E402


def est_regs(kind, v, bm, bn, w):
    d = planner_core.padded_head_dim(v.plan_dim)
    if kind == "decode" and hasattr(planner_core, "decode_regs_estimate"):
        return planner_core.decode_regs_estimate(bm, bn, planner_core.padded_head_dim(v.head_dim),
                                                 planner_core.padded_head_dim(v.v_dim), w)
    return planner_core.regs_estimate(kind, bm, bn, d, w)


def est_smem(kind, v, bm, bn, s):
    d = planner_core.padded_head_dim(v.plan_dim)
    if kind == "decode" and hasattr(planner_core, "decode_smem_estimate"):
        return planner_core.decode_smem_estimate(bm, bn, planner_core.padded_head_dim(v.head_dim),
                                                 planner_core.padded_head_dim(v.v_dim),
                                                 v.dtype_bytes, s)
    return planner_core.smem_estimate(kind, bm, bn, d, v.dtype_bytes, s)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--arch", type=int, required=True)
    ap.add_argument("--variant", nargs="+", required=True)
    ap.add_argument("--function", default="kernel", help="kernel, dkdv_kernel or dq_kernel")
    ap.add_argument("--tiles", nargs="+", required=True, help="MxNwWsS, e.g. 32x64w4s2")
    ap.add_argument("--v-is-k", action="store_true", help="decode: V read as K's view (V_IS_K)")
    ap.add_argument("--no-split", action="store_true", help="decode: one split (no reduction)")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    out = Path(tempfile.mkdtemp(prefix="flashgen-sweep-"))
    build_spec(spec, out)
    sys.path.insert(0, str(out))
    variants = {v.name: v for v in variants_for(spec)}
    registry = importlib.import_module(f"{spec.package}._registry")
    for name in args.variant:
        v = variants[name]
        module = importlib.import_module(f"{spec.package}.kernels.{name}")
        fn = getattr(module, f"{name}_{args.function}")
        decode = v.kind == "decode"
        types, flags = offline.mod_arg_types(registry, name)
        for tile in args.tiles:
            bm, bn, w, s = planner_core.parse_tile(tile)
            if decode:
                cfg = dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
                constexprs = offline._launches("decode", cfg, (), dims=(v.head_dim, v.v_dim))[0][1]
                constexprs = dict(constexprs, V_IS_K=args.v_is_k, SPLIT=not args.no_split)
            else:
                constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, USE_TMA=False, **offline._DENSE,
                                  ROW64=False)
            if args.function == "kernel" and not decode:
                constexprs.update(WARP_SPECIALIZE=False, **offline._FWD_DENSE)
            if args.function == "dkdv_kernel":
                constexprs = dict(constexprs, FUSED_DQ=0, **flags)
            try:
                shared, regs, stores, loads = offline.compile_kernel(fn, v.dtype, constexprs, w, s,
                                                                     args.arch, types, decode)
                err = None
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at compile time
                shared = regs = stores = loads = -1
                err = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            kind = "decode" if decode else "bwd" if args.function != "kernel" else "fwd"
            d = planner_core.padded_head_dim(v.plan_dim)
            row = dict(cap=args.arch, variant=name, function=args.function, tile=tile,
                       shared=shared, regs=regs, spill=stores, est=est_regs(kind, v, bm, bn, w),
                       est_smem=est_smem(kind, v, bm, bn, s), error=err)
            if decode:
                row["v_is_k"] = args.v_is_k
            print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
