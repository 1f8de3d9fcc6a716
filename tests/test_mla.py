"""Different head dims for Q/K and for V (DeepSeek MLA's 192/128): a spec entry
{qk: D, v: DV} builds kernels whose output and V have their own head dim, forward,
backward and decode (flash_attn_with_kvcache: paged, appended, split, the latent cache's
v_cache = k_cache[..., :DV] view), with masks, dropout, GQA and mods; compared with the
float64 reference. The GPU group runs DeepSeek's real 576/512 latent decode.

The test sizes keep the MLA ratio's shape (a Q/K dim that is not a power of two, larger
than V's) at interpreter scale: {qk: 48, v: 32}, and {qk: 24, v: 40} the other way round."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from flashgen.errors import SpecError
from flashgen.reference import attention_ref, visible_mask
from flashgen.spec import parse_spec
from flashgen.variants import variants_for
from packages import build_and_import, gluon_compiles

ROOT = Path(__file__).resolve().parent.parent

TILE = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("mla"), "fg_test_mla", """
        head_dims: [32, {qk: 48, v: 32}, {qk: 24, v: 40}]
        dtypes: [fp32, bf16]
        masks: [none, causal]
        dropout: true
        gqa: true
        mods:
          softcap: {builtin: softcap, params: {cap: 2.0}}
        variants:
          - {mask: causal, mods: [softcap]}
        """)


def reference(q, k, v, causal, score=None):
    """(B, N, H, d) inputs -> (B, Nq, H, dv) float64; causal bottom-right."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if score is not None:
        s = score(s)
    if causal:
        n_q, n_k = s.shape[-2:]
        s = s.masked_fill(torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q).logical_not(),
                          float("-inf"))
    # rows that see no key (N_q > N_k, causal bottom-right) give 0
    return (torch.nan_to_num(torch.softmax(s, -1), nan=0.0) @ v).transpose(1, 2)


CASES = [
    # (dq/k, dv, dtype, causal, Nq, Nk, Hq, Hkv, mods)
    (48, 32, torch.float32, True, 37, 37, 2, 2, None),
    (48, 32, torch.bfloat16, False, 23, 41, 4, 1, None),
    (24, 40, torch.float32, True, 59, 33, 2, 1, None),
    (48, 32, torch.float32, True, 37, 37, 2, 2, "softcap"),
]


@pytest.mark.parametrize("d, dv, dtype, causal, n_q, n_k, h, h_kv, mod", CASES,
                         ids=["48v32-causal", "48v32-bf16-gqa-ragged", "24v40-causal-gqa",
                              "48v32-softcap"])
def test_forward_and_gradients(pkg, device, d, dv, dtype, causal, n_q, n_k, h, h_kv, mod):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, n_q, h, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    k = torch.randn(2, n_k, h_kv, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    v = torch.randn(2, n_k, h_kv, dv, generator=g).to(device=device, dtype=dtype).requires_grad_()
    kw = {"mods": ("softcap",)} if mod else {}
    with pkg._runtime.override_config(**TILE):
        out = pkg.flash_attn_func(q, k, v, causal=causal, **kw)
        assert out.shape == (2, n_q, h, dv)
        dout = torch.randn_like(out)
        out.backward(dout)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref = reference(*leaves, causal, (lambda s: 2.0 * torch.tanh(s / 2.0)) if mod else None)
    want = torch.autograd.grad(ref, leaves, dout.detach().cpu().double())
    atol, rtol = OUT_TOL[dtype]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.detach().cpu().double(), ref, atol=atol, rtol=rtol)
    gatol, grtol = GRAD_TOL[dtype]
    for got, exp, name in zip((q.grad, k.grad, v.grad), want, ("dq", "dk", "dv")):
        assert got.shape == exp.shape, name
        torch.testing.assert_close(got.cpu().double(), exp, atol=gatol, rtol=grtol, msg=name)


def test_dropout_and_sdpa_layout(pkg):
    """SDPA's (B, H, N, d) layout, and dropout: the output is finite, scaled like the
    reference in expectation, and p=0 matches it exactly."""
    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, 2, 33, 48, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 33, 32, generator=g)
    with pkg._runtime.override_config(**TILE):
        out = pkg.scaled_dot_product_attention(q, k, v, is_causal=True)
        dropped = pkg.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=0.3)
    ref = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    assert dropped.shape == out.shape and torch.isfinite(dropped).all()
    assert not torch.equal(dropped, out)


