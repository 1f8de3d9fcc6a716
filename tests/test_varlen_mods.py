"""flash_attn_varlen_func with mods: a packed ragged batch where each sequence is a batch
entry of its own, against a float64 reference that runs each sequence alone with the mod
written out in PyTorch (b = the sequence's index, q_idx / kv_idx in-sequence positions,
causal bottom-right per sequence), forward, LSE and every gradient.

The package is specs/mods.yaml at a test size (head dim 32, fp32 and bf16), so every
built-in combination the spec ships is available. Lengths are ragged on purpose (an empty
sequence, one-token ones, N_q != N_k both ways, lengths off the 16 x 16 test tiles), so a
mask mod's block lists see sequences whose blocks are full, partial, empty and missing.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from packages import build_and_import
from test_gluon import needs_gluon_triton

ROOT = Path(__file__).resolve().parent.parent
TILE = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
D = 32
# an empty sequence, a one-token one, N_q < N_k, N_q > N_k, multi-block ones
LQ = [5, 0, 17, 1, 33, 20]
LK = [9, 3, 17, 1, 20, 0]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    body = re.sub(r"head_dims: \[.*\]", f"head_dims: [{D}]", body)
    body = re.sub(r"dtypes: \[.*\]", "dtypes: [fp32, bf16]", body)
    body = body.replace("decode: true", "decode: false")
    return build_and_import(tmp_path_factory.mktemp("varlen_mods"), "varlen_mods_t", body)


def cu(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32,
                        device=device)


# ----------------------------------------------------------------------------------------
# The reference: float64, one sequence at a time, each mod written out
# ----------------------------------------------------------------------------------------
def reference(q, k, v, lq, lk, *, causal=False, score=None, mask=None, sink=None, keep=None,
              drop_scale=1.0):
    """Packed q (total_q, H, d), k/v (total_k, Hkv, d) float64 leaves -> out (total_q, H,
    d), lse (H, total_q). score(s, b, h, i, j) / mask(b, h, i, j) see b = the sequence;
    sink: [H] logits (sink_logits'); keep: the (batch, H, max_q, max_k) dropout keep mask,
    kept weights times drop_scale. A row that sees nothing gives 0 and LSE -inf."""
    cq, ck = cu(lq), cu(lk)
    outs, lses = [], []
    for seq, (n_q, n_k) in enumerate(zip(lq, lk)):
        qs = q[cq[seq]:cq[seq + 1]].transpose(0, 1)
        ks = k[ck[seq]:ck[seq + 1]].transpose(0, 1)
        vs = v[ck[seq]:ck[seq + 1]].transpose(0, 1)
        group = qs.shape[0] // ks.shape[0]
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        s = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])  # (H, n_q, n_k)
        b = torch.tensor(seq)
        h = torch.arange(qs.shape[0])[:, None, None]
        i, j = torch.arange(n_q)[:, None], torch.arange(n_k)[None, :]
        if score is not None:
            s = score(s, b, h, i, j)
        visible = torch.ones_like(s, dtype=torch.bool)
        if causal:
            visible = visible & (j <= i + n_k - n_q)
        if mask is not None:
            visible = visible & mask(b, h, i, j)
        s = s.masked_fill(~visible, float("-inf"))
        if sink is not None:
            s = torch.cat([s, sink[:, None, None].double().expand(-1, n_q, 1)], -1)
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
        if sink is not None:
            p = p[..., :-1]
        if keep is not None:
            p = p * keep[seq, :, :n_q, :n_k].double() * drop_scale
        outs.append((p @ vs).transpose(0, 1))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses, 1)


def packed(lq, lk, h, h_kv, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda n, heads: torch.randn(n, heads, D, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return make(sum(lq), h), make(sum(lk), h_kv), make(sum(lk), h_kv)


def check(pkg, device, dtype, *, causal=False, mods, kw, score=None, mask=None, sink=None,
          lq=LQ, lk=LK, h=2, h_kv=2, grads=()):
    """The packed call's out, LSE and gradients (of q, k, v and of the mod tensors named in
    `grads`) against the per-sequence reference; NaN fails. `sink` names the [H] sink
    tensor in kw; `score` takes the reference's copies of the tensors in `grads` as
    keyword arguments."""
    q, k, v = packed(lq, lk, h, h_kv, dtype, device)
    with pkg._runtime.override_config(**TILE):
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cu(lq, device), cu(lk, device),
                                              max(lq), max(lk), causal=causal, mods=mods,
                                              return_lse=True, **kw)
        dout = torch.randn_like(out)
        out.backward(dout)
    extra = [kw[t] for t in grads]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, *extra)]
    ref_kw = {name: leaves[3 + n] for n, name in enumerate(grads)}
    sink_ref = None
    if sink is not None:
        sink_ref = ref_kw.get(sink, kw[sink].detach().cpu().double())
    ref, ref_lse = reference(*leaves[:3], lq, lk, causal=causal, mask=mask, sink=sink_ref,
                             score=None if score is None else (lambda *a: score(*a, **ref_kw)))
    want = torch.autograd.grad(ref, leaves, dout.detach().cpu().double(), allow_unused=True)
    assert out.shape == q.shape and lse.shape == (h, sum(lq)), "LSE is (H_q, total_q)"
    assert not torch.isnan(out).any(), "NaN in the output (or a row never written)"
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse.detach())
    assert torch.equal(torch.isfinite(lse.cpu()), finite), "LSE -inf rows differ"
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse.detach()[finite],
                               atol=LSE_TOL[0], rtol=LSE_TOL[1])
    gatol, grtol = GRAD_TOL[dtype]
    for got, exp, name in zip((q.grad, k.grad, v.grad, *(t.grad for t in extra)), want,
                              ("dq", "dk", "dv", *(f"d{t}" for t in grads))):
        assert got is not None and not torch.isnan(got).any(), name
        torch.testing.assert_close(got.cpu().double(), exp, atol=gatol, rtol=grtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def documents(batch, n, device, seed=1):
    """Each sequence split into ragged documents: sorted ids, random lengths."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.sort(torch.randint(0, 4, (batch, n), generator=g), -1).values
    return ids.to(torch.int32).to(device)


