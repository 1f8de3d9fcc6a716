"""Context parallelism with data-dependent masks, sinks and mod gradients (issue 51) on
the CPU: the ring and all-gather strategies with document ids, key padding and attn_mask
passed whole on every rank, sinks folded into the merged rows once, and the gradients of
a float attn_mask and of the sinks, summed over pieces and ranks.

In process: the cell table against brute force, planning with it (a piece that sees
nothing is not launched), cu_seqlens to document ids. Across processes (gloo,
tests/ring_worker.py as in test_ring): world sizes 2 and 3 (4 in the slow group) against
the package's single-process call and the float64 reference, bitwise determinism, and the
refusals (a sharded mask tensor, shards that differ across ranks, a bad mask on one rank
only), raised on every rank. Shapes are tiny: Triton's interpreter runs the kernels.
"""
import re

import pytest
import torch

from packages import build_and_import
from test_ring import TILES, assert_results, case, run_world

PACKAGE = "fg_test_ring_masks"
SPEC = """
    head_dims: [16]
    dtypes: [fp32, bf16]
    masks: [none, causal]
    gqa: true
    attn_mask: true
    mods:
      document: {builtin: document}
      key_padding: {builtin: key_padding}
      sink_logits: {builtin: sink_logits}
    variants:
      - {mask: causal, mods: [document]}
      - {mask: none, mods: [document]}
      - {mask: causal, mods: [key_padding]}
      - {mask: causal, mods: [sink_logits]}
      - {mask: causal, mods: [document, sink_logits]}
    """


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring_masks")
    pkg = build_and_import(root, PACKAGE, SPEC)
    return pkg, root / "out"


@pytest.fixture(scope="module")
def pkg(built):
    return built[0]


def ints(values, dtype="int32"):
    return {"values": values, "dtype": dtype}


def docs(*lengths):
    """Document ids (1, N) for documents of these lengths, packed."""
    return ints([[i for i, n in enumerate(lengths) for _ in range(n)]])


def mcase(n, mods, mod_kw, **kw):
    return case(n, mods=list(mods), mod_kw=mod_kw, **kw)


# ----------------------------------------------------------------------------------------
# In process
# ----------------------------------------------------------------------------------------
def test_document_ids_from_cu_seqlens(pkg):
    got = pkg.document_ids(torch.tensor([0, 3, 3, 7]), n=9)
    assert got.tolist() == [[0, 0, 0, 2, 2, 2, 2, -1, -1]] and got.dtype == torch.int32
    with pytest.raises(ValueError, match="non-decreasing"):
        pkg.document_ids(torch.tensor([0, 5, 2]))


