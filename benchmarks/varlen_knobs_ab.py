"""Gluon forward knobs on `flashgen bench --suite varlen`'s packed documents, interleaved.

The varlen forward's tiles are short where its documents are (a 128-token document is one
tile of one key block), so the tile-boundary knobs that paid off for the document mask
(families.KEY_SPAN_FWD_KNOBS: `q_buffers` 2, `block_n` 64) are A/B'd here: each arm is
the llama package's Gluon default with the knobs changed (override_config), in rounds
whose arm order alternates; the dense (B, N) = (total / dense_n, dense_n) forward is timed
beside them. Outputs are compared with the base arm's.

    PYTHONPATH=$PWD python benchmarks/varlen_knobs_ab.py --knobs 'q2={"q_buffers": 2}' \\
        [--rounds 5] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from flashgen.bench import varlen as bv


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--knobs", nargs="*", default=[], metavar="LABEL=JSON")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    c = dict(bv.DEFAULTS)
    arms = {"base": {}}
    for spec in args.knobs:
        label, _, text = spec.partition("=")
        arms[label] = json.loads(text)
    pkg = bv._package(c["d"])
    rt = pkg._runtime
    lengths = bv.ragged_lengths(c["docs"], c["total"], c["min_len"], c["max_len"], args.seed)
    cu = torch.tensor(bv.cu_seqlens(lengths), dtype=torch.int32, device="cuda")
    torch.manual_seed(0)
    h, d, t = c["h"], c["d"], c["total"]
    q, k, v = (torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    b = t // c["dense_n"]
    qd, kd, vd = (x.view(b, c["dense_n"], h, d) for x in (q, k, v))
    mx = max(lengths)

    def varlen():
        return pkg.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)

    def dense():
        return pkg.flash_attn_func(qd, kd, vd, causal=True)

    with torch.no_grad():
        outs = {}
        for a, cfg in arms.items():
            with rt.override_config(family="gluon", **cfg):
                outs[a] = varlen()
        ms = {a: [] for a in list(arms) + ["dense"]}
        for r in range(args.rounds):
            order = list(arms) + ["dense"]
            for a in (order if r % 2 == 0 else order[::-1]):
                if a == "dense":
                    ms[a].append(triton.testing.do_bench(dense, warmup=25, rep=100,
                                                         return_mode="median"))
                    continue
                with rt.override_config(family="gluon", **arms[a]):
                    varlen()
                    ms[a].append(triton.testing.do_bench(varlen, warmup=25, rep=100,
                                                         return_mode="median"))
    fl_var = bv.document_flops(lengths, h, d, True, "fwd")
    fl_dense = bv.document_flops([c["dense_n"]] * b, h, d, True, "fwd")
    dense_tf = fl_dense / (statistics.median(ms["dense"]) * 1e-3) / 1e12
    rows = [dict(arm="dense", knobs={}, ms=[round(x, 4) for x in ms["dense"]],
                 tflops=round(dense_tf, 1))]
    base = statistics.median(ms["base"])
    print(f"documents {lengths}", flush=True)
    for a in arms:
        m = statistics.median(ms[a])
        tf = fl_var / (m * 1e-3) / 1e12
        rows.append(dict(arm=a, knobs=arms[a], ms=[round(x, 4) for x in ms[a]],
                         tflops=round(tf, 1), vs_base=round(base / m, 3),
                         vs_dense=round(tf / dense_tf, 3),
                         max_diff_vs_base=round((outs[a].float() - outs["base"].float())
                                                .abs().max().item(), 5)))
    for r in rows:
        print(r, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(lengths=lengths, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