def test_unbuilt_pair_names_the_spec_entry(pkg):
    q, k = torch.randn(1, 8, 2, 48), torch.randn(1, 8, 2, 48)
    with pytest.raises(ValueError, match=r"\{qk: 48, v: 16\}"):
        pkg.flash_attn_func(q, k, torch.randn(1, 8, 2, 16))
    with pytest.raises(ValueError, match="q has head dim 48 but k has 32"):
        pkg.flash_attn_func(q, torch.randn(1, 8, 2, 32), torch.randn(1, 8, 2, 32))


def test_spec_pairs_and_names():
    spec = parse_spec("package: p\nhead_dims: [64, {qk: 192, v: 128}]\ndtypes: [bf16]\n"
                      "masks: [causal]\ngpu: {name: H100, sram_bytes: 232448}\n", "p.yaml")
    assert spec.head_dims == (64, 192)
    assert spec.head_dim_pairs == ((64, 64), (192, 128))
    names = {v.name for v in variants_for(spec)}
    assert {"fwd_causal_d192v128_bf16", "bwd_causal_d192v128_bf16", "fwd_causal_d64_bf16"} <= names
    with pytest.raises(SpecError, match=r"p\.yaml:2.*head_dims\.v.*not a multiple of 8"):
        parse_spec("package: p\nhead_dims: [{qk: 192, v: 100}]\ndtypes: [bf16]\n"
                   "masks: [causal]\ngpu: {name: H100, sram_bytes: 232448}\n", "p.yaml")


# ---------------------------------------------------------------------------------------
# decode: flash_attn_with_kvcache with V's head dim apart from Q's and K's
# ---------------------------------------------------------------------------------------
# The interpreter-scale stand-ins for DeepSeek's latent decode (576 / 512): 48 / 32 (V
# narrower, so v_cache can be a view of k_cache's first 32 dims), 24 / 40 (V wider), and a
# decode_only entry 40 / 24 (decode kernels alone). Small tiles force many key blocks per
# split, every split several blocks, and the masked / unmasked loop phases all to run.
DEC_TILE = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
DEC_H_KV = 2


@pytest.fixture(scope="module")
def dec(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("mla_decode"), "fg_test_mla_decode", """
        head_dims: [{qk: 48, v: 32}, {qk: 24, v: 40}, {qk: 40, v: 24, decode_only: true}]
        dtypes: [fp32, bf16]
        masks: [none, causal, sliding_window]
        window: {left: 20, right: 0}
        gqa: true
        decode: true
        attn_mask: false
        mods:
          softcap: {builtin: softcap, params: {cap: 2.0}}
        variants:
          - {mask: causal, mods: [softcap]}
        """)


