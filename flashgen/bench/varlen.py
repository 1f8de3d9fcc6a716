"""The varlen benchmark (issue 17's bar): packed ragged batches on the GPU.

    python -m flashgen.bench.varlen [--dry-run] [--modes fwd bwd] [--providers ...]
                                    [--docs 16] [--total 16384] [--min-len 128]
                                    [--max-len 4096] [--d 128] [--h 16] [--seed 0]
                                    [--dense-n 4096] [--rounds 1] [--out results.json]

The workload: `--docs` documents of ragged lengths in [min-len, max-len] (drawn
log-uniformly from a fixed seed, summing to `--total` tokens, packed in a shuffled order so
that the longest is not first in memory), bf16, H query and key/value heads, head dim d,
causal (bottom-right per document, which for equal q/k lengths is the usual diagonal).
Providers, all on the same tokens:

* `flashgen_varlen`: flash_attn_varlen_func of the llama spec's package (d=128) or of
  gpt2's (d=64), q/k/v (total, H, d), int32 cu_seqlens on the GPU;
* `flashgen_dense`: that package's flash_attn_func on a dense (total / dense_n, dense_n,
  H, d) batch -- the same number of tokens in equal sequences: the kernel varlen is held
  to (>= 0.95x its TFLOP/s);
* `flashgen_dense_matched`: the same dense kernel at each document's own length -- for
  every distinct length n, a dense (total // n, n, H, d) batch (about the same tokens)
  is timed, and the documents' FLOPs are charged at that length's TFLOP/s
  (matched_time_ms). Its time is what the dense kernel would take for these documents
  if raggedness cost nothing; varlen against it is the packing's own overhead (walk,
  masking, scheduling), while `flashgen_dense` against it is what short sequences cost
  any kernel (more diagonal blocks and per-tile costs per FLOP). Reported beside the
  bar, not instead of it;
* `flex_document`: torch.compile(flex_attention) on (1, H, total, d) with a causal
  document BlockMask (create_block_mask over the document ids);
* `torch_varlen`: torch.nn.attention.varlen.varlen_attn (window (-1, 0) = causal), where
  this torch has it;
* `flashgen_bi`: flashgen_varlen with batch_invariant=True (the decode kernel's invariant
  form at its pinned tile: issue 49's cost bar, <= 15% against flashgen_varlen);
* `fa4_varlen`: FlashAttention-4's flash_attn_varlen_func (flash_attn.cute, sm90/sm100) on
  the same packed tensors and cu_seqlens, where it is installed (skipped with the reason
  otherwise: flashgen/bench/fa4.py).

FLOPs count each document on its own (4 * H * n^2 * d per forward, halved for causal,
backward 2.5x), so the TFLOP/s of the varlen-shaped providers (the matched row included)
are comparable; the dense row counts its own equal sequences. Times:
triton.testing.do_bench medians (with --rounds R, the providers of a mode timed R times in
alternating order and the median round kept); the backward times one saved forward's
backward. Every varlen-shaped provider's output is checked against flashgen's (bf16
tolerance 3e-2) before it is timed. Results: a table on stdout and, with --out, JSON rows.

The pure parts (lengths, cu_seqlens, FLOPs, the plan and the dry run) run anywhere and are
tested on the CPU (tests/test_bench_varlen.py)."""
from __future__ import annotations

import argparse
import json
import math
import random
import sys

PROVIDERS = ("flashgen_varlen", "flashgen_dense", "flashgen_dense_matched", "flex_document",
             "torch_varlen", "flashgen_bi", "fa4_varlen")
DEFAULTS = dict(docs=16, total=16384, min_len=128, max_len=4096, d=128, h=16, seed=0,
                dense_n=4096)
TOL = 3e-2


