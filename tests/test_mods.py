"""Attention mods (score mods, mask mods with block sparsity, sinks) and SDPA's attn_mask,
against a float64 PyTorch reference that applies each mod by hand (not through flashgen's
expression compiler), forward and every gradient.

The package is specs/mods.yaml -- every built-in and every combination it ships -- built
at a test size (head dim 32, fp32 and bf16) so the interpreter gets through it; tiles of
16 x 16 put several blocks (empty, full and partial ones) in every call."""
from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, OUT_TOL
from packages import build_and_import

ROOT = Path(__file__).resolve().parent.parent
TILE = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    body = re.sub(r"head_dims: \[.*\]", "head_dims: [32]", body)
    body = re.sub(r"dtypes: \[.*\]", "dtypes: [fp32, bf16]", body)
    return build_and_import(tmp_path_factory.mktemp("mods"), "mods_t", body)


# ----------------------------------------------------------------------------------------
# The reference: float64, each mod written out in PyTorch
# ----------------------------------------------------------------------------------------
def reference(q, k, v, *, causal=False, score=None, mask=None, sink=None, scale=None):
    """q (B, Nq, H, d), k/v (B, Nk, Hkv, d) -> out (B, Nq, H, d), lse (B, H, Nq); causal
    bottom-right; score(s, b, h, i, j) and mask(b, h, i, j) on broadcast index grids;
    sink a [H] tensor of logits."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    n_q, n_k = q.shape[2], k.shape[2]
    s = q @ k.transpose(-1, -2) * (scale or 1 / math.sqrt(q.shape[-1]))
    b = torch.arange(q.shape[0])[:, None, None, None]
    h = torch.arange(q.shape[1])[None, :, None, None]
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
        s = torch.cat([s, sink.double()[None, :, None, None].expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    if sink is not None:
        p = p[..., :-1]
    return (p @ v).transpose(1, 2), lse


def inputs(b, n_q, n_k, h, h_kv, d, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    make = lambda n, heads: torch.randn(b, n, heads, d, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return make(n_q, h), make(n_k, h_kv), make(n_k, h_kv)


def check(pkg, device, dtype, *, causal=False, mods, kw, score=None, mask=None, sink=None,
          b=2, n_q=37, n_k=37, h=2, h_kv=2, d=32, grads=()):
    """Forward, LSE and gradients of q, k, v (and of the tensors named in `grads`) against
    the reference; NaN fails."""
    q, k, v = inputs(b, n_q, n_k, h, h_kv, d, dtype, device)
    with pkg._runtime.override_config(**TILE):
        out, lse = pkg.flash_attn_func(q, k, v, causal=causal, mods=mods, return_lse=True, **kw)
        dout = torch.randn_like(out)
        out.backward(dout)
    ref, ref_lse = reference(q.detach().cpu(), k.detach().cpu(), v.detach().cpu(),
                             causal=causal, score=score, mask=mask,
                             sink=None if sink is None else kw[sink].detach().cpu())
    extra = [kw[t] for t in grads]
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, *extra)]
    ref_kw = {name: leaves[3 + n] for n, name in enumerate(grads)}
    ref_out, _ = reference(*leaves[:3], causal=causal,
                           score=None if score is None else (lambda *a: score(*a, **ref_kw)),
                           mask=mask, sink=leaves[3] if sink in grads else
                           (None if sink is None else kw[sink].detach().cpu()))
    want = torch.autograd.grad(ref_out, leaves, dout.detach().cpu().double(), allow_unused=True)
    atol, rtol = OUT_TOL[dtype]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.detach().cpu().double(), ref, atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    gatol, grtol = GRAD_TOL[dtype]
    for got, exp, name in zip((q.grad, k.grad, v.grad, *(t.grad for t in extra)), want,
                              ("dq", "dk", "dv", *(f"d{t}" for t in grads))):
        assert got is not None and not torch.isnan(got).any(), name
        torch.testing.assert_close(got.cpu().double(), exp, atol=gatol, rtol=grtol, msg=name)


def documents(b, n, device, seed=1):
    """Ragged documents: each row's ids are sorted, lengths random."""
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randint(0, 4, (b, n), generator=g), -1).values.to(torch.int32).to(device)


CAP = 50.0


# ----------------------------------------------------------------------------------------
# Every built-in and combination of specs/mods.yaml
# ----------------------------------------------------------------------------------------
def test_softcap_causal(pkg, device):
    # cap 2: small enough that tanh bends every score of this test
    check(pkg, device, torch.float32, causal=True, mods=("softcap",), kw={"cap": 2.0},
          score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0))


def test_softcap_bf16_gqa_ragged(pkg, device):
    # GQA 4:1, N_q != N_k (bottom-right causal), bf16
    check(pkg, device, torch.bfloat16, causal=True, mods=("softcap",), kw={"cap": 3.0},
          score=lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0), n_q=23, n_k=41, h=4, h_kv=1)


