"""flash_attn_varlen_func: packed ragged batches against a float64 reference that runs
each sequence on its own.

The lengths are ragged on purpose: empty sequences, one-token ones, Nq != Nk both ways
within one batch, lengths that are not multiples of the (forced 16 x 16) tiles. The
forward, the LSE in flash-attn's (H, total_q) layout and all three gradients are checked
for the none / causal / sliding-window bands (bottom-right per sequence), GQA 4:1, fp32 and
bf16; dropout against the keep mask replayed by `dropout_mask`; torch.compile fullgraph;
the ValueErrors of bad arguments; and that a corrupted cu_seqlens, unchecked, is clamped
inside the kernels: q, k, v and dO live inside NaN-filled buffers, so a read outside the
tensors would show up as NaN in the result.
"""
import contextlib

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
D = 32


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("varlen"), "fg_test_varlen", """
        head_dims: [32]
        dtypes: [bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 8, right: 0}
        dropout: true
        gqa: true
        """)


def cu(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


def packed(lq, lk, h_q, h_kv, dtype, device, grad=True):
    q = torch.randn(sum(lq), h_q, D, dtype=dtype, device=device, requires_grad=grad)
    k = torch.randn(sum(lk), h_kv, D, dtype=dtype, device=device, requires_grad=grad)
    v = torch.randn(sum(lk), h_kv, D, dtype=dtype, device=device, requires_grad=grad)
    return q, k, v


def reference(q, k, v, lq, lk, do, *, causal=False, window=(-1, -1), keep=None, p=0.0):
    """(out, lse (H, total_q), dq, dk, dv) in float64, one sequence at a time; `keep` is
    the (batch, H, max_q, max_k) keep mask."""
    q64, k64, v64 = (t.detach().double().cpu().requires_grad_() for t in (q, k, v))
    cq, ck = cu(lq), cu(lk)
    outs, lses = [], []
    for i, (n_q, n_k) in enumerate(zip(lq, lk)):
        qs = q64[cq[i]:cq[i + 1]].transpose(0, 1)[None]
        ks = k64[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        vs = v64[ck[i]:ck[i + 1]].transpose(0, 1)[None]
        vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
        kp = None if keep is None else keep[i:i + 1, :, :n_q, :n_k].cpu()
        out, lse = attention_ref(qs, ks, vs, vis, keep=kp, dropout_p=p)
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out, lse = torch.cat(outs), torch.cat(lses, 1)
    out.backward(do.double().cpu())
    return out.detach(), lse.detach(), q64.grad, k64.grad, v64.grad


def assert_all(got, ref, dtype):
    out, lse, dq, dk, dv = got
    r_out, r_lse, r_dq, r_dk, r_dv = ref
    assert lse.shape == r_lse.shape, "LSE is (H_q, total_q)"
    seen = torch.isfinite(r_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen), "LSE -inf rows differ"
    torch.testing.assert_close(lse.double().cpu()[seen], r_lse[seen], atol=LSE_TOL[0],
                               rtol=LSE_TOL[1])
    for name, g, r, tol in (("out", out, r_out, OUT_TOL[dtype]), ("dq", dq, r_dq, GRAD_TOL[dtype]),
                            ("dk", dk, r_dk, GRAD_TOL[dtype]), ("dv", dv, r_dv, GRAD_TOL[dtype])):
        assert not torch.isnan(g).any(), f"NaN in {name} (or an element never written)"
        torch.testing.assert_close(g.double().cpu(), r, atol=tol[0], rtol=tol[1],
                                   msg=lambda m: f"{name}: {m}")


def run(pkg, q, k, v, lq, lk, *, causal=False, window=(-1, -1), p=0.0, seed=0, tiles=TILES):
    cq, ck = cu(lq, q.device), cu(lk, q.device)
    torch.manual_seed(seed)
    with pkg._runtime.override_config(**tiles) if tiles else contextlib.nullcontext():
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cq, ck, max(lq), max(lk), dropout_p=p,
                                              causal=causal, window_size=window,
                                              return_lse=True)
        do = torch.randn_like(out)
        out.backward(do)
    return (out, lse, q.grad, k.grad, v.grad), do


# lengths: an empty sequence, a one-token one, Nq < Nk, Nq > Nk, multi-block ones
LQ = [5, 0, 17, 1, 33, 20]
LK = [9, 3, 17, 1, 20, 0]


@pytest.mark.parametrize("causal,window,h_q,h_kv,dtype", [
    (False, (-1, -1), 2, 2, torch.float32),
    (True, (-1, -1), 4, 1, torch.float32),
    (False, (6, 2), 2, 2, torch.float32),
    (True, (-1, -1), 2, 1, torch.bfloat16),
], ids=["full", "causal_gqa4", "window", "causal_bf16"])
def test_forward_and_gradients(pkg, device, poison, causal, window, h_q, h_kv, dtype):
    q, k, v = packed(LQ, LK, h_q, h_kv, dtype, device)
    got, do = run(pkg, q, k, v, LQ, LK, causal=causal, window=window)
    assert got[0].shape == q.shape and got[1].shape == (h_q, sum(LQ))
    assert_all(got, reference(q, k, v, LQ, LK, do, causal=causal, window=window), dtype)


def test_dropout_uses_the_replayed_mask(pkg, device, poison):
    """Forward and backward regenerate one keep mask, keyed by (sequence, head) and
    in-sequence positions: dropout_mask(batch, H, max_q, max_k)[i, :, :n_q, :n_k]."""
    lq, lk, p = [21, 3, 0, 18], [21, 40, 2, 9], 0.25
    q, k, v = packed(lq, lk, 2, 1, torch.float32, device)
    got, do = run(pkg, q, k, v, lq, lk, causal=True, p=p, seed=7)
    torch.manual_seed(7)
    keep = pkg.dropout_mask(len(lq), 2, max(lq), max(lk), p, device=device)
    ref = reference(q, k, v, lq, lk, do, causal=True, keep=keep, p=p)
    assert_all(got, ref, torch.float32)


def test_planned_tiles(pkg, device, poison):
    """The planner's (on a GPU: tuned, TMA where it applies) tiles, not the forced 16 x 16."""
    lq = lk = [130, 0, 77, 1]
    q, k, v = packed(lq, lk, 2, 2, torch.bfloat16, device)
    got, do = run(pkg, q, k, v, lq, lk, causal=True, tiles=None)
    assert_all(got, reference(q, k, v, lq, lk, do, causal=True), torch.bfloat16)


def test_qkvpacked_matches_the_unpacked_call(pkg):
    lengths = [7, 0, 19]
    qkv = torch.randn(sum(lengths), 3, 2, D, requires_grad=True)
    c = cu(lengths)
    with pkg._runtime.override_config(**TILES):
        out = pkg.flash_attn_varlen_qkvpacked_func(qkv, c, max(lengths), causal=True)
        do = torch.randn_like(out)
        out.backward(do)
    ref = reference(qkv[:, 0], qkv[:, 1], qkv[:, 2], lengths, lengths, do, causal=True)
    torch.testing.assert_close(out.double(), ref[0], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(qkv.grad.double(), torch.stack(ref[2:], 1), atol=1e-4, rtol=1e-4)


def test_torch_compile_fullgraph(pkg):
    """The varlen custom operator traces with no graph break (aot_eager on CPU runs the
    fake implementations and the autograd registration)."""
    torch._dynamo.reset()
    lq, lk = [9, 1, 12], [4, 6, 12]
    cq, ck = cu(lq), cu(lk)

    def f(q, k, v):
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cq, ck, 12, 12, causal=True,
                                              return_lse=True)
        return (out * 2).sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    q, k, v = packed(lq, lk, 2, 2, torch.float32, "cpu")
    with pkg._runtime.override_config(**TILES):
        loss = torch.compile(f, backend="aot_eager", fullgraph=True)(q, k, v)
        loss.backward()
        q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
        loss2 = f(q2, k2, v2)
        loss2.backward()
    torch.testing.assert_close(loss, loss2)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, atol=1e-5, rtol=1e-5)


