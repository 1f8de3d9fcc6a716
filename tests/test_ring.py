"""Context parallelism (`ring_flash_attn_func`, issue 18) on the CPU.

In-process: the planning arithmetic against brute force, sharding round trips, argument
errors, and world size 1 (no process group) against the package's own call. Across
processes: world sizes 2 and 3 on the gloo backend (tests/ring_worker.py, one subprocess
per rank, joined through a FileStore in tmp_path), both strategies, causal and not,
sliding windows, GQA, both layouts, the SDPA twin, bf16: every rank's rows of the output,
LSE and dq, dk, dv against the package's single-process call on the full sequence and the
float64 reference, plus bitwise determinism of a repeated call. Shapes are tiny (Triton's
interpreter), and each world size is one group of processes running all its cases.
Mods (a second small package, MODS_SPEC): position-based mods under the ring against the
single-process call and the float64 reference, and a piece's kernels at global offsets
(data-dependent masks, sinks and mod gradients: test_ring_masks.py).
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from packages import build_and_import

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=1)
PACKAGE = "fg_test_ring"
SPEC = """
    head_dims: [16]
    dtypes: [fp32, bf16]
    masks: [none, causal, sliding_window]
    window: {left: 8, right: 0}
    gqa: true
    dropout: true
    """


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring")
    pkg = build_and_import(root, PACKAGE, SPEC)
    return pkg, root / "out"


@pytest.fixture(scope="module")
def pkg(built):
    return built[0]


# ----------------------------------------------------------------------------------------
# Planning and sharding, in process
# ----------------------------------------------------------------------------------------
def brute(m, n, lo, hi):
    i = torch.arange(m)[:, None]
    j = torch.arange(n)[None, :]
    return (i + lo <= j) & (j <= i + hi)


@pytest.mark.parametrize("m,n", [(1, 1), (3, 5), (6, 6), (5, 2)])
def test_classify_matches_brute_force(pkg, m, n):
    ring = pkg._ring
    for lo in range(-9, 9):
        for hi in range(lo, 10):
            vis = brute(m, n, lo, hi)
            kind = ring.classify(m, n, lo, hi)
            if not vis.any():
                assert kind == "empty", (m, n, lo, hi)
            elif vis.all():
                assert kind == "full", (m, n, lo, hi)
            else:
                assert kind in ("right", "both"), (m, n, lo, hi)
                # "right": the causal kernel ignores LO_OFF, so the left edge must be inert
                if kind == "right":
                    assert torch.equal(vis, brute(m, n, -(m + n), hi)), (m, n, lo, hi)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
@pytest.mark.parametrize("causal,window", [(False, (-1, -1)), (True, (-1, -1)),
                                           (True, (5, 0)), (False, (3, 2))])
def test_plans_cover_the_mask_exactly_once(pkg, world, layout, causal, window):
    """Over every (rank, source) pair, the planned calls' visible cells tile the global
    mask exactly: nothing missed, nothing counted twice."""
    ring = pkg._ring
    n_local = 12
    n = n_local * world
    _, lo_g, hi_g = pkg._runtime.band(n, n, causal, window, True)
    want = brute(n, n, lo_g, hi_g).int()
    got = torch.zeros(n, n, dtype=torch.int32)
    for rank in range(world):
        q_segs = ring.segments(n_local, rank, world, layout)
        for src in range(world):
            k_segs = ring.segments(n_local, src, world, layout)
            q_glob = torch.cat([torch.arange(g, g + ln) for _, ln, g in q_segs])
            k_glob = torch.cat([torch.arange(g, g + ln) for _, ln, g in k_segs])
            for qs, qn, ks, kn, mask, lo, hi, qg, kg in ring.plan_pair(q_segs, k_segs,
                                                                       lo_g, hi_g):
                assert (q_glob[qs], k_glob[ks]) == (qg, kg)  # a call's first global row, key
                lo_eff = lo if mask == "sliding_window" else -(qn + kn + 1)
                hi_eff = hi if mask != "none" else qn + kn + 1
                vis = brute(qn, kn, lo_eff, hi_eff).int()
                rows = q_glob[qs:qs + qn]
                cols = k_glob[ks:ks + kn]
                got[rows[:, None], cols[None, :]] += vis
    assert torch.equal(got, want)


def test_zigzag_calls_are_balanced(pkg):
    """Causal zig-zag: every rank runs the same number of query x key cells."""
    ring = pkg._ring
    world, n_local = 4, 8
    _, lo_g, hi_g = pkg._runtime.band(world * n_local, world * n_local, True, (-1, -1), True)
    work = []
    for rank in range(world):
        q_segs = ring.segments(n_local, rank, world, "zigzag")
        cells = 0
        for src in range(world):
            for qs, qn, ks, kn, *_ in ring.plan_pair(
                    q_segs, ring.segments(n_local, src, world, "zigzag"), lo_g, hi_g):
                cells += qn * kn
        work.append(cells)
    assert len(set(work)) == 1, work


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_shard_unshard_round_trip(pkg, layout):
    x = torch.arange(2 * 24 * 3).reshape(2, 24, 3)
    shards = [pkg.shard(x, r, 3, layout=layout) for r in range(3)]
    assert all(s.shape == (2, 8, 3) for s in shards)
    assert torch.equal(pkg.unshard(shards, layout=layout), x)
    if layout == "zigzag":
        assert shards[0][0, :, 0].tolist() == [0, 3, 6, 9, 60, 63, 66, 69]
    # without a process group, shard_sequence / unshard_sequence are world size 1
    assert torch.equal(pkg.unshard_sequence(pkg.shard_sequence(x, layout=layout),
                                            layout=layout), x)


def test_zigzag_needs_length_divisible_by_two_world(pkg):
    with pytest.raises(ValueError, match="multiple of 6.*layout='contiguous'"):
        pkg.shard(torch.zeros(1, 9, 2, 16), 0, 3)
    q = torch.zeros(1, 5, 2, 16)
    with pytest.raises(ValueError, match="multiple of 2"):
        pkg.ring_flash_attn_func(q, q, q)


@pytest.mark.parametrize("call,exc,match", [
    (dict(dropout_p=1.5), ValueError, "dropout_p must be a number in"),
    (dict(strategy="tree"), ValueError, "strategy='tree'"),
    (dict(layout="striped"), ValueError, "layout='striped'"),
    (dict(grad_sum_dtype="fp64"), ValueError, "grad_sum_dtype='fp64'"),
    (dict(window_size=(4,)), ValueError, "window_size"),
])
def test_bad_arguments(pkg, call, exc, match):
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(exc, match=match):
        pkg.ring_flash_attn_func(q, q, q, **call)


def test_dropout_needs_shard_chunks_on_32_tokens(pkg):
    """The keep mask's Philox blocks are 32 columns wide: a shard chunk off them is refused
    before anything launches or the generator advances, naming the length that works."""
    q = torch.zeros(1, 48, 2, 16)  # one rank, zig-zag: chunks of 24 at 0 and 24
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match="4 chunks of 24: pad the sequence to a multiple of 128"):
        pkg._ring._check_dropout_chunks(48, 2, "zigzag")
    with pytest.raises(ValueError, match="2 chunks of 24: pad the sequence to a multiple of 64"):
        pkg.ring_flash_attn_func(q, q, q, causal=True, dropout_p=0.1)
    with pytest.raises(ValueError, match="multiple of 64"):
        pkg.ring_scaled_dot_product_attention(*(q.transpose(1, 2),) * 3, dropout_p=0.1)
    assert torch.equal(torch.get_rng_state(), state)
    pkg._ring._check_dropout_chunks(64, 2, "zigzag")
    pkg._ring._check_dropout_chunks(32, 3, "contiguous")
    pkg._ring._check_dropout_chunks(48, 1, "contiguous")  # one chunk, at 0
    with pytest.raises(ValueError, match="multiple of 64"):
        pkg._ring._check_dropout_chunks(48, 2, "contiguous")
    o = torch.empty(1, 16, 2, 16)
    with pytest.raises(ValueError, match="row 8, column 0"):
        pkg._runtime.forward(q[:, :16], q[:, :16], q[:, :16], o, mask="none", lo=-40, hi=40,
                             scale=0.25, bnhd=True, dropout_p=0.1,
                             rng=torch.tensor([1, 2]), pos=(8, 0))


def test_dropout_piece_at_global_offsets_drops_the_full_calls_elements(pkg):
    """One forward and one backward launch on rows [a, a + m) and keys [c, c + kn) at
    pos=(a, c) apply the whole call's keep mask there (keep_mask_kernel over the full
    N x N, sliced): out, dq, dk, dv match the float64 reference with that slice. At
    pos=(0, 0), the piece's local coordinates, the same launch drops other elements."""
    from flashgen.reference import attention_ref

    rt = pkg._runtime
    drop = rt._dropout()
    torch.manual_seed(3)
    b, h, n, d, p = 1, 2, 128, 16, 0.4
    a, m, c, kn = 32, 48, 64, 64  # a on a 16-row block, c on a 32-column block
    q, do = torch.randn(b, m, h, d), torch.randn(b, m, h, d)
    k, v = torch.randn(b, kn, h, d), torch.randn(b, kn, h, d)
    rng = torch.tensor([1234, 56])
    seed, stream, thresh, _ = drop.launch_args(rng, p)
    full = torch.empty(b * h, n, n, dtype=torch.int8)
    drop.keep_mask_kernel[(n // 64, n // 64, b * h)](full, seed, stream, n, n, thresh,
                                                     BLOCK_M=64, BLOCK_N=64)
    keep = full.view(b, h, n, n).bool()[:, :, a:a + m, c:c + kn]
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, N, H, d) <-> (B, H, N, d)
    rq, rk, rv = (t(x).double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_ref(rq, rk, rv, torch.ones(m, kn, dtype=torch.bool), keep=keep,
                           dropout_p=p)
    ref.backward(t(do).double())
    band = dict(mask="none", lo=-(m + kn + 1), hi=m + kn + 1, scale=d ** -0.5)

    def piece(pos):
        out = torch.empty_like(q)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        lse = rt.forward(q, k, v, out, bnhd=True, dropout_p=p, rng=rng, pos=pos, **band)
        rt.backward(t(do), t(q), t(k), t(v), t(out), lse, t(dq), t(dk), t(dv), dropout_p=p,
                    rng=rng, pos=pos, **band)
        return out, dq, dk, dv

    with rt.override_config(**TILES):
        got = piece((a, c))
        local = piece((0, 0))
    want = (t(ref), t(rq.grad), t(rk.grad), t(rv.grad))
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=1e-5, rtol=1e-5)
    assert (local[0].double() - want[0]).abs().max() > 0.1  # the offsets matter here


