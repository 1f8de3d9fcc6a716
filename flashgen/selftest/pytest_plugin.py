"""A pytest plugin for `flashgen selftest`'s shards (`-p flashgen.selftest.pytest_plugin`).

1. GPU pinning. The tests use device "cuda", i.e. cuda:0 of what the process sees, so on a
   machine with several GPUs every xdist worker would share the first one. With
   FLASHGEN_SELFTEST_GPUS="0,1" (the visible GPUs' ids), worker gwN sees only GPU
   ids[N % len(ids)] through CUDA_VISIBLE_DEVICES. pytest imports a `-p` plugin before any
   conftest (tests/conftest.py asks torch.cuda.is_available() at import, which reads
   CUDA_VISIBLE_DEVICES once for the process), and xdist sets PYTEST_XDIST_WORKER before
   either, so the pin is in place before CUDA starts.
2. Progress. With FLASHGEN_SELFTEST_PROGRESS=DIR every test process appends JSON lines to
   DIR/<worker>.jsonl as tests start and finish. xdist writes the JUnit XML only at the end,
   so when a shard has to be killed (its timeout) these lines are what says which tests it
   was running and what had passed.

Only the standard library here: this module is imported into every test process first.
"""
from __future__ import annotations

import json
import os
import time

GPUS_ENV = "FLASHGEN_SELFTEST_GPUS"
PROGRESS_ENV = "FLASHGEN_SELFTEST_PROGRESS"


def _pin() -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    ids = [g for g in os.environ.get(GPUS_ENV, "").split(",") if g.strip()]
    if not worker.startswith("gw") or not ids:
        return
    try:
        index = int(worker[2:])
    except ValueError:
        return
    os.environ["CUDA_VISIBLE_DEVICES"] = ids[index % len(ids)].strip()


_pin()  # at import: before conftest, before torch


class _Progress:
    def __init__(self, path: str):
        self.path = path

    def write(self, **record) -> None:
        record["t"] = time.time()
        # one line, appended and closed at once: a killed process leaves whole lines
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def pytest_runtest_logstart(self, nodeid, location):
        self.write(event="start", nodeid=nodeid)

    def pytest_runtest_logreport(self, report):
        self.write(event="report", nodeid=report.nodeid, when=report.when,
                   outcome=report.outcome)

    def pytest_runtest_logfinish(self, nodeid, location):
        self.write(event="finish", nodeid=nodeid)


def pytest_configure(config):
    folder = os.environ.get(PROGRESS_ENV)
    if not folder:
        return
    # under xdist the controller sees every report again: only the processes that run
    # tests write (a worker, or a run without -n)
    worker = getattr(config, "workerinput", None)
    if worker is None and getattr(config.option, "numprocesses", None):
        return
    name = worker["workerid"] if worker is not None else "main"
    os.makedirs(folder, exist_ok=True)
    config.pluginmanager.register(_Progress(os.path.join(folder, f"{name}.jsonl")),
                                  "flashgen-selftest-progress")
