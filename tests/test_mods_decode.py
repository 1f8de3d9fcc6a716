"""Mods in the decode kernels (flash_attn_with_kvcache(..., mods=...)): score mods, mask
mods and sinks against a float64 reference over the cache, with one split and several
(the sink joins the split-KV reduction once), contiguous and paged caches. In decode,
q_idx is a query's cache position and h the query head of each stacked row."""
from __future__ import annotations

import math

import pytest
import torch

from packages import build_and_import


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("modsdec"), "fg_test_mods_decode", """
        head_dims: [32]
        dtypes: [fp32]
        masks: [none, causal]
        gqa: true
        decode: true
        mods:
          softcap: {builtin: softcap, params: {cap: 2.0}}
          alibi: {builtin: alibi}
          document: {builtin: document}
          sinks: {builtin: sink_logits}
        variants:
          - {mask: causal, mods: [softcap]}
          - {mask: causal, mods: [alibi]}
          - {mask: causal, mods: [document, softcap]}
          - {mask: causal, mods: [sinks]}
        """)


def reference(q, k, v, lens, *, score=None, mask=None, sink=None):
    """q (B, Nq, H, d), cache k/v (B, N, Hkv, d), lens (B,) keys per element; query i of
    element b sits at position lens[b] - Nq + i, causal."""
    b_, n_q, h, d = q.shape
    group = h // k.shape[2]
    out = torch.zeros(b_, n_q, h, d, dtype=torch.float64)
    for b in range(b_):
        n = int(lens[b])
        kk = k[b, :n].double().repeat_interleave(group, 1).transpose(0, 1)  # (H, n, d)
        vv = v[b, :n].double().repeat_interleave(group, 1).transpose(0, 1)
        qq = q[b].double().transpose(0, 1)  # (H, Nq, d)
        s = qq @ kk.transpose(-1, -2) / math.sqrt(d)  # (H, Nq, n)
        i = torch.arange(n - n_q, n)[:, None]
        j = torch.arange(n)[None, :]
        hh = torch.arange(h)[:, None, None]
        if score is not None:
            s = score(s, b, hh, i, j)
        vis = (j <= i).expand(h, n_q, n)
        if mask is not None:
            vis = vis & mask(b, hh, i, j)
        s = s.masked_fill(~vis, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink.double()[:, None, None].expand(h, n_q, 1)], -1)
        p = torch.nan_to_num(torch.softmax(s, -1), nan=0.0)
        if sink is not None:
            p = p[..., :-1]
        out[b] = (p @ vv).transpose(0, 1)
    return out


def cache(b=3, n=70, h_kv=2, d=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, n, h_kv, d, generator=g)
    v = torch.randn(b, n, h_kv, d, generator=g)
    lens = torch.tensor([70, 33, 5], dtype=torch.int32)[:b]
    return g, k, v, lens


@pytest.mark.parametrize("splits", [1, 3], ids=["one-split", "three-splits"])
@pytest.mark.parametrize("case", ["softcap", "alibi", "document+softcap", "sinks"])
def test_decode_with_mods(pkg, case, splits):
    g, k, v, lens = cache()
    q = torch.randn(3, 2, 4, 32, generator=g)  # two new query tokens, GQA 2:1
    doc = torch.sort(torch.randint(0, 3, (3, 70), generator=g), -1).values.to(torch.int32)
    slope = torch.tensor([0.3, 0.1, 0.05, 0.02])
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    kw, ref_kw = {}, {}
    if case == "softcap":
        kw = dict(mods=("softcap",))
        ref_kw = dict(score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0))
    elif case == "alibi":
        kw = dict(mods=("alibi",), slope=slope)
        ref_kw = dict(score=lambda s, b, h, i, j: s - slope.double()[h] * (i - j).abs())
    elif case == "document+softcap":
        kw = dict(mods=("document", "softcap"), doc=doc, cap=3.0)
        d_ = doc.long()
        ref_kw = dict(score=lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0),
                      mask=lambda b, h, i, j: d_[b, i] == d_[b, j])
    else:
        kw = dict(mods=("sinks",), sinks=sinks)
        ref_kw = dict(sink=sinks)
    with pkg._runtime.override_config(block_m=16, block_n=16, num_warps=4, num_stages=1):
        out, lse = pkg.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                               num_splits=splits, return_lse=True, **kw)
    ref = reference(q, k, v, lens, **ref_kw)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)


def test_decode_mods_paged_cache_and_bad_tensor(pkg):
    g, k, v, lens = cache()
    q = torch.randn(3, 1, 4, 32, generator=g)
    page = 16
    pages = -(-70 // page)
    k_pages = torch.zeros(3 * pages, page, 2, 32)
    v_pages = torch.zeros(3 * pages, page, 2, 32)
    table = torch.randperm(3 * pages, generator=g).view(3, pages).to(torch.int32)
    for b in range(3):
        for p in range(pages):
            rows = slice(p * page, min((p + 1) * page, 70))
            n = rows.stop - rows.start
            k_pages[table[b, p], :n] = k[b, rows]
            v_pages[table[b, p], :n] = v[b, rows]
    slope = torch.tensor([0.3, 0.1, 0.05, 0.02])
    with pkg._runtime.override_config(block_m=16, block_n=16, num_warps=4, num_stages=1):
        out = pkg.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens,
                                          block_table=table, causal=True, num_splits=2,
                                          mods=("alibi",), slope=slope)
    ref = reference(q, k, v, lens, score=lambda s, b, h, i, j: s - slope.double()[h] * (i - j).abs())
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=3e-5)
    # a repeated call reuses its plan (two lookups, no re-planning) and gives the same result
    plans = len(pkg._decode._plans)
    with pkg._runtime.override_config(block_m=16, block_n=16, num_warps=4, num_stages=1):
        again = pkg.flash_attn_with_kvcache(q, k_pages, v_pages, cache_seqlens=lens,
                                            block_table=table, causal=True, num_splits=2,
                                            mods=("alibi",), slope=slope)
    assert len(pkg._decode._plans) == plans
    assert torch.equal(again, out)
    # doc ids must cover the cache's positions (its capacity), not only the new tokens
    with pytest.raises(ValueError, match=r"`doc` has shape \(3, 2\)"):
        pkg.flash_attn_with_kvcache(q, k, v, cache_seqlens=lens, causal=True,
                                    mods=("document", "softcap"),
                                    doc=torch.zeros(3, 2, dtype=torch.int32))