def test_sdpa_twin_refuses_causal_attn_mask_and_ungrouped_heads(pkg):
    q = torch.zeros(1, 2, 8, 16)
    with pytest.raises(ValueError, match="attn_mask and is_causal"):
        pkg.ring_scaled_dot_product_attention(q, q, q, is_causal=True,
                                              attn_mask=torch.ones(8, 8, dtype=torch.bool))
    with pytest.raises(ValueError, match="enable_gqa"):
        pkg.ring_scaled_dot_product_attention(q, q[:, :1], q[:, :1])


def test_unequal_query_and_key_shards_refused(pkg):
    with pytest.raises(ValueError, match="self-attention"):
        pkg.ring_flash_attn_func(torch.zeros(1, 8, 2, 16), torch.zeros(1, 4, 2, 16),
                                 torch.zeros(1, 4, 2, 16))


def test_merge_kernel_handles_minus_inf(pkg):
    """Rows that one or both sides never saw: weight 0, no NaN, (0, -inf) kept."""
    ninf = float("-inf")
    acc = torch.tensor([1.0, 2.0]).repeat(1, 4, 1, 8)  # (1, 4, 1, 16)
    acc[:, 2:] = 0.0
    lse_acc = torch.tensor([[[0.0, 0.5, ninf, ninf]]])
    out = torch.full((1, 4, 1, 16), float("nan"))
    out[:, 0] = 3.0
    out[:, 2] = 5.0
    lse = torch.tensor([[[0.0, ninf, 1.0, ninf]]])
    want_acc = acc.clone()
    want_acc[:, 0] = (acc[:, 0] + 3.0) / 2
    want_acc[:, 2] = 5.0
    pkg._ring._merge(acc, lse_acc, out, lse, 0)
    assert not torch.isnan(acc).any()
    torch.testing.assert_close(acc, want_acc)
    torch.testing.assert_close(lse_acc, torch.tensor([[[torch.log(torch.tensor(2.0)).item(),
                                                       0.5, 1.0, ninf]]]))


