"""Dropout inside the fused kernels.

The keep mask a call used is replayed with the package's `dropout_mask` hook (same
generator state, same Philox stream), so the forward and all three gradients can be checked
exactly against a float64 reference that applies that very mask:
    out = (softmax(S) * keep / r) @ V,
with r the keep rate the packages document: one byte draw per element, dropped below
T = round(256 p) (clamped to [1, 255]), r = 1 - T / 256. The mask itself is checked against
an independent NumPy Philox4x32 (at flashgen's PHILOX_ROUNDS) and the documented
element -> (call, word, byte) map.
"""
import contextlib
import importlib
import math

import numpy as np
import pytest
import torch

from conftest import GRAD_TOL, OUT_TOL
from flashgen.families import PHILOX_ROUNDS
from flashgen.reference import attention_ref, dropout_keep_rate, visible_mask
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


@pytest.mark.parametrize("tiles", [
    dict(block_m=64, block_n=16, num_warps=4, num_stages=2),
    dict(block_m=16, block_n=128, num_warps=4, num_stages=2),
    dict(block_m=32, block_n=64, num_warps=4, num_stages=2, dq_tile="16x32w4s2"),
    dict(block_m=128, block_n=32, num_warps=4, num_stages=2, dq_tile="64x128w4s2"),
], ids=["fwd16keys-dkdv16keys", "fwd128keys-dq16keys", "dq16x32", "dq64x128"])
def test_every_kernel_regenerates_the_same_mask_at_any_tile(pkg, device, poison, tiles):
    """The forward ([queries, keys] tiles), dK/dV (its transpose) and dQ kernels each
    rebuild the mask at their own tile; 16-key tiles take half of a 32-column Philox block.
    The gradients only match the reference if all three rebuilt the mask it replays."""
    got, ref = run(pkg, device, 1, 150, 150, 2, 2, 64, torch.float32, 0.3, causal=True,
                   tiles=tiles)
    assert_close_all(got, ref, torch.float32)


@pytest.mark.parametrize("p", [1 / 512, 0.5, 0.999])
def test_rounding_edges_scale_as_documented(pkg, device, poison, p):
    """p = 1/512 drops 1/256 (T clamped up to 1), 0.5 exactly half, 0.999 keeps 1/256 and
    scales the survivors by 256: forward and gradients against the reference's scale."""
    got, ref = run(pkg, device, 1, 70, 70, 2, 2, 64, torch.float32, p, causal=False)
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


# dropout_p -> T (drop when the byte draw is below T), written out from the documented
# rule: round(256 p), halves up, clamped to [1, 255] when p > 0
THRESHOLDS = {0.0: 0, 1 / 1024: 1, 1 / 512: 1, 0.1: 26, 0.3: 77, 0.5: 128, 0.999: 255,
              1 - 1 / 1024: 255}


@pytest.mark.parametrize("p,t", sorted(THRESHOLDS.items()))
def test_threshold_and_scale_are_the_documented_rounding(pkg, p, t):
    drop = importlib.import_module(f"{pkg.__name__}._dropout")
    assert drop.threshold(p) == t
    assert pkg.dropout_scale(p) == 256 / (256 - t) == 1 / dropout_keep_rate(p)
    seed, stream, thresh, scale = drop.launch_args(torch.tensor([5, 9]), p)
    assert (thresh, scale) == (t, 256 / (256 - t))
    assert (seed, stream) == ((5, 9) if p > 0 else (0, 0))


@pytest.mark.parametrize("p", [1.0, -0.1, float("nan")])
def test_dropout_scale_refuses_what_a_call_refuses(pkg, p):
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        pkg.dropout_scale(p)


