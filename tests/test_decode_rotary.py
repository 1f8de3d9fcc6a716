"""flash_attn_with_kvcache's rotary append, cache_batch_idx and cache_leftpad (flash-attn 2's
semantics) against a float64 reference written from the definitions.

The reference rotates q and the new k in float64 (key t of element b at position
cache_seqlens[b] + t; query i at cache_seqlens[b] + i with causal or a window, else every
query at cache_seqlens[b]), rounds the rotated keys to the cache dtype and writes them and
v into a copy of the cache (through cache_batch_idx or the block table), then attends in
float64 over keys [cache_leftpad[b], cache_seqlens[b] + N_new) of that copy. The cache after
the call must equal the copy: bit for bit except the rotated keys, which must be the float64
value rounded to the cache dtype (either neighbour where the kernel's fp32 arithmetic may
round the other way: _assert_rounded). Every cache position the call must not read (past
the length, before the left padding, unused pages and cache rows) holds NaN, and outputs
are poisoned (NaN) before the call, so a stray read or a missing write shows.

The kernel rounds the rotated q to the input dtype before the product (as flash-attn does)
where the reference keeps it in float64, so the tolerances are looser than conftest's
OUT_TOL / LSE_TOL (which see q exact in its dtype): out atol = rtol = 3e-3 (fp16),
2.4e-2 (bf16), 5e-5 (fp32); lse atol 2e-3, 3e-2, 1e-4 (rtol 1e-5).
"""
import pytest
import torch

from packages import build_and_import
from flashgen.reference import attention_ref, visible_mask

SMALL_TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
H_KV, GROUP, D = 2, 4, 64
TOL = {torch.float16: 3e-3, torch.bfloat16: 2.4e-2, torch.float32: 5e-5}
LSE_ATOL = {torch.float16: 2e-3, torch.bfloat16: 3e-2, torch.float32: 1e-4}


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("rotary"), "fg_test_decode_rotary", """
        head_dims: [64]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 12, right: 0}
        gqa: true
        decode: true
        """)


