"""A list-scheduling model of the dense Gluon backward's program order under a causal mask
(no GPU needed):

    python benchmarks/bwd_head_group_model.py

One program per (batch, K/V head, 128-key block); a program costs its 64-row query steps
(key block n of N / 128 sees 2 (N/128 - n) - 1 of them under a causal mask) plus 2 for its
start and stores; programs start in grid order on whichever of 132 SMs frees first. Prints
the last SM's end over the mean load for head-major order (G = 1) and for key blocks walked
level by level in groups of G (batch, head) pairs -- the order HEAD_GROUP = G gives
(templates/gluon/bwd.py.j2, _block_coords; the runtime's _gluon_bwd_head_group picks G).
"""
import heapq

SMS, FIXED = 132, 2.0


def order(pairs: int, num_n: int, group: int):
    for g0 in range(0, pairs, group):
        heads = range(g0, min(pairs, g0 + group))
        for n in range(num_n):
            for h in heads:
                yield h, n


def makespan(pairs: int, num_n: int, group: int) -> float:
    cost = [FIXED + 2 * (num_n - n) - 1 for n in range(num_n)]
    free = [0.0] * SMS
    end = 0.0
    for _, n in order(pairs, num_n, group):
        t = heapq.heappop(free) + cost[n]
        end = max(end, t)
        heapq.heappush(free, t)
    return end / (pairs * sum(cost) / SMS)


if __name__ == "__main__":
    for b, h, n in [(1, 16, 4096), (8, 16, 2048), (4, 16, 4096), (1, 16, 16384), (2, 32, 4096)]:
        groups = [g for g in (1, 2, 4, 8, 16, 32, 64, 128) if g <= b * h]
        print(f"(B, H, N) = ({b}, {h}, {n}):",
              " ".join(f"G{g} {makespan(b * h, n // 128, g):.3f}" for g in groups))
