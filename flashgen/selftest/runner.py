"""Run the shards' pytest processes and read back what happened.

One shard part is one `python -m pytest` process (a Job) in the checkout's root, with
xdist workers pinned to the GPUs (pytest_plugin.py), a JUnit XML file and a log under the
output folder. Jobs run a few at a time (shards.workers), longest estimate first, within
the run's deadline (--budget): a job starts only when its estimate fits the time left, and
is killed at its timeout or at the deadline, whichever comes first. The JUnit XML is the
result; when a job is killed or crashes before writing it, the progress lines the plugin
wrote say what had finished and what was still running.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

from .pytest_plugin import GPUS_ENV, PROGRESS_ENV
from .shards import Shard

SINGLE = "1 GPU"
MULTI = "2+ GPUs"
SINGLE_MARKER = "gpu and not multigpu"
MULTI_MARKER = "gpu and multigpu"
MESSAGE_LINES = 15      # the tail of a failure's message kept in the summary
MESSAGE_CHARS = 1500


@dataclass
class Failure:
    nodeid: str | None      # None: the shard itself failed (a timeout, a crash)
    reproducer: str         # a command that runs it again
    message: str


@dataclass
class PartResult:
    shard: str
    part: str               # SINGLE or MULTI
    status: str             # ok | failed | timeout | error | skipped | not run
    passed: int = 0
    failed: int = 0
    errors: int = 0
    skipped: int = 0
    seconds: float = 0.0
    workers: int = 0
    timeout_s: int = 0
    files: list[str] = field(default_factory=list)
    command: str = ""
    log: str | None = None
    note: str = ""
    failures: list[Failure] = field(default_factory=list)

    @property
    def bad(self) -> bool:
        """Whether this part makes the run fail (a skip for want of GPUs does not)."""
        return self.status not in ("ok", "skipped")


@dataclass
class Job:
    shard: Shard
    part: str
    files: tuple[str, ...]
    marker: str
    workers: int            # xdist workers; 0 runs without xdist
    timeout_s: int
    est_s: int
    folder: Path            # <out>/shards

    @property
    def key(self) -> str:
        return self.shard.name if self.part == SINGLE else f"{self.shard.name}-multigpu"

    @property
    def junit(self) -> Path:
        return self.folder / f"{self.key}.xml"

    @property
    def log(self) -> Path:
        return self.folder / f"{self.key}.log"

    @property
    def progress(self) -> Path:
        return self.folder / f"{self.key}.progress"

    def argv(self, basetemp: Path | None = None) -> list[str]:
        argv = [sys.executable, "-m", "pytest", "-m", self.marker, *self.files,
                "-p", "flashgen.selftest.pytest_plugin", "-p", "no:cacheprovider",
                "--junitxml", str(self.junit), "-o", "junit_family=xunit1", "-q", "-rfE"]
        if self.workers:
            argv += ["-n", str(self.workers)]
        if basetemp is not None:
            argv += ["--basetemp", str(basetemp)]
        return argv

    def display(self) -> str:
        """The command as a person would type it here (paths relative to this directory;
        the process itself gets absolute ones, since it runs in the checkout's root)."""
        def short(arg: str) -> str:
            if os.path.isabs(arg) and arg.startswith(str(self.folder)):
                rel = os.path.relpath(arg)
                return arg if rel.startswith("..") else rel
            return arg
        return shlex.join(["python", *map(short, self.argv()[1:])])


def xdist_available() -> bool:
    return importlib.util.find_spec("xdist") is not None


def plan_jobs(shards: list[Shard], folder: Path, per_shard: int,
              timeout: int | None = None) -> tuple[list[Job], list[Job]]:
    """(single-GPU jobs, multi-GPU jobs) for the chosen shards. The multi-GPU jobs are
    planned whatever the GPU count; the caller skips them on fewer than 2 GPUs."""
    xdist = xdist_available()
    folder = Path(folder).resolve()     # the pytest processes run in the checkout's root
    single, multi = [], []
    for s in shards:
        if s.files:
            w = min(per_shard, s.max_workers or per_shard) if xdist else 0
            single.append(Job(s, SINGLE, s.files, SINGLE_MARKER, w,
                              timeout or s.timeout_s(), s.est_s, folder))
        if s.multigpu_files:
            multi.append(Job(s, MULTI, s.multigpu_files, MULTI_MARKER, 0,
                             timeout or s.multigpu_timeout_s(), s.multigpu_est_s, folder))
    return single, multi


def reproducer(nodeid: str, marker: str = "gpu") -> str:
    return shlex.join(["python", "-m", "pytest", "-m", marker, nodeid])


# ---------------------------------------------------------------------------------------
# JUnit XML
# ---------------------------------------------------------------------------------------

def _nodeid(case: ET.Element) -> str:
    """pytest's node id from a <testcase> (xunit1: `file` is the path; classname is the
    dotted module, then any classes)."""
    name = case.get("name", "")
    classname = case.get("classname", "")
    file = case.get("file")
    if file:
        module = file[:-3].replace("/", ".") if file.endswith(".py") else file
        classes = classname[len(module) + 1:].split(".") if classname.startswith(module + ".") \
            else []
        return "::".join([file, *classes, name])
    if not classname:      # a collection error: the name is the dotted module
        return name.replace(".", "/") + ".py"
    return classname.replace(".", "/") + ".py::" + name


def _tail(text: str) -> str:
    lines = [ln for ln in (text or "").splitlines() if ln.strip()]
    out = "\n".join(lines[-MESSAGE_LINES:])
    return out[-MESSAGE_CHARS:]


def parse_junit(path: Path, marker: str = "gpu") -> tuple[dict[str, int], list[Failure]]:
    """Counts (passed, failed, errors, skipped) and the failures with their reproducers."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        failure, error = case.find("failure"), case.find("error")
        bad = failure if failure is not None else error
        if bad is not None:
            counts["failed" if failure is not None else "errors"] += 1
            nodeid = _nodeid(case)
            text = bad.text or ""
            message = _tail(text) or bad.get("message", "")
            failures.append(Failure(nodeid, reproducer(nodeid, marker), message))
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return counts, sorted(failures, key=lambda f: f.nodeid or "")


# ---------------------------------------------------------------------------------------
# the progress lines (pytest_plugin.py)
# ---------------------------------------------------------------------------------------

def read_progress(folder: Path) -> tuple[dict[str, int], list[tuple[str, str, float]]]:
    """Counts of the tests that finished, and (worker, nodeid, start time) of those that
    started and did not finish."""
    counts = {"passed": 0, "failed": 0, "errors": 0, "skipped": 0}
    running = []
    for path in sorted(Path(folder).glob("*.jsonl")):
        started, outcome = {}, {}
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue    # a line cut by the kill
            node = rec.get("nodeid")
            if rec.get("event") == "start":
                started[node] = rec.get("t", 0.0)
            elif rec.get("event") == "report":
                if rec.get("outcome") == "failed":
                    # a failing call is a failure; a failing setup or teardown an error
                    if rec.get("when") == "call":
                        outcome[node] = "failed"
                    elif outcome.get(node) != "failed":
                        outcome[node] = "errors"
                elif rec.get("outcome") == "skipped":
                    outcome.setdefault(node, "skipped")
                elif rec.get("when") == "call":
                    outcome.setdefault(node, "passed")
            elif rec.get("event") == "finish":
                counts[outcome.get(node, "passed")] += 1
                started.pop(node, None)
        running += [(path.stem, node, t) for node, t in started.items()]
    return counts, running


# ---------------------------------------------------------------------------------------
# running
# ---------------------------------------------------------------------------------------

def job_env(job: Job, gpu_ids: list[str]) -> dict[str, str]:
    env = dict(os.environ)
    # the GPU suite must not run in Triton's interpreter (the tests turn it on themselves
    # when there is no GPU; an exported TRITON_INTERPRET=1 would send CUDA tensors to it)
    env.pop("TRITON_INTERPRET", None)
    # a selftest started from inside a test process must not pass its xdist identity on
    for name in ("PYTEST_XDIST_WORKER", "PYTEST_XDIST_WORKER_COUNT", "PYTEST_XDIST_TESTRUNUID",
                 "PYTEST_CURRENT_TEST"):
        env.pop(name, None)
    env[PROGRESS_ENV] = str(job.progress)
    if job.part == SINGLE and job.workers:
        env[GPUS_ENV] = ",".join(gpu_ids)
    else:
        env.pop(GPUS_ENV, None)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """The job's whole process group (pytest, its xdist workers, their compilers)."""
    for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _result(job: Job, rc: int | None, seconds: float, killed: str | None,
            limit: float) -> PartResult:
    res = PartResult(job.shard.name, job.part, "ok", seconds=round(seconds, 1),
                     workers=job.workers, timeout_s=job.timeout_s, files=list(job.files),
                     command=job.display(), log=str(job.log))
    rerun = f"flashgen selftest --only {job.shard.name}"
    if killed is None and job.junit.is_file():
        try:
            counts, failures = parse_junit(job.junit)
        except ET.ParseError as e:
            counts, failures = None, [Failure(None, rerun, f"unreadable {job.junit}: {e}")]
        if counts is not None:
            for k, v in counts.items():
                setattr(res, k, v)
        res.failures = failures
        if rc == 5:
            res.note = "no tests selected"
        elif rc not in (0, 1) or counts is None:
            res.status = "error"
            res.failures.append(Failure(None, rerun, f"pytest exited {rc}:\n{_log_tail(job)}"))
        elif failures:
            res.status = "failed"
        return res

    counts, running = read_progress(job.progress)
    for k, v in counts.items():
        setattr(res, k, v)
    now = time.time()
    doing = ", ".join(f"{node} ({worker}, {now - t:.0f} s)" for worker, node, t in running) \
        or "no test (it was starting up or collecting)"
    if killed is not None:
        res.status = "timeout"
        what = (f"stopped at the run's --budget after {seconds:.0f} s (its own timeout is "
                f"{job.timeout_s} s)" if killed == "budget" else
                f"timed out after {limit:.0f} s (--timeout)")
        res.note = what
        res.failures.append(Failure(None, rerun, f"shard {job.shard.name} ({job.part}) {what}; "
                                                 f"it was running: {doing}"))
        res.failures += [Failure(node, reproducer(node), f"still running at the kill ({worker})")
                         for worker, node, _ in running]
    else:
        res.status = "error"
        res.failures.append(Failure(None, rerun, f"pytest exited {rc} without a JUnit "
                                                 f"report; it was running: {doing}\n"
                                                 f"{_log_tail(job)}"))
    return res


def _log_tail(job: Job) -> str:
    try:
        return _tail(job.log.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return ""


def not_run(job: Job, why: str) -> PartResult:
    return PartResult(job.shard.name, job.part, "not run", workers=job.workers,
                      timeout_s=job.timeout_s, files=list(job.files), command=job.display(),
                      note=why, failures=[Failure(None, f"flashgen selftest --only "
                                                        f"{job.shard.name}", why)])


def skipped(job: Job, why: str) -> PartResult:
    return PartResult(job.shard.name, job.part, "skipped", workers=job.workers,
                      timeout_s=job.timeout_s, files=list(job.files), command=job.display(),
                      note=why)


def run_jobs(jobs: list[Job], root: Path, gpu_ids: list[str], at_once: int,
             deadline: float | None, basetemp: Path, echo=None, poll: float = 0.5,
             heartbeat: float = 60.0) -> list[PartResult]:
    """Run the jobs, at most `at_once` at a time, longest estimate first; results in the
    jobs' order. `deadline` is a time.monotonic() value (None: no deadline)."""
    echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    queue = sorted(jobs, key=lambda j: -j.est_s)
    running: list[tuple[Job, subprocess.Popen, float, float, str | None, object]] = []
    results: dict[str, PartResult] = {}
    last_beat = time.monotonic()
    try:
        _schedule(queue, running, results, root, gpu_ids, at_once, deadline, basetemp, echo,
                  poll, heartbeat, last_beat)
    except BaseException:
        # Ctrl-C or a bug: the jobs run in sessions of their own, so nothing else would stop
        # them (and they hold the GPU)
        for _, proc, *_rest, log in running:
            kill_group(proc)
            log.close()
        raise
    return [results[j.key] for j in jobs]


def _schedule(queue, running, results, root, gpu_ids, at_once, deadline, basetemp, echo,
              poll, heartbeat, last_beat) -> None:
    while queue or running:
        now = time.monotonic()
        left = float("inf") if deadline is None else deadline - now
        while len(running) < at_once:
            job = next((j for j in queue if j.est_s <= left), None)
            if job is None:
                break
            queue.remove(job)
            job.folder.mkdir(parents=True, exist_ok=True)
            basetemp.mkdir(parents=True, exist_ok=True)   # (pytest makes only the last level)
            for stale in (job.junit, job.log):
                stale.unlink(missing_ok=True)
            if job.progress.exists():
                for f in job.progress.glob("*"):
                    f.unlink()
            # the budget caps a job's time only when it is the tighter limit
            limit, cap = (job.timeout_s, None) if job.timeout_s <= left else (left, "budget")
            log = open(job.log, "w", encoding="utf-8")
            log.write(f"$ {job.display()}\n(in {root})\n\n")
            log.flush()
            proc = subprocess.Popen(job.argv(basetemp / job.key), cwd=root, stdout=log,
                                    stderr=subprocess.STDOUT, env=job_env(job, gpu_ids),
                                    start_new_session=True)
            workers = f"{job.workers} workers" if job.workers else "no xdist"
            echo(f"selftest: {job.shard.name} ({job.part}, {workers}) started")
            running.append((job, proc, now, limit, cap, log))
        if not running:
            why = (f"not started: its estimate ({{}} s) did not fit the {max(left, 0):.0f} s "
                   "left of the run's --budget")
            for job in queue:
                results[job.key] = not_run(job, why.format(job.est_s))
            break
        time.sleep(poll)
        now = time.monotonic()
        still = []
        for job, proc, start, limit, cap, log in running:
            rc = proc.poll()
            killed = None
            if rc is None and now - start > limit:
                kill_group(proc)
                rc, killed = proc.returncode, cap or "timeout"
            if rc is None:
                still.append((job, proc, start, limit, cap, log))
                continue
            log.close()
            res = _result(job, rc, time.monotonic() - start, killed, limit)
            results[job.key] = res
            echo(f"selftest: {job.shard.name} ({job.part}) {res.status}: {res.passed} passed, "
                 f"{res.failed} failed, {res.errors} errors, {res.skipped} skipped in "
                 f"{res.seconds:.0f} s")
        running[:] = still
        if running and now - last_beat >= heartbeat:
            last_beat = now
            echo("selftest: running " + ", ".join(
                f"{j.shard.name} ({now - s:.0f} s)" for j, _, s, _, _, _ in running))
