"""Context parallelism (ring / all-gather / Ulysses / hybrid) against one GPU: time, peak
memory, exactness.

    torchrun --nproc_per_node 2 benchmarks/ring.py [--seqlens 32768,131072,262144]
        [--strategies ring,allgather,ring:g1,ulysses,hybrid:u2]
        [--heads 32 --kv-heads 8 --head-dim 128] [--mask causal|none|window:4096]
        [--docs 64 [--doc-lengths equal|random:SEED] [--layout zigzag|documents|balanced]
         [--fresh-docs]]
        [--reps 5] [--oom-seqlen N] [--out ring.json] [--api flash|sdpa]

--docs D: D documents packed into each sequence, under the document mask (the committed
generated/mods_attn, whose document variant is causal): equal lengths, or random ones
(--doc-lengths random:SEED, multiples of 2 * world); --layout documents shards them with
document_layout (the zig-zag per document), balanced with document_layout(...,
balanced=True) (whole documents on ranks), zigzag (default) with the plain zig-zag.
--fresh-docs: a new document ids tensor every step (a training loop's new batch), so
neither the one-GPU call nor the context-parallel one reuses the mask's cached block
lists (and cell table): both pay for making them every step.
hybrid:uU: strategy="hybrid" over hybrid_groups(U); ulysses:p: FLASHGEN_CP_PREFETCH=1;
ring:l0: FLASHGEN_CP_LOCAL=0 (cp_call has the flags).

For each sequence length N (B=1, bf16, the committed generated/llama_attn), times a
forward + backward step:
  one_gpu   flash_attn_func on the whole sequence on rank 0 (the other ranks wait), or
            "OOM" when it does not fit;
  <strategy> ring_flash_attn_func on zig-zag shards, every rank at once (the step's time
            is the slowest rank's);
and reports each one's median time, the context-parallel time as a fraction of the
one-GPU time (the issue's bar: <= 0.55 on 2 GPUs at 128k and 256k), and the peak memory
per GPU (torch.cuda.max_memory_allocated over the step, inputs included; the bar: about
half of one GPU's). At the first length it also checks exactness: every rank's output and
dq, dk, dv against rank 0's one-GPU result (max abs error, and the one-GPU bf16 result's
own error against fp32 for scale when --check-fp32 is given).

--oom-seqlen N: one more length, expected not to fit one GPU and to run on all of them
(the "OOM on one, runs on two" bar); no exactness check there (gathering the shards
would not fit either); --oom-skip-one-gpu leaves its one-GPU timing out.
Rank 0 prints a table and writes --out (JSON).

--api sdpa: (B, H, N, d) tensors through scaled_dot_product_attention and
ring_scaled_dot_product_attention (shards cut along dim 2) instead of flash-attn's
(B, N, H, d). Each head's rows are then adjacent, which is what very wide calls (many
heads: a shard whose rows span >= 2**31 elements) need.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generated.llama_attn as llama  # noqa: E402

pkg = llama  # generated.mods_attn under --docs (main)


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqlens", default="32768,131072,262144")
    p.add_argument("--strategies", default="ring,allgather")
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--mask", default="causal", help="causal, none or window:LEFT (causal)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--oom-seqlen", type=int, default=0)
    p.add_argument("--oom-skip-one-gpu", action="store_true",
                   help="do not time one GPU at --oom-seqlen (an H200 fits 1M tokens: ~1 min a step)")
    p.add_argument("--check-fp32", action="store_true")
    p.add_argument("--api", default="flash", choices=("flash", "sdpa"))
    p.add_argument("--docs", type=int, default=0)
    p.add_argument("--doc-lengths", default="equal")
    p.add_argument("--layout", default="zigzag", choices=("zigzag", "documents", "balanced"))
    p.add_argument("--fresh-docs", action="store_true")
    p.add_argument("--out", default="")
    return p.parse_args()


def mask_args(mask: str) -> dict:
    if mask == "causal":
        return dict(causal=True)
    if mask == "none":
        return dict(causal=False)
    if mask.startswith("window:"):
        return dict(causal=True, window_size=(int(mask.split(":")[1]), 0))
    raise SystemExit(f"--mask {mask!r}: causal, none or window:LEFT")


SEQ_DIM = {"flash": 1, "sdpa": 2}


def make(n, args, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    shapes = ((n, args.heads), (n, args.kv_heads), (n, args.kv_heads), (n, args.heads))
    if args.api == "sdpa":
        return [torch.randn(1, h, s, args.head_dim, generator=g, device=device,
                            dtype=torch.bfloat16) for s, h in shapes]
    return [torch.randn(1, s, h, args.head_dim, generator=g, device=device,
                        dtype=torch.bfloat16) for s, h in shapes]


def doc_lengths(n, args, world):
    """The --docs document lengths of a sequence of n tokens."""
    d = args.docs
    if args.doc_lengths == "equal":
        return [n // d] * (d - 1) + [n - n // d * (d - 1)]
    g = torch.Generator().manual_seed(int(args.doc_lengths.split(":")[1]))
    unit = 2 * world
    weights = torch.rand(d, generator=g) + 0.1
    units = (weights / weights.sum() * (n // unit)).floor().long().clamp(min=1)
    units[-1] += n // unit - units.sum()
    return [int(u) * unit for u in units]


def doc_kw(n, args, world, device):
    """The document mask's call arguments (and the layout) of a --docs run, else {}."""
    if not args.docs:
        return {}, "zigzag"
    lengths = doc_lengths(n, args, world)
    cu = torch.tensor([0] + lengths).cumsum(0)
    kw = dict(mods=("document",), doc=pkg.document_ids(cu).to(device))
    layout = ("zigzag" if args.layout == "zigzag" else
              pkg.document_layout(cu, world, balanced=args.layout == "balanced"))
    return kw, layout


