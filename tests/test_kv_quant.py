"""Quantized KV caches (issue 49): fp8 e4m3 and int8 caches with fp32 scales per tensor,
per K/V head and per token, read by flash_attn_with_kvcache (contiguous and paged,
split-KV, appends that quantize on write) and by the paged prefill
(flash_attn_varlen_func with block_table), with fp16 / bf16 queries.

The reference is independent of the package: the cache as the call leaves it (after an
append, what the append kernel wrote) is dequantized in float64 here (x_q * scale, the
scales broadcast by their shape), gathered row by row through the block table, and
attended to with flashgen.reference's float64 attention. The kernels convert the 1-byte
values to the queries' dtype exactly and apply the scales to fp32 products, so the
stated tolerance is the queries' dtype's against float64 (conftest.OUT_TOL: bf16 1.6e-2,
fp16 2e-3), whatever the cache dtype and scale granularity; the quantization error itself
(against the unquantized cache) is measured separately, with its own bound.

Inputs are hostile where they can be: outputs start poisoned (NaN), the per-token scales
of every cache row a call must not read are NaN (and so are an fp8 cache's values there),
so a read past a length, a page or a row shows up as NaN; rows carry magnitudes over two
decades, so per-token scales differ. CPU cases run in Triton's interpreter at d = 32 with
16 x 16 tiles (N_cache 1, 59, 257; GQA 4:1 and 8:1; batch 3; pages of 16, 64 and 24, the
last a page index per key); the gpu-marked ones at d = 128 with the planner's tiles and
the automatic split count, over 4k-token caches too.
"""
from __future__ import annotations

import math

import pytest
import torch

from conftest import LSE_TOL, OUT_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
FP8, INT8 = torch.float8_e4m3fn, torch.int8


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("kvq"), "fg_test_kvq", """
        head_dims: [32, 128]
        dtypes: [fp16, bf16]
        masks: [none, causal]
        gqa: true
        decode: true
        kv_cache_dtypes: [bf16, fp16, fp8_e4m3, int8]
        """)


# ---------------------------------------------------------------------------------------
# inputs and the reference
# ---------------------------------------------------------------------------------------
def raw(shape, gen):
    """Random rows whose magnitudes spread over two decades (per-token scales differ)."""
    x = torch.randn(shape, generator=gen)
    return x * torch.exp(torch.randn(shape[:-1], generator=gen) * 1.2)[..., None]


def widen(scale, per):
    """A scale broadcast against its cache (..., H_kv, d)."""
    return scale[..., None] if per == "token" else scale[:, None] if per == "head" else scale


def dequant(xq, scale, per):
    return xq.double() * widen(scale.double(), per)


def quant_cache(pkg, shape, dtype, per, gen, device):
    """(k_q, v_q, k_scale, v_scale) of random rows, quantized by the package's helper."""
    out = []
    for _ in range(2):
        out.append(pkg.quantize_kv_cache(raw(shape, gen), dtype, per))
    (kq, ks), (vq, vs) = out
    return kq.to(device), vq.to(device), ks.to(device), vs.to(device)