def test_no_grad_and_empty_batches(pkg):
    q, k, v = packed([0, 0], [3, 0], 2, 2, torch.float32, "cpu", grad=False)
    out, lse = pkg.flash_attn_varlen_func(q, k, v, cu([0, 0]), cu([3, 0]), 0, 3,
                                          return_lse=True)
    assert out.shape == (0, 2, D) and lse.shape == (2, 0)
    # keys but no sequence sees one: zeros and -inf, as a dense call's empty rows
    q, k, v = packed([2], [0], 2, 2, torch.float32, "cpu", grad=False)
    out, lse = pkg.flash_attn_varlen_func(q, k, v, cu([2]), cu([0]), 2, 0, return_lse=True)
    assert (out == 0).all() and (lse == float("-inf")).all()


@pytest.mark.parametrize("change,match", [
    (dict(cq=cu([3, 4]).long()), "int32"),
    (dict(cq=torch.tensor([0, 5, 3], dtype=torch.int32)), "non-decreasing"),
    (dict(cq=torch.tensor([0, 3, 8], dtype=torch.int32)), r"\[-1\] = 8"),
    (dict(cq=torch.tensor([1, 3, 7], dtype=torch.int32)), "start at 0"),
    (dict(cq=cu([3, 4])[None]), "1-D"),
    (dict(ck=cu([5])), "entries"),
    (dict(max_q=3), "max_seqlen_q = 3"),
    (dict(max_k=4.0), "max_seqlen_k must be a host int"),
    (dict(max_k=torch.tensor(5)), "max_seqlen_k must be a host int"),
    (dict(q=torch.randn(1, 7, 2, D)), "3-D"),
    (dict(k=torch.randn(9, 3, D), v=torch.randn(9, 3, D)), "multiple of key/value heads"),
    (dict(q=torch.randn(7, 2, 16)), "head dim"),
])
def test_bad_arguments_raise_value_errors(pkg, change, match):
    args = dict(q=torch.randn(7, 2, D), k=torch.randn(9, 2, D), v=torch.randn(9, 2, D),
                cq=cu([3, 4]), ck=cu([4, 5]), max_q=4, max_k=5)
    args.update(change)
    with pytest.raises(ValueError, match=match):
        pkg.flash_attn_varlen_func(args["q"], args["k"], args["v"], args["cq"], args["ck"],
                                   args["max_q"], args["max_k"])