def test_buffers_follow_the_memory_order_of_their_model(pkg):
    """An SDPA-layout shard (B, H, N, d) seen as (B, N, H, d): the ring's buffers must keep
    each head's rows adjacent, as the shard does, or a long shard's rows would span more
    elements than the kernels' row offsets reach."""
    like = torch.empty(2, 3, 5, 4).transpose(1, 2)  # (B, N=5, H=3, d) with rows d apart
    t = pkg._ring._empty_as(like, (2, 5, 3, 4), torch.float32)
    assert t.shape == (2, 5, 3, 4) and t.stride() == like.stride() and t.dtype == torch.float32
    t2 = pkg._ring._empty_as(like, (2, 5, 3, 4), lead=(2,))
    assert t2.shape == (2, 2, 5, 3, 4) and t2[1].stride() == like.stride()
    assert t2[1].data_ptr() - t2[0].data_ptr() == like.numel() * like.element_size()
    flat = torch.empty(2, 5, 3, 4)
    assert pkg._ring._empty_as(flat, flat.shape).is_contiguous()


@pytest.mark.parametrize("strategy", ["ring", "allgather"])
def test_world_size_one_matches_flash_attn_func(pkg, strategy):
    """Without a process group the call is one rank: zig-zag's two chunks on one rank,
    against flash_attn_func (exact up to the fp32 merge) -- fast coverage of the plumbing."""
    torch.manual_seed(0)
    q = torch.randn(1, 16, 2, 16, requires_grad=True)
    k, v = (torch.randn(1, 16, 1, 16, requires_grad=True) for _ in range(2))
    with pkg._runtime.override_config(**TILES):
        ref = pkg.flash_attn_func(q, k, v, causal=True)
        do = torch.randn_like(ref)
        g_ref = torch.autograd.grad(ref, (q, k, v), do)
        out = pkg.ring_flash_attn_func(q, k, v, causal=True, strategy=strategy)
        g = torch.autograd.grad(out, (q, k, v), do)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_head_groups_choice(pkg, monkeypatch):
    """auto: the most groups (a divisor of H_kv, at most HEAD_GROUPS_MAX) that leave each
    group's K/V shard at least HEAD_GROUP_MIN_BYTES, one where no K/V moves; a forced
    count must divide H_kv."""
    r = pkg._ring
    monkeypatch.setattr(r, "HEAD_GROUP_MIN_BYTES", 2 * 64 * 16 * 4)  # 2 heads' K+V, fp32
    k = torch.empty(1, 64, 12, 16)  # 12 K/V heads: 6 groups of 2 (8 and 12 do not fit)
    assert r._head_groups(k, "auto") == 6
    assert r._head_groups(torch.empty(1, 64, 1, 16), "auto") == 1
    assert r._head_groups(torch.empty(1, 64, 32, 16), "auto") == r.HEAD_GROUPS_MAX
    assert r._head_groups(k, "3") == 3
    # no K/V moves (documents within ranks): nothing to overlap, one group unless forced
    assert r._head_groups(k, "auto", still=True) == 1 and r._head_groups(k, "3", still=True) == 3
    for bad in ("5", "0", "x"):
        with pytest.raises(ValueError, match="FLASHGEN_CP_HEAD_GROUPS"):
            r._head_groups(k, bad)


