"""The Gluon (Hopper) backward with mods: score mods (the chain rule through d(mod)/d(score)
on dS^T), mask mods (the transposed block lists, the mask in partial blocks) and sinks (D
back to the host for the sink's gradient).

On the CPU: which backward variants of specs/mods.yaml get a Gluon kernel and why the
others do not; the runtime's wiring, with the Gluon launch replaced by a recorder (every
argument the kernel's signature declares, the block lists of its tile, the sink's gradient
from the returned D, the `tl` fallback for a mod tensor whose gradient is wanted); the
offline sm_90 compile of every such kernel (resources in the assertions). On the GPU (-m
gpu): every mod's dq, dk, dv (and the sink's gradient) against float64 autograd, odd
shapes, Nq != Nk, GQA 4:1, batch 3, rows that see no key, with a check that the Gluon
backward is what ran; the persistent block-mask form, and its work counter, which each
launch leaves at 0 (back-to-back calls at two shapes, replays of a CUDA graph).
"""
from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL
from packages import build_and_import, gluon_compiles
from test_mods import documents, reference

from flashgen import families

ROOT = Path(__file__).resolve().parent.parent

# the backward variants of specs/mods.yaml the Gluon kernel serves (mods, causal)
SERVED = {
    "softcap": (("softcap",), True),
    "alibi": (("alibi",), True),
    "document": (("document",), True),
    "document_softcap": (("document", "softcap"), True),
    "prefix_lm": (("prefix_lm",), False),
    "window_sinks": (("window_sinks",), False),
    "sink_logits": (("sink_logits",), True),
    "softcap_key_padding": (("softcap", "key_padding"), True),
}


def _bwd_name(mods, causal, d=128, dtype="bf16"):
    return f"bwd_{'causal_' if causal else ''}{'_'.join(mods)}_d{d}_{dtype}"


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    body = body.replace("decode: true", "decode: false")
    return build_and_import(tmp_path_factory.mktemp("gbwd_mods"), "fg_gbwd_mods", body)


def _kernel_text(pkg, name):
    return (Path(pkg.__file__).parent / "kernels" / "gluon" / f"{name}.py").read_text()


# ---------------------------------------------------------------------------------------
# which variants, what is rendered
# ---------------------------------------------------------------------------------------
def test_backward_mod_variants_with_a_gluon_kernel(pkg):
    reasons = pkg._registry.GLUON
    for mods, causal in SERVED.values():
        for d in (64, 128):
            for dt in ("bf16", "fp16"):
                assert reasons[_bwd_name(mods, causal, d, dt)] is None
    # a tensor with a gradient (the bias behind attn_mask): the `tl` dK/dV kernel writes it
    assert "gradient" in reasons["bwd_sdpa_mask_d128_bf16"]
    assert "gradient" in reasons["bwd_softcap_sdpa_mask_d128_bf16"]
    # a [q, kv] gather: `tl`, as in the forward
    assert "[q, kv] tile" in reasons["bwd_relative_bias_d128_bf16"]
    # the forward with a mask mod has its Gluon kernel too (block-sparse, tests/test_gluon.py)
    assert reasons["fwd_causal_document_d128_bf16"] is None


def test_rendered_mods(pkg):
    soft = _kernel_text(pkg, "bwd_causal_softcap_d128_bf16")
    # the chain rule: the derivative (a 16-bit kernel's tanh from _fastmath) multiplies P^T,
    # guarded
    assert "pt = gl.where(pt == 0.0, 0.0, pt * (" in soft and "_tanh(" in soft
    assert "dst = gl.where(dpt == 0.0, 0.0, pt * dpt) * SCALE" in soft
    assert "FULL_CNT" not in soft
    # ALiBi's derivative is 1: nothing to multiply
    alibi = _kernel_text(pkg, "bwd_causal_alibi_d128_bf16")
    assert "T_slope" in alibi and "pt * dpt" not in alibi
    # a mask mod: the lists, walked by the producer and the consumers, the mask in partial
    # blocks only
    doc = _kernel_text(pkg, "bwd_causal_document_d128_bf16")
    assert doc.count("_listed_block(FULL_IDX, PART_IDX, bm_row, i, n_full, N_Q, BM_NQB, BLOCK_M, VARLEN)") == 2
    assert "if i >= n_full:" in doc and "T_doc" in doc
    assert "= _query_range(" not in doc
    # the plain kernel of the same package takes none of it
    plain = _kernel_text(pkg, "bwd_causal_d128_bf16")
    for word in ("FULL_CNT", "score = st", "dpt == 0.0", "_listed_block", "q_idx"):
        assert word not in plain


# ---------------------------------------------------------------------------------------
# the runtime's wiring, the Gluon launch recorded instead of run (no GPU here)
# ---------------------------------------------------------------------------------------
def _runtime_params(text, name):
    """The run-time (not constexpr) parameters of `<name>_kernel` in a rendered module."""
    fn = next(n for n in ast.parse(text).body
              if isinstance(n, ast.FunctionDef) and n.name == f"{name}_kernel")
    return [a.arg for a in fn.args.args
            if not (a.annotation is not None and ast.unparse(a.annotation) == "gl.constexpr")]


