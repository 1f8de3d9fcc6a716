"""How each kind of self-test case runs (flashgen.selftest.cases.run_case calls `run`):
inputs made from the case's seed, the package's public call with the memory it allocates
poisoned, and the float64 reference.

The reference is flashgen.reference's attention written from its definition, with the
mods written out by hand (flashgen.selftest.modref).
Inputs are drawn on the CPU from the case's seed (the same values on every device) and
placed in the case's memory layout inside NaN-filled buffers: a kernel that reads past a
view's rows or columns turns the result into NaN.
"""
from __future__ import annotations

import contextlib
import traceback

import torch

from ..reference import dropout_keep_rate, visible_mask
from .cases import KINDS, Case
from .modref import Mods, reference

# dtype -> (atol, rtol) of an output against the float64 reference: |got - ref| <= atol *
# max(1, RMS(ref)) + rtol * |ref| element by element (Checker.close says why the RMS), the
# values of tests/conftest.py (which says where they come from; a wheel does not ship it).
# Gradients are judged against the exact backward of the output the forward stored
# (backward_reference): without that, bf16 gradients crossed these tolerances in ~3% of
# the interpreter's fuzz cases, by up to 4x (where the terms of dP - D cancel); with it, no
# gradient of ~1000 cases came within 2x of them, nor any fp32 one within 30x.
OUT_TOL = {"fp32": (2e-5, 2e-5), "fp16": (2e-3, 2e-3), "bf16": (1.6e-2, 1.6e-2)}
GRAD_TOL = {"fp32": (1e-4, 1e-4), "fp16": (5e-3, 5e-3), "bf16": (4e-2, 4e-2)}
LSE_TOL = (1e-4, 1e-5)
TORCH_DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
F64 = torch.float64


# ----------------------------------------------------------------------------------------
# Judging outputs
# ----------------------------------------------------------------------------------------
class Checker:
    """Collects, per output, the worst |got - ref| / (atol + rtol |ref|) and every other
    problem (NaN, a wrong -inf pattern, a row that sees no key but is not 0)."""

    def __init__(self, ref_device: str):
        self.device = torch.device(ref_device)
        self.errors: dict[str, float] = {}
        self.problems: list[str] = []

    def _f64(self, t) -> torch.Tensor:
        return t.detach().to(self.device, F64)

    def close(self, name: str, got, ref, tol) -> None:
        if got is None:
            self.problems.append(f"{name}: no value (no gradient reached it)")
            self.errors[name] = float("nan")
            return
        got, ref = self._f64(got), self._f64(ref)
        if got.shape != ref.shape:
            self.problems.append(f"{name}: shape {tuple(got.shape)}, expected {tuple(ref.shape)}")
            self.errors[name] = float("nan")
            return
        nan = int(torch.isnan(got).sum())
        if nan:
            self.problems.append(f"{name}: {nan} of {got.numel()} elements NaN (produced, or "
                                 "never written)")
            self.errors[name] = float("nan")
            return
        if not got.numel():
            self.errors[name] = 0.0
            return
        # atol in units of the output's RMS once that exceeds 1: an element's rounding error
        # is a fraction of the terms summed into it, whose size the RMS follows, not of its
        # own value (a gradient element near 0 from cancelling terms of size 10 carries
        # their error); scaling every input by c scales the gradients and their errors by c
        atol, rtol = tol
        atol *= max(1.0, ref.pow(2).mean().sqrt().item())
        ratio = ((got - ref).abs() / (atol + rtol * ref.abs())).max().item()
        self.errors[name] = ratio if ratio == ratio else float("inf")  # (inf - inf: wrong)

    def lse(self, name: str, got, ref) -> torch.Tensor:
        """The LSE: -inf exactly where the reference's row sees nothing (returned, on the
        reference's device), the rest within LSE_TOL."""
        got, ref = self._f64(got), self._f64(ref)
        masked = torch.isneginf(ref)
        if got.shape != ref.shape:
            self.close(name, got, ref, LSE_TOL)
            return masked
        wrong = int((masked != torch.isneginf(got)).sum())
        if wrong:
            self.problems.append(f"{name}: {wrong} rows' -inf differs from the reference (-inf "
                                 "exactly for the rows that see no key)")
        seen = ~masked & ~torch.isneginf(got)
        self.close(name, got[seen], ref[seen], LSE_TOL)
        return masked

    def zero_rows(self, name: str, out, masked) -> None:
        """`masked` (out's shape without the head dim): rows that see no key, which must be
        exactly 0."""
        rows = self._f64(out)[masked.to(self.device)]
        bad = int((rows != 0).any(-1).sum()) if rows.numel() else 0
        if bad:
            self.problems.append(f"{name}: {bad} rows that see no key are not 0")

    def exact(self, name: str, got, want) -> None:
        same = torch.equal(got.detach().cpu(), want.detach().cpu())
        self.errors[name] = 0.0 if same else float("inf")
        if not same:
            diff = int((got.detach().cpu() != want.detach().cpu()).sum())
            self.problems.append(f"{name}: {diff} elements differ from the expected cache")