def test_describe_and_the_gluon_reason(pkg):
    text = pkg.describe()
    assert ("flash_attn_varlen_func: the forward and the backward run their Gluon kernels "
            "with VARLEN=True where the dense call runs them") in text
    assert "dropout" in pkg._runtime.VARLEN_GLUON_REASON
    # d=32 has no Gluon kernel: the reason names the variant's, whatever the device
    cfg = {"family": "gluon"}
    q = torch.randn(8, 2, D, dtype=torch.bfloat16)
    assert "head dim 32" in pkg._runtime.gluon_varlen_reason("fwd_causal_d32_bf16", cfg, q, q, q,
                                                             q, 8, "causal")


def test_mods_the_package_was_not_built_with(pkg):
    """(Packed batches with mods: tests/test_varlen_mods.py.) A package built without a mod
    names its spec and what to add."""
    q, k, v = packed([3], [3], 2, 2, torch.float32, "cpu", grad=False)
    with pytest.raises(ValueError, match=r"unknown mod 'softcap'.*built with mods.*`mods:`"):
        pkg.flash_attn_varlen_func(q, k, v, cu([3]), cu([3]), 3, 3, mods=("softcap",), cap=5.0)


def _inside_nan(t, pad=40):
    """t as a view into a NaN-filled buffer with `pad` rows either side."""
    buf = torch.full((t.shape[0] + 2 * pad, *t.shape[1:]), float("nan"), dtype=t.dtype)
    buf[pad:pad + t.shape[0]] = t
    return buf[pad:pad + t.shape[0]]


@pytest.mark.parametrize("cq,ck", [
    ([0, 5, 3, 60], [0, 9, 14, 12]),      # decreasing, last past the total
    ([-7, 2, 30, 30], [0, -3, 99, 14]),   # negative, past the total
], ids=["decreasing_and_past_the_end", "negative"])
def test_corrupted_cu_seqlens_stay_in_bounds(pkg, monkeypatch, cq, ck):
    """Unchecked (FLASHGEN_CHECK_VALUES=0) bad cu_seqlens give a finite wrong answer: the
    kernels clamp every span into the packed tensors, forward and backward."""
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)
    q, k, v = (_inside_nan(torch.randn(n, 2, D)).requires_grad_() for n in (30, 14, 14))
    cq, ck = (torch.tensor(c, dtype=torch.int32) for c in (cq, ck))
    with pkg._runtime.override_config(**TILES):
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cq, ck, 32, 32, causal=True,
                                              return_lse=True)
        assert not torch.isnan(out).any() and not torch.isnan(lse).any()
        out.backward(_inside_nan(torch.randn_like(out)))
    for g in (q.grad, k.grad, v.grad):
        assert torch.isfinite(g).all()


def test_values_are_checked_on_the_cpu_by_default(pkg, monkeypatch):
    """CPU cu_seqlens are read (free); FLASHGEN_CHECK_VALUES=0 turns that off."""
    q, k, v = packed([3, 4], [4, 5], 2, 2, torch.float32, "cpu", grad=False)
    bad = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="total"):
        pkg.flash_attn_varlen_func(q, k, v, bad, cu([4, 5]), 5, 5)
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)
    with pkg._runtime.override_config(**TILES):
        out = pkg.flash_attn_varlen_func(q, k, v, bad, cu([4, 5]), 5, 5)
    assert torch.isfinite(out).all()
