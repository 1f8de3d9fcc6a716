"""Forward kernels against the float64 reference.

Shapes are small (the CPU runs them in Triton's interpreter) but chosen to hit every edge
of the kernel: one token, lengths that are not multiples of any block (59, 127, 257),
Nq != Nk both ways, head dims that are not powers of two (24, 80, 96), GQA 4:1 and 8:1,
strided views, batch 3, and rows that see no key at all. Most cases force 16x16 tiles so
that even short sequences cross several key blocks and all three loop phases run.
"""
import contextlib
import math

import pytest
import torch

from conftest import LSE_TOL, OUT_TOL
from packages import build_and_import
from flashgen.reference import attention_ref, visible_mask

SMALL_TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("fwd"), "fg_test_fwd", """
        head_dims: [24, 64, 80, 96]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 32, right: 0}
        gqa: true
        """)


def rand(*shape, dtype, device):
    return torch.randn(*shape, dtype=dtype, device=device)


def assert_out(out, ref_out, dtype):
    assert not torch.isnan(out).any(), "NaN in the output (or an element never written)"
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), atol=atol, rtol=rtol)


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    """out and ref_out (B, H, N, d); lse and ref_lse (B, H, N)."""
    assert_out(out, ref_out, dtype)
    assert not torch.isnan(lse).any(), "NaN in the LSE (or an element never written)"
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen.cpu()), "LSE -inf rows differ"
    assert (lse.cpu()[~seen.cpu()] == float("-inf")).all()
    torch.testing.assert_close(lse.double().cpu()[seen.cpu()], ref_lse.cpu()[seen.cpu()],
                               atol=LSE_TOL[0], rtol=LSE_TOL[1])


def run_flash(pkg, q, k, v, *, causal=False, window=(-1, -1), tiles=SMALL_TILES):
    """flash_attn_func on (B, N, H, d); returns (out, lse, ref_out, ref_lse) as (B, H, N, ...)."""
    with pkg._runtime.override_config(**tiles) if tiles else contextlib.nullcontext():
        out, lse = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                       return_lse=True)
    vis = visible_mask(q.shape[1], k.shape[1], causal=causal, window=window, bottom_right=True)
    ref_out, ref_lse = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis)
    return out.transpose(1, 2), lse, ref_out, ref_lse


# ---------------------------------------------------------------------------------------
# odd lengths, both causal conventions
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_q,n_k", [(1, 1), (59, 59), (127, 127), (37, 70), (70, 37), (1, 59)],
                         ids=["N1", "N59", "N127", "Nq37_Nk70", "Nq70_Nk37", "Nq1_Nk59"])
def test_odd_lengths_flash_layout(pkg, device, poison, n_q, n_k, causal):
    dt = torch.float16
    q, k, v = (rand(2, n, 2, 64, dtype=dt, device=device) for n in (n_q, n_k, n_k))
    assert_matches(*run_flash(pkg, q, k, v, causal=causal), dt)


def test_n257_with_planned_tiles(pkg, device, poison):
    """The planner's real tiles (128 x 64 for d=64) rather than the forced small ones."""
    dt = torch.float16
    q, k, v = (rand(1, 257, 2, 64, dtype=dt, device=device) for _ in range(3))
    assert_matches(*run_flash(pkg, q, k, v, causal=True, tiles=None), dt)


