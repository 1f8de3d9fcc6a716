"""Chunked prefill over a paged KV cache: flash_attn_varlen_func with block_table,
seqused_k and seqused_q, against a float64 reference that runs each sequence alone on its
keys gathered from the pages, and against the package's own dense varlen call on the same
gathered keys.

The cache is hostile on purpose: its pages are shuffled, every row the call must not read
(unused pages, the tail of a sequence's last page, rows past seqused_k) is NaN, the block
table's unused entries are out of range, and the output starts poisoned (NaN), so a read
of a wrong row or a row never written shows as NaN. Page sizes 16 and 64 (key blocks of
16 x 16 test tiles and of the planner's tile both inside one page and spanning several)
and 24, which is no power of two; queries of 0, 1 and more rows over cached contexts from
0 to about 300 keys.

Tolerances (conftest): fp32 2e-5, bf16 1.6e-2 on the output against float64; the LSE 1e-4
(fp32 scores whatever the input). Against the dense varlen call on the gathered keys the
paged call must agree bit for bit at one tile: the same kernel, with the rows found
through the table.

The Gluon paged forward (Hopper; d 64 / 128, a package of its own, `gpkg`): on the CPU the
runtime's reasons and plan (device checks patched) and, -m slow, its sm_90 compile (pages 16
and 64, causal and not, d 64 / 128: no key-loop spills, the dense design, a TMA box a page);
on the GPU (-m gpu) against float64 on the same hostile caches at 1, 59, 127 and 257 new
tokens over contexts up to ~3000 keys, pages 16 / 64 / 256, GQA 4:1 and 8:1, seqused_k,
windows, against the `tl` kernel (FLASHGEN_PAGED_GLUON's switch), and bad page indices.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LSE_TOL, OUT_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import
from test_gluon import needs_gluon_triton

ROOT = Path(__file__).resolve().parent.parent
TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
D = 32
# new tokens (queries) and the sequence's keys (cached context + new tokens): an empty
# chunk, one-token chunks (decode-like), a context of 0, multi-page contexts
LQ = [7, 0, 1, 20, 1, 33]
LK = [7, 5, 300, 57, 1, 140]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    body = re.sub(r"head_dims: \[.*\]", f"head_dims: [{D}]", body)
    body = re.sub(r"dtypes: \[.*\]", "dtypes: [fp32, bf16]", body)
    body = re.sub(r"masks: \[.*\]", "masks: [none, causal, sliding_window]\n"
                  "window: {left: 24, right: 0}", body)
    body = body.replace("decode: true", "decode: false")
    return build_and_import(tmp_path_factory.mktemp("paged"), "fg_test_paged", body)


def cu(lengths):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)


def paged_cache(lk, page_size, h_kv, dtype, spare=3, gen=None, d=D):
    """(k_cache, v_cache, block_table, k, v): the packed keys / values of every sequence and
    the same rows scattered over shuffled pages of a NaN-filled pool; the table's unused
    entries point past the pool."""
    pages = [-(-n // page_size) for n in lk]
    max_pages = max(pages) + 1
    num_blocks = sum(pages) + spare
    k = torch.randn(sum(lk), h_kv, d, generator=gen).to(dtype)
    v = torch.randn(sum(lk), h_kv, d, generator=gen).to(dtype)
    k_cache = torch.full((num_blocks, page_size, h_kv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.full((len(lk), max_pages), num_blocks + 7, dtype=torch.int32)
    start, used = 0, 0
    for i, (n, p) in enumerate(zip(lk, pages)):
        for j in range(p):
            page = int(order[used])
            used += 1
            table[i, j] = page
            rows = slice(start + j * page_size, start + min((j + 1) * page_size, n))
            count = rows.stop - rows.start
            k_cache[page, :count] = k[rows]
            v_cache[page, :count] = v[rows]
        start += n
    return k_cache, v_cache, table, k, v


def reference(q, k, v, lq, lk, *, causal, window=(-1, -1), score_mod=None, sink=None):
    """(out, lse (H, total_q)) in float64, one sequence at a time on its packed keys."""
    cq, ck = cu(lq), cu(lk)
    outs, lses = [], []
    for i, (n_q, n_k) in enumerate(zip(lq, lk)):
        qs = q[cq[i]:cq[i + 1]].transpose(0, 1)[None]
        ks = k[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        vs = v[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
        out, lse = attention_ref(qs, ks, vs, vis, score_mod=score_mod,
                                 sink=None if sink is None else sink[None])
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    return torch.cat(outs), torch.cat(lses, 1)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype)


def check(got, ref, dtype):
    out, lse = got
    r_out, r_lse = ref
    assert not torch.isnan(out).any(), "NaN in the output: a wrong row read or never written"
    seen = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), seen), "LSE -inf rows differ"
    torch.testing.assert_close(lse.double()[seen], r_lse[seen], atol=LSE_TOL[0],
                               rtol=LSE_TOL[1])
    tol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double(), r_out, atol=tol[0], rtol=tol[1])


def call(pkg, q, k_cache, v_cache, lq, lk, bt, *, tiles=TILES, cu_k=True, seqused_k=None,
         **kw):
    with pkg._runtime.override_config(**tiles) if tiles else _nothing():
        return pkg.flash_attn_varlen_func(
            q, k_cache, v_cache, cu(lq), cu(lk) if cu_k else None, max(lq), max(lk),
            block_table=bt, seqused_k=seqused_k, return_lse=True, **kw)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


@pytest.mark.parametrize("page_size,causal,window,h_q,h_kv,dtype", [
    (16, True, (-1, -1), 4, 1, torch.float32),
    (64, True, (-1, -1), 2, 2, torch.float32),
    (24, False, (-1, -1), 4, 1, torch.float32),
    (16, False, (24, 0), 2, 1, torch.float32),
    (64, True, (-1, -1), 4, 1, torch.bfloat16),
], ids=["p16_causal_gqa4", "p64_causal", "p24_full_gqa4", "p16_window", "p64_causal_bf16"])
def test_paged_matches_float64_and_the_dense_varlen_call(pkg, page_size, causal, window, h_q,
                                                         h_kv, dtype):
    gen = torch.Generator().manual_seed(page_size * 10 + h_q)
    k_cache, v_cache, bt, k, v = paged_cache(LK, page_size, h_kv, dtype, gen=gen)
    q = torch.randn(sum(LQ), h_q, D, generator=gen).to(dtype)
    got = call(pkg, q, k_cache, v_cache, LQ, LK, bt, causal=causal, window_size=window)
    check(got, reference(q, k, v, LQ, LK, causal=causal, window=window), dtype)
    with pkg._runtime.override_config(**TILES):
        dense = pkg.flash_attn_varlen_func(q, k, v, cu(LQ), cu(LK), max(LQ), max(LK),
                                           causal=causal, window_size=window,
                                           return_lse=True)
    assert torch.equal(got[0], dense[0]) and torch.equal(got[1], dense[1])


@pytest.mark.parametrize("page_size", [16, 64, 24])
def test_planned_tiles(pkg, page_size):
    """The planner's tile (a key block of 64 or more), over pages smaller than, equal to
    and not dividing it."""
    gen = torch.Generator().manual_seed(page_size)
    k_cache, v_cache, bt, k, v = paged_cache(LK, page_size, 1, torch.bfloat16, gen=gen)
    q = torch.randn(sum(LQ), 4, D, generator=gen).to(torch.bfloat16)
    got = call(pkg, q, k_cache, v_cache, LQ, LK, bt, tiles=None, causal=True)
    check(got, reference(q, k, v, LQ, LK, causal=True), torch.bfloat16)


def test_seqused_k_shorter_than_the_pages_and_no_cu_seqlens_k(pkg):
    """seqused_k (FA3 / FA4) gives the keys: cu_seqlens_k None, the pages hold more rows
    (finite ones past seqused_k, which must not be read)."""
    gen = torch.Generator().manual_seed(3)
    held = [n + 13 for n in LK]
    k_cache, v_cache, bt, k, v = paged_cache(held, 16, 1, torch.float32, gen=gen)
    used = torch.tensor(LK, dtype=torch.int32)
    keep = torch.cat([torch.arange(s, s + n) for s, n in zip(cu(held)[:-1].tolist(), LK)])
    q = torch.randn(sum(LQ), 4, D, generator=gen)
    got = call(pkg, q, k_cache, v_cache, LQ, held, bt, cu_k=False, seqused_k=used,
               causal=True)
    check(got, reference(q, k[keep], v[keep], LQ, LK, causal=True), torch.float32)
    # with cu_seqlens_k too, seqused_k wins (FA3's order)
    again = call(pkg, q, k_cache, v_cache, LQ, held, bt, seqused_k=used, causal=True)
    assert torch.equal(got[0], again[0])


def test_seqused_q_zeroes_the_rows_past_it(pkg):
    """seqused_q[i]: the first rows of sequence i's span are its queries (bottom-right on
    them); the rest get 0 and LSE -inf."""
    gen = torch.Generator().manual_seed(4)
    k_cache, v_cache, bt, k, v = paged_cache(LK, 16, 1, torch.float32, gen=gen)
    q = torch.randn(sum(LQ), 4, D, generator=gen)
    used_q = [5, 0, 1, 0, 1, 17]
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_varlen_func(
            q, k_cache, v_cache, cu(LQ), cu(LK), max(LQ), max(LK), causal=True,
            block_table=bt, seqused_q=torch.tensor(used_q, dtype=torch.int32),
            return_lse=True)
    rows = torch.cat([torch.arange(s, s + n) for s, n in zip(cu(LQ)[:-1].tolist(), used_q)])
    ref = reference(q[rows], k, v, used_q, LK, causal=True)
    check((out[rows], lse[:, rows]), ref, torch.float32)
    rest = torch.ones(sum(LQ), dtype=torch.bool)
    rest[rows] = False
    assert (out[rest] == 0).all() and (lse[:, rest] == float("-inf")).all()


def test_seqused_k_on_packed_keys(pkg):
    """Without a block table, seqused_k[i] keys of sequence i's cu_seqlens_k rows."""
    gen = torch.Generator().manual_seed(5)
    span = [n + 4 for n in LK]
    k = torch.randn(sum(span), 2, D, generator=gen)
    v = torch.randn(sum(span), 2, D, generator=gen)
    q = torch.randn(sum(LQ), 2, D, generator=gen)
    keep = torch.cat([torch.arange(s, s + n) for s, n in zip(cu(span)[:-1].tolist(), LK)])
    k[~torch.isin(torch.arange(sum(span)), keep)] = float("nan")
    with pkg._runtime.override_config(**TILES):
        got = pkg.flash_attn_varlen_func(q, k, v, cu(LQ), cu(span), max(LQ), max(span),
                                         causal=True, seqused_k=torch.tensor(LK, dtype=torch.int32),
                                         return_lse=True)
    check(got, reference(q, k[keep], v[keep], LQ, LK, causal=True), torch.float32)


