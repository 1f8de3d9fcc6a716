"""Decoding with a KV cache (`flash_attn_with_kvcache`) against a float64 reference.

The reference is built from the definitions: for each batch element gather its first
L = cache_seqlens + N_new cache rows (through the block table for a paged cache, one row
at a time), put query i at position L - N_q + i, mask with flashgen.reference's
bottom-right causal/window mask and take a naive softmax. Shapes stay small for Triton's
interpreter (B = 3, H_kv = 2, d = 64, lengths <= 300) and most calls force 16 x 16 tiles
so that a few hundred keys cross many key blocks, every split holds several, and the
masked/unmasked loop phases all run.

The host path is checked too: a repeated call must not read device values (no
.item()/.tolist()/.cpu()) and must issue only a couple of torch ops, and with the value
checks off, out-of-range lengths and page indices must be clamped by the kernels (the
interpreter would crash on an out-of-bounds access) rather than reported.
"""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import LSE_TOL, OUT_TOL
from packages import build_and_import
from flashgen.reference import attention_ref, visible_mask

SMALL_TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)
H_KV = 2


@pytest.fixture
def checked(pkg, monkeypatch):
    """Value checks on (FLASHGEN_CHECK_VALUES=1), whatever the environment says."""
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", True)


@pytest.fixture
def unchecked(pkg, monkeypatch):
    """Value checks off (FLASHGEN_CHECK_VALUES=0): the kernels' clamping is all there is."""
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", False)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("decode"), "fg_test_decode", """
        head_dims: [64, 80]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 32, right: 0}
        gqa: true
        decode: true
        """)


# ---------------------------------------------------------------------------------------
# inputs and the reference
# ---------------------------------------------------------------------------------------
def make_cache(batch, capacity, *, page_size=None, d=64, dtype=torch.float16, device="cpu",
               seed=0):
    """(k_cache, v_cache, block_table). Paged: the pages of all batch elements are
    shuffled through the pool, with a few spare pages no one uses."""
    g = torch.Generator().manual_seed(seed)
    if page_size is None:
        k, v = (torch.randn(batch, capacity, H_KV, d, generator=g).to(dtype) for _ in range(2))
        return k.to(device), v.to(device), None
    max_pages = -(-capacity // page_size)
    num_blocks = batch * max_pages + 3
    k, v = (torch.randn(num_blocks, page_size, H_KV, d, generator=g).to(dtype) for _ in range(2))
    table = torch.randperm(num_blocks, generator=g)[:batch * max_pages].view(batch, max_pages)
    return k.to(device), v.to(device), table.to(torch.int32).to(device)


def logical_rows(cache, table, b, n):
    """The first n cache rows of batch element b, (n, H_kv, d), by definition."""
    if table is None:
        return cache[b, :n]
    page_size = cache.shape[1]
    rows = [cache[int(table[b, j // page_size]), j % page_size] for j in range(n)]
    return torch.stack(rows) if rows else cache.new_zeros((0,) + tuple(cache.shape[2:]))


def reference(q, k_cache, v_cache, table, lengths, *, causal=False, window=(-1, -1)):
    """(out (B, N_q, H_q, d), lse (B, H_q, N_q)) in float64 on the CPU."""
    q, k_cache, v_cache = q.cpu(), k_cache.cpu(), v_cache.cpu()
    table = None if table is None else table.cpu()
    outs, lses = [], []
    for b, n in enumerate(lengths):
        k = logical_rows(k_cache, table, b, n)[None].transpose(1, 2)
        v = logical_rows(v_cache, table, b, n)[None].transpose(1, 2)
        vis = visible_mask(q.shape[1], n, causal=causal, window=window, bottom_right=True)
        o, lse = attention_ref(q[b:b + 1].transpose(1, 2), k, v, vis)
        outs.append(o.transpose(1, 2))
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def assert_matches(out, lse, ref_out, ref_lse, dtype):
    assert not torch.isnan(out).any(), "NaN in the output (or an element never written)"
    assert not torch.isnan(lse).any(), "NaN in the LSE (or an element never written)"
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double().cpu(), ref_out, atol=atol, rtol=rtol)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse).cpu(), seen), "LSE -inf rows differ"
    assert (lse.cpu()[~seen] == float("-inf")).all()
    assert (out.cpu().transpose(1, 2)[~seen] == 0).all(), "a row that sees no key must be 0"
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse[seen], atol=LSE_TOL[0],
                               rtol=LSE_TOL[1])


def run(pkg, q, k_cache, v_cache, lengths, *, table=None, tiles=SMALL_TILES, **kwargs):
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=q.device)
    with pkg._runtime.override_config(**tiles) if tiles else _nothing():
        return pkg.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=seqlens,
                                           block_table=table, return_lse=True, **kwargs)


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def queries(batch, n_q, group, *, d=64, dtype=torch.float16, device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, n_q, H_KV * group, d, generator=g).to(dtype).to(device)


# ---------------------------------------------------------------------------------------
# contiguous caches: ragged lengths (empty, partial, full), N_q 1 and 4, GQA
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("n_q", [1, 4])
def test_contiguous_ragged(pkg, device, poison, n_q, causal):
    lengths = [0, 137, 300]  # empty, partial, the whole cache
    k_cache, v_cache, _ = make_cache(3, 300, device=device)
    q = queries(3, n_q, 4, device=device)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, causal=causal, num_splits=3)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert lse.shape == (3, 8, n_q) and lse.dtype == torch.float32
    assert_matches(out, lse, *reference(q, k_cache, v_cache, None, lengths, causal=causal),
                   torch.float16)


def test_gqa_8_to_1_and_rows_without_keys(pkg, device, poison):
    """8 query heads per KV head x 4 tokens = 32 stacked rows; L = 2 < N_q, so with causal
    the first two query tokens of that element see no key at all."""
    lengths = [2, 61, 200]
    k_cache, v_cache, _ = make_cache(3, 200, device=device, seed=2)
    q = queries(3, 4, 8, device=device, seed=3)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, causal=True, num_splits=2)
    ref_out, ref_lse = reference(q, k_cache, v_cache, None, lengths, causal=True)
    assert not torch.isfinite(ref_lse[0, :, :2]).any()
    assert_matches(out, lse, ref_out, ref_lse, torch.float16)


def test_several_row_blocks(pkg, device, poison):
    """8 heads x 9 tokens = 72 stacked rows: more than one query-row block per KV head."""
    lengths = [40, 75]
    k_cache, v_cache, _ = make_cache(2, 80, device=device, seed=4)
    q = queries(2, 9, 8, device=device, seed=5)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, causal=True, num_splits=2)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, None, lengths, causal=True),
                   torch.float16)


@pytest.mark.parametrize("group, n_q, rows", [(4, 8, 32), (8, 8, 64)])
def test_stacked_tiles_reduce_splits_in_chunks(pkg, device, poison, group, n_q, rows):
    """32 and 64 stacked rows run one tile of that many rows, whose split reduction reads
    fewer splits a step (planner_core.decode_split_chunk: 4 and 2 at V dim 64, where 16
    rows read 8): 7 splits take several steps, one of them partly past the last split."""
    lengths = [33, 250]
    k_cache, v_cache, _ = make_cache(2, 250, device=device, seed=40)
    q = queries(2, n_q, group, device=device, seed=41)
    with pkg._runtime.override_config(**SMALL_TILES):
        plan = pkg._decode._make_plan(q, k_cache, v_cache, None, None,
                                      torch.tensor(lengths, dtype=torch.int32, device=device),
                                      None, None, True, (-1, -1), 7)
    assert plan.kernel.meta["BLOCK_M"] == rows and plan.split
    assert pkg._decode._planner.decode_split_chunk(rows, 64) == 128 // rows
    out, lse = run(pkg, q, k_cache, v_cache, lengths, causal=True, num_splits=7)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, None, lengths, causal=True),
                   torch.float16)


# ---------------------------------------------------------------------------------------
# paged caches: shuffled block tables, page sizes below, at and above BLOCK_N
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [5, 16, 64, 256])
def test_paged(pkg, device, poison, page_size):
    lengths = [0, 257, 300]
    k_cache, v_cache, table = make_cache(3, 300, page_size=page_size, device=device,
                                         seed=page_size)
    q = queries(3, 4, 4, device=device, seed=6)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, table=table, causal=True, num_splits=3)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths, causal=True),
                   torch.float16)


@pytest.mark.parametrize("page_size", [16, 256])
def test_paged_planned_tiles_auto_splits(pkg, device, poison, page_size):
    """The planner's real tiles and num_splits=0: BLOCK_N 128 > page 16 (a page lookup
    per key row), and page 256 = 2 key blocks (one page lookup per key block)."""
    lengths = [300, 33, 129]
    k_cache, v_cache, table = make_cache(3, 304, page_size=page_size, device=device, seed=7)
    q = queries(3, 1, 4, device=device, seed=8)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, table=table, tiles=None)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths), torch.float16)


# ---------------------------------------------------------------------------------------
# appending new keys and values in place
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("page_size", [None, 16], ids=["contiguous", "paged16"])
@pytest.mark.parametrize("n_q,n_new", [(3, 3), (1, 2)])
def test_append(pkg, device, poison, page_size, n_q, n_new):
    lengths = [0, 100, 300 - n_new]  # the last one fills the cache exactly
    k_cache, v_cache, table = make_cache(3, 300, page_size=page_size, device=device, seed=9)
    g = torch.Generator().manual_seed(10)
    k_new, v_new = (torch.randn(3, n_new, H_KV, 64, generator=g).half().to(device)
                    for _ in range(2))
    q = queries(3, n_q, 4, device=device, seed=11)
    # the expected caches, written by definition one row at a time
    k_want, v_want = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        for t in range(n_new):
            j = n + t
            page, row = (b, j) if table is None else (int(table[b, j // page_size]), j % page_size)
            k_want[page, row] = k_new[b, t]
            v_want[page, row] = v_new[b, t]
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with pkg._runtime.override_config(**SMALL_TILES):
        out, lse = pkg.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=2, return_lse=True)
    assert torch.equal(k_cache, k_want) and torch.equal(v_cache, v_want), \
        "the cache must hold the new rows at cache_seqlens.. and nothing else may change"
    assert torch.equal(seqlens.cpu(), torch.tensor(lengths, dtype=torch.int32)), \
        "cache_seqlens is not updated (flash-attn's convention)"
    total = [n + n_new for n in lengths]
    assert_matches(out, lse, *reference(q, k_want, v_want, table, total, causal=True),
                   torch.float16)


# ---------------------------------------------------------------------------------------
# sliding windows, split counts, dtypes, head dims
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("window,causal", [((32, 0), False), ((20, 5), False), ((24, -1), True),
                                           ((-1, 8), False)],
                         ids=["left32", "left20_right5", "left24_causal", "right8"])
def test_window(pkg, device, poison, window, causal):
    lengths = [10, 150, 300]
    k_cache, v_cache, table = make_cache(3, 320, page_size=64, device=device, seed=12)
    q = queries(3, 4, 4, device=device, seed=13)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, table=table, causal=causal,
                   window_size=window, num_splits=3)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths, causal=causal,
                                        window=window), torch.float16)


def test_num_splits_agree(pkg, device, poison):
    """1 split (no combine), 2, 5 and more splits than key blocks (empty splits), the
    heuristic, and a split count given as a launch-config knob all give the answer."""
    lengths = [0, 170, 250]
    k_cache, v_cache, _ = make_cache(3, 250, device=device, seed=14)
    q = queries(3, 2, 4, device=device, seed=15)
    ref = reference(q, k_cache, v_cache, None, lengths, causal=True)
    results = [run(pkg, q, k_cache, v_cache, lengths, causal=True, num_splits=s)
               for s in (1, 2, 5, 20, 0)]
    results.append(run(pkg, q, k_cache, v_cache, lengths, causal=True,
                       tiles=dict(SMALL_TILES, num_splits=4)))
    for out, lse in results:
        assert_matches(out, lse, *ref, torch.float16)
        torch.testing.assert_close(out, results[0][0], atol=2e-3, rtol=0)
        torch.testing.assert_close(lse, results[0][1], atol=1e-5, rtol=0)


def test_a_tuned_split_count_keeps_its_grid_for_other_batches(pkg):
    """num_splits tuned at 8 sequences x 8 KV heads (64 programs) is rescaled so that a
    call with fewer programs keeps about the same grid: 4 splits at 64 programs become
    64 x 4 / 4 = 64 splits at 1 sequence x 4 KV heads -- capped by the key blocks (4 each
    at least) -- and stay 4 at 64 programs."""
    def splits(batch, h_kv, capacity):
        k_cache = torch.zeros(batch, capacity, h_kv, 64, dtype=torch.float16)
        q = torch.zeros(batch, 1, h_kv, 64, dtype=torch.float16)
        with pkg._runtime.override_config(block_m=16, block_n=16, num_warps=4, num_stages=2,
                                          num_splits=4):
            plan = pkg._decode._make_plan(q, k_cache, k_cache, None, None, None, None, None,
                                          False, (-1, -1), 0)
        return plan.kernel.grid[2]

    assert splits(8, 8, 4096) == 4
    assert splits(1, 4, 4096) == 64            # 4 * 64 / 4
    assert splits(1, 4, 256) == 4              # 16 key blocks: at least 4 per split
    assert splits(16, 8, 4096) == 2            # more programs than tuned: fewer splits


@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 64), (torch.float32, 64),
                                     (torch.float16, 80)], ids=["bf16", "fp32", "d80"])
def test_dtypes_and_head_dims(pkg, device, poison, dtype, d):
    lengths = [77, 0, 128]
    k_cache, v_cache, table = make_cache(3, 128, page_size=32, d=d, dtype=dtype,
                                         device=device, seed=16)
    q = queries(3, 2, 4, d=d, dtype=dtype, device=device, seed=17)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, table=table, causal=True, num_splits=2)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths, causal=True), dtype)


def test_int_and_none_cache_seqlens(pkg, device):
    """An int is every element's length; None means the cache is full."""
    k_cache, v_cache, _ = make_cache(2, 48, device=device, seed=18)
    q = queries(2, 1, 4, device=device, seed=19)
    with pkg._runtime.override_config(**SMALL_TILES):
        out_int = pkg.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=40)
        out_none = pkg.flash_attn_with_kvcache(q, k_cache, v_cache, num_splits=2)
    torch.testing.assert_close(out_int.double().cpu(),
                               reference(q, k_cache, v_cache, None, [40, 40])[0],
                               atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(out_none.double().cpu(),
                               reference(q, k_cache, v_cache, None, [48, 48])[0],
                               atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("page_size", [None, 64], ids=["contiguous", "paged64"])
def test_short_lengths_in_a_large_cache(pkg, device, poison, page_size):
    """The split count comes from the capacity (1024 keys: 16 splits here), not the
    lengths in use, so most splits of the short elements are empty. They must write no
    partial output that the combine reads (poison: torch.empty is NaN-filled)."""
    lengths = [0, 3, 100]
    k_cache, v_cache, table = make_cache(3, 1024, page_size=page_size, device=device,
                                         seed=30)
    q = queries(3, 1, 4, device=device, seed=31)
    out, lse = run(pkg, q, k_cache, v_cache, lengths, table=table, causal=True)
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths, causal=True),
                   torch.float16)
    assert pkg._decode.num_splits_heuristic(3 * H_KV, 1024 // 16, 132) == 16


def test_return_lse_or_not_and_repeated_calls(pkg, device):
    """The cached plan serves calls with and without return_lse (the LSE store is off
    without it) and repeated calls give the same answer: bitwise, since the split
    reduction adds the splits in a fixed order whichever finishes last, and every
    tile's ticket counter is back at 0 after a call."""
    lengths = [50, 200, 7]
    k_cache, v_cache, table = make_cache(3, 256, page_size=32, device=device, seed=32)
    q = queries(3, 1, 4, device=device, seed=33)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with pkg._runtime.override_config(**SMALL_TILES):
        for splits in (1, 3):
            kw = dict(cache_seqlens=seqlens, block_table=table, num_splits=splits)
            out, lse = pkg.flash_attn_with_kvcache(q, k_cache, v_cache, return_lse=True, **kw)
            again = pkg.flash_attn_with_kvcache(q, k_cache, v_cache, **kw)
            assert torch.equal(out, again)
            assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths),
                           torch.float16)
            if splits > 1:
                counters = [c for (dev, _), c in pkg._decode._tickets.items()
                            if dev == out.device]
                assert counters and not any(c.any() for c in counters)


