"""Different head dims for Q/K and for V (DeepSeek MLA's 192/128): a spec entry
{qk: D, v: DV} builds kernels whose output and V have their own head dim, forward and
backward, with masks, dropout, GQA and mods; compared with the float64 reference.

The test sizes keep the MLA ratio's shape (a Q/K dim that is not a power of two, larger
than V's) at interpreter scale: {qk: 48, v: 32}, and {qk: 24, v: 40} the other way round."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import GRAD_TOL, OUT_TOL
from flashgen.errors import SpecError
from flashgen.spec import parse_spec
from flashgen.variants import variants_for
from packages import build_and_import

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