# ----------------------------------------------------------------------------------------
# Score, mask and sink mods on packed batches
# ----------------------------------------------------------------------------------------
def test_softcap_causal_gqa(pkg, device, poison):
    check(pkg, device, torch.float32, causal=True, mods=("softcap",), kw={"cap": 2.0},
          score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0), h=4, h_kv=1)


def test_alibi_bf16(pkg, device, poison):
    slope = torch.tensor([0.5, 0.125], device=device)
    check(pkg, device, torch.bfloat16, causal=True, mods=("alibi",), kw={"slope": slope},
          score=lambda s, b, h, i, j: s - slope.cpu().double()[h] * (i - j).abs())


def test_document_causal(pkg, device, poison):
    """A mask mod on a packed batch: block lists per sequence at its own lengths and band;
    the doc tensor is (batch, max_seqlen), row i for sequence i."""
    doc = documents(len(LQ), max(LQ + LK), device)
    d = doc.cpu().long()
    check(pkg, device, torch.float32, causal=True, mods=("document",), kw={"doc": doc},
          mask=lambda b, h, i, j: d[b, i] == d[b, j])


def test_document_softcap_bf16_gqa(pkg, device, poison):
    lq, lk = [40, 1, 23, 16], [40, 7, 23, 33]
    doc = documents(len(lq), 40, device, seed=5)
    d = doc.cpu().long()
    check(pkg, device, torch.bfloat16, causal=True, mods=("document", "softcap"),
          kw={"doc": doc, "cap": 2.0}, score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
          mask=lambda b, h, i, j: d[b, i] == d[b, j], lq=lq, lk=lk, h=4, h_kv=1)


def test_prefix_lm(pkg, device, poison):
    prefix = torch.tensor([2, 0, 30, 1, 7, 3], dtype=torch.int32, device=device)
    p = prefix.cpu().long()
    check(pkg, device, torch.float32, mods=("prefix_lm",), kw={"prefix_len": prefix},
          mask=lambda b, h, i, j: (j < p[b]) | (j <= i))


def test_window_sinks(pkg, device, poison):
    lq = lk = [59, 3, 33]
    check(pkg, device, torch.float32, mods=("window_sinks",), kw={"sinks": 3, "window": 9},
          mask=lambda b, h, i, j: (j <= i) & ((j < 3) | (i - j <= 9)), lq=lq, lk=lk)


