"""Rows of one (batch, head) slice that span 2**31 elements or more run with 64-bit row
offsets (the `tl` kernels' ROW64 switch, chosen per call signature), instead of wrapping.
(Such calls were refused with a ValueError until the switch existed; on the GPU a wrapped
offset was an illegal memory access: 2 x H200, a (1, 81920, 384, 128) ring shard.)

On the CPU the interpreter really crosses 2**31: every tensor is a view into one
`torch.empty` buffer of ~6.4 GB whose rows are 2**26 elements apart, so row 32 of a slice
lies 2**31 elements past row 0. Linux maps the buffer's pages on first touch, and only
the rows' few kilobytes are touched. Without the switch, those rows' offsets wrap to
-2**31 and the kernels read and write 4 GB before the tensors (a crash, or garbage).
"""
import os

import pytest
import torch

import generated.llama_attn as pkg
from flashgen.reference import attention_ref, visible_mask

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL

rt = pkg._runtime


def meta(*shape):
    return torch.empty(shape, device="meta", dtype=torch.bfloat16)


def test_the_span_arithmetic():
    q = meta(1, 81920, 384, 128)  # flash-attn layout: rows 384 * 128 elements apart
    assert rt.row_span_past_int32(1, 81920, q)
    # the same tensor with each head's rows contiguous stays below
    assert not rt.row_span_past_int32(2, 81920, meta(1, 384, 81920, 128))
    # the last row count that fits: (rows - 1) * stride + d - 1 < 2**31
    rows = (2 ** 31 - 128) // (384 * 128) + 1
    assert not rt.row_span_past_int32(1, rows, meta(1, rows, 384, 128))
    assert rt.row_span_past_int32(1, rows + 1, meta(1, rows + 1, 384, 128))
    # any one tensor past the limit is enough; no rows, nothing to address
    assert rt.row_span_past_int32(1, rows + 1, meta(1, rows + 1, 1, 128), meta(1, rows + 1, 384, 128))
    assert not rt.row_span_past_int32(1, 0, q)


def test_the_plans_switch_to_64_bit_offsets_only_past_2_31():
    """Meta tensors stand in for the multi-GB inputs: planning reads shapes and strides."""
    big = meta(1, 81920, 384, 128)
    fwd = rt._forward_plan(big, big, big, big, True, "causal", 0, 0, 0.1, False)[0]
    assert fwd.meta["ROW64"] is True
    t = big.transpose(1, 2)  # the backward's (B, H, N, d) views of flash-attn tensors
    plan = rt._backward_plan(t, t, t, t, t, t, t, t, "causal", 0, 0, 0.1, False)
    pre, dkdv, dq = plan[0], plan[2], plan[4]
    assert dkdv.meta["ROW64"] is True and dq.meta["ROW64"] is True
    assert dkdv.meta["FUSED_DQ"] == 0  # fused dQ's fp32 sum is addressed in 32 bits
    assert pre.meta["ROW64"] is False  # 64 rows of 49152 elements: its base is 64-bit
    # the usual call keeps the 32-bit binary
    small = meta(1, 8192, 32, 128)
    assert rt._forward_plan(small, small, small, small, True, "causal", 0, 0, 0.1,
                            False)[0].meta["ROW64"] is False
    s = small.transpose(1, 2)
    plan = rt._backward_plan(s, s, s, s, s, s, s, s, "causal", 0, 0, 0.1, False)
    assert plan[2].meta["ROW64"] is False and plan[4].meta["ROW64"] is False
    # packed batches: the longest sequence's rows count (its first row is 64-bit)
    packed = meta(81920 * 4, 384, 128)
    cu = torch.tensor([0, 81920 * 4], dtype=torch.int32, device="meta")
    launch = rt._varlen_forward_plan(packed, packed, packed, packed, cu, 81920, 81920,
                                     "causal", 0, 0, 0.1, False)[0]
    assert launch.meta["ROW64"] is True
    launch = rt._varlen_forward_plan(packed, packed, packed, packed, cu, 40000, 40000,
                                     "causal", 0, 0, 0.1, False)[0]
    assert launch.meta["ROW64"] is False


