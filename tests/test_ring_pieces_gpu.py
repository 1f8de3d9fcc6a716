"""The context-parallel call's pieces on one GPU (`-m gpu`): world size 1, no process group.

Zig-zag on one rank still cuts the sequence into two chunks, so the call runs real
kernels on pieces whose queries and keys start at global positions other than 0 (the
second chunk: N / 2), merges them through their LSE, and runs the backward piece by piece
against the global output and LSE -- the same arithmetic as a 2-GPU ring minus the NCCL
transfers (tests/test_ring_gpu.py, which needs 2 GPUs). Checked against float64:
  * position-based mods on the committed generated/mods_attn (bf16, d = 128, the Gluon
    kernels where they serve): ALiBi, softcap, window_sinks, prefix_lm -- each piece's
    kernels must see global q_idx / kv_idx (Q_POS / KV_POS);
  * the backward in K/V head groups (FLASHGEN_CP_HEAD_GROUPS) on generated/llama_attn,
    GQA 8:4, against one group: the same arithmetic per head;
  * a test package's fp32 d = 128 backward (the planner once chose a tile that needed
    262912 B of shared memory and did not launch);
  * a piece's dK/dV kept in fp32 by the Gluon backward (generated/llama_attn, d = 128).
"""
import sys
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from packages import build_and_import

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "generated"))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

from flashgen.reference import attention_ref  # noqa: E402
from ring_worker import mod_reference  # noqa: E402
from test_ring import piece_grads_keep_fp32  # noqa: E402


def _inputs(b, n, h, hk, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, n, heads, d, generator=g, device="cuda", dtype=dtype)
            for heads in (h, hk, hk, h)]


def _check(got, ref, tol, what):
    got, ref = got.double(), ref.double()
    assert not torch.isnan(got).any(), f"{what}: NaN"
    err = (got - ref).abs().max().item()
    bound = tol[0] + tol[1] * ref.abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


MOD_CASES = {
    "alibi": (dict(slope=[0.25, 0.5, 0.125, 1.0]), True),
    "softcap": (dict(cap=2.0), True),
    "window_sinks": (dict(sinks=3, window=200), False),
    "prefix_lm": (dict(prefix_len=[700, 300]), False),
}


@pytest.mark.parametrize("name,groups", [(name, "auto") for name in MOD_CASES]
                         + [("alibi", "2")])
def test_pieces_with_mods_at_global_positions(name, groups, monkeypatch):
    """(groups "2": the backward in two K/V head groups, each reading its own heads'
    slopes)"""
    import mods_attn as pkg

    monkeypatch.setenv("FLASHGEN_CP_HEAD_GROUPS", groups)
    kw, causal = MOD_CASES[name]
    # n / 2 = 500: the second chunk's pieces start at a position that is not a multiple of
    # 16, after pieces at 0 of the same shape (one launch plan): a kernel specialised on
    # Q_POS / KV_POS (divisibility, == 1) would reuse the first piece's binary
    b, n, h, hk, d = 2, 1000, 4, 2, 128
    q, k, v, do = _inputs(b, n, h, hk, d, torch.bfloat16)
    mod_kw = {"mods": (name,)}
    for key, value in kw.items():
        mod_kw[key] = (torch.tensor(value, device="cuda",
                                    dtype=torch.int32 if key == "prefix_len" else torch.float32)
                       if isinstance(value, list) else value)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = pkg.ring_flash_attn_func(q, k, v, causal=causal, return_lse=True, **mod_kw)
    grads = torch.autograd.grad(out, (q, k, v), do)

    # (the reference on the CPU, where mod_reference builds its index grids)
    score_mod, visible = mod_reference(mod_kw, n)
    if causal:
        visible = visible & torch.ones(n, n, dtype=torch.bool).tril()
    rq, rk, rv = (t.detach().cpu().double().transpose(1, 2).requires_grad_()
                  for t in (q, k, v))
    r_out, r_lse = attention_ref(rq, rk, rv, visible, score_mod=score_mod)
    r_grads = torch.autograd.grad(r_out, (rq, rk, rv), do.cpu().double().transpose(1, 2))
    out, lse, grads = out.cpu(), lse.cpu(), [t.cpu() for t in grads]
    _check(out, r_out.transpose(1, 2), OUT_TOL[torch.bfloat16], f"{name} out")
    finite = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse), finite), f"{name}: LSE -inf pattern"
    _check(lse[finite], r_lse[finite], LSE_TOL, f"{name} lse")
    for what, a, r in zip(("dq", "dk", "dv"), grads, r_grads):
        _check(a, r.transpose(1, 2), GRAD_TOL[torch.bfloat16], f"{name} {what}")