def test_softcap_key_padding_gqa(pkg, device, poison):
    # keep[b, kv_idx]: (batch, >= max_seqlen_k); sequence 0 loses its first keys, so some
    # of its rows see none (0 and LSE -inf)
    keep = torch.ones(len(LK), max(LK), dtype=torch.bool)
    keep[0, :6] = False
    keep[4, 11:] = False
    check(pkg, device, torch.float32, causal=True, mods=("softcap", "key_padding"),
          kw={"keep": keep.to(device), "cap": 2.0},
          score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
          mask=lambda b, h, i, j: keep[b, j], h=4, h_kv=2)


def test_sink_logits_with_gradient(pkg, device, poison):
    """The sink's gradient sums over each sequence's own rows."""
    sinks = torch.tensor([0.7, -1.5], device=device).requires_grad_()
    check(pkg, device, torch.float32, causal=True, mods=("sink_logits",), kw={"sinks": sinks},
          sink="sinks", grads=("sinks",))


def test_relative_bias(pkg, device, poison):
    rel = torch.randn(2, 2 * 6 + 1, generator=torch.Generator().manual_seed(3)).to(device)
    r = rel.cpu().double()
    check(pkg, device, torch.float32, mods=("relative_bias",),
          kw={"rel_bias": rel, "max_distance": 6},
          score=lambda s, b, h, i, j: s + r[h, (j - i + 6).clamp(0, 12)])


def test_bias_gradient(pkg, device, poison):
    """A score mod read at every (b, h, q_idx, kv_idx) (sdpa_mask's additive bias) gets its
    gradient at (sequence, head, in-sequence row, column) of a (batch, H, max_q, max_k)
    tensor, zero where no sequence reaches; a broadcast head extent is summed."""
    g = torch.Generator().manual_seed(4)
    bias = torch.randn(len(LQ), 1, max(LQ), max(LK), generator=g).to(device).requires_grad_()
    check(pkg, device, torch.float32, mods=("softcap", "sdpa_mask"), kw={"cap": 2.0, "bias": bias},
          score=lambda s, b, h, i, j, bias: 2.0 * torch.tanh(s / 2.0) + bias[b, 0, i, j],
          grads=("bias",))
    # rows and columns past each sequence's lengths get exactly zero
    for seq, (n_q, n_k) in enumerate(zip(LQ, LK)):
        assert bias.grad[seq, :, n_q:].abs().sum() == 0
        assert bias.grad[seq, :, :, n_k:].abs().sum() == 0


def test_dropout_with_mods(tmp_path, device, poison):
    """Dropout beside a mask and a score mod on a packed batch: the keep mask is the dense
    (batch, H, max_q, max_k) call's cut to each sequence, as without mods, forward and
    gradients; and an empty batch returns empty results."""
    pkg = build_and_import(tmp_path, "varlen_mods_drop_t", """
        head_dims: [32]
        dtypes: [fp32]
        masks: [causal]
        dropout: true
        gqa: true
        mods:
          softcap: {builtin: softcap}
          document: {builtin: document}
        variants:
          - {mask: causal, mods: [document, softcap]}
        """)
    lq, lk, p = [21, 3, 0, 18], [21, 40, 2, 9], 0.25
    doc = documents(len(lq), 40, device, seed=6)
    d_ids = doc.cpu().long()
    q, k, v = packed(lq, lk, 2, 1, torch.float32, device)
    torch.manual_seed(7)
    with pkg._runtime.override_config(**TILE):
        out = pkg.flash_attn_varlen_func(q, k, v, cu(lq, device), cu(lk, device), max(lq),
                                         max(lk), dropout_p=p, causal=True,
                                         mods=("document", "softcap"), doc=doc, cap=2.0)
        dout = torch.randn_like(out)
        out.backward(dout)
    torch.manual_seed(7)
    keep = pkg.dropout_mask(len(lq), 2, max(lq), max(lk), p, device=device).cpu()
    assert 0 < keep.float().mean() < 1
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    ref, _ = reference(*leaves, lq, lk, causal=True, keep=keep, drop_scale=pkg.dropout_scale(p),
                       score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
                       mask=lambda b, h, i, j: d_ids[b, i] == d_ids[b, j])
    want = torch.autograd.grad(ref, leaves, dout.detach().cpu().double())
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(),
                               atol=OUT_TOL[torch.float32][0], rtol=OUT_TOL[torch.float32][1])
    for got, exp, name in zip((q.grad, k.grad, v.grad), want, ("dq", "dk", "dv")):
        torch.testing.assert_close(got.cpu().double(), exp, atol=GRAD_TOL[torch.float32][0],
                                   rtol=GRAD_TOL[torch.float32][1], msg=name)
    # no sequences at all: nothing launches, nothing is read
    empty = torch.zeros(0, 2, 32, device=device)
    none = torch.zeros(1, dtype=torch.int32, device=device)
    out, lse = pkg.flash_attn_varlen_func(empty, empty[:, :1], empty[:, :1], none, none, 0, 0,
                                          causal=True, mods=("document", "softcap"),
                                          doc=torch.zeros(0, 1, dtype=torch.int32, device=device),
                                          return_lse=True)
    assert out.shape == (0, 2, 32) and lse.shape == (2, 0)


