"""Stage 5a, measure: what one tuning trial does on the GPU -- check a launch config's
output against a float64 reference at a small shape, then time it at a shape that fills the
GPU (B*N = 16k tokens, H*d = 2048, as `flashgen bench`'s training suite; decoding at 8 sequences x 8
KV heads with one query token). `flashgen tune` (flashgen/tune.py) runs the studies and
hands each trial's config to a measure built here by :func:`gpu_measure`; the tests pass a
synthetic measure instead.

A measure returns milliseconds, or a :class:`WrongAnswer` (the config ran but computed a
wrong result); it raises :class:`TuneAborted` when the CUDA context broke and the process
cannot go on.
"""
from __future__ import annotations

import math
from typing import Callable, Mapping

from . import planner_core
from .errors import FlashgenError

TOKENS = 16384          # B * N of the timed shape
HIDDEN = 2048           # H * d of the timed shape
DECODE_B = 8               # decode timing: sequences ...
DECODE_KV_HEADS = 8        # ... and key/value heads (Llama-3-8B's serving shape)
CHECK_PAD = 37          # the check's sequence length: 2 * the larger block + 37 (ragged)
DROPOUT_P = 0.1         # dropout variants are called with this probability
DROPOUT_SEED = 4321     # and this generator seed, so the check can replay their mask
# |out - ref| / max(1, |ref|), elementwise max, per dtype (see tests/conftest.py)
FWD_TOL = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}
BWD_TOL = {"fp32": 1e-3, "fp16": 2e-2, "bf16": 1e-1}
SLOW_CALL_MS = 20.0             # calls this slow are timed SLOW_CALL_RUNS times, not do_bench'd
SLOW_CALL_RUNS = 3
assert DECODE_B * DECODE_KV_HEADS == planner_core.TUNED_DECODE_PROGRAMS  # the runtime rescales by it


