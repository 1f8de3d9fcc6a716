"""What `flashgen bench` measures: the suites, their shapes and providers, the case list,
the FLOP formula and the result files' names. Pure Python (no torch), so the dry run and
the tests run anywhere.

Suites:
  training  the H100 anchor table's shapes (docs/H100_ANCHORS.md): bf16, B*N = 16k
            tokens, H*d = 2048, d = 64 (gpt2_attn) and 128 (llama_attn),
            N = 512 .. 16k, causal and not, fwd and bwd ("bwd" = `o.backward(do)` alone).
  dropout   causal d=128, H=16, B*N = 16k, N = 1k/4k, p=0.1: flashgen built from
            specs/bench/dropout_d128.yaml with and
            without dropout, and the SDPA backends that take dropout_p, and naive PyTorch.
  decode    flashgen/bench/decode.py's measurement (one query token, B=8, Hq=32, Hkv=8,
            d=128, KV length 4k/16k/64k), imported and run as is; GB/s.
  small     the seeds' small shapes: H=16, d=64, (B, N) = (4, 512), (8, 59), (1, 2048),
            causal and not, forward; ms per call, plus flashgen's host dispatch time.
  mods      flashgen's mod variants against FlexAttention with the same mods
            (flashgen/bench/mods.py).

FLOPs: forward 4*B*H*Nq*Nk*d, halved when causal; backward 2.5x the forward (the anchors'
and the FlashAttention papers' convention).
"""
from __future__ import annotations

from dataclasses import dataclass, field

SUITES = ("training", "dropout", "decode", "small", "mods")
TRAINING_N = (512, 1024, 2048, 4096, 8192, 16384)
TRAINING_D = (64, 128)
DROPOUT_N = (1024, 4096)
DROPOUT_P = 0.1
DECODE_B = (8, 1)
DECODE_N = (4096, 16384, 65536)
SMALL_SHAPES = ((4, 512), (8, 59), (1, 2048))
SMALL_H, SMALL_D = 16, 64
NAIVE_MAX_N = 8192  # naive attention materialises the N x N scores
TOKENS, WIDTH = 16384, 2048  # B*N and H*d of the anchor table

# head dim -> the example spec whose package the training suite times
SPECS = {64: "gpt2.yaml", 128: "llama.yaml"}
DROPOUT_SPEC = "bench/dropout_d128.yaml"
# head dim -> the spec whose package has the fp8 kernels the flashgen_fp8 rows time
FP8_SPECS = {64: "gpt2.yaml", 128: "bench/fp8_d128.yaml"}

# provider name -> what it is (the dry run and the table's headers)
PROVIDERS = {
    "flashgen": "the generated package (gpt2_attn for d=64, llama_attn for d=128; "
                "bench_dropout_attn for the dropout suite, mods_attn for the mods suite)",
    "flashgen_p0": "flashgen's dropout package at p=0 (dropout suite: its own baseline)",
    "flashgen_tl": "the same package with every call on the `tl` kernel family (on Hopper the "
                   "package's default is the Gluon family where a variant has one)",
    "flashgen_fp8kv": "decode: the same package over an fp8 e4m3 KV cache, one scale per K/V "
                      "head (kv_cache_dtypes), contiguous and paged",
    "flashgen_int8kv": "decode: the same package over an int8 KV cache, one scale per token "
                       "and head (kv_cache_dtypes), contiguous and paged",
    "flashgen_fp8": "training: flashgen's fp8 kernels on e4m3 copies of the inputs, one scale a "
                    "tensor, bf16 out (bench/fp8.py; opt in with --providers)",
    "flashgen_fp8_gluon": "training: flashgen_fp8 with the Gluon family forced (every fp8 "
                          "call on Gluon, tiny ones included; opt in with --providers)",
    "cudnn_fp8": "training: cuDNN's fp8 SDPA graphs (nvidia-cudnn-frontend), e4m3 in and out, "
                 "where installed; skipped with the reason otherwise (opt in with --providers)",
    "flashgen_bi": "decode: the same package with batch_invariant=True (its pinned tile and "
                   "fixed splits), contiguous and paged",
    "sdpa_flash": "SDPA, FLASH_ATTENTION backend (FlashAttention-2)",
    "sdpa_cudnn": "SDPA, CUDNN_ATTENTION backend",
    "sdpa_efficient": "SDPA, EFFICIENT_ATTENTION backend (dropout suite; training when named)",
    "fa4": "FlashAttention-4 (flash-attn-4, flash_attn.cute: CuTe-DSL kernels, sm90/sm100), where "
           "installed; skipped with the reason otherwise (decode: its split-KV forward on the "
           "contiguous cache and, fa4_paged, on the page pool)",
    "flex": "torch.compile(flex_attention), causal BlockMask from create_block_mask (mods suite: "
            "the same score_mod / mask_mod as flashgen's mod)",
    "naive": "PyTorch matmul-softmax-matmul (N <= 8192 only)",
}
# fa4 is in neither the dropout nor the mods suite: FA4 has no dropout, and its score and
# mask mods are CuTe-DSL functions of its own, not the mods suite's
MODS_PROVIDERS = ("flashgen", "flex")
TRAINING_PROVIDERS = ("flashgen", "flashgen_tl", "sdpa_flash", "sdpa_cudnn", "fa4", "flex",
                      "naive")