def test_head_groups_match_one_group(monkeypatch):
    import llama_attn as pkg

    q, k, v, do = _inputs(1, 4096, 8, 4, 128, torch.bfloat16, seed=1)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    results = []
    for groups in ("1", "2", "4"):
        monkeypatch.setenv("FLASHGEN_CP_HEAD_GROUPS", groups)
        out = pkg.ring_flash_attn_func(q, k, v, causal=True)
        results.append(torch.autograd.grad(out, (q, k, v), do))
    for groups, grads in zip(("2", "4"), results[1:]):
        for what, a, b in zip(("dq", "dk", "dv"), grads, results[0]):
            # each head's pieces and sums are the same; dQ's fp32 sum is reduce-added by
            # the kernel's programs in whatever order they finish
            _check(a, b, (1e-2, 1e-2), f"{groups} groups {what}")


@pytest.fixture(scope="module")
def fp32_pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("fp32_d128"), "fg_test_fp32_d128", """
        head_dims: [128]
        dtypes: [fp32]
        masks: [causal]
        gqa: true
        """)


@pytest.mark.parametrize("n", [257, 1024])
def test_fp32_d128_backward_launches_and_matches(fp32_pkg, n):
    q, k, v, do = _inputs(1, n, 4, 2, 128, torch.float32, seed=2)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fp32_pkg.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    visible = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    rq, rk, rv = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    r_out, _ = attention_ref(rq, rk, rv, visible)
    r_grads = torch.autograd.grad(r_out, (rq, rk, rv), do.double().transpose(1, 2))
    _check(out, r_out.transpose(1, 2), OUT_TOL[torch.float32], "fp32 out")
    for what, a, r in zip(("dq", "dk", "dv"), grads, r_grads):
        _check(a, r.transpose(1, 2), GRAD_TOL[torch.float32], f"fp32 {what}")


def test_pieces_with_dropout_draw_the_single_call_mask():
    """Dropout at world size 1: the pieces (the second chunk at global row / column
    N / 2) must drop exactly the elements the single call drops from the same generator
    state, so output and gradients agree up to the merge's rounding."""
    import gpt2_attn as pkg  # (the shipped spec with dropout: d = 64)

    q, k, v, do = _inputs(2, 2048, 8, 8, 64, torch.bfloat16, seed=3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    results = []
    for fn in (pkg.flash_attn_func, pkg.ring_flash_attn_func):
        torch.manual_seed(7)
        out = fn(q, k, v, causal=True, dropout_p=0.2)
        results.append((out, *torch.autograd.grad(out, (q, k, v), do)))
    torch.manual_seed(7)
    other = pkg.flash_attn_func(q, k, v, causal=True, dropout_p=0.2)
    torch.manual_seed(8)
    assert not torch.equal(other, pkg.flash_attn_func(q, k, v, causal=True, dropout_p=0.2)), \
        "another seed must drop other elements (or this test could not fail)"
    for what, a, b in zip(("out", "dq", "dk", "dv"), results[1], results[0]):
        _check(a, b, OUT_TOL[torch.bfloat16] if what == "out" else GRAD_TOL[torch.bfloat16],
               f"dropout {what}")


@pytest.fixture(scope="module")
def dropout_d128_pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("dropout_d128"), "fg_test_ring_drop128", """
        head_dims: [128]
        dtypes: [bf16]
        masks: [none, causal]
        dropout: true
        gqa: true
        """)


def test_gluon_dropout_forward_pieces_draw_the_single_call_mask(dropout_d128_pkg):
    """The Gluon dropout forward (d > 64, opt-in) at the second chunk's global position:
    the forward (the backward is the `tl` family's) against the single call's, from the
    same generator state, and against a float64 reference with the replayed mask."""
    pkg = dropout_d128_pkg
    rt = pkg._runtime
    b, n, h, hk, d, p = 2, 2048, 4, 2, 128, 0.15
    q, k, v, _ = _inputs(b, n, h, hk, d, torch.bfloat16, seed=4)
    outs = []
    rt._forward_plans.clear()
    with rt.override_config(family="gluon"):
        for fn in (pkg.flash_attn_func, pkg.ring_flash_attn_func):
            torch.manual_seed(9)
            outs.append(fn(q, k, v, causal=True, dropout_p=p))
        kinds = {type(pl[0].fn).__name__ for pl in rt._forward_plans.values()
                 if pl[0] is not None}
        assert kinds == {"GluonJITFunction"}, kinds
    torch.manual_seed(9)
    keep = pkg.dropout_mask(b, h, n, n, p, device="cuda")
    visible = torch.ones(n, n, dtype=torch.bool, device="cuda").tril()
    ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), visible,
                           keep=keep, dropout_p=p)
    _check(outs[1], outs[0], OUT_TOL[torch.bfloat16], "gluon dropout ring vs single")
    _check(outs[1], ref.transpose(1, 2), OUT_TOL[torch.bfloat16], "gluon dropout ring vs float64")


def test_piece_grads_keep_fp32():
    """The Gluon backward stores an fp32 dK/dV from registers (no TMA through 16-bit K/V
    slots): the same accumulators as the 16-bit call, before its rounding."""
    import llama_attn as pkg

    piece_grads_keep_fp32(pkg, "cuda", 128)