def ragged_lengths(docs: int, total: int, lo: int, hi: int, seed: int = 0) -> list:
    """`docs` lengths in [lo, hi] summing to `total`, log-uniform around their geometric
    middle, deterministic for a seed; the first is `hi` and one is `lo` when docs >= 2 (the
    bar's range is then exercised exactly), and the order is shuffled."""
    if not (docs >= 1 and 1 <= lo <= hi and docs * lo <= total <= docs * hi):
        raise ValueError(f"cannot split {total} tokens into {docs} documents of {lo}..{hi}")
    rng = random.Random(seed)
    if docs == 1:
        return [total]
    fixed = [hi, lo] if docs >= 2 and (docs - 2) * lo <= total - hi - lo <= (docs - 2) * hi \
        else []
    rest = docs - len(fixed)
    budget = total - sum(fixed)
    draws = [math.exp(rng.uniform(math.log(lo), math.log(hi))) for _ in range(rest)]
    scale = budget / sum(draws) if draws else 0.0
    lengths = [min(hi, max(lo, int(round(x * scale)))) for x in draws]
    # repair the sum one token at a time, spreading over the documents with room
    i = 0
    while sum(lengths) != budget:
        step = 1 if sum(lengths) < budget else -1
        j = i % rest
        if lo <= lengths[j] + step <= hi:
            lengths[j] += step
        i += 1
    out = fixed + lengths
    rng.shuffle(out)
    return out


def cu_seqlens(lengths) -> list:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def document_flops(lengths, h: int, d: int, causal: bool, mode: str) -> float:
    """FLOPs of one call over the documents, each counted on its own (the training suite's
    formula: 4 H n^2 d, halved when causal, the backward 2.5x the forward)."""
    f = sum(4.0 * h * n * n * d for n in lengths)
    if causal:
        f /= 2
    return 2.5 * f if mode == "bwd" else f


def matched_batches(lengths, total: int) -> dict:
    """The dense batch timed for each distinct document length of the length-matched
    baseline: n -> B with B * n as close to `total` tokens as whole sequences allow (at
    least one), so every length is timed on a call about as large as the varlen one."""
    return {n: max(1, round(total / n)) for n in sorted(set(lengths)) if n > 0}


def matched_time_ms(lengths, rates: dict, h: int, d: int, mode: str) -> float:
    """The length-matched dense time of the documents: each one's FLOPs (document_flops)
    at the TFLOP/s the dense kernel reached at its length (`rates`: n -> TFLOP/s)."""
    return sum(document_flops([n], h, d, True, mode) / (rates[n] * 1e12) * 1e3
               for n in lengths if n > 0)


def plan(providers=None, modes=("fwd", "bwd"), **kw) -> list:
    """The cases of a run: one per (mode, provider), with the workload's facts."""
    cfg = {**DEFAULTS, **{k: v for k, v in kw.items() if v is not None}}
    if cfg["total"] % cfg["dense_n"]:
        raise ValueError(f"--total {cfg['total']} is not a multiple of --dense-n "
                         f"{cfg['dense_n']} (the dense batch's sequence length)")
    providers = tuple(providers or PROVIDERS)
    unknown = [p for p in providers if p not in PROVIDERS]
    if unknown:
        raise ValueError(f"unknown provider(s) {unknown}; one of {', '.join(PROVIDERS)}")
    lengths = ragged_lengths(cfg["docs"], cfg["total"], cfg["min_len"], cfg["max_len"],
                             cfg["seed"])
    cases = []
    for mode in modes:
        if mode not in ("fwd", "bwd"):
            raise ValueError(f"mode {mode!r}: fwd or bwd")
        for p in providers:
            if p == "flashgen_dense":
                n = cfg["dense_n"]
                b = cfg["total"] // n
                fl = document_flops([n] * b, cfg["h"], cfg["d"], True, mode)
            else:
                fl = document_flops(lengths, cfg["h"], cfg["d"], True, mode)
            cases.append(dict(mode=mode, provider=p, lengths=lengths, flops=fl, **cfg))
    return cases


