"""A cost model of where the varlen Gluon kernels' time goes, against the dense kernels
(issue 17's bar; CPU only, no GPU needed):

    PYTHONPATH=. python benchmarks/varlen_schedule_model.py

It counts the (tile, head) work units of the bench's workload (flashgen.bench.varlen's
16 documents of 128..4096 tokens, seed 0, H=16, d=128, causal) and of the dense (4, 4096)
batch, fits per-unit costs (a full key block, a diagonal block with the tile's own fixed
cost, a per-call constant) to the dense kernels' measured TFLOP/s at N = 1k..16k
(docs/PERF_NOTES.md; the numbers are typed in below, from the benches named beside them),
and replays the schedules the kernels use (the varlen forward's level walk dealt back and
forth, the dense forward's host table, the backward grids dispatched in program order)
against alternatives (longest-processing-time first). What it prints is a model: its
costs are averages, and it knows nothing of L2 or of per-SM clock differences.
"""
from __future__ import annotations

import heapq

import numpy as np

from flashgen import families
from flashgen.bench.varlen import ragged_lengths

P = 132          # SMs of the H100 SXM (persistent grid / resident backward programs)
H = 16
BM = BN = 128    # the Gluon forward's tile; the backward's key block
BWD_M = 64       # the Gluon backward's query step (GLUON_BWD_DEFAULT)
BLOCK_FLOP = 4.0 * BM * BN * 128   # one (128 x 128) block of a forward at d=128
TOKENS = 16384


