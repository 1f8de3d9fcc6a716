"""`flashgen selftest --sanitize`: NVIDIA compute-sanitizer over the sanitize case set.

Each tool runs `python -m flashgen.selftest.cases --set sanitize --device cuda` (a
representative set of both kernel families at odd shapes, cases.SANITIZE_CASES) once:

* memcheck: out-of-bounds and misaligned global/shared accesses. Run with
  PYTORCH_NO_CUDA_MEMORY_CACHING=1: torch's caching allocator carves tensors out of large
  cudaMalloc segments, and memcheck knows only cudaMalloc's bounds, so a read past a
  tensor's end that lands in the same segment would go unseen. Without the cache every
  tensor is its own allocation, and `--padding` puts a guard after each one (an access just
  past it is out of bounds even when another allocation follows). API errors are not
  reported (`--report-api-errors no`): torch checks every CUDA call it makes and a failing
  one fails the case, while the driver-internal errors the default mode adds are noise.
* racecheck: shared-memory hazards. This is the point for the warp-specialised Gluon
  kernels: a missing mbarrier wait between the producer's TMA copy into a ring slot and the
  consumers' reads (or their release and the next copy) is a silent wrong answer on some
  runs only. `--racecheck-report analysis` (the default, said explicitly): one report per
  pair of racing source locations with its hazard count; `hazard` prints one report per
  byte of shared memory, thousands of lines for one missing wait. Its ERROR level fails
  the run; WARNING (warp-synchronous code without a __syncwarp, which racecheck itself
  calls possibly intended) is listed and does not. The torch allocator's cache stays on:
  racecheck reads shared memory only. racecheck does not model how Gluon's partitions
  order shared memory (mbarriers, Triton's partition start-up) and reports both on a
  race-free control kernel; a run with errors is followed by that control under racecheck,
  and passes when every report is of a kind the control shows (explain_races,
  selftest/racecheck.py).
* synccheck: barrier misuse (divergent barriers, wgmma sequences on sm_90a) -- "where it
  runs": a toolkit or GPU that says it does not support it is recorded, not a failure.

A tool's verdict is conjunctive: its summary line must be there (a run killed or crashed
before it is not clean), with no errors, and the cases themselves must pass under the tool
(memcheck terminates a kernel at its first bad access, so its case fails too). A racecheck
or synccheck that reports it tracked more mbarriers than it had room for says its results
"might be incorrect": inconclusive, a failure, with the fix (--sanitizer-args=
"--num-cuda-barriers N"). The first REPORT_LINES lines of the tool's own output go into the
summary; the whole log stays under <out>/sanitize/.

`--target-processes application-only`: the cases run in one process; Triton's ptxas
children need no instrumentation. `--launch-timeout 120`: importing torch and building the
selftest packages before the first CUDA call can take longer than the default 10 s.
"""
from __future__ import annotations

import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import FlashgenError

TOOLS = ("memcheck", "racecheck", "synccheck")
OPTIONAL = ("synccheck",)       # "where it runs"
DEFAULT_TIMEOUT = 540           # one tool's seconds at most (the device's 10-minute calls)
REPORT_LINES = 50
PREFIX = "========="
ERROR_EXITCODE = 99
PADDING = 256                   # bytes of guard after every allocation (memcheck)
CASES = ["-m", "flashgen.selftest.cases", "--set", "sanitize", "--device", "cuda"]

_ERROR_SUMMARY = re.compile(r"ERROR SUMMARY:\s*(\d+) errors?")
_RACE_SUMMARY = re.compile(
    r"RACECHECK SUMMARY:\s*(\d+) hazards? displayed\s*\((\d+) errors?,\s*(\d+) warnings?\)")
_UNSUPPORTED = re.compile(r"(?i)\b(not supported|unsupported)\b")
_OVERFLOW = re.compile(r"(?i)overflow of tracked cuda::barrier")
_APP_ERROR = "Target application returned an error"


@dataclass
class SanitizeResult:
    tool: str
    # ok | failed | inconclusive | unsupported | timeout | error | not run
    status: str
    errors: int | None = None
    warnings: int | None = None
    returncode: int | None = None
    seconds: float = 0.0
    command: str = ""
    log: str | None = None
    note: str = ""
    report: list[str] = field(default_factory=list)   # the tool's first lines
    app_tail: str = ""          # the cases' last lines when they failed

    @property
    def bad(self) -> bool:
        if self.status == "ok":
            return False
        return not (self.status == "unsupported" and self.tool in OPTIONAL)


def parse_tools(spec: str | None) -> list[str]:
    if spec is None:
        return list(TOOLS)
    tools = [t.strip() for t in spec.split(",") if t.strip()]
    unknown = [t for t in tools if t not in TOOLS]
    if unknown or not tools:
        raise FlashgenError(f"--sanitize-tools {spec!r}: the tools are "
                            f"{', '.join(TOOLS)} (comma-separated)")
    return [t for t in TOOLS if t in tools]