def describe_exception(e: BaseException) -> str:
    """One line: the exception, its first message line and where it was raised."""
    lines = str(e).strip().splitlines() or [""]
    text = f"{type(e).__name__}: {lines[0][:400]}"
    frames = traceback.extract_tb(e.__traceback__)
    if frames:
        f = frames[-1]
        text += f" (at {'/'.join(f.filename.split('/')[-2:])}:{f.lineno})"
    return text


# ----------------------------------------------------------------------------------------
# Running: family, tiles, poisoned allocations, inputs
# ----------------------------------------------------------------------------------------
@contextlib.contextmanager
def kernel_family(pkg, family: str, device: str):
    """Send the package's calls to `family` for the block (auto: its default choice) and
    yield a note when Gluon was asked for where it cannot run (a CPU, the interpreter, a
    GPU before Hopper): the case then runs `tl`, and says so. `use_family` rather than
    override_config(family=...), whose Gluon config would also reshape decode's tiles."""
    rt = pkg._runtime
    saved = rt._FORCED_FAMILY
    note = ""
    try:
        rt.use_family("")
        if family == "gluon":
            why = rt.gluon_ready(torch.device(device))
            if why is not None:
                note, family = f"family gluon ran as tl: {why}", "tl"
        rt.use_family("" if family == "auto" else family)
        yield note
    finally:
        rt.use_family(saved)


@contextlib.contextmanager
def poisoned():
    """Every floating-point tensor torch.empty / empty_like / empty_strided / new_empty
    makes in the block is NaN-filled: an output element a kernel never writes shows."""
    def poisoning(make):
        def made(*args, **kwargs):
            t = make(*args, **kwargs)
            if t.is_floating_point() and t.numel():
                t.fill_(float("nan"))
            return t
        return made

    saved = torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty
    torch.empty, torch.empty_like, torch.empty_strided = (poisoning(f) for f in saved[:3])
    torch.Tensor.new_empty = poisoning(saved[3])
    try:
        yield
    finally:
        torch.empty, torch.empty_like, torch.empty_strided, torch.Tensor.new_empty = saved


@contextlib.contextmanager
def seeded(device: str, seed: int):
    """The CPU generator and the device's seeded from the case for the block (a dropout
    call draws its mask from them: the same case drops the same elements in any run),
    and put back as they were after it."""
    dev = torch.device(device)
    index = None
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
    with torch.random.fork_rng(devices=[] if index is None else [index]):
        torch.default_generator.manual_seed(seed)
        if index is not None:
            with torch.cuda.device(index):
                torch.cuda.manual_seed(seed)
        yield