def hide_unread(kq, vq, ks, vs, per, table, lengths, page_size):
    """NaN in the per-token scales (and the fp8 values) of every cache row past a batch
    element's length: a kernel that reads one gives NaN."""
    keep = torch.zeros(kq.shape[:2], dtype=torch.bool)
    for b, n in enumerate(lengths):
        for j in range(n):
            if table is None:
                keep[b, j] = True
            else:
                keep[int(table[b, j // page_size]), j % page_size] = True
    keep = keep.to(kq.device)
    if per == "token":
        ks[~keep] = float("nan")
        vs[~keep] = float("nan")
    if kq.dtype == FP8:  # 0x7f: e4m3's NaN; the kernels' bit placement reads it as +480
        # (past e4m3's 448): a key row of it dominates every query whose elements sum > 0,
        # and its value row then sets the output -- an error far past the tolerance
        kq.view(torch.uint8)[~keep] = 0x7F
        vq.view(torch.uint8)[~keep] = 0x7F


def logical(cache, table, b, n):
    """The first n rows of batch element b, by definition (row by row through the table)."""
    if table is None:
        return cache[b, :n]
    p = cache.shape[1]
    rows = [cache[int(table[b, j // p]), j % p] for j in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros((0,) + tuple(cache.shape[2:]))


def reference(q, k, v, table, lengths, causal, score_mod=None):
    """(out (B, N_q, H_q, d), lse (B, H_q, N_q), bound) in float64 from dequantized caches;
    bound is softmax(S) @ |V|, the sum of |p_j v_j| that a kernel's rounding of P scales
    with (raw()'s rows spread over two decades: one large row can dominate a small output)."""
    q, k, v = q.cpu(), k.cpu(), v.cpu()
    table = None if table is None else table.cpu()
    outs, lses, bounds = [], [], []
    for b, n in enumerate(lengths):
        kb = logical(k, table, b, n)[None].transpose(1, 2)
        vb = logical(v, table, b, n)[None].transpose(1, 2)
        vis = visible_mask(q.shape[1], n, causal=causal, bottom_right=True)
        qb = q[b:b + 1].transpose(1, 2)
        o, lse = attention_ref(qb, kb, vb, vis, score_mod=score_mod)
        bound, _ = attention_ref(qb, kb, vb.abs(), vis, score_mod=score_mod)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
        bounds.append(bound.transpose(1, 2))
    return torch.cat(outs), torch.cat(lses), torch.cat(bounds)


def assert_close(out, lse, ref_out, ref_lse, bound, qdtype):
    """out within atol + rtol * bound of float64: the error of a sum of rounded terms scales
    with the sum of their magnitudes (bound), not with the sum itself."""
    assert not torch.isnan(out).any(), "NaN in the output: a row read that must not be, or never written"
    atol, rtol = OUT_TOL[qdtype]
    err = (out.double().cpu() - ref_out).abs()
    over = err - (atol + rtol * bound)
    worst = int(over.flatten().argmax())
    assert over.max() <= 0, (f"output off by {err.flatten()[worst]:.3e} at flat index {worst} "
                             f"(bound {bound.flatten()[worst]:.3e}, allowed {atol} + {rtol} x bound)")
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen)
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse[seen], atol=LSE_TOL[0],
                               rtol=LSE_TOL[1])


def assert_prefill_matches(out, lse, q, kq, vq, ks, vs, per, table, lq, lk, causal):
    """A paged prefill's packed (out, lse) against float64, one sequence at a time on its
    dequantized pages."""
    kd, vd = dequant(kq.cpu(), ks.cpu(), per), dequant(vq.cpu(), vs.cpu(), per)
    rows, outs, lses, bounds = 0, [], [], []
    for b, (n_q, n_k) in enumerate(zip(lq, lk)):
        o, l_, m = reference(q.cpu()[rows:rows + n_q][None], kd, vd, table[b:b + 1], [n_k],
                             causal)
        outs.append(o[0])
        lses.append(l_[0])
        bounds.append(m[0])
        rows += n_q
    assert_close(out[None], lse[None], torch.cat(outs)[None], torch.cat(lses, 1)[None],
                 torch.cat(bounds)[None], torch.bfloat16)


def paged(batch, capacity, page_size, gen):
    """A shuffled block table over a pool with 3 spare pages: (table, num_blocks)."""
    pages = -(-capacity // page_size)
    num_blocks = batch * pages + 3
    table = torch.randperm(num_blocks, generator=gen)[:batch * pages].view(batch, pages)
    return table.to(torch.int32), num_blocks


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


# ---------------------------------------------------------------------------------------
# the kernels' dequantization (_kvquant.dequant_tile: bit placement), every byte
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("code, src", [(1, FP8), (2, INT8)], ids=["fp8", "int8"])
@pytest.mark.parametrize("qdt", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_dequant_tile_every_byte(pkg, code, src, qdt):
    """All 256 bytes against torch's own conversion: e4m3 (subnormals and zeros too) is
    x * 2^-120 in bf16 and x * 2^-8 in fp16, exactly; int8 exactly x. e4m3's NaN bytes
    read as +-480 (finite: what hide_unread's poison relies on)."""
    import triton
    import triton.language as tl

    global _dequant_tile  # the interpreter looks the helper up in this module's globals
    _dequant_tile = pkg._kvquant.dequant_tile

    @triton.jit
    def kernel(X, Y, DT: tl.constexpr, KV_QUANT: tl.constexpr):
        o = tl.arange(0, 256)
        tl.store(Y + o, _dequant_tile(tl.load(X + o), DT, KV_QUANT))

    pkg._runtime.kernel("decode_d32_bf16")  # (the interpreter's fixes)
    x = torch.arange(256, dtype=torch.uint8).view(src)
    y = torch.empty(256, dtype=qdt)
    kernel[(1,)](x, y, tl.bfloat16 if qdt == torch.bfloat16 else tl.float16, code)
    unit = 2.0 ** (120 if qdt == torch.bfloat16 else 8) if code == 1 else 1.0
    want, got = x.double(), y.double() * unit
    nan = want.isnan()
    assert torch.equal(got[~nan], want[~nan])
    assert got[nan].tolist() == ([480.0, -480.0] if code == 1 else [])


# ---------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------
# (cache dtype, scales, page size or None, lengths (capacity = the largest), GQA group,
# H_kv, query tokens, causal, num_splits, query dtype)
DECODE = [
    (INT8, "token", None, [1, 30, 59], 4, 2, 1, True, 2, torch.bfloat16),
    (FP8, "head", 16, [257, 1, 100], 8, 1, 2, True, 0, torch.bfloat16),
    (FP8, "tensor", 64, [59, 128, 0], 4, 2, 1, False, 3, torch.bfloat16),
    (INT8, "head", None, [1, 1, 1], 8, 1, 1, True, 1, torch.float16),
    (INT8, "token", 24, [40, 17, 33], 4, 2, 3, True, 2, torch.float16),  # (a page per key)
    (FP8, "token", 64, [59, 0, 64], 8, 1, 1, True, 0, torch.bfloat16),
]
DECODE_IDS = ["int8_token_n59_gqa4", "fp8_head_p16_n257_gqa8", "fp8_tensor_p64_split3",
              "int8_head_n1_fp16", "int8_token_p24_fp16_nq3", "fp8_token_p64_gqa8"]


def run_decode(pkg, device, case, d=32, tiles=TILES, seed=0):
    dtype, per, page, lengths, group, h_kv, n_q, causal, splits, qdt = case
    gen = torch.Generator().manual_seed(seed)
    batch, capacity = len(lengths), max(lengths)
    table = None
    if page is None:
        shape = (batch, capacity, h_kv, d)
    else:
        table, num_blocks = paged(batch, capacity, page, gen)
        shape = (num_blocks, page, h_kv, d)
    kq, vq, ks, vs = quant_cache(pkg, shape, dtype, per, gen, device)
    hide_unread(kq, vq, ks, vs, per, table, lengths, page)
    q = torch.randn(batch, n_q, h_kv * group, d, generator=gen).to(qdt).to(device)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with pkg._runtime.override_config(**tiles) if tiles else _nothing():
        out, lse = pkg.flash_attn_with_kvcache(
            q, kq, vq, cache_seqlens=lens, block_table=None if table is None else table.to(device),
            causal=causal, num_splits=splits, return_lse=True, k_scale=ks, v_scale=vs)
    assert out.shape == q.shape and out.dtype == qdt
    ref = reference(q, dequant(kq.cpu(), ks.cpu(), per), dequant(vq.cpu(), vs.cpu(), per),
                    table, lengths, causal)
    assert_close(out, lse, *ref, qdt)


@pytest.mark.parametrize("case", DECODE, ids=DECODE_IDS)
def test_decode_matches_float64_on_the_dequantized_cache(pkg, device, poison, case):
    run_decode(pkg, device, case)


def test_quantization_error_against_the_unquantized_cache(pkg):
    """What the cache dtype costs against the bf16 cache it was made from (the kernels'
    own error is the one above): on rows of unit scale, int8 per token within 0.02 of the
    float64 output, fp8 e4m3 per head within 0.06."""
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(2, 96, 2, 32, generator=gen) for _ in range(2))
    q = torch.randn(2, 1, 8, 32, generator=gen).to(torch.bfloat16)
    ref = reference(q, k.double(), v.double(), None, [96, 70], True)[0]
    for dtype, per, bound in ((INT8, "token", 0.02), (FP8, "head", 0.06)):
        (kq, ks), (vq, vs) = (pkg.quantize_kv_cache(t, dtype, per) for t in (k, v))
        with pkg._runtime.override_config(**TILES):
            out = pkg.flash_attn_with_kvcache(q, kq, vq, cache_seqlens=torch.tensor(
                [96, 70], dtype=torch.int32), causal=True, k_scale=ks, v_scale=vs)
        err = (out.double() - ref).abs().max().item()
        assert err < bound, (dtype, per, err)


# ---------------------------------------------------------------------------------------
# appends quantize on write
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("page", [16, None], ids=["paged16", "contiguous"])
def test_append_into_int8_cache_writes_per_token_scales(pkg, device, poison, page):
    gen = torch.Generator().manual_seed(11)
    before, n_new, group, h_kv, d = [5, 20, 33], 3, 4, 2, 32
    batch, capacity = 3, 40
    table = None
    if page is None:
        shape = (batch, capacity, h_kv, d)
    else:
        table, num_blocks = paged(batch, capacity, page, gen)
        shape = (num_blocks, page, h_kv, d)
    kq, vq, ks, vs = quant_cache(pkg, shape, INT8, "token", gen, device)
    k_new, v_new = (raw((batch, n_new, h_kv, d), gen).to(torch.bfloat16).to(device)
                    for _ in range(2))
    q = torch.randn(batch, n_new, h_kv * group, d, generator=gen).to(torch.bfloat16).to(device)
    old = [t.clone() for t in (kq, vq, ks, vs)]
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_with_kvcache(
            q, kq, vq, k_new, v_new, cache_seqlens=torch.tensor(before, dtype=torch.int32,
                                                                device=device),
            block_table=None if table is None else table.to(device), causal=True,
            return_lse=True, k_scale=ks, v_scale=vs)
    # the new rows as quantize_kv_cache makes them (one int8 step for a rounding tie), and
    # every other row untouched
    written = torch.zeros(kq.shape[:2], dtype=torch.bool)
    for new, cache, scale, was in ((k_new, kq, ks, old[0]), (v_new, vq, vs, old[1])):
        want_q, want_s = pkg.quantize_kv_cache(new.cpu(), INT8, "token")
        for b in range(batch):
            for t in range(n_new):
                j = before[b] + t
                row = (b, j) if table is None else (int(table[b, j // page]), j % page)
                written[row] = True
                torch.testing.assert_close(scale.cpu()[row], want_s[b, t], rtol=1e-6, atol=0)
                assert (cache.cpu()[row].int() - want_q[b, t].int()).abs().max() <= 1
        assert torch.equal(cache.cpu()[~written], was.cpu()[~written])
    assert torch.equal(ks.cpu()[~written], old[2].cpu()[~written])
    lengths = [n + n_new for n in before]
    ref = reference(q, dequant(kq.cpu(), ks.cpu(), "token"), dequant(vq.cpu(), vs.cpu(), "token"),
                    table, lengths, True)
    assert_close(out, lse, *ref, torch.bfloat16)


@pytest.mark.parametrize("page, interleaved", [(16, True), (None, False)],
                         ids=["paged16_gptj", "contiguous_batch_idx_neox"])
def test_rotary_append_into_int8_cache(pkg, poison, page, interleaved):
    """Rotary on append with a quantized cache (and, contiguous, cache_batch_idx): the new
    keys are rotated at their cache positions, then quantized per token as they are
    written; q is rotated at its positions. Against float64: the rotated rows, quantized by
    quantize_kv_cache (one int8 step for rounding), and attention on the dequantized cache."""
    from test_decode_rotary import LSE_ATOL, TOL, rotate64

    ROT_TOL, ROT_LSE_ATOL = TOL[torch.bfloat16], LSE_ATOL[torch.bfloat16]

    gen = torch.Generator().manual_seed(12)
    before, n_new, group, h_kv, d, rot = [5, 20, 33], 2, 4, 2, 32, 16
    batch, capacity = 3, 40
    table, rows_of = None, [2, 0, 1]  # contiguous: cache row of each batch element
    if page is None:
        shape = (batch, capacity, h_kv, d)
    else:
        table, num_blocks = paged(batch, capacity, page, gen)
        shape = (num_blocks, page, h_kv, d)
    # unit-size rows: the rotated q reaches the scores rounded to bf16 (see below), and one
    # ulp of it times a key 30x the others (raw()'s spread) would be all the error measured
    kq, ks = pkg.quantize_kv_cache(torch.randn(shape, generator=gen), INT8, "token")
    vq, vs = pkg.quantize_kv_cache(torch.randn(shape, generator=gen), INT8, "token")
    k_new = torch.randn(batch, n_new, h_kv, d, generator=gen).to(torch.bfloat16)
    v_new = torch.randn(batch, n_new, h_kv, d, generator=gen).to(torch.bfloat16)
    q = torch.randn(batch, n_new, h_kv * group, d, generator=gen).to(torch.bfloat16)
    angles = torch.rand(64, rot // 2, generator=gen, dtype=torch.float64) * 6.3
    cos, sin = angles.cos().float(), angles.sin().float()
    extra = dict(rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    if page is None:
        extra["cache_batch_idx"] = torch.tensor(rows_of, dtype=torch.int32)
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_with_kvcache(
            q, kq, vq, k_new, v_new, cache_seqlens=torch.tensor(before, dtype=torch.int32),
            block_table=table, causal=True, return_lse=True, k_scale=ks, v_scale=vs, **extra)

    def slot(b, j):
        return (rows_of[b], j) if table is None else (int(table[b, j // page]), j % page)

    for b in range(batch):
        pos = torch.arange(before[b], before[b] + n_new)
        want_q, want_s = pkg.quantize_kv_cache(
            rotate64(k_new[b].float(), cos, sin, pos, interleaved).float()[None], INT8, "token")
        want_q, want_s = want_q[0], want_s[0]
        for t in range(n_new):
            row = slot(b, before[b] + t)
            torch.testing.assert_close(ks[row], want_s[t], rtol=1e-2, atol=0)
            assert (kq[row].int() - want_q[t].int()).abs().max() <= 1
    # the reference in the batch elements' own order: their cache rows gathered
    lengths = [n + n_new for n in before]
    k_deq, v_deq = dequant(kq, ks, "token"), dequant(vq, vs, "token")
    if table is None:
        k_deq, v_deq = k_deq[rows_of], v_deq[rows_of]
    q_rot = torch.stack([rotate64(q[b].float(), cos, sin,
                                  torch.arange(before[b], before[b] + n_new), interleaved)
                         for b in range(batch)])
    ref_out, ref_lse, _ = reference(q_rot, k_deq, v_deq, table, lengths, True)
    # test_decode_rotary's tolerances: the kernel rounds the rotated q to bf16 before its
    # dot (the interpreter by truncation), which the float64 rotation does not
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref_out, atol=ROT_TOL, rtol=ROT_TOL)
    torch.testing.assert_close(lse.double(), ref_lse, atol=ROT_LSE_ATOL, rtol=1e-5)


@pytest.mark.parametrize("dtype, per, page", [(FP8, "head", None), (INT8, "token", 16),
                                             (FP8, "token", 24), (INT8, "tensor", None)],
                         ids=["fp8_head", "int8_token_paged16", "fp8_token_paged24",
                              "int8_tensor"])
def test_fused_rotary_append_matches_the_append_kernel(pkg, device, poison, monkeypatch, dtype,
                                                       per, page):
    """The append in the attention launch (FUSED_APPEND) quantizes the rotated keys and the
    values as the append kernel does (FLASHGEN_FUSED_APPEND=0): the same cache bytes and
    per-token scales (in the interpreter bit for bit), and the output it attends over the
    new rows in registers agrees (to the rounding of P: they are a block of their own)."""
    gen = torch.Generator().manual_seed(21)
    before, n_new, group, h_kv, d, rot = [0, 13, 37], 3, 4, 2, 32, 16
    batch, capacity = 3, 40
    table = None
    shape = (batch, capacity, h_kv, d)
    if page is not None:
        table, num_blocks = paged(batch, capacity, page, gen)
        shape = (num_blocks, page, h_kv, d)
    kq, ks = pkg.quantize_kv_cache(raw(shape, gen), dtype, per)
    vq, vs = pkg.quantize_kv_cache(raw(shape, gen), dtype, per)
    k_new, v_new = (raw((batch, n_new, h_kv, d), gen).to(torch.bfloat16) * 3 for _ in range(2))
    q = torch.randn(batch, n_new, h_kv * group, d, generator=gen).to(torch.bfloat16)
    angles = torch.rand(64, rot // 2, generator=gen, dtype=torch.float64) * 6.3
    kw = dict(rotary_cos=angles.cos().float().to(device),
              rotary_sin=angles.sin().float().to(device), rotary_interleaved=page is None, causal=True, num_splits=3, return_lse=True,
              cache_seqlens=torch.tensor(before, dtype=torch.int32, device=device),
              block_table=None if table is None else table.to(device))
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(pkg._decode, "FUSED_APPEND", fused)
        cache = [t.to(device) for t in (kq, vq, ks, vs)]
        with pkg._runtime.override_config(**TILES), torch.no_grad():
            out, lse = pkg.flash_attn_with_kvcache(q.to(device), cache[0], cache[1],
                                                   k_new.to(device), v_new.to(device),
                                                   k_scale=cache[2], v_scale=cache[3], **kw)
        got[fused] = [t.cpu() for t in (*cache, out, lse)]
    for i, name in enumerate(("k_cache", "v_cache", "k_scale", "v_scale")):
        a, b = got[False][i], got[True][i]
        if device == "cpu" or name.startswith("v"):
            assert torch.equal(a.view(torch.uint8) if a.element_size() == 1 else a,
                               b.view(torch.uint8) if b.element_size() == 1 else b), name
        elif a.element_size() == 1:  # a rotated key one bf16 ulp apart: one code at most
            assert (a.view(torch.uint8).int() - b.view(torch.uint8).int()).abs().max() <= 1, name
        else:
            torch.testing.assert_close(b, a, rtol=2 ** -7, atol=0)
    assert not torch.isnan(got[True][4]).any()
    torch.testing.assert_close(got[True][4], got[False][4], atol=2 ** -7, rtol=2 ** -7)
    torch.testing.assert_close(got[True][5], got[False][5], atol=1e-4, rtol=1e-5)


def test_append_into_fp8_cache_uses_the_head_scales_and_saturates(pkg, device, poison):
    gen = torch.Generator().manual_seed(12)
    batch, capacity, h_kv, group, d = 3, 24, 2, 4, 32
    kq, vq, ks, vs = quant_cache(pkg, (batch, capacity, h_kv, d), FP8, "head", gen, device)
    k_new = raw((batch, 1, h_kv, d), gen)
    k_new[0, 0, 1, 5] = 1e4 * float(ks[1])  # past e4m3's 448 x the head's scale
    k_new[2, 0, 0, 7] = -1e4 * float(ks[0])
    k_new = k_new.to(torch.float16).to(device)
    v_new = raw((batch, 1, h_kv, d), gen).to(torch.float16).to(device)
    q = torch.randn(batch, 1, h_kv * group, d, generator=gen).to(torch.float16).to(device)
    scales = (ks.clone(), vs.clone())
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_with_kvcache(
            q, kq, vq, k_new, v_new, cache_seqlens=7, causal=True,
            return_lse=True, k_scale=ks, v_scale=vs)
    assert torch.equal(ks, scales[0]) and torch.equal(vs, scales[1]), "per-head scales are inputs"
    assert float(kq[0, 7, 1, 5].float()) == 448.0 and float(kq[2, 7, 0, 7].float()) == -448.0
    want, _ = pkg.quantize_kv_cache(k_new.cpu(), FP8, "head", scale=ks.cpu())
    assert torch.equal(kq.cpu()[:, 7].float(), want[:, 0].float())
    ref = reference(q, dequant(kq.cpu(), ks.cpu(), "head"), dequant(vq.cpu(), vs.cpu(), "head"),
                    None, [8, 8, 8], True)
    assert_close(out, lse, *ref, torch.float16)


# ---------------------------------------------------------------------------------------
# chunked prefill over a quantized paged cache
# ---------------------------------------------------------------------------------------
LQ, LK = [7, 0, 1, 20], [7, 5, 90, 57]


def cu(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


@pytest.mark.parametrize("dtype, per, page, causal", [
    (INT8, "token", 24, True), (FP8, "head", 64, False), (FP8, "tensor", 16, True),
], ids=["int8_token_p24", "fp8_head_p64_full", "fp8_tensor_p16"])
def test_paged_prefill_matches_float64(pkg, device, poison, dtype, per, page, causal):
    gen = torch.Generator().manual_seed(page)
    h_kv, group, d = 2, 4, 32
    table, num_blocks = paged(len(LK), max(LK), page, gen)
    kq, vq, ks, vs = quant_cache(pkg, (num_blocks, page, h_kv, d), dtype, per, gen, device)
    hide_unread(kq, vq, ks, vs, per, table, LK, page)
    q = torch.randn(sum(LQ), h_kv * group, d, generator=gen).to(torch.bfloat16).to(device)
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_varlen_func(
            q, kq, vq, cu(LQ, device), cu(LK, device), max(LQ), max(LK), causal=causal,
            block_table=table.to(device), return_lse=True, k_scale=ks, v_scale=vs)
    assert_prefill_matches(out, lse, q, kq, vq, ks, vs, per, table, LQ, LK, causal)


# ---------------------------------------------------------------------------------------
# quantize_kv_cache
# ---------------------------------------------------------------------------------------
def test_quantize_kv_cache(pkg):
    gen = torch.Generator().manual_seed(3)
    x = raw((5, 16, 3, 32), gen).to(torch.bfloat16)
    x[1, 2] = 0.0  # all-zero rows: scale 1, values 0
    xq, s = pkg.quantize_kv_cache(x, INT8)  # int8: per token by default
    assert xq.dtype == INT8 and s.shape == (5, 16, 3) and s.dtype == torch.float32
    assert (s[1, 2] == 1).all() and (xq[1, 2] == 0).all() and xq.abs().max() <= 127
    err = (dequant(xq, s, "token") - x.double()).abs()
    assert (err <= s.double()[..., None] / 2 + 1e-7).all()  # half a step, rounded to nearest
    xq, s = pkg.quantize_kv_cache(x, FP8)  # fp8: per head by default
    assert xq.dtype == FP8 and s.shape == (3,)
    rel = (dequant(xq, s, "head") - x.double()).abs() / x.double().abs().clamp(min=1e-30)
    big = x.double().abs() >= s.double()[:, None] * 2 ** -6  # e4m3's normal range
    assert (rel[big] <= 2 ** -4 + 1e-9).all()
    _, s = pkg.quantize_kv_cache(x, FP8, "tensor")
    assert s.shape == (1,) and math.isclose(float(s), float(x.float().abs().max()) / 448)
    half = torch.full((1,), float(s) / 2)
    xq, s2 = pkg.quantize_kv_cache(x, FP8, "tensor", scale=half)  # a given scale saturates
    assert torch.equal(s2, half) and xq.float().abs().max() == 448
    for bad, match in (((x, torch.bfloat16), "dtype"), ((x[0], INT8), "4-D"),
                       ((x, INT8, "row"), "per"), ((x, INT8, "token", half), "scale"),
                       ((x, FP8, "head", half), r"\(3,\)")):
        with pytest.raises(ValueError, match=match):
            pkg.quantize_kv_cache(*bad)


# ---------------------------------------------------------------------------------------
# bad input: ValueError naming the argument, before any launch or write
# ---------------------------------------------------------------------------------------
def _decode_call(pkg, k_scale="ok", v_scale="ok", *, dtype=INT8, per="token", qdt=torch.bfloat16,
                 k_new=False, view=False):
    gen = torch.Generator().manual_seed(0)
    kq, vq, ks, vs = quant_cache(pkg, (2, 8, 2, 32), dtype, per, gen, "cpu")
    if view:
        vq = kq
    q = torch.randn(2, 1, 4, 32).to(qdt)
    kw = dict(k_scale=ks if k_scale == "ok" else k_scale, v_scale=vs if v_scale == "ok" else v_scale)
    new = (torch.randn(2, 1, 2, 32).to(qdt),) * 2 if k_new else (None, None)
    before = kq.clone()
    try:
        pkg.flash_attn_with_kvcache(q, kq, vq, *new, cache_seqlens=4, **kw)
    finally:
        assert torch.equal(kq, before), "the cache was written before the error"


@pytest.mark.parametrize("change, match", [
    (dict(k_scale=None), "k_scale is missing"),
    (dict(v_scale=None), "v_scale is missing"),
    (dict(k_scale=torch.ones(2, 8, 2, dtype=torch.float16)), "k_scale must be float32"),
    (dict(v_scale=torch.ones(2, 8)), r"v_scale has shape \(2, 8\)"),
    (dict(k_scale=torch.ones(3)), r"k_scale has shape \(3,\)"),
    (dict(k_scale=0.5), "k_scale must be an fp32 torch.Tensor"),
    (dict(k_scale=torch.ones(2)), "k_scale and v_scale must have one shape"),
    (dict(k_new=True, k_scale=torch.ones(2, 8, 2, dtype=torch.float64)), "k_scale must be float32"),
    (dict(qdt=torch.float32), "float32"),
    (dict(view=True), "view of k_cache"),
], ids=["no_k_scale", "no_v_scale", "fp16_scale", "2d_scale", "heads_mismatch", "float_scale",
        "shapes_differ", "append_bad_scale", "fp32_q", "latent_view"])
def test_bad_scales_raise_before_any_launch(pkg, change, match):
    with pytest.raises(ValueError, match=match):
        _decode_call(pkg, **change)


def test_scales_on_a_cache_that_is_not_quantized(pkg):
    q = torch.randn(1, 1, 2, 32).to(torch.bfloat16)
    cache = torch.randn(1, 8, 2, 32).to(torch.bfloat16)
    with pytest.raises(ValueError, match="k_scale / v_scale go with a quantized KV cache"):
        pkg.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=4,
                                    k_scale=torch.ones(1), v_scale=torch.ones(1))


def test_varlen_quantized_cache_needs_block_table(pkg):
    q = torch.randn(6, 4, 32).to(torch.bfloat16)
    kq = torch.zeros(6, 2, 32, dtype=INT8)
    cu_ = torch.tensor([0, 6], dtype=torch.int32)
    for k in (kq, kq.to(torch.float16).to(FP8)):
        with pytest.raises(ValueError, match="block_table"):
            pkg.flash_attn_varlen_func(q, k, k.clone(), cu_, cu_, 6, 6, k_scale=torch.ones(1),
                                       v_scale=torch.ones(1))
    pages, table = torch.zeros(2, 16, 2, 32, dtype=INT8), torch.zeros(1, 1, dtype=torch.int32)
    with pytest.raises(ValueError, match="k_scale is missing"):
        pkg.flash_attn_varlen_func(q, pages, pages.clone(), cu_, cu_, 6, 6, block_table=table)


def test_cache_dtype_not_built_names_the_spec_key(tmp_path):
    only_fp8 = build_and_import(tmp_path, "fg_test_kvq_fp8", """
        head_dims: [32]
        dtypes: [bf16]
        masks: [none]
        decode: true
        kv_cache_dtypes: [fp8_e4m3]
        """)
    q = torch.randn(1, 1, 2, 32).to(torch.bfloat16)
    kq, s = only_fp8.quantize_kv_cache(torch.randn(1, 8, 2, 32), INT8)
    with pytest.raises(ValueError, match=r"int8 to `kv_cache_dtypes`"):
        only_fp8.flash_attn_with_kvcache(q, kq, kq.clone(), cache_seqlens=4, k_scale=s,
                                         v_scale=s.clone())
    assert "kv_cache_dtypes" in only_fp8._registry.BUILT_FOR
    assert "quantized KV caches" in only_fp8.describe()


# ---------------------------------------------------------------------------------------
# GPU: the model's head dim, the planner's tiles, the automatic split count, appends
# ---------------------------------------------------------------------------------------
GPU_CASES = [
    (dtype, per, page, lengths, group, h_kv, n_q, True, 0, qdt)
    for dtype, per in ((INT8, "token"), (INT8, "head"), (FP8, "head"), (FP8, "tensor"),
                       (FP8, "token"))
    for page, lengths, group, h_kv in ((None, [1, 59, 257], 4, 2), (16, [257, 4100, 59], 8, 1),
                                       (64, [4096, 1, 300], 4, 2))
    for n_q, qdt in ((1, torch.bfloat16), (4, torch.float16))
]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, (
    "fp8" if c[0] == FP8 else "int8", c[1], f"p{c[2]}", f"n{max(c[3])}", f"g{c[4]}",
    f"q{c[6]}", str(c[9])[6:]))))
def test_gpu_decode_planned_tiles(pkg, poison, case):
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    run_decode(pkg, "cuda", case, d=128, tiles=None, seed=hash(str(case)) % 1000)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype, per, page", [(INT8, "token", 16), (FP8, "head", 64),
                                              (INT8, "token", 64), (FP8, "tensor", 16)])
def test_gpu_paged_prefill_planned_tiles(pkg, poison, dtype, per, page):
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    gen = torch.Generator().manual_seed(page)
    lq, lk = [512, 1, 0, 77, 300], [4000, 59, 1, 257, 300]
    h_kv, group, d = 2, 4, 128
    table, num_blocks = paged(len(lk), max(lk), page, gen)
    kq, vq, ks, vs = quant_cache(pkg, (num_blocks, page, h_kv, d), dtype, per, gen, "cuda")
    hide_unread(kq, vq, ks, vs, per, table, lk, page)
    q = torch.randn(sum(lq), h_kv * group, d, generator=gen).to(torch.bfloat16).cuda()
    out, lse = pkg.flash_attn_varlen_func(
        q, kq, vq, cu(lq, "cuda"), cu(lk, "cuda"), max(lq), max(lk), causal=True,
        block_table=table.cuda(), return_lse=True, k_scale=ks, v_scale=vs)
    assert_prefill_matches(out, lse, q, kq, vq, ks, vs, per, table, lq, lk, True)


def test_quantized_decode_with_a_score_mod(tmp_path):
    """A spec's score mod (softcap) on a quantized cache: the mod sees the scores after the
    per-token K scale (the scores the float64 reference forms from the dequantized cache)."""
    pkg = build_and_import(tmp_path, "fg_test_kvq_mods", """
        head_dims: [32]
        dtypes: [bf16]
        masks: [causal]
        gqa: true
        decode: true
        kv_cache_dtypes: [bf16, int8]
        mods:
          softcap: {builtin: softcap, params: {cap: 2.0}}
        variants:
          - {mask: causal, mods: [softcap]}
        """)
    gen = torch.Generator().manual_seed(21)
    lengths, page = [59, 1, 40], 16
    table, num_blocks = paged(3, 64, page, gen)
    kq, vq, ks, vs = quant_cache(pkg, (num_blocks, page, 2, 32), INT8, "token", gen, "cpu")
    q = (torch.randn(3, 2, 8, 32, generator=gen) * 3).to(torch.bfloat16)
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_with_kvcache(
            q, kq, vq, cache_seqlens=torch.tensor(lengths, dtype=torch.int32),
            block_table=table, causal=True, return_lse=True, k_scale=ks, v_scale=vs,
            num_splits=2, mods=("softcap",))
    ref = reference(q, dequant(kq, ks, "token"), dequant(vq, vs, "token"), table, lengths,
                    True, score_mod=lambda s: 2.0 * torch.tanh(s / 2.0))
    assert_close(out, lse, *ref, torch.bfloat16)