def test_score_and_sink_mods(pkg):
    gen = torch.Generator().manual_seed(6)
    k_cache, v_cache, bt, k, v = paged_cache(LK, 16, 1, torch.float32, gen=gen)
    q = torch.randn(sum(LQ), 4, D, generator=gen) * 3
    got = call(pkg, q, k_cache, v_cache, LQ, LK, bt, causal=True, mods=("softcap",), cap=5.0)
    ref = reference(q, k, v, LQ, LK, causal=True,
                    score_mod=lambda s: 5.0 * torch.tanh(s / 5.0))
    check(got, ref, torch.float32)
    sinks = torch.randn(4, generator=gen)
    got = call(pkg, q, k_cache, v_cache, LQ, LK, bt, causal=True, mods=("sink_logits",),
               sinks=sinks)
    check(got, reference(q, k, v, LQ, LK, causal=True, sink=sinks.double()), torch.float32)


def test_bad_block_table_values(pkg, monkeypatch):
    """Out-of-range page indices in use: a ValueError where values are checked (CPU tensors
    by default), clamped into the pool unchecked (FLASHGEN_CHECK_VALUES=0): finite, no
    crash. Lengths past the table's capacity likewise."""
    gen = torch.Generator().manual_seed(7)
    k_cache, v_cache, bt, k, v = paged_cache(LK, 16, 1, torch.float32, gen=gen)
    k_cache = k_cache.nan_to_num()  # a clamped index may land on any page
    v_cache = v_cache.nan_to_num()
    q = torch.randn(sum(LQ), 4, D, generator=gen)
    for bad in (-3, k_cache.shape[0], 2 ** 31 - 1):
        table = bt.clone()
        table[2, 5] = bad
        with pytest.raises(ValueError, match="block_table entries in use"):
            call(pkg, q, k_cache, v_cache, LQ, LK, table, causal=True)
    with pytest.raises(ValueError, match="capacity"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt, cu_k=False, causal=True,
             seqused_k=torch.tensor([10 ** 6] + LK[1:], dtype=torch.int32))
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)
    table = bt.clone()
    table[2, 5], table[5, 0], table[0, 0] = -3, 2 ** 31 - 1, k_cache.shape[0]
    out, lse = call(pkg, q, k_cache, v_cache, LQ, LK, table, causal=True)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    out, lse = call(pkg, q, k_cache, v_cache, LQ, LK, bt, cu_k=False, causal=True,
                    seqused_k=torch.tensor([10 ** 6, -5] + LK[2:], dtype=torch.int32))
    assert torch.isfinite(out).all() and not torch.isnan(lse).any()