def test_head_groups_match_one_group(pkg, monkeypatch):
    """World size 1, GQA 4:2: the backward in two head groups gives the same gradients as
    in one (each head's arithmetic is unchanged)."""
    torch.manual_seed(1)
    q = torch.randn(1, 16, 4, 16, requires_grad=True)
    k, v = (torch.randn(1, 16, 2, 16, requires_grad=True) for _ in range(2))
    do = torch.randn(1, 16, 4, 16)
    grads = []
    for groups in ("1", "2"):
        monkeypatch.setenv("FLASHGEN_CP_HEAD_GROUPS", groups)
        with pkg._runtime.override_config(**TILES):
            out = pkg.ring_flash_attn_func(q, k, v, causal=True)
            grads.append(torch.autograd.grad(out, (q, k, v), do))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# ----------------------------------------------------------------------------------------
# Across processes: gloo, world sizes 2 and 3
def piece_grads_keep_fp32(pkg, device, d):
    """A context-parallel piece's dK/dV (runtime.backward into fp32 buffers) rounds to the
    16-bit call's dK/dV bit for bit -- the same fp32 accumulators, stored before rather
    than after the rounding (to nearest on a GPU; Triton's interpreter truncates) -- and
    carries bits that 16-bit buffers would drop: the ring adds pieces before any rounding
    (2 GPUs at 32k: per-piece bf16 rounding made dK's error 1.7x the single call's)."""
    rt = pkg._runtime
    g = torch.Generator(device=device).manual_seed(1)
    b, h, hk, n = 1, 4, 2, 200
    q, do = (torch.randn(b, h, n, d, generator=g, device=device, dtype=torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn(b, hk, n, d, generator=g, device=device, dtype=torch.bfloat16)
            for _ in range(2))
    _, lo, hi = rt.band(n, n, True, (-1, -1), True)
    out, lse = pkg.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), causal=True,
                                   return_lse=True)
    o = out.transpose(1, 2)
    grads = {}
    for dtype in (torch.bfloat16, torch.float32):
        dq = torch.empty_like(q)
        dk, dv = (torch.full_like(t, float("nan"), dtype=dtype) for t in (k, v))
        rt.backward(do, q, k, v, o, lse, dq, dk, dv, mask="causal", lo=lo, hi=hi,
                    scale=d ** -0.5)
        grads[dtype] = (dk, dv)
    for name, low, full in zip(("dk", "dv"), grads[torch.bfloat16], grads[torch.float32]):
        assert not torch.isnan(full).any(), f"{name}: an fp32 element not written"
        nearest = full.to(torch.bfloat16)
        toward_zero = (full.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
        assert ((low == nearest) | (low == toward_zero)).all(), f"{name}: not the 16-bit call's"
        assert not torch.equal(full, low.float()), f"{name}: rounded to 16 bits"


def test_piece_grads_keep_fp32(pkg):
    with pkg._runtime.override_config(**TILES):
        piece_grads_keep_fp32(pkg, "cpu", 16)


# ----------------------------------------------------------------------------------------
def case(n, causal=False, window=(-1, -1), strategy="ring", layout="zigzag", dtype="fp32",
         heads=(2, 1), **extra):
    return dict(shape=[1, n, heads[0], heads[1], 16], causal=causal, window=list(window),
                strategy=strategy, layout=layout, dtype=dtype, **extra)


CASES = {
    2: [case(24, causal=True, repeat=True),
        case(24, causal=True, strategy="allgather"),
        case(24, causal=True, window=(5, 0)),
        case(24, window=(3, 2), strategy="allgather"),
        case(20, causal=True, layout="contiguous", sdpa=True),
        case(24, dtype="bf16", heads=(2, 2)),
        # the dK/dV sums travel in fp32 by default; 16-bit on request (and repeatable)
        case(24, causal=True, dtype="bf16", heads=(2, 2), grad_sum="input", repeat=True),
        # the backward in two groups of heads (GQA: each group's query heads with it)
        case(24, causal=True, heads=(4, 2), head_groups=2, repeat=True)],
    3: [case(36, causal=True, repeat=True), case(36, causal=True, window=(7, 0)),
        case(36, window=(5, 3), heads=(2, 2), head_groups=2, sdpa=True),
        case(30, layout="contiguous", strategy="allgather")],
}


def run_world(world, pkg_dir, tmp_path, cases, *, package=PACKAGE, backend="gloo",
              timeout=600):
    """Run tests/ring_worker.py as `world` processes (one per rank; with backend="nccl",
    one GPU each) on `cases`; returns each rank's list of results."""
    cases_file = tmp_path / "cases.json"
    cases_file.write_text(json.dumps(cases))
    env = dict(os.environ, OMP_NUM_THREADS="1", RING_BACKEND=backend,
               PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    if backend == "gloo":
        env["TRITON_INTERPRET"] = "1"
    procs = [subprocess.Popen(
        [sys.executable, str(HERE / "ring_worker.py"), str(r), str(world),
         str(tmp_path / "store"), str(pkg_dir), package, str(cases_file),
         str(tmp_path / f"rank{r}.json")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)]
    logs = []
    try:
        for p in procs:
            logs.append(p.communicate(timeout=timeout)[0])
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        tails = [f"rank {r}:\n{(p.communicate()[0] or '')[-3000:]}" for r, p in enumerate(procs)]
        raise AssertionError(f"the world of {world} ran past {timeout} s; each rank's log "
                             "(one line per finished case):\n" + "\n".join(tails))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_matches_single_process(built, tmp_path, world):
    _, pkg_dir = built
    per_rank = run_world(world, pkg_dir, tmp_path, CASES[world])
    assert_results(per_rank)


def test_agreement_opt_out_skips_its_all_gather(built, tmp_path):
    """FLASHGEN_CP_AGREE=0 (a caller that vouches for symmetric calls, e.g. under CUDA-graph
    capture): the same results with no agreement all_gather; by default one a call (and
    its repeat), on each strategy."""
    _, pkg_dir = built
    cases = [case(24, causal=True, repeat=True, agree=agree, strategy=strategy)
             for strategy in ("ring", "allgather", "ulysses") for agree in (True, False)]
    for c in cases[4:]:
        c["shape"][2:4] = [2, 2]  # Ulysses: heads divisible by the world
    per_rank = run_world(2, pkg_dir, tmp_path, cases)
    assert_results(per_rank)
    for results in per_rank:
        for res in results:
            want = 2 if res["case"]["agree"] else 0
            assert res["agree_gathers"] == want, (res["case"], res["agree_gathers"])


# Dropout: shard chunks of 32 tokens (the keep mask's Philox blocks are 32 columns wide),
# so N = 64 * world under zig-zag. 32 x 32 tiles (16 x 16 would walk these lengths slowly
# in the interpreter); one case takes 16-key tiles, the keep mask's half-block path.
# rank_seeds: the ranks' generators differ for the context-parallel call, so only rank 0's
# (seed, stream), broadcast, gives every rank the single call's mask
DROP_TILES = dict(block_m=32, block_n=32, num_warps=4, num_stages=1)
DROPOUT_CASES = {
    2: [case(128, causal=True, dropout_p=0.3, rng_seed=5, rank_seeds=True, tiles=DROP_TILES,
             repeat=True),
        case(128, causal=True, dropout_p=0.3, rng_seed=6, strategy="allgather",
             heads=(4, 2), tiles=DROP_TILES),
        # the all-gather's key range under a window starts off a 32-column block: rounded
        # down to one (the band hides the extra keys); 16-key tiles
        case(128, causal=True, window=(40, 0), dropout_p=0.2, rng_seed=7,
             strategy="allgather", tiles=dict(DROP_TILES, block_n=16)),
        case(128, dropout_p=0.25, rng_seed=8, layout="contiguous", sdpa=True,
             dtype="bf16", tiles=DROP_TILES)],
    3: [case(192, causal=True, dropout_p=0.3, rng_seed=10, rank_seeds=True, tiles=DROP_TILES)],
}


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])  # (CPU time)
def test_context_parallel_dropout_matches_single_process(built, tmp_path, world):
    """The pieces drop exactly the elements flash_attn_func on the full sequence drops
    from the same generator state: out, LSE and dq, dk, dv match it (and the float64
    reference with its replayed mask)."""
    _, pkg_dir = built
    per_rank = run_world(world, pkg_dir, tmp_path, DROPOUT_CASES[world])
    assert_results(per_rank)


def assert_results(per_rank):
    """Every rank's rows within tolerance of the package's single-process call and of the
    float64 reference; no NaN; a repeated call bitwise equal."""
    failures = []
    for rank, results in enumerate(per_rank):
        for res in results:
            c = res["case"]
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16,
                     "fp16": torch.float16}[c["dtype"]]
            out_tol, grad_tol = OUT_TOL[dtype][0], GRAD_TOL[dtype][0]
            # vs the package's own full-sequence call: the pieces run the same kernels; the
            # differences are the fp32 merge and dK/dV, dQ summed over pieces (one rounding
            # to the input dtype per piece)
            # (fp32: relative to the result's magnitude -- on a GPU the dK of 1k rows
            # reaches ~10, where a reordered fp32 sum differs by more than 1e-5)
            flash_tol = [1e-5 * max(1.0, m) for m in res["scale"]] if c["dtype"] == "fp32" \
                else [out_tol, LSE_TOL[0], grad_tol, grad_tol, grad_tol]
            ref_tol = [out_tol, LSE_TOL[0] * 10, grad_tol, grad_tol, grad_tol]
            names = ["out", "lse", "dq", "dk", "dv"]
            if res["nan"]:
                failures.append((rank, c, "NaN"))
            if not res.get("layout_ok", True):
                failures.append((rank, c, "output not laid out like the inputs"))
            for what, errs, tols in (("flash", res["vs_flash"], flash_tol),
                                     ("ref", res["vs_ref"], ref_tol)):
                for name, e, t in zip(names, errs, tols):
                    if not e <= t:
                        failures.append((rank, c, f"{name} vs {what}: {e:.2e} > {t:.0e}"))
            for what in ("flash", "ref"):  # mod tensors' gradients (sinks, a bias)
                for i, e in enumerate(res.get(f"vs_{what}_t", ())):
                    if not e <= grad_tol:
                        failures.append((rank, c, f"mod tensor {i} grad vs {what}: {e:.2e}"))
            if "repeat_equal" in res and not res["repeat_equal"]:
                failures.append((rank, c, "a repeated call differs"))
    assert not failures, "\n".join(map(str, failures))