def _candidates() -> list[Path]:
    found = []
    which = shutil.which("compute-sanitizer")
    if which:
        found.append(Path(which))
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            found.append(Path(os.environ[var]) / "bin" / "compute-sanitizer")
    found.append(Path("/usr/local/cuda/bin/compute-sanitizer"))

    def version(path: str):
        nums = re.findall(r"\d+", Path(path).parent.parent.name)
        return tuple(int(n) for n in nums)
    found += [Path(p) for p in sorted(glob.glob("/usr/local/cuda-*/bin/compute-sanitizer"),
                                      key=version, reverse=True)]
    # the pip wheel (nvidia-cuda-sanitizer-api-cu12) puts it inside site-packages
    for entry in sys.path:
        found.append(Path(entry or ".") / "nvidia" / "cuda_sanitizer_api" /
                     "compute-sanitizer" / "compute-sanitizer")
    return found


def find_sanitizer(explicit: str | None = None) -> Path:
    if explicit:
        path = Path(explicit)
        if path.is_file() and os.access(path, os.X_OK):
            return path
        raise FlashgenError(f"--sanitizer {explicit}: not an executable file; pass the "
                            "path of compute-sanitizer (e.g. /usr/local/cuda/bin/"
                            "compute-sanitizer)")
    for path in _candidates():
        if path.is_file() and os.access(path, os.X_OK):
            return path
    raise FlashgenError("compute-sanitizer not found: looked on PATH, in $CUDA_HOME/bin, "
                        "/usr/local/cuda/bin, /usr/local/cuda-*/bin and site-packages' "
                        "nvidia/cuda_sanitizer_api; install the CUDA toolkit's "
                        "compute-sanitizer (or pip install nvidia-cuda-sanitizer-api-cu12) "
                        "or pass --sanitizer PATH")


def command(tool: str, sanitizer: str | Path, extra: list[str] | None = None,
            python: str | None = None) -> list[str]:
    argv = [str(sanitizer), "--tool", tool, "--error-exitcode", str(ERROR_EXITCODE),
            "--target-processes", "application-only", "--launch-timeout", "120"]
    if tool == "memcheck":
        argv += ["--padding", str(PADDING), "--report-api-errors", "no"]
    elif tool == "racecheck":
        argv += ["--racecheck-report", "analysis"]
    return argv + list(extra or []) + [python or sys.executable, *CASES]


def tool_env(tool: str, gpu_id: str | None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)   # the cases run on the GPU, never the interpreter
    if gpu_id is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu_id    # one GPU: the cases use cuda:0
    if tool == "memcheck":
        env["PYTORCH_NO_CUDA_MEMORY_CACHING"] = "1"
    return env


def parse_report(tool: str, text: str, returncode: int | None) -> SanitizeResult:
    """The verdict on one tool's output (its lines start with PREFIX, the cases' do not)."""
    lines = text.splitlines()
    mine = [ln for ln in lines if ln.startswith(PREFIX)]
    app = [ln for ln in lines if not ln.startswith(PREFIX)]
    res = SanitizeResult(tool, "ok", returncode=returncode,
                         report=[ln for ln in mine if "COMPUTE-SANITIZER" not in ln]
                         [:REPORT_LINES])
    race = list(_RACE_SUMMARY.finditer(text))
    errs = list(_ERROR_SUMMARY.finditer(text))
    if race:
        res.errors = sum(int(m.group(2)) for m in race)
        res.warnings = sum(int(m.group(3)) for m in race)
    elif errs:
        res.errors = sum(int(m.group(1)) for m in errs)
    unsupported = [ln for ln in mine if _UNSUPPORTED.search(ln)
                   and "Program hit" not in ln and "API" not in ln]
    app_failed = (returncode not in (0, ERROR_EXITCODE, None)
                  or any(_APP_ERROR in ln for ln in mine))
    if app_failed:
        res.app_tail = "\n".join(ln for ln in app if ln.strip())[-1500:]

    if unsupported and not res.errors:
        res.status = "unsupported"
        res.note = unsupported[0][len(PREFIX):].strip()
    elif res.errors is None:
        res.status = "error"
        res.note = (f"no {'RACECHECK' if tool == 'racecheck' else 'ERROR'} SUMMARY line: the "
                    f"tool did not finish (exit {returncode})")
    elif res.errors:
        res.status = "failed"
        res.note = f"{res.errors} error{'s' if res.errors != 1 else ''}"
    elif any(_OVERFLOW.search(ln) for ln in mine):
        res.status = "inconclusive"
        res.note = ("the tool tracked fewer mbarriers than the kernels use: its results "
                    "\"might be incorrect\"; run again with --sanitizer-args="
                    "\"--num-cuda-barriers 64\"")
    elif app_failed:
        res.status = "failed"
        res.note = f"the cases failed under {tool} (exit {returncode}): see their last lines"
    elif returncode == ERROR_EXITCODE and not res.warnings:
        res.status = "failed"
        res.note = (f"exit {ERROR_EXITCODE} (--error-exitcode: errors found) although the "
                    "summary counts none: read the log")
    if res.warnings:
        extra = f"{res.warnings} warning{'s' if res.warnings != 1 else ''} (listed, not failures)"
        res.note = f"{res.note}; {extra}" if res.note else extra
    return res