def test_alibi_causal(pkg, device):
    slope = torch.tensor([0.5, 0.125], device=device)
    check(pkg, device, torch.float32, causal=True, mods=("alibi",), kw={"slope": slope},
          score=lambda s, b, h, i, j: s - slope.cpu().double()[h] * (i - j).abs())


@pytest.mark.parametrize("n", [1, 59], ids=["N1", "N59"])
def test_document_causal(pkg, device, n):
    doc = documents(3, n, device)
    d = doc.cpu().long()
    check(pkg, device, torch.float32, causal=True, mods=("document",), kw={"doc": doc},
          mask=lambda b, h, i, j: d[b, i] == d[b, j], b=3, n_q=n, n_k=n)


def test_document_softcap_gqa(pkg, device):
    doc = documents(2, 37, device)
    d = doc.cpu().long()
    check(pkg, device, torch.float32, causal=True, mods=("document", "softcap"),
          kw={"doc": doc, "cap": 2.0}, score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
          mask=lambda b, h, i, j: d[b, i] == d[b, j], h=4, h_kv=1)


def test_softcap_key_padding_gqa(pkg, device):
    # Gemma 2 on a padded batch: a score mod listed before a mask mod (the kernels take the
    # tensors before the params whatever the order), right and left padding (left-padded
    # query rows see no key: 0 and LSE -inf), N_q != N_k
    keep = torch.ones(2, 41, dtype=torch.bool)
    keep[0, 30:] = False
    keep[1, :9] = False
    check(pkg, device, torch.float32, causal=True, mods=("softcap", "key_padding"),
          kw={"keep": keep.to(device), "cap": 2.0},
          score=lambda s, b, h, i, j: 2.0 * torch.tanh(s / 2.0),
          mask=lambda b, h, i, j: keep[b, j], n_q=37, n_k=41, h=4, h_kv=2)


def test_prefix_lm(pkg, device):
    prefix = torch.tensor([5, 30], dtype=torch.int32, device=device)
    p = prefix.cpu().long()
    check(pkg, device, torch.float32, mods=("prefix_lm",), kw={"prefix_len": prefix},
          mask=lambda b, h, i, j: (j < p[b]) | (j <= i))


def test_window_sinks(pkg, device):
    check(pkg, device, torch.float32, mods=("window_sinks",), kw={"sinks": 3, "window": 9},
          mask=lambda b, h, i, j: (j <= i) & ((j < 3) | (i - j <= 9)), n_q=59, n_k=59)


def test_sink_logits_with_gradient(pkg, device):
    sinks = torch.tensor([0.7, -1.5], device=device).requires_grad_()
    check(pkg, device, torch.float32, causal=True, mods=("sink_logits",), kw={"sinks": sinks},
          sink="sinks", grads=("sinks",))


def test_relative_bias(pkg, device):
    rel = torch.randn(2, 2 * 6 + 1, generator=torch.Generator().manual_seed(3)).to(device)
    r = rel.cpu().double()
    check(pkg, device, torch.float32, mods=("relative_bias",),
          kw={"rel_bias": rel, "max_distance": 6},
          score=lambda s, b, h, i, j: s + r[h, (j - i + 6).clamp(0, 12)])


# ----------------------------------------------------------------------------------------
# scaled_dot_product_attention(attn_mask=...)
# ----------------------------------------------------------------------------------------
def sdpa_reference(q, k, v, bias):
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1]) + bias
    return torch.softmax(s, -1) @ v.double()


def test_sdpa_float_bias_gradient(pkg, device):
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 2, n, 32, generator=g).to(device).requires_grad_()
               for n in (37, 29, 29))
    bias = torch.randn(1, 2, 37, 29, generator=g).to(device).requires_grad_()  # broadcast over B
    with pkg._runtime.override_config(**TILE):
        out = pkg.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        dout = torch.randn_like(out)
        out.backward(dout)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v, bias)]
    ref = sdpa_reference(*leaves)
    want = torch.autograd.grad(ref, leaves, dout.cpu().double())
    torch.testing.assert_close(out.detach().cpu().double(), ref, atol=2e-5, rtol=2e-5)
    for got, exp, name in zip((q.grad, k.grad, v.grad, bias.grad), want, "qkvb"):
        assert got.shape == exp.shape, name
        torch.testing.assert_close(got.cpu().double(), exp, atol=1e-4, rtol=1e-4, msg=name)


