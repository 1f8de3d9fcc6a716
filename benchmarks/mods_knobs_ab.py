"""Gluon knobs on the mods bench's masks, interleaved, with Flex.

Each arm is the package's Gluon default for the case with some config keys changed
(`override_config(family="gluon", **knobs)`), timed in rounds whose arm order alternates,
so a clock drift hits every arm alike; Flex (compiled once, outside the timing) runs on the
same inputs last. Outputs (forward) and dQ/dK/dV (backward) are compared with the base
arm's. `--docs K` replaces the bench's ragged documents with K equal documents a sequence
(K=1 is plain causal through the block-mask path): how the distance to Flex moves with the
documents' length tells per-tile costs from per-block ones. Case `causal` is the plain
causal variant (no mods), Flex with a causal block mask.

    PYTHONPATH=$PWD python benchmarks/mods_knobs_ab.py --kind fwd --cases document \\
        --knobs 'q2={"q_buffers": 2}' 'ovl={"overlap": true}' [--docs 1 4 16] [--rounds 3]
        [--json OUT.json]

The block-mask backward's persistent form (the runtime's GLUON_BWD_PERSISTENT_MASKS, on by
default) is a knob like any other; the per-key-block form is its arm (a barrier-phase bug in
a template change would hang: run such arms under timeout):

    PYTHONPATH=$PWD timeout 900 python benchmarks/mods_knobs_ab.py --kind bwd --d 128 \\
        --cases document prefix_lm window_sinks --knobs 'per_block={"persistent_bwd": false}'
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


def _equal_docs(b, n, k, device):
    row = (torch.arange(n) * k // n).to(torch.int32)
    return {"doc": row.expand(b, n).contiguous().to(device)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kind", choices=("fwd", "bwd"), default="fwd")
    ap.add_argument("--cases", nargs="+", default=["document"])
    ap.add_argument("--docs", nargs="*", type=int, default=[],
                    help="document case only: K equal documents a sequence (0: the bench's)")
    ap.add_argument("--knobs", nargs="*", default=[], metavar="LABEL=JSON")
    ap.add_argument("--b", type=int, default=4)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    B, H, N, D = args.b, args.h, args.n, args.d
    arms = {"base": {}}
    for spec in args.knobs:
        label, _, text = spec.partition("=")
        arms[label] = json.loads(text)
    t0 = time.time()
    pkg, sha = load_package(bundled_spec(bm.MODS_SPEC))
    rt = pkg._runtime
    rows = []
    jobs = []
    for case in args.cases:
        if case == "document" and args.docs:
            jobs += [(case, k) for k in args.docs]
        else:
            jobs.append((case, 0))
    for case, ndocs in jobs:
        if case == "causal":
            band, mods, causal_count, kw = True, (), True, {}
        else:
            band, mods, causal_count = bm.MOD_CASES[case]
            kw = _equal_docs(B, N, ndocs, "cuda") if ndocs else bm.inputs(case, B, H, N, "cuda")
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=args.kind == "bwd") for _ in range(3))
        do = torch.randn_like(q)
        label = f"{case}" + (f" docs={ndocs}" if ndocs else "")

        def fwd():
            if not mods:
                return pkg.scaled_dot_product_attention(q, k, v, is_causal=band)
            return pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)

        results, ms = {}, {a: [] for a in arms}
        if args.kind == "fwd":
            with torch.no_grad():
                for a, cfg in arms.items():
                    with rt.override_config(family="gluon", **cfg):
                        results[a] = [fwd()]
                for r in range(args.rounds):
                    for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                        with rt.override_config(family="gluon", **arms[a]):
                            fwd()
                            ms[a].append(triton.testing.do_bench(fwd, warmup=25, rep=100,
                                                                 return_mode="median"))
        else:
            out = fwd()
            for a, cfg in arms.items():
                with rt.override_config(family="gluon", **cfg):
                    results[a] = list(torch.autograd.grad(out, (q, k, v), do, retain_graph=True))
            for r in range(args.rounds):
                for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
                    with rt.override_config(family="gluon", **arms[a]):
                        out.backward(do, retain_graph=True)
                        ms[a].append(triton.testing.do_bench(
                            lambda: out.backward(do, retain_graph=True), warmup=25, rep=100,
                            grad_to_none=[q, k, v], return_mode="median"))
        diff = {a: [round((x.float() - y.float()).abs().max().item(), 5)
                    for x, y in zip(results[a], results["base"])] for a in arms}
        fms = None
        if not args.no_flex:
            from torch.nn.attention.flex_attention import create_block_mask, flex_attention
            flex = torch.compile(flex_attention, dynamic=False)
            if case == "causal":
                score_mod = None
                block_mask = create_block_mask(lambda b_, h_, qi, ki: qi >= ki, B=None, H=None,
                                               Q_LEN=N, KV_LEN=N, device="cuda")
            elif ndocs:
                doc = kw["doc"]
                block_mask = create_block_mask(
                    lambda b_, h_, qi, ki: (doc[b_, qi] == doc[b_, ki]) & (qi >= ki),
                    B=B, H=None, Q_LEN=N, KV_LEN=N, device="cuda")
                score_mod = None
            else:
                score_mod, block_mask = bm.flex_mods(case, kw, B, H, N, "cuda")
            if args.kind == "fwd":
                with torch.no_grad():
                    flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
                    fms = triton.testing.do_bench(
                        lambda: flex(q, k, v, score_mod=score_mod, block_mask=block_mask),
                        warmup=25, rep=100, return_mode="median")
            else:
                fout = flex(q, k, v, score_mod=score_mod, block_mask=block_mask)
                fout.backward(do, retain_graph=True)
                fms = triton.testing.do_bench(lambda: fout.backward(do, retain_graph=True),
                                              warmup=25, rep=100, grad_to_none=[q, k, v],
                                              return_mode="median")
                del fout
        base = min(ms["base"])
        for a in arms:
            best = min(ms[a])
            row = dict(case=label, kind=args.kind, arm=a, knobs=arms[a],
                       ms=[round(x, 4) for x in ms[a]],
                       tflops=round(tflops(best, B, H, N, D, causal_count, args.kind), 1),
                       vs_base=round(base / best, 3), max_diff_vs_base=diff[a])
            if fms is not None:
                row["vs_flex"] = round(fms / best, 3)
            rows.append(row)
            print(row, flush=True)
        if fms is not None:
            row = dict(case=label, kind=args.kind, arm="flex", ms=[round(fms, 4)],
                       tflops=round(tflops(fms, B, H, N, D, causal_count, args.kind), 1))
            rows.append(row)
            print(row, flush=True)
        torch.cuda.empty_cache()
    print(f"total {time.time() - t0:.0f} s; spec sha {sha}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
