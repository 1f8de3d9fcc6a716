"""The chunked-prefill benchmark (issue 49's bar): new tokens over a paged KV cache.

    python -m flashgen.bench.prefill [--dry-run] [--providers ...] [--seqs 32] [--chunk 512]
                                     [--max-context 16384] [--pages 16 64] [--d 128]
                                     [--h 32] [--h-kv 8] [--seed 0] [--rounds 1]
                                     [--out results.json]

The workload: `--seqs` sequences, each `--chunk` new tokens (the queries) after a cached
context; the contexts spread evenly over 0..max-context (sequence i has
round(i * max_context / (seqs - 1)) cached tokens), bf16, H query and H_kv key/value
heads, head dim d, causal bottom-right per sequence (new token j sees the context and the
new tokens up to j). The keys of each sequence (context + chunk) sit in a page pool of
page size P, its pages shuffled across the pool. Providers, all on the same tokens:

* `flashgen_paged<P>`: the llama spec's package (d = 128) flash_attn_varlen_func with
  block_table and seqused_k (cu_seqlens_k None), pages of P tokens;
* `flashgen_varlen`: the same call on the keys packed contiguously (cu_seqlens_k, no
  table): the dense varlen kernel the paged one is held to (the page table costs nothing:
  >= 1.0x);
* `flashgen_bi_paged<P>`, `flashgen_bi_varlen`: those two with batch_invariant=True (issue
  49's cost bar: <= 15% against the default);
* `fa4_paged<P>`: FlashAttention-4's flash_attn_varlen_func with page_table and seqused_k
  on the same pool, where installed (skipped with the reason otherwise; an error in its
  cell if it refuses the page size);
* `fa4_varlen`: FA4 on the packed keys.

FLOPs count the visible (query, key) pairs: 4 * H * d per pair, sum over sequences of
chunk * context + chunk * (chunk + 1) / 2. Every provider's output is checked against
flashgen_varlen's (bf16 tolerance 3e-2) before it is timed; times are
triton.testing.do_bench medians, with --rounds R the providers timed R times in
alternating order and the median round kept. The pure parts (contexts, FLOPs, the plan,
the dry run) run anywhere and are tested on the CPU (tests/test_bench_prefill.py).
"""
from __future__ import annotations

import argparse
import json
import sys

DEFAULTS = dict(seqs=32, chunk=512, max_context=16384, d=128, h=32, h_kv=8, seed=0)
PAGES = (16, 64)
TOL = 3e-2


def providers_for(pages) -> tuple:
    return (tuple(f"flashgen_paged{p}" for p in pages) + ("flashgen_varlen",)
            + tuple(f"flashgen_bi_paged{p}" for p in pages) + ("flashgen_bi_varlen",)
            + tuple(f"fa4_paged{p}" for p in pages) + ("fa4_varlen",))


def contexts(seqs: int, max_context: int) -> list:
    """Cached tokens per sequence, evenly over 0..max_context."""
    if seqs == 1:
        return [max_context]
    return [round(i * max_context / (seqs - 1)) for i in range(seqs)]


def prefill_flops(ctx, chunk: int, h: int, d: int) -> float:
    return 4.0 * h * d * sum(chunk * c + chunk * (chunk + 1) / 2 for c in ctx)


def plan(providers=None, pages=PAGES, **kw) -> list:
    cfg = {**DEFAULTS, **{k: v for k, v in kw.items() if v is not None}}
    for name in ("seqs", "chunk", "d", "h", "h_kv"):
        if cfg[name] < 1:
            raise ValueError(f"--{name.replace('_', '-')} {cfg[name]}: must be at least 1")
    if cfg["max_context"] < 0 or any(p < 1 for p in pages):
        raise ValueError("--max-context must be >= 0 and page sizes >= 1")
    if cfg["d"] != 128:
        raise ValueError(f"--d {cfg['d']}: the benchmark times the llama spec's package (d = 128)")
    if cfg["h"] % cfg["h_kv"]:
        raise ValueError(f"--h {cfg['h']} is not a multiple of --h-kv {cfg['h_kv']}")
    known = providers_for(pages)
    unknown = [p for p in (providers or ()) if p not in known]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; one of {', '.join(known)}")
    ctx = contexts(cfg["seqs"], cfg["max_context"])
    flops = prefill_flops(ctx, cfg["chunk"], cfg["h"], cfg["d"])
    return [dict(provider=p, contexts=ctx, flops=flops, **cfg)
            for p in (providers or known)]


