"""Decoding throughput on the GPU: flashgen's `flash_attn_with_kvcache` (contiguous and
paged KV cache) beside SDPA's flash and cuDNN backends and FlexAttention, at Llama-3-8B
decode shapes: H_q = 32, H_kv = 8, d = 128, one new query token, bf16, batch 8 and 1, KV
length 4k / 16k / 64k.

    python -m flashgen.bench.decode [--out results.json] [--b 8 1] [--n 4096 16384 65536]
                                    [--splits 0 1 4 16] [--page 256] [--no-graph]

(`flashgen bench --suite decode` runs the same measurement.) The flashgen package is
specs/llama.yaml's, built into a temporary folder.

Decoding is memory-bound, so the figure of merit is bandwidth: GB/s counts q, K, V and the
output once each (B*H_q*d*2 + 2*B*L*H_kv*d*2 + B*H_q*d*2 bytes), whatever the kernel
re-reads. SDPA gets q (B, H_q, 1, d) and K/V (B, H_kv, L, d) with enable_gqa=True, or K/V
repeated to H_q heads if the backend refuses GQA (the row says so; its bytes are still
counted for the un-repeated K/V). Every provider's output is checked against a float32
reference of batch element 0 before it is timed. Times are do_bench medians (its L2 flush
writes 256 MB); each provider is also timed with a read-only flush (rows "<name>_rf",
see `read_flush_ms`), which does not charge the timed kernel for the flush's writeback.

flashgen is called as a server would call it: cache_seqlens is an int32 tensor on the GPU,
and the call reads no device value on the host (no sync; the grid comes from the cache
capacity), so host time and GPU time overlap as they would in a serving loop. Rows:
  flashgen_s{S}          contiguous cache, num_splits S (0 = the heuristic)
  flashgen_append_s0     the same plus one new k/v token appended in place (attention over
                         L keys, the last of them the new one, appended by the same launch)
  flashgen_rotary_append_s0, flashgen_rotary_append_unfused_s0 (and flashgen_paged_...)
                         the same step with rotary (GPT-NeoX halves over all of d): q and the
                         new key rotated at position L - 1 and the key written rotated -- one
                         launch, against flashgen_s0 (paged_s0) for issue 49's <= 1.1x bar;
                         _unfused: FUSED_APPEND off, the append kernel launched first
  flashgen_graph_s0      the flashgen_s0 call captured in a CUDA graph and replayed: the GPU
                         time alone, without Python/launch overhead (possible now that the
                         call never syncs)
  flashgen_paged_s{S}    the same keys in a paged pool (--page, shuffled block table)
  flashgen_paged_graph_s0
  flashgen_bi_s0, flashgen_bi_paged_s0
                         batch_invariant=True (its pinned tile, fixed splits, the ordered
                         fold): its cost against flashgen_s0 / flashgen_paged_s0
  flashgen_fp8kv_s0, flashgen_int8kv_s0, flashgen_paged_fp8kv_s0, flashgen_paged_int8kv_s0
                         the same keys in a quantized cache (spec `kv_cache_dtypes`; skipped
                         with the reason where the package lacks it): fp8 e4m3 with one scale
                         per K/V head, int8 with one per token and head (quantize_kv_cache),
                         checked against the float32 reference on the dequantized cache.
                         Their GB/s count the bytes they read (1-byte K/V and the scales), so
                         their ms against flashgen_s0's (flashgen_paged_s0's) is the inverse
                         of the tokens/s ratio to the bf16 cache
  fa4, fa4_paged         FlashAttention-4's forward (split-KV heuristic) on the contiguous
                         cache and on the same page pool, where it is installed (else
                         "skipped: <why>"); FA4 has no in-place append (flashgen/bench/fa4.py)
and "host_us" (contiguous, paged): the Python + launch time of one call, measured over a
loop of calls before synchronising. When host_us exceeds the graph time, the eager call
is host-bound.
`--splits` times flashgen at fixed split counts besides the automatic choice (0).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..measure import read_flush_ms  # (the tuner times decode this way)
from . import fa4 as bench_fa4
from .timing import host_time_us

fg = None  # the generated package under test (llama_attn's kind: d=128, GQA, decode)

H_Q, H_KV, D = 32, 8, 128
TOL = 2e-2  # bf16 output against the float32 reference


def rotate_neox(x, cos, sin, pos):
    """x (..., d) rotated at the tables' row pos, GPT-NeoX halves over all of d: in float32,
    rounded to x's dtype (as the kernels round the rotated q and k)."""
    c, s = cos[pos].float(), sin[pos].float()
    x1, x2 = x[..., :D // 2].float(), x[..., D // 2:].float()
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], -1).to(x.dtype)