def test_sdpa_bool_padding_mask_and_empty_row(pkg, device):
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(3, 2, 33, 32, generator=g).to(device) for _ in range(3))
    keep = torch.ones(3, 1, 1, 33, dtype=torch.bool)
    keep[1, ..., 20:] = False  # padding of batch 1
    keep = keep.expand(3, 1, 33, 33).clone()
    keep[2, 0, 7] = False  # one query row sees nothing: its output must be 0
    keep = keep.to(device)
    with pkg._runtime.override_config(**TILE):
        out = pkg.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    bias = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep.cpu(), float("-inf"))
    ref = torch.nan_to_num(sdpa_reference(q.cpu(), k.cpu(), v.cpu(), bias), nan=0.0)
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.cpu().double(), ref, atol=2e-5, rtol=2e-5)
    assert out[2, :, 7].abs().max() == 0


def test_empty_row_poisoned_output(pkg):
    # the runtime writes into a NaN-poisoned output: every row is written, a row that sees
    # nothing gets 0 and LSE -inf
    q, k, v = (t.detach().transpose(1, 2).contiguous()
               for t in inputs(1, 5, 16, 2, 2, 32, torch.float32, "cpu"))
    keep = torch.ones(1, 1, 5, 16, dtype=torch.bool)
    keep[..., 3, :] = False
    out = torch.full_like(q, float("nan"))
    bias = pkg._mods.sdpa_mask(keep, q, k)
    call = pkg._mods.prepare(("sdpa_mask",), {"bias": bias}, 1, 2, 5, 16, q.device)
    with torch.no_grad(), pkg._runtime.override_config(**TILE):
        lse = pkg._runtime.forward(q, k, v, out, mask="none", lo=-100, hi=100,
                                   scale=32 ** -0.5, mods=call)
    assert not torch.isnan(out).any()
    assert (out[:, :, 3] == 0).all() and torch.isneginf(lse[:, :, 3]).all()
    ref, ref_lse = reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                             mask=lambda b, h, i, j: i != 3)
    torch.testing.assert_close(out.transpose(1, 2).double(), ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double()[:, :, [0, 1, 2, 4]], ref_lse[:, :, [0, 1, 2, 4]])


# ----------------------------------------------------------------------------------------
# Block sparsity: the lists the kernels walk
# ----------------------------------------------------------------------------------------
def test_block_mask_matches_brute_force_and_is_cached(pkg):
    doc = documents(2, 70, "cpu")
    call = pkg._mods.prepare(("document",), {"doc": doc}, 2, 2, 70, 70, torch.device("cpu"))
    lo, hi = -71, 0  # causal
    name = "fwd_causal_document_d32_fp32"
    before = len(pkg._mods._states)
    lists = call.sparse(name, 16, 32, False, lo, hi)
    assert call.sparse(name, 16, 32, False, lo, hi) is lists  # cached by the mask's inputs
    assert len(pkg._mods._states) == before + 1
    # ... for that tensor object only: an equal tensor that is another object (as a new
    # one at a freed one's address would be) recomputes; an inference tensor (no version
    # counter) is not cached
    other = pkg._mods.prepare(("document",), {"doc": doc.clone()}, 2, 2, 70, 70,
                              torch.device("cpu"))
    other.mask_key = call.mask_key
    assert other.sparse(name, 16, 32, False, lo, hi) is not lists
    with torch.inference_mode():
        frozen = pkg._mods.prepare(("document",), {"doc": doc.clone()}, 2, 2, 70, 70,
                                   torch.device("cpu"))
        assert frozen.mask_key is None
        assert frozen.sparse(name, 16, 32, False, lo, hi) is not frozen.sparse(name, 16, 32, False, lo, hi)
    full_cnt, full_idx, part_cnt, part_idx, sb, sh = lists
    assert (sb, sh) == (1, 0)  # the document mask depends on b, not on h
    i, j = torch.arange(70)[:, None], torch.arange(70)[None, :]
    for b in range(2):
        vis = (doc[b][:, None] == doc[b][None, :]) & (j <= i)
        for m in range(5):
            rows = vis[m * 16:(m + 1) * 16]
            want_full, want_part = [], []
            for n in range(3):
                tile = rows[:, n * 32:(n + 1) * 32]
                whole = tile.shape[0] == 16 and tile.shape[1] == 32 and bool(tile.all())
                if whole:
                    want_full.append(n)
                elif tile.any():
                    want_part.append(n)
            assert full_idx[b, m, :full_cnt[b, m]].tolist() == want_full
            assert part_idx[b, m, :part_cnt[b, m]].tolist() == want_part
    # a new document layout (same tensor, written in place) is a new block mask
    doc[0, :] = 0
    call2 = pkg._mods.prepare(("document",), {"doc": doc}, 2, 2, 70, 70, torch.device("cpu"))
    assert call2.sparse(name, 16, 32, False, lo, hi) is not lists
    # ... and so is another tensor with the same address, version and layout (a view of
    # the same storage stands in for a freed tensor whose memory came back)
    alias = doc.view(doc.shape)
    call3 = pkg._mods.prepare(("document",), {"doc": alias}, 2, 2, 70, 70, torch.device("cpu"))
    assert call3.mask_key == call2.mask_key
    assert call3.sparse(name, 16, 32, False, lo, hi) is not call2.sparse(name, 16, 32, False, lo, hi)