def test_ticket_counters_made_under_capture_are_not_kept(pkg, monkeypatch):
    """A counter set made while a CUDA graph is being captured belongs to that graph's
    memory pool (and only its replays zero it): the next call outside the capture must not
    find it in the cache. Outside a capture a set is made once and reused."""
    dev = torch.device("cpu")
    monkeypatch.setattr(pkg._decode, "_tickets", {})
    monkeypatch.setattr(pkg._runtime, "_capturing", lambda device: True)
    first = pkg._decode._ticket_counters(dev, 10)
    assert pkg._decode._tickets == {} and not first.any()
    assert pkg._decode._ticket_counters(dev, 10) is not first
    monkeypatch.setattr(pkg._runtime, "_capturing", lambda device: False)
    kept = pkg._decode._ticket_counters(dev, 10)
    assert pkg._decode._ticket_counters(dev, 10) is kept
    assert list(pkg._decode._tickets.values()) == [kept]


def test_v_cache_read_from_a_copy_keeps_appends(pkg, poison, monkeypatch):
    """The runtime's side of the padded-V fix, in the interpreter: where v_in_place says no
    (here: any non-contiguous V), the call attends over a contiguous copy and an append's
    new rows still land in the caller's cache, nothing else in it changing."""
    asked = []
    monkeypatch.setattr(pkg._runtime, "v_in_place",
                        lambda v: asked.append(v.is_contiguous()) or v.is_contiguous())
    dt, d, lengths = torch.float16, 80, [5, 0, 30]
    k_cache, _, table = make_cache(3, 32, page_size=16, d=d, dtype=dt, seed=53)
    g = torch.Generator().manual_seed(54)
    pool = torch.randn(k_cache.shape[0], 16, H_KV, d + 8, generator=g).to(dt)
    v_cache = pool[..., :d]
    k_new, v_new = (torch.randn(3, 2, H_KV, d, generator=g).to(dt) for _ in range(2))
    q = queries(3, 2, 4, d=d, dtype=dt, seed=55)
    v_want, tail = v_cache.clone(), pool[..., d:].clone()
    for b, n in enumerate(lengths):
        for t in range(2):
            v_want[int(table[b, (n + t) // 16]), (n + t) % 16] = v_new[b, t]
    out, lse = run(pkg, q, k_cache, v_cache, lengths, table=table, causal=True, k=k_new,
                   v=v_new)
    assert asked[:2] == [False, True], "the padded V must be staged, its copy read in place"
    assert torch.equal(v_cache, v_want) and torch.equal(pool[..., d:], tail)
    grown = [n + 2 for n in lengths]
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, grown, causal=True), dt)


@pytest.mark.gpu
@pytest.mark.parametrize("pad", [1, 8])
@pytest.mark.parametrize("n_q", [1, 64])
def test_padded_v_cache_rows_at_a_split_head_dim(pkg, poison, n_q, pad):
    """A V cache whose rows are not 16-element aligned, at d = 80 (tiled 64 + 16), with the
    planned tiles: the `tl` forward computed the narrow chunk's P @ V wrong from such rows
    on Hopper (Triton 3.6), so the decode kernel, tiled the same way, is checked at that
    layout too, at one query and at a wgmma-size query block."""
    dt, d = torch.bfloat16, 80
    k_cache, _, table = make_cache(3, 320, page_size=64, d=d, dtype=dt, device="cuda", seed=50)
    g = torch.Generator().manual_seed(51)
    pool = torch.randn(k_cache.shape[0], 64, H_KV, d + pad, generator=g).to(dt).to("cuda")
    v_cache = pool[..., :d]
    lengths = [300, 59, 1 + n_q]
    q = queries(3, n_q, 4, d=d, dtype=dt, device="cuda", seed=52)
    for kw in (dict(table=table), dict(table=table, num_splits=4)):
        out, lse = run(pkg, q, k_cache, v_cache, lengths, causal=True, tiles=None, **kw)
        assert_matches(out, lse, *reference(q, k_cache, v_cache, table, lengths, causal=True), dt)
    # an append: the runtime attends over a copy of such V, so the new rows must still
    # reach the caller's cache (and nothing else in it change)
    v_new = torch.randn(3, 1, H_KV, d, generator=g).to(dt).to("cuda")
    k_new = torch.randn(3, 1, H_KV, d, generator=g).to(dt).to("cuda")
    v_want = v_cache.clone()
    for b, n in enumerate(lengths):
        v_want[int(table[b, n // 64]), n % 64] = v_new[b, 0]
    out, lse = run(pkg, q, k_cache, v_cache, lengths, causal=True, tiles=None, table=table,
                   k=k_new, v=v_new)
    assert torch.equal(v_cache, v_want), "the new V rows must reach the caller's cache"
    grown = [n + 1 for n in lengths]
    assert_matches(out, lse, *reference(q, k_cache, v_cache, table, grown, causal=True), dt)


@pytest.mark.gpu
def test_split_decode_in_two_cuda_graphs(pkg):
    """Split decode captured into two graphs on the capture stream (no eager call there
    first, so the counters are made under capture), the first graph freed, the second
    replayed on new queries, then an eager call: each against the reference."""
    lengths = [300, 1000, 77]
    k_cache, v_cache, table = make_cache(3, 1024, page_size=32, device="cuda", seed=41)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device="cuda")
    kw = dict(cache_seqlens=seqlens, block_table=table, num_splits=4, return_lse=True)
    static_q = queries(3, 1, 4, device="cuda", seed=42)
    with pkg._runtime.override_config(**SMALL_TILES):
        pkg.flash_attn_with_kvcache(static_q, k_cache, v_cache, **kw)  # plans, on this stream
        torch.cuda.synchronize()
        outs = []
        for _ in range(2):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out, lse = pkg.flash_attn_with_kvcache(static_q, k_cache, v_cache, **kw)
            outs.append((graph, out, lse))
        del outs[0]
        torch.cuda.empty_cache()
        graph, out, lse = outs[0]
        for seed in (43, 44):
            q = queries(3, 1, 4, device="cuda", seed=seed)
            static_q.copy_(q)
            graph.replay()
            torch.cuda.synchronize()
            ref_out, ref_lse = reference(q, k_cache, v_cache, table, lengths)
            assert_matches(out, lse, ref_out, ref_lse, torch.float16)
        assert_matches(*pkg.flash_attn_with_kvcache(static_q, k_cache, v_cache, **kw),
                       ref_out, ref_lse, torch.float16)


def test_split_heuristic(pkg):
    h = pkg._decode.num_splits_heuristic
    assert h(8 * 8, 32, 132) == 2  # 64 programs -> 128: one wave over 132 SMs
    assert h(1 * 8, 512, 132) == 16
    assert h(132, 512, 132) == 1  # the grid already fills a wave
    assert h(264, 512, 132) == 1
    assert h(8, 6, 132) == 1  # too few key blocks to split
    assert h(8, 8, 132) == 2  # splits keep >= 4 key blocks each
    assert h(1, 10 ** 6, 132) == 128  # capped
    assert h(8, 0, 132) == 1


def test_paged_cache_fills_a_wave_over_a_tuned_split(pkg, monkeypatch):
    """A tuned split count was timed on a contiguous cache; a paged call takes at least the
    heuristic's one wave of programs (its block-table loads want more programs in flight),
    a contiguous call keeps the tuned count (rescaled to the tuned grid). Plans only: no
    launch."""
    capacity = 4096
    k_cache, v_cache, table = make_cache(2, capacity, page_size=64, seed=40)
    flat_k, flat_v, _ = make_cache(2, capacity, seed=40)
    q = queries(2, 1, 4, seed=41)
    lens = torch.tensor([1000, 9], dtype=torch.int32)
    planned = pkg._runtime.launch_config
    monkeypatch.setattr(pkg._runtime, "launch_config",
                        lambda *a: {**planned(*a), "num_splits": 1, "block_n": 16})
    d = pkg._decode
    sms = d.TARGET_GPU.get("sm_count") or 132
    programs = 2 * H_KV  # one row block: the group's 4 query rows fit one tile
    n_blocks = capacity // 16
    splits = {name: d._make_plan(q, kc, vc, None, None, lens, bt, None, False, (-1, -1), 0).kernel.grid[2]
              for name, kc, vc, bt in (("paged", k_cache, v_cache, table),
                                       ("flat", flat_k, flat_v, None))}
    assert splits["flat"] == pkg._planner.TUNED_DECODE_PROGRAMS // programs
    assert splits["paged"] == d.num_splits_heuristic(programs, n_blocks, sms) > splits["flat"]


# ---------------------------------------------------------------------------------------
# validation: ValueError before any launch or write
# ---------------------------------------------------------------------------------------
def _call(pkg, **over):
    """A valid paged call with new keys, with some arguments replaced."""
    k_cache, v_cache, table = make_cache(2, 64, page_size=16, seed=20)
    args = dict(q=queries(2, 1, 4, seed=21), k_cache=k_cache, v_cache=v_cache,
                k=torch.zeros(2, 1, H_KV, 64, dtype=torch.float16),
                v=torch.zeros(2, 1, H_KV, 64, dtype=torch.float16),
                cache_seqlens=torch.tensor([3, 10], dtype=torch.int32), block_table=table)
    args.update(over)
    return pkg.flash_attn_with_kvcache(**args)


def test_valid_call_runs(pkg):
    with pkg._runtime.override_config(**SMALL_TILES):
        assert _call(pkg).shape == (2, 1, 8, 64)


@pytest.mark.parametrize("over,match", [
    (dict(q=torch.zeros(2, 1, 8, 64)), "share a dtype"),
    (dict(q=torch.zeros(2, 1, 8, 32, dtype=torch.float16)), "head dim 32"),
    (dict(q=torch.zeros(3, 1, 8, 64, dtype=torch.float16)), "block_table has 2 rows"),
    (dict(q=torch.zeros(2, 1, 7, 64, dtype=torch.float16)), "multiple of key/value heads"),
    (dict(k=None), "together"),
    (dict(v=None), "together"),
    (dict(k=torch.zeros(2, 2, H_KV, 64, dtype=torch.float16)), "k and v must have one shape"),
    (dict(k=torch.zeros(2, 1, 1, 64, dtype=torch.float16),
          v=torch.zeros(2, 1, 1, 64, dtype=torch.float16)), "N_new, H_kv=2"),
    (dict(cache_seqlens=torch.tensor([3, 64], dtype=torch.int32)), "exceeds the cache capacity"),
    (dict(cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32)), ">= 0"),
    (dict(cache_seqlens=torch.tensor([3, 10], dtype=torch.int64)), "cache_seqlens must be int32"),
    (dict(cache_seqlens=torch.tensor([3], dtype=torch.int32)), r"shape \(2,\)"),
    (dict(cache_seqlens=64), "exceeds the cache capacity"),
    (dict(cache_seqlens=None), "without cache_seqlens"),
    (dict(block_table=torch.zeros(2, 4, dtype=torch.int64)), "block_table must be int32"),
    (dict(block_table=torch.zeros(8, dtype=torch.int32)), "2-D"),
    (dict(block_table=torch.tensor([[0, 1, 2, 3], [11, 5, 6, 7]], dtype=torch.int32)),
     r"page indices in \[0, 11\)"),
    (dict(block_table=torch.tensor([[-1, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)),
     "page indices"),
    (dict(block_table=torch.arange(8, dtype=torch.int32).view(4, 2).t()), "unit stride"),
    (dict(cache_seqlens=torch.tensor([3, 0, 10, 0], dtype=torch.int32)[::2]),
     "cache_seqlens must be contiguous"),
    (dict(num_splits=-1), "num_splits"),
    (dict(softmax_scale=-1.0), "softmax scale"),
    (dict(window_size=(-2, 0)), "window_size"),
], ids=["dtype", "head_dim", "batch", "heads", "k_only", "v_only", "kv_shapes", "new_heads",
        "too_long", "negative", "seqlens_dtype", "seqlens_shape", "int_too_long",
        "append_full", "table_dtype", "table_shape", "table_high", "table_negative",
        "table_strides", "seqlens_strided", "splits", "scale", "window"])
def test_bad_input(pkg, checked, over, match):
    k_cache, v_cache, table = make_cache(2, 64, page_size=16, seed=20)
    before = k_cache.clone()
    with pytest.raises(ValueError, match=match):
        _call(pkg, k_cache=k_cache, v_cache=v_cache, **over)
    assert torch.equal(k_cache, before), "a rejected call must not write the cache"


def test_unused_block_table_entries_may_be_padding(pkg, checked):
    """Only the pages the call touches are checked: -1 padding past them is fine."""
    table = torch.tensor([[0, 1, -1, -1], [2, -1, -1, -1]], dtype=torch.int32)
    with pkg._runtime.override_config(**SMALL_TILES):
        _call(pkg, block_table=table)


@pytest.mark.parametrize("mode", [None, True, False], ids=["auto", "on", "off"])
def test_value_checks_follow_the_switch(pkg, monkeypatch, mode):
    """FLASHGEN_CHECK_VALUES: auto checks tensors when that is free (CPU tensors here),
    on always, off never; an int cache_seqlens is checked whatever the switch."""
    monkeypatch.setattr(pkg._decode, "CHECK_VALUES", mode)
    bad_table = torch.tensor([[0, 1, 2, 3], [11, 5, 6, 7]], dtype=torch.int32)
    with pkg._runtime.override_config(**SMALL_TILES):
        if mode is False:
            _call(pkg, block_table=bad_table)  # clamped in the kernel, not reported
        else:
            with pytest.raises(ValueError, match="page indices"):
                _call(pkg, block_table=bad_table)
        with pytest.raises(ValueError, match="exceeds the cache capacity"):
            _call(pkg, cache_seqlens=64)


def _clamped_expectation(k_cache, v_cache, table, lengths, k_new, v_new, capacity):
    """What the kernels promise for out-of-range values: a length is clamped into
    [0, capacity] before N_new is added (and the sum clamped to the capacity), a page
    index into [0, num_blocks), and a new token whose position or page is out of range is
    not written. Returns (k_want, v_want, clamped table, clamped total lengths)."""
    n_new = k_new.shape[1]
    k_want, v_want = k_cache.clone(), v_cache.clone()
    for b, n in enumerate(lengths):
        for t in range(n_new):
            j = n + t
            if not 0 <= j < capacity:
                continue
            if table is None:
                page, row = b, j
            else:
                page, row = int(table[b, j // k_cache.shape[1]]), j % k_cache.shape[1]
                if not 0 <= page < k_cache.shape[0]:
                    continue
            k_want[page, row] = k_new[b, t]
            v_want[page, row] = v_new[b, t]
    clamped = None if table is None else table.clamp(0, k_cache.shape[0] - 1)
    total = [min(min(max(n, 0), capacity) + n_new, capacity) for n in lengths]
    return k_want, v_want, clamped, total


@pytest.mark.parametrize("page_size,tiles", [(None, "small"), (5, "small"), (16, "small"),
                                             (256, "planned")],
                         ids=["contiguous", "paged5_per_row", "paged16_per_block",
                              "paged256_planned"])
def test_unchecked_bad_values_are_clamped(pkg, unchecked, device, poison, page_size, tiles):
    """With the checks off, lengths beyond the cache (or negative) and page indices out of
    the pool reach the kernels. They must stay inside the cache: Triton's interpreter
    reads raw memory and would crash (or raise) on an out-of-bounds access, as a GPU
    would fault. The answer is the clamped one (see _clamped_expectation)."""
    capacity = 64 if page_size is None else -(-64 // page_size) * page_size
    lengths = [10 ** 5, -3, 40, 20]  # past the cache, negative, then two valid ones
    k_cache, v_cache, table = make_cache(4, 64, page_size=page_size, device=device, seed=40)
    if table is not None:
        table = table.clone()
        table[2, 40 // page_size] = 10 ** 6  # element 2's append and reads hit a bad page
        table[3, 0] = -7  # element 3 reads a negative page
        table[0, -1] = 2 ** 31 - 1
    g = torch.Generator().manual_seed(41)
    k_new, v_new = (torch.randn(4, 1, H_KV, 64, generator=g).half().to(device) for _ in range(2))
    q = queries(4, 2, 4, device=device, seed=42)
    k_want, v_want, clamped, total = _clamped_expectation(
        k_cache.cpu(), v_cache.cpu(), None if table is None else table.cpu(), lengths,
        k_new.cpu(), v_new.cpu(), capacity)
    seqlens = torch.tensor(lengths, dtype=torch.int32, device=device)
    with pkg._runtime.override_config(**SMALL_TILES) if tiles == "small" else _nothing():
        out, lse = pkg.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                               cache_seqlens=seqlens, block_table=table,
                                               causal=True, num_splits=3, return_lse=True)
    assert torch.equal(k_cache.cpu(), k_want) and torch.equal(v_cache.cpu(), v_want)
    if pkg._decode.FUSED_APPEND:
        # the append in the attention launch attends its new keys from k, v themselves at
        # the last N_new of the clamped positions, written or not (the contract is memory
        # safety; the other keys are the cache's, as without it)
        want = [reference(q[b:b + 1], *_with_new_rows(k_want, v_want, clamped, b, total[b],
                                                      k_new.cpu(), v_new.cpu()), [total[b]],
                          causal=True) for b in range(len(lengths))]
        want = torch.cat([o for o, _ in want]), torch.cat([lse for _, lse in want])
    else:
        want = reference(q, k_want, v_want, clamped, total, causal=True)
    assert_matches(out, lse, *want, torch.float16)


def _with_new_rows(k_cache, v_cache, table, b, total, k_new, v_new):
    """(k, v, None): element b's first `total` keys and values as a contiguous cache of one
    element, the last k_new.shape[1] of them its new rows (a clamped table may map two of
    its positions to one row: only the later one takes the new row)."""
    n_new = k_new.shape[1]
    k, v = (logical_rows(c, table, b, total).clone() for c in (k_cache, v_cache))
    first = max(total - n_new, 0)  # (the kernel's new_lo: token t sits at first + t)
    k[first:], v[first:] = k_new[b, :total - first], v_new[b, :total - first]
    return k[None], v[None], None


class _CountOps(TorchDispatchMode):
    """Records the torch (aten) ops issued inside the block."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class _RecordLaunches:
    """Stands in for _runtime.kernel: records (function, grid) instead of launching."""

    def __init__(self):
        self.launches = []

    def __call__(self, name, function="kernel"):
        launches = self.launches

        class Handle:
            def __getitem__(self, grid):
                return lambda *args, **kwargs: launches.append((function, grid))
        return Handle()


def _no_sync(*args, **kwargs):
    raise AssertionError("the hot path read a tensor's value on the host (a device sync)")


# the ways a tensor's value reaches the host
SYNCS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out_lse"])
@pytest.mark.parametrize("n_new", [0, 1], ids=["no_new", "append"])
@pytest.mark.parametrize("page_size", [None, 8, 256], ids=["contiguous", "paged8", "paged256"])
def test_hot_path_reads_no_device_values(pkg, unchecked, monkeypatch, page_size, n_new,
                                         return_lse):
    """A server's call (tensor cache_seqlens, checks off): neither the first call (which
    plans) nor a repeated one reads a device value, and a repeated call issues only its
    allocations -- out, the split workspace, the LSE if asked for -- and its launches:
    the append (if new keys) and the split-KV kernel (which reduces its own splits). The kernels are
    recorded, not run."""
    k_cache, v_cache, table = make_cache(2, 512, page_size=page_size, seed=43)
    q = queries(2, 1, 4, seed=44)
    seqlens = torch.tensor([100, 300], dtype=torch.int32)
    k_new = v_new = None
    if n_new:
        k_new, v_new = (torch.zeros(2, n_new, H_KV, 64, dtype=torch.float16) for _ in range(2))
    launches = _RecordLaunches()
    monkeypatch.setattr(pkg._decode, "_plans", {})
    monkeypatch.setattr(pkg._runtime, "kernel", launches)

    def call():
        return pkg.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                           cache_seqlens=seqlens, block_table=table,
                                           causal=True, return_lse=return_lse)

    with pkg._runtime.override_config(**SMALL_TILES), torch.inference_mode():
        with monkeypatch.context() as m:
            for name in SYNCS:
                m.setattr(torch.Tensor, name, _no_sync)
            call()  # plans
            del launches.launches[:]
            with _CountOps() as counted:
                call()
    assert counted.ops == ["empty"] * (2 + return_lse), counted.ops
    kinds = [function for function, _ in launches.launches]
    # (the attention launch appends: FUSED_APPEND)
    assert kinds == ["append"] * (bool(n_new) and not pkg._decode.FUSED_APPEND) + ["kernel"], kinds
    assert len(pkg._decode._plans) == 1


def test_bad_layouts_and_kinds(pkg):
    k_cache, v_cache, _ = make_cache(2, 32, seed=22)
    q = queries(2, 1, 4, seed=23)
    lens = torch.tensor([5, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="unit stride"):
        pkg.flash_attn_with_kvcache(q, k_cache.transpose(-1, -2).contiguous().transpose(-1, -2),
                                    v_cache, cache_seqlens=lens)
    with pytest.raises(ValueError, match="one shape"):
        pkg.flash_attn_with_kvcache(q, k_cache, v_cache[:, :16], cache_seqlens=lens)
    with pytest.raises(ValueError, match="4-D"):
        pkg.flash_attn_with_kvcache(q[0], k_cache, v_cache, cache_seqlens=lens)
    with pytest.raises(ValueError, match="batch 2"):
        pkg.flash_attn_with_kvcache(q[:1], k_cache, v_cache, cache_seqlens=lens[:1])
    with pytest.raises(ValueError, match=r"`head_dims`"):
        pkg.flash_attn_with_kvcache(*(torch.zeros(2, n, 2, 96, dtype=torch.float16)
                                      for n in (1, 32, 32)), cache_seqlens=lens)
    with pytest.raises(ValueError, match=r"`dtypes`"):
        pkg.flash_attn_with_kvcache(*(t.double() for t in (q, k_cache, v_cache)),
                                    cache_seqlens=lens)


def test_gradients_are_refused(pkg):
    k_cache, v_cache, _ = make_cache(2, 32, seed=24)
    q = queries(2, 1, 4, seed=25).requires_grad_()
    with pytest.raises(ValueError, match="forward-only"):
        pkg.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5)
    with torch.no_grad(), pkg._runtime.override_config(**SMALL_TILES):
        assert pkg.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=5).shape == q.shape


def test_package_without_decode_names_the_spec_field(tmp_path):
    other = build_and_import(tmp_path, "fg_test_no_decode", """
        head_dims: [64]
        dtypes: [fp16]
        masks: [none]
        """)
    k_cache, v_cache, _ = make_cache(1, 16, seed=26)
    q = torch.zeros(1, 1, H_KV, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="decode: true"):
        other.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3)


def test_mask_not_built_names_the_spec_field(tmp_path):
    other = build_and_import(tmp_path, "fg_test_decode_causal_only", """
        head_dims: [64]
        dtypes: [fp16]
        masks: [causal]
        decode: true
        """)
    k_cache, v_cache, _ = make_cache(1, 16, seed=27)
    q = torch.zeros(1, 1, H_KV, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="`masks`"):
        other.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=3, window_size=(4, 0))