def test_qkvpacked_with_mods(pkg, device):
    lengths = [12, 1, 30]
    g = torch.Generator().manual_seed(2)
    qkv = torch.randn(sum(lengths), 3, 2, D, generator=g).to(device)
    doc = documents(len(lengths), 30, device)
    with pkg._runtime.override_config(**TILE):
        got = pkg.flash_attn_varlen_qkvpacked_func(qkv, cu(lengths, device), 30, causal=True,
                                                   mods=("document",), doc=doc)
        want = pkg.flash_attn_varlen_func(qkv[:, 0], qkv[:, 1], qkv[:, 2], cu(lengths, device),
                                          cu(lengths, device), 30, 30, causal=True,
                                          mods=("document",), doc=doc)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


# ----------------------------------------------------------------------------------------
# Block lists, caching, torch.compile, errors
# ----------------------------------------------------------------------------------------
def test_block_lists_are_per_sequence_and_follow_cu_seqlens(pkg):
    """The lists of a packed call classify every sequence's tiles at its own lengths and
    band (brute force over the mask), are cached by the mask's and cu_seqlens' tensors, and
    are made again after cu_seqlens changes in place."""
    rt, mods = pkg._runtime, pkg._mods
    lq, lk = [20, 0, 35], [20, 9, 35]
    cq, ck = cu(lq), cu(lk)
    # two documents a sequence at most: full, partial and empty tiles all occur
    doc = (torch.arange(35)[None, :] >= torch.tensor([[20], [4], [33]])).to(torch.int32)
    mask, lo, hi = rt.varlen_band(35, 35, True, (-1, -1))
    base = mods.prepare(("document",), {"doc": doc}, 3, 2, 35, 35, torch.device("cpu"))
    call = base.packed(cq, ck, sum(lq), sum(lk))
    name = "fwd_causal_document_d32_fp32"
    bm, bn = 16, 16
    lists = call.tl_sparse(name, bm, bn, False, lo, hi)
    full_cnt, full_idx, part_cnt, part_idx, sb, sh, nqb, nkb = lists
    assert (nqb, nkb) == (3, 3) and (sb, sh) == (1, 0)  # a list per sequence, heads shared
    first = full_cnt
    full_cnt, part_cnt = full_cnt.view(-1), part_cnt.view(-1)
    full_idx, part_idx = full_idx.view(-1, nkb), part_idx.view(-1, nkb)
    seen_states = set()
    for seq, (n_q, n_k) in enumerate(zip(lq, lk)):
        i = torch.arange(nqb * bm)[:, None]
        j = torch.arange(nkb * bn)[None, :]
        d = doc[seq].long()
        vis = (j <= i + n_k - n_q) & (j < n_k) & (d[i.clamp(max=34)] == d[j.clamp(max=34)])
        rows = i < n_q
        for m in range(nqb):
            tile = slice(m * bm, (m + 1) * bm)
            states = []
            for n in range(nkb):
                block = (vis & rows)[tile, n * bn:(n + 1) * bn]
                states.append(2 if block.all() else 1 if block.any() else 0)
            row = seq * nqb + m
            seen_states.update(states)
            assert full_cnt[row] == states.count(2) and part_cnt[row] == states.count(1)
            assert sorted(full_idx[row, :states.count(2)].tolist()) == \
                [n for n, s in enumerate(states) if s == 2]
            assert sorted(part_idx[row, :states.count(1)].tolist()) == \
                [n for n, s in enumerate(states) if s == 1]
    assert seen_states == {0, 1, 2}
    again = base.packed(cq, ck, sum(lq), sum(lk)).tl_sparse(name, bm, bn, False, lo, hi)
    assert again[0] is first, "cached by the mask's and cu_seqlens' tensors"
    cq[1:] = cu([20, 9, 26])[1:]  # in place: a new version of the same tensor
    changed = base.packed(cq, ck, 55, sum(lk)).tl_sparse(name, bm, bn, False, lo, hi)
    assert changed[0] is not first
    # sequence 1 had no queries (no tile of it visited); now its 9 x 9 causal tile is partial
    assert part_cnt[3:6].tolist() == [0, 0, 0] and changed[2].view(-1)[3:6].tolist() == [1, 0, 0]


