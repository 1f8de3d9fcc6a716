"""batch_invariant=True (issue 49): a sequence's output rows and LSE are bit for bit the same
whatever else is in the batch (packing, order, empty neighbours), however its prompt is
chunked (chunked prefill over a paged or a contiguous cache against one prefill), whatever
the split count (num_splits, the programs a tile's splits get, folding in registers or from
a workspace) and the page layout (page sizes 16, 24 -- no power of two -- and 64, pages
shuffled, NaN wherever a call must not read) -- and the packed training forward gives the
bits that prefill + decode of the same sequence give.

The CPU cases run in Triton's interpreter at 16 x 16 tiles with splits of 32 keys, so
sequences of tens of keys cross many blocks and splits. The interpreter proves the
structure (fixed block and split boundaries from key 0, one fold order, masked and
unmasked blocks alike); the `gpu` cases run the same equalities at the pinned tile and the
package's SPLIT_KEYS on real sizes, where a kernel that rounded differently per call would
show (docs/DECODING.md, Batch invariance).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from flashgen.errors import SpecError
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

ROOT = Path(__file__).resolve().parent.parent
D, HQ, HKV = 32, 4, 2
TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
LENGTHS = [70, 33, 1, 0, 45]
MASKS = {"causal": dict(causal=True), "window": dict(causal=True, window_size=(24, 0)),
         "none": dict(causal=False), "long_window": dict(causal=True, window_size=(1000, 0))}


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("bi"), "fg_test_bi", f"""
        head_dims: [{D}]
        dtypes: [bf16]
        masks: [none, causal, sliding_window]
        window: {{left: 24, right: 0}}
        gqa: true
        decode: true
        kv_cache_dtypes: [bf16, int8]
        attn_mask: false
        mods:
          softcap: {{builtin: softcap, params: {{cap: 2.0}}}}
          sink_logits: {{builtin: sink_logits}}
        variants:
          - {{mask: causal, mods: [softcap]}}
          - {{mask: causal, mods: [sink_logits]}}
        """)


@pytest.fixture
def small(pkg, monkeypatch):
    """Splits of 32 keys and 16 x 16 tiles, pinned for the test."""
    monkeypatch.setattr(pkg._invariant, "SPLIT_KEYS", 32)
    with pkg._runtime.override_config(**TILES):
        yield pkg


# ---------------------------------------------------------------------------------------
# sequences, caches and the calls
# ---------------------------------------------------------------------------------------
def cu(lengths, device="cpu"):
    return torch.tensor([0] + torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist(),
                        dtype=torch.int32, device=device)


def tokens(lengths, device, seed=0, h_q=HQ, h_kv=HKV, d=D, dtype=torch.bfloat16):
    """Packed (q, k, v) of self-attention sequences of these lengths."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lengths)
    return tuple(torch.randn(n, h, d, generator=g).to(dtype).to(device)
                 for h in (h_q, h_kv, h_kv))


def rows(lengths, i):
    start = sum(lengths[:i])
    return slice(start, start + lengths[i])


def train(pkg, q, k, v, lengths, mask="causal", **kw):
    """The packed forward of every sequence at once (the training call): (out, lse)."""
    c = cu(lengths, q.device)
    n = max(lengths)
    return pkg.flash_attn_varlen_func(q, k, v, c, c, n, n, return_lse=True,
                                      batch_invariant=True, **MASKS[mask], **kw)


