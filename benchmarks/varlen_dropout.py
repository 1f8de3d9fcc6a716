"""Dropout in packed ragged batches: flash_attn_varlen_func(..., dropout_p=p) on the Gluon
varlen kernels (the default on Hopper, _runtime.VARLEN_GLUON_DROPOUT) against the same call
on the `tl` varlen kernels (the switch off) and the same kernels at p = 0, forward and
backward, interleaved rounds.

    PYTHONPATH=$PWD python benchmarks/varlen_dropout.py [--d 128] [--p 0.1] [--rounds 3]
                                                        [--out results.json]

The workload is flashgen.bench.varlen's (16 documents of 128..4096 tokens, 16k tokens,
H=16, bf16, causal bottom-right per document), the package specs/gpt2.yaml (d=64) or
specs/bench/dropout_d128.yaml (d=128) built into a temporary folder. FLOPs count each
document on its own (bench.varlen.document_flops). Times are do_bench medians (L2
flushed); the backward is that of one saved forward.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen.bench.varlen import cu_seqlens, document_flops, ragged_lengths  # noqa: E402
from flashgen.build import build  # noqa: E402

SPECS = {64: ("gpt2.yaml", "gpt2_attn"), 128: ("bench/dropout_d128.yaml", "bench_dropout_attn")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--d", type=int, default=128, choices=sorted(SPECS))
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    spec, name = SPECS[args.d]
    out = Path(tempfile.mkdtemp(prefix="fg_varlen_drop_"))
    build(ROOT / "specs" / spec, out)
    sys.path.insert(0, str(out))
    pkg = importlib.import_module(name)
    rt = pkg._runtime
    lengths = ragged_lengths(16, 16384, 128, 4096, 0)
    h, d = 16, args.d
    torch.manual_seed(0)
    q, k, v = (torch.randn(16384, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device="cuda")
    n = max(lengths)
    arms = {"gluon_p": (True, args.p), "tl_p": (False, args.p), "gluon_p0": (True, 0.0)}
    rows = {}
    for r in range(args.rounds):
        for arm, (gluon, p) in arms.items():
            rt.VARLEN_GLUON_DROPOUT = gluon
            rt._forward_plans.clear()
            rt._backward_plans.clear()
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

            def fwd():
                return pkg.flash_attn_varlen_func(qg, kg, vg, cu, cu, n, n, dropout_p=p,
                                                  causal=True)
            with torch.no_grad():
                fwd()
                ms_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
            o = fwd()
            do = torch.randn_like(o)
            ms_b = triton.testing.do_bench(lambda: o.backward(do, retain_graph=True), warmup=10,
                                           rep=100, grad_to_none=[qg, kg, vg],
                                           return_mode="median")
            fam_f = [pl[2] == rt._GLUON for pl in rt._forward_plans.values() if pl[0] is not None]
            fam_b = [pl[-1] == rt._GLUON for pl in rt._backward_plans.values() if pl is not None]
            row = rows.setdefault(arm, {"fwd_ms": [], "bwd_ms": [], "gluon_fwd": fam_f,
                                        "gluon_bwd": fam_b})
            row["fwd_ms"].append(round(ms_f, 4))
            row["bwd_ms"].append(round(ms_b, 4))
    rt.VARLEN_GLUON_DROPOUT = True
    for arm, row in rows.items():
        f, b = sorted(row["fwd_ms"])[len(row["fwd_ms"]) // 2], sorted(row["bwd_ms"])[len(row["bwd_ms"]) // 2]
        row["fwd_tflops"] = round(document_flops(lengths, h, d, True, "fwd") / (f * 1e-3) / 1e12, 1)
        row["bwd_tflops"] = round(document_flops(lengths, h, d, True, "bwd") / (b * 1e-3) / 1e12, 1)
        print(json.dumps({"d": d, "p": arms[arm][1], "arm": arm, **row,
                          "gpu": torch.cuda.get_device_name()}), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
