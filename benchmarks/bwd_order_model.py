"""A model of the non-persistent Gluon backward's dispatch for block-mask variants (issue 16):
132 SMs take programs in grid order, each costing F + its steps (partial steps weighted w);
prints the busiest SM over the mean for head-major and longest-first orders at the mods
bench's masks (B=4 H=16 N=4096). CPU only: python benchmarks/bwd_order_model.py
(docs/PERF_NOTES.md, fifteenth session, compares it with the H100)."""
import heapq
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashgen.bench import mods as bm
B, H, N, BM, BN = 4, 16, 4096, 64, 128
def vis(mod, kw):
    i = torch.arange(N)[:, None]; j = torch.arange(N)[None, :]
    out = []
    for b in range(B):
        if mod == "document":
            d = kw["doc"][b]; v = (j <= i) & (d[:, None] == d[None, :])
        elif mod == "prefix_lm":
            v = (j < kw["prefix_len"][b]) | (j <= i)
        elif mod == "window_sinks":
            v = (j <= i) & ((j < 4) | (i - j <= 1024))
        else:
            v = j <= i
        out.append(v)
    return out
def steps(mod):
    kw = bm.inputs(mod, B, H, N, "cpu")
    res = []
    for v in vis(mod, kw):
        t = v.reshape(N // BM, BM, N // BN, BN)
        anyv = t.any(3).any(1)  # [NM, NN]
        allv = t.all(3).all(1)
        full = allv.sum(0); part = (anyv & ~allv).sum(0)
        res.append((full, part))
    return res
def makespan(costs, P=132):
    heap = [0.0] * P
    for c in costs:
        t = heapq.heappop(heap); heapq.heappush(heap, t + c)
    return max(heap)
F, W = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0, 1.3
for mod in ("alibi", "document", "prefix_lm", "window_sinks"):
    st = steps(mod)
    progs = []  # (b, h, n, cost)
    for b in range(B):
        full, part = st[b]
        for h in range(H):
            for n in range(N // BN):
                progs.append((b, h, n, F + full[n].item() + W * part[n].item()))
    costs = [p[3] for p in progs]
    lb = max(sum(costs) / 132, max(costs))
    head_major = makespan(costs)
    lpt = makespan(sorted(costs, reverse=True))
    # bucketed: programs at least 2x the mean first (global, longest first), then head-major
    mean = sum(costs) / len(costs)
    big = sorted([c for c in costs if c >= 2 * mean], reverse=True)
    bucket = makespan(big + [c for c in costs if c < 2 * mean])
    # head-major, within each head longest first
    hm_lpt = makespan([c for i in range(0, len(costs), N // BN) for c in sorted(costs[i:i + N // BN], reverse=True)])
    print(f"{mod:13s} bound {lb:7.1f}  head-major {head_major/lb:.3f}  head-LPT {hm_lpt/lb:.3f}  outliers-first {bucket/lb:.3f}  global LPT {lpt/lb:.3f}  maxcost/mean {max(costs)/mean:.2f}")
print("quantized LPT: sort by -floor(cost / (mean*q)), ties head-major; (makespan/bound, mean distinct heads per 132 consecutive)")
def heads_per_wave(order):
    return sum(len({(progs[i][0], progs[i][1]) for i in order[s:s+132]}) for s in range(0, len(order), 132)) / ((len(order)+131)//132)
for mod in ("alibi", "document", "prefix_lm", "window_sinks"):
    st = steps(mod)
    progs = []
    for b in range(B):
        full, part = st[b]
        for h in range(H):
            for n in range(N // BN):
                progs.append((b, h, n, F + full[n].item() + W * part[n].item()))
    costs = [p[3] for p in progs]; lb = max(sum(costs) / 132, max(costs)); mean = sum(costs)/len(costs)
    row = [f"{mod:13s} hm {makespan(costs)/lb:.3f}/{heads_per_wave(list(range(len(costs)))):.1f}"]
    for q in (0.25, 0.5, 1.0):
        order = sorted(range(len(costs)), key=lambda i: (-int(costs[i] // (mean * q)), i))
        row.append(f"q{q}: {makespan([costs[i] for i in order])/lb:.3f}/{heads_per_wave(order):.1f}")
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    row.append(f"LPT {makespan([costs[i] for i in order])/lb:.3f}/{heads_per_wave(order):.1f}")
    print("  ".join(row))