def test_forward_only_and_argument_errors(pkg):
    gen = torch.Generator().manual_seed(9)
    k_cache, v_cache, bt, k, v = paged_cache(LK, 16, 1, torch.float32, gen=gen)
    q = torch.randn(sum(LQ), 4, D, generator=gen)
    with pytest.raises(ValueError, match="forward-only"):
        call(pkg, q.requires_grad_(), k_cache, v_cache, LQ, LK, bt, causal=True)
    q = q.detach()
    with pytest.raises(ValueError, match="mask mod"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt, causal=True, mods=("document",),
             doc=torch.zeros(len(LQ), max(LK), dtype=torch.int32))
    with pytest.raises(ValueError, match="both None"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt, cu_k=False, causal=True)
    with pytest.raises(ValueError, match="int32"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt.long(), causal=True)
    with pytest.raises(ValueError, match="rows but the batch"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt[1:], causal=True)
    with pytest.raises(ValueError, match="4-D paged cache"):
        call(pkg, q, k, v, LQ, LK, bt, causal=True)
    with pytest.raises(ValueError, match="unit stride"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt.t().contiguous().t(), causal=True)
    with pytest.raises(ValueError, match="dropout"):
        call(pkg, q, k_cache, v_cache, LQ, LK, bt, causal=True, dropout_p=0.1)