CONTROL = ["-m", "flashgen.selftest.control", "handover"]
CONTROL_TIMEOUT = 240


def explain_races(res: SanitizeResult, text: str, sanitizer, extra, root: Path, folder: Path,
                  gpu_id: str | None) -> None:
    """Run the race-free control kernel (selftest/control.py) under racecheck and sort
    the cases' reports by the kinds it shows (selftest/racecheck.py): a run whose every
    report is of such a kind passes, with the counts in its note."""
    from . import racecheck
    from .package import cache_dir

    argv = [a for a in command("racecheck", sanitizer, extra)[:-len(CASES)]] + CONTROL
    log_path = folder / "racecheck-control.log"
    try:
        proc = subprocess.run(argv, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env=tool_env("racecheck", gpu_id), timeout=CONTROL_TIMEOUT,
                              text=True, errors="replace")
        control_text, rc = proc.stdout, proc.returncode
    except subprocess.TimeoutExpired as e:
        control_text, rc = (e.stdout or ""), None
    log_path.write_text(f"$ {shlex.join(argv)}\n\n{control_text}", encoding="utf-8")
    if "handover: right" not in control_text:
        res.note += f"; the control kernel did not run right under racecheck (exit {rc}): " \
                    f"{log_path}"
        return
    found = racecheck.triage(text, control_text, [cache_dir()],
                              [Path(__file__).with_name("control.py")])
    res.note = found.note()
    if not found.unexplained:
        res.status = "ok"
    else:
        res.report = found.unexplained[:REPORT_LINES] + ["(every report: " + str(res.log) + ")"]


def run_tools(tools: list[str], sanitizer: Path, root: Path, folder: Path,
              gpu_id: str | None, deadline: float | None, timeout: int | None = None,
              extra: list[str] | None = None, echo=None) -> list[SanitizeResult]:
    from .runner import kill_group

    echo = echo or (lambda line: print(line, file=sys.stderr, flush=True))
    folder.mkdir(parents=True, exist_ok=True)
    results = []
    for tool in tools:
        argv = command(tool, sanitizer, extra)
        shown = shlex.join(["compute-sanitizer" if a == str(sanitizer) else
                            "python" if a == sys.executable else a for a in argv])
        limit = timeout or DEFAULT_TIMEOUT
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left < 30:
            why = f"not started: {left:.0f} s left of the run's --budget"
            results.append(SanitizeResult(tool, "not run", command=shown, note=why +
                                          f"; run it alone: flashgen selftest --sanitize "
                                          f"--sanitize-tools {tool}"))
            continue
        cap = left is not None and left < limit
        limit = min(limit, left) if left is not None else limit
        log_path = folder / f"{tool}.log"
        echo(f"selftest: compute-sanitizer {tool} started")
        start = time.monotonic()
        with open(log_path, "w", encoding="utf-8") as log:
            log.write(f"$ {shown}\n(in {root})\n\n")
            log.flush()
            proc = subprocess.Popen(argv, cwd=root, stdout=log, stderr=subprocess.STDOUT,
                                    env=tool_env(tool, gpu_id), start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
                killed = False
            except subprocess.TimeoutExpired:
                kill_group(proc)
                rc, killed = proc.returncode, True
            except BaseException:   # Ctrl-C: its own session would keep it running
                kill_group(proc)
                raise
        seconds = time.monotonic() - start
        text = log_path.read_text(encoding="utf-8", errors="replace")
        res = parse_report(tool, text.split("\n\n", 1)[-1], rc)   # (after our header)
        if killed:
            res.status = "timeout"
            res.note = (f"stopped at the run's --budget after {seconds:.0f} s" if cap else
                        f"timed out after {limit:.0f} s (--timeout)")
        res.seconds, res.command, res.log = round(seconds, 1), shown, str(log_path)
        if (tool == "racecheck" and res.status == "failed" and res.errors and not killed
                and not res.app_tail):
            explain_races(res, text, sanitizer, extra, root, folder, gpu_id)
        echo(f"selftest: compute-sanitizer {tool} {res.status}"
             + (f": {res.note}" if res.note else ""))
        results.append(res)
    return results
