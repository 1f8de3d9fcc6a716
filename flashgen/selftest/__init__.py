"""`flashgen selftest`: the project's GPU checks on the machine at hand, in one summary.

* (default) the GPU test suite in named shards (shards.py; `--only a,b` re-runs some), each
  a pytest process with xdist workers pinned to the GPUs (runner.py), the multi-GPU tests
  on 2+ GPUs;
* `--sanitize`: compute-sanitizer memcheck, racecheck and synccheck over a representative
  case set of both kernel families (sanitize.py, cases.SANITIZE_CASES);
* `--fuzz N`: N seeded random cases against the float64 reference (fuzz.py), on the GPU or,
  without one, in Triton's interpreter; `--fuzz-case JSON` replays one failure;
* `--dry-run`: what would run, anywhere.

Every run writes selftest.txt and selftest.json under --out (summary.py). Exit status: 0
when everything asked for ran and passed, 1 when something failed or did not run, 2 for a
usage error (found before anything runs). The whole suite takes about 28 minutes of shard
time on one H100 (measured: 1335 s for the shards but the fuzz shard, from a cold compile
cache), about 14 minutes of wall time two shards at a time; `--part I/N` runs a balanced
Nth of it, so a machine that limits a command
to 10 minutes runs `--part 1/3`, `2/3` and `3/3`. `--budget S` bounds the shards and the
sanitizer tools: a shard whose estimate does not fit is listed with the command that runs
it.

This module imports only the standard library at the top: `python -m
flashgen.selftest.cases` (the sanitizer's target) imports this package first.
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

DEFAULT_BUDGET = 0  # no limit; --part splits a run that must fit a time limit
DEFAULT_OUT = "flashgen-selftest"
NO_GPU = ("no CUDA GPU on this machine: selftest runs the GPU suite; --fuzz N runs the "
          "fuzzer on the CPU")
NO_TESTS = ("no tests/ folder of a flashgen checkout in {cwd} or above it: the GPU test "
            "shards run from a checkout (cd into one, or pass --tests DIR); --fuzz N and "
            "--sanitize run from any install")


def _echo(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def visible_gpus() -> list[str]:
    """The ids of the GPUs this process sees, as CUDA_VISIBLE_DEVICES names them (so a
    worker pinned to one sees the same GPU); [] without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    n = torch.cuda.device_count()
    listed = [g.strip() for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
              if g.strip()][:n]
    return listed if len(listed) == n else [str(i) for i in range(n)]


def locate_tests(explicit: str | None = None, start: Path | None = None) -> Path | None:
    """--tests DIR, else the tests/ of the flashgen checkout at or above the current
    directory (a wheel install has none)."""
    from ..errors import FlashgenError

    if explicit:
        tests = Path(explicit).resolve()
        if not (tests / "conftest.py").is_file():
            raise FlashgenError(f"--tests {explicit}: not a folder with a conftest.py; pass "
                                "the tests/ folder of a flashgen checkout")
        return tests
    here = (start or Path.cwd()).resolve()
    for folder in (here, *here.parents):
        project = folder / "pyproject.toml"
        if (folder / "tests" / "conftest.py").is_file() and project.is_file() and \
                'name = "flashgen"' in project.read_text(encoding="utf-8", errors="replace"):
            return folder / "tests"
    return None


def _check_numbers(args) -> None:
    from ..errors import FlashgenError

    for flag, value, least in (("--fuzz", args.fuzz, 1), ("--timeout", args.timeout, 1),
                               ("--budget", args.budget, 0), ("-n", args.pytest_workers, 1),
                               ("--parallel", args.parallel, 1), ("--workers", args.workers, 1),
                               ("--fuzz-start", getattr(args, "fuzz_start", 0), 0)):
        if value is not None and value < least:
            raise FlashgenError(f"{flag} {value}: must be at least {least}")


# ---------------------------------------------------------------------------------------
# the handler
# ---------------------------------------------------------------------------------------

def run(args) -> int:
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("flashgen selftest: interrupted; its test processes were stopped and no summary "
              "was written", file=sys.stderr)
        return 130