def test_paged_calls_at_d32_stay_tl(pkg):
    """d = 32 has no Gluon kernel: a paged call's reason is the variant's."""
    q = torch.randn(8, 2, D, dtype=torch.bfloat16)
    bt = torch.zeros(1, 2, dtype=torch.int32)
    cache = torch.zeros(4, 16, 2, D, dtype=torch.bfloat16)
    why = pkg._runtime.gluon_varlen_reason("fwd_causal_d32_bf16", {"family": "gluon"}, q, cache,
                                           cache, q, 8, "causal", serving=(None, None, bt))
    assert "head dim 32" in why


# ---------------------------------------------------------------------------------------
# The Gluon paged forward (Hopper): reasons, plan and offline compile on the CPU
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gpkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gpaged"), "fg_test_gluon_paged", """
        head_dims: [64, 128]
        dtypes: [fp16, bf16]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        gqa: true
        """)


def _serving(bt=None, used_k=None, used_q=None):
    return (used_q, used_k, bt)


def test_gluon_paged_reasons(gpkg, monkeypatch):
    """Which serving calls the Gluon forward takes (device checks patched to an H100's):
    pages of 8+ keys dividing its 128-key block and multiples of it, seqused_k alone; not
    seqused_q, pages of 4 or 24, a quantized cache, a cache TMA cannot read; all of them
    `tl` with PAGED_GLUON off (FLASHGEN_PAGED_GLUON=0) unless the family is asked for."""
    rt = gpkg._runtime
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)
    monkeypatch.setattr(rt, "PAGED_GLUON", True)  # (the default; FLASHGEN_PAGED_GLUON=0 off)
    name = "fwd_causal_d128_bf16"
    cfg = rt._gluon_default(name, 4096)
    assert cfg["block_n"] == 128
    q = torch.randn(4096, 8, 128, dtype=torch.bfloat16)
    bt = torch.zeros(4, 64, dtype=torch.int32)
    used = torch.full((4,), 100, dtype=torch.int32)

    def why(page, serving=None, cache=None, **kw):
        c = cache if cache is not None else torch.zeros(8, page, 2, 128, dtype=torch.bfloat16)
        return rt.gluon_varlen_reason(name, cfg, q, c, c, q, 4096, "causal", None,
                                      serving or _serving(bt), **kw)

    for page in (8, 16, 32, 64, 128, 256, 512):
        assert why(page) is None, page
    for page in (4, 24, 48, 1):
        assert "page size" in why(page), page
    assert why(16, _serving(bt, used)) is None
    packed = torch.zeros(4096, 2, 128, dtype=torch.bfloat16)
    assert rt.gluon_varlen_reason(name, cfg, q, packed, packed, q, 4096, "causal", None,
                                  _serving(None, used)) is None
    assert "seqused_q" in why(16, _serving(bt, used, used))
    assert "quantized" in why(16, quantized=True)
    odd = torch.zeros(8 * 16 * 2 * 128 + 1, dtype=torch.bfloat16)[1:].view(8, 16, 2, 128)
    assert "TMA" in why(16, cache=odd)
    heads = torch.zeros(8, 16, 3, 136, dtype=torch.bfloat16)[:, :, :2, :128]  # 272-byte rows
    assert why(16, cache=heads) is None
    monkeypatch.setattr(rt, "PAGED_GLUON", False)
    assert why(16) == rt.SERVING_GLUON_REASON
    with rt.override_config(family="gluon"):
        assert why(16) is None
    # the families' rule, and the variant facts describe() prints
    assert rt._families.paged_gluon_reason("bf16", False, 16, 128) is None
    assert "fp8" in rt._families.paged_gluon_reason("fp8_e4m3", False, 16, 128)
    assert "dropout" in rt._families.paged_gluon_reason("bf16", True, 0, 128)
    assert "paged prefill tl (off: FLASHGEN_PAGED_GLUON=0)" in gpkg.describe()
    monkeypatch.setattr(rt, "PAGED_GLUON", True)
    assert "paged prefill gluon (pages of 8-128" in gpkg.describe()


def _paged_plan(rt, lq, lk, page, h_q, h_kv, d, causal, used=False):
    k_cache, v_cache, bt, _, _ = paged_cache(lk, page, h_kv, torch.bfloat16, d=d,
                                             gen=torch.Generator().manual_seed(1))
    q = torch.randn(sum(lq), h_q, d, dtype=torch.bfloat16)
    mask, lo, hi = rt.varlen_band(max(lq), max(lk), causal, (-1, -1))
    serving = (None, torch.tensor(lk, dtype=torch.int32) if used else None, bt)
    plan = rt._varlen_forward_plan(q, k_cache, v_cache, q, cu(lq), max(lq), max(lk), mask, lo,
                                   hi, d ** -0.5, False, None, serving)
    return plan, k_cache, bt


def test_gluon_paged_plan(gpkg, monkeypatch):
    """With the device patched to an H100's, a paged call plans the Gluon varlen forward
    with PAGE_SIZE (and SEQUSED for seqused_k): the table's row stride and the pool's pages,
    the caches' (page, head, row) strides, N_K the table's capacity; unpatched, `tl`."""
    rt = gpkg._runtime
    lq, lk = [1, 59, 127, 257] * 8, [1000, 59, 3000, 777] * 8
    plan, _, _ = _paged_plan(rt, lq, lk, 16, 32, 8, 128, True)
    assert type(plan[0].fn).__name__ != "GluonJITFunction"
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)
    monkeypatch.setattr(rt, "gpu_key", lambda device: ("NVIDIA H100|sm90|132sm", 232448, 132))
    monkeypatch.setattr(rt, "_gluon_kv_heads", lambda cfg, q, n_k, d, at_least: at_least)
    for page, used in ((16, False), (64, True), (256, False)):
        # (a CPU tensor's launch_config is the planner's: ask for the family, as a CUDA
        # tensor on Hopper gets it by default)
        with rt.override_config(family="gluon"):
            (launch, args, tma, sparse), k_cache, bt = _paged_plan(rt, lq, lk, page, 32, 8,
                                                                   128, True, used)
        assert tma == rt._GLUON and type(launch.fn).__name__ == "GluonJITFunction"
        assert launch.meta["PAGE_SIZE"] == page and launch.meta["SEQUSED"] is used
        assert launch.meta["VARLEN"] is True and launch.meta["BLOCK_N"] == 128
        names = list(launch.fn.arg_names)
        got = dict(zip(names[names.index("stride_btb"):], args))
        assert got["stride_btb"] == bt.stride(0) and got["NUM_PAGES"] == k_cache.shape[0]
        assert (got["stride_kb"], got["stride_kh"], got["stride_kn"]) == (
            k_cache.stride(0), k_cache.stride(2), k_cache.stride(1))
        assert got["N_K"] == bt.shape[1] * page and got["N_Q"] == sum(lq)
        assert got["KV_GROUP"] == 4
    # d = 64 at pages of 4: `tl`
    with rt.override_config(family="gluon"):
        plan, _, _ = _paged_plan(rt, lq[:4], lk[:4], 4, 8, 2, 64, False)
    assert type(plan[0].fn).__name__ != "GluonJITFunction"


_COMPILE = r"""
import json, sys
from pathlib import Path
sys.path.insert(0, str(Path(sys.argv[1]).parent))
import importlib
from flashgen import gluon_compile, families
from flashgen.offline import mod_arg_types
pkg = Path(sys.argv[1]).name
registry = importlib.import_module(pkg + "._registry")
rows = []
for spec in sys.argv[2].split(","):
    name, page, *used = spec.split(":")
    facts = registry.VARIANTS[name]
    module = importlib.import_module(f"{pkg}.kernels.gluon.{name}")
    cfg = families.variant_gluon_default(facts)
    for p in (0, int(page)):
        rows.append(gluon_compile.compile_variant(module, name, facts["head_dim"], facts["dtype"],
                                                  cfg, mod_arg_types(registry, name)[0],
                                                  varlen=True, page_size=p,
                                                  seqused=bool(p and used)).__dict__)
print(json.dumps(rows))
"""


@pytest.fixture(scope="module")
def gmods(tmp_path_factory):
    """The mods spec (d 64 / 128) without its decode kernels: score and sink mods on the
    Gluon paged forward."""
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    return build_and_import(tmp_path_factory.mktemp("gpagedmods"), "fg_test_gluon_paged_mods",
                            body.replace("decode: true", "decode: false"))


def _compile_rows(pkg, specs):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(Path(pkg.__file__).parent),
                          ",".join(specs)], capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(specs)
    return rows


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_gluon_paged_mods_compile_for_sm90(gmods):
    """A score mod (softcap) and a sink on the paged form: no key-loop spills, the packed
    form's products and register split."""
    specs = ["fwd_causal_softcap_d128_bf16:16", "fwd_causal_sink_logits_d64_fp16:64"]
    rows = _compile_rows(gmods, specs)
    for packed, paged in zip(rows[::2], rows[1::2]):
        assert paged["wgmma"] == packed["wgmma"] > 0, paged
        assert paged["setmaxnreg"] == packed["setmaxnreg"], paged
        assert paged["loop_spills"] == 0, paged


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_gluon_paged_forward_compiles_for_sm90(gpkg):
    """The paged form beside the packed one, sm_90 offline: the same wgmma products, register
    split and shared memory (+16 bytes: two more descriptors' worth of barriers and
    scratch at most), no spills in the key loops, and a TMA box a page: at page 16 and
    128-key blocks 8 boxes for K and 8 for V a block (each two 64-column TMA instructions
    at d = 128). Measured when written (stack bytes, packed / paged): causal d128 104 / 40
    (p16), 32 (p64)."""
    # (":seqused": the lengths from seqused_k, cu_seqlens_k None: the prefill bench's call)
    specs = ["fwd_causal_d128_bf16:16", "fwd_d128_bf16:64", "fwd_causal_d64_fp16:64",
             "fwd_d64_bf16:16", "fwd_causal_d128_bf16:64:seqused"]
    rows = _compile_rows(gpkg, specs)
    for spec, packed, paged in zip(specs, rows[::2], rows[1::2]):
        page = int(spec.split(":")[1])
        used = "seqused " if spec.endswith("seqused") else ""
        assert paged["config"] == f"paged{page} {used}" + packed["config"], paged
        assert paged["wgmma"] == packed["wgmma"] > 0, paged
        assert paged["setmaxnreg"] == packed["setmaxnreg"], paged
        assert paged["gmma_forms"] == packed["gmma_forms"], paged
        assert paged["shared"] <= packed["shared"] + 64 and paged["shared"] <= 232448, paged
        assert paged["spill_bytes"] <= max(packed["spill_bytes"], 64), paged
        assert paged["loop_spills"] == 0, paged
        # a box a page below the 128-key block: K and V each 128 / page boxes where the
        # packed form loads one, a box of d = 128 two TMA instructions (128-byte rows)
        pages, per_box = 128 // min(page, 128), 2 if "_d128_" in spec else 1
        assert paged["tma_loads"] == packed["tma_loads"] + 2 * (pages - 1) * per_box, (
            paged, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [TILES, None], ids=["small_tiles", "planned"])
@pytest.mark.parametrize("page_size", [16, 64, 24])
def test_on_cuda(pkg, page_size, tiles):
    """The paged prefill on the GPU, GQA 4:1, causal: against float64, and at one tile bit
    for bit against the dense varlen call on the gathered keys (the same kernel)."""
    gen = torch.Generator().manual_seed(100 + page_size)
    k_cache, v_cache, bt, k, v = paged_cache(LK, page_size, 2, torch.bfloat16, gen=gen)
    q = torch.randn(sum(LQ), 8, D, generator=gen).to(torch.bfloat16)
    lengths = (cu(LQ).cuda(), cu(LK).cuda(), max(LQ), max(LK))
    with pkg._runtime.override_config(**tiles) if tiles else _nothing():
        out, lse = pkg.flash_attn_varlen_func(q.cuda(), k_cache.cuda(), v_cache.cuda(),
                                              *lengths, block_table=bt.cuda(), causal=True,
                                              return_lse=True)
        if tiles:
            dense = pkg.flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), *lengths,
                                               causal=True, return_lse=True)
            assert torch.equal(out, dense[0]) and torch.equal(lse, dense[1])
    check((out.cpu(), lse.cpu()), reference(q, k, v, LQ, LK, causal=True), torch.bfloat16)