# ---------------------------------------------------------------------------------------
# The interpreter, past 2**31 for real
# ---------------------------------------------------------------------------------------
STRIDE = 2 ** 26  # elements between rows: row 32 starts 2**31 elements past row 0
D = 128
H_Q, H_KV = 2, 1  # GQA: both query heads read the one K/V head
N = 48  # rows 32..47 lie past 2**31; 16-row blocks put a whole block there
# each row of the buffer holds a row of every tensor, side by side
COLUMNS = {"q": H_Q, "k": H_KV, "v": H_KV, "o": H_Q, "do": H_Q, "dq": H_Q, "dk": H_KV,
           "dv": H_KV}
interpreting = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0") in ("", "0"),
                                  reason="crosses 2**31 on the CPU, through lazily mapped pages")


@pytest.fixture(scope="module")
def buffer():
    rows = N + 8  # the packed batch's total
    width = sum(COLUMNS.values()) * D
    assert (rows - 1) * STRIDE + width >= 2 ** 31 + 15 * STRIDE  # really past the limit
    return torch.empty((rows - 1) * STRIDE + width, dtype=torch.float16)


def views(buffer, rows: int, batch_dim: bool, seed: int):
    """{name: (1, rows, H, d) or (rows, H, d) view of the buffer}, rows STRIDE elements
    apart; inputs filled with fresh random values, outputs with NaN."""
    gen = torch.Generator().manual_seed(seed)
    out, col = {}, 0
    for name, heads in COLUMNS.items():
        shape, strides = (rows, heads, D), (STRIDE, D, 1)
        if batch_dim:
            shape, strides = (1, *shape), (rows * STRIDE, *strides)
        t = buffer.as_strided(shape, strides, col)
        col += heads * D
        if name in ("q", "k", "v", "do"):
            t.copy_(torch.randn(shape, generator=gen))
        else:
            t.fill_(float("nan"))
        out[name] = t
    return out