def synchronize(device: str) -> None:
    """On CUDA, wait for the case's kernels, so an asynchronous error is this case's."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def rng_state(device: str):
    dev = torch.device(device)
    return torch.cuda.get_rng_state(dev) if dev.type == "cuda" else torch.get_rng_state()


def set_rng_state(device: str, state) -> None:
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_rng_state(state, dev)
    else:
        torch.set_rng_state(state)


def replay_keep(pkg, device, state, shape, p):
    """The keep mask the dropout call made from generator `state` drew (the package's
    dropout_mask hook), leaving the generator where the call left it."""
    after = rng_state(device)
    set_rng_state(device, state)
    keep = pkg.dropout_mask(*shape, p, device=device)
    set_rng_state(device, after)
    return keep


def randn(g: torch.Generator, shape, dtype, scale: float = 1.0) -> torch.Tensor:
    """Normal values on the CPU in `dtype` (then exact in float64 for the reference)."""
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def placed(x: torch.Tensor, layout: str, device) -> torch.Tensor:
    """x (..., T, H, D) copied into `layout` on `device` inside a NaN-filled buffer (see
    cases.LAYOUTS; "qkv" is made by the caller)."""
    *lead, t, h, d = x.shape
    nan = float("nan")
    if layout in ("none", "qkv"):
        return x.to(device, copy=True).contiguous()
    if layout == "heads":
        view = torch.full((*lead, t, h + 3, d), nan, dtype=x.dtype, device=device)[..., 1:h + 1, :]
    elif layout in ("pad", "odd"):
        view = torch.full((*lead, t, h, d + (8 if layout == "pad" else 1)), nan, dtype=x.dtype,
                          device=device)[..., :d]
    elif layout == "bhnd":
        view = torch.full((*lead, h, t, d), nan, dtype=x.dtype, device=device).transpose(-3, -2)
    else:
        raise ValueError(f"unknown layout {layout!r}")
    view.copy_(x.to(device))
    return view


def untouched_around(view: torch.Tensor) -> int:
    """How many elements of the NaN-filled buffer around a `placed` view are no longer NaN
    (0 for a view that fills its buffer)."""
    memory = torch.tensor([], dtype=view.dtype, device=view.device).set_(view.untyped_storage())
    nan_outside = int(torch.isnan(memory).sum()) - int(torch.isnan(view).sum())
    return memory.numel() - view.numel() - nan_outside


def fused_qkv(q, k, v, device):
    """q, k, v as views of one (..., T, Hq + 2 Hkv, d) tensor (a fused projection)."""
    buf = torch.cat([q, k, v], dim=-2).to(device)
    hq, hk = q.shape[-2], k.shape[-2]
    return buf[..., :hq, :], buf[..., hq:hq + hk, :], buf[..., hq + hk:, :]


def leaves(*ts):
    return [t.requires_grad_() for t in ts]


def backward_reference(r_out, r_lse, inputs, grad_out, stored, row_dims) -> list:
    """The reference gradients of `inputs` that a FlashAttention backward computes exactly,
    given the output its forward stored (`stored`, the kernel's own output, in its dtype).

    Such a backward forms dS = P (dP - D) with D = rowsum(dO * O) from the stored O, where
    the exact gradient has D from the exact O: the difference, P (D_exact - D_stored) per
    row, is no rounding of the backward's but the forward's, made visible where the terms
    of dP - D cancel -- a row that sees one key has dS = 0 exactly, and a key seen by a
    thousand such rows gathers their D's roundings into its dK. So the reference adds it:
    since dLSE_i / ds_ij = P_ij, the added gradients are those of sum_i dD_i * LSE_i
    (through the same scale, score mods, sinks and GQA sums), dD_i = rowsum(dO_i *
    (O_exact,i - O_stored,i)). The forward's own error is judged on `out` by itself.
    `row_dims`: the permutation that puts the outputs' rows in the LSE's layout."""
    exact = torch.autograd.grad(r_out, inputs, grad_out, retain_graph=True, allow_unused=True)
    d_rows = ((r_out.detach() - stored.detach().to(r_out.device, F64)) * grad_out).sum(-1)
    d_rows = d_rows.permute(*row_dims)
    seen = torch.isfinite(r_lse)
    term = (torch.where(seen, d_rows, 0.0) * torch.where(seen, r_lse, 0.0)).sum()
    shift = torch.autograd.grad(term, inputs, allow_unused=True)
    return [torch.zeros_like(x) if e is None and d is None else
            (e if d is None else d if e is None else e + d)
            for x, e, d in zip(inputs, exact, shift)]


def scaled(tol, p: float):
    """A tolerance grown by dropout's survivor scale (the outputs grow by it)."""
    s = 1.0 / dropout_keep_rate(p)
    return (tol[0] * s, tol[1] * s)


# ----------------------------------------------------------------------------------------
# The kinds
# ----------------------------------------------------------------------------------------
def run(case: Case, pkg, device: str, ref_device: str):
    """(errors, problems, note) of one case: see cases.run_case."""
    check = Checker(ref_device)
    dev = torch.device(device)
    # (Triton launches on the current device: make it the case's)
    on_device = torch.cuda.device(dev) if dev.type == "cuda" else contextlib.nullcontext()
    with on_device, seeded(device, case.seed), kernel_family(pkg, case.family, device) as note:
        tiles = (pkg._runtime.override_config(block_m=case.tiles, block_n=case.tiles,
                                              num_warps=4, num_stages=1)
                 if case.tiles else contextlib.nullcontext())
        with tiles:
            RUNNERS[case.kind](case, pkg, device, check)
    return check.errors, check.problems, note


def _dense(case: Case, pkg, device: str, check: Checker) -> None:
    """A dense training call (flash_attn_func, scaled_dot_product_attention, the packed
    QKV call, or the ring call at world size 1: kind ring_merge) forward and backward."""
    g = torch.Generator().manual_seed(case.seed)
    dt, p, ring = TORCH_DTYPES[case.dtype], case.dropout, case.kind == "ring_merge"
    bsz, hq, hk, d, dv = case.batch, case.h_q, case.h_kv, case.d, case.v_dim
    nq, nk = (case.n_q, case.n_q) if ring else (case.n_q, case.n_k)
    qv = randn(g, (bsz, nq, hq, d), dt, case.option("q_scale", 1.0))
    kv, vv = randn(g, (bsz, nk, hk, d), dt), randn(g, (bsz, nk, hk, dv), dt)
    do = randn(g, (bsz, nq, hq, dv), dt).to(device)
    sm = case.option("scale")  # softmax_scale (None: 1 / sqrt(d))
    mods = Mods(case, pkg, g, device, bsz, nq, nk, grad=True)
    bias_leaf, call_kw = None, dict(mods.kwargs)
    if case.kind == "attn_mask":
        bias_leaf, call_kw["attn_mask"] = _attn_mask(case, g, bsz, hq, nq, nk, device)
    if case.api == "packed":
        qkv = placed(torch.stack([qv, kv, vv], dim=2), case.strided, device).requires_grad_()
        inputs = [qkv]
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
    else:
        if case.strided == "qkv":
            q, k, v = fused_qkv(qv, kv, vv, device)
        else:
            q, k, v = (placed(x, case.strided, device) for x in (qv, kv, vv))
        inputs = leaves(q, k, v)
    window, lse = tuple(case.window), None
    state = rng_state(device)
    with poisoned():
        if ring:
            kw = dict(dropout_p=p, window_size=window, return_lse=case.return_lse,
                      strategy=case.option("strategy", "ring"),
                      layout=case.option("layout", "zigzag"), **call_kw)
            if case.api == "sdpa":
                res = pkg.ring_scaled_dot_product_attention(
                    q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                    is_causal=case.causal, scale=sm, enable_gqa=hq != hk, **kw)
            else:
                res = pkg.ring_flash_attn_func(q, k, v, causal=case.causal, softmax_scale=sm, **kw)
            out, lse = res if case.return_lse else (res, None)
            out = out.transpose(1, 2) if case.api == "sdpa" else out
        elif case.api == "sdpa":
            out = pkg.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), dropout_p=p,
                is_causal=case.causal, scale=sm, enable_gqa=hq != hk, **call_kw).transpose(1, 2)
        elif case.api == "packed":
            res = pkg.flash_attn_qkvpacked_func(qkv, dropout_p=p, softmax_scale=sm,
                                                causal=case.causal, window_size=window,
                                                return_lse=case.return_lse)
            out, lse = res if case.return_lse else (res, None)
        else:
            res = pkg.flash_attn_func(q, k, v, dropout_p=p, softmax_scale=sm, causal=case.causal,
                                      window_size=window, return_lse=case.return_lse, **call_kw)
            out, lse = res if case.return_lse else (res, None)
        extra = list(mods.grads.values())
        if bias_leaf is not None:
            extra.append(call_kw["attn_mask"])
        grads = torch.autograd.grad(out, inputs + extra, do, allow_unused=True)
        synchronize(device)
    keep = replay_keep(pkg, device, state, (bsz, hq, nq, nk), p) if p else None

    rdev = check.device
    r_q, r_k, r_v = (x.detach().to(rdev, F64).requires_grad_() for x in (qv, kv, vv))
    r_mod = {name: t.detach().to(rdev, F64).requires_grad_() for name, t in mods.grads.items()}
    r_bias = None if bias_leaf is None else bias_leaf.detach().to(rdev, F64).requires_grad_()
    top_left = case.api == "sdpa" and not ring
    vis = visible_mask(nq, nk, causal=case.causal, window=window, bottom_right=not top_left)
    if case.kind == "attn_mask" and bias_leaf is None:  # a boolean mask
        vis = vis.to(rdev) & call_kw["attn_mask"].to(rdev)
    r_out, r_lse = reference(r_q, r_k, r_v, vis, mods=mods, b_index=torch.arange(bsz),
                             keep=keep, p=p, mod_leaves=r_mod, bias=r_bias, scale=sm)
    r_leaves = [r_q, r_k, r_v] + list(r_mod.values()) + ([r_bias] if r_bias is not None else [])
    r_grads = backward_reference(r_out, r_lse, r_leaves, do.to(rdev, F64), out, (0, 2, 1))

    check.close("out", out, r_out, scaled(OUT_TOL[case.dtype], p))
    masked = torch.isneginf(r_lse.detach())
    if lse is not None:
        masked = check.lse("lse", lse, r_lse)
    check.zero_rows("out", out, masked.transpose(1, 2))
    got = grads[:3] if case.api != "packed" else [grads[0][:, :, i] for i in range(3)]
    for name, gg, rg in zip(("dq", "dk", "dv"), got, r_grads):
        check.close(name, gg, rg, scaled(GRAD_TOL[case.dtype], p))
    names = list(mods.grads) + (["dbias"] if bias_leaf is not None else [])
    for name, gg, rg in zip(names, grads[len(inputs):], r_grads[3:]):
        check.close(name, gg, rg, GRAD_TOL[case.dtype])