# training rows that run only when named (--providers flashgen_fp8 cudnn_fp8 flashgen): fp8
FP8_PROVIDERS = ("flashgen_fp8", "flashgen_fp8_gluon", "cudnn_fp8")
DROPOUT_PROVIDERS = ("flashgen_p0", "flashgen", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient",
                     "naive")
# decode.py's own rows: flashgen_s0, flashgen_append_s0, flashgen_rotary_append[_unfused]_s0,
# flashgen_graph_s0, flashgen_paged_*, flashgen_fp8kv_s0, flashgen_int8kv_s0 (and paged), flashgen_bi_s0 (and paged), sdpa_flash,
# sdpa_cudnn, fa4, fa4_paged, flex; --providers filters them by prefix
DECODE_PROVIDERS = ("flashgen", "flashgen_fp8kv", "flashgen_int8kv", "flashgen_bi", "sdpa_flash",
                    "sdpa_cudnn", "fa4", "flex")


@dataclass(frozen=True)
class Case:
    suite: str
    mode: str  # fwd | bwd
    d: int
    causal: bool
    b: int
    h: int
    n: int
    p: float = 0.0
    providers: tuple = field(default=(), compare=False)
    mod: str = ""  # the mods suite's case (mods.MOD_CASES)
    dv: int = 0  # V's head dim where it is not d (a --spec pair such as {qk: 192, v: 128})

    def label(self) -> str:
        causal = "causal" if self.causal else "full"
        p = f" p={self.p}" if self.p else ""
        if self.suite == "mods":
            return (f"{self.suite:8s} {self.mode} d={self.d} {self.mod:12s} B={self.b} "
                    f"H={self.h} N={self.n}")
        if self.suite == "decode":
            return (f"{self.suite:8s} 1 query token d={self.d} B={self.b} Hq={self.h} "
                    f"Hkv={self.h // 4} KV={self.n}")
        dims = f"{self.d}/{self.dv}" if self.dv else f"{self.d}"
        return (f"{self.suite:8s} {self.mode} d={dims} {causal:6s} B={self.b} H={self.h} "
                f"N={self.n}{p}")


def keep(names, wanted):
    """The names `wanted` selects: a name, or its sub-rows (flashgen -> flashgen_p0)."""
    return tuple(n for n in names if wanted is None or any(
        n == w or n.startswith(w + "_") for w in wanted))