class _Recorder:
    """Stands in for a @gluon.jit kernel: kernel[grid](*args, **meta) is recorded."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.calls.append((grid, args, meta))
        return launch


def _wired(pkg, monkeypatch):
    rt = pkg._runtime
    rec = _Recorder()
    real = rt.kernel
    monkeypatch.setattr(rt, "kernel", lambda name, function="kernel", family="tl": (
        rec if family == "gluon" else real(name, function, family)))
    monkeypatch.setattr(rt, "gluon_call_reason", lambda *a: None)  # no Hopper here
    rt._backward_plans.clear()
    return rt, rec


@pytest.mark.parametrize("case", sorted(SERVED))
def test_backward_launch_passes_what_the_kernel_declares(pkg, monkeypatch, case):
    """Every run-time parameter of the rendered kernel gets an argument, in order: the
    mods' tensors and params, then (mask mods) the lists of the kernel's own tile,
    transposed -- the very tensors the block-mask cache holds for them."""
    mods, causal = SERVED[case]
    rt, rec = _wired(pkg, monkeypatch)
    b, n, h, d = 2, 150, 4, 128
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, n, h, d, generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    kw = {"cap": 20.0, "slope": torch.rand(h), "doc": documents(b, n, "cpu"),
          "prefix_len": torch.tensor([7, 90], dtype=torch.int32),
          "sinks": torch.randn(h), "keep": torch.rand(b, n) > 0.2}
    if case == "window_sinks":
        kw["sinks"], kw["window"] = 4, 50
    accepted = {a for m in mods for a in [t for t, _, _ in pkg._registry.MODS[m]["tensors"]]
                + list(pkg._registry.MODS[m]["params"])}
    kw = {a: x for a, x in kw.items() if a in accepted}
    out = pkg.flash_attn_func(q, k, v, causal=causal, mods=mods, **kw)
    # the fp32 dQ sum starts as NaN: only the preprocess's zeroing (ZERO_DQ, at the sum's
    # own strides) makes it 0, and the recorded kernel adds nothing to it
    empty_strided = torch.empty_strided
    monkeypatch.setattr(torch, "empty_strided",
                        lambda *a, **k_: empty_strided(*a, **k_).fill_(float("nan")))
    with rt.override_config(family="gluon"):
        out.backward(torch.randn_like(out))
    monkeypatch.setattr(torch, "empty_strided", empty_strided)
    assert torch.equal(q.grad, torch.zeros_like(q.grad)), "the preprocess left the dQ sum unzeroed"
    name = _bwd_name(mods, causal)
    assert len(rec.calls) == 1, "the Gluon backward did not run"
    grid, args, meta = rec.calls[0]
    params = _runtime_params(_kernel_text(pkg, name), name)
    assert len(args) == len(params), (params, len(args))
    assert meta["BLOCK_M"] == families.GLUON_BWD_DEFAULT["block_m"]
    call = pkg._mods.prepare(mods, kw, b, h, n, n, torch.device("cpu"))
    got = dict(zip(params, args))
    mod_args = dict(zip([p for p in params if p.startswith(("T_", "P_"))], call.args))
    for p, x in mod_args.items():
        if isinstance(x, torch.Tensor):  # a bool tensor is passed as a fresh int8 view
            assert torch.equal(got[p], x) and got[p].data_ptr() == x.data_ptr(), p
        else:
            assert got[p] == x, p
    if pkg._registry.MOD_COMBOS["+".join(mods)]["block_sparse"]:
        lo, hi = args[params.index("LO_OFF")], args[params.index("HI_OFF")]
        fwd = name.replace("bwd_", "fwd_", 1)
        lists = call.sparse(fwd, meta["BLOCK_M"], meta["BLOCK_N"], True, lo, hi)
        for p, want in zip(("FULL_CNT", "FULL_IDX", "PART_CNT", "PART_IDX", "BM_SB", "BM_SH"),
                           lists):
            if isinstance(want, torch.Tensor):
                assert got[p] is want, f"{p}: not the cached list of the kernel's tile"
                # per key block (transposed), one row per query block of BLOCK_M rows
                assert want.shape[-2 if want.dim() == 3 else -1] == -(-n // meta["BLOCK_N"])
            else:
                assert got[p] == want, p
    else:
        assert "FULL_CNT" not in params


def test_sink_gradient_comes_from_the_gluon_backwards_d(pkg, monkeypatch):
    """The sink's gradient is computed on the host from D, which the Gluon path returns
    now (its rows padded for TMA, sliced back)."""
    rt, rec = _wired(pkg, monkeypatch)
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 70, 4, 128, generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    sinks = torch.randn(4, generator=g).requires_grad_()
    out = pkg.flash_attn_func(q, k, v, causal=True, mods=("sink_logits",), sinks=sinks)
    with rt.override_config(family="gluon"):
        out.backward(torch.randn_like(out))
    assert len(rec.calls) == 1
    assert sinks.grad is not None and torch.isfinite(sinks.grad).all()
    assert sinks.grad.abs().sum() > 0


def test_a_wanted_mod_tensor_gradient_keeps_the_tl_backward(pkg, monkeypatch):
    """A call whose mod tensor wants its gradient takes the `tl` backward, which writes it
    (the variants with such a tensor have no Gluon backward at all; this is the call-time
    guard behind that)."""
    rt = pkg._runtime
    monkeypatch.setattr(rt, "gluon_call_reason", lambda *a: None)
    q = torch.randn(1, 2, 64, 128, dtype=torch.bfloat16)

    class Call:
        grad_buffers = None
    with rt.override_config(family="gluon"):
        assert rt.gluon_backward_reason("bwd_d128_bf16", q, q, q, q, "none", Call()) is None
        Call.grad_buffers = {"bias": torch.zeros(1)}
        why = rt.gluon_backward_reason("bwd_d128_bf16", q, q, q, q, "none", Call())
    assert "gradient" in why and "bias" in why


# ---------------------------------------------------------------------------------------
# sm_90 compile, offline
# ---------------------------------------------------------------------------------------
_COMPILE = r"""
import json, sys
from pathlib import Path
from flashgen import gluon_compile, families
res = gluon_compile.compile_package(Path(sys.argv[1]),
                                    configs=[{**families.GLUON_BWD_DEFAULT, "kind": "bwd"}],
                                    variants=sys.argv[2].split(","))