def _run(args) -> int:
    from ..errors import FlashgenError
    from . import sanitize, shards

    _check_numbers(args)
    if args.fuzz_case is not None:
        return fuzz_case(args.fuzz_case)
    do_sanitize = args.sanitize or args.sanitize_tools is not None
    do_shards = args.only is not None or (args.fuzz is None and not do_sanitize)
    selected = shards.select(args.only) if do_shards else []
    if args.part is not None:
        selected = shards.part(selected, args.part)
    tools = sanitize.parse_tools(args.sanitize_tools) if do_sanitize else []
    try:
        extra = shlex.split(args.sanitizer_args or "")
    except ValueError as e:
        raise FlashgenError(f"--sanitizer-args {args.sanitizer_args!r}: {e}") from None
    tests = locate_tests(args.tests)
    gpu_ids = visible_gpus()
    if args.dry_run:
        print(dry_run(args, selected, tools, extra, tests, gpu_ids, do_shards, do_sanitize))
        return 0

    # usage errors first: a 9-minute run must not end in one
    if not gpu_ids and (do_shards or do_sanitize):
        asked = "" if not args.fuzz else (" (--sanitize and --only need one: run --fuzz "
                                          "alone here)")
        raise FlashgenError(NO_GPU + asked)
    if do_shards and tests is None:
        raise FlashgenError(NO_TESTS.format(cwd=Path.cwd()))
    sanitizer = sanitize.find_sanitizer(args.sanitizer) if tools else None
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FlashgenError(f"--out {args.out} is a file; --out takes a folder (the summary "
                            "and the logs are written into it)")
    if not gpu_ids:
        # the fuzzer on the CPU: Triton reads this once, when it is first imported
        os.environ.setdefault("TRITON_INTERPRET", "1")

    argv = getattr(args, "argv", None)
    root = tests.parent if tests is not None else None
    out.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget if args.budget else None
    parts, unassigned = None, []
    if do_shards:
        if args.only is None:
            unassigned = shards.unassigned(tests)
            if unassigned:
                selected = selected + [shards.Shard(
                    "unassigned", "GPU test files no shard names", tuple(unassigned), 60)]
        parts = run_shards(selected, root, out, gpu_ids, args, deadline)
    results = None
    if tools:
        results = sanitize.run_tools(tools, sanitizer, root or Path.cwd(), out / "sanitize",
                                     gpu_ids[0], deadline, args.timeout, extra, _echo)
    fuzz_rec = run_fuzz(args, gpu_ids) if args.fuzz else None

    from . import summary

    rec = summary.build(summary.environment(root, argv), parts, unassigned, results, fuzz_rec)
    text = summary.format_text(rec)
    js, txt = summary.write(out, rec, text)
    sys.stdout.write(text)
    print(f"written: {txt} and {js}")
    return rec["exit_status"]


def run_shards(selected, root: Path, out: Path, gpu_ids: list[str], args, deadline):
    from . import runner, shards

    per, at_once = shards.workers(len(gpu_ids), cores(), args.pytest_workers, args.parallel)
    single, multi = runner.plan_jobs(selected, out / "shards", per, args.timeout)
    basetemp = Path(tempfile.mkdtemp(prefix="flashgen-selftest-"))
    try:
        results = runner.run_jobs(single, root, gpu_ids, at_once, deadline, basetemp, _echo)
        if len(gpu_ids) >= 2:
            # alone: these tests use every GPU (one process each, NCCL)
            results += runner.run_jobs(multi, root, gpu_ids, 1, deadline, basetemp, _echo)
        else:
            results += [runner.skipped(j, f"needs 2 GPUs; this machine has {len(gpu_ids)}")
                        for j in multi]
    finally:
        shutil.rmtree(basetemp, ignore_errors=True)
    order = {s.name: i for i, s in enumerate(selected)}
    return sorted(results, key=lambda r: (order[r.shard], r.part != runner.SINGLE))


def run_fuzz(args, gpu_ids: list[str]) -> dict:
    from . import summary

    device = "cuda" if gpu_ids else "cpu"
    first = getattr(args, "fuzz_start", 0)
    _echo(f"selftest: fuzzing {args.fuzz} cases on {device} (seed {args.seed}"
          f"{f', from case {first}' if first else ''}, "
          f"{args.workers} worker{'' if args.workers == 1 else 's'})")
    try:
        from ..progress import Progress
        from .fuzz import fuzz

        bar = Progress(args.fuzz, "fuzz")

        def progress(done, total, result=None, *_):
            # fuzz calls progress(done, total, result) after each case
            failed = result is not None and getattr(result, "failed", False)
            bar.done = max(done - 1, 0)
            label = getattr(getattr(result, "case", None), "label", lambda: "")
            bar.advance(f"FAIL {label()}" if failed else "")

        report = fuzz(args.fuzz, args.seed, device, workers=args.workers, progress=progress,
                      start=getattr(args, "fuzz_start", 0))
        bar.close()
    except Exception:  # noqa: BLE001 -- a bug in the fuzzer must not lose the shards' results
        tb = traceback.format_exc()
        _echo(tb)
        return {"status": "error", "device": device, "seed": args.seed,
                "workers": args.workers, "requested": args.fuzz,
                "error": tb.strip().splitlines()[-1]}
    rec = summary.fuzz_record(report, device, args.seed, args.workers, args.fuzz)
    if first:
        rec["start"] = first
    return rec


