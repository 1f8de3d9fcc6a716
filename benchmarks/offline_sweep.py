"""Compile one kernel of a spec's package offline (no GPU) for an sm_XY target at many
tiles and print one JSON row per tile: the planner's register estimate next to what ptxas
allocated and spilled. How docs/OTHER_GPUS.md's sweeps were measured:

    python benchmarks/offline_sweep.py specs/gpus/rtx4090.yaml --arch 89 \
        --variant bwd_window_dropout_d128_bf16 --function dkdv_kernel \
        --tiles 16x64w4s1 32x64w4s2 > out.jsonl
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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("--arch", type=int, required=True)
    ap.add_argument("--variant", nargs="+", required=True)
    ap.add_argument("--function", default="kernel", help="kernel, dkdv_kernel or dq_kernel")
    ap.add_argument("--tiles", nargs="+", required=True, help="MxNwWsS, e.g. 32x64w4s2")
    args = ap.parse_args(argv)
    spec = load_spec(args.spec)
    out = Path(tempfile.mkdtemp(prefix="flashgen-sweep-"))
    build_spec(spec, out)
    sys.path.insert(0, str(out))
    variants = {v.name: v for v in variants_for(spec)}
    for name in args.variant:
        v = variants[name]
        module = importlib.import_module(f"{spec.package}.kernels.{name}")
        fn = getattr(module, f"{name}_{args.function}")
        for tile in args.tiles:
            bm, bn, w, s = planner_core.parse_tile(tile)
            constexprs = dict(BLOCK_M=bm, BLOCK_N=bn, USE_TMA=False, **offline._DENSE,
                              ROW64=False)
            if args.function == "kernel":
                constexprs["WARP_SPECIALIZE"] = False
            if args.function == "dkdv_kernel":
                constexprs["FUSED_DQ"] = 0
            try:
                shared, regs, stores, loads = offline.compile_kernel(fn, v.dtype, constexprs, w, s,
                                                                     args.arch)
                err = None
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory at compile time
                shared = regs = stores = loads = -1
                err = str(e).splitlines()[0][:200] if str(e) else type(e).__name__
            kind = "bwd" if args.function != "kernel" else "fwd"
            d = planner_core.padded_head_dim(v.head_dim)
            est = planner_core.regs_estimate(kind, bm, bn, d, w)
            print(json.dumps(dict(cap=args.arch, variant=name, function=args.function, tile=tile,
                                  shared=shared, regs=regs, spill=stores, est=est, error=err)),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
