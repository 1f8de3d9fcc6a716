"""Stage 5b, compile ahead: build the kernels of a batch of tuning trials in parallel.

A trial's time on the H100 is mostly Triton compiling its kernels, not the GPU timing
them: a Gluon forward takes ~8 s of one CPU core per shape (ptxas included) and a trial
compiles two (the check's small shape and the timed one), against well under a second of
GPU work. `flashgen tune` therefore asks the sampler for a batch of trials, has a pool of
worker processes run each trial's two calls once (which compiles them into Triton's
on-disk cache), and only then checks and times them one by one in the tuning process,
where every launch finds its binary in the cache. The workers' runs are not timed and
their results are not used: a config that fails in a worker fails again, with the real
message, when the tuner measures it. Nothing is timed while the workers compile, so their
load does not touch a measurement.

The workers are spawned processes (CUDA cannot be forked), one CUDA context each; each
imports the package the tuner built (from the same folder, so the kernels' sources and
hence Triton's cache keys are the tuner's) and keeps one measure at a time.
"""
from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import sys
import time
from pathlib import Path
from typing import Mapping, Sequence

# what one worker keeps between tasks: the package and the measure of the last
# (variant, bucket) it compiled for
_STATE: dict = {}


def default_workers() -> int:
    """Half the machine's cores, at most 8: ptxas is single-threaded, and the tuning
    process and the GPU's driver threads need cores of their own."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def _init(folder: str, package: str, spec_path: str, device_index: int) -> None:
    import importlib

    import torch

    from .spec import load_spec

    os.environ.pop("TRITON_INTERPRET", None)
    sys.path.insert(0, folder)
    _STATE.update(pkg=importlib.import_module(package), spec=load_spec(spec_path),
                  device=torch.device("cuda", device_index))


def _compile(variant: str, bucket: int, config: dict) -> str | None:
    """Run `config`'s calls once (Workload.compile_once); None, or why it failed (the
    tuner will see the same failure when it measures the config, and record it)."""
    from .measure import gpu_measure

    if _STATE.get("key") != (variant, bucket):
        old = _STATE.pop("measure", None)
        if old is not None:
            old.close()
        _STATE.update(key=(variant, bucket), measure=gpu_measure(
            _STATE["pkg"], variant, bucket, _STATE["device"], spec=_STATE["spec"]))
    try:
        _STATE["measure"].compile_once(config)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:200]}"
    return None


class CompileAhead:
    """A pool of `workers` processes that compile trials' kernels ahead of their
    measurement (see the module docstring), for the package built in `folder` from the
    spec at `spec_path`. `preparer(variant, bucket)` gives a study's `prepare(configs)`,
    which returns when every config has been compiled (or failed, or `timeout` seconds
    passed)."""

    def __init__(self, folder: Path, package: str, spec_path, *, workers: int,
                 device_index: int = 0, timeout: float = 600.0):
        self.timeout = timeout
        self.workers = workers
        self.seconds = 0.0   # spent waiting for the workers, all batches
        self._pool = concurrent.futures.ProcessPoolExecutor(
            max_workers=workers, mp_context=multiprocessing.get_context("spawn"),
            initializer=_init, initargs=(str(folder), package, str(spec_path), device_index))

    def preparer(self, variant: str, bucket: int):
        def prepare(configs: Sequence[Mapping]) -> list[str | None]:
            t0 = time.monotonic()
            futures = [self._pool.submit(_compile, variant, int(bucket), dict(c))
                       for c in configs]
            done, _ = concurrent.futures.wait(futures, timeout=self.timeout)
            self.seconds += time.monotonic() - t0
            return [f.result() if f in done and f.exception() is None
                    else f"not compiled ahead: {f.exception() if f in done else 'timeout'}"
                    for f in futures]
        return prepare

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
