"""The Gluon (Hopper) backward.

On the CPU: which backward variants get a Gluon kernel, and that the runtime keeps the
`tl` backward where the Gluon one cannot serve (deterministic mode, the interpreter). The
sm_90 compile of every shipped Gluon kernel, backward included, is in test_gluon.py. On the
GPU (-m gpu): dQ, dK, dV of the Gluon kernel against autograd through the float64
reference, at shapes that cross many key blocks and query steps, ragged ends, Nq != Nk both
ways, GQA 4:1 and 8:1, d = 64 / 96 / 128, every mask; and the deterministic mode's
bitwise-reproducible `tl` fallback.
"""
import pytest
import torch

from conftest import GRAD_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gluon_bwd"), "fg_test_gluon_bwd", """
        head_dims: [64, 80, 96, 128]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        """)


def test_backward_variants_with_a_gluon_kernel(pkg):
    reasons = pkg._registry.GLUON
    assert reasons["bwd_causal_d128_bf16"] is None
    assert reasons["bwd_window_d96_fp16"] is None
    assert reasons["bwd_d64_bf16"] is None
    assert "fp32" in reasons["bwd_d128_fp32"]
    assert "head dim 80" in reasons["bwd_d80_bf16"]
    assert reasons["bwd_dropout_d128_bf16"] is None  # tests/test_gluon_dropout.py
    gluon = __import__("pathlib").Path(pkg.__file__).parent / "kernels" / "gluon"
    text = (gluon / "bwd_causal_d96_bf16.py").read_text()
    assert "def bwd_causal_d96_bf16_kernel(" in text and "HEAD_DIM_PAD = gl.constexpr(128)" in text


def test_backward_default_config_and_reasons(pkg):
    rt = pkg._runtime
    cfg = rt._families.gluon_default(128, "bwd")
    assert cfg["family"] == "gluon" and cfg["block_n"] == 2 * rt._families.KEY_ROWS_PER_CONSUMER
    q = torch.randn(1, 2, 64, 128, dtype=torch.bfloat16)
    # on the CPU (the interpreter, or no GPU) the Gluon backward never runs
    why = rt.gluon_backward_reason("bwd_d128_bf16", q, q, q, q, "none")
    assert why is not None
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in rt.gluon_backward_reason("bwd_d128_bf16", q, q, q, q, "none")
    finally:
        torch.use_deterministic_algorithms(False)


# ---------------------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _grads(pkg, q, k, v, do, causal, window):
    out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
    out.backward(do)
    return q.grad, k.grad, v.grad


def _reference(q, k, v, do, causal, window):
    vis = visible_mask(q.shape[1], k.shape[1], causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2), vis)
    out.transpose(1, 2).backward(do.double())
    return q64.grad, k64.grad, v64.grad


def _bwd_plan_kinds(pkg):
    """'gluon' for each backward plan that runs the Gluon kernel, else 'tl'."""
    return {"gluon" if p is not None and p[7] == pkg._runtime._BWD_GLUON else "tl"
            for p in pkg._runtime._backward_plans.values()}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, dtype, causal, window)
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, True, (-1, -1)),
    (2, 257, 1031, 8, 1, 128, torch.float16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 128, torch.bfloat16, True, (-1, -1)),  # rows that see no key
    (1, 2048, 2048, 16, 16, 64, torch.bfloat16, False, (-1, -1)),
    (3, 59, 127, 4, 1, 64, torch.float16, False, (-1, -1)),
    (2, 777, 777, 4, 2, 96, torch.bfloat16, False, (100, 0)),
    (1, 1, 513, 8, 8, 128, torch.bfloat16, True, (-1, -1)),
    (2, 127, 127, 4, 4, 128, torch.bfloat16, False, (-1, -1)),
], ids=["causal-b3-gqa4", "causal-nq<nk-gqa8", "causal-nq>nk", "d64-2k", "odd-gqa4",
        "d96-window", "decode-row", "N127"])
# (bwd_head_group 5: key blocks level by level in groups of 5 (batch, K/V head) pairs, the
# last group short -- 6 pairs at causal-b3-gqa4, 8 at causal-nq>nk)
@pytest.mark.parametrize("knobs", [{}, {"regs": "232/40"}, {"bwd_head_group": 5}],
                         ids=["default", "regs", "group5"])
def test_gluon_backward_against_float64(pkg, poison, case, knobs):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, nq, nk, hq, hkv, d, dt, causal, window = case
    pkg._runtime._backward_plans.clear()
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt).requires_grad_()
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt).requires_grad_()
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt).requires_grad_()
    do = torch.randn(b, nq, hq, d, device="cuda", dtype=dt)
    # the knobs are the backward's: the forward runs at its own Gluon default (a d=64
    # forward's three consumers take no 232/40 register split)
    with pkg._runtime.override_config(family="gluon"):
        out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
        with pkg._runtime.override_config(family="gluon", **knobs):
            out.backward(do)
            assert _bwd_plan_kinds(pkg) == {"gluon"}
    grads = q.grad, k.grad, v.grad
    atol, rtol = GRAD_TOL[dt]
    for name, g, r in zip("qkv", grads, _reference(q, k, v, do, causal, window)):
        assert not torch.isnan(g).any(), f"NaN in d{name}"
        torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"d{name}: {m}")


def test_descriptors_without_checks_are_the_checked_ones(pkg):
    """After a plan's first call the backward makes its TMA descriptors without Gluon's
    TensorDescriptor checks (_runtime._bare_descriptors): field for field the same
    descriptor."""
    import dataclasses

    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    make = pkg._runtime._bare_descriptors()
    if make is None:  # another Triton's descriptor: the checked constructor serves every call
        assert pkg._runtime._descriptor_maker(True) is hopper.TensorDescriptor
        import triton
        assert not triton.__version__.startswith("3.6."), "3.6's descriptor is the one read"
        return
    t = torch.randn(2, 3, 40, 64, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    args = (t, list(t.shape), list(t.stride()), [1, 1, 64, 64], layout)
    bare, checked = make(*args), hopper.TensorDescriptor(*args)
    assert type(bare) is type(checked)
    assert dataclasses.asdict(bare).keys() == dataclasses.asdict(checked).keys()
    for f in dataclasses.fields(checked):
        assert getattr(bare, f.name) is getattr(checked, f.name) or \
            getattr(bare, f.name) == getattr(checked, f.name), f.name


@pytest.mark.gpu
def test_repeated_backward_calls_reuse_the_plan_with_unchecked_descriptors(pkg, poison):
    """The second and later calls of a signature make the descriptors without the checks;
    each call's gradients against float64 (fresh inputs every call)."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = pkg._runtime
    dt = torch.bfloat16
    atol, rtol = GRAD_TOL[dt]
    with rt.override_config(family="gluon"):  # (plans cleared on entry and on exit only)
        for call in range(3):
            q, k, v = (torch.randn(2, 300, h, 128, device="cuda", dtype=dt).requires_grad_()
                       for h in (8, 2, 2))
            do = torch.randn(2, 300, 8, 128, device="cuda", dtype=dt)
            grads = _grads(pkg, q, k, v, do, True, (-1, -1))
            assert len(rt._backward_plans) == 1 and _bwd_plan_kinds(pkg) == {"gluon"}
            for name, g, r in zip("qkv", grads, _reference(q, k, v, do, True, (-1, -1))):
                assert not torch.isnan(g).any(), f"call {call}: NaN in d{name}"
                torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=atol, rtol=rtol,
                                           msg=lambda m: f"call {call}, d{name}: {m}")
    assert callable(rt._bare_descriptor)