def test_causal_only_package_serves_full_pieces_with_the_causal_kernel(tmp_path):
    """A package without the `none` mask (a decoder's spec): the fully visible pieces of
    a causal zig-zag call run the causal kernel with unbounded offsets."""
    pkg = build_and_import(tmp_path, "fg_test_ring_causal_only", """
        head_dims: [16]
        dtypes: [fp32]
        masks: [causal]
        """)
    assert pkg._ring.kernel_mask("full") == "causal"
    with pytest.raises(ValueError, match="`sliding_window` mask"):
        pkg._ring.kernel_mask("both")
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 16, 2, 16, requires_grad=True) for _ in range(3))
    with pkg._runtime.override_config(**TILES):
        ref = pkg.flash_attn_func(q, k, v, causal=True)
        do = torch.randn_like(ref)
        g_ref = torch.autograd.grad(ref, (q, k, v), do)
        out = pkg.ring_flash_attn_func(q, k, v, causal=True)
        g = torch.autograd.grad(out, (q, k, v), do)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# Mods: position-based mods see global positions
# ----------------------------------------------------------------------------------------
MODS_PACKAGE = "fg_test_ring_mods"
MODS_SPEC = """
    head_dims: [16]
    dtypes: [fp32]
    masks: [none, causal]
    gqa: true
    attn_mask: false
    mods:
      softcap: {builtin: softcap, params: {cap: 2.0}}
      alibi: {builtin: alibi}
      prefix_lm: {builtin: prefix_lm}
      window_sinks: {builtin: sliding_window_sinks, params: {sinks: 2, window: 5}}
      document: {builtin: document}
      sink_logits: {builtin: sink_logits}
      relative_bias: {builtin: relative_bias, params: {max_distance: 4}}
    variants:
      - {mask: causal, mods: [softcap]}
      - {mask: causal, mods: [alibi]}
      - {mask: none, mods: [prefix_lm]}
      - {mask: none, mods: [window_sinks]}
      - {mask: causal, mods: [document]}
      - {mask: causal, mods: [sink_logits]}
      - {mask: none, mods: [relative_bias]}
    """