def test_torch_compile_fullgraph(pkg):
    """Packed calls with mods are the mod_varlen_fwd / mod_varlen_bwd operators under
    torch.compile: fullgraph traces them; output and gradients (the bias's too) equal
    eager."""
    lq, lk = [9, 1, 20], [9, 4, 20]
    cq, ck = cu(lq), cu(lk)
    g = torch.Generator().manual_seed(7)
    q = torch.randn(sum(lq), 2, D, generator=g).requires_grad_()
    k = torch.randn(sum(lk), 2, D, generator=g).requires_grad_()
    v = torch.randn(sum(lk), 2, D, generator=g).requires_grad_()
    bias = torch.randn(3, 2, 20, 20, generator=g).requires_grad_()
    doc = documents(3, 20, "cpu")

    def f(q, k, v, bias):
        a = pkg.flash_attn_varlen_func(q, k, v, cq, ck, 20, 20, causal=True,
                                       mods=("document", "softcap"), doc=doc, cap=3.0)
        b = pkg.flash_attn_varlen_func(q, k, v, cq, ck, 20, 20, mods=("softcap", "sdpa_mask"),
                                       bias=bias, cap=3.0)
        return (a * a).sum() + (b * b).sum()

    with pkg._runtime.override_config(**TILE):
        eager = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_bad_mod_arguments(pkg):
    lq = [4, 6]
    q = torch.randn(10, 2, D)
    c = cu(lq)
    with pytest.raises(ValueError, match=r"mod `document`.*shape \(2, 5\).*N>=6"):
        pkg.flash_attn_varlen_func(q, q, q, c, c, 6, 6, mods=("document",),
                                   doc=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"mod `document`.*shape \(3, 6\).*B=2"):
        pkg.flash_attn_varlen_func(q, q, q, c, c, 6, 6, mods=("document",),
                                   doc=torch.zeros(3, 6, dtype=torch.int32))
    with pytest.raises(TypeError, match="need mods="):
        pkg.flash_attn_varlen_func(q, q, q, c, c, 6, 6, cap=2.0)
    with pytest.raises(ValueError, match=r"no kernel `fwd_alibi_d32_fp32` \(mask `none` with mods alibi\)"):
        pkg.flash_attn_varlen_func(q, q, q, c, c, 6, 6, mods=("alibi",),
                                   slope=torch.ones(2))


# ----------------------------------------------------------------------------------------
# On the GPU at the spec's own sizes: the Gluon varlen kernels with score and sink mods,
# the `tl` ones with a mask mod
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def full_pkg(tmp_path_factory):
    """specs/mods.yaml at its own head dims and dtypes (64 / 128, bf16 / fp16)."""
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    body = body.replace("decode: true", "decode: false")
    return build_and_import(tmp_path_factory.mktemp("varlen_mods_gpu"), "varlen_mods_gpu_t", body)