# ----------------------------------------------------------------------------------------
# Bad mod arguments: errors before any launch, naming the spec entry
# ----------------------------------------------------------------------------------------
def test_bad_mod_arguments(pkg):
    q, k, v = inputs(2, 8, 8, 2, 2, 32, torch.float32, "cpu")
    with pytest.raises(ValueError, match=r"mods\.document.*`doc` has shape \(2, 5\)"):
        pkg.flash_attn_func(q, k, v, mods=("document",), doc=torch.zeros(2, 5, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"`doc` is torch.int64, declared int32"):
        pkg.flash_attn_func(q, k, v, mods=("document",), doc=torch.zeros(2, 8, dtype=torch.int64))
    with pytest.raises(TypeError, match=r"reads tensor `doc`"):
        pkg.flash_attn_func(q, k, v, mods=("document",))
    with pytest.raises(TypeError, match=r"unexpected argument\(s\) \['cap'\]"):
        pkg.flash_attn_func(q, k, v, mods=("document",), doc=torch.zeros(2, 8, dtype=torch.int32),
                            cap=3.0)
    with pytest.raises(ValueError, match=r"unknown mod 'softcapp'"):
        pkg.flash_attn_func(q, k, v, mods=("softcapp",))
    with pytest.raises(ValueError, match=r"no kernel `fwd_softcap_d32_fp32`.*add an entry"):
        pkg.flash_attn_func(q, k, v, causal=False, mods=("softcap",))
    with pytest.raises(NotImplementedError, match=r"`slope` requires grad"):
        pkg.flash_attn_func(q, k, v, causal=True, mods=("alibi",),
                            slope=torch.ones(2, requires_grad=True))
    with pytest.raises(ValueError, match="cannot both be set"):
        pkg.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=torch.ones(8, 8, dtype=torch.bool),
                                         is_causal=True)
    with pytest.raises(ValueError, match="does not broadcast"):
        pkg.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                         attn_mask=torch.ones(3, 8, 8, dtype=torch.bool))


def test_describe_lists_mods(pkg):
    text = pkg.describe()
    assert "softcap" in text and "cap * tanh(score / cap)" in text
    assert "doc[b, q_idx] == doc[b, kv_idx]" in text