print(json.dumps([r.__dict__ for r in res]))
"""


@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on Triton 3.6")
def test_gluon_backwards_with_mods_compile_for_sm90(pkg):
    """Every served mod backward compiles for sm_90 into the design (wgmma, the 240/24
    split, shared memory within 227 KiB: 198176-198240 B at d=128, ~116300 at d=64) at the
    default tile (64 x 128, 2-deep ring), with the stack frames STACK records."""
    names = [_bwd_name(m, c) for m, c in SERVED.values()] + ["bwd_prefix_lm_d64_fp16"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(Path(pkg.__file__).parent),
                          ",".join(names)], capture_output=True, text=True, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    assert set(rows) == set(names)
    for name, r in rows.items():
        assert r["wgmma"] > 0 and r["shared"] <= 232448, r
        assert families.CONSUMER_REGS in r["setmaxnreg"], r
        assert families.PRODUCER_REGS in r["setmaxnreg"], r
        assert r["spill_bytes"] <= STACK.get(re.sub(r"_d\d+_\w+$", "", name), 32), r


# Stack frame bytes allowed per variant at d=128 (the d=64 kernels measured 0-24): measured
# with Triton 3.6.0, rounded up. The plain d=128 backward takes 32 B; its dK and dV
# accumulators leave a consumer ~16 free registers of its 240, so whatever a mod adds to a
# step pushes loop scalars (and, with a mask mod's loads beside a score mod, a few values of
# the step) to the stack: the block lists' walk alone measured 96 B (window_sinks without
# its mask), the mask +32, a softcap and its derivative +160. Whether that costs time is
# for the GPU run (.scratch/gpu_check.sh's bench).
STACK = {
    "bwd_causal_softcap": 192,  # measured 192
    "bwd_causal_alibi": 136,  # 128 with the fp32 index vectors (104 converting per score)
    "bwd_causal_document": 208,  # 208 (d=64: 16)
    "bwd_causal_document_softcap": 432,  # 424
    "bwd_prefix_lm": 120,  # 120 since the global positions (Q_POS) joined, 112 before (d=64 fp16: 0)
    "bwd_window_sinks": 128,  # 128
    "bwd_causal_sink_logits": 32,  # 32, the plain kernel's: the sink is host-side
    "bwd_causal_softcap_key_padding": 336,  # 328
}


# ---------------------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _bwd_plan_kinds(pkg):
    return {"gluon" if p is not None and p[7] == pkg._runtime._BWD_GLUON else "tl"
            for p in pkg._runtime._backward_plans.values()}


def _gpu_check(pkg, mods, kw, *, causal, b, n_q, n_k, h, h_kv, d, dtype, score=None,
               mask=None, sink=None, dead_rows=None, knobs=None):
    """dq, dk, dv (and the sink's gradient) of the Gluon backward against float64
    autograd through test_mods.reference; NaN fails; `dead_rows` (batch, rows) see no key
    and must get exactly zero dq. knobs: config keys for override_config (persistent_bwd:
    the persistent form must be what ran). Returns (dq, dk, dv)."""
    knobs = dict(knobs or {})
    g = torch.Generator().manual_seed(7)
    q = torch.randn(b, n_q, h, d, generator=g).cuda().to(dtype).requires_grad_()
    k = torch.randn(b, n_k, h_kv, d, generator=g).cuda().to(dtype).requires_grad_()
    v = torch.randn(b, n_k, h_kv, d, generator=g).cuda().to(dtype).requires_grad_()
    rt = pkg._runtime
    rt._backward_plans.clear()
    with rt.override_config(family="gluon", **knobs):
        out = pkg.flash_attn_func(q, k, v, causal=causal, mods=mods, **kw)
        dout = torch.randn(out.shape, generator=g).cuda().to(dtype)
        out.backward(dout)
        assert _bwd_plan_kinds(pkg) == {"gluon"}, "the Gluon backward did not run"
        # only a block mask (the plan's lists, p[11]) has a persistent form
        for p in rt._backward_plans.values():
            if p is not None:
                want = p[11] is not None and rt._gluon_bwd_persistent(knobs)
                assert (p[10] == rt._BWD_PERSISTENT) == want, (knobs, p[11])
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    sink_leaf = None
    if sink is not None:
        sink_leaf = kw[sink].detach().cpu().double().requires_grad_()
    ref, _ = reference(*leaves, causal=causal, score=score, mask=mask, sink=sink_leaf)
    want = torch.autograd.grad(ref, leaves + ([sink_leaf] if sink_leaf is not None else []),
                               dout.cpu().double())
    atol, rtol = GRAD_TOL[dtype]
    got = [q.grad, k.grad, v.grad] + ([kw[sink].grad] if sink is not None else [])
    for name, gr, r in zip(("dq", "dk", "dv", "dsink"), got, want):
        assert gr is not None and not torch.isnan(gr).any(), f"NaN in {name}"
        torch.testing.assert_close(gr.double().cpu(), r, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{name}: {m}")
    if dead_rows is not None:
        bi, rows = dead_rows
        assert torch.equal(q.grad[bi, rows], torch.zeros_like(q.grad[bi, rows]))
    return q.grad, k.grad, v.grad


def _skip_unless_hopper():
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")


def _soft(cap):
    return lambda s, b, h, i, j: cap * torch.tanh(s / cap)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, dtype)
    (3, 257, 257, 8, 2, 128, torch.bfloat16),
    (2, 127, 259, 4, 4, 64, torch.float16),
    (1, 1031, 1031, 4, 1, 128, torch.bfloat16),
], ids=["b3-gqa4-257", "d64-nq<nk", "1031-gqa4"])
def test_gluon_softcap_backward(pkg, poison, case):
    _skip_unless_hopper()
    b, nq, nk, h, hkv, d, dt = case
    _gpu_check(pkg, ("softcap",), {"cap": 5.0}, causal=True, b=b, n_q=nq, n_k=nk, h=h,
               h_kv=hkv, d=d, dtype=dt, score=_soft(5.0))


@pytest.mark.gpu
def test_gluon_alibi_backward(pkg, poison):
    _skip_unless_hopper()
    slope = torch.tensor([2.0 ** (-(i + 1)) for i in range(8)], device="cuda")
    sl = slope.cpu().double()
    _gpu_check(pkg, ("alibi",), {"slope": slope}, causal=True, b=3, n_q=59, n_k=59, h=8,
               h_kv=2, d=128, dtype=torch.bfloat16,
               score=lambda s, b, h, i, j: s - sl[h] * (i - j).abs())


@pytest.mark.gpu
@pytest.mark.parametrize("n, h, hkv, d, dt", [(257, 8, 2, 128, torch.bfloat16),
                                               (1000, 4, 1, 64, torch.float16)],
                         ids=["257-gqa4", "1000-d64"])
def test_gluon_document_backward(pkg, poison, n, h, hkv, d, dt):
    _skip_unless_hopper()
    doc = documents(3, n, "cuda")
    dd = doc.cpu().long()
    _gpu_check(pkg, ("document",), {"doc": doc}, causal=True, b=3, n_q=n, n_k=n, h=h,
               h_kv=hkv, d=d, dtype=dt, mask=lambda b, h, i, j: dd[b, i] == dd[b, j])


@pytest.mark.gpu
def test_gluon_document_softcap_backward(pkg, poison):
    _skip_unless_hopper()
    doc = documents(2, 777, "cuda", seed=3)
    dd = doc.cpu().long()
    _gpu_check(pkg, ("document", "softcap"), {"doc": doc, "cap": 5.0}, causal=True, b=2,
               n_q=777, n_k=777, h=4, h_kv=1, d=128, dtype=torch.bfloat16, score=_soft(5.0),
               mask=lambda b, h, i, j: dd[b, i] == dd[b, j])


@pytest.mark.gpu
def test_gluon_prefix_lm_backward(pkg, poison):
    _skip_unless_hopper()
    prefix = torch.tensor([5, 200, 90], dtype=torch.int32, device="cuda")
    p = prefix.cpu().long()
    _gpu_check(pkg, ("prefix_lm",), {"prefix_len": prefix}, causal=False, b=3, n_q=257,
               n_k=257, h=8, h_kv=2, d=128, dtype=torch.bfloat16,
               mask=lambda b, h, i, j: (j < p[b]) | (j <= i))


@pytest.mark.gpu
def test_gluon_window_sinks_backward(pkg, poison):
    _skip_unless_hopper()
    _gpu_check(pkg, ("window_sinks",), {"sinks": 4, "window": 100}, causal=False, b=2,
               n_q=1031, n_k=1031, h=8, h_kv=2, d=128, dtype=torch.bfloat16,
               mask=lambda b, h, i, j: (j <= i) & ((j < 4) | (i - j <= 100)))


@pytest.mark.gpu
def test_gluon_softcap_key_padding_backward_with_dead_rows(pkg, poison):
    """Left padding of batch 1 hides every key from its first queries (bottom-right causal,
    Nq < Nk): those rows' dq is exactly 0."""
    _skip_unless_hopper()
    keep = torch.ones(2, 259, dtype=torch.bool)
    keep[0, 200:] = False
    keep[1, :150] = False
    _gpu_check(pkg, ("softcap", "key_padding"), {"keep": keep.cuda(), "cap": 5.0},
               causal=True, b=2, n_q=127, n_k=259, h=8, h_kv=2, d=128, dtype=torch.float16,
               score=_soft(5.0), mask=lambda b, h, i, j: keep[b, j],
               dead_rows=(1, slice(0, 18)))


@pytest.mark.gpu
def test_gluon_sink_logits_backward(pkg, poison):
    _skip_unless_hopper()
    sinks = torch.tensor([0.7, -1.5, 2.0, 0.0, 1.0, -0.5, 3.0, -2.0], device="cuda")
    sinks.requires_grad_()
    _gpu_check(pkg, ("sink_logits",), {"sinks": sinks}, causal=True, b=3, n_q=257, n_k=257,
               h=8, h_kv=2, d=128, dtype=torch.bfloat16, sink="sinks")


# ---------------------------------------------------------------------------------------
# the persistent form of the block-mask backward (GLUON_BWD_PERSISTENT_MASKS, on by
# default since its first H100 run: docs/PERFORMANCE.md, Mods)
# ---------------------------------------------------------------------------------------
def test_persistent_backward_is_on_by_default(pkg):
    """The H100 A/B (docs/PERFORMANCE.md, Mods) measured it at d=128 and 64; the tuned and
    default configs carry no key of their own, so the switch decides."""
    rt = pkg._runtime
    assert rt.GLUON_BWD_PERSISTENT_MASKS is True
    assert families.GLUON_BWD_DEFAULT.get("persistent_bwd") is None
    assert rt._gluon_bwd_persistent({}) and not rt._gluon_bwd_persistent({"persistent_bwd": False})
    # describe() says so for a block mask's backward, and only there
    lines = pkg.describe().splitlines()
    doc = next(line for line in lines if f" {_bwd_name(('document',), True)} " in line)
    cap = next(line for line in lines if f" {_bwd_name(('softcap',), True)} " in line)
    assert "gluon" in doc and doc.split(";")[1].count("persistent") == 1
    assert "persistent" not in cap


@pytest.mark.parametrize("knobs, persistent, grid", [
    ({}, True, None),
    ({"persistent_bwd": False}, False, None),
    ({"persistent_bwd": True, "persistent_bwd_programs": 7}, True, 7),
    ({"persistent_bwd": True, "persistent_bwd_programs": 1000}, True, None),
], ids=["default", "off", "seven-programs", "capped-at-the-key-blocks"])
def test_persistent_backward_launch(pkg, monkeypatch, knobs, persistent, grid):
    """The persistent form is a launch of the same kernel with PERSISTENT=True on fewer
    programs (never more than the key blocks) and the stream's int32 counter, 0, as WORK --
    the same tensor call after call (_bwd_work_counter: the kernel leaves it at 0, nothing
    zeroes it per call); off, WORK is None and the meta has no PERSISTENT (the
    program-per-key-block binary). The default is persistent (on the CPU a program per
    item: no SM count). A variant without a block mask has no persistent form."""
    rt, rec = _wired(pkg, monkeypatch)
    b, n, h, h_kv, d = 2, 300, 4, 2, 128
    g = torch.Generator().manual_seed(0)
    q = torch.randn(b, n, h, d, generator=g, dtype=torch.bfloat16).requires_grad_()
    k, v = (torch.randn(b, n, h_kv, d, generator=g, dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    doc = documents(b, n, "cpu")
    out = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
    with rt.override_config(family="gluon", **knobs):
        out.backward(torch.randn_like(out))
    assert len(rec.calls) == 1
    (programs, _, _), args, meta = rec.calls[0]
    name = _bwd_name(("document",), True)
    params = _runtime_params(_kernel_text(pkg, name), name)
    assert len(args) == len(params) and params[-1] == "WORK"
    items = b * h_kv * -(-n // meta["BLOCK_N"])
    work = args[-1]
    if persistent:
        assert meta["PERSISTENT"] is True
        assert programs == (grid if grid is not None else items)
        assert work.dtype == torch.int32 and work.shape == (1, ) and int(work) == 0
        assert work is rt._bwd_work_counters[(torch.device("cpu"), 0)]
    else:
        assert not meta.get("PERSISTENT", False) and programs == items and work is None
    # a second call (another length: another plan) takes the same counter, or None
    q2, k2, v2 = (t[:, :200].detach().requires_grad_() for t in (q, k, v))
    out = pkg.flash_attn_func(q2, k2, v2, causal=True, mods=("document",), doc=doc[:, :200])
    with rt.override_config(family="gluon", **knobs):
        out.backward(torch.randn_like(out))
    assert len(rec.calls) == 2 and (rec.calls[1][1][-1] is work)
    # a score mod alone: no block mask, no persistent form, whatever the knob
    rec.calls.clear()
    out = pkg.flash_attn_func(q, k, v, causal=True, mods=("softcap",), cap=20.0)
    with rt.override_config(family="gluon", **knobs):
        out.backward(torch.randn_like(out))
    (programs, _, _), args, meta = rec.calls[0]
    assert "PERSISTENT" not in meta and "WORK" not in _runtime_params(
        _kernel_text(pkg, _bwd_name(("softcap",), True)), _bwd_name(("softcap",), True))


def test_persistent_backward_work_counter_per_stream(pkg, monkeypatch):
    """_bwd_work_counter: one counter per (device, stream), made zeroed once and then handed
    out as it is (the kernel leaves it at 0); one made during a CUDA graph capture lives in
    the graph's pool and is not kept, and a launch under capture never takes a kept one
    (a graph's replays would share it with eager launches). A stand-in CUDA device: the
    stream and the capture state are patched, the tensors are CPU ones."""
    rt = pkg._runtime
    state = {"stream": 11, "capturing": False}
    monkeypatch.setattr(rt, "_bwd_work_counters", {})
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: state["stream"],
                        raising=False)  # (a CPU build of torch has none)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: state["capturing"])
    made = []
    zeros = torch.zeros

    def fake_zeros(*args, device=None, **kw):  # a CPU tensor for the stand-in device
        made.append(device)
        return zeros(*args, **kw)

    monkeypatch.setattr(torch, "zeros", fake_zeros)
    dev0, dev1 = torch.device("cuda", 0), torch.device("cuda", 1)
    a = rt._bwd_work_counter(dev0)
    assert a.dtype == torch.int32 and a.shape == (1, ) and int(a) == 0 and made == [dev0]
    assert rt._bwd_work_counter(dev0) is a and len(made) == 1  # no allocation, no fill
    assert rt._bwd_work_counter(dev1) is not a  # another device
    state["stream"] = 12
    b = rt._bwd_work_counter(dev0)
    assert b is not a and rt._bwd_work_counter(dev0) is b  # another stream: its own
    state["stream"], state["capturing"] = 13, True
    c = rt._bwd_work_counter(dev0)
    assert c is not a and c is not b and rt._bwd_work_counter(dev0) is not c  # not kept
    assert (dev0, 13) not in rt._bwd_work_counters
    state["stream"] = 11  # a capture on a stream that has one still gets its own
    d = rt._bwd_work_counter(dev0)
    assert d is not a and int(d) == 0
    assert set(rt._bwd_work_counters) == {(dev0, 11), (dev1, 11), (dev0, 12)}
    assert rt._bwd_work_counters[(dev0, 11)] is a
    state["capturing"] = False  # and the eager launches after it find theirs
    assert rt._bwd_work_counter(dev0) is a


_PERSISTENT_COMPILE = r"""
import importlib, json, sys
from pathlib import Path
from flashgen import families, gluon_compile
from flashgen.offline import mod_arg_types
pkg = Path(sys.argv[1])
sys.path.insert(0, str(pkg.parent))
registry = importlib.import_module(f"{pkg.name}._registry")
rows = []
for name in sys.argv[2].split(","):
    facts = registry.VARIANTS[name]
    module = importlib.import_module(f"{pkg.name}.kernels.gluon.{name}")
    r = gluon_compile.compile_variant(module, name, facts["head_dim"], facts["dtype"],
                                      {**families.variant_gluon_default(facts), "kind": "bwd"},
                                      mod_arg_types(registry, name)[0], persistent=True)
    rows.append(r.__dict__)
print(json.dumps(rows))
"""


@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on Triton 3.6")
def test_persistent_block_mask_backwards_compile_for_sm90(pkg):
    """The persistent form compiles for sm_90 into the design (wgmma, the 240/24 split,
    within 227 KiB: its item slots and barriers add ~200 B to the program-per-key-block
    kernel's shared memory), at most PERSISTENT_STACK bytes of stack."""
    names = ["bwd_causal_document_d128_bf16", "bwd_causal_document_d64_bf16",
             "bwd_prefix_lm_d128_bf16", "bwd_prefix_lm_d64_bf16", "bwd_window_sinks_d128_bf16"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PERSISTENT_COMPILE,
                          str(Path(pkg.__file__).parent), ",".join(names)],
                         capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = {r["variant"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])}
    assert set(rows) == set(names)
    for name, r in rows.items():
        assert "persistent" in r["config"], r
        assert r["wgmma"] > 0 and r["shared"] <= 232448, r
        assert families.CONSUMER_REGS in r["setmaxnreg"], r
        assert families.PRODUCER_REGS in r["setmaxnreg"], r
        assert r["spill_bytes"] <= PERSISTENT_STACK[name], r


# measured with Triton 3.6.0 (stack bytes; the program-per-key-block kernels': document d128
# 96, d64 128, prefix-LM d128 104, d64 184, window+sinks d128 104)
PERSISTENT_STACK = {
    "bwd_causal_document_d128_bf16": 96,  # 88
    "bwd_causal_document_d64_bf16": 168,  # 160
    "bwd_prefix_lm_d128_bf16": 128,  # 120
    "bwd_prefix_lm_d64_bf16": 200,  # 192
    "bwd_window_sinks_d128_bf16": 96,  # 88
}


def _persistent_cases():
    """(id, mods, kwargs maker, causal, b, n, h, h_kv, d, dtype, mask maker): odd lengths,
    GQA and MQA, both head dims."""
    def doc_kw(b, n):
        return {"doc": documents(b, n, "cuda")}

    def doc_mask(kw):
        dd = kw["doc"].cpu().long()
        return lambda b, h, i, j: dd[b, i] == dd[b, j]

    def prefix_kw(b, n):
        return {"prefix_len": torch.tensor([5, 200, 90][:b], dtype=torch.int32, device="cuda")}

    def prefix_mask(kw):
        p = kw["prefix_len"].cpu().long()
        return lambda b, h, i, j: (j < p[b]) | (j <= i)

    def window_kw(b, n):
        return {"sinks": 4, "window": 100}

    def window_mask(kw):
        return lambda b, h, i, j: (j <= i) & ((j < 4) | (i - j <= 100))

    return [
        pytest.param(("document",), doc_kw, True, 3, 257, 8, 2, 128, torch.bfloat16, doc_mask,
                     id="document-257-gqa4-d128"),
        pytest.param(("document",), doc_kw, True, 3, 1000, 4, 1, 64, torch.float16, doc_mask,
                     id="document-1000-mqa-d64"),
        pytest.param(("prefix_lm",), prefix_kw, False, 3, 257, 8, 2, 128, torch.bfloat16,
                     prefix_mask, id="prefix-257-gqa4-d128"),
        pytest.param(("prefix_lm",), prefix_kw, False, 2, 1031, 4, 4, 64, torch.bfloat16,
                     prefix_mask, id="prefix-1031-d64"),
        pytest.param(("window_sinks",), window_kw, False, 2, 1031, 8, 2, 128, torch.bfloat16,
                     window_mask, id="window-sinks-1031-gqa4-d128"),
        pytest.param(("window_sinks",), window_kw, False, 2, 777, 4, 2, 64, torch.float16,
                     window_mask, id="window-sinks-777-gqa2-d64"),
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("mods, make_kw, causal, b, n, h, hkv, d, dt, make_mask",
                         _persistent_cases())
@pytest.mark.parametrize("programs", [3, None], ids=["3-programs", "one-per-sm"])
def test_gluon_persistent_block_mask_backward(pkg, poison, mods, make_kw, causal, b, n, h, hkv,
                                              d, dt, make_mask, programs):
    """The persistent form against float64, and against the program-per-key-block kernel:
    dK and dV sum the same steps in the same order (to rounding), dQ's reduce-adds land in
    another order. With 3 programs each walks many key blocks (the counter, the item slots,
    K/V loaded under the last epilogue); one per SM is what the runtime launches. Run it
    under `timeout`: a barrier-phase bug hangs rather than fails."""
    _skip_unless_hopper()
    kw = make_kw(b, n)
    knobs = {"persistent_bwd": True}
    if programs is not None:
        knobs["persistent_bwd_programs"] = programs
    common = dict(causal=causal, b=b, n_q=n, n_k=n, h=h, h_kv=hkv, d=d, dtype=dt,
                  mask=make_mask(kw))
    got = _gpu_check(pkg, mods, kw, knobs=knobs, **common)
    want = _gpu_check(pkg, mods, kw, **common)
    for name, x, y in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(x, y, atol=1e-6 if name != "dq" else 2e-3, rtol=2 ** -7,
                                   msg=lambda m: f"{name} vs the program-per-key-block kernel: {m}")


@pytest.mark.gpu
def test_gluon_persistent_backward_by_the_switch(pkg, poison, monkeypatch):
    """GLUON_BWD_PERSISTENT_MASKS = True (the default) alone sends a block mask's backward
    to the persistent form (one program per SM)."""
    _skip_unless_hopper()
    monkeypatch.setattr(pkg._runtime, "GLUON_BWD_PERSISTENT_MASKS", True)
    doc = documents(2, 2048 + 77, "cuda", seed=5)
    dd = doc.cpu().long()
    _gpu_check(pkg, ("document",), {"doc": doc}, causal=True, b=2, n_q=2048 + 77,
               n_k=2048 + 77, h=4, h_kv=2, d=128, dtype=torch.bfloat16,
               mask=lambda b, h, i, j: dd[b, i] == dd[b, j])


def _persistent_counter_inputs(b, n, h, h_kv, d, dt, seed, doc=None):
    """q, k, v, dO and a document mask (`doc`, else one drawn from `seed`) on the GPU, and
    the float64 gradients of q, k, v."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, n, h, d, generator=g).to(dt)
    k, v = (torch.randn(b, n, h_kv, d, generator=g).to(dt) for _ in range(2))
    dout = torch.randn(b, n, h, d, generator=g).to(dt)
    doc = documents(b, n, "cpu", seed=seed) if doc is None else doc.cpu()
    dd = doc.long()
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*leaves, causal=True, mask=lambda b_, h_, i, j: dd[b_, i] == dd[b_, j])
    want = torch.autograd.grad(ref, leaves, dout.double())
    gpu = [t.cuda().requires_grad_() for t in (q, k, v)]
    return (*gpu, dout.cuda(), doc.cuda()), want


# (b, n, h, h_kv, d, dtype): A has 4 * 16 * 3 = 192 key blocks, more than the H100's and
# the H200's 132 SMs, so the one-per-SM grid claims too; B (MQA, d=64: another kernel,
# the same counter) has 3 * 1 * 8 = 24
_COUNTER_SHAPES = [(4, 257, 16, 16, 128, torch.bfloat16), (3, 1000, 4, 1, 64, torch.float16)]


def _check_grads(got, want, dt, what):
    atol, rtol = GRAD_TOL[dt]
    for name, gr, r in zip(("dq", "dk", "dv"), got, want):
        assert not torch.isnan(gr).any(), f"{what}: NaN in {name}"
        torch.testing.assert_close(gr.double().cpu(), r, atol=atol, rtol=rtol,
                                   msg=lambda m: f"{what}: {name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [3, None], ids=["3-programs", "one-per-sm"])
def test_gluon_persistent_backward_counter_resets_itself(pkg, poison, programs):
    """The work counter is made once per (device, stream) and never zeroed again
    (_bwd_work_counter): each launch's last claim leaves it at 0 (_claim's atom.inc). Two
    shapes, A B A B A B back to back on one stream with no host sync between the calls,
    every call's gradients against float64: a counter left anywhere but 0 makes the next
    launch skip key blocks (NaN dK / dV under `poison`) or run some twice. The stream kept
    one counter throughout, at 0 at the end. Run it under `timeout`."""
    _skip_unless_hopper()
    rt = pkg._runtime
    knobs = {"persistent_bwd": True}
    if programs is not None:
        knobs["persistent_bwd_programs"] = programs
    cases = [_persistent_counter_inputs(*shape, seed=i)
             for i, shape in enumerate(_COUNTER_SHAPES)]
    key = (cases[0][0][0].device, torch.cuda.current_stream().cuda_stream)
    counters, grads = [], []
    with rt.override_config(family="gluon", **knobs):
        for i in range(6):
            (q, k, v, dout, doc), _ = cases[i % 2]
            out = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
            grads.append(torch.autograd.grad(out, (q, k, v), dout))
            counters.append(rt._bwd_work_counters.get(key))
        plans = [p for p in rt._backward_plans.values() if p is not None]
        assert len(plans) == 2 and all(p[7] == rt._BWD_GLUON and p[10] == rt._BWD_PERSISTENT
                                       for p in plans), "the persistent backward did not run"
    assert counters[0] is not None and all(c is counters[0] for c in counters)
    for i, got in enumerate(grads):
        _check_grads(got, cases[i % 2][1], _COUNTER_SHAPES[i % 2][-1], f"call {i}")
    assert int(counters[0]) == 0


@pytest.mark.gpu
def test_gluon_persistent_backward_replays_in_a_cuda_graph(pkg):
    """Captured on a stream that already has a counter (made by an eager call on it), the
    graph launches the persistent backward on that counter and zeroes nothing: each replay
    finds it at 0 only because the last launch left it so. Three replays on fresh inputs
    (the captured mask) against float64, then an eager call on the stream."""
    _skip_unless_hopper()
    rt = pkg._runtime
    b, n, h, h_kv, d, dt = _COUNTER_SHAPES[0]
    (q, k, v, dout, doc), want = _persistent_counter_inputs(b, n, h, h_kv, d, dt, seed=0)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with rt.override_config(family="gluon", persistent_bwd=True, persistent_bwd_programs=3), \
            torch.cuda.stream(stream):
        for _ in range(2):  # compile, make the plans, the block lists and the counter
            out = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
            torch.autograd.grad(out, (q, k, v), dout)
        key = (q.device, stream.cuda_stream)
        counter = rt._bwd_work_counters[key]
        kept = list(rt._bwd_work_counters.items())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            out = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
            static = torch.autograd.grad(out, (q, k, v), dout)
        now = list(rt._bwd_work_counters.items())
        assert [x for x, _ in now] == [x for x, _ in kept]
        assert all(a is c for (_, a), (_, c) in zip(now, kept))
        for seed in (1, 2, 3):
            fresh, want = _persistent_counter_inputs(b, n, h, h_kv, d, dt, seed=seed, doc=doc)
            with torch.no_grad():
                for s, x in zip((q, k, v, dout), fresh[:4]):
                    s.copy_(x)
            graph.replay()
            _check_grads(static, want, dt, f"replay {seed}")
            assert int(counter) == 0
        out = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
        _check_grads(torch.autograd.grad(out, (q, k, v), dout), want, dt, "eager after")
    torch.cuda.current_stream().wait_stream(stream)
