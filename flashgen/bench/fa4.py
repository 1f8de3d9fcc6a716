"""FlashAttention-4 (the `flash-attn-4` package, `flash_attn.cute`: CuTe-DSL kernels for
sm90 and sm100) as a bench peer: whether it can run here, and its calls in the bench's
layouts. Written against 4.0.0b36; an optional import, never a dependency of flashgen.

FA4 takes q, k, v as (B, N, H, d) (varlen: (total, H, d)) and serves GQA itself (H a
multiple of H_kv); the bench's tensors are (B, H, N, d), so they go in as transposed views
(FA4 accepts any 16-byte-aligned strides, so no copy is timed) and the output comes back
the same way. Every argument after q, k, v is passed by name: b36 puts `qv` fourth.

Absent, failing to import, or on another GPU, FA4 is skipped, and the reason (which
package is missing, how to get it) goes into the provider's row. torch is imported only
by the calls.
"""
from __future__ import annotations

PACKAGE = "flash-attn-4"
MODULE = "flash_attn.cute"
ARCHS = (9, 10)  # sm90 (H100/H200) and sm100 (B200): the major versions FA4 has kernels for
HOW_TO_GET = (f"`pip install {PACKAGE}` (on the GPU machine without network: stage it as "
              "docs/H100_ANCHORS.md#fa4 says, then `. /tmp/fa4-site/env.sh`)")


class Unavailable(Exception):
    """FA4 cannot run on this machine; str() is the reason the report shows."""


def capability():
    """The current GPU's (major, minor), or None without CUDA."""
    import torch
    return torch.cuda.get_device_capability() if torch.cuda.is_available() else None


def load():
    """The `flash_attn.cute` module, or Unavailable with the reason."""
    import importlib
    try:
        module = importlib.import_module(MODULE)
    except ModuleNotFoundError as e:
        if e.name in ("flash_attn", MODULE):
            raise Unavailable(f"{PACKAGE} is not installed (no module {MODULE}); get it with "
                              f"{HOW_TO_GET}") from None
        # FA4 itself is there, one of its dependencies (cutlass DSL, quack, einops...) not
        raise Unavailable(f"{MODULE} ({PACKAGE}) needs the module {e.name!r}, which is not "
                          f"installed; install {PACKAGE} with its dependencies: "
                          f"{HOW_TO_GET}") from None
    except Exception as e:  # a broken install (a missing CUDA library, a DSL mismatch)
        raise Unavailable(f"{MODULE} ({PACKAGE}) failed to import: {type(e).__name__}: "
                          f"{str(e)[:160]}") from None
    cap = capability()
    if cap is None or cap[0] not in ARCHS:
        where = "no CUDA GPU" if cap is None else f"this GPU is sm{cap[0]}{cap[1]}"
        raise Unavailable(f"{PACKAGE} runs on sm90/sm100 GPUs only; {where}")
    return module


def version() -> str | None:
    """The installed distribution's version (FA4's own __version__ asks for a distribution
    named "fa4" and reads 0.0.0)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version
    try:
        return dist_version(PACKAGE)
    except PackageNotFoundError:
        return None


def _out(result):
    """FA4's output tensor: some versions return (out, lse), others out alone."""
    return result[0] if isinstance(result, (tuple, list)) else result


def _window(window):
    """flashgen's (left, right) window, a negative or None side unbounded, as FA4's
    window_size: FA4 reads None as unbounded and a lone -1 as a real bound (b36 treats -1
    as unbounded only when both sides are negative)."""
    if window is None:
        return (None, None)
    left, right = window
    return (None if left is None or left < 0 else left,
            None if right is None or right < 0 else right)


def _check_heads(h, h_kv):
    if h_kv < 1 or h % h_kv:
        raise ValueError(f"{h} query heads are not a multiple of {h_kv} key/value heads")


def attention(fa4, q, k, v, causal=False, scale=None, window=None):
    """Dense attention of q (B, H, Nq, d), k/v (B, H_kv, Nk, d) through fa4.flash_attn_func;
    the output (B, H, Nq, d_v). `scale` defaults to d**-0.5 (passed explicitly, not left to
    the version's default)."""
    _check_heads(q.shape[1], k.shape[1])
    out = fa4.flash_attn_func(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
        softmax_scale=q.shape[-1] ** -0.5 if scale is None else scale, causal=causal,
        window_size=_window(window))
    return _out(out).transpose(1, 2)


def varlen_attention(fa4, q, k, v, cu_q, cu_k, max_q, max_k, causal=False, scale=None,
                     window=None, page_table=None, seqused_k=None):
    """Packed attention of q (total_q, H, d), k/v (total_k, H_kv, d) with int32 cu_seqlens
    through fa4.flash_attn_varlen_func; the output (total_q, H, d_v). With page_table
    (B, pages) int32 and seqused_k (B,), k/v are a page pool (pages, page, H_kv, d) and
    cu_k is None (chunked prefill)."""
    _check_heads(q.shape[1], k.shape[-2])
    paged = {} if page_table is None else dict(page_table=page_table, seqused_k=seqused_k)
    out = fa4.flash_attn_varlen_func(
        q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, max_seqlen_q=max_q, max_seqlen_k=max_k,
        softmax_scale=q.shape[-1] ** -0.5 if scale is None else scale, causal=causal,
        window_size=_window(window), **paged)
    return _out(out)


def decode(fa4, q, k_cache, v_cache, seqused=None, page_table=None):
    """One decode step, q (B, 1, H, d) against a cache (B, L, H_kv, d) or, with page_table
    (B, pages) int32, a page pool (pages, page, H_kv, d) read up to seqused (B,) int32 keys:
    the output (B, 1, H, d). FA4 (b36) has no kvcache call and no in-place append; its
    forward takes a page table and per-sequence key counts, and num_splits=0 picks its
    split-KV heuristic (its default of 1 split leaves most SMs idle at one query token).
    Not causal: the one query sees every cached key either way."""
    _check_heads(q.shape[2], k_cache.shape[2])
    scale = q.shape[-1] ** -0.5
    if page_table is None and seqused is None:
        out = fa4.flash_attn_func(q, k_cache, v_cache, softmax_scale=scale, num_splits=0)
    else:
        out = fa4.flash_attn_varlen_func(q, k_cache, v_cache, seqused_k=seqused,
                                         page_table=page_table, softmax_scale=scale,
                                         num_splits=0)
    return _out(out)