def test_cell_table_and_plans_skip_what_sees_nothing(pkg, monkeypatch):
    """One rank, zig-zag: the table's cells against a brute-force mask; a cell with nothing
    visible launches no kernel (forward and backward), and the result is the single
    call's."""
    torch.manual_seed(0)
    n, world = 24, 1
    doc = torch.tensor([[0] * 12 + [1] * 12], dtype=torch.int32)  # chunk 1 sees only itself
    q = torch.randn(1, n, 2, 16, requires_grad=True)
    k, v = (torch.randn(1, n, 1, 16, requires_grad=True) for _ in range(2))
    rm = pkg._ring_masks
    cp = rm.prepare(("document",), dict(doc=doc), 1, 2, n, q.device)
    _, lo, hi = pkg._ring._global_band(n, True, (-1, -1))
    with pkg._runtime.override_config(**TILES):
        rows = rm.table_rows(cp, q, v, n, 0, world, "zigzag", lo, hi, False)
        assert rows == [1, 0, 0, 1]  # chunk 0 sees chunk 0; chunk 1 only itself
        table = rm.Table([rows], n, world, "zigzag")
        assert not table.sparse and table.steps(world) == []
        launches = []
        for name in ("forward", "backward"):
            real = getattr(pkg._ring, f"_piece_{name}")
            monkeypatch.setattr(pkg._ring, f"_piece_{name}", lambda *a, _r=real, _n=name, **kw:
                                launches.append(_n) or _r(*a, **kw))
        out = pkg.ring_flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
        g = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        assert launches == ["forward"] * 2 + ["backward"] * 2, launches
        monkeypatch.undo()
        ref = pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc)
        g_ref = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_table_needs_and_steps(pkg):
    """need[r][s] and the ring distances some rank needs, from a whole table."""
    rm = pkg._ring_masks
    n_local, world = 8, 3  # contiguous: one chunk a rank
    vis = [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    table = rm.Table(vis, n_local, world, "contiguous")
    assert table.need == [[True, False, False], [True, True, False], [False, False, True]]
    assert table.sparse and table.steps(world) == [1]
    assert table.key_range(8, 0, 24) == (0, 16) and table.key_range(16, 0, 24) == (16, 24)


def brute_work(doc, world, layout, pkg):
    """Visible (query, key) pairs of each rank's rows under causal + document."""
    n = doc.shape[1]
    work = []
    for r in range(world):
        rows = pkg.shard(torch.arange(n)[None], r, world, layout=layout)[0]
        d = doc[0]
        vis = (d[rows][:, None] == d[None, :]) & (torch.arange(n)[None, :] <= rows[:, None])
        work.append(int(vis.sum()))
    return work


def test_document_layout_balances_documents(pkg):
    """Per-document zig-zag: shard / unshard round trip, and every rank's share of the
    causal document mask's work is equal (lengths divisible by 2 * world: exactly; else
    within a row per document and chunk), where the plain zig-zag is not."""
    lengths = [8, 40, 16, 32]  # divisible by 2 * world = 8
    cu = torch.tensor([0, 8, 48, 64, 96])
    doc = pkg.document_ids(cu)
    layout = pkg.document_layout(cu, 4)
    x = torch.arange(96)[None]
    shards = [pkg.shard(x, r, 4, layout=layout) for r in range(4)]
    assert torch.equal(pkg.unshard(shards, layout=layout), x)
    assert shards[0][0, :3].tolist() == [0, 8, 9]  # part 0 of each document, in order
    assert len(set(brute_work(doc, 4, layout, pkg))) == 1
    plain = brute_work(doc, 4, "zigzag", pkg)
    assert max(plain) > 1.3 * min(plain), plain
    # lengths off the 6 chunks (and 3 tokens of padding): within a row per document and
    # chunk (here 140, 143, 147; the plain zig-zag's 100, 96, 234)
    odd = pkg.document_layout(torch.tensor([0, 7, 30, 45]), 3, n=48)
    work = brute_work(pkg.document_ids(torch.tensor([0, 7, 30, 45]), n=48), 3, odd, pkg)
    assert max(work) <= 1.06 * min(work), work
    with pytest.raises(ValueError, match="divide into 8 chunks"):
        pkg.document_layout(torch.tensor([0, 9, 30]), 4)
    q = torch.zeros(1, 96, 2, 16)
    with pytest.raises(ValueError, match="needs the document mask"):
        pkg.ring_flash_attn_func(q, q[:, :, :1], q[:, :, :1], causal=True,
                                 layout=pkg.document_layout(cu, 1))
    with pytest.raises(ValueError, match="do not match"):
        pkg.ring_flash_attn_func(q, q[:, :, :1], q[:, :, :1], causal=True,
                                 layout=pkg.document_layout(cu, 1), mods=("document",),
                                 doc=torch.zeros(1, 96, dtype=torch.int32))


def cross_needs(layout, world, pkg):
    """The (rank, other rank) pairs where a rank's queries see a key of the other's."""
    n = layout.n
    owner = torch.empty(n, dtype=torch.long)
    for r in range(world):
        owner[pkg.shard(torch.arange(n)[None], r, world, layout=layout)[0]] = r
    pairs = set()
    for start, length in zip(layout.starts, layout.lengths):
        o = owner[start:start + length].tolist()
        pairs |= {(a, b) for i, a in enumerate(o) for b in set(o[:i + 1]) if a != b}
    return pairs


def test_balanced_document_layout(pkg):
    """Whole documents on ranks: the round trip, each document's tokens in order on the
    permuted sequence (the causal mask unchanged), the causal work within 5% of equal, and
    most ranks needing nothing of the others (the per-document zig-zag: every pair); a
    document costing more than a rank's share is zig-zagged over every rank."""
    g = torch.Generator().manual_seed(0)
    lengths = [8 * int(x) for x in torch.randint(2, 12, (40,), generator=g)]
    lengths[-1] += -sum(lengths) % 64
    cu = torch.tensor([0] + lengths).cumsum(0)
    doc = pkg.document_ids(cu)
    layout = pkg.document_layout(cu, 4, balanced=True)
    x = torch.arange(layout.n)[None]
    shards = [pkg.shard(x, r, 4, layout=layout) for r in range(4)]
    assert torch.equal(pkg.unshard(shards, layout=layout), x)
    place = layout.inverse
    for start, length in zip(layout.starts, layout.lengths):
        assert bool((place[start:start + length].diff() > 0).all())
    work = brute_work(doc, 4, layout, pkg)
    assert max(work) <= 1.05 * sum(work) / 4, work
    assert len(cross_needs(layout, 4, pkg)) <= 4
    assert len(cross_needs(pkg.document_layout(cu, 4), 4, pkg)) == 12
    assert "balanced" in repr(layout) and layout.key() != pkg.document_layout(cu, 4).key()
    # one long document among short ones: zig-zagged over the ranks, the work equal
    cu = torch.tensor([0, 8, 16, 24, 32, 96])
    work = brute_work(pkg.document_ids(cu), 2, pkg.document_layout(cu, 2, balanced=True), pkg)
    assert max(work) <= 1.05 * sum(work) / 2, work


def test_sharded_mask_tensor_refused(pkg):
    q = torch.zeros(1, 8, 2, 16)
    doc = torch.zeros(1, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="passed whole"):
        pkg.ring_flash_attn_func(q, q[:, :, :1], q[:, :, :1], causal=True,
                                 mods=("document",), doc=doc)
    with pytest.raises(ValueError, match="not this rank's shard"):
        pkg.ring_scaled_dot_product_attention(q.transpose(1, 2), q.transpose(1, 2),
                                              q.transpose(1, 2),
                                              attn_mask=torch.ones(4, 4, dtype=torch.bool))


def test_only_the_pieces_refusals_fall_back_from_the_local_choice(pkg, monkeypatch):
    """strategy="ulysses" over a document layout makes the ring's cell table for the local
    choice (`_ring._ulysses_table`); a ValueError there (the ring's pieces cannot run the
    mods) leaves the call to Ulysses, but a TypeError (a bug) reaches the caller instead of
    taking the slower path. (One rank: the table is made, the choice falls to Ulysses.)"""
    cu = torch.tensor([0, 6, 16])
    layout = pkg.document_layout(cu, 1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 16, 2, 16, generator=g) for _ in range(3))
    doc = pkg.document_ids(cu)
    want = pkg.shard(pkg.flash_attn_func(q, k, v, causal=True, mods=("document",), doc=doc),
                     0, 1, layout=layout)
    mine = [pkg.shard(t, 0, 1, layout=layout) for t in (q, k, v)]

    def call():
        return pkg.ring_flash_attn_func(*mine, causal=True, strategy="ulysses", layout=layout,
                                        mods=("document",), doc=doc)

    got = call()  # (the permuted sequence: its key blocks summed in another order)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)

    def fails(error):
        def table_rows(*args, **kw):
            raise error
        return table_rows

    monkeypatch.setattr(pkg._ring_masks, "table_rows", fails(ValueError("pieces")))
    assert torch.equal(call(), got)
    monkeypatch.setattr(pkg._ring_masks, "table_rows", fails(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        call()


# ----------------------------------------------------------------------------------------
# Across processes
# ----------------------------------------------------------------------------------------
SINKS = {"sinks": {"values": [0.5, -0.3], "dtype": "float32"}}


def mask(blocks, seed=0, heads=2, as_float=True):
    """An attn_mask the worker builds (ring_worker.block_mask): blocks of these lengths."""
    return {"blocks": list(blocks), "seed": seed, "heads": heads, "float": as_float}


def step_cases(world, lengths):
    """A packed batch of documents under the balanced layout, ring and Ulysses, whose
    second step is counted (ring_worker.counted_step; assert_step_work)."""
    cu = [0]
    for x in lengths:
        cu.append(cu[-1] + x)
    kw = dict(causal=True, layout={"documents": cu, "balanced": True}, count=True)
    return [mcase(cu[-1], ["document"], {"doc": docs(*lengths)}, heads=(2, 1), **kw),
            mcase(cu[-1], ["document"], {"doc": docs(*lengths)}, heads=(world, 2),
                  strategy="ulysses", **kw)]


def _counted_results(per_rank):
    """(rank, result) of every counted step (ring_worker.counted_step) the ranks returned."""
    for rank, results in enumerate(per_rank):
        for res in results:
            if "counts" in res:
                yield rank, res


def assert_step_work(per_rank, world):
    """A repeated step with the same document ids: no rank rebuilds the mask's block
    lists or cell table (no block_state launch, as the single-process call's second step
    makes none), reads at most one value on the host (the agreement's gather: a sync on a
    GPU), and visits 1 / world of the single call's key blocks. (Every step used to
    permute the ids anew, so each rank rebuilt its block lists -- under Ulysses over the
    whole sequence -- and its cell table, with 2-3 syncs.)"""
    counted = list(_counted_results(per_rank))
    for rank, res in counted:
        one, cp, what = res["counts"]["single"], res["counts"]["cp"], (rank, res["case"])
        assert one["launches"].get("block_state", 0) == 0, (what, one)
        assert cp["launches"].get("block_state", 0) == 0, (what, cp)
        assert cp["reads"] <= 1, (what, cp)
        assert 0 < cp["visits"] <= 1.05 * one["visits"] / world, (what, cp, one)
    assert len(counted) == 2 * world, len(counted)


# zig-zag over 2 ranks: chunks of 6 tokens, rank 0 holds chunks 0 and 3, rank 1 chunks
# 1 and 2. Documents of 6, 9, 9: chunk 1 sees nothing of chunk 0, so rank 1 needs nothing
# of rank 0 (the direct schedule: rank 1 sends, rank 0 sends back dK/dV)
KEEP = ints([[True] * 9 + [False] * 9 + [True] * 6], "bool")  # chunk 2 all padding
CASES = {
    2: [mcase(24, ["document", "sink_logits"], {"doc": docs(6, 9, 9), **SINKS}, causal=True,
              grad_tensors=["sinks"], repeat=True),
        mcase(24, ["key_padding"], {"keep": KEEP}, causal=True, sdpa=True, heads=(2, 2),
              strategy="allgather"),
        # two blocks, one per contiguous half: rank 1 needs nothing of rank 0
        case(24, sdpa=True, layout="contiguous", heads=(2, 1),
             attn_mask=mask((12, 12)), grad_tensors=["bias"]),
        # the per-document zig-zag: the call runs on the permuted sequence
        mcase(24, ["document"], {"doc": docs(7, 11, 6)}, causal=True, heads=(2, 2),
              dtype="bf16", layout={"documents": [0, 7, 18, 24]}),
        # whole documents on ranks: 4 + 4 + 5 | 6 + 5 on rank 0, the 11 cut across ranks
        mcase(24, ["document"], {"doc": docs(4, 4, 5, 11)}, causal=True, heads=(2, 1),
              layout={"documents": [0, 4, 8, 13, 24], "balanced": True}, repeat=True),
        mcase(24, ["document"], {"doc": docs(4, 4, 5, 11)}, causal=True, heads=(2, 2),
              strategy="ulysses", layout={"documents": [0, 4, 8, 13, 24], "balanced": True}),
        *step_cases(2, [32, 16, 48, 32, 64, 16, 32, 16])],
    3: [mcase(36, ["document", "sink_logits"], {"doc": docs(3, 9, 4, 8, 12), **SINKS},
              causal=True, grad_tensors=["sinks"], repeat=True),
        mcase(36, ["document"], {"doc": docs(5, 7, 6, 6, 4, 8)}, causal=True,
              layout={"documents": [0, 5, 12, 18, 24, 28, 36], "balanced": True})],
    4: [*step_cases(4, [16] * 8 + [128]),  # the long one zig-zagged: ring steps run
        mcase(48, ["document"], {"doc": docs(5, 19, 8, 16)}, causal=True),
        mcase(48, ["document"], {"doc": docs(6, 5, 7, 4, 6, 8, 5, 7)}, causal=True,
              layout={"documents": [0, 6, 11, 18, 22, 28, 36, 41, 48], "balanced": True}),
        mcase(48, ["document"], {"doc": docs(7, 11, 30)}, strategy="allgather", heads=(2, 2)),
        # hybrid 2 x 2 (Ulysses pairs x a ring of 2): the ring's cell table on its heads
        mcase(48, ["document", "sink_logits"], {"doc": docs(5, 19, 8, 16), **SINKS},
              causal=True, strategy="hybrid", ulysses=2),
        case(48, sdpa=True, heads=(2, 2), strategy="allgather",
             attn_mask=mask((20, 28)), grad_tensors=["bias"])],
}


def bad(n, match, **kw):
    return dict(case(n, **kw), error=match)


ERROR_CASES = {
    2: [  # a document mask cut like the shards instead of whole
        bad(24, r"passed whole", mods=["document"], mod_kw={"doc": docs(12)}, causal=True),
        # rank 1's shard is shorter: only the agreement's all_gather can tell
        bad(24, r"different shards.*rank 0: q \(1, 12, 2, 16\).*rank 1: q \(1, 10, 2, 16\)",
            rank_n={"1": 10}, causal=True),
        bad(24, r"different shards", rank_n={"0": 10}, strategy="allgather"),
        # a bad mask on rank 1 only: rank 1 raises its own error, rank 0 learns of it
        bad(24, r"passed whole|refused on rank\(s\) \[1\]", mods=["document"],
            mod_kw={"doc": docs(24)}, rank_mod_kw={"1": {"doc": docs(12)}}, causal=True)],
}


def split(per_rank):
    """(results, refusals) per rank."""
    return ([[r for r in res if "error" not in r["case"]] for res in per_rank],
            [[r for r in res if "error" in r["case"]] for res in per_rank])


def assert_refused(per_rank):
    for rank, results in enumerate(per_rank):
        for res in results:
            msg, want = res["error"], res["case"]["error"]
            assert msg is not None, f"rank {rank} ran {res['case']}"
            assert re.search(want, msg, re.S), f"rank {rank}: {msg!r} !~ {want!r}"


# world 4 in the slow group: four interpreter processes on CI's two cores
# (world 2's cases -- key padding, attn_mask, document layouts, counted steps -- took ~100 s
# of the CPU group's 10 minutes on 2 cores: they run with world 4's in the slow group; world
# 3's documents and sinks stay in the CPU group)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3,
                                   pytest.param(4, marks=pytest.mark.slow)])
