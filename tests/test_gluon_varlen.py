"""flash_attn_varlen_func on the Gluon (Hopper) forward: the dense Gluon kernel with VARLEN=True.

On the CPU: the packed form of the shipped Gluon forwards compiles for sm_90 (Triton's
bundled ptxas) into the dense kernel's design and budget, and the runtime's reasons.
On the GPU (-m gpu): forward output and LSE (and the gradients, through the `tl` varlen
backward) against a float64 reference run one sequence at a time, with ragged lengths
(0 and 1 included, Nq != Nk both ways, lengths off the 64/128-row tiles), GQA, the three
bands, dropout against the replayed mask, a corrupted cu_seqlens inside NaN-filled
buffers, and a check that the Gluon kernel (GluonJITFunction) is what ran.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import OUT_TOL
from packages import build_and_import
from test_gluon import needs_gluon_triton
from test_varlen import assert_all, cu, reference

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gvarlen"), "fg_test_gluon_varlen", """
        head_dims: [64, 128]
        dtypes: [fp16, bf16]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        """)


# ---------------------------------------------------------------------------------------
# CPU: offline compile and reasons
# ---------------------------------------------------------------------------------------
_COMPILE = r"""
import json, sys
from pathlib import Path
from flashgen import gluon_compile, families
res = gluon_compile.compile_package(Path(sys.argv[1]), configs=[families.GLUON_DEFAULT],
                                    variants=sys.argv[2].split(","), varlen=True)
print(json.dumps([r.__dict__ for r in res]))
"""


@needs_gluon_triton
def test_varlen_gluon_forward_compiles_for_sm90(pkg):
    """Dense and packed forms side by side: the packed one keeps the design (wgmma, the
    register split), its shared memory and a small stack frame. Measured when written
    (llama-like d=128 bf16 causal): 197064 B shared (dense 197032), 80 B stack (dense 112)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    names = ["fwd_causal_d128_bf16", "fwd_d64_fp16", "fwd_window_d128_bf16"]
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(Path(pkg.__file__).parent),
                          ",".join(names)], capture_output=True, text=True, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == 2 * len(names)
    dense = {r["variant"]: r for r in rows if not r["config"].startswith("varlen")}
    for r in rows:
        if not r["config"].startswith("varlen"):
            continue
        d = dense[r["variant"]]
        assert r["shared"] <= 232448 and r["shared"] <= d["shared"] + 1024, r
        assert r["wgmma"] == d["wgmma"] > 0, r
        assert r["setmaxnreg"] == d["setmaxnreg"], r
        assert r["spill_bytes"] <= 128, r


def test_the_runtime_says_why_not_gluon(pkg, monkeypatch):
    rt = pkg._runtime
    q = torch.randn(40, 4, 128, dtype=torch.bfloat16)
    cfg = {"family": "gluon"}
    # on this machine: the interpreter or no CUDA device
    assert rt.gluon_varlen_reason("fwd_causal_d128_bf16", cfg, q, q, q, q, 40, "causal")
    assert "tl" in rt.gluon_varlen_reason("fwd_causal_d128_bf16", {}, q, q, q, q, 40, "causal")
    assert "dropout at head dim <= 64" in rt.gluon_varlen_reason(
        "fwd_dropout_d64_bf16", cfg, q[..., :64], q[..., :64], q[..., :64], q[..., :64], 40, "none")
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)  # as on an H100
    assert "dropout in a packed batch" in rt.gluon_varlen_reason(
        "fwd_dropout_d128_bf16", cfg, q, q, q, q, 40, "none")
    odd = torch.randn(40 * 4 * 128 + 1, dtype=torch.bfloat16)[1:].view(40, 4, 128)
    assert "TMA" in rt.gluon_varlen_reason("fwd_causal_d128_bf16", cfg, q, q, odd, q, 40, "causal")
    assert "no keys" in rt.gluon_varlen_reason("fwd_causal_d128_bf16", cfg, q, q[:0], q[:0], q,
                                               0, "causal")
    assert "too small" in rt.gluon_varlen_reason("fwd_causal_d128_bf16", cfg, q, q, q, q, 40,
                                                 "causal")
    kernel = (Path(pkg.__file__).parent / "kernels" / "gluon" / "fwd_causal_d128_bf16.py").read_text()
    assert "VARLEN: gl.constexpr" in kernel and "def _varlen_tile(" in kernel