@pytest.mark.parametrize("dt", [torch.float16, torch.bfloat16, torch.float32],
                         ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dtypes(pkg, device, poison, dt, causal):
    q, k, v = (rand(1, 45, 2, 64, dtype=dt, device=device) for _ in range(3))
    assert_matches(*run_flash(pkg, q, k, v, causal=causal), dt)


@pytest.mark.parametrize("d", [24, 80, 96])
def test_head_dims_not_powers_of_two(pkg, device, poison, d):
    dt = torch.float16
    q, k, v = (rand(1, 50, 2, d, dtype=dt, device=device) for _ in range(3))
    assert_matches(*run_flash(pkg, q, k, v, causal=True), dt)


@pytest.mark.parametrize("h_q,h_kv", [(8, 2), (8, 1)], ids=["gqa4to1", "gqa8to1"])
def test_gqa(pkg, device, poison, h_q, h_kv):
    dt = torch.bfloat16
    q = rand(1, 33, h_q, 64, dtype=dt, device=device)
    k, v = (rand(1, 40, h_kv, 64, dtype=dt, device=device) for _ in range(2))
    assert_matches(*run_flash(pkg, q, k, v, causal=True), dt)


@pytest.mark.parametrize("d,causal", [(64, False), (80, True), (96, False)],
                         ids=["d64", "d80_causal", "d96"])
def test_tensor_descriptors_and_warp_specialization(pkg, device, poison, d, causal):
    """The Hopper knobs: unmasked K/V blocks loaded through tensor descriptors (rows past
    N_K and columns past the head dim read as zero) inside a warp-specialised loop."""
    tiles = dict(SMALL_TILES, tma=True, warp_specialize=True)
    q = rand(2, 70, 4, d, dtype=torch.float16, device=device)
    k, v = (rand(2, 83, 2, d, dtype=torch.float16, device=device) for _ in range(2))
    out, lse, ref_out, ref_lse = run_flash(pkg, q, k, v, causal=causal, tiles=tiles)
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


def test_batch3(pkg, device, poison):
    dt = torch.float16
    q, k, v = (rand(3, 31, 2, 64, dtype=dt, device=device) for _ in range(3))
    assert_matches(*run_flash(pkg, q, k, v, causal=True), dt)


# ---------------------------------------------------------------------------------------
# sliding windows, and rows that see nothing
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_k,window,causal", [
    (64, 64, (8, 0), False),
    (64, 64, (20, 20), False),
    (64, 64, (5, -1), False),
    (64, 64, (-1, 3), False),
    (40, 70, (10, -1), True),
    (70, 40, (16, 4), False),
], ids=["left8", "sym20", "left5_unbounded_right", "right3_only", "causal_left10_NqltNk",
        "NqgtNk_16_4"])
def test_sliding_window(pkg, device, poison, n_q, n_k, window, causal):
    dt = torch.float16
    q = rand(1, n_q, 2, 64, dtype=dt, device=device)
    k, v = (rand(1, n_k, 2, 64, dtype=dt, device=device) for _ in range(2))
    assert_matches(*run_flash(pkg, q, k, v, causal=causal, window=window), dt)


def test_fully_masked_rows_give_zero_and_minus_inf(pkg, device, poison):
    """Bottom-right causal with Nq > Nk: the first Nq - Nk queries precede every key."""
    dt = torch.float32
    q = rand(1, 50, 2, 64, dtype=dt, device=device)
    k, v = (rand(1, 20, 2, 64, dtype=dt, device=device) for _ in range(2))
    out, lse, ref_out, ref_lse = run_flash(pkg, q, k, v, causal=True)
    assert (out[:, :, :30] == 0).all()
    assert (lse[:, :, :30] == float("-inf")).all()
    assert_matches(out, lse, ref_out, ref_lse, dt)


# ---------------------------------------------------------------------------------------
# layouts: SDPA's (B, H, N, d), strided views, the packed QKV buffer
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("n_q,n_k", [(45, 45), (30, 61)])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_sdpa_top_left_causal(pkg, device, poison, n_q, n_k, causal):
    dt = torch.float16
    q = rand(2, 2, n_q, 64, dtype=dt, device=device)
    k, v = (rand(2, 2, n_k, 64, dtype=dt, device=device) for _ in range(2))
    with pkg._runtime.override_config(**SMALL_TILES):
        out = pkg.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=0.3)
    vis = visible_mask(n_q, n_k, causal=causal, bottom_right=False)
    ref_out, _ = attention_ref(q, k, v, vis, scale=0.3)
    assert out.shape == q.shape and out.is_contiguous()
    assert_out(out, ref_out, dt)


def test_sdpa_gqa_needs_enable_gqa(pkg, device):
    q = rand(1, 4, 16, 64, dtype=torch.float16, device=device)
    k, v = (rand(1, 2, 16, 64, dtype=torch.float16, device=device) for _ in range(2))
    with pytest.raises(ValueError, match="enable_gqa=True"):
        pkg.scaled_dot_product_attention(q, k, v)
    out = pkg.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    ref, _ = attention_ref(q, k, v, visible_mask(16, 16, causal=False, bottom_right=False))
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), atol=2e-3, rtol=2e-3)