@pytest.fixture(scope="module")
def mods_built(tmp_path_factory):
    root = tmp_path_factory.mktemp("ring_mods")
    pkg = build_and_import(root, MODS_PACKAGE, MODS_SPEC)
    return pkg, root / "out"


SLOPE = [0.25, 0.75]  # per query head: ALiBi's distance penalty must be visible


@pytest.mark.parametrize("mods,kw,causal", [
    (("alibi",), dict(slope=torch.tensor(SLOPE)), True),
    (("window_sinks",), dict(sinks=2, window=5), False),  # a mask mod: block lists
    (("prefix_lm",), dict(prefix_len=torch.tensor([7, 30], dtype=torch.int32)), False),
])
def test_piece_at_global_offsets_matches_the_full_call(mods_built, mods, kw, causal):
    """Rows [a, a + m) against keys [0, c) and [c, n), each one forward launch whose mods
    see global positions (a _mods.Call piece), merged through their LSE: the full call's
    rows. Without the offsets the same launch gives other numbers."""
    pkg, _ = mods_built
    torch.manual_seed(2)
    b, n, a, m, c = 2, 40, 9, 23, 21
    q = torch.randn(b, n, 2, 16)
    k, v = torch.randn(b, n, 1, 16), torch.randn(b, n, 1, 16)
    _, lo_g, hi_g = pkg._ring._global_band(n, causal, (-1, -1))
    mask = "causal" if causal else "none"
    call = pkg._mods.prepare(mods, kw, b, 2, n, n, q.device)
    with pkg._runtime.override_config(**TILES):
        full, full_lse = pkg.flash_attn_func(q, k, v, causal=causal, mods=mods,
                                             return_lse=True, **kw)
        parts = []
        for ks, kn in ((0, c), (c, n - c)):
            o = torch.empty(b, m, 2, 16)
            lse = pkg._runtime.forward(q[:, a:a + m], k[:, ks:ks + kn], v[:, ks:ks + kn], o,
                                       mask=mask, lo=a - ks + lo_g, hi=a - ks + hi_g,
                                       scale=16 ** -0.5, bnhd=True,
                                       mods=call.piece(m, kn, a, ks))
            parts.append((o, lse))
        local = torch.empty(b, m, 2, 16)
        pkg._runtime.forward(q[:, a:a + m], k, v, local, mask=mask, lo=a + lo_g, hi=a + hi_g,
                             scale=16 ** -0.5, bnhd=True, mods=call.piece(m, n, 0, 0))
    lse = torch.logaddexp(parts[0][1], parts[1][1])
    out = sum(torch.nan_to_num(o * torch.exp(l - lse).transpose(1, 2)[..., None])
              for o, l in parts)
    torch.testing.assert_close(out, full[:, a:a + m], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, full_lse[..., a:a + m], atol=1e-5, rtol=1e-5)
    assert (local - full[:, a:a + m]).abs().max() > 0.1  # the offsets matter here