# ---------------------------------------------------------------------------------------
# GPU: against float64
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _families_ran(pkg):
    return {type(p[0].fn).__name__ for key, p in pkg._runtime._forward_plans.items()
            if key[0] == "varlen" and p[0] is not None}


def _run(pkg, lq, lk, h_q, h_kv, d, dtype, *, causal=False, window=(-1, -1), p=0.0,
         grad=True, seed=0, expect="GluonJITFunction"):
    q = torch.randn(sum(lq), h_q, d, dtype=dtype, device="cuda", requires_grad=grad)
    k = torch.randn(sum(lk), h_kv, d, dtype=dtype, device="cuda", requires_grad=grad)
    v = torch.randn(sum(lk), h_kv, d, dtype=dtype, device="cuda", requires_grad=grad)
    pkg._runtime._forward_plans.clear()
    torch.manual_seed(seed)
    with pkg._runtime.override_config(family="gluon"):  # asked for: most are tiny
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cu(lq, "cuda"), cu(lk, "cuda"),
                                              max(lq), max(lk), dropout_p=p, causal=causal,
                                              window_size=window, return_lse=True)
        assert _families_ran(pkg) == {expect}, f"expected {expect} to run"
        do = torch.randn_like(out)
        if grad:
            out.backward(do)
    return q, k, v, out, lse, do


# lengths: empty, one token, Nq < Nk, Nq > Nk, off the 64/128-row tiles, several tiles
LQ = [130, 0, 1, 59, 257, 64, 200, 1]
LK = [130, 3, 1, 300, 100, 64, 0, 7]


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window,h_q,h_kv,d,dtype", [
    (True, (-1, -1), 8, 2, 128, torch.bfloat16),
    (False, (-1, -1), 4, 4, 128, torch.float16),
    (False, (100, 0), 4, 1, 128, torch.bfloat16),
    (True, (-1, -1), 4, 1, 64, torch.float16),
    (False, (-1, -1), 2, 2, 64, torch.bfloat16),
], ids=["causal-gqa4", "full", "window-mqa", "causal-d64-gqa4", "full-d64"])
def test_gluon_varlen_against_float64(pkg, poison, causal, window, h_q, h_kv, d, dtype):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    q, k, v, out, lse, do = _run(pkg, LQ, LK, h_q, h_kv, d, dtype, causal=causal, window=window)
    assert lse.shape == (h_q, sum(LQ))
    ref = reference(q, k, v, LQ, LK, do, causal=causal, window=window)
    assert_all((out, lse, q.grad, k.grad, v.grad), ref, dtype)