def dry_run_text(cases) -> str:
    if not cases:
        return "no cases\n"
    c0 = cases[0]
    lines = [f"varlen: {c0['docs']} documents, {c0['total']} tokens, lengths "
             f"{min(c0['lengths'])}..{max(c0['lengths'])} (packed order "
             f"{c0['lengths']}), H={c0['h']}, d={c0['d']}, bf16, causal",
             f"dense baseline: B={c0['total'] // c0['dense_n']} x N={c0['dense_n']}"]
    for c in cases:
        lines.append(f"  {c['mode']} {c['provider']:22s} {c['flops'] / 1e12:.3f} TFLOP")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------
# the GPU part
# ----------------------------------------------------------------------------------------
def _package(d: int):
    from ..resources import bundled_spec
    from .providers import load_package
    from .suites import SPECS
    return load_package(bundled_spec(SPECS[d]))[0]


def _providers(case, q, k, v, cu, doc_ids):
    """name -> callable(q, k, v) returning the output in q's (total, H, d) layout, or, for
    an optional provider that cannot run here, the fa4.Unavailable that says why."""
    import torch

    from . import fa4 as bench_fa4

    total, h, d = q.shape
    lengths = case["lengths"]
    pkg = _package(d)
    max_len = max(lengths)
    out = {}

    def varlen(q_, k_, v_):
        return pkg.flash_attn_varlen_func(q_, k_, v_, cu, cu, max_len, max_len, causal=True)
    out["flashgen_varlen"] = varlen

    def invariant(q_, k_, v_):
        return pkg.flash_attn_varlen_func(q_, k_, v_, cu, cu, max_len, max_len, causal=True,
                                          batch_invariant=True)
    out["flashgen_bi"] = invariant

    n = case["dense_n"]

    def dense(q_, k_, v_):
        b = total // n
        return pkg.flash_attn_func(q_.view(b, n, h, d), k_.view(b, n, h, d),
                                   v_.view(b, n, h, d), causal=True).view(total, h, d)
    out["flashgen_dense"] = dense

    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc_causal(b_, h_, qi, ki):
            return (doc_ids[qi] == doc_ids[ki]) & (qi >= ki)
        block_mask = create_block_mask(doc_causal, B=None, H=None, Q_LEN=total, KV_LEN=total,
                                       device=q.device)
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_doc(q_, k_, v_):
            o = flex(q_.transpose(0, 1)[None], k_.transpose(0, 1)[None],
                     v_.transpose(0, 1)[None], block_mask=block_mask)
            return o[0].transpose(0, 1)
        out["flex_document"] = flex_doc
    except ImportError:
        pass
    try:
        from torch.nn.attention.varlen import varlen_attn

        def torch_varlen(q_, k_, v_):
            return varlen_attn(q_, k_, v_, cu, cu, max_len, max_len, window_size=(-1, 0))
        out["torch_varlen"] = torch_varlen
    except ImportError:
        pass
    try:
        fa4 = bench_fa4.load()

        def fa4_varlen(q_, k_, v_):
            return bench_fa4.varlen_attention(fa4, q_, k_, v_, cu, cu, max_len, max_len,
                                              causal=True)
        out["fa4_varlen"] = fa4_varlen
    except bench_fa4.Unavailable as e:
        out["fa4_varlen"] = e
    return out


