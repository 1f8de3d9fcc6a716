"""The packages of the shipped specs for other GPUs (specs/gpus/: A100, RTX 4090) run on the
GPU at hand with the tiles the planner chose for *their* budget and architecture.

tests/test_offline_compile.py proves offline that those tiles fit the target's shared memory
and do not spill; this runs the same kernels (the `tl` family, the spec's planned launch
configs, not the runtime's re-plan for the GPU it finds) on the H100 against the float64
reference: forward, the three gradients and, with dropout, the exact keep mask. The smaller
tiles and the unpipelined pre-Hopper backward (num_stages 1) cross many blocks even at the
odd lengths used here.

GPU only (`pytest -m gpu`): the interpreter runs the same `tl` code in the other test files.
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, OUT_TOL
from flashgen.build import build
from flashgen.reference import attention_ref, visible_mask

ROOT = Path(__file__).resolve().parent.parent
SPECS = {"a100": "a100.yaml", "rtx4090": "rtx4090.yaml"}

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", params=sorted(SPECS))
def pkg(request, tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    out = tmp_path_factory.mktemp(request.param)
    build(ROOT / "specs" / "gpus" / SPECS[request.param], out)
    sys.path.insert(0, str(out))
    try:
        package = importlib.import_module(f"{request.param}_attn")
    finally:
        sys.path.remove(str(out))
    return package


@pytest.fixture
def planned_tiles(pkg, monkeypatch):
    """Every call of the package launches the spec's planned config (its target GPU's
    tiles), on the `tl` family: no tuning entry, no Gluon default, no re-plan for this GPU."""
    rt = pkg._runtime
    seen = []

    def planned(name, device, n):
        seen.append(name)
        return dict(rt.PLANNED[name])

    monkeypatch.setattr(rt, "launch_config", planned)
    rt._configs.clear()
    return seen


def _inputs(b, n_q, n_k, h_q, h_kv, d, dtype=torch.bfloat16):
    q = torch.randn(b, n_q, h_q, d, dtype=dtype, device="cuda", requires_grad=True)
    k, v = (torch.randn(b, n_k, h_kv, d, dtype=dtype, device="cuda", requires_grad=True)
            for _ in range(2))
    do = torch.randn(b, n_q, h_q, d, dtype=dtype, device="cuda")
    return q, k, v, do


def _reference(q, k, v, do, visible, keep=None, p=0.0):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2),
                           visible, keep=keep, dropout_p=p)
    out = out.transpose(1, 2)
    out.backward(do.double())
    return out.detach(), q64.grad, k64.grad, v64.grad


def _assert_all(got, ref, dtype=torch.bfloat16):
    for name, g, r, tol in zip(("out", "dq", "dk", "dv"), got, ref,
                               [OUT_TOL[dtype]] + [GRAD_TOL[dtype]] * 3):
        assert g is not None, f"{name} missing"
        assert not torch.isnan(g).any(), f"NaN in {name} (or an element never written)"
        torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=tol[0], rtol=tol[1],
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask", ["none", "causal", "window"])
@pytest.mark.parametrize("n_q,n_k,h_q,h_kv", [(257, 257, 4, 4), (127, 300, 8, 2), (59, 59, 8, 1)],
                         ids=["N257", "Nq127_Nk300_gqa4to1", "N59_gqa8to1"])
def test_planned_tiles_match_float64(pkg, planned_tiles, poison, d, mask, n_q, n_k, h_q, h_kv):
    causal = mask == "causal"
    window = (40, 0) if mask == "window" else (-1, -1)
    q, k, v, do = _inputs(3, n_q, n_k, h_q, h_kv, d)
    out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
    out.backward(do)
    kind = {"none": "", "causal": "causal_", "window": "window_"}[mask]
    assert {f"fwd_{kind}d{d}_bf16", f"bwd_{kind}d{d}_bf16"} <= set(planned_tiles)
    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
    _assert_all((out, q.grad, k.grad, v.grad), _reference(q, k, v, do, vis))


@pytest.mark.parametrize("d", [64, 128])
def test_planned_tiles_with_dropout_use_the_exact_mask(pkg, planned_tiles, poison, d):
    b, n_q, n_k, h_q, h_kv, p = 2, 190, 190, 4, 2, 0.2
    q, k, v, do = _inputs(b, n_q, n_k, h_q, h_kv, d)
    torch.manual_seed(7)
    out = pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
    out.backward(do)
    assert {f"fwd_causal_dropout_d{d}_bf16", f"bwd_causal_dropout_d{d}_bf16"} <= set(planned_tiles)
    torch.manual_seed(7)
    keep = pkg.dropout_mask(b, h_q, n_q, n_k, p, device="cuda")
    vis = visible_mask(n_q, n_k, causal=True, bottom_right=True)
    _assert_all((out, q.grad, k.grad, v.grad), _reference(q, k, v, do, vis, keep, p))


def test_planned_tiles_are_the_targets_not_the_h100s(pkg):
    """What this file runs is the other GPU's plan: the spec's arch and budget, a backward
    without software pipelining before Hopper, and tiles other than the H100 package's."""
    rt = pkg._runtime
    bwd = rt.PLANNED["bwd_causal_d128_bf16"]
    assert bwd["num_stages"] == 1, bwd
    llama = importlib.import_module("generated.llama_attn")
    assert rt.PLANNED["fwd_causal_d128_bf16"] != llama._runtime.PLANNED["fwd_causal_d128_bf16"]