GPU_LQ = [127, 0, 1, 59, 257, 300, 1000, 64]
GPU_LK = [127, 3, 1, 300, 100, 300, 1000, 64]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (mods, causal, Hq, Hkv, d, dtype, families the forward / backward must run on Hopper)
    (("softcap",), True, 8, 2, 128, torch.bfloat16, "gluon gluon"),
    (("alibi",), True, 4, 4, 64, torch.float16, "gluon gluon"),
    (("sink_logits",), True, 4, 1, 128, torch.bfloat16, "gluon gluon"),
    (("document", "softcap"), True, 8, 2, 128, torch.bfloat16, "gluon gluon"),
    (("document",), True, 4, 4, 64, torch.float16, "gluon gluon"),
    (("prefix_lm",), False, 4, 4, 64, torch.bfloat16, "gluon gluon"),
    (("prefix_lm",), False, 8, 1, 128, torch.bfloat16, "gluon gluon"),
    (("window_sinks",), False, 4, 2, 128, torch.bfloat16, "gluon gluon"),
    (("softcap", "key_padding"), True, 4, 4, 128, torch.bfloat16, "gluon gluon"),
    # the bias gradient (sdpa_mask is `tl`-only: its bias is staged through shared memory)
    (("softcap", "sdpa_mask"), False, 4, 4, 64, torch.bfloat16, "tl tl"),
    # the mask mods' `tl` path, VARLEN_GLUON_MASK_MODS off
    (("document", "softcap"), True, 8, 2, 128, torch.bfloat16, "tl tl"),
], ids=["softcap-gqa4-d128", "alibi-d64-fp16", "sink-logits-gqa4", "document-softcap",
        "document-d64-fp16", "prefix-lm-d64", "prefix-lm-mqa-d128", "window-sinks-gqa2",
        "softcap-key-padding", "bias-gradient", "document-softcap-tl"])
