"""Running self-test cases in this process or in worker processes (flashgen.selftest.fuzz
uses it): results always come back in case order.

Worker processes are spawned (a CUDA context does not survive a fork); the cases that
launch the same kernels are dealt to one worker, so each kernel compiles once, and on a
machine with several GPUs the workers take them in turn. A worker reports each case's
start and result on a queue; one that dies, or runs a case past `case_timeout`, fails that
case, and a new worker takes the rest of its cases. A case that loses the CUDA context (an
illegal address) ends its worker the same way, so the cases after it run in a fresh one;
in this process they are skipped, with the reason.
"""
from __future__ import annotations

import collections
import multiprocessing
import queue as queue_module
import time

from .cases import Case, CaseResult, run_case


def _context_lost(device: str) -> bool:
    """Whether a CUDA error left this process's context unusable (an illegal address:
    every later call fails the same way)."""
    if not str(device).startswith("cuda"):
        return False
    import torch

    try:
        torch.cuda.synchronize(device)
        return False
    except RuntimeError:
        return True


LOST = "the CUDA context was lost in an earlier case"
EXIT_CONTEXT_LOST = 3


def run_here(cases, device, ref_device, progress, on_start=None,
              stop_when_lost: bool = False) -> list[CaseResult]:
    """Run `cases` in this process. After a case that loses the CUDA context the rest are
    skipped (or, `stop_when_lost`, not run at all: a worker's parent restarts them)."""
    from .package import selftest_packages

    packages = selftest_packages(device, sorted({c.package for c in cases}))
    results: list[CaseResult] = []
    lost = ""
    for i, case in enumerate(cases):
        if lost:
            if stop_when_lost:
                break
            result = CaseResult(case, False, skipped=lost)
        else:
            if on_start is not None:
                on_start(i)
            result = run_case(case, packages, device, ref_device)
            if result.failed and _context_lost(device):
                lost = f"{LOST} ({result.message[:160]})"
        results.append(result)
        if progress is not None:
            progress(len(results), len(cases), result)
    return results


def deal(cases: list[Case], workers: int) -> list[list[int]]:
    """Case indices per worker: the cases that launch the same kernels go to one worker
    (each compiles once), the groups spread evenly, each worker's cases in case order."""
    groups: dict[tuple, list[int]] = collections.defaultdict(list)
    for i, c in enumerate(cases):
        band = "causal" if c.causal else "none"
        if tuple(c.window) != (-1, -1):
            band = "window"
        key = (c.package, c.kind in ("decode", "paged_decode", "mla_decode"), c.kind == "varlen",
               c.dtype, c.d, c.dv, band, c.dropout > 0, c.mods, c.family, c.tiles)
        groups[key].append(i)
    load = [0] * workers
    dealt: list[list[int]] = [[] for _ in range(workers)]
    for indices in sorted(groups.values(), key=len, reverse=True):
        w = load.index(min(load))
        dealt[w] += indices
        load[w] += len(indices)
    return [sorted(d) for d in dealt if d]


def _worker(wid: int, cases_json: list[str], indices: list[int], device: str, ref_device,
            out) -> None:
    """A worker process: runs its cases, reporting (wid, "start", i, None) and (wid,
    "done", i, result); exits EXIT_CONTEXT_LOST after a case that lost the CUDA context
    (its parent starts another worker for the rest)."""
    import sys

    cases = [Case.from_json(t) for t in cases_json]
    results = run_here(
        cases, device, ref_device,
        lambda done, total, result: out.put((wid, "done", indices[done - 1], result)),
        on_start=lambda i: out.put((wid, "start", indices[i], None)), stop_when_lost=True)
    if len(results) < len(cases):
        sys.exit(EXIT_CONTEXT_LOST)  # (sys.exit, not os._exit: the queue is flushed)