def cdiv(a, b):
    return -(-a // b)


# ----------------------------------------------------------------------------------------
# forward units: a tile is (full key blocks, diagonal blocks) + its own fixed cost
# ----------------------------------------------------------------------------------------
def fwd_tile(n, m, causal=True):
    """(full, diagonal) key blocks of query tile m of a sequence of n tokens (q = k)."""
    if not causal:
        return cdiv(n, BN), 0
    return m, 1


def fwd_counts(lengths, causal=True):
    tiles = sum(cdiv(n, BM) for n in lengths)
    full = diag = 0
    for n in lengths:
        for m in range(cdiv(n, BM)):
            f, dg = fwd_tile(n, m, causal)
            full += f
            diag += dg
    return tiles, full, diag


def fwd_flop_blocks(lengths, causal=True):
    """The counted FLOPs in block units (the bench's formula: n^2/2 per causal sequence)."""
    return sum(n * n / (2 if causal else 1) for n in lengths) / (BM * BN)


# ----------------------------------------------------------------------------------------
# schedules
# ----------------------------------------------------------------------------------------
def varlen_walk_fwd(lengths, head_group, programs=P):
    """The varlen Gluon forward's static walk (templates/gluon/fwd.py.j2, _varlen_tile):
    head group, then level from the top, then sequence, then head; tile t goes to program
    t mod P, back and forth by round. Returns per program the list of (seq, head, m)."""
    num_m = max(cdiv(n, BM) for n in lengths)
    order = []
    for g0 in range(0, H, head_group):
        heads = range(g0, min(g0 + head_group, H))
        for level in range(num_m - 1, -1, -1):
            for b, n in enumerate(lengths):
                if n > level * BM:
                    order.extend((b, h, level) for h in heads)
    mine = [[] for _ in range(programs)]
    for t, unit in enumerate(order):
        k, p = divmod(t, programs)
        if k % 2:
            p = programs - 1 - p
        mine[p].append(unit)
    return mine


def lpt(units, cost, programs=P):
    """Longest processing time first: every unit, most expensive first, to the program
    with the least work so far (a greedy list schedule; the same as a dynamic queue
    that hands out units in that order when costs are exact)."""
    heap = [(0.0, p) for p in range(programs)]
    mine = [[] for _ in range(programs)]
    for u in sorted(units, key=lambda u: -cost(u)):
        load, p = heapq.heappop(heap)
        mine[p].append(u)
        heapq.heappush(heap, (load + cost(u), p))
    return mine


def in_order(units, cost, programs=P):
    """Hardware dispatch of a non-persistent grid: each program, in grid order, starts on
    the first SM to free up (one resident program an SM)."""
    return lpt_fixed_order(units, cost, programs)


def lpt_fixed_order(units, cost, programs=P):
    heap = [(0.0, p) for p in range(programs)]
    finish = [0.0] * programs
    for u in units:
        load, p = heapq.heappop(heap)
        finish[p] = load + cost(u)
        heapq.heappush(heap, (finish[p], p))
    return finish


def makespan(mine, cost):
    loads = [sum(cost(u) for u in lst) for lst in mine]
    return max(loads), sum(loads) / len(loads)


# ----------------------------------------------------------------------------------------
# fitted costs
# ----------------------------------------------------------------------------------------
# Dense Gluon forward, B*N = 16k, H=16, d=128 (bench_training_fwd_d128-64_n1024-...-16384
# _flashgen-sdpa_flash-sdpa_cudnn-flex.md, flashgen column): TFLOP/s by N
FWD_CAUSAL = {1024: 396.4, 2048: 485.2, 4096: 512.3, 8192: 554.8, 16384: 551.8}
FWD_FULL = {1024: 561.7, 2048: 628.5, 4096: 609.8, 8192: 605.1, 16384: 607.8}
# Dense Gluon backward, same shapes (PERF_NOTES tenth session, grads cleared; 8k and 16k
# from the later run of the same bench)
BWD_CAUSAL = {1024: 262.2, 2048: 364.0, 4096: 420.1, 8192: 500.2, 16384: 529.5}
BWD_FULL = {1024: 382.0, 2048: 456.4, 4096: 484.2, 8192: 502.2, 16384: 551.3}


def fit_forward():
    """us per full block, per (diagonal block + tile fixed cost), per non-diagonal tile's
    fixed cost, per call: least squares on the dense runs, each run's count vector being
    the busiest program's of its schedule (the host table for causal; stream-K evens out
    the non-causal ones, so their mean program)."""
    rows, ys = [], []
    for causal, table in ((True, FWD_CAUSAL), (False, FWD_FULL)):
        for n, tf in table.items():
            b = TOKENS // n
            flops = b * H * fwd_flop_blocks([n], causal) * BLOCK_FLOP
            us = flops / (tf * 1e12) * 1e6
            t = cdiv(n, BM)
            if causal:
                # busiest program of the host deal, in (full, diag+tile, tile, call) counts
                mine = dense_fwd_deal(b, n)
                vecs = [np.array([sum(m for m, _ in lst), len(lst), 0, 1.0]) for lst in mine]
                rows.append(vecs)
            else:
                vec = np.array([b * H * t * t / P, 0, b * H * t / P, 1.0])
                rows.append([vec])
            ys.append(us)
    x = np.array([1.8, 4.0, 1.0, 10.0])
    for _ in range(10):  # the busiest program depends on the costs: iterate
        a = np.array([max(v, key=lambda v: v @ x) for v in rows])
        x, *_ = np.linalg.lstsq(a, np.array(ys), rcond=None)
    return x, a, np.array(ys)


def dense_fwd_deal(b, n, programs=P):
    """The dense causal forward's host table (families.band_tile_order), as (m, bh) lists."""
    num_m = cdiv(n, BM)
    costs = [families.band_tile_blocks(m, BM, BN, n, n, 0, 0, False, True) for m in range(num_m)]
    l2_heads = max(1, (50 * 2**20 // 4) // (2 * n * 128 * 2), cdiv(2 * programs, num_m))
    order = families.band_tile_order(b * H, num_m, costs, l2_heads, 1, programs)
    offs, tiles = order[:programs + 1], order[programs + 1:]
    return [[(t % num_m, t // num_m) for t in tiles[offs[p]:offs[p + 1]]]
            for p in range(programs)]


def bwd_program(n, j, causal=True):
    """(full steps, masked steps) of key block j of a sequence of n tokens (q = k) in the
    Gluon backward (64-row query steps; a key block crossing the end masks every step,
    a ragged last query step is masked)."""
    n_start = j * BN
    lo = n_start if causal else 0
    lo = (lo // BWD_M) * BWD_M
    steps = cdiv(n - lo, BWD_M)
    if n_start + BN > n:  # crosses the end (varlen): every step masked
        return 0, steps
    masked = 0
    full_lo = cdiv(min(n_start + BN, n) - 1, BWD_M) * BWD_M if causal else 0
    full_hi = (n // BWD_M) * BWD_M
    for s in range(steps):
        m0 = lo + s * BWD_M
        if not (full_lo <= m0 and m0 + BWD_M <= full_hi):
            masked += 1
    return steps - masked, masked


# The backward's four costs are not separable from the dense runs alone (an unconstrained
# fit traded the per-program cost against the per-call one and put a masked step below a
# full one), so two are set: a masked step costs MASKED_STEP x a full one (the same
# products plus the mask arithmetic), and a call BWD_CALL_US besides its programs (the
# preprocess, zeroing the fp32 dQ sum and its conversion: ~50 MB of traffic and three
# launches). The schedule ratios below moved by under 0.005 for MASKED_STEP 1.0-1.5 and
# BWD_CALL_US 15-50.
MASKED_STEP = 1.25
BWD_CALL_US = 30.0


def fit_backward():
    """us per full step, per masked step, per program, per call (the dense backward's grid
    dispatched in program order): the full step and the program's fixed cost fitted."""
    rows, ys = [], []
    for causal, table in ((True, BWD_CAUSAL), (False, BWD_FULL)):
        for n, tf in table.items():
            b = TOKENS // n
            flops = 2.5 * b * H * fwd_flop_blocks([n], causal) * BLOCK_FLOP
            us = flops / (tf * 1e12) * 1e6
            units = [bwd_program(n, j, causal) for _ in range(b * H) for j in range(cdiv(n, BN))]
            rows.append(units)
            ys.append(us)
    ys = np.array(ys)
    x = np.array([2.0, 2.0 * MASKED_STEP, 15.0, BWD_CALL_US])
    for _ in range(10):  # the last SM depends on the costs: iterate
        a = np.array([_critical_counts(units, x) for units in rows])
        a2 = np.stack([a[:, 0] + MASKED_STEP * a[:, 1], a[:, 2]], 1)
        y, *_ = np.linalg.lstsq(a2, ys - BWD_CALL_US, rcond=None)
        x = np.array([y[0], MASKED_STEP * y[0], y[1], BWD_CALL_US])
    return x, a, ys


def _critical_counts(units, x, programs=P):
    """Counts (full, masked, programs, 1) along the SM that finishes last under in-order
    dispatch with costs x."""
    heap = [(0.0, p) for p in range(programs)]
    vec = [np.zeros(4) for _ in range(programs)]
    for u in units:
        load, p = heapq.heappop(heap)
        vec[p] = vec[p] + np.array([u[0], u[1], 1, 0])
        heapq.heappush(heap, (load + u[0] * x[0] + u[1] * x[1] + x[2], p))
    last = max(range(programs), key=lambda p: vec[p][:3] @ x[:3])
    return vec[last] + np.array([0, 0, 0, 1.0])


def main():
    lengths = ragged_lengths(16, TOKENS, 128, 4096, 0)
    dense = [4096] * 4
    print(f"documents (packed order): {lengths}")
    print(f"sorted: {sorted(lengths, reverse=True)}")
    print("\n== forward work units (per head; x16 heads) ==")
    for name, ls in (("varlen", lengths), ("dense 4x4096", dense)):
        t, f, dg = fwd_counts(ls)
        fl = fwd_flop_blocks(ls)
        print(f"{name:13s} tiles {t:4d}  full blocks {f:5d}  diagonal {dg:4d}  "
              f"blocks/tile {(f + dg) / t:5.2f}  counted FLOP (blocks) {fl:7.1f}  "
              f"counted/executed {fl / (f + dg):.3f}  diagonal share {dg / (f + dg):.3f}  "
              f"FLOP share in diagonal blocks (counted) {dg * 0.5 / fl:.3f}")
    hist = {}
    for n in lengths:
        for m in range(cdiv(n, BM)):
            hist[m + 1] = hist.get(m + 1, 0) + H
    print("varlen (tile, head) units by key blocks:", dict(sorted(hist.items(), reverse=True)))

    xf, af, yf = fit_forward()
    print(f"\nforward fit (us): full block {xf[0]:.3f}, diagonal block + tile fixed "
          f"{xf[1]:.3f}, non-causal tile fixed {xf[2]:.3f}, per call {xf[3]:.2f}")
    print("  fit residuals (model/measured):", np.round(af @ xf / yf, 3))
    cost = lambda u: u[2] * xf[0] + xf[1]  # noqa: E731  (b, h, m): m full + diag + tile

    units = [(b, h, m) for b, n in enumerate(lengths) for h in range(H)
             for m in range(cdiv(n, BM))]
    mean = sum(cost(u) for u in units) / P
    print(f"\n== forward schedule (us; the mean program {mean:.1f}) ==")
    res = {}
    for name, mine in (
            ("walk, head_group 8 (VARLEN_GLUON_ROUNDS 8, today)", varlen_walk_fwd(lengths, 8)),
            ("walk, head_group 16 (one group)", varlen_walk_fwd(lengths, 16)),
            ("walk, head_group 4", varlen_walk_fwd(lengths, 4)),
            ("walk, head_group 2", varlen_walk_fwd(lengths, 2)),
            ("LPT over all (tile, head) units", lpt(units, cost))):
        ms, mn = makespan(mine, cost)
        res[name] = ms
        print(f"  {name:50s} busiest {ms:7.1f}  / mean {ms / mn:.3f}")
    dmine = dense_fwd_deal(4, 4096)
    dcost = lambda u: u[0] * xf[0] + xf[1]  # noqa: E731
    dms, dmn = makespan(dmine, dcost)
    print(f"  {'dense (4, 4096), host table':50s} busiest {dms:7.1f}  / mean {dms / dmn:.3f}")
    vf = fwd_flop_blocks(lengths) * H * BLOCK_FLOP
    df = fwd_flop_blocks(dense) * H * BLOCK_FLOP
    d_us = dms + xf[3]
    print(f"  model TFLOP/s: dense {df / d_us / 1e6:.1f}; varlen today "
          f"{vf / (res['walk, head_group 8 (VARLEN_GLUON_ROUNDS 8, today)'] + xf[3]) / 1e6:.1f}"
          f", varlen LPT {vf / (res['LPT over all (tile, head) units'] + xf[3]) / 1e6:.1f}, "
          f"varlen perfectly even {vf / (mean + xf[3]) / 1e6:.1f}")
    # the length-matched dense baseline in the model: each document charged at the rate
    # the model gives the dense kernel on an equal-length batch of its length (about
    # 16k tokens, the host table's deal), as bench.varlen's flashgen_dense_matched row
    matched_us = 0.0
    for n in lengths:
        b = max(1, round(TOKENS / n))
        mine_n = dense_fwd_deal(b, n)
        t_n = makespan(mine_n, dcost)[0] + xf[3]
        rate = b * fwd_flop_blocks([n]) * H * BLOCK_FLOP / t_n
        matched_us += fwd_flop_blocks([n]) * H * BLOCK_FLOP / rate
    print(f"  model length-matched dense {vf / matched_us / 1e6:.1f} TFLOP/s; varlen today / "
          f"matched {(matched_us) / (res['walk, head_group 8 (VARLEN_GLUON_ROUNDS 8, today)'] + xf[3]):.3f}"
          f", perfectly even varlen / dense(4, 4096) {(vf / (mean + xf[3])) / (df / d_us):.3f}")

    xb, ab, yb = fit_backward()
    print(f"\nbackward fit (us): full step {xb[0]:.3f}, masked step {xb[1]:.3f} (set: "
          f"{MASKED_STEP} x), program fixed {xb[2]:.3f}, per call {xb[3]:.2f} (set)")
    print("  fit residuals (model/measured):", np.round(ab @ xb / yb, 3))
    bcost = lambda u: u[0] * xb[0] + u[1] * xb[1] + xb[2]  # noqa: E731
    bunits = {}
    for b, n in enumerate(lengths):
        for j in range(cdiv(n, BN)):
            bunits[(b, j)] = bwd_program(n, j)
    steps_v = [sum(bunits[k][i] for k in bunits) for i in (0, 1)]
    dn = [bwd_program(4096, j) for j in range(32)]
    steps_d = [4 * sum(u[i] for u in dn) for i in (0, 1)]
    print(f"\n== backward work units (per head) ==\n  varlen programs {len(bunits)}, full "
          f"steps {steps_v[0]}, masked steps {steps_v[1]} (share {steps_v[1] / sum(steps_v):.3f})"
          f"\n  dense  programs 128, full steps {steps_d[0]}, masked steps {steps_d[1]} "
          f"(share {steps_d[1] / sum(steps_d):.3f})")
    num_n = max(cdiv(n, BN) for n in lengths)

    def level_order(group):
        """The varlen backward's grid order (templates/gluon/bwd.py.j2, _varlen_block):
        groups of `group` heads, in a group level from the top, then sequence, then head."""
        out = []
        for g0 in range(0, H, group):
            for lv in range(num_n - 1, -1, -1):
                for b, n in enumerate(lengths):
                    if cdiv(n, BN) > lv:
                        out.extend([bunits[(b, cdiv(n, BN) - 1 - lv)]] * min(group, H - g0))
        return out

    ball = [bunits[k] for k in bunits for _ in range(H)]
    bmean = sum(bcost(u) for u in ball) / P
    print(f"\n== backward schedule (us; the mean SM {bmean:.1f}) ==")
    bres = {}
    for name, order in (("head-major, level from the top (today)", level_order(1)),
                        ("groups of 2 heads, level-major in a group", level_order(2)),
                        ("groups of 4 heads (VARLEN_GLUON_BWD_HEADS 4)", level_order(4)),
                        ("groups of 8 heads", level_order(8)),
                        ("level-major across all heads", level_order(16)),
                        ("LPT: every program by cost", sorted(ball, key=lambda u: -bcost(u)))):
        fin = lpt_fixed_order(order, bcost)
        bres[name] = max(fin)
        print(f"  {name:50s} last SM {max(fin):7.1f}  / mean {max(fin) / bmean:.3f}")
    dorder = [u for _ in range(4 * H) for u in dn]
    dfin = lpt_fixed_order(dorder, bcost)
    dmean = sum(bcost(u) for u in dorder) / P
    print(f"  {'dense (4, 4096), grid order':50s} last SM {max(dfin):7.1f}  / mean "
          f"{max(dfin) / dmean:.3f}")
    vbf = 2.5 * vf
    dbf = 2.5 * df
    print(f"  model TFLOP/s: dense {dbf / (max(dfin) + xb[3]) / 1e6:.1f}; varlen today "
          f"{vbf / (bres['head-major, level from the top (today)'] + xb[3]) / 1e6:.1f}, "
          f"groups of 4 {vbf / (bres['groups of 4 heads (VARLEN_GLUON_BWD_HEADS 4)'] + xb[3]) / 1e6:.1f}, "
          f"LPT {vbf / (bres['LPT: every program by cost'] + xb[3]) / 1e6:.1f}, perfectly "
          f"even {vbf / (bmean + xb[3]) / 1e6:.1f}")
    matched_us = 0.0
    for n in lengths:
        b = max(1, round(TOKENS / n))
        units_n = [bwd_program(n, j) for _ in range(b * H) for j in range(cdiv(n, BN))]
        t_n = max(lpt_fixed_order(units_n, bcost)) + xb[3]
        matched_us += t_n / b  # this document's share of its equal-length batch
    print(f"  model length-matched dense {vbf / matched_us / 1e6:.1f} TFLOP/s; varlen today / "
          f"matched {matched_us / (bres['head-major, level from the top (today)'] + xb[3]):.3f}, "
          f"groups of 4 / matched "
          f"{matched_us / (bres['groups of 4 heads (VARLEN_GLUON_BWD_HEADS 4)'] + xb[3]):.3f}")


if __name__ == "__main__":
    main()
