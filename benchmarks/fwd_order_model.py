"""A model of the persistent Gluon forward's tile deal for block-mask variants (issue 16):
P = 132 programs, each running its dealt tiles back to back, a tile costing
TILE_FIXED_COST + full blocks + FWD_PARTIAL_WEIGHT x partial blocks (key blocks of 128, query
tiles of 128 rows: the Gluon default). Prints the busiest program over the mean for the
kernel's own deal (LONGEST_FIRST, the order before _mods._tile_table; FWD_ORDER_QUANTUM = 0)
and the table's (classes 1.0 and 0.5 mean costs wide), at the mods bench's masks
(B=4 H=16 N=4096), and the distinct heads among the first tile of every program (what
shares K/V through L2 at one time). The deals are the generated package's own
(_mods.deal_tiles), so the model runs the code the GPU runs.
CPU only: PYTHONPATH=$PWD python benchmarks/fwd_order_model.py"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashgen.bench import mods as bm  # noqa: E402
from generated.mods_attn import _families, _mods  # noqa: E402

B, H, N, BM, BN, P = 4, 16, 4096, 128, 128, 132
# the runtime's head group at this shape on the H100: max(L2 / 4 / one head's K/V, rounds
# of two grids' worth of query blocks) = max(50 MB / 4 / 2 MiB, cdiv(2 * 132, 32)) = 9
HEAD_GROUP = 9


def visible(mod, kw, b):
    """[N, N] bool: which keys query i sees, with the variant's band (document: causal)."""
    i = torch.arange(N)[:, None]
    j = torch.arange(N)[None, :]
    if mod == "document":
        d = kw["doc"][b]
        return (j <= i) & (d[:, None] == d[None, :])
    if mod == "prefix_lm":
        return (j < kw["prefix_len"][b]) | (j <= i)
    if mod == "window_sinks":
        return (j <= i) & ((j < bm.SINKS) | (i - j <= bm.WINDOW))
    return j <= i


def tile_costs(mod):
    """[B * H, N / BM] costs in key-block units (every head of a batch row alike)."""
    kw = bm.inputs(mod, B, H, N, "cpu")
    rows = []
    for b in range(B):
        t = visible(mod, kw, b).reshape(N // BM, BM, N // BN, BN)
        anyv, allv = t.any(3).any(1), t.all(3).all(1)
        full = allv.sum(1).float()
        part = (anyv & ~allv).sum(1).float()
        rows += [full + _mods.FWD_PARTIAL_WEIGHT * part + _families.TILE_FIXED_COST] * H
    return torch.stack(rows)


def evaluate(cost, table):
    """(busiest program / mean, heads in flight at the start)."""
    flat = cost.reshape(-1)
    off, tiles = table[:P + 1].long(), table[P + 1:].long()
    assert sorted(tiles.tolist()) == list(range(flat.numel()))
    totals = torch.stack([flat[tiles[off[p]:off[p + 1]]].sum() for p in range(P)])
    first = tiles[off[:-1]] // (N // BM)
    return (totals.max() / totals.mean()).item(), len(set(first.tolist()))


def main():
    print(f"B={B} H={H} N={N} tiles {BM}x{BN}, {P} programs; busiest/mean (heads at the start)")
    for mod in ("document", "prefix_lm", "window_sinks"):
        cost = tile_costs(mod)
        row = [f"{mod:13s} max tile/mean {cost.max().item() / cost.mean().item():.2f}"]
        for name, q in (("kernel deal", 0.0), ("table q=1.0", 1.0), ("table q=0.5", 0.5)):
            ratio, heads = evaluate(cost, _mods.deal_tiles(cost, P, q, HEAD_GROUP))
            row.append(f"{name} {ratio:.3f} ({heads})")
        print("  ".join(row))


if __name__ == "__main__":
    main()