@pytest.mark.gpu
def test_gluon_varlen_many_sequences_and_rounds(pkg, poison):
    """More sequences than one chunk of the walk (32), lengths up to a few tiles, more
    tiles than SMs: the on-device tile count and walk cover every row exactly once."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    g = torch.Generator().manual_seed(3)
    lq = torch.randint(0, 700, (70,), generator=g).tolist()
    lq[5], lq[9] = 0, 1
    q, k, v, out, lse, do = _run(pkg, lq, lq, 8, 2, 128, torch.bfloat16, causal=True, grad=False)
    ref = reference(q, k, v, lq, lq, do, causal=True)
    atol, rtol = OUT_TOL[torch.bfloat16]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double().cpu(), ref[0], atol=atol, rtol=rtol)
    seen = torch.isfinite(ref[1])
    assert torch.equal(torch.isfinite(lse).cpu(), seen)


@pytest.mark.gpu
def test_gluon_varlen_bench_shape(pkg, poison):
    """The bench's workload (16 documents of 128..4096 tokens, 16k tokens, H=16, d=128,
    causal) on the default path (no family asked): the Gluon forward, correct."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    from flashgen.bench_varlen import ragged_lengths
    lens = ragged_lengths(16, 16384, 128, 4096, 0)
    q, k, v = (torch.randn(16384, 16, 128, dtype=torch.bfloat16, device="cuda") for _ in range(3))
    pkg._runtime._forward_plans.clear()
    out = pkg.flash_attn_varlen_func(q, k, v, cu(lens, "cuda"), cu(lens, "cuda"), max(lens),
                                     max(lens), causal=True)
    if pkg._runtime._FORCED_FAMILY != "tl" and pkg._runtime.VARLEN_GLUON_FORWARD:
        assert _families_ran(pkg) == {"GluonJITFunction"}
    c = cu(lens)
    for i in (0, 1, 8, 15):  # spot-check a few documents against float64 in full
        s, e = c[i].item(), c[i + 1].item()
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t[s:e].transpose(0, 1).double() for t in (q, k, v)), is_causal=True)
        torch.testing.assert_close(out[s:e].transpose(0, 1).double(), ref, atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.gpu
def test_dropout_falls_back_to_tl(pkg, poison):
    """Dropout with a packed batch stays on `tl` (gluon_varlen_reason), asked-for family
    or not, and is still the replayed mask."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    lq, lk, p = [211, 3, 0, 130], [211, 400, 2, 90], 0.25
    q, k, v, out, lse, do = _run(pkg, lq, lk, 4, 1, 128, torch.bfloat16, causal=True, p=p, seed=7,
                                 expect="JITFunction")
    torch.manual_seed(7)
    keep = pkg.dropout_mask(len(lq), 4, max(lq), max(lk), p, device="cuda")
    ref = reference(q, k, v, lq, lk, do, causal=True, keep=keep, p=p)
    assert_all((out, lse, q.grad, k.grad, v.grad), ref, torch.bfloat16)


@pytest.mark.gpu
def test_gluon_varlen_corrupted_cu_seqlens_stay_in_bounds(pkg, monkeypatch):
    """Unchecked bad cu_seqlens: spans are clamped into the packed tensors, which live
    inside NaN-filled buffers, so a read or write outside them shows up."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)

    def inside_nan(n, h):
        buf = torch.full((n + 256, h, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
        buf[128:128 + n] = torch.randn(n, h, 128, dtype=torch.bfloat16, device="cuda")
        return buf, buf[128:128 + n]

    for cq, ck in (([0, 500, 300, 6000], [0, 900, 1400, 1200]),
                   ([-70, 200, 3000, 3000], [0, -30, 9900, 1400])):
        qb, q = inside_nan(3000, 4)
        kb, k = inside_nan(1400, 4)
        vb, v = inside_nan(1400, 4)
        out_buf = torch.full_like(qb, 7.0)
        pkg._runtime._forward_plans.clear()
        mask, lo, hi = pkg._runtime.varlen_band(3200, 3200, True, (-1, -1))
        with pkg._runtime.override_config(family="gluon"):
            lse = pkg._runtime.forward_varlen(
                q, k, v, out_buf[128:128 + 3000], torch.tensor(cq, dtype=torch.int32, device="cuda"),
                torch.tensor(ck, dtype=torch.int32, device="cuda"), 3200, 3200, mask=mask,
                lo=lo, hi=hi, scale=128 ** -0.5)
            assert _families_ran(pkg) == {"GluonJITFunction"}
        assert not torch.isnan(lse).any()
        assert (out_buf[:128] == 7).all() and (out_buf[128 + 3000:] == 7).all(), "wrote outside O"
        assert not torch.isnan(out_buf[128:128 + 3000]).any()