def test_plans_with_mods_call_contiguous_global_runs(mods_built):
    """With mods, a call's rows and keys are each one run of global positions (its mods
    add its first position to the local index), and the pieces still tile the mask."""
    pkg, _ = mods_built
    ring = pkg._ring
    call = pkg._mods.prepare(("alibi",), dict(slope=torch.tensor(SLOPE)), 1, 2, 24, 24,
                              torch.device("cpu"))
    world, n_local = 3, 8
    n = world * n_local
    _, lo_g, hi_g = pkg._runtime.band(n, n, True, (-1, -1), True)
    got = torch.zeros(n, n, dtype=torch.int32)
    for rank in range(world):
        q_segs = ring.segments(n_local, rank, world, "zigzag")
        q_glob = torch.cat([torch.arange(g, g + ln) for _, ln, g in q_segs])
        for src in range(world):
            k_segs = ring.segments(n_local, src, world, "zigzag")
            k_glob = torch.cat([torch.arange(g, g + ln) for _, ln, g in k_segs])
            for qs, qn, ks, kn, mask, lo, hi, qg, kg in ring.plan_pair(q_segs, k_segs, lo_g,
                                                                       hi_g, call):
                assert mask == "causal"  # the only mask alibi was built with
                rows, cols = q_glob[qs:qs + qn], k_glob[ks:ks + kn]
                assert torch.equal(rows, torch.arange(qg, qg + qn))
                assert torch.equal(cols, torch.arange(kg, kg + kn))
                got[rows[:, None], cols[None, :]] += brute(qn, kn, lo, hi).int()
    assert torch.equal(got, brute(n, n, lo_g, hi_g).int())