def paged(k, v, lengths, page_size, seed=1, capacity=None):
    """(k_cache, v_cache, table): each sequence's first `lengths` keys on shuffled pages of a
    NaN-filled pool (room for `capacity` keys a sequence), the table's unused entries out of
    range."""
    g = torch.Generator().manual_seed(seed)
    capacity = capacity or max(lengths) or 1
    max_pages = -(-capacity // page_size)
    num_blocks = len(lengths) * max_pages + 3
    shape = (num_blocks, page_size) + tuple(k.shape[1:])
    k_cache = torch.full(shape, float("nan"), dtype=k.dtype, device=k.device)
    v_cache = torch.full(shape, float("nan"), dtype=v.dtype, device=v.device)
    order = torch.randperm(num_blocks, generator=g)
    table = torch.full((len(lengths), max_pages), num_blocks + 7, dtype=torch.int32)
    for i, n in enumerate(lengths):
        table[i] = order[i * max_pages:(i + 1) * max_pages].to(torch.int32)
        for j in range(n):
            page, slot = int(table[i, j // page_size]), j % page_size
            k_cache[page, slot] = k[rows(lengths, i)][j]
            v_cache[page, slot] = v[rows(lengths, i)][j]
    return k_cache, v_cache, table.to(k.device)


def prefill_chunk(pkg, q, k_cache, v_cache, table, seqs, lengths, mask="causal", **kw):
    """One chunked-prefill call over the paged cache: `seqs` = [(sequence, start, end)]
    runs queries start..end - 1 of each listed sequence against its first `end` keys.
    Returns {(sequence, start, end): (out rows, lse rows)}."""
    qs = torch.cat([q[rows(lengths, i)][a:b] for i, a, b in seqs])
    spans = [b - a for _, a, b in seqs]
    used = torch.tensor([b for _, _, b in seqs], dtype=torch.int32, device=q.device)
    bt = table[[i for i, _, _ in seqs]]
    out, lse = pkg.flash_attn_varlen_func(
        qs, k_cache, v_cache, cu(spans, q.device), None, max(spans), int(used.max()),
        block_table=bt, seqused_k=used, return_lse=True, batch_invariant=True,
        **MASKS[mask], **kw)
    got, at = {}, 0
    for (i, a, b), n in zip(seqs, spans):
        got[(i, a, b)] = (out[at:at + n], lse[:, at:at + n])
        at += n
    return got


def same(got, want, what):
    out, lse = got
    w_out, w_lse = want
    assert torch.equal(out, w_out), f"{what}: output bits differ"
    assert torch.equal(lse, w_lse), f"{what}: LSE bits differ"


# ---------------------------------------------------------------------------------------
# the equalities
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["causal", "window", "none"])
def test_packing_order_and_alone(small, device, mask):
    """A sequence's rows packed with others, in another order, alone (packed and dense)."""
    q, k, v = tokens(LENGTHS, device)
    out, lse = train(small, q, k, v, LENGTHS, mask)
    order = [4, 2, 0, 3, 1]
    lens2 = [LENGTHS[i] for i in order]
    q2, k2, v2 = (torch.cat([t[rows(LENGTHS, i)] for i in order]) for t in (q, k, v))
    out2, lse2 = train(small, q2, k2, v2, lens2, mask)
    for pos, i in enumerate(order):
        r, r2 = rows(LENGTHS, i), rows(lens2, pos)
        same((out2[r2], lse2[:, r2]), (out[r], lse[:, r]), f"sequence {i} reordered")
    for i in (0, 4):
        r = rows(LENGTHS, i)
        alone = train(small, q[r], k[r], v[r], [LENGTHS[i]], mask)
        same(alone, (out[r], lse[:, r]), f"sequence {i} alone")
        d_out, d_lse = small.flash_attn_func(q[None, r], k[None, r], v[None, r],
                                             return_lse=True, batch_invariant=True,
                                             **MASKS[mask])
        same((d_out[0], d_lse[0]), (out[r], lse[:, r]), f"sequence {i} dense")


def test_close_to_float64(small, device):
    """The mode computes attention: within the dtype's tolerance of float64."""
    q, k, v = tokens(LENGTHS, device, seed=3)
    out, lse = train(small, q, k, v, LENGTHS, "window")
    for i, n in enumerate(LENGTHS):
        r = rows(LENGTHS, i)
        vis = visible_mask(n, n, causal=True, window=(24, 0), bottom_right=True)
        ref, ref_lse = attention_ref(*(t[r].transpose(0, 1)[None].cpu() for t in (q, k, v)), vis)
        tol = OUT_TOL[torch.bfloat16]
        torch.testing.assert_close(out[r].double().cpu(), ref[0].transpose(0, 1), atol=tol[0],
                                   rtol=tol[1])
        seen = torch.isfinite(ref_lse[0])
        torch.testing.assert_close(lse[:, r].cpu().double()[seen], ref_lse[0][seen],
                                   atol=LSE_TOL[0], rtol=LSE_TOL[1])


def test_programs_fold_in_registers_or_from_a_workspace(small, device, monkeypatch):
    """However many programs share a tile's splits (1: the fold in registers)."""
    lengths = [70, 1, 45]
    q, k, v = tokens(lengths, device, seed=4)
    want = train(small, q, k, v, lengths)
    for programs in (1, 3):
        monkeypatch.setattr(small._invariant, "PROGRAMS", programs)
        same(train(small, q, k, v, lengths), want, f"{programs} programs a tile")


@pytest.mark.parametrize("page_size", [16, 24, 64])
def test_chunked_prefill_over_pages_then_decode(small, device, page_size):
    """Chunks of each prompt, several sequences at different chunks in one call, then
    decode steps in mixed batches with several split counts: the training rows' bits."""
    lengths = [70, 45, 33]
    q, k, v = tokens(lengths, device, seed=5)
    out, lse = train(small, q, k, v, lengths)
    k_cache, v_cache, table = paged(k, v, lengths, page_size)
    calls = [[(0, 0, 20), (1, 0, 45), (2, 0, 1)],
             [(2, 1, 30), (0, 20, 52)],
             [(0, 52, 67)]]
    for seqs in calls:
        for (i, a, b), got in prefill_chunk(small, q, k_cache, v_cache, table, seqs,
                                            lengths).items():
            r = rows(lengths, i)
            same(got, (out[r][a:b], lse[:, r][:, a:b]), f"sequence {i} rows {a}:{b}")
    # decode: one token a call, batches of different members, any split count
    for step, (members, splits) in enumerate((([0, 2], 0), ([2, 0], 1), ([0], 3))):
        pos = {0: 67 + step, 2: 30 + step}
        qd = torch.stack([q[rows(lengths, i)][pos[i]] for i in members])[:, None]
        seqlens = torch.tensor([pos[i] + 1 for i in members], dtype=torch.int32, device=device)
        o, l = small.flash_attn_with_kvcache(qd, k_cache, v_cache, cache_seqlens=seqlens,
                                             block_table=table[members], causal=True,
                                             num_splits=splits, return_lse=True,
                                             batch_invariant=True)
        for j, i in enumerate(members):
            r = rows(lengths, i)
            same((o[j, 0], l[j, :, 0]), (out[r][pos[i]], lse[:, r][:, pos[i]]),
                 f"decode of sequence {i} at {pos[i]}")


def test_seqused_q_leaves_the_rest_zero(small, device):
    """seqused_q: the used rows are the training rows' bits, the rest 0 with LSE -inf."""
    lengths = [40, 30]
    q, k, v = tokens(lengths, device, seed=12)
    out, lse = train(small, q, k, v, lengths)
    k_cache, v_cache, table = paged(k, v, lengths, 16)
    # sequence 1's span holds 20 rows, its first 15 the queries at positions 15..29
    qs = torch.cat([q[rows(lengths, 0)][20:30], q[rows(lengths, 1)][15:30],
                    q[rows(lengths, 1)][:5]])
    o, l = small.flash_attn_varlen_func(
        qs, k_cache, v_cache, cu([10, 20], device), None, 20, 30, block_table=table,
        seqused_k=torch.tensor([30, 30], dtype=torch.int32, device=device),
        seqused_q=torch.tensor([10, 15], dtype=torch.int32, device=device), causal=True,
        return_lse=True, batch_invariant=True)
    r0, r1 = rows(lengths, 0), rows(lengths, 1)
    same((o[:10], l[:, :10]), (out[r0][20:30], lse[:, r0][:, 20:30]), "sequence 0")
    same((o[10:25], l[:, 10:25]), (out[r1][15:30], lse[:, r1][:, 15:30]), "sequence 1")
    assert not o[25:].any() and torch.isinf(l[:, 25:]).all()


def test_decode_with_appends_into_a_contiguous_cache(small, device):
    """Prefill chunks and single tokens through flash_attn_with_kvcache's append (k=, v=)
    into a contiguous cache (rows chosen by cache_batch_idx), the batch and the split
    count changing from call to call."""
    lengths = [50, 37]
    q, k, v = tokens(lengths, device, seed=6)
    out, lse = train(small, q, k, v, lengths)
    k_cache, v_cache = (torch.full((2, 64, HKV, D), float("nan"), dtype=k.dtype, device=device)
                        for _ in range(2))
    done = [0, 0]
    for step, (members, n_new) in enumerate((([0, 1], 20), ([0], 1), ([1], 16), ([1, 0], 1),
                                             ([0], 28))):
        qs, ks, vs = (torch.stack([t[rows(lengths, i)][done[i]:done[i] + n_new]
                                   for i in members]) for t in (q, k, v))
        o, l = small.flash_attn_with_kvcache(
            qs, k_cache, v_cache, k=ks, v=vs,
            cache_seqlens=torch.tensor([done[i] for i in members], dtype=torch.int32,
                                       device=device),
            cache_batch_idx=torch.tensor(members, dtype=torch.int32, device=device),
            causal=True, num_splits=step % 3, return_lse=True, batch_invariant=True)
        for j, i in enumerate(members):
            r, a, b = rows(lengths, i), done[i], done[i] + n_new
            same((o[j], l[j]), (out[r][a:b], lse[:, r][:, a:b]), f"sequence {i} rows {a}:{b}")
            done[i] = b
    assert done == lengths


def test_training_backward(small, device):
    """The training call's forward is the no-grad call's bits; its gradients are the
    default backward's on that output, within tolerance of float64."""
    lengths = [40, 17]
    q, k, v = tokens(lengths, device, seed=7)
    want = train(small, q, k, v, lengths)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = train(small, *leaves, lengths)
    same((out.detach(), lse), want, "training forward")
    g = torch.Generator().manual_seed(8)
    dout = torch.randn(out.shape, generator=g).to(out.dtype).to(device)
    out.backward(dout)
    for i, n in enumerate(lengths):
        r = rows(lengths, i)
        ref_in = [t.detach()[r].transpose(0, 1)[None].cpu().double().requires_grad_()
                  for t in (q, k, v)]
        ref, _ = attention_ref(*ref_in, visible_mask(n, n, causal=True, bottom_right=True))
        ref.backward(dout[r].transpose(0, 1)[None].cpu().double())
        tol = GRAD_TOL[torch.bfloat16]
        for leaf, r_in in zip(leaves, ref_in):
            torch.testing.assert_close(leaf.grad[r].cpu().double(),
                                       r_in.grad[0].transpose(0, 1), atol=tol[0], rtol=tol[1])


@pytest.mark.parametrize("mod", ["softcap", "sink_logits"])
def test_score_and_sink_mods_prefill_equals_decode(small, device, mod):
    """A score mod in every block, a sink folded once after the splits: packed, chunked
    and decoded rows agree."""
    lengths = [60, 9]
    q, k, v = tokens(lengths, device, seed=9)
    args = {} if mod == "softcap" else {"sinks": torch.randn(HQ, device=device)}
    out, lse = train(small, q, k, v, lengths, mods=(mod,), **args)
    k_cache, v_cache, table = paged(k, v, lengths, 16)
    got = prefill_chunk(small, q, k_cache, v_cache, table, [(0, 30, 59), (1, 0, 9)], lengths,
                        mods=(mod,), **args)
    for (i, a, b), g in got.items():
        r = rows(lengths, i)
        same(g, (out[r][a:b], lse[:, r][:, a:b]), f"{mod}: sequence {i} rows {a}:{b}")
    o, l = small.flash_attn_with_kvcache(q[rows(lengths, 0)][59][None, None], k_cache, v_cache,
                                         cache_seqlens=torch.tensor([60], dtype=torch.int32,
                                                                    device=device),
                                         block_table=table[:1], causal=True, return_lse=True,
                                         batch_invariant=True, mods=(mod,), **args)
    same((o[0, 0], l[0, :, 0]), (out[rows(lengths, 0)][59], lse[:, rows(lengths, 0)][:, 59]),
         f"{mod}: decode")


def test_quantized_cache_prefill_equals_decode(small, device):
    """An int8 paged cache (per-token scales): chunked prefill and decode rows agree."""
    lengths = [50]
    q, k, v = tokens(lengths, device, seed=10)
    k_cache, v_cache, table = paged(k, v, lengths, 16)
    k_cache, v_cache = (torch.nan_to_num(c) for c in (k_cache, v_cache))
    k_q, k_s = small.quantize_kv_cache(k_cache, torch.int8)
    v_q, v_s = small.quantize_kv_cache(v_cache, torch.int8)
    one = prefill_chunk(small, q, k_q, v_q, table, [(0, 0, 50)], lengths, k_scale=k_s,
                        v_scale=v_s)[(0, 0, 50)]
    two = prefill_chunk(small, q, k_q, v_q, table, [(0, 40, 49)], lengths, k_scale=k_s,
                        v_scale=v_s)[(0, 40, 49)]
    same(two, (one[0][40:49], one[1][:, 40:49]), "int8 chunk")
    o, l = small.flash_attn_with_kvcache(q[49][None, None], k_q, v_q,
                                         cache_seqlens=torch.tensor([50], dtype=torch.int32,
                                                                    device=device),
                                         block_table=table, causal=True, k_scale=k_s,
                                         v_scale=v_s, num_splits=2, return_lse=True,
                                         batch_invariant=True)
    same((o[0, 0], l[0, :, 0]), (one[0][49], one[1][:, 49]), "int8 decode")


# ---------------------------------------------------------------------------------------
# what the mode refuses, the spec key
# ---------------------------------------------------------------------------------------
def test_refusals(pkg):
    q, k, v = tokens([8], "cpu")
    c = cu([8])
    with pytest.raises(ValueError, match="batch_invariant=True cannot honour dropout"):
        pkg.flash_attn_varlen_func(q, k, v, c, c, 8, 8, dropout_p=0.1, batch_invariant=True)
    with pytest.raises(ValueError, match="cannot honour dropout"):
        pkg.flash_attn_func(q[None], k[None], v[None], dropout_p=0.1, batch_invariant=True)
    with pytest.raises(ValueError, match="cannot honour fp8 inputs"):
        pkg.flash_attn_func(*(t[None].to(torch.float8_e4m3fn) for t in (q, k, v)),
                            batch_invariant=True)
    with pytest.raises(ValueError, match="cannot honour mods .* with gradients"):
        pkg.flash_attn_varlen_func(q.requires_grad_(), k, v, c, c, 8, 8, causal=True,
                                   mods=("softcap",), batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be True, False or None"):
        pkg.flash_attn_func(q[None], k[None], v[None], batch_invariant="yes")
    with pkg._runtime.override_config(family="gluon"), pytest.raises(
            ValueError, match=r"cannot honour override_config\(family='gluon'\)"):
        pkg.flash_attn_varlen_func(q, k, v, c, c, 8, 8, causal=True, batch_invariant=True)


def test_spec_default_and_its_errors(tmp_path):
    body = f"""
        head_dims: [{D}]
        dtypes: [bf16]
        masks: [causal]
        gqa: true
        decode: true
        batch_invariant: true
        """
    pkg = build_and_import(tmp_path, "fg_test_bi_default", body)
    assert pkg._invariant.DEFAULT is True
    q, k, v = tokens([20], "cpu", seed=11)
    with pkg._runtime.override_config(**TILES):
        by_default = pkg.flash_attn_func(q[None], k[None], v[None], causal=True)
        asked = pkg.flash_attn_func(q[None], k[None], v[None], causal=True,
                                    batch_invariant=True)
        assert torch.equal(by_default, asked)
        assert pkg._invariant._plans, "a call without the flag took the invariant kernel"
    with pytest.raises(SpecError, match=r"batch_invariant.*no decode kernels") as e:
        build_and_import(tmp_path, "fg_test_bi_nodecode", body.replace(
            "decode: true", "decode: false"))
    assert "fg_test_bi_nodecode.yaml:" in str(e.value)
    with pytest.raises(SpecError, match="batch_invariant"):
        build_and_import(tmp_path, "fg_test_bi_notbool", body.replace(
            "batch_invariant: true", "batch_invariant: 1"))


# ---------------------------------------------------------------------------------------
# GPU: the pinned tile and the package's SPLIT_KEYS at real sizes (Llama's d = 128, GQA
# 32 / 8, bf16), where a kernel that rounded differently per call would show
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    text = (ROOT / "specs" / "llama.yaml").read_text()
    body = text.split("package: llama_attn", 1)[1].split("\ngpu:", 1)[0]
    return build_and_import(tmp_path_factory.mktemp("bi_llama"), "fg_test_bi_llama", body)


GPU_LENGTHS = [3000, 1, 517, 2048, 4100, 129, 1024, 777]


@pytest.mark.gpu
@pytest.mark.parametrize("mask", ["causal", "long_window"])
def test_gpu_packing_chunking_pages_splits(llama, mask):
    """Training rows of 8 sequences = each alone = dense = chunked prefill (512-token
    chunks over pages of 16 and 64, several sequences a call) = decode steps (mixed
    batches, num_splits 0, 1, 4, 16) = any programs a tile."""
    lengths = GPU_LENGTHS
    q, k, v = tokens(lengths, "cuda", seed=20, h_q=32, h_kv=8, d=128)
    out, lse = train(llama, q, k, v, lengths, mask)
    for i in (0, 4, 5):
        r = rows(lengths, i)
        same(train(llama, q[r], k[r], v[r], [lengths[i]], mask),
             (out[r], lse[:, r]), f"sequence {i} alone")
        d_out, d_lse = llama.flash_attn_func(q[None, r], k[None, r], v[None, r],
                                             return_lse=True, batch_invariant=True,
                                             **MASKS[mask])
        same((d_out[0], d_lse[0]), (out[r], lse[:, r]), f"sequence {i} dense")
    for programs in (1, 3, 16):
        llama._invariant.PROGRAMS = programs
        try:
            same(train(llama, q, k, v, lengths, mask), (out, lse),
                 f"{programs} programs")
        finally:
            llama._invariant.PROGRAMS = 0
    for page_size in (16, 64):
        k_cache, v_cache, table = paged(k, v, lengths, page_size)
        ends = [0] * len(lengths)
        while any(e < n - 4 for e, n in zip(ends, lengths)):
            seqs = [(i, e, min(e + 512, n - 4)) for i, (e, n) in enumerate(zip(ends, lengths))
                    if e < n - 4][::-1]
            for (i, a, b), got in prefill_chunk(llama, q, k_cache, v_cache, table, seqs,
                                                lengths, mask).items():
                r = rows(lengths, i)
                same(got, (out[r][a:b], lse[:, r][:, a:b]), f"pages {page_size}: {i} {a}:{b}")
                ends[i] = b
        for step, splits in enumerate((0, 1, 4, 16)):
            members = [i for i, n in enumerate(lengths)
                       if n >= 4 and (step == 0 or i % 2 == step % 2)]
            pos = {i: lengths[i] - 4 + step for i in members}
            qd = torch.stack([q[rows(lengths, i)][pos[i]] for i in members])[:, None]
            o, l = llama.flash_attn_with_kvcache(
                qd, k_cache, v_cache,
                cache_seqlens=torch.tensor([pos[i] + 1 for i in members], dtype=torch.int32,
                                           device="cuda"),
                block_table=table[members], num_splits=splits, return_lse=True,
                batch_invariant=True, **MASKS[mask])
            for j, i in enumerate(members):
                r = rows(lengths, i)
                same((o[j, 0], l[j, :, 0]), (out[r][pos[i]], lse[:, r][:, pos[i]]),
                     f"pages {page_size}: decode of {i} at {pos[i]}, {splits} splits")


@pytest.mark.gpu
def test_gpu_training_backward_and_accuracy(llama):
    """At the real tile: the training forward's bits and a backward within tolerance of
    the default one."""
    lengths = [1500, 700, 33]
    q, k, v = tokens(lengths, "cuda", seed=21, h_q=32, h_kv=8, d=128)
    want = train(llama, q, k, v, lengths)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = train(llama, *leaves, lengths)
    same((out.detach(), lse), want, "training forward")
    dout = torch.randn_like(out)
    out.backward(dout)
    base = [t.clone().requires_grad_() for t in (q, k, v)]
    c = cu(lengths, "cuda")
    ref = llama.flash_attn_varlen_func(*base, c, c, max(lengths), max(lengths), causal=True)
    tol = OUT_TOL[torch.bfloat16]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol[0], rtol=tol[1])
    ref.backward(dout)
    tol = GRAD_TOL[torch.bfloat16]
    for leaf, b in zip(leaves, base):
        torch.testing.assert_close(leaf.grad.float(), b.grad.float(), atol=tol[0], rtol=tol[1])