def test_strided_views(pkg, device, poison):
    """Non-contiguous inputs: every tensor is a slice of a larger buffer with its own
    strides (only the head dim must be unit-stride)."""
    dt = torch.float16
    big_q = rand(2, 70, 5, 96, dtype=dt, device=device)
    big_kv = rand(2, 3, 90, 4, 80, dtype=dt, device=device)
    q = big_q[:, 3:50, 1:3, 16:80]  # (2, 47, 2, 64), strides of the big buffer
    k = big_kv[:, 0, 10:70, ::2, :64]  # heads every other one
    v = big_kv[:, 2, 5:65, 1::2, 16:]
    assert not q.is_contiguous() and not k.is_contiguous() and not v.is_contiguous()
    assert_matches(*run_flash(pkg, q, k, v, causal=True), dt)


@pytest.mark.parametrize("d, pad", [(96, 8), (96, 1), (80, 8)])
def test_padded_v_rows_at_split_head_dims(pkg, device, poison, d, pad):
    """V rows padded by a few elements at a head dim the `tl` kernels split (96 = 64 + 32,
    80 = 64 + 16), with the planned tiles: Triton 3.6 computed the narrow chunk's P @ V
    wrong on Hopper from such rows (output columns 64..d wrong), so the runtime copies
    them (_plans.v_in_place). Found by `flashgen selftest --fuzz` on an H100."""
    dt = torch.bfloat16
    q, k = rand(1, 257, 4, d, dtype=dt, device=device), rand(1, 257, 1, d, dtype=dt, device=device)
    v = rand(1, 257, 1, d + pad, dtype=dt, device=device)[..., :d]
    assert_matches(*run_flash(pkg, q, k, v, causal=True, tiles=None), dt)
    assert_matches(*run_flash(pkg, q, k, v, window=(64, 0), tiles=None), dt)


@pytest.mark.parametrize("shape, strides, ptr, in_place", [
    ((1, 257, 1, 96), (26728, 104, 104, 1), 0, False),     # rows padded by 8
    ((1, 257, 1, 96), (24929, 97, 97, 1), 0, False),       # by 1
    ((1, 257, 1, 96), (24672, 96, 96, 1), 8, False),       # a base off 16 bytes
    ((1, 257, 1, 96), (24672, 96, 96, 1), 0, True),        # contiguous
    ((1, 257, 3, 80), (61680, 240, 80, 1), 0, True),       # contiguous d = 80
    ((1, 257, 1, 128), (33153, 129, 129, 1), 0, True),     # no narrow chunk at 128
    ((1, 257, 1, 40), (10280, 40, 40, 1), 0, True),        # d = 40: a copy is no better
])
def test_which_v_the_forward_reads_in_place(pkg, shape, strides, ptr, in_place):
    class CudaV:  # the attributes v_in_place reads, as a CUDA tensor has them
        device = torch.device("cuda")
        def __init__(self):
            self.shape = shape
        def data_ptr(self):
            return 0x7f0000000000 + ptr
        def stride(self):
            return strides
    assert pkg._runtime.v_in_place(CudaV()) is in_place


def test_qkvpacked(pkg, device, poison):
    dt = torch.bfloat16
    qkv = rand(2, 41, 3, 2, 64, dtype=dt, device=device)
    with pkg._runtime.override_config(**SMALL_TILES):
        out, lse = pkg.flash_attn_qkvpacked_func(qkv, causal=True, return_lse=True)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    ref_out, ref_lse = attention_ref(q, k, v, visible_mask(41, 41, causal=True, bottom_right=True))
    assert_matches(out.transpose(1, 2), lse, ref_out, ref_lse, dt)


def test_softmax_scale(pkg, device, poison):
    dt = torch.float32
    q, k, v = (rand(1, 20, 2, 64, dtype=dt, device=device) for _ in range(3))
    out, lse = pkg.flash_attn_func(q, k, v, softmax_scale=0.05, return_lse=True)
    vis = visible_mask(20, 20, causal=False, bottom_right=True)
    ref_out, ref_lse = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                     vis, scale=0.05)
    assert_matches(out.transpose(1, 2), lse, ref_out, ref_lse, dt)


def test_empty_query(pkg, device):
    q = rand(1, 0, 2, 64, dtype=torch.float16, device=device)
    k, v = (rand(1, 5, 2, 64, dtype=torch.float16, device=device) for _ in range(2))
    out = pkg.flash_attn_func(q, k, v)
    assert out.shape == (1, 0, 2, 64)