def test_mod_arguments_checked_before_launch(mods_built):
    pkg, _ = mods_built
    q = torch.zeros(1, 8, 2, 16)
    with pytest.raises(TypeError, match="need mods="):
        pkg.ring_flash_attn_func(q, q, q, causal=True, slope=torch.zeros(2))
    with pytest.raises(ValueError, match=r"`slope` has shape \(3,\)"):
        pkg.ring_flash_attn_func(q, q, q, causal=True, mods=("alibi",), slope=torch.zeros(3))
    # a mod tensor that wants a gradient would silently get none: refused
    with pytest.raises(NotImplementedError, match="`slope` requires grad"):
        pkg.ring_flash_attn_func(q, q, q, causal=True, mods=("alibi",),
                                 slope=torch.zeros(2, requires_grad=True))
    with pytest.raises(ValueError, match="no kernel"):  # prefix_lm was built without causal
        pkg.ring_flash_attn_func(q, q, q, causal=True, mods=("prefix_lm",),
                                 prefix_len=torch.zeros(1, dtype=torch.int32))


def mod_case(n, mods, mod_kw, **kw):
    return case(n, mods=list(mods), mod_kw=mod_kw, **kw)


ALIBI = {"slope": {"values": SLOPE, "dtype": "float32"}}
MOD_CASES = {
    # zig-zag chunks of 5 rows: pieces start off the 16-row tiles
    2: [mod_case(20, ["alibi"], ALIBI, causal=True),
        mod_case(20, ["softcap"], {"cap": 2.0}, causal=True, strategy="allgather"),
        mod_case(18, ["window_sinks"], {"sinks": 2, "window": 5}, layout="contiguous",
                 sdpa=True),
        mod_case(24, ["prefix_lm"], {"prefix_len": {"values": [15], "dtype": "int32"}},
                 strategy="allgather"),
        # a [H, 2 * 4 + 1] bias gathered at kv_idx - q_idx (clamped): 20 tokens reach
        # distances past 4 both ways, so both end buckets are read across pieces
        mod_case(20, ["relative_bias"], {"rel_bias": {
            "values": [[0.1 * (i - 4) * (h + 1) for i in range(9)] for h in range(2)],
            "dtype": "float32"}})],
    # (FLASHGEN_CP_HEAD_GROUPS=2: the second group's heads must read their own slopes --
    # the group's mods get the slope narrowed to its heads)
    3: [mod_case(30, ["alibi"], ALIBI, causal=True, heads=(2, 2), head_groups=2)],
}


@pytest.mark.parametrize("world", [2, 3])
def test_context_parallel_mods_match_single_process(mods_built, tmp_path, world):
    _, pkg_dir = mods_built
    per_rank = run_world(world, pkg_dir, tmp_path, MOD_CASES[world], package=MODS_PACKAGE)
    assert_results(per_rank)
