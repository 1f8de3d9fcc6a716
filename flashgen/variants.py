"""Kernel variants and their canonical names.

A variant is one compiled specialisation: (kind, mask, dropout, head dim, dtype, mods). Its
canonical name, e.g. ``fwd_causal_d128_bf16``, names the rendered file, the registry
entry, the tuning record and the benchmark row, so one string follows a kernel from the
spec to a benchmark table (the way FlashInfer's URIs do).

Sequence lengths, batch, heads, GQA grouping, strides and window extents are run-time
arguments, never part of a variant: a new shape must not compile a new kernel.
"""
from __future__ import annotations

from dataclasses import dataclass

from .spec import FP8_DTYPES, Spec

# spec mask name -> the word it contributes to a canonical name ("none" contributes nothing)
MASK_WORDS = {"none": "", "causal": "causal", "sliding_window": "window"}
DTYPE_BYTES = {"fp16": 2, "bf16": 2, "fp32": 4, "fp8_e4m3": 1}
TORCH_DTYPES = {"fp16": "torch.float16", "bf16": "torch.bfloat16", "fp32": "torch.float32",
                "fp8_e4m3": "torch.float8_e4m3fn"}
KIND_TEMPLATES = {"fwd": "fwd.py.j2", "bwd": "bwd.py.j2", "decode": "decode.py.j2"}


@dataclass(frozen=True, order=True)
class Variant:
    kind: str  # "fwd" | "bwd" | "decode"
    mask: str  # a spec mask name: none | causal | sliding_window
    dropout: bool
    head_dim: int
    dtype: str  # fp16 | bf16 | fp32 | fp8_e4m3
    mods: tuple = ()  # names of the spec's mods, in the order they apply
    v_head_dim: int | None = None  # V's (and the output's) head dim when it is not Q's (MLA)

    @property
    def v_dim(self) -> int:
        return self.v_head_dim or self.head_dim

    @property
    def plan_dim(self) -> int:
        """The head dim tiles are planned for: the larger of Q's and V's (a conservative
        estimate of shared memory and registers when they differ)."""
        return max(self.head_dim, self.v_dim)

    @property
    def dim_word(self) -> str:
        """d128, or d192v128 when V's head dim differs from Q's and K's."""
        return f"d{self.head_dim}" + (f"v{self.v_dim}" if self.v_dim != self.head_dim else "")

    @property
    def name(self) -> str:
        words = [self.kind, MASK_WORDS[self.mask], *self.mods, "dropout" if self.dropout else "",
                 self.dim_word, self.dtype]
        return "_".join(w for w in words if w)

    @property
    def template(self) -> str:
        return KIND_TEMPLATES[self.kind]

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]


def variants_for(spec: Spec) -> tuple[Variant, ...]:
    """Every variant a spec asks for, in a stable order (the registry's and the files'):
    each forward has a backward with the same mask, dropout, head dim and dtype."""
    dropouts = (False, True) if spec.dropout else (False,)
    training = [
        Variant(kind, mask, dropout, d, dtype, (), dv if dv != d else None)
        for kind in ("fwd", "bwd")
        for mask in spec.masks
        for dropout in dropouts
        for d, dv in spec.head_dim_pairs
        for dtype in spec.dtypes
    ]
    # decoding (KV cache, split-KV): forward only, no dropout; every head_dims entry,
    # `decode_only` ones (DeepSeek's 576/512 latent cache) included
    decoding = [
        Variant("decode", mask, False, d, dtype, (), dv if dv != d else None)
        for mask in spec.masks
        for d, dv in spec.decode_pairs
        for dtype in spec.dtypes
    ] if spec.decode else []
    # fp8 (spec.check_fp8): forward and backward only, no mods -- attn_mask's implicit
    # variants, on by default, are built for the other dtypes alone
    unscaled = [dt for dt in spec.dtypes if dt not in FP8_DTYPES]
    # the spec's `variants:` (mods on top of a band mask): forward and backward, and
    # decode when the spec builds decode kernels (not for SDPA's attn_mask, which decode
    # does not take)
    modded = [
        Variant(kind, mv.mask, dropout, d, dtype, mv.mods, dv if dv != d else None)
        for mv in spec.mod_variants
        for kind in ("fwd", "bwd")
        for dropout in dropouts
        for d, dv in spec.head_dim_pairs
        for dtype in unscaled
    ] + ([
        Variant("decode", mv.mask, False, d, dtype, mv.mods, dv if dv != d else None)
        for mv in spec.mod_variants if mv.mods != ("sdpa_mask",)
        for d, dv in spec.decode_pairs
        for dtype in unscaled
    ] if spec.decode else [])
    out = tuple(training + decoding + modded)
    names = [v.name for v in out]
    for v in out:
        if names.count(v.name) > 1:
            raise spec.error("variants", f"two variants share the name {v.name!r}",
                             "mod names that keep variant names apart",
                             "rename one of the mods")
    return out


def reads_quantized_kv(spec: Spec, variant: Variant) -> bool:
    """Whether a variant's kernels take 1-byte KV caches (spec `kv_cache_dtypes` fp8_e4m3,
    int8) and their scales: the fp16/bf16 decode kernels, and the fp16/bf16 forwards
    without dropout (chunked prefill over a paged cache runs them). A package that builds
    no quantized cache renders none of that code."""
    return (bool(spec.kv_quant_dtypes) and variant.kind in ("decode", "fwd")
            and variant.dtype in ("fp16", "bf16") and not variant.dropout)