def dec_cache(batch, capacity, d, dv, *, page_size=None, latent=None, dtype=torch.float32,
              device="cpu", seed=0):
    """(k_cache, v_cache, block_table). latent "prefix": v_cache = k_cache[..., :dv] (DeepSeek's
    latent cache, V_IS_K); "offset": k_cache[..., 16:16 + dv], a strided view that is not a
    prefix (V read on its own). Paged: every element's pages shuffled through the pool, with
    spare pages no one uses."""
    g = torch.Generator().manual_seed(seed)
    if page_size is None:
        lead = (batch, capacity)
        table = None
    else:
        pages = -(-capacity // page_size)
        lead = (batch * pages + 3, page_size)
        table = torch.randperm(lead[0], generator=g)[:batch * pages].view(batch, pages)
        table = table.to(torch.int32).to(device)
    k = torch.randn(*lead, DEC_H_KV, d, generator=g).to(dtype).to(device)
    if latent == "prefix":
        v = k[..., :dv]
    elif latent == "offset":
        v = k[..., 16:16 + dv]
    else:
        v = torch.randn(*lead, DEC_H_KV, dv, generator=g).to(dtype).to(device)
    return k, v, table


def dec_reference(q, k_cache, v_cache, table, lengths, *, causal=False, window=(-1, -1),
                  score=None):
    """(out (B, N_q, H_q, dv), lse (B, H_q, N_q)) in float64 on the CPU, by definition: the
    first L cache rows of each element (through the block table one row at a time), query
    i at position L - N_q + i."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    table = None if table is None else table.cpu()
    outs, lses = [], []
    for b, n in enumerate(lengths):
        def rows(cache):
            if table is None:
                return cache[b, :n]
            size = cache.shape[1]
            picked = [cache[int(table[b, j // size]), j % size] for j in range(n)]
            return torch.stack(picked) if picked else cache.new_zeros((0,) + cache.shape[2:])
        k, v = (rows(c)[None].transpose(1, 2) for c in (k_cache, v_cache))
        vis = visible_mask(q.shape[1], n, causal=causal, window=window, bottom_right=True)
        o, lse = attention_ref(q[b:b + 1].transpose(1, 2), k, v, vis, score_mod=score)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def assert_decode_matches(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any(), "NaN in the output (or an element never written)"
    assert not torch.isnan(lse).any(), "NaN in the LSE (or an element never written)"
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=atol, rtol=rtol)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen), "LSE -inf rows differ"
    assert (out.cpu().transpose(1, 2)[~seen] == 0).all(), "a row that sees no key must be 0"
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse[seen], atol=LSE_TOL[0],
                               rtol=LSE_TOL[1])


DEC_CASES = [
    # (id, d, dv, dtype, page_size, latent, n_q, group, mask, splits)
    ("48v32-causal", 48, 32, torch.float32, None, None, 1, 4, "causal", 1),
    ("48v32-bf16-paged16-split3", 48, 32, torch.bfloat16, 16, None, 2, 4, "causal", 3),
    ("48v32-latent-paged16-split3", 48, 32, torch.bfloat16, 16, "prefix", 1, 4, "causal", 3),
    ("48v32-latent-contiguous", 48, 32, torch.float32, None, "prefix", 3, 4, "none", 2),
    ("48v32-offset-view", 48, 32, torch.float32, None, "offset", 1, 1, "causal", 2),
    ("24v40-window-paged16", 24, 40, torch.float32, 16, None, 1, 4, "window", 2),
    ("24v40-none-auto-splits", 24, 40, torch.bfloat16, None, None, 1, 2, "none", 0),
    ("40v24-decode-only", 40, 24, torch.float32, 16, "prefix", 2, 4, "causal", 4),
]


@pytest.mark.parametrize("case", DEC_CASES, ids=[c[0] for c in DEC_CASES])
def test_decode_matches_reference(dec, device, poison, case):
    """Ragged lengths 1, 59 and 127 (the whole cache) over a batch of 3, GQA (4:1 and
    2:1), causal / window / none, one split and several (the in-launch LSE reduction),
    contiguous and paged (16-row pages, shuffled table), V apart, V as a view of K's first
    dims (the latent cache: V_IS_K) and as a strided view elsewhere in K."""
    _, d, dv, dtype, page, latent, n_q, group, mask, splits = case
    lengths = [1, 59, 127]
    k_cache, v_cache, table = dec_cache(3, 127, d, dv, page_size=page, latent=latent,
                                        dtype=dtype, device=device, seed=d + dv)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(3, n_q, DEC_H_KV * group, d, generator=g).to(dtype).to(device)
    causal = mask == "causal"
    window = (20, 0) if mask == "window" else (-1, -1)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with dec._runtime.override_config(**DEC_TILE):
        out, lse = dec.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               block_table=table, causal=causal,
                                               window_size=window, num_splits=splits,
                                               return_lse=True)
    assert out.shape == (3, n_q, DEC_H_KV * group, dv) and out.dtype == dtype
    assert_decode_matches(out, lse, *dec_reference(q, k_cache, v_cache, table, lengths,
                                                   causal=causal, window=window), dtype)


def test_decode_reads_a_latent_view_once(dec):
    """v_cache = k_cache[..., :dv] launches the V_IS_K form (no second load of those
    bytes), a separate v_cache or a view that is not a prefix of K does not; the same
    shapes and strides with and without the aliasing get plans of their own."""
    k_cache, _, _ = dec_cache(2, 32, 48, 32)
    q = torch.zeros(2, 1, 2, 48)
    other = torch.randn(2, 32, DEC_H_KV, 48)

    def v_is_k(v_cache):
        with dec._runtime.override_config(**DEC_TILE):
            plan = dec._decode._make_plan(q, k_cache, v_cache, None, None, 5, None, None,
                                          True, (-1, -1), 1)
        return plan.kernel.meta["V_IS_K"]

    assert v_is_k(k_cache[..., :32])
    assert not v_is_k(k_cache[..., 16:])
    assert not v_is_k(other[..., :32])  # same shape and strides, another tensor
    key = dec._decode._plan_key
    assert (key(q, k_cache, k_cache[..., :32], None, None, 5, None, None, True, (-1, -1), 1)
            != key(q, k_cache, other[..., :32], None, None, 5, None, None, True, (-1, -1), 1))


@pytest.mark.parametrize("page_size,latent", [(None, None), (16, None), (16, "prefix")],
                         ids=["contiguous", "paged16", "latent-paged16"])
def test_decode_appends_new_keys_and_values(dec, device, poison, page_size, latent):
    """New k (d = 48 dims) and v (dv = 32) are written in place at cache_seqlens.. (through
    the shuffled block table when paged) and attended to; with the latent cache the new
    values are the new keys' first dims (v = k[..., :dv], a view) and v_cache reads them
    back out of k_cache."""
    d, dv, n_new = 48, 32, 2
    lengths = [0, 57, 125]  # the last one fills the 127-row cache exactly
    k_cache, v_cache, table = dec_cache(3, 127, d, dv, page_size=page_size, latent=latent,
                                        device=device, seed=3)
    g = torch.Generator().manual_seed(4)
    k_new = torch.randn(3, n_new, DEC_H_KV, d, generator=g).to(device)
    v_new = (k_new[..., :dv] if latent else
             torch.randn(3, n_new, DEC_H_KV, dv, generator=g).to(device))
    q = torch.randn(3, 2, DEC_H_KV * 4, d, generator=g).to(device)
    k_want = k_cache.clone()
    v_want = k_want[..., :dv] if latent else v_cache.clone()
    for b, n in enumerate(lengths):
        for t in range(n_new):
            j = n + t
            page, row = (b, j) if table is None else (int(table[b, j // page_size]), j % page_size)
            k_want[page, row] = k_new[b, t]
            v_want[page, row] = v_new[b, t]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with dec._runtime.override_config(**DEC_TILE):
        out, lse = dec.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=3, return_lse=True)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), \
        "the caches must hold the new rows at cache_seqlens.. and nothing else may change"
    total = [n + n_new for n in lengths]
    assert_decode_matches(out, lse, *dec_reference(q, k_want, v_want, table, total,
                                                   causal=True), torch.float32)


@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "three-splits"])
def test_decode_softcap_mod(dec, device, poison, splits):
    """A score mod (softcap, its cap passed at the call) on the latent cache."""
    lengths = [1, 59, 127]
    k_cache, v_cache, table = dec_cache(3, 127, 48, 32, page_size=16, latent="prefix",
                                        device=device, seed=11)
    q = torch.randn(3, 1, DEC_H_KV * 4, 48, generator=torch.Generator().manual_seed(12))
    q = q.to(device)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with dec._runtime.override_config(**DEC_TILE):
        out, lse = dec.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                               block_table=table, causal=True,
                                               num_splits=splits, return_lse=True,
                                               mods=("softcap",), cap=1.5)
    ref = dec_reference(q, k_cache, v_cache, table, lengths, causal=True,
                        score=lambda s: 1.5 * torch.tanh(s / 1.5))
    assert_decode_matches(out, lse, *ref, torch.float32)


def _dec_call(dec, **over):
    """A valid paged call with new keys at 48 / 32, with some arguments replaced."""
    k_cache, v_cache, table = dec_cache(2, 64, 48, 32, page_size=16, seed=20)
    args = dict(q=torch.zeros(2, 1, 8, 48), k_cache=k_cache, v_cache=v_cache,
                k=torch.zeros(2, 1, DEC_H_KV, 48), v=torch.zeros(2, 1, DEC_H_KV, 32),
                cache_seqlens=torch.tensor([3, 10], dtype=torch.int32), block_table=table)
    args.update(over)
    return dec.flash_attn_with_kvcache(**args)


def test_decode_valid_call_runs(dec):
    with dec._runtime.override_config(**DEC_TILE):
        assert _dec_call(dec).shape == (2, 1, 8, 32)


@pytest.mark.parametrize("over,match", [
    (dict(v_cache=torch.zeros(11, 16, DEC_H_KV, 16)), r"\{qk: 48, v: 16\}.*decode_only"),
    (dict(v_cache=torch.zeros(11, 8, DEC_H_KV, 32)), "one shape"),
    (dict(v_cache=torch.zeros(11, 16, 1, 32)), "one shape"),
    (dict(v=torch.zeros(2, 1, DEC_H_KV, 48)), r"new v has head dim 48 but v_cache has 32.*k\[\.\.\., :32\]"),
    (dict(k=torch.zeros(2, 1, DEC_H_KV, 32)), "new k must be"),
    (dict(v=torch.zeros(2, 2, DEC_H_KV, 32)), "k and v must have one shape"),
    (dict(q=torch.zeros(2, 1, 8, 32)), "q has head dim 32 but the cache has 48"),
    (dict(v_cache=torch.zeros(11, 16, DEC_H_KV, 32, dtype=torch.bfloat16)), "share a dtype"),
], ids=["v_dim_not_built", "v_pages", "v_heads", "new_v_dim", "new_k_dim", "new_kv_tokens",
        "q_dim", "v_dtype"])
def test_decode_bad_tensors_raise_before_any_write(dec, over, match):
    k_cache, v_cache, table = dec_cache(2, 64, 48, 32, page_size=16, seed=20)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=match):
        _dec_call(dec, k_cache=k_cache, **({"v_cache": v_cache} | over))
    assert torch.equal(k_cache, before), "a rejected call must not write the cache"


def test_decode_only_entry_builds_no_forward(dec):
    """{qk: 40, v: 24, decode_only: true}: decode kernels, no forward or backward."""
    names = set(dec._registry.VARIANTS)
    assert {"decode_causal_d40v24_fp32", "decode_causal_softcap_d40v24_bf16"} <= names
    assert not any("d40v24" in n for n in names if not n.startswith("decode"))
    with pytest.raises(ValueError, match=r"\{qk: 40, v: 24\}"):
        dec.flash_attn_func(torch.zeros(1, 4, 2, 40), torch.zeros(1, 4, 2, 40),
                            torch.zeros(1, 4, 2, 24))
    text = dec.describe()
    assert "decode_causal_d48v32_bf16" in text and "decode_causal_d40v24_fp32" in text
    assert "decode kernels for (q/k, v) head dims [(24, 40), (40, 24), (48, 32)]" in text


def test_decode_only_spec_rules():
    gpu = "gpu: {name: H100, sram_bytes: 232448}\n"
    base = "package: p\ndtypes: [bf16]\nmasks: [causal]\n"
    spec = parse_spec(base + "decode: true\nhead_dims: [{qk: 192, v: 128}, "
                      "{qk: 576, v: 512, decode_only: true}]\n" + gpu, "p.yaml")
    assert spec.head_dims == (192,) and spec.head_dim_pairs == ((192, 128),)
    assert spec.decode_pairs == ((192, 128), (576, 512))
    names = {v.name for v in variants_for(spec)}
    assert {"decode_causal_d576v512_bf16", "decode_causal_d192v128_bf16",
            "fwd_causal_d192v128_bf16"} <= names
    assert not any("d576" in n for n in names if not n.startswith("decode"))
    with pytest.raises(SpecError, match=r"head_dims\.qk.*576 is outside 16\.\.512.*decode_only: true"):
        parse_spec(base + "decode: true\nhead_dims: [{qk: 576, v: 512}]\n" + gpu, "p.yaml")
    with pytest.raises(SpecError, match=r"decode_only but the spec builds no decode kernels"):
        parse_spec(base + "head_dims: [{qk: 576, v: 512, decode_only: true}]\n" + gpu, "p.yaml")
    with pytest.raises(SpecError, match=r"outside 16\.\.576"):
        parse_spec(base + "decode: true\nhead_dims: [{qk: 584, v: 512, decode_only: true}]\n"
                   + gpu, "p.yaml")


def test_shipped_mla_spec_plans_the_latent_decode():
    """specs/mla.yaml builds DeepSeek's 576 / 512 decode: its tile fits the H100's shared
    memory in the planner's model, takes the 4 warps it compiled with without a spill
    (sm_90 offline: MMA_COLS_PER_WARP); 16 query heads run that 16-row tile, and 128 heads
    32-row tiles at 8 warps (4 row blocks instead of 8: at 4 warps, and at 64 rows, the
    tile spilled, sm_90 offline)."""
    from flashgen.plan import plan_spec
    from flashgen.spec import load_spec
    from generated.mla_attn import _decode, _registry

    spec = load_spec(ROOT / "specs" / "mla.yaml")
    plans = {v.name: p for v, p in plan_spec(spec).items()}
    plan = plans["decode_causal_d576v512_bf16"]
    chosen = next(c for c in plan.candidates if c.config == plan.chosen)
    assert chosen.smem_bytes <= spec.gpu.sram_bytes == 232448
    assert (plan.chosen.block_m, plan.chosen.block_n, plan.chosen.num_warps) == (16, 32, 4)
    cfg = _registry.PLANNED["decode_causal_d576v512_bf16"]
    cpu = torch.device("cpu")

    def tile(c, rows, dim):
        t = _decode.stacked_tile(c, rows, dim, 2, cpu)
        return t["block_m"], t["block_n"], t["num_warps"], t["num_stages"]

    assert tile(cfg, 16, 576) == (16, 32, 4, 2)
    assert tile(cfg, 128, 576) == (32, 32, 8, 2)
    assert tile(cfg, 64, 576) == (32, 32, 8, 2)
    assert tile(_registry.PLANNED["decode_causal_d192v128_bf16"], 8, 192) == (16, 128, 4, 2)
    assert tile(_registry.PLANNED["decode_causal_d192v128_bf16"], 64, 192) == (64, 128, 8, 2)


# ---------------------------------------------------------------------------------------
# GPU: DeepSeek's real latent decode (run on the H100 with -m gpu)
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("latent", [True, False], ids=["latent-view", "separate-v"])
@pytest.mark.parametrize("paged", [True, False], ids=["paged64", "contiguous"])
@pytest.mark.parametrize("h_q", [16, 128], ids=["16-heads", "128-heads"])
def test_gpu_deepseek_latent_decode_576_512(latent, paged, h_q):
    """generated/mla_attn's decode_causal_d576v512_bf16 on CUDA: 16 or 128 query heads on
    one latent head (MQA; 128 stack into 32-row, 8-warp tiles, 4 row blocks), q 576 dims,
    v_cache = k_cache[..., :512] (or a cache of its own), ragged lengths up to 4096 with one
    appended token, paged (64-row pages, shuffled) or not, split-KV chosen by the
    heuristic, the LSE returned; against float64."""
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    import generated.mla_attn as mla

    d, dv, n_new, batch, cap = 576, 512, 1, 4, 4096
    lengths = [0, 1, 1000, cap - n_new]
    g = torch.Generator().manual_seed(0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    if paged:
        page = 64
        pages = cap // page
        k_cache = torch.randn(batch * pages + 5, page, 1, d, generator=g).to(**bf)
        table = torch.randperm(batch * pages + 5, generator=g)[:batch * pages]
        table = table.view(batch, pages).to(torch.int32).cuda()
    else:
        k_cache = torch.randn(batch, cap, 1, d, generator=g).to(**bf)
        table = None
    v_cache = (k_cache[..., :dv] if latent else
               torch.randn(*k_cache.shape[:3], dv, generator=g).to(**bf))
    k_new = torch.randn(batch, n_new, 1, d, generator=g).to(**bf)
    v_new = k_new[..., :dv] if latent else torch.randn(batch, n_new, 1, dv, generator=g).to(**bf)
    q = torch.randn(batch, 1, h_q, d, generator=g).to(**bf)
    scale = 1.0 / math.sqrt(192)  # DeepSeek scales by the unabsorbed q/k head dim
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    with torch.inference_mode():
        out, lse = mla.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=seqlens, block_table=table,
                                               softmax_scale=scale, causal=True,
                                               return_lse=True)
    torch.cuda.synchronize()
    assert out.shape == (batch, 1, h_q, dv)
    total = [n + n_new for n in lengths]
    ref_out, ref_lse = dec_reference(q, k_cache, v_cache, table, total, causal=True,
                                     score=lambda s: s * (scale * math.sqrt(d)))
    assert_decode_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


# ---------------------------------------------------------------------------------------
# The Gluon latent decode (issue 16; templates/gluon/decode_mla.py.j2): on by default on
# Hopper, compiled for sm_90 here, checked against float64 on the H100 with -m gpu
# ---------------------------------------------------------------------------------------
MLA_VARIANT = "decode_causal_d576v512_bf16"

_MLA_COMPILE = r"""
import importlib, io, contextlib, json, sys
sys.path.insert(0, sys.argv[1])
from flashgen import gluon_compile
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
name = sys.argv[2]
module = importlib.import_module("mla_attn.kernels.gluon." + name)
rows = [gluon_compile.compile_mla_decode(module, name, paged=paged, per_row_lens=lens).__dict__
        for paged, lens in ((True, True), (False, True), (False, False))]
sig = {"OP": "*fp32", "O": "*bf16", "LSE": "*fp32", "N_Q": "i32", "H_Q": "i32",
       "NUM_SPLITS": "i32", "N_ROWS": "i32", "LP_OFF": "i32", "STORE_LSE": "constexpr",
       "SPLITS_PAD": "constexpr", "R": "constexpr"}
buf = io.StringIO()
with contextlib.redirect_stdout(buf):
    triton.compile(ASTSource(getattr(module, name + "_combine"), sig, {(8,): True, (9,): 8, (10,): 4}),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4))
