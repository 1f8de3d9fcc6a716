"""Ulysses (all-to-all) context parallelism, `strategy="ulysses"` (issue 51), on the CPU.

World sizes 2 and 4 on gloo (tests/ring_worker.py, test_ring's packages and helpers):
every rank's rows of the output, LSE and dq, dk, dv against the package's single-process
call on the full sequence and the float64 reference -- causal and not, windows, both
layouts, the SDPA twin, GQA with K/V heads partitioned, replicated (H_kv < world) and
straddled (a rank's query heads read two K/V heads), bf16, mods including the whole-
sequence document mask and sinks that the ring refuses; bitwise equal to the single call
where no K/V head is replicated. And the refusals: ValueError on every rank, within a
timeout (no rank left waiting in a collective). The hybrid strategy (Ulysses groups x a
ring, `hybrid_groups`): degenerate at world 2, 2 x 2 at world 4 (slow).
"""
import re

import pytest
import torch

from test_ring import (ALIBI, MODS_PACKAGE, assert_results, built, case, mod_case,  # noqa: F401
                       mods_built, pkg, run_world)


def uly(n, **kw):
    return case(n, strategy="ulysses", **kw)


CASES = {
    # heads (H_q, H_kv): (2, 1) replicates the one K/V head; (8, 2) partitions them 4:1;
    # (6, 3) gives rank 0 query heads 0-2, which read K/V heads 0, 0, 1 (one replica each)
    2: [uly(24, causal=True, repeat=True),
        uly(24, heads=(8, 2), exact=True),
        uly(24, causal=True, window=(5, 0), heads=(2, 2), exact=True),
        uly(20, causal=True, layout="contiguous", sdpa=True, heads=(4, 2), exact=True),
        uly(24, window=(3, 2), heads=(4, 2), layout="contiguous", exact=True),
        uly(24, causal=True, dtype="bf16", heads=(6, 3)),
        uly(24, causal=True, dtype="bf16", heads=(2, 2)),
        # a rank's query heads in groups (FLASHGEN_CP_HEAD_GROUPS): two groups with a K/V
        # head each, two sharing one (their dK/dV summed in fp32), three over straddled
        uly(24, causal=True, heads=(8, 4), head_groups=2, exact=True),
        # the groups' all-to-alls overlapping the kernels (FLASHGEN_CP_PREFETCH=1)
        uly(24, causal=True, heads=(8, 4), head_groups=2, prefetch=True, exact=True),
        uly(20, heads=(4, 4), head_groups=2, prefetch=True, layout="contiguous", exact=True),
        uly(24, causal=True, heads=(8, 2), head_groups=4, prefetch=True, dtype="bf16"),
        uly(24, causal=True, heads=(8, 2), head_groups=2, repeat=True),
        uly(24, causal=True, dtype="bf16", heads=(6, 3), head_groups=3, sdpa=True),
        # hybrid, degenerate at world 2: Ulysses over both (one ring rank; the K/V head
        # replicated), then the ring over both (Ulysses groups of one)
        case(24, causal=True, strategy="hybrid", ulysses=2, heads=(4, 1)),
        case(24, causal=True, strategy="hybrid", ulysses=1, layout="contiguous", sdpa=True)],
    4: [uly(32, causal=True, heads=(4, 2), repeat=True),
        uly(32, window=(5, 3), heads=(8, 2)),
        uly(32, causal=True, heads=(4, 4), layout="contiguous", sdpa=True, exact=True),
        uly(24, heads=(8, 4), exact=True),
        # hybrid 2 x 2: Ulysses pairs x a ring of 2; K/V heads replicated (4:1) and
        # straddled (6:3)
        case(32, causal=True, strategy="hybrid", ulysses=2, heads=(4, 1), repeat=True),
        case(32, window=(5, 3), strategy="hybrid", ulysses=2, heads=(4, 2),
             layout="contiguous", sdpa=True),
        case(32, causal=True, strategy="hybrid", ulysses=2, heads=(6, 3), dtype="bf16")],
}


def assert_exact(per_rank):
    """Where every rank holds whole K/V heads (no replica to sum), each rank runs the
    single-process kernels on whole rows: in fp32 its results are the single call's,
    bitwise. (In bf16 dK/dV may differ by an ulp: they leave the kernel in fp32 here.)"""
    for rank, results in enumerate(per_rank):
        for res in results:
            if res["case"].get("exact"):
                assert res["vs_flash"] == [0.0] * 5, (rank, res["case"], res["vs_flash"])


# world 4 runs in the slow group (CI runs it too): four interpreter processes on CI's two
# cores take ~25 s a test, and the CPU group is kept under 10 minutes
@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ulysses_matches_single_process(built, tmp_path, world):
    _, pkg_dir = built
    per_rank = run_world(world, pkg_dir, tmp_path, CASES[world])
    assert_results(per_rank)
    assert_exact(per_rank)