# ---------------------------------------------------------------------------------------
# the reference
# ---------------------------------------------------------------------------------------
def rotate64(x, cos, sin, pos, interleaved):
    """x (N, H, d) rotated in float64 at positions pos (N,) over the first 2 * cos.shape[1]
    dims: GPT-J pairs (2i, 2i + 1) or GPT-NeoX halves (i, i + r / 2)."""
    r = 2 * cos.shape[1]
    x = x.double().clone()
    c, s = cos.double()[pos][:, None, :], sin.double()[pos][:, None, :]  # (N, 1, r / 2)
    if interleaved:
        x1, x2 = x[..., 0:r:2].clone(), x[..., 1:r:2].clone()
        x[..., 0:r:2], x[..., 1:r:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = x[..., :r // 2].clone(), x[..., r // 2:r].clone()
        x[..., :r // 2], x[..., r // 2:r] = x1 * c - x2 * s, x1 * s + x2 * c
    return x


def cache_slot(table, page_size, b, cache_b, j):
    """(row, position) of element b's cache position j in the cache tensor."""
    if table is None:
        return cache_b, j
    return int(table[b, j // page_size]), j % page_size


def reference(q, k_cache, v_cache, k, v, lens, *, cos, sin, interleaved, causal=False,
              window=(-1, -1), table=None, batch_idx=None, leftpad=None):
    """(out, lse) in float64, the expected caches, and (k_exact, slack, where): the rotated
    keys in float64 with how far the kernel's fp32 arithmetic may stray from them, and
    the (row, position) each went to."""
    batch, n_q = q.shape[:2]
    n_new = 0 if k is None else k.shape[1]
    page_size = k_cache.shape[1]
    k_want, v_want = k_cache.clone(), v_cache.clone()
    written = []
    outs, lses = [], []
    for b in range(batch):
        s_b = lens[b]
        cache_b = b if batch_idx is None else int(batch_idx[b])
        if n_new:
            pos = torch.arange(s_b, s_b + n_new)
            k_rot = k[b] if cos is None else rotate64(k[b], cos, sin, pos, interleaved)
            # fp32 arithmetic: each product and the sum are within 2**-24 relative
            slack = 4 * 2.0 ** -24 * k[b].double().abs().amax(-1, keepdim=True)
            for t in range(n_new):
                row, j = cache_slot(table, page_size, b, cache_b, s_b + t)
                k_want[row, j] = k_rot[t].to(k_cache.dtype)
                v_want[row, j] = v[b, t]
                written.append((row, j, k_rot[t], slack[t]))
        length = s_b + n_new
        first = 0 if leftpad is None else int(leftpad[b])
        # the padding (NaN in the tests' caches) is masked out: zeros keep 0 * NaN out
        keys, vals = ([c[cache_slot(table, page_size, b, cache_b, j)] if j >= first
                       else torch.zeros_like(c[0, 0]) for j in range(length)]
                      for c in (k_want, v_want))
        keys, vals = (torch.stack(x)[None].transpose(1, 2) for x in (keys, vals))
        qb = q[b].double()
        if cos is not None:
            q_pos = s_b + (torch.arange(n_q) if causal or window != (-1, -1)
                           else torch.zeros(n_q, dtype=torch.long))
            qb = rotate64(qb, cos, sin, q_pos, interleaved)
        vis = visible_mask(n_q, length, causal=causal, window=window, bottom_right=True)
        vis = vis & (torch.arange(length) >= first)[None, :]
        o, lse = attention_ref(qb[None].transpose(1, 2), keys, vals, vis)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses), k_want, v_want, written


def _bits(t):
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _assert_rounded(got, exact, slack, dtype, faithful=False):
    """got (the cache dtype) is the float64 value exact rounded to nearest in the dtype, or
    the neighbour it rounds to once moved by the kernel's arithmetic error (slack).
    faithful: either neighbour of exact (Triton's interpreter converts fp32 to bf16 by
    truncation, where the GPU rounds to nearest)."""
    if faithful:
        _, e = torch.frexp(exact)  # exact in [2**(e-1), 2**e): its ulp in the dtype
        ulp = torch.ldexp(torch.full_like(exact, torch.finfo(dtype).eps), e - 1)
        ok = (got.double() - exact).abs() < ulp + slack
    else:
        ok = (got >= (exact - slack).to(dtype)) & (got <= (exact + slack).to(dtype))
    assert ok.all(), (f"rotated keys written to the cache differ from the float64 rotation "
                      f"rounded to {dtype}: {got[~ok]} vs {exact[~ok]}")


def check_call(pkg, device, q, k_cache, v_cache, k, v, lens, *, tiles=SMALL_TILES,
               int_lens=False, **kw):
    """Run the call on `device` (outputs poisoned by the fixture) and compare out, lse and
    the caches (inputs given on the CPU)."""
    ref_kw = {n: kw[n] for n in ("causal", "window", "table", "batch_idx", "leftpad") if n in kw}
    cos, sin = kw.get("rotary_cos"), kw.get("rotary_sin")
    interleaved = kw.get("rotary_interleaved", True)
    ref_out, ref_lse, k_want, v_want, written = reference(
        q, k_cache, v_cache, k, v, lens, cos=cos, sin=sin, interleaved=interleaved, **ref_kw)
    call_kw = dict(kw)
    if "window" in call_kw:
        call_kw["window_size"] = call_kw.pop("window")
    for ours, theirs in (("table", "block_table"), ("batch_idx", "cache_batch_idx"),
                         ("leftpad", "cache_leftpad")):
        if ours in call_kw:
            call_kw[theirs] = call_kw.pop(ours)
    seqlens = lens[0] if int_lens else torch.tensor(lens, dtype=torch.int32, device=device)
    call_kw = {n: t.to(device) if isinstance(t, torch.Tensor) else t for n, t in call_kw.items()}
    caches = k_cache.to(device), v_cache.to(device)
    with pkg._runtime.override_config(**tiles), torch.no_grad():
        out, lse = pkg.flash_attn_with_kvcache(q.to(device), *caches, k.to(device), v.to(device),
                                               cache_seqlens=seqlens, return_lse=True, **call_kw)
    k_cache, v_cache, out, lse = (t.cpu() for t in (*caches, out, lse))
    faithful = device == "cpu" and k_cache.dtype == torch.bfloat16
    # the caches: rotated keys rounded from float64, everything else bit for bit
    for row, j, exact, slack in written:
        _assert_rounded(k_cache[row, j], exact, slack, k_cache.dtype, faithful)
        k_want[row, j] = k_cache[row, j]
    assert torch.equal(_bits(k_cache), _bits(k_want)), "k_cache differs outside the new keys"
    assert torch.equal(_bits(v_cache), _bits(v_want)), "v_cache differs from the appended v"
    assert not torch.isnan(out).any(), "NaN in the output (a stray read or a missing write)"
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.double(), ref_out, atol=tol, rtol=tol)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen), "LSE -inf rows differ"
    torch.testing.assert_close(lse.double()[seen], ref_lse[seen], atol=LSE_ATOL[q.dtype],
                               rtol=1e-5)
    return out


# ---------------------------------------------------------------------------------------
# inputs: NaN wherever the call must not read
# ---------------------------------------------------------------------------------------
def tables(seqlen_ro, rotary_dim, dtype, seed=5):
    g = torch.Generator().manual_seed(seed)
    angle = torch.rand(seqlen_ro, rotary_dim // 2, generator=g, dtype=torch.float64) * 6.283
    return angle.cos().to(dtype), angle.sin().to(dtype)


def inputs(lens, n_q, n_new, capacity, dtype, *, page_size=None, cache_rows=None, seed=0,
           group=GROUP):
    """q, k, v and a cache whose unused positions (past each length, unused pages and
    cache rows) are NaN. Paged: the pool's pages shuffled, three spare ones. Returns
    (q, k, v, k_cache, v_cache, table)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q = rnd(batch, n_q, H_KV * group, D)
    k, v = rnd(batch, n_new, H_KV, D), rnd(batch, n_new, H_KV, D)
    if page_size is None:
        rows = cache_rows or batch
        k_cache, v_cache = rnd(rows, capacity, H_KV, D), rnd(rows, capacity, H_KV, D)
        return q, k, v, k_cache, v_cache, None
    max_pages = -(-capacity // page_size)
    num_blocks = batch * max_pages + 3
    k_cache, v_cache = rnd(num_blocks, page_size, H_KV, D), rnd(num_blocks, page_size, H_KV, D)
    table = torch.randperm(num_blocks, generator=g)[:batch * max_pages].view(batch, max_pages)
    return q, k, v, k_cache, v_cache, table.to(torch.int32)


def poison_unused(k_cache, v_cache, lens, n_new, *, table=None, batch_idx=None, leftpad=None):
    """NaN into every cache position no call reads: before the left padding, past the
    length, and in the pages and cache rows no element uses."""
    live = torch.zeros(k_cache.shape[:2], dtype=torch.bool)
    page_size = k_cache.shape[1]
    for b, s_b in enumerate(lens):
        cache_b = b if batch_idx is None else int(batch_idx[b])
        first = 0 if leftpad is None else int(leftpad[b])
        for j in range(first, s_b + n_new):
            live[cache_slot(table, page_size, b, cache_b, j)] = True
    k_cache[~live] = float("nan")
    v_cache[~live] = float("nan")


# ---------------------------------------------------------------------------------------
# rotary append against the reference
# ---------------------------------------------------------------------------------------
CASES = [
    # interleaved, rotary_dim, n_q, n_new, causal, window, page_size, dtype
    (True, 64, 1, 1, True, None, None, torch.float16),
    (False, 64, 1, 1, True, None, None, torch.float16),
    (True, 32, 3, 3, True, None, None, torch.float16),
    (False, 16, 3, 3, False, None, None, torch.float16),  # every query at cache_seqlens
    (False, 32, 2, 3, True, None, None, torch.float16),  # n_q != n_new
    (True, 48, 2, 2, False, (12, 0), None, torch.float16),  # a window rotates like causal
    (False, 32, 2, 2, True, None, 8, torch.float16),
    (True, 64, 1, 1, True, None, 5, torch.bfloat16),
    (False, 64, 3, 3, True, None, None, torch.float32),
]


@pytest.mark.parametrize("interleaved,rotary_dim,n_q,n_new,causal,window,page_size,dtype", CASES,
                         ids=[f"{'gptj' if c[0] else 'neox'}-r{c[1]}-q{c[2]}n{c[3]}"
                              f"{'-causal' if c[4] else ''}{'-win' if c[5] else ''}"
                              f"{f'-paged{c[6]}' if c[6] else ''}-{str(c[7])[6:]}" for c in CASES])
def test_rotary_append(pkg, device, poison, interleaved, rotary_dim, n_q, n_new, causal, window,
                       page_size, dtype):
    lens = [0, 17, 36]  # ragged: empty, mid-block, the last rows (40 = capacity - n_new max)
    q, k, v, k_cache, v_cache, table = inputs(lens, n_q, n_new, 40, dtype, page_size=page_size)
    poison_unused(k_cache, v_cache, lens, n_new, table=table)
    cos, sin = tables(48, rotary_dim, dtype)
    kw = dict(causal=causal, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    if window:
        kw["window"] = window
    if table is not None:
        kw["table"] = table
    check_call(pkg, device, q, k_cache, v_cache, k, v, lens, **kw)


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_rotary_with_batch_idx_and_leftpad(pkg, device, poison, page_size):
    """cache_batch_idx permuted over a larger cache (contiguous only, as in flash-attn),
    cache_leftpad nonzero: padded keys are hidden, positions stay cache positions."""
    lens, n_new = [9, 30, 20], 2
    q, k, v, k_cache, v_cache, table = inputs(lens, 2, n_new, 40, torch.float16,
                                              page_size=page_size, cache_rows=5, seed=3)
    batch_idx = None if page_size else torch.tensor([3, 0, 4], dtype=torch.int32)
    leftpad = torch.tensor([4, 0, 20], dtype=torch.int32)  # the last: only the new keys
    poison_unused(k_cache, v_cache, lens, n_new, table=table, batch_idx=batch_idx,
                  leftpad=leftpad)
    cos, sin = tables(44, 32, torch.float32)  # fp32 tables with fp16 inputs
    kw = dict(causal=True, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=False,
              leftpad=leftpad)
    kw.update(table=table) if table is not None else kw.update(batch_idx=batch_idx)
    check_call(pkg, device, q, k_cache, v_cache, k, v, lens, **kw)


def test_batch_idx_and_leftpad_without_rotary_and_int_lens(pkg, device, poison):
    """The extras without rotary, an int cache_seqlens, a split of the keys."""
    lens, n_new = [25, 25], 1
    q, k, v, k_cache, v_cache, _ = inputs(lens, 1, n_new, 32, torch.float16, cache_rows=3,
                                          seed=4)
    batch_idx = torch.tensor([2, 1], dtype=torch.int32)
    leftpad = torch.tensor([3, 24], dtype=torch.int32)
    poison_unused(k_cache, v_cache, lens, n_new, batch_idx=batch_idx, leftpad=leftpad)
    check_call(pkg, device, q, k_cache, v_cache, k, v, lens, int_lens=True, causal=True,
               batch_idx=batch_idx, leftpad=leftpad, num_splits=2)


def test_rotary_int_lens_and_no_rotary_kernels_unchanged(pkg, device, poison, monkeypatch):
    """An int cache_seqlens rotates at that position; a plain call after a rotary one
    still runs the plain kernels (ROTARY_DIM=0) and gets the plain answer."""
    monkeypatch.setattr(pkg._decode, "_plans", {})
    lens, n_new = [12, 12], 1
    q, k, v, k_cache, v_cache, _ = inputs(lens, 1, n_new, 16, torch.float16, seed=6)
    cos, sin = tables(13, 64, torch.float16)  # exactly the rows the call needs
    check_call(pkg, device, q, k_cache.clone(), v_cache.clone(), k, v, lens, int_lens=True,
               causal=True, rotary_cos=cos, rotary_sin=sin)
    plain = check_call(pkg, device, q, k_cache, v_cache, k, v, lens, int_lens=True, causal=True)
    plans = list(pkg._decode._plans.values())
    assert sorted(p.kernel.meta["ROTARY_DIM"] for p in plans) == [0, 64]
    assert sorted(p.append.meta["ROTARY_DIM"] for p in plans) == [0, 64]
    assert plain.shape == (2, 1, H_KV * GROUP, D)


# ---------------------------------------------------------------------------------------
# the append in the attention launch (FUSED_APPEND): every program that covers new keys
# takes them from k, v; one program a KV head writes them
# ---------------------------------------------------------------------------------------
FUSED = [
    # interleaved, rotary_dim, n_q (= n_new), lens, page_size, group, num_splits, extra
    (True, 64, 1, [0, 17, 36], None, 4, 3, None),
    (False, 32, 3, [5, 0, 29], 16, 8, 1, None),  # rotary_dim < d, GQA 8:1
    (True, 48, 7, [30, 9, 0], None, 4, 3, None),  # 30..36 straddle the splits [16, 32), [32, 37)
    (False, 64, 7, [40, 1, 13], 64, 8, 2, None),  # 56 stacked rows: 4 row blocks need the keys
    (True, 16, 3, [11, 33, 2], 256, 4, 4, None),
    (False, 32, 3, [9, 30, 20], None, 4, 2, "batch_idx+leftpad"),
    (True, 32, 1, [12, 24, 3], 16, 8, 3, "leftpad"),
    (False, 64, 20, [0, 9, 28], 16, 4, 3, None),  # more new keys than a tile of NEW_N = 16
]


@pytest.mark.parametrize("interleaved,rotary_dim,n,lens,page_size,group,splits,extra", FUSED,
                         ids=[f"{'gptj' if c[0] else 'neox'}-r{c[1]}-n{c[2]}"
                              f"{f'-paged{c[4]}' if c[4] else ''}-gqa{c[5]}-s{c[6]}"
                              f"{f'-{c[7]}' if c[7] else ''}" for c in FUSED])
def test_fused_rotary_append(pkg, device, poison, interleaved, rotary_dim, n, lens, page_size,
                             group, splits, extra):
    """The fused path against float64 (check_call: the caches bit for bit, the poisoned
    rows untouched, no NaN): ragged lengths with 0, splits the new keys straddle, several
    row blocks, pages of 16 / 64 / 256 shuffled, cache_batch_idx, cache_leftpad."""
    assert pkg._decode.FUSED_APPEND, "FLASHGEN_FUSED_APPEND=0 in the environment"
    kw = dict(cache_rows=5, seed=11) if extra and "batch_idx" in extra else dict(seed=11)
    q, k, v, k_cache, v_cache, table = inputs(lens, n, n, 48, torch.float16,
                                              page_size=page_size, group=group, **kw)
    batch_idx = (torch.tensor([4, 0, 2], dtype=torch.int32)
                 if extra and "batch_idx" in extra else None)
    leftpad = (torch.tensor([min(3, s) for s in lens], dtype=torch.int32)
               if extra and "leftpad" in extra else None)
    poison_unused(k_cache, v_cache, lens, n, table=table, batch_idx=batch_idx, leftpad=leftpad)
    cos, sin = tables(48, rotary_dim, torch.float16, seed=n)
    kw = dict(causal=True, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved,
              num_splits=splits)
    for name, t in (("table", table), ("batch_idx", batch_idx), ("leftpad", leftpad)):
        if t is not None:
            kw[name] = t
    check_call(pkg, device, q, k_cache, v_cache, k, v, lens, **kw)


AB = [  # rotary, page_size, n_q, n_new, num_splits, causal
    (True, None, 1, 1, 3, True),
    (True, 16, 3, 3, 2, True),
    (False, 5, 2, 2, 3, True),  # no rotary, a page index per key
    (True, None, 1, 3, 1, False),  # every query at cache_seqlens
]


@pytest.mark.parametrize("rotary,page_size,n_q,n_new,splits,causal", AB,
                         ids=[f"{'rotary' if c[0] else 'plain'}{f'-paged{c[1]}' if c[1] else ''}"
                              f"-q{c[2]}n{c[3]}-s{c[4]}{'-causal' if c[5] else ''}" for c in AB])
def test_fused_append_matches_the_append_kernel(pkg, device, poison, monkeypatch, rotary,
                                                page_size, n_q, n_new, splits, causal):
    """FLASHGEN_FUSED_APPEND=0 (the append kernel, then attention) and the fused launch
    write the same cache bits: the same operations on the same values (in the interpreter
    bit for bit; a GPU compiles the two rotations apart, so an FMA may round a key one ulp
    the other way there). The outputs agree to the rounding of P: the fused launch takes
    the new keys as a block of their own, so the online softmax's running maximum, which
    P is scaled by before its rounding to bf16, steps differently."""
    lens = [0, 21, 40 - n_new]
    q, k, v, k_cache, v_cache, table = inputs(lens, n_q, n_new, 40, torch.bfloat16,
                                              page_size=page_size, seed=13)
    poison_unused(k_cache, v_cache, lens, n_new, table=table)
    kw = dict(causal=causal, num_splits=splits, return_lse=True,
              cache_seqlens=torch.tensor(lens, dtype=torch.int32, device=device))
    if rotary:
        cos, sin = tables(48, 48, torch.float32)
        kw.update(rotary_cos=cos.to(device), rotary_sin=sin.to(device))
    if table is not None:
        kw["block_table"] = table.to(device)
    got = {}
    for fused in (False, True):
        monkeypatch.setattr(pkg._decode, "FUSED_APPEND", fused)
        caches = k_cache.to(device), v_cache.to(device)
        with pkg._runtime.override_config(**SMALL_TILES), torch.no_grad():
            out, lse = pkg.flash_attn_with_kvcache(q.to(device), *caches, k.to(device),
                                                   v.to(device), **kw)
        got[fused] = [t.cpu() for t in (*caches, out, lse)]
    (k0, v0, out0, lse0), (k1, v1, out1, lse1) = got[False], got[True]
    assert torch.equal(_bits(v0), _bits(v1))
    assert not torch.isnan(out1).any()
    if device == "cpu":
        assert torch.equal(_bits(k0), _bits(k1))
    else:
        torch.testing.assert_close(k1, k0, atol=0, rtol=2 ** -7, equal_nan=True)
    # (measured in the interpreter: at most one bf16 ulp of the output, 2e-3; LSE 5e-7)
    torch.testing.assert_close(out1, out0, atol=2 ** -7, rtol=2 ** -7)
    torch.testing.assert_close(lse1, lse0, atol=1e-4, rtol=1e-5)


GPU_FUSED = [  # interleaved, rotary_dim, n, page_size, group
    (False, 64, 1, None, 4), (True, 32, 3, 16, 8), (False, 48, 7, 64, 4), (True, 64, 1, 256, 8),
]


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved,rotary_dim,n,page_size,group", GPU_FUSED,
                         ids=[f"{'gptj' if c[0] else 'neox'}-r{c[1]}-n{c[2]}"
                              f"{f'-paged{c[3]}' if c[3] else ''}-gqa{c[4]}" for c in GPU_FUSED])
def test_gpu_fused_rotary_append_planned_tiles(pkg, poison, interleaved, rotary_dim, n,
                                               page_size, group):
    """The fused path at the planner's tiles and split count over caches of thousands of
    keys (a page per key block, or per key), ragged, one empty."""
    lens = [4100, 0, 2999, 1]
    q, k, v, k_cache, v_cache, table = inputs(lens, n, n, 4112, torch.bfloat16,
                                              page_size=page_size, group=group, seed=19)
    poison_unused(k_cache, v_cache, lens, n, table=table)
    cos, sin = tables(4112, rotary_dim, torch.bfloat16, seed=n)
    kw = dict(causal=True, rotary_cos=cos, rotary_sin=sin, rotary_interleaved=interleaved)
    if table is not None:
        kw["table"] = table
    check_call(pkg, "cuda", q, k_cache, v_cache, k, v, lens, tiles={}, **kw)


class _CountLaunches:
    """Stands in for _runtime.kernel: records each launch's function and runs it (the
    interpreter takes Triton's own `fn[grid](...)` path, the one the handle wraps)."""

    def __init__(self, real):
        self.real, self.launches = real, []

    def __call__(self, name, function="kernel", family="tl"):
        fn, launches = self.real(name, function, family), self.launches

        class Handle:
            def __getitem__(self, grid):
                def launch(*args, **kwargs):
                    launches.append(function)
                    return fn[grid](*args, **kwargs)
                return launch
        return Handle()


@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
def test_one_launch_rotates_appends_and_attends(pkg, poison, monkeypatch, page_size):
    """The launches a rotary append makes, counted as they run: one, the attention kernel
    (split in 3, its splits merged in the same launch), and the answer is right; with
    FLASHGEN_FUSED_APPEND=0 the append kernel runs first."""
    monkeypatch.setattr(pkg._decode, "_plans", {})
    lens, n = [7, 30, 18], 3
    q, k, v, k_cache, v_cache, table = inputs(lens, n, n, 40, torch.float16,
                                              page_size=page_size, seed=17)
    poison_unused(k_cache, v_cache, lens, n, table=table)
    cos, sin = tables(40, 32, torch.float16)
    kw = dict(causal=True, rotary_cos=cos, rotary_sin=sin, num_splits=3)
    if table is not None:
        kw["table"] = table
    for fused, want in ((True, ["kernel"]), (False, ["append", "kernel"])):
        monkeypatch.setattr(pkg._decode, "FUSED_APPEND", fused)
        counter = _CountLaunches(pkg._runtime.kernel)
        with monkeypatch.context() as m:
            m.setattr(pkg._runtime, "kernel", counter)
            check_call(pkg, "cpu", q, k_cache.clone(), v_cache.clone(), k, v, lens, **kw)
        assert counter.launches == want


# ---------------------------------------------------------------------------------------
# bad input: ValueError naming the argument, before anything is written
# ---------------------------------------------------------------------------------------
def _bad_call(pkg, **over):
    lens = [10, 20]
    q, k, v, k_cache, v_cache, _ = inputs(lens, 1, 1, 32, torch.float16, seed=7)
    cos, sin = tables(32, 32, torch.float16)
    args = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k, v=v,
                cache_seqlens=torch.tensor(lens, dtype=torch.int32), causal=True,
                rotary_cos=cos, rotary_sin=sin)
    args.update(over)
    before = k_cache.clone()
    try:
        with torch.no_grad():
            pkg.flash_attn_with_kvcache(**args)
    finally:
        assert torch.equal(_bits(k_cache), _bits(before)), "the cache was written"


@pytest.mark.parametrize("over,match", [
    (dict(rotary_sin=torch.zeros(32, 8, dtype=torch.float16)), "rotary_cos and rotary_sin must share"),
    (dict(rotary_sin=torch.zeros(32, 16, dtype=torch.float32)), "rotary_cos and rotary_sin must share"),
    (dict(rotary_cos=torch.zeros(32, 16, dtype=torch.int32),
          rotary_sin=torch.zeros(32, 16, dtype=torch.int32)), "rotary_cos must be fp16"),
    (dict(rotary_cos=torch.zeros(32, 40), rotary_sin=torch.zeros(32, 40)), "rotary_dim = 2 \\* 40"),
    (dict(rotary_cos=torch.zeros(32), rotary_sin=torch.zeros(32)), "rotary_cos must be a 2-D"),
    (dict(rotary_sin=None), "rotary_cos and rotary_sin together"),
    (dict(k=None, v=None), "pass k and v"),
    (dict(rotary_interleaved=1), "rotary_interleaved must be a bool"),
    (dict(rotary_cos=torch.zeros(32, 32)[:, ::2], rotary_sin=torch.zeros(32, 32)[:, ::2]),
     "unit stride"),
    (dict(rotary_cos=torch.zeros(20, 16), rotary_sin=torch.zeros(20, 16)),
     "rotary_cos / rotary_sin have 20 rows but the call rotates positions up to 20"),
    (dict(cache_seqlens=31, rotary_cos=torch.zeros(31, 16), rotary_sin=torch.zeros(31, 16)),
     "have 31 rows but the call rotates positions up to 31"),
    (dict(cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32)), "cache_batch_idx values must be in \\[0, 2\\)"),
    (dict(cache_batch_idx=torch.tensor([0, -1], dtype=torch.int32)), "cache_batch_idx values"),
    (dict(cache_batch_idx=torch.tensor([0, 1])), "cache_batch_idx must be an int32"),
    (dict(cache_batch_idx=torch.tensor([0], dtype=torch.int32)), "cache_batch_idx must be an int32 tensor of shape \\(2,\\)"),
    (dict(cache_leftpad=torch.tensor([0, 21], dtype=torch.int32)), "cache_leftpad values .* past its cache_seqlens"),
    (dict(cache_leftpad=torch.tensor([-1, 0], dtype=torch.int32)), "cache_leftpad values .* below 0"),
    (dict(cache_leftpad=[0, 1]), "cache_leftpad must be an int32"),
])
def test_bad_input(pkg, over, match):
    with pytest.raises(ValueError, match=match):
        _bad_call(pkg, **over)


def test_bad_input_needing_the_call(pkg):
    """Refusals that depend on the other arguments: a page table with cache_batch_idx (as
    flash-attn), a latent cache (V a view of K), a cache of more rows without
    cache_batch_idx."""
    k_cache = torch.zeros(6, 8, H_KV, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="cache_batch_idx indexes a contiguous cache"):
        _bad_call(pkg, k_cache=k_cache, v_cache=k_cache.clone(),
                  block_table=torch.zeros(2, 4, dtype=torch.int32),
                  cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    q, k, _, k_cache, _, _ = inputs([1, 1], 1, 1, 32, torch.float16)
    with pytest.raises(ValueError, match="a latent cache"):
        _bad_call(pkg, q=q, k_cache=k_cache, v_cache=k_cache, k=k, v=k)
    k_cache = torch.zeros(3, 32, H_KV, D, dtype=torch.float16)
    with pytest.raises(ValueError, match="q has batch 2 but the cache has batch 3"):
        _bad_call(pkg, k_cache=k_cache, v_cache=k_cache.clone(), rotary_cos=None,
                  rotary_sin=None)


# ---------------------------------------------------------------------------------------
# unchecked values are clamped, and the hot path reads none
# ---------------------------------------------------------------------------------------
def test_unchecked_bad_values_are_clamped(pkg, monkeypatch, poison):
    """With the value checks off, a cache_batch_idx past the cache, a left padding past the
    length and rotary tables shorter than the positions reach the kernels: no access
    outside any tensor (the interpreter would fault), the token of the bad cache row is
    not written, and the padding past the length leaves no key (out 0, lse -inf)."""
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)
    lens = [10, 20]
    q, k, v, k_cache, v_cache, _ = inputs(lens, 1, 1, 32, torch.float16, cache_rows=2, seed=8)
    cos, sin = tables(4, 64, torch.float16)  # positions 10 and 20 clamp to row 3
    before = k_cache.clone()
    with torch.no_grad(), pkg._runtime.override_config(**SMALL_TILES):
        out, lse = pkg.flash_attn_with_kvcache(
            q, k_cache, v_cache, k, v, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
            causal=True, rotary_cos=cos, rotary_sin=sin, return_lse=True,
            cache_batch_idx=torch.tensor([0, 7], dtype=torch.int32),
            cache_leftpad=torch.tensor([0, 99], dtype=torch.int32))
    assert torch.equal(_bits(k_cache[1]), _bits(before[1])), "a token went to a clamped row"
    # element 0: rotated at the clamped position 3
    want = rotate64(k[0], cos, sin, torch.tensor([3]), True)[0].to(torch.float16)
    assert torch.allclose(k_cache[0, 10].double(), want.double(), atol=1e-3, rtol=0)
    assert torch.isfinite(lse[0]).all() and not torch.isnan(out).any()
    assert (lse[1] == float("-inf")).all() and (out[1] == 0).all()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "append_kernel"])