def reference(t, visible, scale=None):
    """float64 (out, lse, dq, dk, dv) of (B, H, N, d) views."""
    q, k, v = (t[n].detach().double().requires_grad_() for n in ("q", "k", "v"))
    out, lse = attention_ref(q, k, v, visible, scale)
    out.backward(t["do"].double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def close(got, want, tol, what):
    assert not got.isnan().any(), f"{what}: NaN (an element never written)"
    torch.testing.assert_close(got.double(), want, atol=tol[0], rtol=tol[1], msg=what)


@interpreting
@pytest.mark.parametrize("causal", [False, True])
def test_dense_forward_and_backward_past_2_31(buffer, causal):
    t = views(buffer, N, True, seed=7 + causal)
    bhnd = {n: x.transpose(1, 2) for n, x in t.items()}
    mask, lo, hi = rt.band(N, N, causal, (-1, -1), True)
    scale = D ** -0.5
    with rt.override_config(block_m=16, block_n=16, num_warps=4, num_stages=1):
        lse = rt.forward(t["q"], t["k"], t["v"], t["o"], mask=mask, lo=lo, hi=hi, scale=scale,
                         bnhd=True)
        assert [p[0].meta["ROW64"] for p in rt._forward_plans.values()] == [True]
        rt.backward(bhnd["do"], bhnd["q"], bhnd["k"], bhnd["v"], bhnd["o"], lse, bhnd["dq"],
                    bhnd["dk"], bhnd["dv"], mask=mask, lo=lo, hi=hi, scale=scale)
    out, want_lse, dq, dk, dv = reference(bhnd, visible_mask(N, N, causal=causal,
                                                             bottom_right=True))
    close(bhnd["o"], out, OUT_TOL[torch.float16], "out")
    close(lse, want_lse, LSE_TOL, "lse")
    for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
        close(bhnd[name], want, GRAD_TOL[torch.float16], name)


@interpreting
def test_packed_forward_and_backward_past_2_31(buffer):
    """Two sequences, 8 and N rows: the second starts at row 8 (a 64-bit base) and its
    own rows 32..47 lie past 2**31 from its first."""
    lens = (8, N)
    total = sum(lens)
    t = views(buffer, total, False, seed=11)
    cu = torch.tensor([0, lens[0], total], dtype=torch.int32)
    mask, lo, hi = rt.varlen_band(N, N, True, (-1, -1))
    scale = D ** -0.5
    with rt.override_config(block_m=16, block_n=16, num_warps=4, num_stages=1):
        lse = rt.forward_varlen(t["q"], t["k"], t["v"], t["o"], cu, cu, N, N, mask=mask, lo=lo,
                                hi=hi, scale=scale)
        rt.backward_varlen(t["do"], t["q"], t["k"], t["v"], t["o"], lse, t["dq"], t["dk"],
                           t["dv"], cu, cu, N, N, mask=mask, lo=lo, hi=hi, scale=scale)
    for i, n in enumerate(lens):
        rows = slice(cu[i].item(), cu[i + 1].item())
        seq = {name: x[rows].transpose(0, 1)[None] for name, x in t.items()}  # (1, H, n, d)
        out, want_lse, dq, dk, dv = reference(seq, visible_mask(n, n, causal=True,
                                                                bottom_right=True))
        close(seq["o"], out, OUT_TOL[torch.float16], f"sequence {i} out")
        close(lse[:, rows][None], want_lse, LSE_TOL, f"sequence {i} lse")
        for name, want in (("dq", dq), ("dk", dk), ("dv", dv)):
            close(seq[name], want, GRAD_TOL[torch.float16], f"sequence {i} {name}")


@interpreting
def test_flash_attn_func_takes_such_inputs(buffer):
    """The public entry point with autograd: nothing on the way refuses or copies them."""
    t = views(buffer, N, True, seed=5)
    q, k, v = (t[n].requires_grad_() for n in ("q", "k", "v"))
    with rt.override_config(block_m=16, block_n=16, num_warps=4, num_stages=1):
        out = pkg.flash_attn_func(q, k, v, causal=True)
        out.backward(t["do"])
    bhnd = {n: x.transpose(1, 2) for n, x in t.items()}
    want, _, dq, dk, dv = reference(bhnd, visible_mask(N, N, causal=True, bottom_right=True))
    close(out.transpose(1, 2), want, OUT_TOL[torch.float16], "out")
    for name, got, ref in (("dq", q.grad, dq), ("dk", k.grad, dk), ("dv", v.grad, dv)):
        close(got.transpose(1, 2), ref, GRAD_TOL[torch.float16], name)


# ---------------------------------------------------------------------------------------
# The GPU: a ring shard's shape, both kernel families
# ---------------------------------------------------------------------------------------
# (1, N, 384, 128) bf16, flash-attn layout: rows 49152 elements apart, so rows 43691 and
# later lie 2**31 elements or more past row 0 (the 2 x H200 crash had N = 81920, whose
# eight 8 GB tensors do not fit one H100). ~4.4 GB a tensor, ~45 GB in all with the
# Gluon backward's fp32 dQ sum.
GPU_N, GPU_H, GPU_D = 45056, 384, 128
FIRST_PAST = -(-2 ** 31 // (GPU_H * GPU_D))  # 43691
CHECKED_HEADS = (0, GPU_H - 1)


def head_reference(q, k, v, do, chunk=2048):
    """float64 (out, lse, dq, dk, dv) of one head's causal attention, q, k, v, do its (N, d)
    rows: autograd through flashgen.reference.attention_ref a block of query rows at a
    time (rows are independent; dK and dV are sums over them), so the N x N scores never
    exist at once."""
    q, k, v, do = (t.detach() for t in (q, k, v, do))
    n_q, n_k = q.shape[0], k.shape[0]
    k64 = k.double().requires_grad_()
    v64 = v.double().requires_grad_()
    outs, lses, dqs = [], [], []
    for i0 in range(0, n_q, chunk):
        i1 = min(i0 + chunk, n_q)
        q64 = q[i0:i1].double().requires_grad_()
        rows = torch.arange(i0, i1, device=q.device)[:, None] + (n_k - n_q)
        visible = torch.arange(n_k, device=q.device)[None, :] <= rows  # bottom-right causal
        out, lse = attention_ref(q64[None, None], k64[None, None], v64[None, None], visible)
        out.backward(do[i0:i1].double()[None, None])
        outs.append(out.detach()[0, 0])
        lses.append(lse.detach()[0, 0])
        dqs.append(q64.grad)
    return torch.cat(outs), torch.cat(lses), torch.cat(dqs), k64.grad, v64.grad


def rows_close(got, want, what, tol=0.05):
    """Every row within `tol` of the reference, relative to the row's own norm: the
    outputs of late causal rows are averages of ~40k values, ~100x smaller than row 0's,
    so a tolerance on the tensor's scale could not tell them from garbage. (A row whose
    exact value is ~0, such as dQ of a query that sees one key, is measured against 1% of
    the median row's norm instead.)"""
    assert got.isfinite().all(), f"{what}: NaN or inf (an element never written?)"
    norms = want.norm(dim=-1)
    err = (got.double() - want).norm(dim=-1) / norms.clamp_min(1e-2 * norms.median())
    worst = int(err.argmax())
    past = err[FIRST_PAST:].max().item() if len(err) > FIRST_PAST else float("nan")
    assert err[worst] < tol, (f"{what}: row {worst} off by {err[worst]:.3g} of its norm "
                              f"(rows past 2**31 start at {FIRST_PAST}; worst there {past:.3g})")


def _gpu_family(family):
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    if family == "gluon" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernels run on Hopper only")
    saved = rt._FORCED_FAMILY
    rt.use_family(family)
    rt._forward_plans.clear()  # (the assertions below read this test's plans)
    rt._backward_plans.clear()
    return saved


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tl", "gluon"])
def test_a_shard_past_2_31_runs_on_the_gpu(family, gpu_memory_alone, poison):
    saved = _gpu_family(family)
    try:
        torch.manual_seed(0)
        shape = (1, GPU_N, GPU_H, GPU_D)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        out, lse = pkg.flash_attn_func(q, k, v, causal=True, return_lse=True)
        out.backward(do)
        torch.cuda.synchronize()
        (fwd,) = rt._forward_plans.values()
        (bwd,) = rt._backward_plans.values()
        if family == "gluon":
            assert fwd[2] == rt._GLUON and bwd[7] == rt._BWD_GLUON
        else:
            assert fwd[0].meta["ROW64"] and bwd[2].meta["ROW64"] and bwd[4].meta["ROW64"]
        for h in CHECKED_HEADS:
            want = head_reference(q[0, :, h], k[0, :, h], v[0, :, h], do[0, :, h])
            torch.testing.assert_close(lse[0, h].double(), want[1], atol=LSE_TOL[0],
                                       rtol=LSE_TOL[1], msg=lambda m: f"head {h} lse: {m}")
            for name, got, ref in (("out", out, want[0]), ("dq", q.grad, want[2]),
                                   ("dk", k.grad, want[3]), ("dv", v.grad, want[4])):
                rows_close(got[0, :, h], ref, f"{family} head {h} {name}")
    finally:
        rt.use_family(saved)


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["tl", "gluon"])
def test_a_packed_batch_past_2_31_runs_on_the_gpu(family, gpu_memory_alone, poison):
    """Two sequences, 1000 and GPU_N tokens: the second starts 1000 rows in (a 64-bit base)
    and its own rows FIRST_PAST.. lie past 2**31 from its first."""
    saved = _gpu_family(family)
    try:
        torch.manual_seed(1)
        lens = (1000, GPU_N)
        total = sum(lens)
        shape = (total, GPU_H, GPU_D)
        q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        cu = torch.tensor([0, lens[0], total], device="cuda", dtype=torch.int32)
        out = pkg.flash_attn_varlen_func(q, k, v, cu, cu, GPU_N, GPU_N, causal=True)
        out.backward(do)
        torch.cuda.synchronize()
        (fwd,) = rt._forward_plans.values()
        (bwd,) = rt._backward_plans.values()
        if family == "gluon":
            assert fwd[2] == rt._GLUON and bwd[7] == rt._GLUON  # (_varlen_backward_plan's last)
        else:
            assert fwd[0].meta["ROW64"] and bwd[2].meta["ROW64"] and bwd[4].meta["ROW64"]
        for i, h in ((0, 0), (1, 0), (1, GPU_H - 1)):
            rows = slice(cu[i].item(), cu[i + 1].item())
            want = head_reference(q[rows, h], k[rows, h], v[rows, h], do[rows, h])
            for name, got, ref in (("out", out, want[0]), ("dq", q.grad, want[2]),
                                   ("dk", k.grad, want[3]), ("dv", v.grad, want[4])):
                rows_close(got[rows, h], ref, f"{family} sequence {i} head {h} {name}")
    finally:
        rt.use_family(saved)