DOC = {"doc": {"values": [[0] * 7 + [1] * 9 + [2] * 4], "dtype": "int32"}}
SINKS = {"sinks": {"values": [0.5, -0.3], "dtype": "float32"}}
MOD_CASES = {
    2: [mod_case(20, ["document"], DOC, causal=True, strategy="ulysses", exact=True),
        mod_case(20, ["alibi"], ALIBI, causal=True, strategy="ulysses", heads=(2, 2),
                 layout="contiguous", exact=True),
        mod_case(20, ["sink_logits"], SINKS, causal=True, strategy="ulysses", sdpa=True),
        mod_case(18, ["window_sinks"], {"sinks": 2, "window": 5}, layout="contiguous",
                 strategy="ulysses")],
    4: [mod_case(24, ["document"], {"doc": {"values": [[0] * 5 + [1] * 12 + [2] * 7],
                                            "dtype": "int32"}},
                 causal=True, strategy="ulysses", heads=(4, 1))],
}


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ulysses_mods_match_single_process(mods_built, tmp_path, world):
    """Mods see global positions; a document mask's ids are passed whole on every rank
    (the ring refuses them); sinks join each whole row's softmax once."""
    _, pkg_dir = mods_built
    per_rank = run_world(world, pkg_dir, tmp_path, MOD_CASES[world], package=MODS_PACKAGE)
    assert_results(per_rank)
    assert_exact(per_rank)


def bad(n, match, **kw):
    return dict(uly(n, **kw), error=match)


ERROR_CASES = {
    2: [bad(24, r"H_q = 3 does not divide by 2.*strategy='ring'", heads=(3, 1)),
        # rank 1's shard is shorter: only the shape all_gather can tell
        bad(24, r"different shards.*rank 0: q \(1, 12, 2, 16\).*rank 1: q \(1, 10, 2, 16\)",
            rank_n={"1": 10}),
        bad(24, r"dropout under strategy='ulysses'", dropout_p=0.1),
        # the ring's own check: zig-zag shards have an even length
        bad(22, r"cannot split", causal=True),
        dict(case(24, heads=(3, 1), strategy="hybrid", ulysses=2),
             error=r"strategy='hybrid' gives each of the 2 ranks.*H_q = 3")],
    4: [bad(32, r"H_q = 6 does not divide by 4", heads=(6, 2)),
        bad(32, r"different shards", heads=(4, 2), rank_n={"3": 6})],
}
MOD_ERROR_CASES = {
    # a document mask cut like the shards instead of whole
    2: [dict(mod_case(20, ["document"], {"doc": {"values": [[0] * 10], "dtype": "int32"}},
                      causal=True, strategy="ulysses"), error=r"passed whole")],
}


def assert_refused(per_rank):
    for rank, results in enumerate(per_rank):
        for res in results:
            msg, want = res["error"], res["case"]["error"]
            assert msg is not None, f"rank {rank} ran {res['case']}"
            assert re.search(want, msg, re.S), f"rank {rank}: {msg!r} !~ {want!r}"


@pytest.mark.parametrize("world", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_ulysses_bad_input_raises_on_every_rank(built, tmp_path, world):
    _, pkg_dir = built
    assert_refused(run_world(world, pkg_dir, tmp_path, ERROR_CASES[world], timeout=240))


def test_ulysses_sharded_mod_tensor_refused(mods_built, tmp_path):
    _, pkg_dir = mods_built
    assert_refused(run_world(2, pkg_dir, tmp_path, MOD_ERROR_CASES[2], package=MODS_PACKAGE,
                             timeout=240))


def test_hybrid_sharding_round_trip(pkg):
    """Hybrid sharding over 2 ring ranks x Ulysses pairs: each ring rank's zig-zag chunks
    are split between its pair, and unshard inverts shard."""
    x = torch.arange(32)[None]
    shards = [pkg.shard(x, r, 4, ulysses=2) for r in range(4)]
    # ring rank 0 holds chunks 0 and 3 (of 8 tokens): its pair gets halves of each
    assert shards[0].tolist() == [[0, 1, 2, 3, 24, 25, 26, 27]]
    assert shards[1].tolist() == [[4, 5, 6, 7, 28, 29, 30, 31]]
    assert shards[2].tolist() == [[8, 9, 10, 11, 16, 17, 18, 19]]
    assert torch.equal(pkg.unshard(shards, ulysses=2), x)
    with pytest.raises(ValueError, match="ulysses=3"):
        pkg.shard(x, 0, 4, ulysses=3)
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(ValueError, match="strategy='hybrid' takes group="):
        pkg.ring_flash_attn_func(q, q, q, strategy="hybrid")