def dry_run_text(cases) -> str:
    if not cases:
        return "no cases\n"
    c = cases[0]
    lines = [f"chunked prefill: {c['seqs']} sequences x {c['chunk']} new tokens over contexts "
             f"{min(c['contexts'])}..{max(c['contexts'])}, H={c['h']}/{c['h_kv']}, d={c['d']}, "
             f"bf16, causal, {c['flops'] / 1e12:.3f} TFLOP a call"]
    lines += [f"  fwd {x['provider']}" for x in cases]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# the GPU part
# ----------------------------------------------------------------------------------------
def inputs(case, page_sizes, device="cuda"):
    """q (total_q, H, d), packed k/v (total_k, H_kv, d), cu_seqlens of both, and for each
    page size (pool k, pool v, block table, seqused_k): the same keys in shuffled pages."""
    import torch

    g = torch.Generator().manual_seed(case["seed"])
    chunk, h, hk, d = case["chunk"], case["h"], case["h_kv"], case["d"]
    lk = [c + chunk for c in case["contexts"]]
    q = torch.randn(chunk * len(lk), h, d, generator=g).to(device, torch.bfloat16)
    k, v = (torch.randn(sum(lk), hk, d, generator=g).to(device, torch.bfloat16)
            for _ in range(2))
    cu_q = torch.arange(0, chunk * len(lk) + 1, chunk, dtype=torch.int32, device=device)
    cu_k = torch.tensor([0] + lk, device=device).cumsum(0).to(torch.int32)
    used = torch.tensor(lk, dtype=torch.int32, device=device)
    paged = {}
    for p in page_sizes:
        npages = [-(-n // p) for n in lk]
        perm = torch.randperm(sum(npages), generator=g).to(device)
        table = torch.zeros(len(lk), max(npages), dtype=torch.int32, device=device)
        pool_k = torch.zeros(sum(npages), p, hk, d, dtype=torch.bfloat16, device=device)
        pool_v = torch.zeros_like(pool_k)
        first = 0
        for i, (n, m) in enumerate(zip(lk, npages)):
            ids = perm[first:first + m]
            table[i, :m] = ids.to(torch.int32)
            rows = torch.arange(n, device=device)
            a = int(cu_k[i])
            pool_k[ids[rows // p], rows % p] = k[a:a + n]
            pool_v[ids[rows // p], rows % p] = v[a:a + n]
            first += m
        paged[p] = (pool_k, pool_v, table, used)
    return q, k, v, cu_q, cu_k, max(lk), paged


def _callables(case, data, pages):
    from . import fa4 as bench_fa4
    from .varlen import _package

    q, k, v, cu_q, cu_k, max_k, paged = data
    chunk = case["chunk"]
    pkg = _package(case["d"])
    out = {}
    for bi, tag in ((False, ""), (True, "bi_")):
        out[f"flashgen_{tag}varlen"] = lambda bi=bi: pkg.flash_attn_varlen_func(
            q, k, v, cu_q, cu_k, chunk, max_k, causal=True, batch_invariant=bi)
        for p in pages:
            pk, pv, table, used = paged[p]
            out[f"flashgen_{tag}paged{p}"] = (
                lambda pk=pk, pv=pv, table=table, used=used, bi=bi: pkg.flash_attn_varlen_func(
                    q, pk, pv, cu_q, None, chunk, max_k, causal=True, block_table=table,
                    seqused_k=used, batch_invariant=bi))
    try:
        fa4 = bench_fa4.load()
    except bench_fa4.Unavailable as e:
        return {**out, "fa4_varlen": e, **{f"fa4_paged{p}": e for p in pages}}
    out["fa4_varlen"] = lambda: bench_fa4.varlen_attention(fa4, q, k, v, cu_q, cu_k, chunk,
                                                           max_k, causal=True)
    for p in pages:
        pk, pv, table, used = paged[p]
        out[f"fa4_paged{p}"] = (lambda pk=pk, pv=pv, table=table, used=used:
                                bench_fa4.varlen_attention(fa4, q, pk, pv, cu_q, None, chunk,
                                                           max_k, causal=True, page_table=table,
                                                           seqused_k=used))
    return out


def measure(cases, pages=PAGES, log=print, rounds=1) -> list:
    import triton

    from .timing import interleaved_rounds, record_rounds

    data = inputs(cases[0], pages)
    calls = _callables(cases[0], data, pages)
    ref = calls["flashgen_varlen"]().float()
    rows, timers = [], {}
    for case in cases:
        name = case["provider"]
        row = {k: case[k] for k in ("provider", "seqs", "chunk", "max_context", "h", "h_kv",
                                    "d")}
        row["status"] = "ok"
        rows.append(row)
        fn = calls.get(name)
        if isinstance(fn, Exception):  # fa4.Unavailable
            row["status"] = f"skipped: {fn}"
            continue
        try:
            err = (fn().float() - ref).abs().max().item()
            if not err <= TOL:
                raise RuntimeError(f"max |out - flashgen_varlen| = {err:.3g} > {TOL}")
            timers[name] = lambda fn=fn: triton.testing.do_bench(fn, warmup=25, rep=100,
                                                                 return_mode="median")
        except Exception as e:  # reported in the row, not fatal
            row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
    times = interleaved_rounds(list(timers), rounds, lambda name: timers[name]())
    for case, row in zip(cases, rows):
        ms = record_rounds(row, times.get(case["provider"]), width=120)
        if ms is not None:
            row["tflops"] = round(case["flops"] / (ms * 1e-3) / 1e12, 1)
        log(f"fwd {row['provider']:18s} {row.get('ms', '-')} ms {row.get('tflops', '-')} "
            f"TFLOP/s {'' if row['status'] == 'ok' else row['status']}")
    return rows


def bar_text(rows, pages=PAGES) -> str:
    """The issue's bar: each paged row >= 1.0x FA4's paged row of its page size and >= 1.0x
    flashgen's own dense varlen."""
    got = {r["provider"]: r["tflops"] for r in rows if r.get("tflops")}
    lines = []
    for p in pages:
        mine = got.get(f"flashgen_paged{p}")
        for peer in (f"fa4_paged{p}", "flashgen_varlen"):
            if mine and got.get(peer):
                ratio = mine / got[peer]
                lines.append(f"page {p}: flashgen_paged{p} / {peer} = {ratio:.3f} "
                             f"({'meets' if ratio >= 1.0 else 'MISSES'} the bar 1.0)")
    for base in [f"paged{p}" for p in pages] + ["varlen"]:  # batch_invariant's cost: <= 15%
        if got.get(f"flashgen_{base}") and got.get(f"flashgen_bi_{base}"):
            cost = got[f"flashgen_{base}"] / got[f"flashgen_bi_{base}"] - 1
            lines.append(f"flashgen_bi_{base} costs {cost:+.1%} against flashgen_{base} "
                         f"({'meets' if cost <= 0.15 else 'MISSES'} the bar 15%)")
    return "\n".join(lines) + ("\n" if lines else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.prefill",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--providers", nargs="+", default=None)
    ap.add_argument("--pages", nargs="+", type=int, default=list(PAGES))
    for name in DEFAULTS:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name])
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds {args.rounds}: give at least 1 round", file=sys.stderr)
        return 2
    try:
        cases = plan(args.providers, tuple(args.pages),
                     **{k: getattr(args, k) for k in DEFAULTS})
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(dry_run_text(cases))
    if args.dry_run:
        return 0
    import torch
    if not torch.cuda.is_available():
        print("error: the prefill benchmark needs a CUDA GPU (--dry-run prints the plan)",
              file=sys.stderr)
        return 2
    rows = measure(cases, tuple(args.pages), rounds=args.rounds)
    sys.stdout.write(bar_text(rows, tuple(args.pages)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