def _attn_mask(case: Case, g, bsz, hq, nq, nk, device):
    """(float64 CPU bias or None, the call's attn_mask) in one of the shapes SDPA
    broadcasts: (B, H, Nq, Nk), (1, H, Nq, Nk), (B, 1, 1, Nk) or (Nq, Nk). A float mask
    wants its gradient; a boolean one may leave rows with no key."""
    shapes = [(bsz, hq, nq, nk), (1, hq, nq, nk), (bsz, 1, 1, nk), (nq, nk)]
    shape = shapes[case.seed % len(shapes)]
    if case.option("mask", "bool") == "float":
        bias = torch.randn(shape, generator=g)
        return bias, bias.to(device, copy=True).requires_grad_()
    keep = torch.rand(shape, generator=g) > 0.25
    return None, keep.to(device)


def _varlen(case: Case, pkg, device: str, check: Checker) -> None:
    """flash_attn_varlen_func forward and backward on a packed ragged batch."""
    g = torch.Generator().manual_seed(case.seed)
    dt, p = TORCH_DTYPES[case.dtype], case.dropout
    lq, lk = list(case.seqlens_q), list(case.seqlens_k)
    if len(lq) != len(lk) or not lq:
        raise ValueError("varlen: seqlens_q and seqlens_k need one entry per sequence")
    bsz, hq, hk, d, dv = len(lq), case.h_q, case.h_kv, case.d, case.v_dim
    tq, tk = sum(lq), sum(lk)
    qv = randn(g, (tq, hq, d), dt, case.option("q_scale", 1.0))
    kv, vv = randn(g, (tk, hk, d), dt), randn(g, (tk, hk, dv), dt)
    do = randn(g, (tq, hq, dv), dt).to(device)
    sm = case.option("scale")
    extra = int(case.option("max_extra", 0))
    max_q, max_k = max(lq) + extra, max(lk) + extra
    mods = Mods(case, pkg, g, device, bsz, max_q, max_k, grad=True)
    if case.strided == "qkv":
        q, k, v = fused_qkv(qv, kv, vv, device)
    else:
        q, k, v = (placed(x, case.strided, device) for x in (qv, kv, vv))
    inputs = leaves(q, k, v)
    cq, ck = (torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)
              for ls in (lq, lk))
    state = rng_state(device)
    with poisoned():
        out, lse = pkg.flash_attn_varlen_func(
            q, k, v, cq.to(device), ck.to(device), max_q, max_k, dropout_p=p, softmax_scale=sm,
            causal=case.causal, window_size=tuple(case.window), return_lse=True, **mods.kwargs)
        grads = torch.autograd.grad(out, inputs + list(mods.grads.values()), do,
                                    allow_unused=True)
        synchronize(device)
    keep = replay_keep(pkg, device, state, (bsz, hq, max_q, max_k), p) if p else None

    rdev = check.device
    r_q, r_k, r_v = (x.detach().to(rdev, F64).requires_grad_() for x in (qv, kv, vv))
    r_mod = {name: t.detach().to(rdev, F64).requires_grad_() for name, t in mods.grads.items()}
    outs, lses = [], []
    for s, (n_q, n_k) in enumerate(zip(lq, lk)):
        rows_q, rows_k = slice(int(cq[s]), int(cq[s + 1])), slice(int(ck[s]), int(ck[s + 1]))
        vis = visible_mask(n_q, n_k, causal=case.causal, window=tuple(case.window),
                           bottom_right=True)
        o, l_ = reference(r_q[rows_q][None], r_k[rows_k][None], r_v[rows_k][None], vis, mods=mods,
                          b_index=torch.tensor([s]),
                          keep=None if keep is None else keep[s:s + 1, :, :n_q, :n_k],
                          p=p, mod_leaves=r_mod, scale=sm)
        outs.append(o[0])
        lses.append(l_[0])
    r_out, r_lse = torch.cat(outs), torch.cat(lses, dim=1)
    r_grads = backward_reference(r_out, r_lse, [r_q, r_k, r_v] + list(r_mod.values()),
                                 do.to(rdev, F64), out, (1, 0))
    check.close("out", out, r_out, scaled(OUT_TOL[case.dtype], p))
    masked = check.lse("lse", lse, r_lse)
    check.zero_rows("out", out, masked.transpose(0, 1))
    for name, gg, rg in zip(["dq", "dk", "dv"] + list(mods.grads), grads, r_grads):
        check.close(name, gg, rg, scaled(GRAD_TOL[case.dtype], p))