@pytest.mark.gpu
def test_deterministic_mode_takes_the_reproducible_tl_backward(pkg):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = pkg._runtime
    q = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    do = torch.randn_like(q)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        rt._backward_plans.clear()
        with rt.override_config(family="gluon"):
            for _ in range(2):
                q.grad = None
                pkg.flash_attn_func(q, q, q, causal=True).backward(do)
                runs.append(q.grad.clone())
            assert _bwd_plan_kinds(pkg) == {"tl"}
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0], runs[1])


def test_which_gluon_kernels_run_by_default():
    from flashgen import families

    # what has run on the H100 and beaten `tl` there: the forward without dropout, the
    # backward at d >= 96 (d=64 from GLUON_BWD_SMALL_D_MIN_N); the dropout backward by the
    # same rule; the dropout forward at d = 64 and 128 (d = 96 and with mods when asked for)
    assert families.gluon_by_default("fwd", False, 64)
    assert families.gluon_by_default("bwd", False, 128)
    assert families.gluon_by_default("bwd", False, 96)
    # d=64: `tl` below GLUON_BWD_SMALL_D_MIN_N, Gluon (128-row steps) from it up
    assert not families.gluon_by_default("bwd", False, 64)
    assert not families.gluon_by_default("bwd", False, 64, (), families.GLUON_BWD_SMALL_D_MIN_N // 2)
    assert families.gluon_by_default("bwd", False, 64, (), families.GLUON_BWD_SMALL_D_MIN_N)
    assert families.gluon_default(64, "bwd")["block_m"] == 128
    assert families.gluon_default(128, "bwd")["block_m"] == 64
    assert families.gluon_by_default("fwd", True, 128)
    assert not families.gluon_by_default("fwd", True, 64)  # (a length rule at d = 64)
    assert families.gluon_by_default("fwd", True, 64, (), families.GLUON_DROPOUT_FWD_SMALL_D_MIN_N)
    assert not families.gluon_by_default("fwd", True, 64, (), 512)
    assert not families.gluon_by_default("fwd", True, 96)
    assert not families.gluon_by_default("fwd", True, 128, ("score",))
    assert families.gluon_by_default("bwd", True, 128)
    assert families.gluon_by_default("bwd", True, 96)
    assert not families.gluon_by_default("bwd", True, 64)
    assert not families.gluon_by_default("bwd", True, 64, (), families.GLUON_BWD_SMALL_D_MIN_N // 2)
    assert families.gluon_by_default("bwd", True, 64, (), families.GLUON_BWD_SMALL_D_MIN_N)


def test_causal_backward_head_groups(pkg):
    """The dense Gluon backward's program order: under a causal mask, the smallest divisor
    of the (batch, K/V head) pairs whose key blocks fill a 132-SM wave to within one level
    (families.bwd_head_group); head-major (1) without a causal mask or off a GPU; a config's
    bwd_head_group wins."""
    from flashgen import families

    assert families.bwd_head_group(16, 32, 132) == 4  # (1, 16, 4k): 4 x 32 blocks a wave
    assert families.bwd_head_group(128, 16, 132) == 8  # (8, 16, 2k)
    assert families.bwd_head_group(8, 32, 132) == 4  # GQA 4:1 at (1, 32, 4k): K/V heads
    assert families.bwd_head_group(16, 128, 132) == 1  # 16k: 128 blocks a head already
    assert families.bwd_head_group(6, 2, 132) == 6  # few blocks: every pair in one group
    rt = pkg._runtime
    q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    for name in ("bwd_causal_d128_bf16", "bwd_d128_bf16", "bwd_window_d128_bf16"):
        assert rt._gluon_bwd_head_group({}, name, q, 16, 32) == 1  # (a CPU tensor; unmasked)
    assert rt._gluon_bwd_head_group({"bwd_head_group": 5}, "bwd_causal_d128_bf16", q, 16, 32) == 5