def test_hot_path_reads_no_device_values(pkg, monkeypatch, fused):
    """A server's call with rotary, cache_batch_idx and cache_leftpad and the value checks
    off: no device value read on the host, a repeated call allocates out and the LSE and
    launches the attention kernel, which appends (FUSED_APPEND), or the append and then
    the attention kernel (FLASHGEN_FUSED_APPEND=0), nothing else."""
    from test_decode import SYNCS, _CountOps, _no_sync, _RecordLaunches

    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)
    monkeypatch.setattr(pkg._decode, "FUSED_APPEND", fused)
    lens = [10, 20]
    q, k, v, k_cache, v_cache, _ = inputs(lens, 1, 1, 32, torch.float16, cache_rows=3)
    cos, sin = tables(32, 32, torch.float16)
    seqlens = torch.tensor(lens, dtype=torch.int32)
    idx, pad = torch.tensor([2, 0], dtype=torch.int32), torch.tensor([1, 2], dtype=torch.int32)
    launches = _RecordLaunches()
    monkeypatch.setattr(pkg._decode, "_plans", {})
    monkeypatch.setattr(pkg._runtime, "kernel", launches)

    def call():
        return pkg.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                           causal=True, rotary_cos=cos, rotary_sin=sin,
                                           cache_batch_idx=idx, cache_leftpad=pad,
                                           return_lse=True, num_splits=1)

    with pkg._runtime.override_config(**SMALL_TILES), torch.inference_mode():
        with monkeypatch.context() as m:
            for name in SYNCS:
                m.setattr(torch.Tensor, name, _no_sync)
            call()
            del launches.launches[:]
            with _CountOps() as counted:
                call()
    assert counted.ops == ["empty"] * 2, counted.ops
    assert [f for f, _ in launches.launches] == ["kernel"] if fused else ["append", "kernel"]