# ---------------------------------------------------------------------------------------
# GPU: the Gluon paged forward against float64
# ---------------------------------------------------------------------------------------
# new tokens and cached contexts (neither a multiple of any page size here, 0 included)
GLQ = [1, 59, 127, 257]
GCTX = [0, 1000, 2987, 333]


def _gluon_paged_ran(rt, page) -> bool:
    """Whether a varlen plan with the Gluon kernel at PAGE_SIZE = page was made (and so ran)."""
    return any(key[0] == "varlen" and plan[0] is not None
               and type(plan[0].fn).__name__ == "GluonJITFunction"
               and plan[0].meta["PAGE_SIZE"] == page for key, plan in rt._forward_plans.items())


def _gluon_paged_call(pkg, q, k_cache, v_cache, lq, lk, bt, *, used=False, **kw):
    """The call on the GPU: cu_seqlens_k, or seqused_k alone (used); (out, lse) on the CPU."""
    cuda = lambda t: t.cuda()  # noqa: E731
    out, lse = pkg.flash_attn_varlen_func(
        cuda(q), cuda(k_cache), cuda(v_cache), cuda(cu(lq)), None if used else cuda(cu(lk)),
        max(lq), max(lk), block_table=cuda(bt),
        seqused_k=cuda(torch.tensor(lk, dtype=torch.int32)) if used else None,
        return_lse=True, **kw)
    return out.cpu(), lse.cpu()


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64, 256])
@pytest.mark.parametrize("h_q,h_kv,d,dtype,causal,window,used", [
    (8, 2, 128, torch.bfloat16, True, (-1, -1), False),
    (16, 2, 128, torch.bfloat16, False, (-1, -1), True),
    (8, 1, 64, torch.float16, True, (-1, -1), True),
    (8, 2, 64, torch.bfloat16, False, (100, 0), False),
], ids=["gqa4_d128_causal", "gqa8_d128_full_seqused", "gqa8_d64_fp16_causal_seqused",
        "gqa4_d64_window"])