def test_masks_match_single_process(built, tmp_path, world):
    _, pkg_dir = built
    results, refusals = split(run_world(world, pkg_dir, tmp_path,
                                        CASES[world] + ERROR_CASES.get(world, []),
                                        package=PACKAGE))
    assert_results(results)
    assert_refused(refusals)
    if world in (2, 4):
        assert_step_work(results, world)


# ----------------------------------------------------------------------------------------
# Packed documents run as one GPU runs them (issue 51's 0.30 bar)
# ----------------------------------------------------------------------------------------
def random_lengths(n, d, world, seed):
    """benchmarks/ring.py's --doc-lengths random:SEED: d lengths, multiples of 2 * world."""
    g = torch.Generator().manual_seed(seed)
    unit = 2 * world
    w = torch.rand(d, generator=g) + 0.1
    units = (w / w.sum() * (n // unit)).floor().long().clamp(min=1)
    units[-1] += n // unit - units.sum()
    return [int(u) * unit for u in units]


def cross_cells(pkg, lengths, world, ulysses=1):
    """Brute force: {rank: cells where its queries see another rank's keys} under the
    balanced layout (chunks sharing a document, the later one seeing the earlier). A
    hybrid's (ulysses = U > 1) ranks in sequence order: chunk k < world on rank k, chunk
    k >= world on ring rank 2 * world / U - 1 - k // U's member k % U."""
    cu = torch.tensor([0] + lengths).cumsum(0)
    layout = pkg.document_layout(cu, world, balanced=True)
    c = layout.n // (2 * world)
    ids = pkg.document_ids(cu)[0][layout.perm]
    chunk = [set(ids[i * c:(i + 1) * c].tolist()) for i in range(2 * world)]
    rings = 2 * world // ulysses
    owner = [i if i < world else
             (2 * world - 1 - i if ulysses == 1 else
              (rings - 1 - i // ulysses) * ulysses + i % ulysses)
             for i in range(2 * world)]
    cells = {r: [] for r in range(world)}
    for i in range(2 * world):
        for j in range(i):
            if owner[i] != owner[j] and chunk[i] & chunk[j]:
                cells[owner[i]].append((i, j))
    return cells, owner


# (seed 3 at 512 tokens: every document on one rank; at 1024: one cut across two, as the
# benchmark's 64 documents in 256k cut two)
LOCAL_DOCS = {2: [(256, 12, 1)], 4: [(512, 16, 3), (1024, 16, 3)]}


def local_cases(world):
    # (world 4: 64 x 64 tiles, and the switch back only at world 2 -- the interpreter
    # walks 16 x 16 tiles of 4 ranks' 1k tokens past the world's 600 s)
    big = {"tiles": dict(TILES, block_m=64, block_n=64)} if world > 2 else {}
    out = []
    for n, d, seed in LOCAL_DOCS[world]:
        lengths = random_lengths(n, d, world, seed)
        cu = [0]
        for x in lengths:
            cu.append(cu[-1] + x)
        kw = dict(causal=True, layout={"documents": cu, "balanced": True}, lengths=lengths,
                  **big)
        out += [mcase(n, ["document"], {"doc": docs(*lengths)}, heads=(2, 1), count=True,
                      repeat=True, **kw),
                mcase(n, ["document"], {"doc": docs(*lengths)}, heads=(world, 2), count=True,
                      strategy="ulysses", **kw),
                # the switch back (A/B): the ring's own pieces, exact too
                mcase(n, ["document"], {"doc": docs(*lengths)}, heads=(2, 1),
                      env={"FLASHGEN_CP_LOCAL": "0"}, **kw)][:3 if world == 2 else 2]
    return out


def assert_runs_as_one_gpu(pkg, per_rank, world):
    """A repeated step of packed documents under the balanced layout, ring and Ulysses
    alike: a rank whose queries see no other rank's keys makes exactly the single-process
    call's launches (no merge, no per-piece preprocess) and no P2P operation; one with
    cross cells adds a forward, a merge and one backward's launches per cell; no all-to-
    all, all-reduce or broadcast anywhere, at most the agreement's one all_gather and one
    host read, and a batch of P2P operations in each direction only where a document is
    cut across ranks. (Before: three pieces a rank, each with its merge and preprocess, and
    Ulysses' all-to-alls; 4 x H200 at 256k: 0.32-0.49 of one GPU's time against ~0.25.)"""
    counted = list(_counted_results(per_rank))
    for rank, res in counted:
        assert_step_as_one_gpu(pkg, rank, res, world)
    assert len(counted) == 2 * world * len(LOCAL_DOCS[world]), len(counted)


def gathers(coll):
    return sum(coll.get(g, 0) for g in ("all_gather_into_tensor", "all_gather_single"))


def assert_step_as_one_gpu(pkg, rank, res, world, ulysses=1):
    """assert_runs_as_one_gpu for one rank's counted step; a hybrid's agreement is two
    all_gathers (its Ulysses group's, then its ring group's), each read on the host."""
    c = res["case"]
    cells, owner = cross_cells(pkg, c["lengths"], world, ulysses)
    mine = len(cells[rank])
    involved = mine or any(owner[j] == rank for r in cells for _, j in cells[r])
    one, cp, what = res["counts"]["single"], res["counts"]["cp"], (rank, c)
    launches = dict(cp["launches"])
    extra = {"fwd": mine, "merge": mine}
    for kind, count in one["launches"].items():
        if kind not in ("fwd", "merge", "block_state"):
            extra[kind] = mine  # one more backward per cross cell
    for kind in set(launches) | set(one["launches"]):
        want = one["launches"].get(kind, 0) + extra.get(kind, 0)
        assert launches.get(kind, 0) == want, (what, kind, cp, one)
    coll = cp["collectives"]
    assert set(coll) <= {"all_gather_into_tensor", "all_gather_single",
                         "batch_isend_irecv", "isend", "irecv"}, (what, coll)
    agreement = 1 if ulysses == 1 else 2
    assert gathers(coll) == agreement, (what, coll)
    assert coll.get("batch_isend_irecv", 0) == (2 if involved else 0), (what, coll)
    assert cp["reads"] <= agreement, (what, cp)


# (slow at both worlds: ~2 min of interpreted ranks at world 2 would put the CPU suite past
# its 10-minute budget; CI's slow stage runs them)
@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_documents_run_as_one_gpu_runs(built, tmp_path, world):
    pkg, pkg_dir = built
    results = run_world(world, pkg_dir, tmp_path, local_cases(world), package=PACKAGE)
    assert_results(results)
    assert_runs_as_one_gpu(pkg, results, world)


# Hybrid at world 4, U = 2 (sequence rank 2 * ring rank + Ulysses rank): the balanced
# layout's streams are the plain zig-zag's, so a hybrid rank's second chunk is its Ulysses
# partner's stream, and documents there cross between the two
HYBRID_DOCS = {
    # 4 cross cells (<= world: the local call), one from rank 1 to rank 2, which share
    # neither a Ulysses nor a ring group (P2P over the default group)
    "few": [8, 7, 8, 7, 3, 8, 1, 7, 9, 6],
    # 24 cross cells between every pair: the hybrid itself, after the local call's
    # agreement its own; FLASHGEN_CP_LOCAL=1 takes them locally
    "many": [16, 8, 8, 32]}


def hybrid_cases():
    out = []
    for name, env in (("few", {}), ("many", {}), ("many", {"FLASHGEN_CP_LOCAL": "1"})):
        lengths = HYBRID_DOCS[name]
        cu = [0]
        for x in lengths:
            cu.append(cu[-1] + x)
        out.append(mcase(64, ["document"], {"doc": docs(*lengths)}, heads=(2, 1), causal=True,
                         strategy="hybrid", ulysses=2, lengths=lengths, count=True, env=env,
                         layout={"documents": cu, "balanced": True}, repeat=name == "few"))
    # a shard of another length on rank 1 alone: it fails its own checks (the layout does
    # not fit), the others have table rows, and the gathers of every rank still match
    out.append(dict(case(64, causal=True, strategy="hybrid", ulysses=2, heads=(2, 1),
                         mods=["document"], mod_kw={"doc": docs(*HYBRID_DOCS["few"])},
                         layout=out[0]["layout"], rank_n={"1": 10}),
                    error=r"does not fit|refused on rank"))
    # FLASHGEN_CP_AGREE=0 and no cell table: the pair's agreement makes no gather
    out.append(case(64, causal=True, strategy="hybrid", ulysses=2, heads=(2, 1), agree=False))
    return out


# (slow: four interpreted ranks, 30-65 s on two shared cores)
@pytest.mark.slow
def test_hybrid_documents_run_as_one_gpu_runs(built, tmp_path):
    """strategy="hybrid" over a document layout takes the local call as the other
    strategies do: exact against the single-process call, and a counted step makes its
    launches plus a piece per cross cell, with no all-to-all; with too many cross cells
    the hybrid itself runs (its all-to-alls, and a second agreement of its own)."""
    pkg, pkg_dir = built
    results, refusals = split(run_world(4, pkg_dir, tmp_path, hybrid_cases(),
                                        package=PACKAGE))
    assert_results(results)
    assert_refused(refusals)
    opted_out = [res for rank in results for res in rank if res["case"].get("agree") is False]
    assert len(opted_out) == 4 and all(res["agree_gathers"] == 0 for res in opted_out)
    counted = list(_counted_results(results))
    assert len(counted) == 3 * 4, len(counted)
    for rank, res in counted:
        if res["case"]["env"] or res["case"]["lengths"] == HYBRID_DOCS["few"]:
            assert_step_as_one_gpu(pkg, rank, res, 4, ulysses=2)
        else:
            coll = res["counts"]["cp"]["collectives"]
            assert coll.get("all_to_all_single", 0) > 0, (rank, coll)
            assert gathers(coll) == 4, (rank, coll)