def attend(q, k, v, args, ring=False, strategy=None, extra=None):
    """One call of the chosen API (forward only); extra: the context-parallel call's
    group / layout and the mods' arguments."""
    kw = mask_args(args.mask)
    kw.update(extra or {})
    if args.fresh_docs and "doc" in kw:
        kw["doc"] = kw["doc"].clone()  # (a new tensor: no cached block lists)
    if args.api == "flash":
        if ring:
            return pkg.ring_flash_attn_func(q, k, v, strategy=strategy, **kw)
        kw.pop("layout", None)
        kw.pop("group", None)
        return pkg.flash_attn_func(q, k, v, **kw)
    sdpa_kw = dict(is_causal=kw["causal"], enable_gqa=args.heads != args.kv_heads)
    if "window_size" in kw:
        sdpa_kw["window_size"] = kw["window_size"]
    if ring:
        return pkg.ring_scaled_dot_product_attention(q, k, v, strategy=strategy, **sdpa_kw)
    return pkg.scaled_dot_product_attention(q, k, v, **sdpa_kw)


def timed_step(fn, reps, warmup, collective=True, baseline=0):
    """(median ms of fn(), peak bytes of one call above `baseline`, the bytes that were
    allocated before the call's inputs were made: results kept from an earlier length or
    strategy must not count) -- fn runs forward + backward. With
    `collective`, every rank calls this together and the reps start on a barrier; rank 0's
    one-GPU run must not (a barrier the other ranks never join pairs with their ring's P2P
    operations and hangs NCCL)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if collective and dist.is_initialized():
            dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), torch.cuda.max_memory_allocated() - baseline


def one_gpu(n, args, device, world, keep=False):
    q = k = v = do = None
    baseline = torch.cuda.memory_allocated()
    try:
        q, k, v, do = make(n, args, device)
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        extra = doc_kw(n, args, world, device)[0]

        def step():
            q.grad = k.grad = v.grad = None
            out = attend(q, k, v, args, extra=extra)
            out.backward(do)
            return out

        ms, peak = timed_step(step, args.reps, args.warmup, collective=False,
                              baseline=baseline)
        result = {"ms": round(ms, 3), "peak_gib": round(peak / 2**30, 2)}
        if keep:
            out = step()
            result["tensors"] = [out.detach(), q.grad, k.grad, v.grad]
            if args.check_fp32:
                q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
                o32 = attend(q32, k32, v32, args, extra=extra)
                o32.backward(do.float())
                result["bf16_vs_fp32"] = [(a.float() - b).abs().max().item() for a, b in
                                          zip(result["tensors"], (o32, q32.grad, k32.grad, v32.grad))]
        return result
    except torch.OutOfMemoryError:
        return {"ms": None, "peak_gib": None, "oom": True}
    finally:
        del q, k, v, do
        torch.cuda.empty_cache()


_HYBRID = {}


def cp_call(strategy, n, args, device, world):
    """(strategy, the call's extra arguments, the shard() keywords) of a --strategies
    entry: a name ("ring", "allgather", "ulysses", "hybrid") and ":"-separated flags: gN
    (the head groups, FLASHGEN_CP_HEAD_GROUPS=N; none: auto), uU (hybrid's Ulysses group
    size, default 2), p (Ulysses' head groups' all-to-alls overlapping the kernels,
    FLASHGEN_CP_PREFETCH=1), l0 / l1 (FLASHGEN_CP_LOCAL=0 / 1: never / always the local
    call of documents, _ring_masks._Local; none: auto). E.g. ring:g1:l0, hybrid:u2."""
    name, *flags = strategy.split(":")
    value = {f[0]: f[1:] for f in flags}
    os.environ["FLASHGEN_CP_PREFETCH"] = "1" if "p" in value else "0"
    os.environ["FLASHGEN_CP_HEAD_GROUPS"] = value.get("g") or "auto"
    os.environ["FLASHGEN_CP_LOCAL"] = value.get("l") or "auto"
    extra, layout = doc_kw(n, args, world, device)
    shard_kw = dict(layout=layout)
    if name == "hybrid":
        size = int(value.get("u") or 2)
        if size not in _HYBRID:  # (new_group: a collective, once per size)
            _HYBRID[size] = pkg.hybrid_groups(size)
        name, extra["group"], shard_kw["ulysses"] = "hybrid", _HYBRID[size], size
    extra["layout"] = layout
    return name, extra, shard_kw


def context_parallel(n, strategy, args, device, rank, world, keep=False):
    strategy, extra, shard_kw = cp_call(strategy, n, args, device, world)
    dim = SEQ_DIM[args.api]
    baseline = torch.cuda.memory_allocated()
    q, k, v, do = (pkg.shard(t, rank, world, dim=dim, **shard_kw)
                   for t in make(n, args, device))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def step():
        q.grad = k.grad = v.grad = None
        out = attend(q, k, v, args, ring=True, strategy=strategy, extra=extra)
        out.backward(do)
        return out

    try:
        torch.cuda.empty_cache()
        ms, peak = timed_step(step, args.reps, args.warmup, baseline=baseline)
        result = {"ms": ms, "peak_gib": peak / 2**30}
        if keep:
            out = step()
            result["tensors"] = [out.detach(), q.grad, k.grad, v.grad]
            result["shard_kw"] = shard_kw
        return result
    except torch.OutOfMemoryError:
        return {"ms": None, "peak_gib": None, "oom": True}


def slowest(value):
    t = torch.tensor([value if value is not None else float("inf")], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def main():
    global pkg
    args = parse()
    if args.docs:
        import generated.mods_attn as mods_attn

        pkg = mods_attn
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)  # before NCCL starts
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda")
    seqlens = [int(s) for s in args.seqlens.split(",") if s]
    if args.oom_seqlen:
        seqlens.append(args.oom_seqlen)
    rows = []
    for i, n in enumerate(seqlens):
        if n % (2 * world):
            raise SystemExit(f"N={n} is not a multiple of 2 * world = {2 * world}")
        row = {"seqlen": n, "world": world, "mask": args.mask, "heads": args.heads,
               "kv_heads": args.kv_heads, "head_dim": args.head_dim, "docs": args.docs,
               "doc_lengths": args.doc_lengths, "layout": args.layout,
               "fresh_docs": args.fresh_docs}
        if rank != 0:
            single = None
        elif n == args.oom_seqlen and args.oom_skip_one_gpu:
            single = {"ms": None, "peak_gib": None, "skipped": True}
        else:
            single = one_gpu(n, args, device, world, keep=(i == 0))
        dist.barrier()
        if rank == 0:
            row["one_gpu"] = {k: v for k, v in single.items() if k != "tensors"}
        for strategy in args.strategies.split(","):
            res = context_parallel(n, strategy, args, device, rank, world,
                                   keep=(i == 0 and n != args.oom_seqlen))
            ms = slowest(res["ms"])
            peak = slowest(res["peak_gib"])
            entry = {"ms": None if ms == float("inf") else round(ms, 3),
                     "peak_gib_max_rank": None if peak == float("inf") else round(peak, 2)}
            if "tensors" in res:
                # exactness against rank 0's one-GPU result
                kw = res["shard_kw"]
                group = _HYBRID[kw["ulysses"]] if "ulysses" in kw else None
                full = [pkg.unshard_sequence(t.contiguous(), group, dim=SEQ_DIM[args.api],
                                             layout=kw["layout"])
                        for t in res["tensors"]]
                if rank == 0 and "tensors" in single:
                    entry["max_abs_err_vs_one_gpu"] = [
                        (a.float() - b.float()).abs().max().item()
                        for a, b in zip(full, single["tensors"])]
            if rank == 0 and single.get("ms") and entry["ms"]:
                entry["fraction_of_one_gpu"] = round(entry["ms"] / single["ms"], 3)
            row[strategy] = entry
            del res
            torch.cuda.empty_cache()
        if rank == 0:
            rows.append(row)
            print(json.dumps(row), flush=True)
        if single is not None:
            single.pop("tensors", None)
    if rank == 0:
        print(f"\n{'N':>8} {'one GPU ms':>11} {'GiB':>6}  " + "  ".join(
            f"{s + ' ms':>12} {'frac':>5} {'GiB':>6}" for s in args.strategies.split(",")))
        for row in rows:
            one = row["one_gpu"]
            none = "skipped" if one.get("skipped") else "OOM"
            line = f"{row['seqlen']:>8} {one['ms'] or none:>11} {one['peak_gib'] or '-':>6}  "
            for s in args.strategies.split(","):
                e = row[s]
                line += (f"  {e['ms'] or 'OOM':>12} {e.get('fraction_of_one_gpu', '-'):>5} "
                         f"{e['peak_gib_max_rank'] or '-':>6}")
            print(line)
        if args.out:
            Path(args.out).write_text(json.dumps(rows, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