def measure(cases, log=print, rounds=1) -> list:
    """Rows for the planned cases. The providers of one mode are timed `rounds` times in
    alternating order (timing.interleaved_rounds: a clock drifting during the run
    lands on all of them alike); each row's ms is the median round, `ms_rounds` (rounds >
    1) keeps them all."""
    import torch

    from .timing import interleaved_rounds, record_rounds

    rows = []
    by_shape, groups = {}, {}
    for case in cases:
        groups.setdefault((tuple(case["lengths"]), case["h"], case["d"], case["mode"]),
                          []).append(case)
    for (lengths, h, d, mode), group in groups.items():
        key = (lengths, h, d)
        if key not in by_shape:
            case = group[0]
            torch.manual_seed(case["seed"])
            q, k, v = (torch.randn(case["total"], h, d, device="cuda",
                                   dtype=torch.bfloat16) for _ in range(3))
            cu = torch.tensor(cu_seqlens(case["lengths"]), dtype=torch.int32, device="cuda")
            doc_ids = torch.repeat_interleave(
                torch.arange(len(case["lengths"]), device="cuda"),
                torch.tensor(case["lengths"], device="cuda"))
            provs = _providers(case, q, k, v, cu, doc_ids)
            ref = provs["flashgen_varlen"](q, k, v).float()
            by_shape[key] = (q, k, v, provs, ref)
        q, k, v, provs, ref = by_shape[key]
        group_rows, timers = [], {}
        for case in group:
            row = {k_: case[k_] for k_ in ("mode", "provider", "docs", "total", "h", "d",
                                           "dense_n")}
            row["status"] = "ok"
            group_rows.append((case, row))
            name = case["provider"]
            try:
                if name == "flashgen_dense_matched":
                    timers[name] = lambda case=case: _matched_ms(case, log)
                    continue
                fn = provs.get(name)
                if fn is None:
                    raise RuntimeError("not available in this torch")
                if isinstance(fn, Exception):  # fa4.Unavailable: not installed, another GPU
                    row["status"] = f"skipped: {fn}"
                    continue
                if name != "flashgen_dense":
                    err = (fn(q, k, v).float() - ref).abs().max().item()
                    if not err <= TOL:
                        raise RuntimeError(f"max |out - flashgen_varlen| = {err:.3g} > {TOL}")
                timers[name] = lambda fn=fn: _time_provider(fn, q, k, v, mode)
            except Exception as e:  # a provider that fails is reported, not fatal
                row["status"] = f"error: {type(e).__name__}: {str(e)[:120]}"
        times = interleaved_rounds(list(timers), rounds, lambda name: timers[name]())
        for case, row in group_rows:
            ms = record_rounds(row, times.get(case["provider"]), width=120)
            if ms is not None:
                row["tflops"] = round(case["flops"] / (ms * 1e-3) / 1e12, 1)
            log(f"{row['mode']} {row['provider']:22s} {row.get('ms', '-')} ms "
                f"{row.get('tflops', '-')} TFLOP/s {row['status'] if row['status'] != 'ok' else ''}")
            rows.append(row)
    return rows


def _time_provider(fn, q, k, v, mode) -> float:
    """do_bench's median of fn's forward, or of the backward of one saved forward."""
    import torch
    if mode == "fwd":
        return _time(lambda: fn(q, k, v))
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o = fn(qg, kg, vg)
    do = torch.randn_like(o)
    # grad_to_none: no accumulation into the last call's gradients
    return _time(lambda: o.backward(do, retain_graph=True), [qg, kg, vg])


def _time(call, grads=None) -> float:
    import triton
    return triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads,
                                   return_mode="median")


def _matched_ms(case, log) -> float:
    """flashgen_dense_matched: the dense kernel timed at every distinct document length
    (matched_batches), the documents charged at their length's rate (matched_time_ms)."""
    import torch

    h, d, mode = case["h"], case["d"], case["mode"]
    pkg = _package(d)
    rates = {}
    for n, b in matched_batches(case["lengths"], case["total"]).items():
        q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        if mode == "fwd":
            ms = _time(lambda: pkg.flash_attn_func(q, k, v, causal=True))
        else:
            qg, kg, vg = (t.requires_grad_() for t in (q, k, v))
            o = pkg.flash_attn_func(qg, kg, vg, causal=True)
            do = torch.randn_like(o)
            ms = _time(lambda: o.backward(do, retain_graph=True), [qg, kg, vg])
        rates[n] = document_flops([n] * b, h, d, True, mode) / (ms * 1e-3) / 1e12
        log(f"  {mode} dense ({b}, {n}): {ms:.4f} ms {rates[n]:.1f} TFLOP/s")
    return matched_time_ms(case["lengths"], rates, h, d, mode)