def test_large_logits_stay_finite(pkg, device, poison):
    """Scores around 1e4 would overflow a naive exp; the online softmax must not."""
    dt = torch.float32
    q = rand(1, 33, 1, 64, dtype=dt, device=device) * 30
    k, v = (rand(1, 33, 1, 64, dtype=dt, device=device) * 30 for _ in range(2))
    out, lse, ref_out, ref_lse = run_flash(pkg, q, k, v, causal=True)
    assert torch.isfinite(out).all()
    # fp32 scores of magnitude ~1e3 carry ~1e-4 of rounding, which moves outputs of
    # magnitude |v| ~ 30 by up to ~2e-3 (seen); a broken online softmax is off by O(|v|)
    torch.testing.assert_close(out.double().cpu(), ref_out.cpu(), atol=1e-2, rtol=1e-4)
    torch.testing.assert_close(lse.double().cpu(), ref_lse.cpu(), atol=1e-3, rtol=1e-5)


# ---------------------------------------------------------------------------------------
# bad input: a ValueError that names the problem and the fix, before any launch
# ---------------------------------------------------------------------------------------
def _qkv(dtype=torch.float16, shape=(1, 16, 2, 64), device="cpu"):
    return [torch.randn(*shape, dtype=dtype, device=device) for _ in range(3)]


@pytest.mark.parametrize("case,match", [
    ("dtype_not_built", r"built for dtypes .* add it to `dtypes`"),
    ("head_dim_not_built", r"built for head dims .* `head_dims`"),
    ("mixed_dtypes", "share a dtype"),
    ("three_dims", "must be a 4-D"),
    ("batch_mismatch", "batch"),
    ("head_dim_mismatch", "head dim"),
    ("heads_not_multiple", "multiple of key/value heads"),
    ("no_heads", r"head count must be >= 1, got 0 query heads and 0 key/value heads"),
    ("no_kv_heads", r"head count must be >= 1, got 2 query heads and 0 key/value heads"),
    ("last_dim_strided", r"unit stride .*\.contiguous\(\)"),
    ("kv_shape_mismatch", "k and v must have one shape"),
    ("bad_dropout", r"dropout_p must be a number in \[0, 1\)"),
    ("bad_window", "window_size"),
    ("bad_scale", "positive finite"),
    ("not_a_tensor", "torch.Tensor"),
])
def test_bad_input_raises_before_launch(pkg, monkeypatch, case, match):
    def no_launch(name):
        raise AssertionError("a kernel was looked up for an invalid call")

    monkeypatch.setattr(pkg._runtime, "kernel", no_launch)
    q, k, v = _qkv()
    kwargs = {}
    if case == "dtype_not_built":
        q, k, v = _qkv(torch.float64)
    elif case == "head_dim_not_built":
        q, k, v = _qkv(shape=(1, 16, 2, 32))
    elif case == "mixed_dtypes":
        k = k.float()
    elif case == "three_dims":
        q = q[0]
    elif case == "batch_mismatch":
        k, v = torch.cat([k, k]), torch.cat([v, v])
    elif case == "head_dim_mismatch":
        k, v = k[..., :32], v[..., :32]
    elif case == "heads_not_multiple":
        q = torch.randn(1, 16, 3, 64, dtype=torch.float16)
    elif case == "no_heads":
        q, k, v = _qkv(shape=(1, 16, 0, 64))
    elif case == "no_kv_heads":
        k, v = k[:, :, :0], v[:, :, :0]
    elif case == "last_dim_strided":
        q = torch.randn(1, 16, 2, 128, dtype=torch.float16)[..., ::2]
    elif case == "kv_shape_mismatch":
        v = v[:, :8]
    elif case == "bad_dropout":
        kwargs = dict(dropout_p=1.0)
    elif case == "bad_window":
        kwargs = dict(window_size=(-2, 0))
    elif case == "bad_scale":
        kwargs = dict(softmax_scale=-1.0)
    elif case == "not_a_tensor":
        q = q.tolist()
    with pytest.raises(ValueError, match=match):
        pkg.flash_attn_func(q, k, v, **kwargs)