def test_varlen_mods_on_the_gpu(full_pkg, poison, case, monkeypatch):
    """Packed batches with mods at the kernels' real sizes against float64, forward, LSE
    and gradients (the sink's and the bias's too): on Hopper the Gluon varlen kernels serve
    score, sink and mask mods (VARLEN_GLUON_MODS, VARLEN_GLUON_MASK_MODS: a mask mod's
    block lists per sequence); sdpa_mask's bias and its gradient run `tl`."""
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    pkg, rt = full_pkg, full_pkg._runtime
    mods, causal, h, h_kv, d, dtype, families = case
    fwd_family, bwd_family = families.split()
    forced = {"family": "gluon"}
    if fwd_family == bwd_family == "tl":
        monkeypatch.setattr(rt, "VARLEN_GLUON_MASK_MODS", False)
        forced = {}
    hopper = torch.cuda.get_device_capability() == (9, 0)
    g = torch.Generator().manual_seed(3)
    lq, lk = GPU_LQ, GPU_LK if not mods[0] in ("document", "prefix_lm") else GPU_LQ
    kw, score, mask, sink, grads = {}, None, None, None, ()
    bias = None
    if "softcap" in mods:
        kw["cap"] = 5.0
        score = lambda s, b, h_, i, j: 5.0 * torch.tanh(s / 5.0)  # noqa: E731
    if "alibi" in mods:
        slope = torch.rand(h, generator=g) * 0.1
        kw["slope"] = slope.cuda()
        score = lambda s, b, h_, i, j: s - slope.double()[h_] * (i - j).abs()  # noqa: E731
    if "sink_logits" in mods:
        kw["sinks"] = torch.randn(h, generator=g).cuda().requires_grad_()
        sink, grads = "sinks", ("sinks",)
    if "document" in mods:
        doc = documents(len(lq), max(lq), "cuda", seed=4)
        kw["doc"] = doc
        d_ids = doc.cpu().long()
        mask = lambda b, h_, i, j: d_ids[b, i] == d_ids[b, j]  # noqa: E731
    if "prefix_lm" in mods:
        prefix = torch.randint(0, 300, (len(lq),), generator=g, dtype=torch.int32)
        kw["prefix_len"] = prefix.cuda()
        mask = lambda b, h_, i, j: (j < prefix.long()[b]) | (j <= i)  # noqa: E731
    if "window_sinks" in mods:
        kw.update(sinks=4, window=100)
        mask = lambda b, h_, i, j: (j <= i) & ((j < 4) | (i - j <= 100))  # noqa: E731
    if "key_padding" in mods:
        keep = torch.rand(len(lk), max(lk), generator=g) > 0.3
        keep[0, :] = False  # a sequence whose rows see no key: 0 and LSE -inf
        kw["keep"] = keep.cuda()
        mask = lambda b, h_, i, j: keep[b, j]  # noqa: E731
    if "sdpa_mask" in mods:
        bias = torch.randn(len(lq), 1, max(lq), max(lk), generator=g)
        kw["bias"] = bias.cuda().requires_grad_()
        grads = ("bias",)
        cap_score = score
        score = lambda s, b, h_, i, j, bias: cap_score(s, b, h_, i, j) + bias[b, 0, i, j]  # noqa: E731
    make = lambda n, heads: torch.randn(n, heads, d, generator=g).to("cuda", dtype).requires_grad_()  # noqa: E731
    q, k, v = make(sum(lq), h), make(sum(lk), h_kv), make(sum(lk), h_kv)
    rt._forward_plans.clear()
    rt._backward_plans.clear()
    # (family asked for: a call this small would take `tl` for the Gluon kernels' fixed cost)
    with rt.override_config(**forced):
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cu(lq, "cuda"), cu(lk, "cuda"), max(lq),
                                              max(lk), causal=causal, mods=mods,
                                              return_lse=True, **kw)
        dout = torch.randn_like(out)
        out.backward(dout)
        torch.cuda.synchronize()
        (fplan,) = [p for p in rt._forward_plans.values() if p[0] is not None]
        (bplan,) = [p for p in rt._backward_plans.values() if p is not None]
    if hopper:
        assert (fplan[2] == rt._GLUON) == (fwd_family == "gluon")
        assert (bplan[-1] == rt._GLUON) == (bwd_family == "gluon")
    extra = [kw[t] for t in grads]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, *extra)]
    sink_ref = leaves[3] if sink else None
    if bias is not None:
        score = (lambda f, bias_: lambda *a: f(*a, bias=bias_))(score, leaves[3])
    ref, ref_lse = reference(*leaves[:3], lq, lk, causal=causal, score=score, mask=mask,
                             sink=sink_ref)
    want = torch.autograd.grad(ref, leaves, dout.detach().cpu().double())
    assert not torch.isnan(out).any()
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.detach().cpu().double(), ref.detach(), atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse.detach())
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse.detach()[finite], atol=1e-4,
                               rtol=1e-4)
    gatol, grtol = GRAD_TOL[dtype]
    for got, exp, name in zip((q.grad, k.grad, v.grad, *(t.grad for t in extra)), want,
                              ("dq", "dk", "dv", *(f"d{t}" for t in grads))):
        assert got is not None and not torch.isnan(got).any(), name
        torch.testing.assert_close(got.cpu().double(), exp, atol=gatol, rtol=grtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_which_family_a_packed_call_with_mods_takes(full_pkg, monkeypatch):
    """The reasons behind the family choice (no GPU needed: the device checks patched to an
    H100's): score, sink and mask mods may take the Gluon varlen kernels, unless
    VARLEN_GLUON_MODS (VARLEN_GLUON_MASK_MODS for a mask mod) is off and the family not
    asked for; a bias that wants its gradient takes the `tl` backward."""
    rt, mods = full_pkg._runtime, full_pkg._mods
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)
    q = torch.randn(4096, 16, 128, dtype=torch.bfloat16)
    cfg = {"family": "gluon"}

    def call(names, **kw):
        return mods.prepare(names, kw, 2, 16, 2048, 2048, torch.device("cpu"))

    softcap = call(("softcap",), cap=5.0)
    document = call(("document",), doc=torch.zeros(2, 2048, dtype=torch.int32))
    fwd, bwd = rt.gluon_varlen_reason, rt.gluon_varlen_backward_reason
    assert fwd("fwd_causal_softcap_d128_bf16", cfg, q, q, q, q, 2048, "causal", softcap) is None
    assert bwd("bwd_causal_softcap_d128_bf16", cfg, q, q, q, q, 2048, "causal", softcap) is None
    assert fwd("fwd_causal_document_d128_bf16", cfg, q, q, q, q, 2048, "causal", document) is None
    assert bwd("bwd_causal_document_d128_bf16", cfg, q, q, q, q, 2048, "causal", document) is None
    monkeypatch.setattr(rt, "VARLEN_GLUON_MASK_MODS", False)
    for why in (fwd("fwd_causal_document_d128_bf16", cfg, q, q, q, q, 2048, "causal", document),
                bwd("bwd_causal_document_d128_bf16", cfg, q, q, q, q, 2048, "causal", document)):
        assert why == rt.VARLEN_MODS_REASON
    with rt.override_config(family="gluon"):
        assert fwd("fwd_causal_document_d128_bf16", cfg, q, q, q, q, 2048, "causal",
                   document) is None
    # a mod tensor whose gradient the dK/dV kernel writes takes the `tl` backward, as a dense
    # call does (no shipped Gluon kernel has one yet: sdpa_mask's bias is `tl`-only, so its
    # registry entry is patched to pass the variant check; validated at a small shape, the
    # reasons read the packed tensors', not the mods')
    monkeypatch.setitem(rt.GLUON, "bwd_softcap_sdpa_mask_d128_bf16", None)
    bias = mods.prepare(("softcap", "sdpa_mask"), {"cap": 5.0, "bias": torch.zeros(2, 1, 64, 64)},
                        2, 16, 64, 64, torch.device("cpu"))
    assert bwd("bwd_softcap_sdpa_mask_d128_bf16", cfg, q, q, q, q, 2048, "none", bias) is None
    mods._want_grads(bias, {"bias": True}, torch.device("cpu"))
    assert "gradient of mod tensor(s) bias" in bwd("bwd_softcap_sdpa_mask_d128_bf16", cfg, q, q,
                                                   q, q, 2048, "none", bias)
    monkeypatch.setattr(rt, "VARLEN_GLUON_MODS", False)
    assert "VARLEN_GLUON_MODS" in fwd("fwd_causal_softcap_d128_bf16", cfg, q, q, q, q, 2048,
                                      "causal", softcap)
    with rt.override_config(family="gluon"):
        assert fwd("fwd_causal_softcap_d128_bf16", cfg, q, q, q, q, 2048, "causal",
                   softcap) is None


