"""Backward kernels against autograd through the float64 reference formula.

dQ, dK and dV are compared on fresh random inputs and a fresh random upstream gradient dO,
for the same odd shapes, masks, head dims, GQA ratios and layouts as the forward tests.
Forced 16 x 32 tiles make short sequences cross several blocks in both backward kernels.
"""
import pytest
import torch

from conftest import GRAD_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

TILES = dict(block_m=16, block_n=32, num_warps=4, num_stages=2)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("bwd"), "fg_test_bwd", """
        head_dims: [24, 64, 80]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 32, right: 0}
        gqa: true
        """)


def leaf(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_()


def reference_grads(q, k, v, do, visible, bnhd=True, scale=None):
    """dq, dk, dv in float64 by autograd through the naive formula."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    view = (lambda t: t.transpose(1, 2)) if bnhd else (lambda t: t)
    out, _ = attention_ref(view(q64), view(k64), view(v64), visible, scale=scale)
    view(out).backward(do.double())
    return q64.grad, k64.grad, v64.grad


def assert_grads(grads, ref_grads, dtype):
    atol, rtol = GRAD_TOL[dtype]
    for name, g, r in zip("qkv", grads, ref_grads):
        assert g is not None, f"d{name} missing"
        assert not torch.isnan(g).any(), f"NaN in d{name} (or an element never written)"
        torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"d{name}: {m}")


def flash_grads(pkg, q, k, v, do, *, causal=False, window=(-1, -1), tiles=TILES):
    with pkg._runtime.override_config(**tiles):
        out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
        out.backward(do)
    return q.grad, k.grad, v.grad


def check_flash(pkg, device, b, n_q, n_k, h_q, h_kv, d, dtype, causal=False, window=(-1, -1),
                tiles=TILES):
    q = leaf(b, n_q, h_q, d, dtype=dtype, device=device)
    k, v = (leaf(b, n_k, h_kv, d, dtype=dtype, device=device) for _ in range(2))
    do = torch.randn(b, n_q, h_q, d, dtype=dtype, device=device)
    grads = flash_grads(pkg, q, k, v, do, causal=causal, window=window, tiles=tiles)
    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
    assert_grads(grads, reference_grads(q, k, v, do, vis), dtype)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (59, 59), (127, 127), (37, 70), (70, 37)],
                         ids=["N1", "N59", "N127", "Nq37_Nk70", "Nq70_Nk37"])
def test_odd_lengths(pkg, device, poison, n_q, n_k, causal):
    check_flash(pkg, device, 1, n_q, n_k, 2, 2, 64, torch.float16, causal=causal)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
def test_dtypes(pkg, device, poison, dt):
    check_flash(pkg, device, 2, 45, 45, 2, 2, 64, dt, causal=True)


@pytest.mark.parametrize("d", [24, 80])
def test_head_dims_not_powers_of_two(pkg, device, poison, d):
    check_flash(pkg, device, 1, 50, 50, 2, 2, d, torch.float32, causal=True)


@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (8, 1)], ids=["gqa4to1", "gqa8to1"])
def test_gqa_sums_over_shared_heads(pkg, device, poison, h_q, h_kv):
    check_flash(pkg, device, 1, 33, 40, h_q, h_kv, 64, torch.float32, causal=True)


@pytest.mark.parametrize("window,causal", [((-1, -1), True), ((20, 5), False)],
                         ids=["causal", "window20_5"])
def test_dq_tile_knobs(pkg, device, poison, window, causal):
    """The dQ kernel on a tile of its own (the dq_* knobs), not the dK/dV tile's mirror:
    64 query rows per program stepping over 16 keys, against 16 x 32 for dK/dV."""
    tiles = dict(TILES, dq_tile="64x16w4s3")
    check_flash(pkg, device, 1, 100, 90, 4, 2, 64, torch.float32, causal=causal, window=window,
                tiles=tiles)


@pytest.mark.parametrize("n_q,n_k,d,window,causal", [
    (100, 90, 64, (-1, -1), False),
    (70, 100, 80, (-1, -1), True),
    (64, 90, 64, (64, 16), False),
], ids=["Nq100_Nk90", "causal_d80", "window64_16"])
def test_tma_knob(pkg, device, poison, n_q, n_k, d, window, causal):
    """The tma knob: unmasked Q/dO blocks (dK/dV kernel) and K/V blocks (dQ kernel) come
    through tensor descriptors, the ragged and masked blocks through plain loads; d=80 has a
    padded head-dim chunk the descriptor must read as zeros; GQA 2:1."""
    check_flash(pkg, device, 2, n_q, n_k, 4, 2, d, torch.float32, causal=causal,
                window=window, tiles=dict(TILES, tma=True))


FUSED = dict(TILES, fused_dq=True)


@pytest.mark.parametrize("n_q,n_k,window,causal", [
    (59, 59, (-1, -1), False),
    (127, 100, (-1, -1), True),
    (70, 37, (-1, -1), True),
    (64, 90, (20, 5), False),
], ids=["N59", "causal_Nq127_Nk100", "causal_NqgtNk", "window20_5"])
def test_fused_dq(pkg, device, poison, n_q, n_k, window, causal):
    """dQ accumulated inside the dK/dV kernel (the fused_dq knob): several key-block
    programs add into each block of dQ rows, in turns; GQA 2:1 so the turns are per
    query head; Nq > Nk leaves rows that no program visits (their dQ must be 0)."""
    check_flash(pkg, device, 2, n_q, n_k, 4, 2, 64, torch.float32, causal=causal,
                window=window, tiles=FUSED)


def test_fused_dq_is_deterministic(pkg, device):
    q = leaf(1, 90, 4, 64, dtype=torch.float16, device=device)
    k, v = (leaf(1, 90, 2, 64, dtype=torch.float16, device=device) for _ in range(2))
    do = torch.randn(1, 90, 4, 64, dtype=torch.float16, device=device)
    runs = []
    for _ in range(2):
        q.grad = k.grad = v.grad = None
        runs.append([g.clone() for g in flash_grads(pkg, q, k, v, do, causal=True, tiles=FUSED)])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_unknown_fused_dq_value_is_a_clear_error(pkg):
    q, k, v = (leaf(1, 40, 2, 64, dtype=torch.float32, device="cpu") for _ in range(3))
    out = pkg.flash_attn_func(q, k, v)
    with pkg._runtime.override_config(fused_dq="bogus"), pytest.raises(ValueError, match="fused_dq"):
        out.backward(torch.randn_like(out))


def test_batch3(pkg, device, poison):
    check_flash(pkg, device, 3, 31, 31, 2, 2, 64, torch.float16, causal=False)


@pytest.mark.parametrize("n_q,n_k,window,causal", [
    (64, 64, (8, 0), False),
    (64, 64, (20, 20), False),
    (40, 70, (10, -1), True),
    (70, 40, (16, 4), False),
], ids=["left8", "sym20", "causal_left10_NqltNk", "NqgtNk_16_4"])
def test_sliding_window(pkg, device, poison, n_q, n_k, window, causal):
    check_flash(pkg, device, 1, n_q, n_k, 2, 2, 64, torch.float32, causal=causal, window=window)


def test_fully_masked_rows_get_zero_gradients(pkg, device, poison):
    """Bottom-right causal with Nq > Nk: the first Nq - Nk queries see no key."""
    dt = torch.float32
    q = leaf(1, 50, 2, 64, dtype=dt, device=device)
    k, v = (leaf(1, 20, 2, 64, dtype=dt, device=device) for _ in range(2))
    do = torch.randn(1, 50, 2, 64, dtype=dt, device=device)
    grads = flash_grads(pkg, q, k, v, do, causal=True)
    assert (q.grad[:, :30] == 0).all()
    assert_grads(grads, reference_grads(q, k, v, do, visible_mask(50, 20, causal=True,
                                                                   bottom_right=True)), dt)


def test_sdpa_layout_top_left_causal(pkg, device, poison):
    dt = torch.float32
    q = leaf(2, 2, 30, 64, dtype=dt, device=device)
    k, v = (leaf(2, 2, 61, 64, dtype=dt, device=device) for _ in range(2))
    do = torch.randn(2, 2, 30, 64, dtype=dt, device=device)
    with pkg._runtime.override_config(**TILES):
        pkg.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.2).backward(do)
    ref = reference_grads(q, k, v, do, visible_mask(30, 61, causal=True, bottom_right=False),
                          bnhd=False, scale=0.2)
    assert_grads((q.grad, k.grad, v.grad), ref, dt)


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)), (True, (20, 0))],
                         ids=["causal", "full", "window20"])
def test_bhnd_entry_keeps_the_callers_layout(pkg, device, poison, causal, window):
    """flash_attn_bhnd (the transformers integration's path): (B, H, N, d) views of
    (B, N, H, d) memory, as transformers hands them over, GQA 4:1, N_q != N_k with the
    causal diagonal bottom-right. The output is laid out like query, so its (B, N, H, d)
    transpose is contiguous; gradients against float64 (fp16: bf16's rounding of dS summed
    over four query heads exceeds its tolerance now and then)."""
    dt = torch.float16
    q = leaf(2, 37, 4, 64, dtype=dt, device=device)  # (B, N, H, d) memory
    k, v = (leaf(2, 70, 1, 64, dtype=dt, device=device) for _ in range(2))
    do = torch.randn(2, 37, 4, 64, dtype=dt, device=device)
    with pkg._runtime.override_config(**TILES):
        out = pkg._api.flash_attn_bhnd(q.transpose(1, 2), k.transpose(1, 2),
                                       v.transpose(1, 2), 0.0, 0.3, causal, window)
        assert out.shape == (2, 4, 37, 64) and out.transpose(1, 2).is_contiguous()
        out.transpose(1, 2).backward(do)
    vis = visible_mask(37, 70, causal=causal, window=window, bottom_right=True)
    ref_out, _ = attention_ref(*(t.detach().double().transpose(1, 2) for t in (q, k, v)), vis,
                               scale=0.3)
    atol, rtol = GRAD_TOL[dt]
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), atol=atol, rtol=rtol)
    assert_grads((q.grad, k.grad, v.grad), reference_grads(q, k, v, do, vis, scale=0.3), dt)


def test_strided_inputs_get_gradients_in_their_layout(pkg, device, poison):
    dt = torch.float32
    big_q = torch.randn(2, 60, 3, 96, dtype=dt, device=device, requires_grad=True)
    big_kv = torch.randn(2, 2, 70, 4, 64, dtype=dt, device=device, requires_grad=True)
    q = big_q[:, 5:50, 1:3, 16:80]
    k, v = big_kv[:, 0, 10:60, ::2], big_kv[:, 1, 3:53, 1::2]
    do = torch.randn(2, 45, 2, 64, dtype=dt, device=device)
    with pkg._runtime.override_config(**TILES):
        pkg.flash_attn_func(q, k, v, causal=True).backward(do)
    q64 = big_q.detach().double().requires_grad_()
    kv64 = big_kv.detach().double().requires_grad_()
    out, _ = attention_ref(q64[:, 5:50, 1:3, 16:80].transpose(1, 2),
                           kv64[:, 0, 10:60, ::2].transpose(1, 2),
                           kv64[:, 1, 3:53, 1::2].transpose(1, 2),
                           visible_mask(45, 50, causal=True, bottom_right=True))
    out.transpose(1, 2).backward(do.double())
    torch.testing.assert_close(big_q.grad.double().cpu(), q64.grad.cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(big_kv.grad.double().cpu(), kv64.grad.cpu(), atol=1e-4, rtol=1e-4)


def test_gradient_layout_dtype_and_strides(pkg, device):
    dt = torch.bfloat16
    q = leaf(2, 40, 2, 64, dtype=dt, device=device)  # (B, N, H, d) contiguous
    k = torch.randn(2, 2, 40, 64, dtype=dt, device=device).transpose(1, 2).requires_grad_()
    v = leaf(2, 40, 2, 64, dtype=dt, device=device)
    pkg.flash_attn_func(q, k, v, causal=True).sum().backward()
    for t in (q, k, v):
        assert t.grad.dtype == t.dtype and t.grad.shape == t.shape
        assert t.grad.stride() == t.stride()


def test_qkvpacked(pkg, device, poison):
    dt = torch.float32
    qkv = leaf(2, 41, 3, 2, 64, dtype=dt, device=device)
    do = torch.randn(2, 41, 2, 64, dtype=dt, device=device)
    with pkg._runtime.override_config(**TILES):
        pkg.flash_attn_qkvpacked_func(qkv, causal=True).backward(do)
    qkv64 = qkv.detach().double().requires_grad_()
    q, k, v = (qkv64[:, :, i].transpose(1, 2) for i in range(3))
    out, _ = attention_ref(q, k, v, visible_mask(41, 41, causal=True, bottom_right=True))
    out.transpose(1, 2).backward(do.double())
    torch.testing.assert_close(qkv.grad.double().cpu(), qkv64.grad.cpu(), atol=1e-4, rtol=1e-4)


def test_requires_grad_on_some_inputs(pkg, device):
    dt = torch.float32
    q = leaf(1, 33, 2, 64, dtype=dt, device=device)
    k = torch.randn(1, 33, 2, 64, dtype=dt, device=device)
    v = leaf(1, 33, 2, 64, dtype=dt, device=device)
    do = torch.randn(1, 33, 2, 64, dtype=dt, device=device)
    with pkg._runtime.override_config(**TILES):
        pkg.flash_attn_func(q, k, v, causal=True).backward(do)
    assert k.grad is None
    rq, _, rv = reference_grads(q, k, v, do, visible_mask(33, 33, causal=True, bottom_right=True))
    torch.testing.assert_close(q.grad.double().cpu(), rq.cpu(), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(v.grad.double().cpu(), rv.cpu(), atol=1e-4, rtol=1e-4)


def test_backward_is_deterministic(pkg, device):
    """No atomics: two runs on the same inputs give bitwise-identical gradients."""
    dt = torch.bfloat16
    q = torch.randn(1, 70, 8, 64, dtype=dt, device=device)
    k, v = (torch.randn(1, 70, 2, 64, dtype=dt, device=device) for _ in range(2))
    do = torch.randn(1, 70, 8, 64, dtype=dt, device=device)
    runs = []
    for _ in range(2):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with pkg._runtime.override_config(**TILES):
            pkg.flash_attn_func(*leaves, causal=True).backward(do)
        runs.append([t.grad for t in leaves])
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_lse_is_not_differentiable(pkg, device):
    q, k, v = (leaf(1, 16, 2, 64, dtype=torch.float32, device=device) for _ in range(3))
    out, lse = pkg.flash_attn_func(q, k, v, return_lse=True)
    assert out.requires_grad and not lse.requires_grad


def test_torch_compile_fullgraph(pkg):
    """The custom op traces under torch.compile with no graph break (aot_eager on CPU
    exercises the fake tensors and the autograd registration)."""
    torch._dynamo.reset()

    def f(q, k, v):
        a = pkg.flash_attn_func(q, k, v, causal=True)
        b = pkg.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                             v.transpose(1, 2), is_causal=True)
        return (a * 2).sum() + b.sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    q, k, v = (leaf(1, 24, 2, 64, dtype=torch.float32, device="cpu") for _ in range(3))
    loss = compiled(q, k, v)
    loss.backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    f(q2, k2, v2).backward()
    torch.testing.assert_close(loss, f(q2.detach(), k2.detach(), v2.detach()))
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("b,h,n,d", [(3, 2, 59, 80), (1, 3, 1, 24), (2, 1, 130, 64)],
                         ids=["b3-n59-d80", "n1-d24", "n130-two-blocks-d64"])
def test_preprocess_zeroes_the_gluon_dq_sum(pkg, device, b, h, n, d):
    """The Gluon backward's fp32 dQ sum is zeroed by the preprocess (ZERO_DQ), not by a
    memset: every element of a NaN-filled sum in dQ's (B, N, H, d) layout becomes 0, the
    row after it stays untouched, and D = rowsum(dO * O) is still right."""
    rt = pkg._runtime
    o, do = (torch.randn(b, n, h, d, device=device, dtype=torch.bfloat16).transpose(1, 2)
             for _ in range(2))
    guard = torch.full((b, n + 1, h, d), float("nan"), device=device)
    acc = guard[:, :n].transpose(1, 2)  # (B, H, N, d), rows H * d apart
    delta = torch.full((b * h, n), float("nan"), device=device)
    pre = rt._preprocess(f"bwd_d{d}_bf16", (b * h, -(-n // rt.PREPROCESS_BLOCK)), False,
                         zero_dim=d)
    pre(o, do, delta, *o.stride()[:3], *do.stride()[:3], n, h, n, acc, *acc.stride()[:3])
    assert (acc == 0).all(), "the preprocess left part of the dQ sum unzeroed"
    assert guard[:, n].isnan().all(), "the preprocess wrote past the dQ sum's last row"
    ref = (o.double() * do.double()).sum(-1).reshape(b * h, n)
    torch.testing.assert_close(delta.double().cpu(), ref.cpu(), atol=1e-4, rtol=1e-4)