def fuzz_case(text: str) -> int:
    """`--fuzz-case JSON`: run one case (a fuzz failure's reproducer) here and say how it
    went: 0 passed, 1 failed."""
    from ..errors import FlashgenError

    device = "cuda" if visible_gpus() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    from .cases import Case, run_case
    from .package import selftest_packages

    try:
        case = Case.from_json(text)
    except (ValueError, TypeError, KeyError) as e:
        raise FlashgenError(f"--fuzz-case: not a case ({e}); pass the JSON a fuzz failure "
                            "printed, in single quotes") from None
    result = run_case(case, selftest_packages(device), device)
    line = result.line() if hasattr(result, "line") else \
        f"{'ok' if result.passed else 'FAIL'} {result.message}"
    print(f"{line}  [on {device}]")
    if getattr(result, "skipped", ""):
        print("(skipped here: not a pass; run it where the case can run)")
        return 0
    return 0 if result.passed else 1


# ---------------------------------------------------------------------------------------
# --dry-run
# ---------------------------------------------------------------------------------------

def dry_run(args, selected, tools, extra, tests, gpu_ids, do_shards, do_sanitize) -> str:
    from . import runner, sanitize, shards

    n = len(gpu_ids)
    out = Path(args.out)
    lines = ["flashgen selftest --dry-run: what this command would run (nothing runs)"]
    lines.append(f"  tests    {tests}" if tests else
                 "  tests    none found (not in a checkout): the shards cannot run from here")
    lines.append(f"  GPUs     {n} ({', '.join(gpu_ids)})" if n else
                 "  GPUs     none (CUDA not available): only --fuzz runs here")
    per, at_once = shards.workers(n, cores(), args.pytest_workers, args.parallel)
    h100 = shards.workers(1, 16, args.pytest_workers, args.parallel)
    lines.append(f"  workers  {per} xdist workers a shard, {at_once} shards at a time "
                 f"({shards.WORKERS_PER_GPU} per GPU in all, capped by {cores()} cores; on one "
                 f"H100 with 16 cores: {h100[0]} a shard, {h100[1]} at a time)")
    lines.append(f"  budget   {args.budget} s for the shards and the sanitizer tools"
                 if args.budget else "  budget   none (--budget 0)")
    lines.append(f"  summary  {out / 'selftest.txt'}, {out / 'selftest.json'}")

    shown = selected or list(shards.SHARDS)
    lines.append("")
    lines.append("pytest shards" + ("" if do_shards else
                                    " (not run by this command: pass --only NAMES or no "
                                    "--fuzz/--sanitize)") + ":")
    single, multi = runner.plan_jobs(shown, out / "shards", per, args.timeout)
    for job in single:
        s = job.shard
        w = job.workers
        lines.append(f"  {s.name:<14} est {s.est_s:>4} s  timeout {job.timeout_s:>4} s  "
                     f"{w or 'no'} worker{'' if w == 1 else 's'}  {s.about}")
        lines.append(f"      {job.display()}")
    for job in multi:
        here = ("would run here (alone, all GPUs)" if n >= 2 else
                f"would be skipped here: needs 2 GPUs, this machine has {n}")
        lines.append(f"  {job.shard.name:<14} est {job.est_s:>4} s  timeout {job.timeout_s:>4} s  "
                     f"2+ GPUs, no xdist: {here}")
        lines.append(f"      {job.display()}")
    total = sum(j.est_s for j in single)
    lines.append(f"  estimated {total} s of shard time: about {total / max(at_once, 1):.0f} s "
                 f"at {at_once} at a time" + (f", plus {sum(j.est_s for j in multi)} s on 2+ "
                                               "GPUs" if n >= 2 and multi else ""))
    if tests is not None:
        missing = shards.unassigned(tests)
        if missing:
            lines.append(f"  warning: GPU test files in no shard (a full run adds them as "
                         f"'unassigned'): {', '.join(missing)}")

    lines.append("")
    lines.append("compute-sanitizer" + ("" if do_sanitize else
                                        " (not run by this command: pass --sanitize)") + ":")
    try:
        found = str(sanitize.find_sanitizer(args.sanitizer))
    except Exception as e:  # noqa: BLE001 -- shown, not raised: a dry run works anywhere
        found = None
        lines.append(f"  not found here: {e}")
    for tool in tools or list(sanitize.TOOLS):
        env = sanitize.tool_env(tool, gpu_ids[0] if gpu_ids else "0")
        shown_env = " ".join(f"{k}={env[k]}" for k in ("CUDA_VISIBLE_DEVICES",
                                                       "PYTORCH_NO_CUDA_MEMORY_CACHING")
                             if k in env)
        argv = sanitize.command(tool, found or "compute-sanitizer", extra, python="python")
        optional = " (where it runs)" if tool in sanitize.OPTIONAL else ""
        lines.append(f"  {tool}{optional}: {shown_env} {shlex.join(argv)}")

    lines.append("")
    device = "cuda" if n else "cpu (Triton's interpreter)"
    if args.fuzz:
        lines.append(f"fuzz: {args.fuzz} seeded random cases (seed {args.seed}) on {device}, "
                     f"{args.workers} workers, against the float64 reference; a failure "
                     "prints `flashgen selftest --fuzz-case '<case json>'`")
    else:
        lines.append(f"fuzz (not run by this command: pass --fuzz N): seeded random cases on "
                     f"{device} against the float64 reference")
    return "\n".join(lines)
