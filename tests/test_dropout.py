"""Dropout inside the fused kernels.

The keep mask a call used is replayed with the package's `dropout_mask` hook (same
generator state, same Philox stream), so the forward and all three gradients can be checked
exactly against a float64 reference that applies that very mask:
    out = (softmax(S) * keep / (1 - p)) @ V.
"""
import contextlib
import math

import pytest
import torch

from conftest import GRAD_TOL, OUT_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

TILES = dict(block_m=16, block_n=32, num_warps=4, num_stages=2)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("drop"), "fg_test_dropout", """
        head_dims: [64, 80]
        dtypes: [fp16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 16, right: 0}
        dropout: true
        gqa: true
        """)


def reference(q, k, v, keep, p, visible, do):
    """(out, dq, dk, dv) in float64 for (B, N, H, d) inputs and a (B, H, Nq, Nk) mask."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2),
                           visible, keep=keep, dropout_p=p)
    out = out.transpose(1, 2)
    out.backward(do.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def run(pkg, device, b, n_q, n_k, h_q, h_kv, d, dtype, p, causal=False, window=(-1, -1), seed=0,
        tiles=TILES):
    q = torch.randn(b, n_q, h_q, d, dtype=dtype, device=device, requires_grad=True)
    k, v = (torch.randn(b, n_k, h_kv, d, dtype=dtype, device=device, requires_grad=True)
            for _ in range(2))
    do = torch.randn(b, n_q, h_q, d, dtype=dtype, device=device)
    torch.manual_seed(seed)
    with pkg._runtime.override_config(**tiles) if tiles else contextlib.nullcontext():
        out = pkg.flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window)
        out.backward(do)
    torch.manual_seed(seed)
    keep = pkg.dropout_mask(b, h_q, n_q, n_k, p, device=device)
    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
    ref = reference(q, k, v, keep, p, vis, do)
    return (out, q.grad, k.grad, v.grad), ref


def assert_close_all(got, ref, dtype):
    names = ["out", "dq", "dk", "dv"]
    for name, g, r, tol in zip(names, got, ref, [OUT_TOL[dtype]] + [GRAD_TOL[dtype]] * 3):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=tol[0], rtol=tol[1],
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("n_q,n_k,causal", [(1, 1, False), (59, 59, True), (37, 70, True),
                                             (70, 37, False), (127, 127, False)],
                         ids=["N1", "N59_causal", "Nq37_Nk70_causal", "Nq70_Nk37", "N127"])
def test_forward_and_gradients_with_the_exact_mask(pkg, device, poison, n_q, n_k, causal):
    got, ref = run(pkg, device, 1, n_q, n_k, 2, 2, 64, torch.float32, 0.2, causal=causal)
    assert_close_all(got, ref, torch.float32)


def test_gqa_window_fp16_head_dim_80(pkg, device, poison):
    got, ref = run(pkg, device, 2, 48, 48, 4, 1, 80, torch.float16, 0.1, causal=True,
                   window=(16, -1))
    assert_close_all(got, ref, torch.float16)


@pytest.mark.gpu
def test_direct_launch_with_seeds_of_both_widths(pkg):
    """Repeated calls of one shape reuse a launch plan that calls the compiled kernel
    directly; Triton compiles a seed below 2**31 as i32 and a larger one as i64, so seeds
    alternating between the two must each get the right mask."""
    for seed in (3, 2**40 + 5, 11, 2**40 + 7):
        got, ref = run(pkg, "cuda", 2, 70, 70, 2, 2, 64, torch.float16, 0.2, causal=True,
                       seed=seed, tiles=None)
        assert_close_all(got, ref, torch.float16)


def test_keep_rate_matches_one_minus_p(pkg, device):
    p = 0.1
    keep = pkg.dropout_mask(2, 2, 128, 256, p, device=device)
    n = keep.numel()
    rate = keep.float().mean().item()
    standard_error = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 4 * standard_error, (rate, standard_error)
    # no structure: every (batch, head) slice, and rows vs columns, keep about the same share
    per_slice = keep.float().mean(dim=(2, 3))
    assert (per_slice - (1 - p)).abs().max() < 5 * math.sqrt(p * (1 - p) / (128 * 256))
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


def test_consecutive_calls_differ_and_seeds_reproduce(pkg, device):
    torch.manual_seed(1)
    a = pkg.dropout_mask(1, 2, 64, 64, 0.3, device=device)
    b = pkg.dropout_mask(1, 2, 64, 64, 0.3, device=device)
    torch.manual_seed(1)
    a_again = pkg.dropout_mask(1, 2, 64, 64, 0.3, device=device)
    assert not torch.equal(a, b), "the generator was not advanced between calls"
    assert torch.equal(a, a_again)


def test_consecutive_attention_calls_draw_different_masks(pkg, device):
    q, k, v = (torch.randn(1, 40, 2, 64, device=device) for _ in range(3))
    torch.manual_seed(3)
    first = pkg.flash_attn_func(q, k, v, dropout_p=0.5)
    second = pkg.flash_attn_func(q, k, v, dropout_p=0.5)
    torch.manual_seed(3)
    first_again = pkg.flash_attn_func(q, k, v, dropout_p=0.5)
    assert not torch.equal(first, second)
    assert torch.equal(first, first_again)


def test_p_zero_runs_the_variant_without_dropout(pkg, monkeypatch):
    looked_up = []
    real = pkg._runtime.kernel

    def spy(name, function="kernel"):
        looked_up.append(name)
        return real(name, function)

    monkeypatch.setattr(pkg._runtime, "kernel", spy)
    pkg._runtime._forward_plans.clear()  # cached launch plans would skip the lookup
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    pkg.flash_attn_func(q, k, v, dropout_p=0.0, causal=True)
    pkg.flash_attn_func(q, k, v, dropout_p=0.25, causal=True)
    assert looked_up == ["fwd_causal_d64_fp32", "fwd_causal_dropout_d64_fp32"]
    source = (pkg._runtime.kernel("fwd_causal_d64_fp32").fn.__globals__["DROPOUT"])
    assert not bool(source)


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan"), "0.1"])
def test_invalid_dropout_p(pkg, p):
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        pkg.flash_attn_func(q, k, v, dropout_p=p)


def test_package_without_dropout_names_the_spec_field(tmp_path):
    plain = build_and_import(tmp_path, "fg_test_nodrop", """
        head_dims: [64]
        dtypes: [fp32]
        masks: [none]
        """)
    q, k, v = (torch.randn(1, 16, 2, 64) for _ in range(3))
    with pytest.raises(ValueError, match="set `dropout: true`"):
        plain.flash_attn_func(q, k, v, dropout_p=0.1)


def test_sdpa_dropout_matches_flash_dropout(pkg, device):
    """Both APIs draw the same stream for the same generator state."""
    q, k, v = (torch.randn(1, 30, 2, 64, device=device) for _ in range(3))
    torch.manual_seed(9)
    a = pkg.flash_attn_func(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(9)
    b = pkg.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                         v.transpose(1, 2), dropout_p=0.3, is_causal=True)
    torch.testing.assert_close(a, b.transpose(1, 2))


def test_torch_compile_with_dropout(pkg):
    torch._dynamo.reset()

    def f(q, k, v):
        return pkg.flash_attn_func(q, k, v, dropout_p=0.2, causal=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    q, k, v = (torch.randn(1, 24, 2, 64, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 24, 2, 64)
    torch.manual_seed(4)
    out = compiled(q, k, v)
    out.backward(do)
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    torch.manual_seed(4)
    eager = f(q, k, v)
    eager.backward(do)
    torch.testing.assert_close(out, eager)
    for g, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(g, t.grad)