def plan_cases(suite="training", ns=None, ds=None, modes=("fwd", "bwd"), providers=None,
               causals=(False, True), dvs=None):
    """The cases a run measures, each with the providers it would try. `ns` overrides the
    N list of the training and dropout suites (and the KV lengths of decode); `ds` the head
    dims of training; `modes` applies to training and dropout; `providers` filters by name
    (a name also selects its variants, e.g. flashgen -> flashgen_p0, flashgen_s0); `causals`
    the causalities of the training and small suites (a user's spec may lack a mask); `dvs`
    V's head dim for the training suite's head dims that have their own (spec_v_dims)."""
    suites = SUITES if suite == "all" else (suite,)
    cases = []
    for s in suites:
        if s == "training":
            for mode in modes:
                for d in (ds or TRAINING_D):
                    h = WIDTH // d
                    for causal in causals:
                        for n in (ns or TRAINING_N):
                            names = [x for x in TRAINING_PROVIDERS
                                     if x != "naive" or n <= NAIVE_MAX_N]
                            names += [x for x in FP8_PROVIDERS if x in (providers or ())]
                            # (SDPA's efficient kernel: the one PyTorch runs past d = 256,
                            # flash and cuDNN refusing it; a row only when named)
                            names += [x for x in ("sdpa_efficient",) if x in (providers or ())]
                            cases.append(Case(s, mode, d, causal, max(TOKENS // n, 1), h, n,
                                              providers=keep(names, providers),
                                              dv=(dvs or {}).get(d, 0)))
        elif s == "dropout":
            for n in (ns or DROPOUT_N):
                for mode in modes:
                    names = [x for x in DROPOUT_PROVIDERS if x != "naive" or n <= NAIVE_MAX_N]
                    cases.append(Case(s, mode, 128, True, max(TOKENS // n, 1), 16, n,
                                      DROPOUT_P, providers=keep(names, providers)))
        elif s == "decode":
            for b in DECODE_B:
                for n in (ns or DECODE_N):
                    cases.append(Case(s, "fwd", 128, True, b, 32, n,
                                      providers=keep(DECODE_PROVIDERS, providers)))
        elif s == "mods":
            from .mods import MOD_CASES, MODS_D, MODS_H, MODS_N
            for mode in modes:
                for d in (ds or MODS_D):
                    for mod, (_, _, causal_flops) in MOD_CASES.items():
                        for n in (ns or MODS_N):
                            cases.append(Case(s, mode, d, causal_flops, max(TOKENS // n, 1),
                                              MODS_H, n, providers=keep(MODS_PROVIDERS, providers),
                                              mod=mod))
        elif s == "small":
            for b, n in SMALL_SHAPES:
                for causal in causals:
                    cases.append(Case(s, "fwd", SMALL_D, causal, b, SMALL_H, n,
                                      providers=keep(TRAINING_PROVIDERS, providers)))
        else:
            raise ValueError(f"unknown suite {s!r}; one of {', '.join(SUITES)} or all")
    return cases


def flops(b, h, nq, nk, d, causal, mode, dv=0):
    """FLOPs of one call (docs/H100_ANCHORS.md): forward 4*B*H*Nq*Nk*d, halved when
    causal; backward 2.5x the forward. GQA counts query heads. With V's own head dim dv,
    2*B*H*Nq*Nk*(d + dv) (Q K^T at d, P V at dv)."""
    f = 2 * b * h * nq * nk * (d + (dv or d))
    if causal:
        f /= 2
    return 2.5 * f if mode == "bwd" else float(f)


def tflops(ms, b, h, n, d, causal, mode, dv=0):
    return flops(b, h, n, n, d, causal, mode, dv) / (ms * 1e-3) / 1e12


def result_name(suite, ns=None, ds=None, modes=("fwd", "bwd"), providers=None,
                package=None) -> str:
    """bench_<suite>[_<package>][_<modes>][_d<D>][_n<N>][_<providers>]: runs split by filter
    (to fit a time limit), or of a user's spec (its package name), write separate files
    instead of overwriting each other."""
    parts = ["bench", suite] + ([package] if package else [])
    if modes and set(modes) != {"fwd", "bwd"}:
        parts.append("-".join(modes))
    if ds:
        parts.append("d" + "-".join(map(str, ds)))
    if ns:
        parts.append("n" + "-".join(map(str, ns)))
    if providers:
        parts.append("-".join(providers))
    return "_".join(parts)


def dry_run_text(cases) -> str:
    lines = [f"{len(cases)} cases"]
    for c in cases:
        lines.append(f"  {c.label()}: {', '.join(c.providers) or '(no provider selected)'}")
    used = sorted({p for c in cases for p in c.providers})
    lines.append("providers:")
    for p in used:
        desc = PROVIDERS.get(p) or PROVIDERS.get(p.split("_")[0], "")
        lines.append(f"  {p}: {desc}")
    return "\n".join(lines)


def spec_causals(spec_path) -> tuple:
    """The causalities a spec's package serves (its `none` and `causal` masks)."""
    from ..spec import load_spec
    masks = load_spec(spec_path).masks
    return tuple(c for c, m in ((False, "none"), (True, "causal")) if m in masks)


def spec_head_dims(spec_path) -> list:
    from ..spec import load_spec
    return list(load_spec(spec_path).head_dims)


def spec_v_dims(spec_path) -> dict:
    """{Q/K head dim: V's} of a spec's pairs whose V has its own head dim."""
    from ..spec import load_spec
    return {qk: v for qk, v in load_spec(spec_path).head_dim_pairs if v != qk}


def spec_package(spec_path) -> str:
    from ..spec import load_spec
    return load_spec(spec_path).package
