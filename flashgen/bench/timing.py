"""How the bench times a call: interleaved rounds, the callable do_bench times, host time.

Times are `triton.testing.do_bench(..., return_mode="median")` with the L2 flushed
between calls. With `--rounds R` the providers of a case are timed R times in
alternating order (interleaved_rounds) and each row keeps the median round
(record_rounds).

Host dispatch (small suite, flashgen): `host_us` is the CPU time of one call, from a
perf_counter around 200 back-to-back calls after a synchronize, stopped *before* the final
`torch.cuda.synchronize` (Python, argument checks, dispatch and launches; no GPU wait);
`wall_us` is the same loop's time including the final synchronize, per call. When host_us
exceeds the do_bench GPU time, the eager call is host-bound.

torch is imported inside the functions that need a GPU; the round logic is pure.
"""
from __future__ import annotations

import statistics
import time


def interleaved_rounds(items, rounds, time_one):
    """{item: [ms of round 0, 1, ...]}: `time_one(item)` for every item in every round,
    the items in order in even rounds and in reverse order in odd ones, so that a clock
    that drifts during the run (the GPU warming, its power state moving) lands on every
    item alike instead of on whichever was timed last. An item whose `time_one` raises
    drops out of the later rounds; its exception is returned in place of its list."""
    times = {item: [] for item in items}
    live = list(items)
    for r in range(rounds):
        for item in (live if r % 2 == 0 else live[::-1]):
            try:
                times[item].append(time_one(item))
            except Exception as e:  # reported in the provider's cell, not fatal
                times[item] = e
        live = [item for item in live if not isinstance(times[item], Exception)]
    return times


def record_rounds(row, got, width=100):
    """Put interleaved_rounds' result for one provider into its row: its error as the
    status, or its median round as `ms` (and every round as `ms_rounds` when there were
    several). Returns the median, or None."""
    if isinstance(got, Exception):
        row["status"] = f"error: {type(got).__name__}: {str(got)[:width]}"
        return None
    if not got:
        return None
    ms = statistics.median(got)
    row["ms"] = round(ms, 4)
    if len(got) > 1:
        row["ms_rounds"] = [round(t, 4) for t in got]
    return ms


def host_time_us(call, calls=200):
    """(host_us, wall_us) per call over `calls` back-to-back calls: the CPU timer stops
    before the final synchronize (host_us) and after it (wall_us)."""
    import torch
    call()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        call()
    host = time.perf_counter() - start
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    return round(host / calls * 1e6, 2), round(wall / calls * 1e6, 2)


def timed_call(fn, q, k, v, case):
    """(the callable do_bench times, the tensors whose .grad it clears before each call):
    the forward, or the backward of one saved forward. Clearing the gradients matters:
    left alone, every backward after the first adds its dQ, dK, dV into the previous ones
    (three elementwise kernels, ~0.2 ms at B*N = 16k, H*d = 2048 on the H100), which a
    training step never does with activations' gradients and which took every provider's
    backward 5-20% slower than its kernels, pulling their ratios towards 1."""
    import torch
    if case.mode == "fwd":  # (fn.timed: the forward without the check's conversions, fp8.py)
        fwd = getattr(fn, "timed", fn)
        return (lambda: fwd(q, k, v, case.causal, case.p)), None
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, case.causal, case.p)
    do = torch.randn_like(out)
    return (lambda: out.backward(do, retain_graph=True)), [q, k, v]