def rotary_reference(q, k_cache, v_cache, k_new, n, cos, sin):
    """The rotary append's reference (rotary_rows): its new key lands rotated on the last
    cached key, so it is element 0's keys with that one rotated, and q rotated at n - 1."""
    k_ref = k_cache[0:1, :n].clone()
    k_ref[0, n - 1] = rotate_neox(k_new[0, 0], cos, sin, n - 1)
    return reference_b0(rotate_neox(q[0:1], cos, sin, n - 1), k_ref, v_cache[0:1], n)


def rotary_rows(run, fg, q, caches, k_new, v_new, before, cos, sin, ref, paged="", **kw):
    """Time the rotary append (rows flashgen_{paged}rotary_append[_unfused]_s0), fused and
    with the append kernel first (FUSED_APPEND off)."""
    for suffix, fused in (("", True), ("_unfused", False)):
        saved = fg._decode.FUSED_APPEND
        fg._decode.FUSED_APPEND = fused  # (part of the plan key: read per call)
        try:
            run(f"flashgen_{paged}rotary_append{suffix}_s0",
                lambda: lambda: fg.flash_attn_with_kvcache(
                    q, caches[0], caches[1], k_new, v_new, cache_seqlens=before, causal=True,
                    rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False, **kw), ref)
        finally:
            fg._decode.FUSED_APPEND = saved