def test_torch_compile_fullgraph_with_mods_and_bias_gradient(pkg):
    """Calls with mods are custom operators under torch.compile: fullgraph traces them, and
    the compiled forward and gradients (the bias's included) equal the eager ones."""
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 21, 32, generator=g).requires_grad_() for _ in range(3))
    bias = torch.randn(1, 2, 21, 21, generator=g).requires_grad_()
    doc = documents(1, 21, "cpu")

    def f(q, k, v, bias):
        a = pkg.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        b = pkg.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                causal=True, mods=("document", "softcap"), doc=doc, cap=3.0)
        return (a * a).sum() + (b * b).sum()

    with pkg._runtime.override_config(**TILE):
        eager = torch.autograd.grad(f(q, k, v, bias), (q, k, v, bias))
        compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
        got = torch.autograd.grad(compiled(q, k, v, bias), (q, k, v, bias))
    for a, b in zip(got, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("mods, kw", [(("softcap",), {"cap": 20.0}), (("alibi",), None),
                                      (("sink_logits",), None)], ids=["softcap", "alibi", "sinks"])
def test_gluon_forward_with_mods_on_hopper(mods, kw):
    """The shipped mods package's Gluon forward (score mods, sinks) against the `tl`
    kernel and float64, bf16 d=128 (FLASHGEN_FAMILY=gluon forces it)."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon kernels run on Hopper only")
    import importlib
    import sys
    sys.path.insert(0, str(ROOT / "generated"))
    pkg = importlib.import_module("mods_attn")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 300, 16, 128, generator=g).cuda().bfloat16() for _ in range(3))
    if mods == ("alibi",):
        kw = {"slope": torch.tensor([2.0 ** (-(i + 1) / 2) for i in range(16)], device="cuda")}
    if mods == ("sink_logits",):
        kw = {"sinks": torch.randn(16, generator=g).cuda()}
    pkg._runtime.use_family("gluon")
    try:
        out = pkg.flash_attn_func(q, k, v, causal=True, mods=mods, **kw)
    finally:
        pkg._runtime.use_family("")
    pkg._runtime.use_family("tl")
    try:
        ref = pkg.flash_attn_func(q, k, v, causal=True, mods=mods, **kw)
    finally:
        pkg._runtime.use_family("")
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


def test_sdpa_attn_mask_with_a_score_mod(pkg, device):
    """attn_mask together with mods=...: the spec's {mods: [softcap, sdpa_mask]} variant,
    the mask added after the softcap (Gemma 2 with an arbitrary mask)."""
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(2, 2, 29, 32, generator=g).to(device).requires_grad_()
               for _ in range(3))
    keep = torch.rand(2, 1, 29, 29, generator=g) > 0.3
    keep[..., 0] = True  # every row sees a key
    with pkg._runtime.override_config(**TILE):
        out = pkg.scaled_dot_product_attention(q, k, v, attn_mask=keep.to(device),
                                               mods=("softcap",), cap=2.0)
        dout = torch.randn_like(out)
        out.backward(dout)
    leaves = [t.detach().cpu().double().requires_grad_() for t in (q, k, v)]
    s = 2.0 * torch.tanh(leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(32) / 2.0)
    ref = torch.softmax(s.masked_fill(~keep, float("-inf")), -1) @ leaves[2]
    want = torch.autograd.grad(ref, leaves, dout.cpu().double())
    torch.testing.assert_close(out.detach().cpu().double(), ref, atol=2e-5, rtol=2e-5)
    for got, exp in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got.cpu().double(), exp, atol=1e-4, rtol=1e-4)


def test_merged_block_list_for_the_gluon_forward(pkg):
    """The Gluon forward's block mask: one list per query block in the order its producer
    and consumers walk it (the full blocks, then the partial ones), equal to the `tl`
    kernels' two lists laid end to end; cached apart from them."""
    doc = documents(3, 150, "cpu", seed=4)
    call = pkg._mods.prepare(("document",), {"doc": doc}, 3, 2, 150, 150, torch.device("cpu"))
    name, lo, hi = "fwd_causal_document_d32_fp32", -151, 0
    full_cnt, full_idx, part_cnt, part_idx, sb, sh = call.sparse(name, 32, 16, False, lo, hi)
    merged = call.sparse(name, 32, 16, False, lo, hi, merged=True)
    assert call.sparse(name, 32, 16, False, lo, hi, merged=True) is merged  # cached
    m_full, m_part, idx, m_sb, m_sh = merged
    assert (m_sb, m_sh) == (sb, sh) == (1, 0)
    assert torch.equal(m_full, full_cnt) and torch.equal(m_part, part_cnt)
    assert idx.dtype == torch.int32 and idx.shape == full_idx.shape
    for g in range(3):
        for m in range(idx.shape[1]):
            f, p = int(full_cnt[g, m]), int(part_cnt[g, m])
            want = full_idx[g, m, :f].tolist() + part_idx[g, m, :p].tolist()
            assert idx[g, m, :f + p].tolist() == want


def test_gluon_backward_program_order(pkg, monkeypatch):
    """The Gluon backward's program order (_mods._program_order): a permutation of the
    (batch, K/V head, key block) programs whose cost classes (the lists' lengths, a
    program's query heads summed under GQA) never grow along the grid, head-major within
    a class; head-major throughout at BWD_ORDER_QUANTUM = 0; cached with the lists."""
    mods = pkg._mods
    n, batch, h_q, h_kv, bm, bn = 200, 3, 4, 2, 16, 32
    lo, hi = -201, 0  # causal
    name = "fwd_causal_document_d32_fp32"
    doc = documents(batch, n, "cpu", seed=7)
    call = mods.prepare(("document",), {"doc": doc}, batch, h_q, n, n, torch.device("cpu"))
    nkb = -(-n // bn)
    out = call.sparse(name, bm, bn, True, lo, hi, order_heads=h_kv)
    lists, order = out[:-1], out[-1]
    assert lists == call.sparse(name, bm, bn, True, lo, hi)  # the lists themselves unchanged
    assert call.sparse(name, bm, bn, True, lo, hi, order_heads=h_kv)[-1] is order  # cached
    assert order.dtype == torch.int32
    assert sorted(order.tolist()) == list(range(batch * h_kv * nkb))
    # each program's cost, by brute force over the mask (not through the lists)
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    cost = torch.zeros(batch, h_kv, nkb)
    for b in range(batch):
        vis = (doc[b][:, None] == doc[b][None, :]) & (j <= i)
        for kb in range(nkb):
            full = part = 0
            for m in range(-(-n // bm)):
                tile = vis[m * bm:(m + 1) * bm, kb * bn:(kb + 1) * bn]
                if tile.shape == (bm, bn) and bool(tile.all()):
                    full += 1
                elif tile.any():
                    part += 1
            # every query head of the K/V head walks the same lists (the mask ignores h)
            cost[b, :, kb] = (h_q // h_kv) * (full + mods.BWD_PARTIAL_WEIGHT * part
                                              + mods.BWD_PROGRAM_STEPS)
    cost = cost.view(-1)
    cls = torch.floor(cost / (cost.mean() * mods.BWD_ORDER_QUANTUM))[order.long()]
    assert (cls[1:] <= cls[:-1]).all()  # longest classes first
    assert cls[0] > cls[-1]  # (the case has more than one class)
    same = cls[1:] == cls[:-1]
    assert (order[1:][same] > order[:-1][same]).all()  # head-major within a class
    monkeypatch.setattr(mods, "BWD_ORDER_QUANTUM", 0.0)
    head_major = call.sparse(name, bm, bn, True, lo, hi, order_heads=h_kv)[-1]
    assert head_major.tolist() == list(range(batch * h_kv * nkb))


def test_gluon_forward_tile_table(pkg, monkeypatch):
    """The persistent Gluon forward's tile deal for a block mask (_mods._tile_table): the
    table's offsets and tiles give every (batch, head, query block) tile to exactly one
    program; along each program's list the cost classes (its block lists' lengths, by
    brute force over the mask here) never grow; cached with the lists. At
    FWD_ORDER_QUANTUM = 0 it is the kernel's own LONGEST_FIRST deal (_tile_coords),
    written out here tile by tile."""
    mods = pkg._mods
    n, batch, h_q, bm, bn, programs, head_group = 200, 3, 4, 16, 32, 7, 3
    lo, hi = -201, 0  # causal
    name = "fwd_causal_document_d32_fp32"
    doc = documents(batch, n, "cpu", seed=7)
    call = mods.prepare(("document",), {"doc": doc}, batch, h_q, n, n, torch.device("cpu"))
    num_m = -(-n // bm)
    tiles = batch * h_q * num_m
    lists = call.sparse(name, bm, bn, False, lo, hi, merged=True)
    table = call.tile_table(lists, name, bm, bn, lo, hi, programs, head_group)
    assert call.tile_table(lists, name, bm, bn, lo, hi, programs, head_group) is table  # cached
    assert table.dtype == torch.int32 and table.shape == (programs + 1 + tiles,)
    off, dealt = table[:programs + 1].tolist(), table[programs + 1:]
    assert off[0] == 0 and off[-1] == tiles and all(a <= b for a, b in zip(off, off[1:]))
    assert sorted(dealt.tolist()) == list(range(tiles))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    cost = torch.zeros(batch, h_q, num_m)
    for b in range(batch):
        vis = (doc[b][:, None] == doc[b][None, :]) & (j <= i)
        for m in range(num_m):
            full = part = 0
            for kb in range(-(-n // bn)):
                tile = vis[m * bm:(m + 1) * bm, kb * bn:(kb + 1) * bn]
                if tile.shape == (bm, bn) and bool(tile.all()):
                    full += 1
                elif tile.any():
                    part += 1
            cost[b, :, m] = full + mods.FWD_PARTIAL_WEIGHT * part + pkg._families.TILE_FIXED_COST
    cost = cost.view(-1)
    cls = torch.floor(cost / (cost.mean() * mods.FWD_ORDER_QUANTUM))
    assert cls.max() > cls.min()  # (the case has more than one class)
    for p in range(programs):
        mine = cls[dealt[off[p]:off[p + 1]].long()]
        assert (mine[1:] <= mine[:-1]).all()  # longest classes first
    monkeypatch.setattr(mods, "FWD_ORDER_QUANTUM", 0.0)
    kernel_deal = call.tile_table(lists, name, bm, bn, lo, hi, programs, head_group)
    bh_n, want = batch * h_q, [[] for _ in range(programs)]
    for k in range(-(-tiles // programs)):
        for p in range(programs):
            t = k * programs + (programs - 1 - p if k % 2 else p)
            if t >= tiles:
                continue
            g0 = t // (head_group * num_m) * head_group
            g_size = min(head_group, bh_n - g0)
            r = t - g0 * num_m
            want[p].append((g0 + r % g_size) * num_m + num_m - 1 - r // g_size)
    offsets = [0]
    for lst in want:
        offsets.append(offsets[-1] + len(lst))
    assert kernel_deal.tolist() == offsets + [t for lst in want for t in lst]


# ----------------------------------------------------------------------------------------
# The Gluon forward with mods on Hopper (-m gpu): mask mods walk the block mask
# ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gluon_pkg(tmp_path_factory):
    """specs/mods.yaml at its own head dims and dtypes (the Gluon kernels' sizes), plus
    a mask mod with a score mod and a sink in one variant (and a window with sinks and
    sink logits, gpt-oss's pair)."""
    text = (ROOT / "specs" / "mods.yaml").read_text()
    body = text.split("package: mods_attn", 1)[1].split("\ngpu:", 1)[0]
    body = body.replace("decode: true", "decode: false")
    # (sink_logits' tensor shares its name with window_sinks' param: a sink of its own)
    body = body.replace("\nvariants:\n", "\n  head_sink: {sink: \"sink_w[h]\", tensors: {sink_w: \"[H] fp32\"}}\n"
                        "\nvariants:\n"
                        "  - {mask: causal, mods: [document, softcap, sink_logits]}\n"
                        "  - {mask: none, mods: [window_sinks, head_sink]}\n")
    return build_and_import(tmp_path_factory.mktemp("gmods"), "mods_gluon_t", body)


def _gluon_case(mods, b, n_q, n_k, h, device):
    """(keyword arguments, score, mask, sink name) of one mask-mod case."""
    kw, score, masks, sink = {}, None, [], None
    g = torch.Generator().manual_seed(11)
    if "document" in mods:
        doc = documents(b, n_q, device, seed=2)
        d = doc.cpu().long()
        kw["doc"] = doc
        masks.append(lambda b_, h_, i, j: d[b_, i] == d[b_, j])
    if "prefix_lm" in mods:
        prefix = torch.randint(1, n_k, (b,), generator=g, dtype=torch.int32)
        kw["prefix_len"] = prefix.to(device)
        masks.append(lambda b_, h_, i, j: (j < prefix.long()[b_]) | (j <= i))
    if "window_sinks" in mods:
        kw.update(sinks=4, window=100)
        masks.append(lambda b_, h_, i, j: (j <= i) & ((j < 4) | (i - j <= 100)))
    if "key_padding" in mods:
        keep = torch.ones(b, n_k, dtype=torch.bool)
        keep[0, n_k - 70:] = False  # right padding
        keep[-1, :100] = False  # left padding: the first query rows see no key
        kw["keep"] = keep.to(device)
        masks.append(lambda b_, h_, i, j: keep[b_, j])
    if "softcap" in mods:
        kw["cap"] = 5.0
        score = lambda s, b_, h_, i, j: 5.0 * torch.tanh(s / 5.0)  # noqa: E731
    if "sink_logits" in mods or "head_sink" in mods:
        sink = "sinks" if "sink_logits" in mods else "sink_w"
        kw[sink] = torch.randn(h, generator=g).to(device)
    mask = None
    if masks:
        def mask(b_, h_, i, j):
            out = masks[0](b_, h_, i, j)
            for m in masks[1:]:
                out = out & m(b_, h_, i, j)
            return out
    return kw, score, mask, sink


def _plan_families(pkg):
    return {type(p[0].fn).__name__ for p in pkg._runtime._forward_plans.values()
            if p[0] is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (mods, causal, B, Nq, Nk, Hq, Hkv, d, dtype)
    (("document",), True, 3, 257, 257, 8, 2, 128, torch.bfloat16),
    (("document",), True, 2, 2048, 2048, 8, 8, 128, torch.bfloat16),  # persistent rounds
    (("document", "softcap"), True, 3, 59, 59, 4, 1, 64, torch.float16),
    (("prefix_lm",), False, 2, 257, 700, 4, 4, 128, torch.bfloat16),
    (("prefix_lm",), False, 3, 1031, 1031, 8, 2, 64, torch.bfloat16),
    (("window_sinks",), False, 2, 1000, 1000, 4, 2, 64, torch.bfloat16),
    (("window_sinks",), False, 1, 4096, 4096, 4, 1, 128, torch.float16),
    (("softcap", "key_padding"), True, 3, 257, 300, 8, 2, 128, torch.bfloat16),
    (("document", "softcap", "sink_logits"), True, 3, 300, 300, 4, 1, 128, torch.bfloat16),
    (("window_sinks", "head_sink"), False, 2, 777, 777, 4, 4, 128, torch.bfloat16),
    # a sink over 3-4 tiles a program: `overlap` normalises (sink included) at a tile's
    # end and stores in the next tile's iteration
    (("document", "softcap", "sink_logits"), True, 4, 1024, 1024, 16, 4, 64, torch.bfloat16),
], ids=["document-b3-gqa4", "document-2k", "document-softcap-n59-d64", "prefix-nq<nk",
        "prefix-1031-d64", "window-sinks", "window-sinks-4k-fp16", "softcap-padding-empty-rows",
        "document-softcap-sink", "window-sinks-head-sink", "document-softcap-sink-rounds"])
@pytest.mark.parametrize("knobs", [{}, {"block_n": 64, "num_stages": 3, "pingpong": False,
                                        "persistent": False, "regs": "224/56"},
                                   {"overlap": True, "q_buffers": 2, "diag_first": True},
                                   # many tiles a program: the block mask's deal (TILE_TABLE)
                                   # on every case, not only the large ones
                                   {"programs": 5}],
                         ids=["default", "knobs", "overlap-diag-first", "five-programs"])
def test_gluon_forward_with_mask_mods_against_float64(gluon_pkg, poison, case, knobs):
    """The Gluon forward of every mask mod (block-sparse: lists at its 128-row tile) and of
    a mask mod with a score mod and a sink against float64: ragged ends, Nq != Nk, GQA,
    batch 3, rows that see no key (0, LSE -inf); the Gluon kernel must be what ran."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon kernels run on Hopper only")
    pkg = gluon_pkg
    mods, causal, b, n_q, n_k, h, h_kv, d, dtype = case
    kw, score, mask, sink = _gluon_case(mods, b, n_q, n_k, h, "cuda")
    q, k, v = (t.detach() for t in inputs(b, n_q, n_k, h, h_kv, d, dtype, "cuda"))
    pkg._runtime._forward_plans.clear()
    with torch.no_grad(), pkg._runtime.override_config(family="gluon", **knobs):
        out, lse = pkg.flash_attn_func(q, k, v, causal=causal, mods=mods, return_lse=True, **kw)
        torch.cuda.synchronize()
        assert _plan_families(pkg) == {"GluonJITFunction"}
        (plan,) = [p for p in pkg._runtime._forward_plans.values() if p[0] is not None]
        # a document's own default tile has 64-key blocks (families.KEY_SPAN_FWD_KNOBS)
        (name,) = [n for n, v in pkg._runtime.VARIANTS.items() if v["kind"] == "fwd"
                   and tuple(v.get("mods", ())) == mods and v["head_dim"] == d
                   and v["dtype"] == {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]]
        block_n = knobs.get("block_n", pkg._runtime._gluon_default(name)["block_n"])
        assert plan[5] is None if mask is None else plan[5][1:] == (128, block_n, False)
    ref, ref_lse = reference(q.cpu(), k.cpu(), v.cpu(), causal=causal, score=score, mask=mask,
                             sink=None if sink is None else kw[sink].cpu())
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.cpu().double(), ref, atol=atol, rtol=rtol)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), finite)
    torch.testing.assert_close(lse.cpu().double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-4)
    empty = ~finite.transpose(1, 2)  # (B, Nq, H): rows that see no key
    assert (out.cpu()[empty] == 0).all()
    if "key_padding" in mods:
        assert empty.any()


@pytest.mark.gpu
@pytest.mark.parametrize("programs", [None, 7])
def test_gluon_forward_block_mask_deals_agree(gluon_pkg, monkeypatch, programs):
    """The persistent Gluon forward with a block mask walks the table _mods._tile_table
    deals (TILE_TABLE), and every deal (FWD_ORDER_QUANTUM 0: the kernel's own order; 1.0,
    0.5: longest lists first) gives the same bits: a tile's work does not depend on which
    program runs it or when."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon kernels run on Hopper only")
    pkg = gluon_pkg
    doc = documents(2, 2048, "cuda", seed=5)
    q, k, v = (t.detach() for t in inputs(2, 2048, 2048, 8, 4, 128, torch.bfloat16, "cuda"))
    knobs = {} if programs is None else {"programs": programs}
    outs = []
    for quantum in (0.0, 1.0, 0.5):
        monkeypatch.setattr(pkg._mods, "FWD_ORDER_QUANTUM", quantum)
        pkg._runtime._forward_plans.clear()
        with torch.no_grad(), pkg._runtime.override_config(family="gluon", **knobs):
            outs.append(pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc,
                                            return_lse=True))
            # (inside the override: leaving it clears the plans, made with its config)
            (plan,) = [p for p in pkg._runtime._forward_plans.values() if p[0] is not None]
            assert plan[0].meta["TILE_TABLE"]
    for out, lse in outs[1:]:
        assert torch.equal(out, outs[0][0]) and torch.equal(lse, outs[0][1])


@pytest.mark.gpu
def test_gluon_forward_with_mask_mods_default_and_matches_tl(gluon_pkg):
    """Without FLASHGEN_FAMILY or override_config a mask-mod forward runs the family that
    families.GLUON_MOD_KINDS_BY_DEFAULT names for it; the two families agree."""
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        pytest.skip("the Gluon kernels run on Hopper only")
    from flashgen import families

    pkg = gluon_pkg
    rt = pkg._runtime
    doc = documents(4, 4096, "cuda", seed=3)
    q, k, v = (t.detach() for t in inputs(4, 4096, 4096, 16, 16, 128, torch.bfloat16, "cuda"))
    outs = {}
    for family in ("", "tl", "gluon"):
        rt.use_family(family)
        try:
            with torch.no_grad():
                outs[family] = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
            ran = _plan_families(pkg)
        finally:
            rt.use_family("")
        if family == "":
            want = "GluonJITFunction" if "mask" in families.GLUON_MOD_KINDS_BY_DEFAULT["fwd"] else "JITFunction"
            assert ran == {want}
        else:
            assert ran == {"GluonJITFunction" if family == "gluon" else "JITFunction"}
    assert not torch.isnan(outs["gluon"]).any()
    torch.testing.assert_close(outs["gluon"].float(), outs["tl"].float(), atol=2e-2, rtol=2e-2)