def test_sdpa_attn_mask_needs_the_spec_key(tmp_path):
    """attn_mask works by default (tests/test_mods.py); a package built with
    `attn_mask: false` says which key to set."""
    small = build_and_import(tmp_path, "fg_test_noattnmask", """
        head_dims: [64]
        dtypes: [fp32]
        masks: [none]
        attn_mask: false
        """)
    q, k, v = (t.transpose(1, 2) for t in _qkv(torch.float32))
    with pytest.raises(NotImplementedError, match="attn_mask: true"):
        small.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(16, 16, dtype=torch.bool))


def test_package_without_a_mask_names_the_spec_field(tmp_path):
    small = build_and_import(tmp_path, "fg_test_nomask", """
        head_dims: [64]
        dtypes: [fp32]
        masks: [none]
        """)
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match=r"`causal` mask .* add `causal` to `masks`"):
        small.flash_attn_func(q, k, v, causal=True)
    with pytest.raises(ValueError, match=r"`sliding_window` mask"):
        small.flash_attn_func(q, k, v, window_size=(4, 0))
    q = torch.randn(1, 16, 4, 64)
    with pytest.raises(ValueError, match=r"set `gqa: true`"):
        small.flash_attn_func(q, k, v)


def test_cpu_tensors_without_interpreter_are_refused(pkg, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="run on CUDA GPUs"):
        pkg.flash_attn_func(*_qkv(device="cpu"))


def test_scale_default_is_inverse_sqrt_d(pkg):
    assert math.isclose(pkg._runtime.softmax_scale(None, 64), 0.125)


@pytest.mark.gpu
def test_new_lengths_reuse_the_compiled_kernel(pkg):
    """Sequence lengths are run-time arguments: many lengths, one binary (Triton may add
    one more for a different pointer/stride alignment class)."""
    name = "fwd_causal_d64_fp16"
    rt = pkg._runtime
    # both families may serve these calls on Hopper (tiny calls go to `tl`): count each
    fns = [rt.kernel(name)]
    if rt.GLUON[name] is None and rt.gluon_ready(torch.device("cuda")) is None:
        fns.append(rt.kernel(name, family="gluon"))
    for n_q, n_k in [(100, 100), (37, 1000), (1, 513), (4096, 4096), (17, 16), (250, 250)]:
        q = torch.randn(2, n_q, 4, 64, dtype=torch.float16, device="cuda")
        k, v = (torch.randn(2, n_k, 4, 64, dtype=torch.float16, device="cuda") for _ in range(2))
        pkg.flash_attn_func(q, k, v, causal=True)
    torch.cuda.synchronize()
    counts = []
    for fn in fns:
        counts.append(sum(next(len(c) for c in cache if isinstance(c, dict))
                          for cache in fn.device_caches.values()))
    assert sum(counts) >= 1 and all(c <= 2 for c in counts), f"{counts} binaries per family"


@pytest.mark.gpu
def test_direct_launch_repeats_are_right(pkg):
    """After its first call a launch plan hands arguments straight to the compiled kernel
    (runtime.Launcher). Repeated calls with new values must still be right, and a tensor
    of the same shape whose storage starts off a 16-byte boundary (Triton specialised the
    first binary on alignment) must get its own plan, not the aligned binary."""
    def check(q, k, v):
        out, lse, ref_out, ref_lse = run_flash(pkg, q, k, v, causal=True, tiles=None)
        assert_matches(out, lse, ref_out, ref_lse, torch.float16)

    shape = (2, 100, 4, 64)
    for _ in range(3):
        check(*(rand(*shape, dtype=torch.float16, device="cuda") for _ in range(3)))
    launcher = next(plan[0] for key, plan in pkg._runtime._forward_plans.items()
                    if key[1] == torch.Size(shape))
    if not hasattr(launcher, "compiled"):  # a Gluon plan holds its Launcher
        launcher = launcher.launch
    assert launcher.compiled is not None, "the plan never took the direct path"
    # the same shape and strides, storage 2 bytes past an aligned address
    base = rand(2 * 100 * 4 * 64 + 1, dtype=torch.float16, device="cuda")
    q = base[1:].view(shape)
    assert q.data_ptr() % 16 != 0
    check(q, *(rand(*shape, dtype=torch.float16, device="cuda") for _ in range(2)))