print(json.dumps(rows))
"""


@pytest.mark.skipif(not gluon_compiles(),
                    reason="the Gluon templates are verified on Triton 3.6 (CI pins it)")
def test_gluon_latent_decode_compiles_for_sm90():
    """generated/mla_attn's Gluon latent decode compiles for sm_90 (paged and contiguous,
    per-row lengths or one): within the H100's shared memory, the registers split 192 / 192
    (output warpgroups), 24 (producer) and the rest (104) for the softmax warpgroup, no
    stack frame and no LDL/STL in its key loops, 68 wgmma (S = Q K^T: 9 chunks x 4 k-steps;
    P V: 2 warpgroups x 4 chunks x 4), and no ptxas note that it serialised a wgmma; its
    combine kernel compiles too."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _MLA_COMPILE, str(ROOT / "generated"), MLA_VARIANT],
                         capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 3
    for r in rows:
        assert r["shared"] <= 232448, r
        assert r["wgmma"] == 68, r
        assert {24, 104, 192} <= set(r["setmaxnreg"]), r
        assert r["spill_bytes"] == 0 and r["loop_spills"] == 0, r
        assert not r["wgmma_notes"], r


def test_gluon_latent_decode_is_on_by_default():
    """The switch defaults on and the package lists the kernel in describe(); with it off (or
    the `tl` family forced) the plan does not ask for it; with it on, a call the kernel
    cannot serve (here: on the CPU) keeps the `tl` kernel and the plan says why."""
    import generated.mla_attn as mla
    from generated.mla_attn import _decode, _registry

    from generated.mla_attn import _runtime

    assert _decode.MLA_GLUON is True
    assert MLA_VARIANT in _registry.GLUON_DECODE
    assert "on by default" in mla.describe() and MLA_VARIANT in mla.describe()
    row = next(line for line in mla.describe().splitlines() if line.startswith(f"    {MLA_VARIANT}"))
    assert "gluon latent decode" in row and "tl (" not in row
    q = torch.randn(1, 1, 16, 576).to(torch.bfloat16)
    cache = torch.randn(1, 64, 1, 576).to(torch.bfloat16)

    def plan():
        return _decode._make_plan(q, cache, cache[..., :512], None, None, 5, None, None, True,
                                  (-1, -1), 0)

    _decode.MLA_GLUON = False
    try:
        off = plan()
    finally:
        _decode.MLA_GLUON = True
    assert off.mla is None and off.mla_reason is None  # not asked for
    before = _runtime._FORCED_FAMILY
    _runtime.use_family("tl")
    try:
        forced = plan()
    finally:
        _runtime.use_family(before)
    assert forced.mla is None and forced.mla_reason is None
    on = plan()
    assert on.mla is None and on.mla_reason  # the CPU: the `tl` kernel, with the reason


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [0, 1], ids=["auto-splits", "one-split"])
@pytest.mark.parametrize("page", [64, None], ids=["paged64", "contiguous"])
@pytest.mark.parametrize("h_q", [16, 128], ids=["16-heads", "128-heads"])
def test_gpu_gluon_latent_decode_576_512(h_q, page, splits):
    """The Gluon latent decode (MLA_GLUON on) against float64: 16 or 128 query heads on
    one latent head, v_cache = k_cache[..., :512] (V_IS_K), ragged lengths (0, 1, a block
    and a bit, a length that is not a multiple of 64, the whole cache) with one appended
    token, paged (64-row pages, shuffled, spare pages holding NaN) or contiguous (NaN past
    every length), split-KV by the heuristic or none; the plan must have taken the Gluon
    kernel."""
    _gluon_latent_case(h_q, page, splits, n_q=1, lengths=[0, 1, 64, 1000, 4095], cap=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("n_q,page,int_lens,splits", [
    (2, 128, False, 0),   # two query tokens (causal among them), 128-row pages
    (65, None, False, 3),  # 65 tokens: a 64-row block's tokens wrap from 64 to 0
    (65, 64, True, 0),    # the same with one int length for every element, paged
], ids=["2-tokens-paged128", "65-tokens-contiguous-3-splits", "65-tokens-paged64-int-len"])
def test_gpu_gluon_latent_decode_query_tokens(n_q, page, int_lens, splits):
    """The Gluon latent decode with several query tokens a call (causal among them),
    appended as new keys: with 65 tokens (16 heads: 1040 stacked rows, 17 row blocks) a
    row block holds tokens 64, 0..62 of two heads, so its causal band must be taken over
    every token, not from its first and last row (the review's fix of _split_keys)."""
    cap = 1024
    lengths = [300] * 3 if int_lens else [0, 70, cap - n_q]
    _gluon_latent_case(16, page, splits, n_q=n_q, lengths=lengths, cap=cap, int_lens=int_lens)


def _gluon_latent_case(h_q, page, splits, *, n_q, lengths, cap, int_lens=False):
    """One call of the Gluon latent decode (MLA_GLUON on, the plan must take it) against
    float64: `lengths` cached tokens an element before n_q new ones are appended, the
    cache rows past every length NaN (paged: also the spare pages)."""
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    import generated.mla_attn as mla
    from generated.mla_attn import _decode

    d, dv, n_new, batch = 576, 512, n_q, len(lengths)
    g = torch.Generator().manual_seed(1)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    if page:
        pages = cap // page
        k_cache = torch.randn(batch * pages + 5, page, 1, d, generator=g).to(**bf)
        table = torch.randperm(batch * pages + 5, generator=g)[:batch * pages]
        table = table.view(batch, pages).to(torch.int32).cuda()
        # what no call should read: the rows past each length (after the append)
        for b, n in enumerate(lengths):
            for j in range(n + n_new, cap):
                if j % page == 0 or j == n + n_new:
                    k_cache[int(table[b, j // page]), j % page:] = float("nan")
    else:
        k_cache = torch.randn(batch, cap, 1, d, generator=g).to(**bf)
        table = None
        for b, n in enumerate(lengths):
            k_cache[b, n + n_new:] = float("nan")
    v_cache = k_cache[..., :dv]
    k_new = torch.randn(batch, n_new, 1, d, generator=g).to(**bf)
    q = torch.randn(batch, n_q, h_q, d, generator=g).to(**bf)
    scale = 1.0 / math.sqrt(192)
    seqlens = lengths[0] if int_lens else torch.tensor(lengths, dtype=torch.int32, device="cuda")
    _decode._plans.clear()
    _decode.MLA_GLUON = True
    try:
        with torch.inference_mode():
            out, lse = mla.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new[..., :dv],
                                                   cache_seqlens=seqlens, block_table=table,
                                                   softmax_scale=scale, causal=True,
                                                   num_splits=splits, return_lse=True)
        torch.cuda.synchronize()
        plans = list(_decode._plans.values())
    finally:
        _decode.MLA_GLUON = True
        _decode._plans.clear()
    assert plans and all(p.mla is not None for p in plans), [p.mla_reason for p in plans]
    assert out.shape == (batch, n_q, h_q, dv)
    total = [n + n_new for n in lengths]
    ref_out, ref_lse = dec_reference(q, k_cache, v_cache, table, total, causal=True,
                                     score=lambda s: s * (scale * math.sqrt(d)))
    assert_decode_matches(out, lse, ref_out, ref_lse, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_gluon_latent_decode_falls_back():
    """With MLA_GLUON on, what the Gluon latent decode does not serve stays on `tl`, with a
    reason: pages of 32 rows, a V of its own (not K's view)."""
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    import generated.mla_attn as mla
    from generated.mla_attn import _decode

    bf = dict(dtype=torch.bfloat16, device="cuda")
    q = torch.randn(2, 1, 16, 576, **bf)
    paged = torch.randn(2 * 8, 32, 1, 576, **bf)
    table = torch.arange(16, dtype=torch.int32, device="cuda").view(2, 8)
    own_k = torch.randn(2, 256, 1, 576, **bf)
    own_v = torch.randn(2, 256, 1, 512, **bf)
    _decode._plans.clear()
    _decode.MLA_GLUON = True
    try:
        with torch.inference_mode():
            mla.flash_attn_with_kvcache(q, paged, paged[..., :512], cache_seqlens=100,
                                        block_table=table, causal=True)
            mla.flash_attn_with_kvcache(q, own_k, own_v, cache_seqlens=100, causal=True)
        reasons = [p.mla_reason for p in _decode._plans.values()]
    finally:
        _decode.MLA_GLUON = True
        _decode._plans.clear()
    assert len(reasons) == 2 and all(reasons), reasons
