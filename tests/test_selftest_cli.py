"""`flashgen selftest` on a CPU: the command line, the shard table, the JUnit and sanitizer
parsers, and the shard runner's real subprocess path on a stand-in test file (no GPU: the
stand-in's tests are marked gpu and check only what the runner set up for them).

The GPU paths themselves (real shards, compute-sanitizer, the fuzzer on cuda) run on the
GPU machine: `flashgen selftest` there (docs/TESTING.md)."""
from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch

from flashgen import cli
from flashgen import selftest
from flashgen.selftest import runner, sanitize, shards, summary

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


# ---------------------------------------------------------------------------------------
# the command line
# ---------------------------------------------------------------------------------------

def test_dry_run_lists_shards_workers_timeouts_and_commands(no_gpu, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    assert cli.main(["selftest", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for s in shards.SHARDS:
        assert f"  {s.name} " in out, s.name
        for f in s.all_files():
            assert f in out, f
        assert f"timeout {s.timeout_s():>4} s" in out
    assert "python -m pytest -m 'gpu and not multigpu' tests/test_forward.py" in out
    assert "-p flashgen.selftest.pytest_plugin" in out and "--junitxml" in out
    # the 2-GPU part and whether it would run here
    assert "python -m pytest -m 'gpu and multigpu' tests/test_ring_gpu.py" in out
    assert "would be skipped here: needs 2 GPUs, this machine has 0" in out
    assert "on one H100 with 16 cores: 4 a shard, 2 at a time" in out
    # the other parts, marked as not run by this command
    assert "compute-sanitizer (not run by this command: pass --sanitize)" in out
    for tool in sanitize.TOOLS:
        assert f"--tool {tool} --error-exitcode 99" in out
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING=1 " in out
    assert "python -m flashgen.selftest.cases --set sanitize --device cuda" in out
    assert "fuzz (not run by this command" in out and "cpu (Triton's interpreter)" in out

    assert cli.main(["selftest", "--dry-run", "--sanitize-tools", "racecheck", "--fuzz", "5",
                     "--seed", "7"]) == 0
    out = capsys.readouterr().out
    assert "pytest shards (not run by this command" in out
    assert "--racecheck-report analysis" in out and "--tool memcheck" not in out
    assert "fuzz: 5 seeded random cases (seed 7) on cpu" in out


def test_unknown_shard_exits_2_and_names_the_shards(capsys):
    assert cli.main(["selftest", "--only", "ring,nope", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashgen selftest: error: unknown shard 'nope'; the shards are: ")
    for name in shards.names():
        assert name in err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("args, extra", [
    ([], ""),
    (["--only", "decode"], ""),
    (["--sanitize"], ""),
    (["--sanitize", "--fuzz", "2"], "(--sanitize and --only need one: run --fuzz alone here)"),
])
def test_no_gpu_exits_2_with_the_message(no_gpu, monkeypatch, capsys, args, extra):
    monkeypatch.chdir(ROOT)
    assert cli.main(["selftest", *args]) == 2
    err = capsys.readouterr().err
    assert err == f"flashgen selftest: error: {selftest.NO_GPU}{' ' + extra if extra else ''}\n"


def test_without_a_checkout_the_shards_cannot_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(selftest, "visible_gpus", lambda: ["0"])
    monkeypatch.chdir(tmp_path)
    assert cli.main(["selftest", "--only", "decode"]) == 2
    err = capsys.readouterr().err
    assert "no tests/ folder of a flashgen checkout" in err and "--tests DIR" in err
    assert "--fuzz N and --sanitize run from any install" in err


def test_sanitize_tools_and_sanitizer_are_checked_before_anything_runs(monkeypatch, tmp_path,
                                                                        capsys):
    monkeypatch.setattr(selftest, "visible_gpus", lambda: ["0"])
    assert cli.main(["selftest", "--sanitize-tools", "memcheck,helgrind"]) == 2
    assert "the tools are memcheck, racecheck, synccheck" in capsys.readouterr().err
    assert cli.main(["selftest", "--sanitize", "--sanitizer", str(tmp_path / "nope")]) == 2
    assert "not an executable file" in capsys.readouterr().err
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(sanitize, "_candidates", lambda: [tmp_path / "compute-sanitizer"])
    assert cli.main(["selftest", "--sanitize"]) == 2
    assert "compute-sanitizer not found" in capsys.readouterr().err


def test_out_must_be_a_folder(tmp_path, capsys):
    (tmp_path / "f").write_text("")
    assert cli.main(["selftest", "--fuzz", "1", "--out", str(tmp_path / "f")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("flashgen selftest: error: --out ") and "is a file" in err


# ---------------------------------------------------------------------------------------
# the shard table
# ---------------------------------------------------------------------------------------

def test_every_gpu_test_file_is_in_exactly_one_shard():
    count = collections.Counter(f for s in shards.SHARDS for f in s.all_files())
    assert [f for f, n in count.items() if n > 1] == [], "a file in two shards runs twice"
    gpu = set(shards.gpu_test_files(TESTS))
    missing = sorted(gpu - set(count))
    assert not missing, (f"{missing} hold gpu tests but no shard names them: give each a "
                         "shard in flashgen/selftest/shards.py (or `flashgen selftest` "
                         "never runs them)")
    assert sorted(set(count) - gpu) == [], "a shard names a file without gpu tests"
    assert set(shards.multigpu_test_files(TESTS)) == \
        {f for s in shards.SHARDS for f in s.multigpu_files}
    assert shards.unassigned(TESTS) == []
    assert len(set(shards.names())) == len(shards.SHARDS)


def test_the_scan_agrees_with_pytest_collection():
    """gpu_test_files reads the source; pytest's own collection of `-m gpu` is the truth."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "gpu",
                          "-p", "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    collected = {line.split("::")[0] for line in res.stdout.splitlines() if "::" in line}
    assert collected and collected == set(shards.gpu_test_files(TESTS))


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parts_deal_every_shard_once_and_balance_the_time(n):
    every = list(shards.SHARDS)
    parts = [shards.part(every, f"{i}/{n}") for i in range(1, n + 1)]
    names_ = [s.name for p in parts for s in p]
    assert sorted(names_) == sorted(s.name for s in every)
    loads = [sum(s.est_s + s.multigpu_est_s for s in p) for p in parts]
    # greedy dealing, longest first: no part exceeds the mean by more than the longest shard
    longest = max(s.est_s + s.multigpu_est_s for s in every)
    assert max(loads) <= sum(loads) / n + longest


@pytest.mark.parametrize("spec", ["0/2", "3/2", "2", "a/b", ""])
def test_a_bad_part_exits_2(spec, capsys):
    assert cli.main(["selftest", "--part", spec, "--dry-run"]) == 2
    assert "--part" in capsys.readouterr().err


def test_workers_follow_gpus_and_cores():
    assert shards.workers(1, 16) == (4, 2)       # one H100: 8 workers, 2 shards at a time
    assert shards.workers(2, 32) == (8, 2)
    assert shards.workers(8, 128) == (8, 8)
    assert shards.workers(1, 2) == (1, 2)
    assert shards.workers(1, 16, per_shard=8, at_once=1) == (8, 1)


# ---------------------------------------------------------------------------------------
# JUnit XML and the summary
# ---------------------------------------------------------------------------------------

JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="2" failures="2" skipped="1" tests="7">
<testcase classname="tests.test_decode" name="test_paged[16]" file="tests/test_decode.py"
  line="187" time="1.2" />
<testcase classname="tests.test_decode" name="test_window[(64, 0)-True]"
  file="tests/test_decode.py" line="248" time="0.8">
  <failure message="AssertionError: out: max |err| 0.31 &gt; tol">dec = ...
    def test_window(pkg, device, poison, window, causal):
&gt;       check(out, ref)
E       AssertionError: out: max |err| 0.31 &gt; tol
tests/test_decode.py:255: AssertionError</failure>
</testcase>
<testcase classname="tests.test_gluon.TestScratch" name="test_graph" file="tests/test_gluon.py"
  line="700" time="2.0"><failure message="RuntimeError: CUDA error">E   RuntimeError: CUDA error: an illegal memory access was encountered</failure></testcase>
<testcase classname="tests.test_mla" name="test_decode_softcap_mod[1]" file="tests/test_mla.py"
  line="314" time="0.0"><error message="failed on setup with &quot;OutOfMemoryError&quot;">E   torch.OutOfMemoryError: CUDA out of memory.</error></testcase>
<testcase classname="tests.test_ring_gpu" name="test_ring_small" file="tests/test_ring_gpu.py"
  line="40" time="0.0"><skipped type="pytest.skip" message="needs 2 GPUs, this machine has 1">
  tests/test_ring_gpu.py:40: needs 2 GPUs</skipped></testcase>
<testcase classname="" name="tests.test_broken" time="0.0"><error message="collection failure">ImportError: cannot import name 'x'</error></testcase>
<testcase classname="tests.test_forward" name="test_dtypes[cuda-bfloat16-True]"
  file="tests/test_forward.py" line="85" time="0.3" />
</testsuite></testsuites>
"""


def test_junit_parsing_and_the_summary_json(tmp_path):
    path = tmp_path / "decode.xml"
    path.write_text(JUNIT)
    counts, failures = runner.parse_junit(path)
    assert counts == {"passed": 2, "failed": 2, "errors": 2, "skipped": 1}
    ids = [f.nodeid for f in failures]
    assert ids == ["tests/test_broken.py",      # (sorted by node id)
                   "tests/test_decode.py::test_window[(64, 0)-True]",
                   "tests/test_gluon.py::TestScratch::test_graph",
                   "tests/test_mla.py::test_decode_softcap_mod[1]"]
    broken, failures = failures[0], failures[1:]
    assert broken.reproducer == "python -m pytest -m gpu tests/test_broken.py"
    assert failures[0].reproducer == \
        "python -m pytest -m gpu 'tests/test_decode.py::test_window[(64, 0)-True]'"
    assert failures[0].message.splitlines()[-2:] == [
        "E       AssertionError: out: max |err| 0.31 > tol",
        "tests/test_decode.py:255: AssertionError"]
    assert "illegal memory access" in failures[1].message
    failures.append(broken)

    part = runner.PartResult("decode", runner.SINGLE, "failed", seconds=12.5, workers=4,
                             timeout_s=180, files=["tests/test_decode.py"], failures=failures,
                             **counts)
    ok = runner.PartResult("mla", runner.SINGLE, "ok", passed=37, seconds=40.0, workers=4)
    skip = runner.PartResult("ring", runner.MULTI, "skipped",
                             note="needs 2 GPUs; this machine has 1")
    env = summary.environment(ROOT, ["flashgen", "selftest"])
    rec = summary.build(env, [part, ok, skip])
    rec = json.loads(json.dumps(rec))       # what selftest.json holds
    assert rec["exit_status"] == 1
    assert rec["problems"] == ["shard decode (1 GPU): failed"]
    assert rec["shard_totals"] == {"passed": 39, "failed": 2, "errors": 2, "skipped": 1,
                                   "seconds": 52.5}
    assert len(rec["checkout"]["commit"]) == 40 and isinstance(rec["checkout"]["dirty"], bool)
    for key in ("date", "flashgen", "python", "torch", "triton", "torch_cuda", "gpus",
                "driver", "driver_cuda"):
        assert key in rec, key
    assert rec["shards"][0]["failures"][0]["reproducer"].startswith("python -m pytest -m gpu")
    text = summary.format_text(rec)
    assert "python -m pytest -m gpu 'tests/test_decode.py::test_window[(64, 0)-True]'" in text
    assert "skipped: needs 2 GPUs; this machine has 1" in text
    assert text.rstrip().endswith("shard decode (1 GPU): failed")

    clean = summary.build(env, [ok, skip])
    assert clean["exit_status"] == 0 and clean["problems"] == []
    assert "OK: everything ran and passed" in summary.format_text(clean)


# ---------------------------------------------------------------------------------------
# compute-sanitizer's output (samples in the format of its manual's examples)
# ---------------------------------------------------------------------------------------

MEMCHECK_CLEAN = """\
========= COMPUTE-SANITIZER
ok      0.41s train gpt2 fp16 b3 h2/2 d64 59x59 causal gluon
ok      0.52s decode llama bf16 b3 h8/1 d128 1x257 splits 3
26 cases: 26 passed, 0 failed, 0 skipped
========= ERROR SUMMARY: 0 errors
"""

MEMCHECK_OOB = """\
========= COMPUTE-SANITIZER
ok      0.41s train gpt2 fp16 b3 h2/2 d64 59x59 causal gluon
========= Invalid __global__ read of size 16 bytes
=========     at _fwd_kernel+0x1a40 in fwd_causal_d64_fp16.py:211
=========     by thread (64,0,0) in block (0,3,0)
=========     Address 0x7f3a2e000f00 is out of bounds
=========     and is 1 bytes after the nearest allocation at 0x7f3a2e000000 of size 3839 bytes
=========     Saved host backtrace up to driver entry point at kernel launch time
=========         Host Frame: [0x2e8f95] in libcuda.so.1
=========
FAIL    0.52s varlen selftest bf16 b4 h8/1 d96 | RuntimeError: CUDA error: unspecified launch failure
26 cases: 1 passed, 1 failed, 0 skipped
========= Target application returned an error
========= ERROR SUMMARY: 1 error
"""

RACECHECK_RACE = """\
========= COMPUTE-SANITIZER
ok      3.10s train llama bf16 b1 h8/1 d128 59x257 causal gluon
========= Error: Race reported between Write access at _attn_fwd+0x3b70 in fwd_causal_d128_bf16.py:1045
=========     and Read access at _attn_fwd+0x2c10 in fwd_causal_d128_bf16.py:974 [2048 hazards]
=========
========= Warning: Race reported between Write access at _attn_bwd+0x1f00 in bwd_causal_d128_bf16.py:610
=========     and Write access at _attn_bwd+0x1f00 in bwd_causal_d128_bf16.py:610 [32 hazards]
=========
26 cases: 26 passed, 0 failed, 0 skipped
========= RACECHECK SUMMARY: 2 hazards displayed (1 error, 1 warning)
"""


@pytest.mark.parametrize("tool, text, rc, status, errors, warnings, bad", [
    ("memcheck", MEMCHECK_CLEAN, 0, "ok", 0, None, False),
    ("memcheck", MEMCHECK_OOB, 1, "failed", 1, None, True),
    ("racecheck", RACECHECK_RACE, 99, "failed", 1, 1, True),
    ("racecheck", RACECHECK_RACE.replace("2 hazards displayed (1 error, 1 warning)",
                                         "1 hazard displayed (0 errors, 1 warning)"),
     0, "ok", 0, 1, False),
    ("racecheck", RACECHECK_RACE.split("26 cases")[0], -9, "error", None, None, True),
    ("racecheck", MEMCHECK_CLEAN.replace(
        "========= ERROR SUMMARY: 0 errors",
        "========= Warning: Detected overflow of tracked cuda::barrier structures. Results "
        "might be incorrect. Try using --num-cuda-barriers to fix the issue\n"
        "========= RACECHECK SUMMARY: 0 hazards displayed (0 errors, 0 warnings)"),
     0, "inconclusive", 0, 0, True),
    # the tool's wording for an unsupported GPU or toolkit varies: matched on its own lines
    ("synccheck", "========= COMPUTE-SANITIZER\n========= Error: synccheck is not supported "
                  "on this device\n", 1, "unsupported", None, None, False),
    ("memcheck", "========= COMPUTE-SANITIZER\n========= Error: memcheck is not supported on "
                 "this device\n", 1, "unsupported", None, None, True),
    # an API error that says "not supported" is not the tool's: a failed run
    ("synccheck", MEMCHECK_CLEAN.replace(
        "========= ERROR SUMMARY: 0 errors",
        '========= Program hit cudaErrorNotSupported (error 801) due to "operation not '
        'supported" on CUDA API call to cudaDeviceSetLimit.\n========= ERROR SUMMARY: 1 error'),
     99, "failed", 1, None, True),
    # the cases failed under the tool although it saw nothing
    ("synccheck", MEMCHECK_CLEAN.replace("26 passed, 0 failed", "25 passed, 1 failed")
     .replace("ERROR SUMMARY", "Target application returned an error\n========= ERROR "
              "SUMMARY"), 1, "failed", 0, None, True),
])
def test_sanitizer_verdicts(tool, text, rc, status, errors, warnings, bad):
    res = sanitize.parse_report(tool, text, rc)
    assert (res.status, res.errors, res.warnings, res.bad) == (status, errors, warnings, bad), \
        res.note
    assert all(line.startswith("=========") for line in res.report)
    assert not any("COMPUTE-SANITIZER" in line for line in res.report)
    if status == "failed" and tool == "memcheck":
        assert "Invalid __global__ read of size 16 bytes" in res.report[0]
        assert "FAIL" in res.app_tail and "unspecified launch failure" in res.app_tail
    if status == "inconclusive":
        assert '--sanitizer-args="--num-cuda-barriers 64"' in res.note


def test_sanitizer_commands_and_env():
    cmd = sanitize.command("memcheck", "/cuda/bin/compute-sanitizer", ["--print-limit", "5"],
                           python="python")
    assert cmd == ["/cuda/bin/compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "99",
                   "--target-processes", "application-only", "--launch-timeout", "120",
                   "--padding", "256", "--report-api-errors", "no", "--print-limit", "5",
                   "python", "-m", "flashgen.selftest.cases", "--set", "sanitize",
                   "--device", "cuda"]
    assert "--racecheck-report" in sanitize.command("racecheck", "cs")
    env = sanitize.tool_env("memcheck", "3")
    assert env["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "3"
    assert "TRITON_INTERPRET" not in env
    assert "PYTORCH_NO_CUDA_MEMORY_CACHING" not in sanitize.tool_env("racecheck", "0") or \
        os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING")


# ---------------------------------------------------------------------------------------
# a shard end to end: the real subprocess, xdist, the pin, JUnit, the progress lines
# ---------------------------------------------------------------------------------------

STAND_IN = '''\
import os
import time

import pytest


@pytest.mark.gpu
def test_pinned_to_one_listed_gpu():
    # xdist worker gwN sees GPU ids[N % len(ids)] and nothing else
    if "PYTEST_XDIST_WORKER" not in os.environ:
        assert "FLASHGEN_SELFTEST_GPUS" not in os.environ   # no xdist: no pin
        return
    ids = os.environ["FLASHGEN_SELFTEST_GPUS"].split(",")
    worker = int(os.environ["PYTEST_XDIST_WORKER"][2:])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ids[worker % len(ids)]


@pytest.mark.gpu
@pytest.mark.parametrize("x", ["one two"])
def test_fails(x):
    assert x == "three", "the stand-in fails here"


def test_cpu_only_is_not_selected():
    raise AssertionError("a shard runs -m 'gpu and not multigpu' only")


@pytest.mark.gpu
@pytest.mark.multigpu
def test_multigpu_is_not_in_the_single_gpu_part():
    raise AssertionError("multigpu tests run in their own part")


@pytest.mark.gpu
def test_hangs_when_asked():
    if os.environ.get("STAND_IN_HANG"):
        time.sleep(120)
'''


@pytest.fixture
def stand_in(tmp_path):
    root = tmp_path / "checkout"
    (root / "tests").mkdir(parents=True)
    (root / "pyproject.toml").write_text(textwrap.dedent('''\
        [project]
        name = "flashgen"
        [tool.pytest.ini_options]
        markers = ["gpu: x", "multigpu: x"]
        addopts = "-m 'not gpu and not slow'"
        '''))
    (root / "tests" / "conftest.py").write_text("")
    (root / "tests" / "test_tiny.py").write_text(STAND_IN)
    return root


TINY = shards.Shard("tiny", "a stand-in", ("tests/test_tiny.py",), est_s=1)


def test_a_shard_runs_end_to_end(stand_in, tmp_path, monkeypatch):
    monkeypatch.delenv("STAND_IN_HANG", raising=False)
    single, multi = runner.plan_jobs([TINY], tmp_path / "out" / "shards", per_shard=2)
    assert multi == [] and single[0].workers == 2
    [res] = runner.run_jobs(single, stand_in, ["a", "b"], at_once=1, deadline=None,
                            basetemp=tmp_path / "tmp", echo=lambda line: None)
    assert (res.status, res.passed, res.failed, res.errors, res.skipped) == \
        ("failed", 2, 1, 0, 0), Path(res.log).read_text()
    [f] = res.failures
    assert f.nodeid == "tests/test_tiny.py::test_fails[one two]"
    assert f.reproducer == "python -m pytest -m gpu 'tests/test_tiny.py::test_fails[one two]'"
    assert "the stand-in fails here" in f.message
    progress = single[0].progress
    assert sorted(p.name for p in progress.glob("*.jsonl")) <= ["gw0.jsonl", "gw1.jsonl"]
    assert runner.read_progress(progress)[0] == {"passed": 2, "failed": 1, "errors": 0,
                                                 "skipped": 0}


def test_a_hanging_shard_is_killed_and_says_what_it_was_running(stand_in, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setenv("STAND_IN_HANG", "1")
    single, _ = runner.plan_jobs([TINY], tmp_path / "out" / "shards", per_shard=1,
                                 timeout=8)
    single[0].workers = 0       # no xdist: the quickest start
    [res] = runner.run_jobs(single, stand_in, ["0"], at_once=1, deadline=None,
                            basetemp=tmp_path / "tmp", echo=lambda line: None)
    assert res.status == "timeout" and res.bad
    assert (res.passed, res.failed) == (1, 1)     # what had finished, from the progress lines
    assert res.failures[0].nodeid is None
    assert "shard tiny (1 GPU) timed out after 8 s" in res.failures[0].message
    assert "tests/test_tiny.py::test_hangs_when_asked (main, " in res.failures[0].message
    assert res.failures[-1].nodeid == "tests/test_tiny.py::test_hangs_when_asked"


def test_a_shard_that_does_not_fit_the_budget_is_listed_not_started(tmp_path):
    single, _ = runner.plan_jobs([TINY], tmp_path / "shards", per_shard=1)
    single[0].est_s = 100
    import time

    [res] = runner.run_jobs(single, tmp_path, ["0"], at_once=1,
                            deadline=time.monotonic() + 30, basetemp=tmp_path,
                            echo=lambda line: None)
    assert res.status == "not run" and res.bad
    assert res.failures[0].reproducer == "flashgen selftest --only tiny"
    assert "did not fit" in res.note


# ---------------------------------------------------------------------------------------
# the whole verb with stand-ins: shards, a fake compute-sanitizer, a fake fuzzer
# ---------------------------------------------------------------------------------------

def fake_fuzz_module(seen):
    class FakeCase:
        def to_json(self):
            return '{"kind": "train", "seed": 3}'

    def fuzz(n, seed, device, workers=1, progress=None, start=0):
        seen.update(n=n, seed=seed, device=device, workers=workers, start=start,
                    interpret=os.environ.get("TRITON_INTERPRET"))
        for done in range(1, n + 1):
            progress(done, n, types.SimpleNamespace(failed=done == n, case=None))
        # fuzz.FuzzReport's shape: failures as records, `cases_run`, `coverage()`
        failure = types.SimpleNamespace(
            case=FakeCase(), message="dq 3.2x tol",
            reproducer="flashgen selftest --fuzz-case '{\"kind\": \"train\", \"seed\": 3}'")
        return types.SimpleNamespace(
            cases_run=n, passed=n - 1, seconds=0.5, skipped=[("decode fp32", "not built")],
            failed=[failure], coverage=lambda: {"train": n}, notes={})

    module = types.ModuleType("flashgen.selftest.fuzz")
    module.fuzz = fuzz
    return module


def test_the_verb_end_to_end_with_stand_ins(stand_in, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("STAND_IN_HANG", raising=False)
    monkeypatch.setattr(selftest, "visible_gpus", lambda: ["0"])
    monkeypatch.setattr(shards, "SHARDS", (TINY,))
    seen = {}
    monkeypatch.setitem(sys.modules, "flashgen.selftest.fuzz", fake_fuzz_module(seen))
    sanitizer = tmp_path / "compute-sanitizer"
    sanitizer.write_text("#!/bin/sh\n"
                         "echo '========= COMPUTE-SANITIZER'\n"
                         "echo \"tool=$2 visible=$CUDA_VISIBLE_DEVICES\"\n"
                         "echo '========= RACECHECK SUMMARY: 0 hazards displayed "
                         "(0 errors, 0 warnings)'\n")
    sanitizer.chmod(0o755)
    out = tmp_path / "report"
    rc = cli.main(["selftest", "--tests", str(stand_in / "tests"), "--out", str(out),
                   "--only", "tiny", "-n", "1", "--sanitize-tools", "racecheck",
                   "--sanitizer", str(sanitizer), "--fuzz", "3", "--seed", "11"])
    captured = capsys.readouterr()
    assert rc == 1
    rec = json.loads((out / "selftest.json").read_text())
    assert (out / "selftest.txt").read_text() in captured.out
    assert rec["argv"][:2] == ["flashgen", "selftest"] and "--fuzz" in rec["argv"]
    [part] = rec["shards"]
    assert (part["shard"], part["passed"], part["failed"], part["workers"]) == ("tiny", 2, 1, 1)
    [tool] = rec["sanitize"]
    assert (tool["tool"], tool["status"], tool["errors"]) == ("racecheck", "ok", 0)
    assert "tool=racecheck visible=0" in Path(tool["log"]).read_text()
    seen.pop("interpret")  # (this CPU process has it on already: tests/conftest.py)
    assert seen == {"n": 3, "seed": 11, "device": "cuda", "workers": 1, "start": 0}
    assert rec["fuzz"]["failed"][0]["reproducer"].startswith("flashgen selftest --fuzz-case '")
    assert rec["fuzz"]["failed"][0]["case"] == '{"kind": "train", "seed": 3}'
    assert rec["fuzz"]["kinds"] == {"train": 3} and "  kinds: train 3" in captured.out
    assert rec["problems"] == ["shard tiny (1 GPU): failed", "fuzz: 1 failed"]
    assert "flashgen selftest --fuzz-case '{\"kind\": \"train\", \"seed\": 3}'" in captured.out
    assert "selftest: tiny (1 GPU, 1 workers) started" in captured.err


def test_fuzz_alone_runs_on_the_cpu_in_the_interpreter(no_gpu, tmp_path, monkeypatch, capsys):
    seen = {}
    monkeypatch.setitem(sys.modules, "flashgen.selftest.fuzz", fake_fuzz_module(seen))
    monkeypatch.setenv("TRITON_INTERPRET", "0")    # (so that monkeypatch restores it)
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.chdir(tmp_path)                    # no checkout needed
    assert cli.main(["selftest", "--fuzz", "2", "--out", str(tmp_path / "o")]) == 1
    assert seen["device"] == "cpu" and seen["interpret"] == "1"
    rec = json.loads((tmp_path / "o" / "selftest.json").read_text())
    assert rec["shards"] is None and rec["sanitize"] is None and rec["checkout"] is None


def test_fuzz_record_takes_tuples_too():
    report = types.SimpleNamespace(cases=4, passed=3, seconds=1.25, skipped=[],
                                   failed=[("case", "out 2x tol", "flashgen selftest ...")])
    rec = summary.fuzz_record(report, "cuda", 5, 2, 4)
    assert rec["failed"] == [{"case": "case", "message": "out 2x tol",
                              "reproducer": "flashgen selftest ..."}]
    assert (rec["cases"], rec["passed"], rec["status"], rec["seconds"]) == (4, 3, "failed", 1.2)


def test_fuzz_case_replays_one_case(monkeypatch, capsys):
    ran = []

    class Case:
        def __init__(self, fields):
            self.fields = fields

        @classmethod
        def from_json(cls, text):
            return cls(json.loads(text))

    def run_case(case, packages, device):
        ran.append((case.fields, device))
        passed = case.fields["seed"] != 3
        return types.SimpleNamespace(passed=passed, message="" if passed else "dq 3.2x tol",
                                     skipped="")

    cases = types.ModuleType("flashgen.selftest.cases")
    cases.Case, cases.run_case = Case, run_case
    package = types.ModuleType("flashgen.selftest.package")
    package.selftest_packages = lambda device: {}
    monkeypatch.setitem(sys.modules, "flashgen.selftest.cases", cases)
    monkeypatch.setitem(sys.modules, "flashgen.selftest.package", package)
    monkeypatch.setattr(selftest, "visible_gpus", lambda: ["0"])
    assert cli.main(["selftest", "--fuzz-case", '{"seed": 3}']) == 1
    assert "FAIL dq 3.2x tol  [on cuda]" in capsys.readouterr().out
    assert cli.main(["selftest", "--fuzz-case", '{"seed": 4}']) == 0
    assert ran == [({"seed": 3}, "cuda"), ({"seed": 4}, "cuda")]
    assert cli.main(["selftest", "--fuzz-case", "{not json"]) == 2
    assert "--fuzz-case: not a case" in capsys.readouterr().err


def test_the_commit_can_be_named_for_a_copied_tree(monkeypatch, tmp_path):
    """The GPU machine gets a copy of the tree whose `.git` may be stale: the summary then
    names the commit it was told, and says where the name came from."""
    monkeypatch.setenv("FLASHGEN_SELFTEST_COMMIT", "c5a02f9")
    co = summary.checkout(tmp_path)
    assert co["commit"] == "c5a02f9 (FLASHGEN_SELFTEST_COMMIT)" and co["dirty"] is None
    monkeypatch.delenv("FLASHGEN_SELFTEST_COMMIT")
    assert summary.checkout(tmp_path)["commit"] != co["commit"]