def _decode(case: Case, pkg, device: str, check: Checker) -> None:
    """flash_attn_with_kvcache: new keys appended into a contiguous or paged cache, then
    decode; the append checked element by element, the output and LSE against the
    reference over each element's logical cache rows."""
    g = torch.Generator().manual_seed(case.seed)
    dt = TORCH_DTYPES[case.dtype]
    bsz, nq, hq, hk, d, dv = case.batch, case.n_q, case.h_q, case.h_kv, case.d, case.v_dim
    lens, n_new, page = list(case.seqlens_k), case.n_new, case.page_size
    latent = bool(case.option("latent", 0))
    if len(lens) != bsz:
        raise ValueError("decode: seqlens_k needs one cached length per batch element")
    if page:
        pages = -(-case.n_k // page)
        cap, lead = pages * page, (bsz * pages + 2, page)  # two spare pages no one owns
        table = torch.randperm(lead[0], generator=g)[:bsz * pages].view(bsz, pages).to(torch.int32)
    else:
        cap, lead, table = case.n_k, (bsz, case.n_k), None
    if any(n < 0 or n + n_new > cap for n in lens):
        raise ValueError(f"decode: cached lengths {lens} + {n_new} new exceed the capacity {cap}")
    # the caches in the case's layout too ("qkv" aside): the append writes through strides
    layout = "none" if case.strided == "qkv" else case.strided
    k_cache = placed(randn(g, (*lead, hk, d), dt), layout, device)
    v_cache = k_cache[..., :dv] if latent else placed(randn(g, (*lead, hk, dv), dt), layout, device)
    k_new = randn(g, (bsz, n_new, hk, d), dt) if n_new else None
    v_new = (k_new[..., :dv] if latent else randn(g, (bsz, n_new, hk, dv), dt)) if n_new else None
    qv = randn(g, (bsz, nq, hq, d), dt, case.option("q_scale", 1.0))
    q = placed(qv, "none" if case.strided == "qkv" else case.strided, device)
    sm = case.option("scale")
    mods = Mods(case, pkg, g, device, bsz, cap, cap, grad=False)
    k0, v0 = k_cache.cpu().clone(), v_cache.cpu().clone()
    if case.option("int_lens", 0) and len(set(lens)) == 1:
        seqlens = lens[0]
    else:
        seqlens = torch.tensor(lens, dtype=torch.int32, device=device)
    kn = None if k_new is None else k_new.to(device)
    vn = None if v_new is None else (kn[..., :dv] if latent else v_new.to(device))
    with torch.no_grad(), poisoned():
        res = pkg.flash_attn_with_kvcache(
            q, k_cache, v_cache, k=kn, v=vn, cache_seqlens=seqlens,
            block_table=None if table is None else table.to(device), softmax_scale=sm,
            causal=case.causal,
            window_size=tuple(case.window), num_splits=case.num_splits,
            return_lse=case.return_lse, **mods.kwargs)
        synchronize(device)
    out, lse = res if case.return_lse else (res, None)

    # the caches after the append, by definition: row j of element b is page
    # table[b, j // page], slot j % page
    def slot(b, j):
        return (int(table[b, j // page]), j % page) if page else (b, j)

    k_want, v_want = k0.clone(), v0.clone()
    for b in range(bsz):
        for t in range(n_new):
            k_want[slot(b, lens[b] + t)] = k_new[b, t]
            v_want[slot(b, lens[b] + t)] = v_new[b, t]
    check.exact("k_cache", k_cache, k_want)
    if not latent:
        check.exact("v_cache", v_cache, v_want)
    for name, t in (("k_cache", k_cache),) + ((("v_cache", v_cache),) if not latent else ()):
        outside = untouched_around(t)
        if outside:
            check.problems.append(f"{name}: {outside} elements outside the cache's view written")

    rdev = check.device
    outs, lses = [], []
    for b in range(bsz):
        n = lens[b] + n_new
        j = torch.arange(n)
        at = (table[b].long()[j // page], j % page) if page else (torch.full_like(j, b), j)
        kb, vb = k_want[at], v_want[at]
        vis = visible_mask(nq, n, causal=case.causal, window=tuple(case.window), bottom_right=True)
        o, l_ = reference(qv[b:b + 1].to(rdev, F64), kb[None].to(rdev, F64), vb[None].to(rdev, F64),
                          vis, mods=mods, b_index=torch.tensor([b]),
                          positions=torch.arange(nq) + (n - nq), scale=sm)
        outs.append(o)
        lses.append(l_)
    r_out, r_lse = torch.cat(outs), torch.cat(lses)
    check.close("out", out, r_out, OUT_TOL[case.dtype])
    masked = torch.isneginf(r_lse) if lse is None else check.lse("lse", lse, r_lse)
    check.zero_rows("out", out, masked.transpose(1, 2))


RUNNERS = {"train": _dense, "mods": _dense, "block_mask": _dense, "attn_mask": _dense,
           "ring_merge": _dense, "varlen": _varlen, "decode": _decode,
           "paged_decode": _decode, "mla_decode": _decode}
assert set(RUNNERS) == set(KINDS), "every case kind needs a runner"