_COMPILE = r"""
import json, sys
from pathlib import Path
from flashgen import gluon_compile
res = gluon_compile.compile_package(Path(sys.argv[1]), variants=sys.argv[2].split(","),
                                    varlen=True)
print(json.dumps([r.__dict__ for r in res]))
"""


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_gluon_varlen_kernels_with_mods_compile_for_sm90():
    """The packed (VARLEN) forms of the shipped Gluon kernels with a score mod, a sink and
    a mask mod (block lists per sequence) compile for sm_90 beside their dense forms, with
    the same wgmma products, register split and shared memory; the forward's key loops
    keep no spill. Measured when written (d=128 bf16, stack bytes / key-loop LDL+STL, dense
    -> packed): forward softcap 104 / 0 -> 112 / 0, sink_logits 136 / 0 -> 112 / 0, document
    8 / 0 -> 56 / 0; backward softcap 184 / 80 -> 232 / 113 (the dense softcap backward
    already spills in its loop: f5be0f5), document 96 / 6 -> 152 / 20."""
    import json
    import os
    import subprocess
    import sys

    names = ["fwd_causal_softcap_d128_bf16", "fwd_causal_sink_logits_d128_bf16",
             "bwd_causal_softcap_d128_bf16", "bwd_causal_sink_logits_d128_bf16",
             "fwd_causal_document_d128_bf16", "bwd_causal_document_d128_bf16"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(ROOT / "generated" / "mods_attn"),
                          ",".join(names)], capture_output=True, text=True, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    pairs = {}
    for r in rows:
        pairs.setdefault(r["variant"], [None, None])[r["config"].startswith("varlen")] = r
    assert set(pairs) == set(names) and all(None not in p for p in pairs.values())
    for name, (dense, packed) in pairs.items():
        assert packed["shared"] <= 232448 and packed["shared"] <= dense["shared"] + 256, packed
        assert packed["wgmma"] == dense["wgmma"] > 0, packed
        assert packed["setmaxnreg"] == dense["setmaxnreg"], packed
        if name.startswith("fwd"):
            assert packed["loop_spills"] == 0 and packed["spill_bytes"] <= 160, packed
        else:
            assert packed["loop_spills"] is not None, packed
            assert packed["loop_spills"] <= dense["loop_spills"] + 48, packed