def bar_text(rows) -> str:
    """The issue's bar per mode: flashgen_varlen's TFLOP/s over each peer's (>= 0.95 for
    the dense kernel, >= 1 for FlexAttention and torch's varlen_attn)."""
    need = {"flashgen_dense": 0.95, "flex_document": 1.0, "torch_varlen": 1.0}
    lines = []
    for mode in ("fwd", "bwd"):
        mine = next((r for r in rows if r["mode"] == mode and r["provider"] == "flashgen_varlen"
                     and r.get("tflops")), None)
        if mine is None:
            continue
        matched = next((r for r in rows if r["mode"] == mode and r.get("tflops")
                        and r["provider"] == "flashgen_dense_matched"), None)
        if matched is not None:
            lines.append(f"{mode}: varlen / flashgen_dense_matched = "
                         f"{mine['tflops'] / matched['tflops']:.3f} (the packing's own overhead; "
                         f"no bar)")
        bi = next((r for r in rows if r["mode"] == mode and r.get("tflops")
                   and r["provider"] == "flashgen_bi"), None)
        if bi is not None:  # issue 49: batch_invariant=True costs <= 15%
            cost = mine["tflops"] / bi["tflops"] - 1
            lines.append(f"{mode}: batch_invariant costs {cost:+.1%} against varlen "
                         f"({'meets' if cost <= 0.15 else 'MISSES'} the bar 15%)")
        fa4 = next((r for r in rows if r["mode"] == mode and r.get("tflops")
                    and r["provider"] == "fa4_varlen"), None)
        if fa4 is not None:
            lines.append(f"{mode}: varlen / fa4_varlen = {mine['tflops'] / fa4['tflops']:.3f} "
                         "(no bar)")
        for r in rows:
            if r["mode"] == mode and r["provider"] in need and r.get("tflops"):
                ratio = mine["tflops"] / r["tflops"]
                ok = "meets" if ratio >= need[r["provider"]] else "MISSES"
                lines.append(f"{mode}: varlen / {r['provider']} = {ratio:.3f} "
                             f"({ok} the bar {need[r['provider']]})")
    return "\n".join(lines) + ("\n" if lines else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgen.bench.varlen",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the plan, run nothing")
    ap.add_argument("--modes", nargs="+", default=["fwd", "bwd"])
    ap.add_argument("--providers", nargs="+", default=None, help=", ".join(PROVIDERS))
    for name in ("docs", "total", "min_len", "max_len", "d", "h", "seed", "dense_n"):
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=DEFAULTS[name])
    ap.add_argument("--rounds", type=int, default=1,
                    help="time the providers this many times in alternating order and keep "
                    "each one's median round (default 1)")
    ap.add_argument("--out", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.rounds < 1:
        print(f"error: --rounds {args.rounds}: give at least 1 round", file=sys.stderr)
        return 2
    for name in ("docs", "total", "min_len", "max_len", "d", "h", "dense_n"):
        if getattr(args, name) < 1:  # (0 divides by zero; a negative size plans nonsense)
            print(f"error: --{name.replace('_', '-')} {getattr(args, name)}: must be at "
                  "least 1", file=sys.stderr)
            return 2
    try:
        cases = plan(args.providers, tuple(args.modes), docs=args.docs, total=args.total,
                     min_len=args.min_len, max_len=args.max_len, d=args.d, h=args.h,
                     seed=args.seed, dense_n=args.dense_n)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(dry_run_text(cases))
    if args.dry_run:
        return 0
    import torch
    if not torch.cuda.is_available():
        print("error: the varlen benchmark needs a CUDA GPU (--dry-run prints the plan)",
              file=sys.stderr)
        return 2
    rows = measure(cases, rounds=args.rounds)
    sys.stdout.write(bar_text(rows))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