def test_gluon_paged_against_float64(gpkg, poison, page, h_q, h_kv, d, dtype, causal, window,
                                     used):
    """The Gluon paged forward on a shuffled, NaN-filled pool (unused table entries past
    it) against float64, and the `tl` kernel on the same call (FLASHGEN_PAGED_GLUON=0's
    path) within the same tolerance."""
    rt = gpkg._runtime
    gen = torch.Generator().manual_seed(page * 100 + h_q + d)
    lk = [c + n for c, n in zip(GCTX, GLQ)]
    k_cache, v_cache, bt, k, v = paged_cache(lk, page, h_kv, dtype, gen=gen, d=d)
    q = torch.randn(sum(GLQ), h_q, d, generator=gen).to(dtype)
    rt._forward_plans.clear()
    with rt.override_config(family="gluon"):  # (a call this small is `tl` by default)
        got = _gluon_paged_call(gpkg, q, k_cache, v_cache, GLQ, lk, bt, used=used,
                                causal=causal, window_size=window)
        assert _gluon_paged_ran(rt, page)  # (inside: leaving override_config clears plans)
    ref = reference(q, k, v, GLQ, lk, causal=causal, window=window)
    check(got, ref, dtype)
    rt._forward_plans.clear()
    saved = rt.PAGED_GLUON
    try:
        rt.PAGED_GLUON = False
        tl = _gluon_paged_call(gpkg, q, k_cache, v_cache, GLQ, lk, bt, used=used,
                               causal=causal, window_size=window)
    finally:
        rt.PAGED_GLUON = saved
    assert not _gluon_paged_ran(rt, page)
    check(tl, ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_gluon_paged_by_default_at_the_bench_shape(gpkg, poison, page, monkeypatch):
    """By default (PAGED_GLUON on), no family asked for: a prefill-sized call (8 sequences of 512 new tokens over
    contexts up to ~4k, GQA 4:1, d = 128, causal) takes the Gluon paged forward on Hopper,
    and agrees with the dense Gluon varlen call on the gathered keys to fp32 rounding of
    the same products (the same tiles, walk and key order)."""
    rt = gpkg._runtime
    monkeypatch.setattr(rt, "PAGED_GLUON", True)
    gen = torch.Generator().manual_seed(page)
    lq = [512] * 8
    lk = [512 + c for c in (0, 517, 1023, 1999, 2500, 3001, 3333, 4093)]
    k_cache, v_cache, bt, k, v = paged_cache(lk, page, 8, torch.bfloat16, gen=gen, d=128)
    q = torch.randn(sum(lq), 32, 128, generator=gen).to(torch.bfloat16)
    rt._forward_plans.clear()
    got = _gluon_paged_call(gpkg, q, k_cache, v_cache, lq, lk, bt, causal=True)
    assert _gluon_paged_ran(rt, page)
    dense = gpkg.flash_attn_varlen_func(q.cuda(), k.cuda(), v.cuda(), cu(lq).cuda(),
                                        cu(lk).cuda(), max(lq), max(lk), causal=True,
                                        return_lse=True)
    assert not torch.isnan(got[0]).any()
    torch.testing.assert_close(got[0], dense[0].cpu(), atol=2e-3, rtol=0)
    torch.testing.assert_close(got[1], dense[1].cpu(), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_gluon_paged_bad_page_indices_stay_in_the_pool(gpkg, monkeypatch):
    """Unchecked (FLASHGEN_CHECK_VALUES off), page indices past the pool, negative or huge,
    and lengths past the table's capacity are clamped in the Gluon kernel: a finite answer,
    no illegal access (the next call on the device still runs)."""
    rt = gpkg._runtime
    gen = torch.Generator().manual_seed(11)
    lk = [c + n for c, n in zip(GCTX, GLQ)]
    k_cache, v_cache, bt, k, v = paged_cache(lk, 16, 2, torch.bfloat16, gen=gen, d=128)
    k_cache, v_cache = k_cache.nan_to_num(), v_cache.nan_to_num()
    q = torch.randn(sum(GLQ), 8, 128, generator=gen).to(torch.bfloat16)
    monkeypatch.setattr(gpkg._decode, "CHECK_VALUES", False)
    bt[1, 3], bt[2, 0], bt[0, 0] = -3, 2 ** 31 - 1, k_cache.shape[0]
    rt._forward_plans.clear()
    with rt.override_config(family="gluon"):
        out, lse = _gluon_paged_call(gpkg, q, k_cache, v_cache, GLQ, lk, bt, causal=True)
        assert _gluon_paged_ran(rt, 16)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
        huge = [10 ** 6, -5] + lk[2:]
        out, lse = _gluon_paged_call(gpkg, q, k_cache, v_cache, GLQ, huge, bt, used=True,
                                     causal=True)
        assert torch.isfinite(out).all() and not torch.isnan(lse).any()
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_gluon_seqused_k_on_packed_keys(gpkg, poison):
    """seqused_k without a block table on the Gluon forward (SEQUSED): sequence i's first
    seqused_k[i] rows of its cu_seqlens_k span, the rest NaN and never seen."""
    rt = gpkg._runtime
    gen = torch.Generator().manual_seed(12)
    lk = [c + n for c, n in zip(GCTX, GLQ)]
    span = [n + 37 for n in lk]
    k = torch.randn(sum(span), 2, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(sum(span), 2, 128, generator=gen).to(torch.bfloat16)
    q = torch.randn(sum(GLQ), 8, 128, generator=gen).to(torch.bfloat16)
    keep = torch.cat([torch.arange(s, s + n) for s, n in zip(cu(span)[:-1].tolist(), lk)])
    gone = ~torch.isin(torch.arange(sum(span)), keep)
    k[gone], v[gone] = float("nan"), float("nan")
    rt._forward_plans.clear()
    with rt.override_config(family="gluon"):
        out, lse = gpkg.flash_attn_varlen_func(
            q.cuda(), k.cuda(), v.cuda(), cu(GLQ).cuda(), cu(span).cuda(), max(GLQ), max(span),
            causal=True, seqused_k=torch.tensor(lk, dtype=torch.int32).cuda(), return_lse=True)
        assert any(key[0] == "varlen" and plan[0].meta.get("SEQUSED") is True
                   and type(plan[0].fn).__name__ == "GluonJITFunction"
                   for key, plan in rt._forward_plans.items())
    check((out.cpu(), lse.cpu()), reference(q, k[keep], v[keep], GLQ, lk, causal=True),
          torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("page", [16, 64])
def test_gluon_paged_score_and_sink_mods(gmods, poison, page):
    """softcap and a sink on the Gluon paged forward against float64 (the mods see the
    sequence as b and in-sequence positions, as in a packed call)."""
    rt = gmods._runtime
    gen = torch.Generator().manual_seed(13 + page)
    lk = [c + n for c, n in zip(GCTX, GLQ)]
    k_cache, v_cache, bt, k, v = paged_cache(lk, page, 2, torch.bfloat16, gen=gen, d=128)
    q = (torch.randn(sum(GLQ), 8, 128, generator=gen) * 3).to(torch.bfloat16)
    sinks = torch.randn(8, generator=gen)
    rt._forward_plans.clear()
    with rt.override_config(family="gluon"):
        got = _gluon_paged_call(gmods, q, k_cache, v_cache, GLQ, lk, bt, causal=True,
                                mods=("softcap",), cap=5.0)
        assert _gluon_paged_ran(rt, page)
        check(got, reference(q, k, v, GLQ, lk, causal=True,
                             score_mod=lambda s: 5.0 * torch.tanh(s / 5.0)), torch.bfloat16)
        rt._forward_plans.clear()
        got = _gluon_paged_call(gmods, q, k_cache, v_cache, GLQ, lk, bt, causal=True,
                                mods=("sink_logits",), sinks=sinks.cuda())
        assert _gluon_paged_ran(rt, page)
        check(got, reference(q, k, v, GLQ, lk, causal=True, sink=sinks.double()),
              torch.bfloat16)