@pytest.mark.parametrize("p", [0.1, 1 / 512, 0.5, 0.999])
def test_keep_rate_is_one_minus_t_over_256(pkg, device, p):
    """Over 2**20 elements the keep rate is within 4 standard errors of 1 - T/256. At the
    rounding edges that is far from 1 - p (p = 1/512 drops twice as much, 0.999 keeps four
    times as much: 32 and 47 standard errors off); at 0.1, 5 (0.8984 vs 0.9)."""
    torch.manual_seed(11)
    keep = pkg.dropout_mask(4, 2, 256, 512, p, device=device)
    n = keep.numel()
    want = 1 - THRESHOLDS[p] / 256
    rate = keep.float().mean().item()
    standard_error = math.sqrt(want * (1 - want) / n)
    assert abs(rate - want) < 4 * standard_error, (rate, want, standard_error)
    # no structure: every (batch, head) slice, every row parity and column position in a
    # 32-column Philox block keeps about the same share
    per_slice = keep.float().mean(dim=(2, 3))
    assert (per_slice - want).abs().max() < 5 * math.sqrt(want * (1 - want) / (256 * 512)), per_slice
    per_lane = keep.view(4, 2, 256, 16, 32).float().mean(dim=(0, 1, 2, 3))
    assert (per_lane - want).abs().max() < 5 * math.sqrt(want * (1 - want) / (n // 32)), per_lane
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


def _philox4x32(seed, c0, c1, c2, c3, rounds=PHILOX_ROUNDS):
    """Philox4x32 (Salmon et al., SC'11) in NumPy: the four 32-bit words of counters
    (c0, c1, c2, c3) under the 64-bit key `seed` (low word first), after `rounds` rounds."""
    mask = np.uint64(0xFFFFFFFF)
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    c = [np.asarray(x, dtype=np.uint64) for x in (c0, c1, c2, c3)]
    for _ in range(rounds):
        prod_a = c[0] * np.uint64(0xD2511F53)
        prod_b = c[2] * np.uint64(0xCD9E8D57)
        c = [((prod_b >> np.uint64(32)) ^ c[1] ^ k0) & mask, prod_b & mask,
             ((prod_a >> np.uint64(32)) ^ c[3] ^ k1) & mask, prod_a & mask]
        k0 = (k0 + np.uint64(0x9E3779B9)) & mask
        k1 = (k1 + np.uint64(0xBB67AE85)) & mask
    return c


# Random123's known-answer vectors for philox4x32 (kat_vectors): rounds, counter words,
# key words, output words
PHILOX_KAT = [
    (7, (0, 0, 0, 0), (0, 0), (0x5F6FB709, 0x0D893F64, 0x4F121F81, 0x4F730A48)),
    (7, (0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2, (0x5207DDC2, 0x45165E59, 0x4D8EE751, 0x8C52F662)),
    (7, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0x4DFCCABA, 0x190A87F0, 0xC47362BA, 0xB6B5242A)),
    (10, (0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    (10, (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0),
     (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1)),
]


@pytest.mark.parametrize("rounds,counter,key,want", PHILOX_KAT)
def test_numpy_philox_gives_random123_known_answers(rounds, counter, key, want):
    """The NumPy Philox the masks are checked against is the published generator, at the
    package's round count and at the usual 10."""
    words = _philox4x32(key[0] | key[1] << 32, *(np.array([c], dtype=np.uint64) for c in counter),
                        rounds=rounds)
    assert tuple(int(w[0]) for w in words) == want
    assert PHILOX_ROUNDS in {r for r, *_ in PHILOX_KAT}


def _documented_mask(seed, stream, bh, n_q, n_k, t):
    """Element (row, col), row = 16 G + 8 wh + rr, col = 32 Q + 16 b + 8 wl + 2 t + k, is
    kept when byte wh + 2 k of word b + 2 wl of the Philox call with counters
    (4 Q + t, 16 G + rr, bh, stream) is at least T."""
    row, col = np.arange(n_q)[:, None], np.arange(n_k)[None, :]
    shape = (n_q, n_k)
    c0 = np.broadcast_to(4 * (col // 32) + (col // 2) % 4, shape)
    c1 = np.broadcast_to(16 * (row // 16) + row % 8, shape)
    words = _philox4x32(seed, c0, c1, np.full(shape, bh), np.full(shape, stream))
    word = np.choose((col // 16) % 2 + 2 * ((col // 8) % 2), words)
    byte = (word >> (8 * ((row // 8) % 2 + 2 * (col % 2))).astype(np.uint64)) & np.uint64(0xFF)
    return torch.from_numpy(byte >= t)


@pytest.mark.parametrize("block_m,block_n", [(64, 64), (16, 16), (32, 128), (128, 32)])
def test_keep_mask_is_the_documented_byte_map_at_every_tile(pkg, device, block_m, block_n):
    """The mask kernel, at tiles of 16 to 128 rows and columns (a 16-column tile takes half
    of a Philox call's 32 columns), against NumPy's Philox and the documented map."""
    drop = importlib.import_module(f"{pkg.__name__}._dropout")
    seed, stream, t, bh, n_q, n_k = 2**40 + 12345, 2**31 + 77, 26, 3, 80, 144
    want = torch.stack([_documented_mask(seed, stream, h, n_q, n_k, t) for h in range(bh)])
    got = torch.full((bh, n_q, n_k), -1, dtype=torch.int8, device=device)
    grid = (-(-n_q // block_m), -(-n_k // block_n), bh)
    drop.keep_mask_kernel[grid](got, seed, stream, n_q, n_k, t, BLOCK_M=block_m,
                                BLOCK_N=block_n)
    assert (got >= 0).all(), "an element was not written"
    assert torch.equal(got.bool().cpu(), want), f"{(got.bool().cpu() != want).sum()} differ"


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


@pytest.mark.parametrize("p", [2.0, -1, 1.0, "0.1"])
def test_dropout_mask_refuses_what_a_call_refuses(pkg, p):
    """p = 2.0 or -1 used to give a mask silently (T clamped to [1, 255])."""
    with pytest.raises(ValueError, match=r"dropout_p must be a number in \[0, 1\)"):
        pkg.dropout_mask(1, 2, 16, 16, p)


def test_dropout_mask_defaults_to_the_device_calls_run_on(pkg, monkeypatch):
    """As README and docs/VARLEN.md call it, without a device: the current CUDA device,
    or the CPU (the interpreter) on a machine without one -- it was "cuda" always."""
    want = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(5)
    mask = pkg.dropout_mask(1, 2, 16, 16, 0.3)
    assert mask.device.type == want and mask.shape == (1, 2, 16, 16)
    torch.manual_seed(5)
    assert torch.equal(mask, pkg.dropout_mask(1, 2, 16, 16, 0.3, device=want))
    if want == "cpu":  # without the interpreter the CPU is refused as a call refuses it
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            pkg.dropout_mask(1, 2, 16, 16, 0.3)


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