class _Workers:
    """The parent's side: one worker process per slot, each with its remaining cases; a
    worker that dies or runs a case past the timeout fails that case and is replaced by a
    new one for the rest of its cases."""

    def __init__(self, cases, device, ref_device, workers, progress, case_timeout):
        self.cases, self.ref_device, self.progress = cases, ref_device, progress
        self.timeout = case_timeout
        self.ctx = multiprocessing.get_context("spawn")
        self.out = self.ctx.Queue()
        self.devices = [str(device)]
        if str(device) == "cuda":
            import torch  # (counting GPUs makes no CUDA context)

            self.devices = [f"cuda:{i}" for i in range(max(1, torch.cuda.device_count()))]
        self.results: list[CaseResult | None] = [None] * len(cases)
        self.done = 0
        self.todo: dict[int, list[int]] = {}   # slot -> its cases not done yet
        # slot -> [process, wid, case in flight, since, whether it started a case]
        self.procs: dict[int, list] = {}
        self.wids = 0
        self.stillborn = 0  # workers that died before starting a case
        for slot, indices in enumerate(deal(cases, workers)):
            self.launch(slot, indices)

    def launch(self, slot: int, indices: list[int]) -> None:
        self.wids += 1
        p = self.ctx.Process(target=_worker, daemon=True, args=(
            self.wids, [self.cases[i].to_json() for i in indices], indices,
            self.devices[slot % len(self.devices)], self.ref_device, self.out))
        p.start()
        self.todo[slot] = list(indices)
        self.procs[slot] = [p, self.wids, None, time.monotonic(), False]

    def finish(self, i: int, result: CaseResult) -> None:
        if self.results[i] is None:
            self.results[i] = result
            self.done += 1
            if self.progress is not None:
                self.progress(self.done, len(self.cases), result)

    def handle(self, message) -> None:
        wid, kind, i, result = message
        slot = next((s for s, pr in self.procs.items() if pr[1] == wid), None)
        if slot is None or i not in self.todo[slot]:
            return  # from a worker already replaced
        if kind == "start":
            self.procs[slot][2:] = [i, time.monotonic(), True]
        else:
            self.todo[slot].remove(i)
            self.procs[slot][2:4] = [None, time.monotonic()]
            self.finish(i, result)

    def drain(self) -> None:
        while True:
            try:
                self.handle(self.out.get_nowait())
            except queue_module.Empty:
                return

    def reap(self) -> None:
        """Replace the workers that died or overran the timeout."""
        for slot, (p, _, flight, since, _) in list(self.procs.items()):
            over = (flight is not None and self.timeout is not None
                    and time.monotonic() - since > self.timeout)
            if p.is_alive() and not over:
                continue
            if over:
                p.kill()
            p.join()
            self.drain()  # what it reported before it went
            flight, started = self.procs[slot][2], self.procs[slot][4]
            if not over and not started and p.exitcode != EXIT_CONTEXT_LOST:
                # (a worker that cannot even start: the environment, not a case)
                self.stillborn += 1
                if self.stillborn >= 2:
                    self.stop()
                    raise RuntimeError(
                        f"selftest worker processes exit (code {p.exitcode}) before running "
                        "a case: see their output above (a script that calls fuzz with "
                        "workers > 1 needs the `if __name__ == \"__main__\":` guard, since "
                        "workers are spawned), or run with workers=1")
                del self.procs[slot]
                self.launch(slot, self.todo[slot])
                continue
            if over:
                why = f"timed out after {self.timeout:.0f} s (the worker was killed)"
            elif p.exitcode == EXIT_CONTEXT_LOST:
                why = None  # the failed case was reported; the rest run again
            else:
                why = f"the worker process died (exit code {p.exitcode})"
                if flight is None and self.todo[slot]:
                    flight = self.todo[slot][0]  # (died before reporting its start)
            if why is not None and flight is not None and flight in self.todo[slot]:
                self.todo[slot].remove(flight)
                self.finish(flight, CaseResult(self.cases[flight], False, message=why))
            del self.procs[slot]
            if self.todo[slot]:
                self.launch(slot, self.todo[slot])

    def stop(self) -> None:
        for p, *_ in self.procs.values():
            if p.is_alive():
                p.kill()
            p.join()
        self.procs.clear()

    def run(self) -> list[CaseResult]:
        while self.done < len(self.cases):
            try:
                self.handle(self.out.get(timeout=1.0))
                continue
            except queue_module.Empty:
                pass
            self.reap()
            if not self.procs:  # (every worker gone, yet results missing: never hang)
                for i, r in enumerate(self.results):
                    if r is None:
                        self.finish(i, CaseResult(self.cases[i], False,
                                                  message="no result came back from its worker"))
        return self.results


def run_workers(cases, device, ref_device, workers, progress, case_timeout):
    return _Workers(cases, device, ref_device, workers, progress, case_timeout).run()