class WrongAnswer:
    """What a measure returns for a config that ran but computed a wrong result."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"WrongAnswer({self.reason!r})"


class TuneAborted(FlashgenError):
    """The tune cannot go on in this process (e.g. the CUDA context broke); the study is
    intact and a rerun resumes it."""


Measure = Callable[[dict], "float | WrongAnswer"]


def _fmt_config(cfg: Mapping | None) -> str:
    if not cfg:
        return "-"
    text = f"{cfg['block_m']}x{cfg['block_n']} w{cfg['num_warps']} s{cfg['num_stages']}"
    extra = [f"{k}={v}" for k, v in cfg.items()
             if k not in ("block_m", "block_n", "num_warps", "num_stages")]
    return " ".join([text, *extra])


def _reason(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------
# the GPU measurement
# ----------------------------------------------------------------------------------------

def _torch_dtype(name: str):
    import torch

    return {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}[name]


def _rel_err(x, ref) -> float:
    x = x.double()
    ref = ref.double()
    if not bool(x.isfinite().all()):
        return math.inf
    return ((x - ref).abs() / ref.abs().clamp(min=1)).max().item()


def bench_ms(fn, grads=None) -> float:
    """Median milliseconds of `fn()` with the L2 cache flushed before each run.

    A fast call goes to triton.testing.do_bench (25 ms of warm-up, 100 ms of runs). A slow
    one (SLOW_CALL_MS or more: fp32 or dropout variants at the long buckets, up to 0.3 s a
    call) would still cost do_bench eight calls -- five just to estimate the time -- which
    at 15 minutes for a whole spec is more than a study's share; it gets one warm-up call
    and SLOW_CALL_RUNS timed ones, whose median is as steady as a fast call's 100 ms."""
    import torch
    import triton

    def clear_grads():
        for t in grads or ():
            t.grad = None

    clear_grads()
    fn()  # compiles at this shape, if the check's shape did not
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    clear_grads()
    start.record()
    fn()
    end.record()
    end.synchronize()
    first = start.elapsed_time(end)
    if first < SLOW_CALL_MS:
        return float(triton.testing.do_bench(fn, warmup=25, rep=100, grad_to_none=grads,
                                             return_mode="median"))
    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
    times = [first]
    for _ in range(SLOW_CALL_RUNS - 1):
        clear_grads()
        flush.zero_()
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return float(sorted(times)[len(times) // 2])


def read_flush_ms(fn, reps: int = 100) -> float:
    """Median milliseconds of `fn()` with L2 flushed by READING 256 MB before each call.

    do_bench flushes by writing 256 MB, which leaves up to the L2's 50 MB of dirty lines to
    be written back to HBM while the timed kernel runs. A memory-bound kernel of tens of
    microseconds (decoding) pays that writeback inside its own time, ~8 us of a 4k-key
    decode on the H100 (docs/PERFORMANCE.md, Decoding; the log in 23fd84a), and the noise it
    adds is as large as the differences between split counts. A read leaves L2 as cold for
    the kernel's inputs with nothing to write back. `flashgen bench --suite decode` reports
    both (`_rf` rows)."""
    import torch

    global _READ_FLUSH
    if _READ_FLUSH is None:
        _READ_FLUSH = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    fn()
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for start, end in events:
        _READ_FLUSH.sum()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return float(times[len(times) // 2])


_READ_FLUSH = None


class Workload:
    """The calls one variant's trials make: a correctness check at a small shape and the
    timing at the bucket's shape, through the built package's public flash_attn_func
    (tensors allocated (B, H, N, d) like `flashgen bench` and passed as (B, N, H, d)
    views), with `_runtime.override_config(**config)` selecting the config.

    A variant with mods is called as a user calls it, `mods=(...)` and the mods' tensors
    and params as keywords, valued as a model would pass them (bench.mods.call_inputs:
    documents of random lengths, prefixes of N/8..N/2 tokens, ...; a block mask's speed
    depends on its sparsity), made once per shape and kept for the study; the check's
    float64 reference applies the same mods to the same values (check.mod_reference).
    The mod tensors are passed without requires_grad (a mask or ids never has one; a
    bias's or sink's gradient is not what the tuned launch decides)."""

    def __init__(self, pkg, variant: str, facts: Mapping, bucket: int, device,
                 window=(-1, -1), gqa: bool = False, default: Mapping | None = None,
                 check_n: int | None = None):
        import torch

        self.torch = torch
        self.pkg = pkg
        self.variant = variant
        self.kind = facts["kind"]
        self.mask = facts["mask"]
        self.dropout = bool(facts.get("dropout"))
        self.d = facts["head_dim"]
        # V's (and the output's) head dim: its own in an MLA variant ({qk: d, v: dv}),
        # which V must have for the variant's kernel to take the call
        self.dv = facts.get("v_head_dim") or self.d
        self.dtype_name = facts["dtype"]
        self.dtype = _torch_dtype(facts["dtype"])
        self.bucket = int(bucket)
        self.device = torch.device(device)
        self.window = tuple(window) if self.mask == "sliding_window" else (-1, -1)
        self.gqa = gqa
        self.default = dict(default) if default is not None else None
        self.check_n = check_n
        self.mods = tuple(facts.get("mods") or ())
        self._mod_args = {}   # (B, Hq, N, small) -> the mods' keyword arguments
        self._mod_refs = {}   # (B, Hq, N) -> the check's (score mod, mask, sink)
        self._seed = 0
        self._timed = None

    # -- calls ------------------------------------------------------------------------
    def call(self, q, k, v, window=None, small=False):
        """(B, H, N, d) tensors -> out (B, N, H, d); with the variant's mods and their
        arguments for this shape (mod_args; `small`: the check's)."""
        p = DROPOUT_P if self.dropout else 0.0
        b, h_q, n, _ = q.shape
        mods = {"mods": self.mods, **self.mod_args(b, h_q, n, small)} if self.mods else {}
        return self.pkg.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                        dropout_p=p, causal=self.mask == "causal",
                                        window_size=self.window if window is None else window,
                                        **mods)

    def _mod_objects(self) -> list:
        """The variant's mods (flashgen.mods.Mod), from the package's registry."""
        from .mods import make_mod

        out = []
        for name in self.mods:
            m = self.pkg._registry.MODS[name]
            tensors = {t: f"[{', '.join(map(str, dims))}] {dtype}"
                       for t, dims, dtype in m["tensors"]}
            out.append(make_mod(name, m["kind"], m["source"], dict(m["params"]), tensors,
                                m.get("builtin")))
        return out

    def mod_args(self, b: int, h_q: int, n: int, small: bool = False) -> dict:
        """The mods' tensors and params of a call of this shape (bench.mods.call_inputs),
        made on the first call of the shape and kept."""
        key = (b, h_q, n, small)
        if key not in self._mod_args:
            from .bench.mods import call_inputs

            self._mod_args[key] = call_inputs(self._mod_objects(), b, h_q, n, n, self.device,
                                              small=small)
        return self._mod_args[key]

    def mod_reference(self, b: int, h_q: int, n: int) -> tuple:
        """(score mod, mask, sink) of the check's float64 reference at this shape
        (check.mod_reference over the check's mod arguments); Nones without mods."""
        if not self.mods:
            return None, None, None
        key = (b, h_q, n)
        if key not in self._mod_refs:
            from .check import mod_reference

            self._mod_refs[key] = mod_reference(self._mod_objects(),
                                                self.mod_args(b, h_q, n, small=True),
                                                b, h_q, n, n)
        return self._mod_refs[key]

    def _inputs(self, b, h_q, h_kv, n, grad: bool):
        torch = self.torch
        gen = torch.Generator(device=self.device)
        gen.manual_seed(1000 + self._seed)
        self._seed += 1
        shape_q, shape_kv = (b, h_q, n, self.d), (b, h_kv, n, self.d)
        q = torch.randn(shape_q, generator=gen, device=self.device, dtype=self.dtype)
        k = torch.randn(shape_kv, generator=gen, device=self.device, dtype=self.dtype)
        v = torch.randn((b, h_kv, n, self.dv), generator=gen, device=self.device,
                        dtype=self.dtype)
        if grad:
            q, k, v = (t.requires_grad_() for t in (q, k, v))
        return q, k, v

    def _run(self, config, q, k, v, do=None, window=None):
        """Forward (and with `do`, the backward) of one call at the check's shape; `config`
        applies to this variant's kind only: a backward config is never launched on the
        forward kernel."""
        torch = self.torch
        override = self.pkg._runtime.override_config
        torch.manual_seed(DROPOUT_SEED)  # the dropout stream, identical for every config
        if self.kind == "fwd":
            with override(**config):
                return (self.call(q, k, v, window, small=True),)
        out = self.call(q, k, v, window, small=True)
        with override(**config):
            return torch.autograd.grad(out, (q, k, v), do)

    # -- the check ----------------------------------------------------------------------
    def check(self, config: Mapping) -> str | None:
        """None if `config` computes this variant correctly on fresh random inputs, else why
        not. Reference: float64 (flashgen.reference); for dropout variants with the keep mask
        the call drew, replayed by the package's `dropout_mask` hook; with mods, their
        arguments for this shape (mod_args(small=True)) applied by the reference too."""
        torch = self.torch
        from .reference import attention_ref, visible_mask

        n = self.check_n or 2 * max(config["block_m"], config["block_n"]) + CHECK_PAD
        h_q, h_kv = (4, 2) if self.gqa else (2, 2)
        window = tuple(min(w, n // 3) if w >= 0 else w for w in self.window)
        grad = self.kind == "bwd"
        q, k, v = self._inputs(2, h_q, h_kv, n, grad)
        do = torch.randn((2, n, h_q, self.dv), device=self.device, dtype=self.dtype) if grad else None
        got = self._run(config, q, k, v, do, window)
        keep, against = None, "the float64 reference"
        if self.dropout and hasattr(self.pkg, "dropout_mask"):
            torch.manual_seed(DROPOUT_SEED)   # replay the keep mask the call drew
            keep = self.pkg.dropout_mask(2, h_q, n, n, DROPOUT_P, device=self.device)
            against += " with the call's dropout mask"
        if self.dropout and keep is None:  # a package without the replay hook
            if self.default is None:
                return "no reference for a dropout variant (no default config given)"
            want = self._run(self.default, q, k, v, do, window)
            against = "the planner config's output under the same dropout seed"
        else:
            vis = visible_mask(n, n, causal=self.mask == "causal", window=window,
                               bottom_right=True)
            score_mod, mod_mask, sink = self.mod_reference(2, h_q, n)
            if mod_mask is not None:
                vis = vis & mod_mask
            if self.mods:
                against += f" with the mods {'+'.join(self.mods)}"
            q64, k64, v64 = (t.detach().double().requires_grad_(grad) for t in (q, k, v))
            ref, _ = attention_ref(q64, k64, v64, vis, keep=keep,
                                   dropout_p=DROPOUT_P if keep is not None else 0.0,
                                   score_mod=score_mod, sink=sink)
            if grad:
                want = torch.autograd.grad(ref, (q64, k64, v64), do.double().transpose(1, 2))
            else:
                want = (ref.transpose(1, 2),)
        tol = (BWD_TOL if grad else FWD_TOL)[self.dtype_name]
        names = ("dq", "dk", "dv") if grad else ("out",)
        for name, x, ref in zip(names, got, want):
            err = _rel_err(x, ref)
            if not err <= tol:
                return f"{name} differs from {against}: max rel err {err:.3g} > {tol:g} (N={n})"
        return None

    # -- the timing ---------------------------------------------------------------------
    def _timing_setup(self):
        if self._timed is None:
            torch = self.torch
            b = max(TOKENS // self.bucket, 1)
            h = max(HIDDEN // self.d, 1)
            grad = self.kind == "bwd"
            q, k, v = self._inputs(b, h, h, self.bucket, grad)
            if grad:
                torch.manual_seed(DROPOUT_SEED)
                out = self.call(q, k, v)  # once, with the package's own forward config
                do = torch.randn_like(out)
                self._timed = (lambda: out.backward(do, retain_graph=True), [q, k, v])
            else:
                self._timed = (lambda: self.call(q, k, v), None)
        return self._timed

    def time(self, config: Mapping) -> float:
        fn, grads = self._timing_setup()
        with self.pkg._runtime.override_config(**config):
            return bench_ms(fn, grads)

    def compile_once(self, config: Mapping) -> None:
        """Run `config`'s calls once, untimed and unchecked: the check's shape, then the
        timed one (what flashgen/ahead.py's workers do to compile a trial's kernels)."""
        self.check(config)
        fn, _ = self._timing_setup()
        with self.pkg._runtime.override_config(**config):
            fn()
        self.torch.cuda.synchronize()

    def close(self):
        self._timed = None
        self._mod_args.clear()
        self._mod_refs.clear()
        self.torch.cuda.empty_cache()

    # -- the measure --------------------------------------------------------------------
    def __call__(self, config: Mapping) -> "float | WrongAnswer":
        try:
            wrong = self.check(config)
            if wrong is not None:
                return WrongAnswer(wrong)
            return self.time(config)
        except Exception as e:
            if _cuda_broken(self.torch):
                raise TuneAborted(
                    f"the CUDA context failed while measuring {self.variant} with "
                    f"{_fmt_config(dict(config))} ({_reason(e)}); the study is saved: run the "
                    "same command again to resume (the config is retried)") from e
            raise


class DecodeWorkload(Workload):
    """The calls a decoding variant's trials make, through the package's public
    `flash_attn_with_kvcache`: one new query token against a KV cache whose capacity is
    the bucket. The check uses ragged cache lengths (one full, one about half) against
    the float64 reference per batch element; the timing uses a serving shape, DECODE_B
    sequences with DECODE_KV_HEADS key/value heads (4 query heads each with GQA), every
    cache full."""

    def call_decode(self, q, k_cache, v_cache, lens, window=None):
        return self.pkg.flash_attn_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=lens, causal=self.mask == "causal",
            window_size=self.window if window is None else window)

    def _cache(self, b, h_kv, n, h_q):
        torch = self.torch
        gen = torch.Generator(device=self.device)
        gen.manual_seed(2000 + self._seed)
        self._seed += 1
        def rnd(*shape):  # noqa: E306
            return torch.randn(shape, generator=gen, device=self.device, dtype=self.dtype)
        return rnd(b, 1, h_q, self.d), rnd(b, n, h_kv, self.d), rnd(b, n, h_kv, self.dv)

    def check(self, config: Mapping) -> str | None:
        torch = self.torch
        from .reference import attention_ref, visible_mask

        n = self.check_n or 2 * config["block_n"] + CHECK_PAD
        h_kv = 2
        h_q = h_kv * (4 if self.gqa else 1)
        window = tuple(min(w, n // 3) if w >= 0 else w for w in self.window)
        q, k_cache, v_cache = self._cache(2, h_kv, n, h_q)
        lens = torch.tensor([n, n // 2 + 3], dtype=torch.int32, device=self.device)
        with self.pkg._runtime.override_config(**config):
            got = self.call_decode(q, k_cache, v_cache, lens, window)
        tol = FWD_TOL[self.dtype_name]
        for b, length in enumerate(lens.tolist()):
            vis = visible_mask(1, length, causal=self.mask == "causal", window=window,
                               bottom_right=True)
            ref, _ = attention_ref(q[b:b + 1].transpose(1, 2), k_cache[b:b + 1, :length].transpose(1, 2),
                                   v_cache[b:b + 1, :length].transpose(1, 2), vis)
            err = _rel_err(got[b:b + 1], ref.transpose(1, 2))
            if not err <= tol:
                return (f"out differs from the float64 reference: max rel err {err:.3g} > "
                        f"{tol:g} (cache length {length} of {n})")
        return None

    def _timing_setup(self):
        if self._timed is None:
            torch = self.torch
            h_q = DECODE_KV_HEADS * (4 if self.gqa else 1)
            q, k_cache, v_cache = self._cache(DECODE_B, DECODE_KV_HEADS, self.bucket, h_q)
            lens = torch.full((DECODE_B,), self.bucket, dtype=torch.int32, device=self.device)
            self._timed = (lambda: self.call_decode(q, k_cache, v_cache, lens), None)
        return self._timed

    def time(self, config: Mapping) -> float:
        # memory-bound: timed with a read flush (see read_flush_ms), like the `_rf` rows of
        # `flashgen bench --suite decode`
        fn, _ = self._timing_setup()
        with self.pkg._runtime.override_config(**config):
            return read_flush_ms(fn)


def _cuda_broken(torch) -> bool:
    try:
        torch.cuda.synchronize()
        return False
    except Exception:
        return True


def gpu_measure(pkg, variant: str, bucket: int, device, *, spec=None,
                default: Mapping | None = None) -> Workload:
    """The default measure: check then time `variant` of the imported package `pkg` at
    `bucket` on `device` (see Workload)."""
    facts = pkg._registry.VARIANTS[variant]
    if facts["kind"] == "decode" and facts.get("mods"):
        raise FlashgenError(f"{variant}: the decode measure makes no mod inputs (a decode "
                            "variant with mods is not tuned; it runs its base variant's configs)")
    window = (spec.window.left, spec.window.right) if spec is not None and spec.window else (-1, -1)
    gqa = bool(spec.gqa) if spec is not None else False
    workload = DecodeWorkload if facts["kind"] == "decode" else Workload
    return workload(pkg, variant, facts, bucket, device, window=window, gqa=gqa,
                    default=default)


# Kinds `flashgen tune` can measure; a new kind adds its Workload in gpu_measure.
