"""Head dims past 256 (Gemma 4's global layers: d = 512) in the `tl` kernels, against the
float64 reference: the forward's output and LSE, the backward's dQ, dK and dV, at d = 512
and at {qk: 512, v: 256} (V's own head dim), odd lengths, causal and not, GQA 4:1 and
batch 3. Most cases force small tiles (16 rows, several blocks even at N = 59); one each
runs the planner's tiles for the H100 (32 x 32: planner_core.warps_across_d).

The interpreter is slow at d = 512, so the shapes stay small (one or two heads)."""
import contextlib

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from flashgen import families
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

FWD_TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
BWD_TILES = dict(block_m=16, block_n=32, num_warps=4, num_stages=2)
PAIR = (512, 256)
# the planner's tiles for the H100 (block_m, block_n, warps, stages): under 64 rows Triton
# runs mma.sync, whose operand fragments count (planner_core.wide_regs_estimate)
PLANNED_H100 = {"fwd_d512_bf16": (32, 32, 8, 3), "fwd_causal_d512_bf16": (32, 32, 8, 3),
                "fwd_d512v256_bf16": (32, 32, 8, 3), "fwd_causal_d512v256_bf16": (32, 32, 8, 3),
                "bwd_d512_bf16": (16, 16, 8, 2), "bwd_causal_d512_bf16": (16, 16, 8, 2),
                "bwd_d512v256_bf16": (16, 16, 8, 2), "bwd_causal_d512v256_bf16": (16, 16, 8, 2)}


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("d512"), "fg_test_d512", """
        head_dims: [512, {qk: 512, v: 256}]
        dtypes: [bf16]
        masks: [none, causal]
        gqa: true
        """)


def inputs(b, n, h_q, h_kv, dims, device, grad=False):
    d, dv = dims
    q = torch.randn(b, n, h_q, d, dtype=torch.bfloat16, device=device)
    k = torch.randn(b, n, h_kv, d, dtype=torch.bfloat16, device=device)
    v = torch.randn(b, n, h_kv, dv, dtype=torch.bfloat16, device=device)
    return tuple(t.requires_grad_(grad) for t in (q, k, v))


def reference(q, k, v, causal):
    """(out, lse) in float64, (B, H, N, dv) and (B, H, N); the float64 leaves for autograd."""
    n_q, n_k = q.shape[1], k.shape[1]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    vis = visible_mask(n_q, n_k, causal=causal, bottom_right=True)
    out, lse = attention_ref(*(t.transpose(1, 2) for t in leaves), vis)
    return out, lse, leaves


def check_forward(pkg, device, b, n, h_q, h_kv, dims, causal, tiles):
    q, k, v = inputs(b, n, h_q, h_kv, dims, device)
    with pkg._runtime.override_config(**tiles) if tiles else contextlib.nullcontext():
        out, lse = pkg.flash_attn_func(q, k, v, causal=causal, return_lse=True)
    ref_out, ref_lse, _ = reference(q, k, v, causal)
    assert out.shape[-1] == dims[1]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol, rtol = OUT_TOL[torch.bfloat16]
    torch.testing.assert_close(out.transpose(1, 2).double().cpu(), ref_out, atol=atol, rtol=rtol)
    torch.testing.assert_close(lse.double().cpu(), ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def check_backward(pkg, device, b, n, h_q, h_kv, dims, causal, tiles):
    q, k, v = inputs(b, n, h_q, h_kv, dims, device, grad=True)
    do = torch.randn(b, n, h_q, dims[1], dtype=torch.bfloat16, device=device)
    with pkg._runtime.override_config(**tiles) if tiles else contextlib.nullcontext():
        pkg.flash_attn_func(q, k, v, causal=causal).backward(do)
    ref_out, _, leaves = reference(q, k, v, causal)
    ref_out.transpose(1, 2).backward(do.double().cpu())
    atol, rtol = GRAD_TOL[torch.bfloat16]
    for name, g, r in zip("qkv", (q.grad, k.grad, v.grad), leaves):
        assert not torch.isnan(g).any(), f"NaN in d{name} (or an element never written)"
        torch.testing.assert_close(g.double().cpu(), r.grad, atol=atol, rtol=rtol,
                                   msg=lambda m: f"d{name}: {m}")


CASES = [pytest.param(n, causal, id=f"N{n}-{'causal' if causal else 'full'}")
         for n in (1, 59, 127) for causal in (False, True)]


@pytest.mark.parametrize("n, causal", CASES)
def test_forward_d512(pkg, device, poison, n, causal):
    check_forward(pkg, device, 1, n, 2, 2, (512, 512), causal, FWD_TILES)


@pytest.mark.parametrize("n, causal", CASES)
def test_backward_d512(pkg, device, poison, n, causal):
    check_backward(pkg, device, 1, n, 2, 2, (512, 512), causal, BWD_TILES)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_v_head_dim_of_its_own(pkg, device, poison, causal):
    check_forward(pkg, device, 1, 59, 2, 1, PAIR, causal, FWD_TILES)
    check_backward(pkg, device, 1, 59, 2, 1, PAIR, causal, BWD_TILES)


def test_gqa_4to1_batch3(pkg, device, poison):
    check_forward(pkg, device, 3, 33, 4, 1, (512, 512), True, FWD_TILES)
    check_backward(pkg, device, 3, 33, 4, 1, (512, 512), True, BWD_TILES)


def test_planned_tiles(pkg, device, poison):
    """The registry's tiles for the spec's H100 (what a GPU without tuning data runs)."""
    planned = {name: (c["block_m"], c["block_n"], c["num_warps"], c["num_stages"])
               for name, c in pkg._registry.PLANNED.items() if "sdpa_mask" not in name}
    assert planned == PLANNED_H100, planned
    check_forward(pkg, device, 1, 127, 2, 2, (512, 512), True, None)
    check_backward(pkg, device, 1, 127, 2, 2, (512, 512), True, None)


def test_gluon_at_512_forward_and_backward_default(pkg):
    """Gluon's forward serves Q/K 512 (tests/test_gluon_d512.py: the (512, 256) kernel, twice
    at d = 512); the backward has a Gluon kernel too (bwd_d512.py.j2), the default unless
    FLASHGEN_GLUON_BWD_512=0 at import."""
    gluon = pkg._registry.GLUON
    assert {n for n in gluon if "d512" in n} == set(pkg._registry.VARIANTS)
    # (attn_mask, the sdpa_mask mod: `tl`, as every mod at Q/K 512)
    assert all(gluon[n] is None for n in gluon if "sdpa_mask" not in n), gluon
    assert families.gluon_reason("fwd", False, 512, "bf16") is None
    assert families.gluon_reason("bwd", False, 512, "bf16") is None
    assert families.gluon_by_default("fwd", False, 512)
    assert families.gluon_by_default("bwd", False, 512) == families.D512_BWD_ON