def reference_b0(q, k_cache, v_cache, n):
    """float32 attention of batch element 0 over its n cached keys: (1, H_q, d)."""
    qf = q[0].float()  # (1, H_q, d)
    kf = k_cache[0, :n].float().repeat_interleave(H_Q // H_KV, dim=1)  # (n, H_q, d)
    vf = v_cache[0, :n].float().repeat_interleave(H_Q // H_KV, dim=1)
    s = torch.einsum("qhd,nhd->hqn", qf, kf) / math.sqrt(D)
    return torch.einsum("hqn,nhd->qhd", torch.softmax(s, dim=-1), vf)


def sdpa_provider(backend, q, k, v):
    """q (B, 1, H_q, d), k/v (B, L, H_kv, d) -> a timed callable returning (B, 1, H_q, d),
    and a note on how GQA was served."""
    qs = q.transpose(1, 2).contiguous()
    ks, vs = (t.transpose(1, 2).contiguous() for t in (k, v))

    def gqa():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qs, ks, vs, enable_gqa=True).transpose(1, 2)
    try:
        gqa()
        return gqa, "enable_gqa"
    except Exception:
        pass
    kr, vr = (t.repeat_interleave(H_Q // H_KV, dim=1) for t in (ks, vs))

    def repeated():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(qs, kr, vr).transpose(1, 2)
    return repeated, "repeated K/V"


def flex_provider(q, k, v):
    from torch.nn.attention.flex_attention import flex_attention
    compiled = torch.compile(flex_attention, dynamic=False)
    qs = q.transpose(1, 2).contiguous()
    ks, vs = (t.transpose(1, 2).contiguous() for t in (k, v))
    return lambda: compiled(qs, ks, vs, enable_gqa=True).transpose(1, 2)


def to_pages(cache, table, page):
    """The same keys in a paged pool: page table[b, p] holds positions p*page.. of b."""
    b, n = cache.shape[:2]
    pool = torch.empty((table.numel(), page) + tuple(cache.shape[2:]), device=cache.device,
                       dtype=cache.dtype)
    pool[table.flatten().long()] = cache.reshape(b * (n // page), page, *cache.shape[2:])
    return pool


def graph_provider(fn):
    """fn captured in a CUDA graph (after a warm-up call that compiles): replaying it
    returns the captured output tensor, rewritten in place."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()

    def replay():
        graph.replay()
        return out
    return replay


def host_us(fn, calls=200):
    """Microseconds of host time per call: Python, checks and launches, not the GPU."""
    return host_time_us(fn, calls)[0]


def measure(fn, ref, nbytes):
    out = fn()
    err = (out[0].float() - ref).abs().max().item()
    if not err < TOL:
        return f"WRONG (max err {err:.3g})"
    ms = triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    clean = read_flush_ms(fn)
    return {"ms": round(ms, 4), "GB/s": round(nbytes / ms / 1e6, 1),
            "ms_read_flush": round(clean, 4), "GB/s_read_flush": round(nbytes / clean / 1e6, 1)}


ROW_META = ("gpu", "b", "n", "page", "bytes", "host_us", "paged_host_us")
# the quantized caches timed beside the bf16 one: (row name part, spec dtype, scales)
QUANT_CACHES = (("fp8kv", "fp8_e4m3", "head"), ("int8kv", "int8", "token"))


def quantized(fg, k_cache, v_cache, dtype_name, per):
    """(k_q, v_q, k_scale, v_scale) of a bf16 cache, by the package's quantize_kv_cache."""
    dtype = torch.float8_e4m3fn if dtype_name == "fp8_e4m3" else torch.int8
    (kq, ks), (vq, vs) = (fg.quantize_kv_cache(t, dtype, per) for t in (k_cache, v_cache))
    return kq, vq, ks, vs


def dequantized_b0(cache, per, n):
    """Batch element 0's first n rows of a quantized cache (k_q, v_q, k_scale, v_scale) in
    float32, (1, n, H_kv, d) each: what reference_b0 takes."""
    out = []
    for xq, s in ((cache[0], cache[2]), (cache[1], cache[3])):
        s = s[0, :n, :, None] if per == "token" else s[:, None]
        out.append((xq[0, :n].float() * s)[None])
    return out


def quantized_bytes(b, n, per):
    """What a decode step over a quantized cache reads: q and the output in bf16, K and V
    at a byte an element, and per-token scales (fp32, K's and V's)."""
    return 2 * (2 * b * H_Q * D) + 2 * b * n * H_KV * D + (2 * 4 * b * n * H_KV if per == "token"
                                                            else 0)


def bench(bs=(8, 1), ns=(4096, 16384, 65536), splits=(0,), page=256, graph=True,
          log=print, package=None):
    """One row per (B, KV length): {provider: {"ms", "GB/s"[, "gqa"]} or an error/WRONG
    string} plus the keys of ROW_META. `package`: the generated package to time (default:
    specs/llama.yaml's, built now). flashgen/bench/runner.py (`flashgen bench --suite
    decode`) calls this too."""
    global fg
    if package is None:
        from .providers import load_package
        package = load_package(None, 128)[0]
    fg = package
    try:
        fa4 = bench_fa4.load()
    except bench_fa4.Unavailable as e:
        fa4 = e
    gpu = torch.cuda.get_device_name()
    log(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, bf16, "
        f"H_q {H_Q}, H_kv {H_KV}, d {D}, N_q 1")
    rows = []
    torch.manual_seed(0)
    for b in bs:
        for n in ns:
            dev, dt = "cuda", torch.bfloat16
            q = torch.randn(b, 1, H_Q, D, device=dev, dtype=dt)
            k_cache = torch.randn(b, n, H_KV, D, device=dev, dtype=dt)
            v_cache = torch.randn(b, n, H_KV, D, device=dev, dtype=dt)
            seqlens = torch.full((b,), n, dtype=torch.int32, device=dev)
            nbytes = 2 * (2 * b * H_Q * D + 2 * b * n * H_KV * D)
            ref = reference_b0(q, k_cache, v_cache, n)
            row = {"gpu": gpu, "b": b, "n": n, "page": page, "bytes": nbytes}

            def run(name, make, ref=ref, nbytes=nbytes):
                try:
                    row[name] = measure(make(), ref, nbytes)
                except Exception as e:  # a provider that refuses a shape is reported
                    row[name] = f"error: {type(e).__name__}: {str(e)[:100]}"
                torch.cuda.empty_cache()

            with torch.inference_mode():
                def flashgen():
                    return fg.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                                      causal=True)
                for s in splits:
                    run(f"flashgen_s{s}", lambda s=s: lambda: fg.flash_attn_with_kvcache(
                        q, k_cache, v_cache, cache_seqlens=seqlens, causal=True, num_splits=s))
                row["host_us"] = host_us(flashgen)
                # a decode step that appends its token: the last cached key is rewritten with
                # itself, so the reference is unchanged
                k_new, v_new = k_cache[:, n - 1:n].clone(), v_cache[:, n - 1:n].clone()
                before = seqlens - 1
                run("flashgen_append_s0", lambda: lambda: fg.flash_attn_with_kvcache(
                    q, k_cache, v_cache, k_new, v_new, cache_seqlens=before, causal=True))
                angles = torch.rand(n, D // 2, device=dev, dtype=torch.float64) * 6.283
                cos, sin = angles.cos().to(dt), angles.sin().to(dt)
                last = k_cache[:, n - 1].clone()
                rot_ref = rotary_reference(q, k_cache, v_cache, k_new, n, cos, sin)
                rotary_rows(run, fg, q, (k_cache, v_cache), k_new, v_new, before, cos, sin,
                            rot_ref)
                k_cache[:, n - 1] = last  # (the rows below read the keys as they were)
                if graph:
                    run("flashgen_graph_s0", lambda: graph_provider(flashgen))
                run("flashgen_bi_s0", lambda: lambda: fg.flash_attn_with_kvcache(
                    q, k_cache, v_cache, cache_seqlens=seqlens, causal=True,
                    batch_invariant=True))
                quant = {}  # kv -> (k_q, v_q, k_scale, v_scale, per)
                for kv, dtype_name, per in QUANT_CACHES:
                    if dtype_name not in fg._registry.BUILT_FOR.get("kv_cache_dtypes", ()):
                        row[f"flashgen_{kv}_s0"] = (f"skipped: {fg.__name__} was built without "
                                                    f"{dtype_name} in kv_cache_dtypes")
                        continue
                    cache = quant[kv] = (*quantized(fg, k_cache, v_cache, dtype_name, per), per)
                    run(f"flashgen_{kv}_s0", lambda c=cache: lambda: fg.flash_attn_with_kvcache(
                        q, c[0], c[1], cache_seqlens=seqlens, causal=True, k_scale=c[2],
                        v_scale=c[3]), reference_b0(q, *dequantized_b0(cache, per, n), n),
                        quantized_bytes(b, n, per))
                for name, backend in (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                      ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION)):
                    note = {}

                    def make(backend=backend, note=note):
                        fn, how = sdpa_provider(backend, q, k_cache, v_cache)
                        note["gqa"] = how
                        return fn
                    run(name, make)
                    if isinstance(row[name], dict):
                        row[name]["gqa"] = note.get("gqa")
                if isinstance(fa4, Exception):
                    row["fa4"] = f"skipped: {fa4}"
                else:
                    run("fa4", lambda: lambda: bench_fa4.decode(fa4, q, k_cache, v_cache))
                run("flex", lambda: flex_provider(q, k_cache, v_cache))

                # the same keys in a paged pool with a shuffled block table
                if n % page == 0:
                    pages = n // page
                    table = torch.randperm(b * pages, device=dev).to(torch.int32).view(b, pages)
                    k_pool, v_pool = to_pages(k_cache, table, page), to_pages(v_cache, table, page)
                    del k_cache, v_cache
                    torch.cuda.empty_cache()
                    def paged():
                        return fg.flash_attn_with_kvcache(q, k_pool, v_pool, cache_seqlens=seqlens,
                                                          block_table=table, causal=True)
                    for s in splits:
                        run(f"flashgen_paged_s{s}", lambda s=s: lambda: fg.flash_attn_with_kvcache(
                            q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table,
                            causal=True, num_splits=s))
                    row["paged_host_us"] = host_us(paged)
                    run("flashgen_bi_paged_s0", lambda: lambda: fg.flash_attn_with_kvcache(
                        q, k_pool, v_pool, cache_seqlens=seqlens, block_table=table,
                        causal=True, batch_invariant=True))
                    if graph:
                        run("flashgen_paged_graph_s0", lambda: graph_provider(paged))
                    if isinstance(fa4, Exception):
                        row["fa4_paged"] = f"skipped: {fa4}"
                    else:
                        run("fa4_paged", lambda: lambda: bench_fa4.decode(
                            fa4, q, k_pool, v_pool, seqlens, table))
                    # (last: it rewrites the last key, rotated)
                    rotary_rows(run, fg, q, (k_pool, v_pool), k_new, v_new, before, cos, sin,
                                rot_ref, "paged_", block_table=table)
                    del k_pool, v_pool
                    for kv, (kq, vq, ks, vs, per) in quant.items():
                        pool = [to_pages(t, table, page) for t in (kq, vq)]
                        scales = ([to_pages(t, table, page) for t in (ks, vs)]
                                  if per == "token" else [ks, vs])
                        ref_q = reference_b0(q, *dequantized_b0((kq, vq, ks, vs), per, n), n)
                        run(f"flashgen_paged_{kv}_s0", lambda: lambda: fg.flash_attn_with_kvcache(
                            q, pool[0], pool[1], cache_seqlens=seqlens, block_table=table,
                            causal=True, k_scale=scales[0], v_scale=scales[1]), ref_q,
                            quantized_bytes(b, n, per))
                        del pool, scales
                quant.clear()
            rows.append(row)
            log(json.dumps(row))
            torch.cuda.empty_cache()
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, nargs="*", default=[8, 1])
    ap.add_argument("--n", type=int, nargs="*", default=[4096, 16384, 65536])
    ap.add_argument("--splits", type=int, nargs="*", default=[0])
    ap.add_argument("--page", type=int, default=256)
    ap.add_argument("--no-graph", dest="graph", action="store_false",
                    help="skip the CUDA-graph rows")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    for flag, values, least in (("--b", args.b, 1), ("--n", args.n, 1),
                                ("--page", [args.page], 1), ("--splits", args.splits, 0)):
        bad = [v for v in values if v < least]
        if bad:
            print(f"error: {flag} {bad[0]}: must be at least {least}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("error: the decode benchmark needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = bench(args.b, args.n, args.splits, args.page, args.graph,
                 log=lambda s: print(s, flush=True))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))

    skip = ROW_META
    cols = [c for c in rows[0] if c not in skip] if rows else []
    print("\nGB/s (q, K, V, o counted once)\n")
    print("| B | L | " + " | ".join(cols) + " |")
    print("|---|---|" + "---|" * len(cols))
    for r in rows:
        cells = [str(r[c]["GB/s"]) if isinstance(r.get(c), dict) else str(r.get(c, "-"))[:24]
                 for c in cols]
        print(f"| {r['b']} | {r['n']} | " + " | ".join(cells) + " |")
    print("\nhost us per call (contiguous, paged): "
          + ", ".join(f"B{r['b']} L{r['n']}: {r.get('host_us')}, {r.get('paged_host_us')}"
                      for r in rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
