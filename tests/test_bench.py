"""`flashgen bench` on a CPU: the dry run, the no-GPU error, the FLOP formula and the
table / CSV / JSON writers on synthetic rows. The measuring itself needs a GPU."""
from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.bench import providers, report, suites, timing

ROOT = Path(__file__).resolve().parent.parent



def flashgen(*args: str, cwd: Path, env_extra=None) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "flashgen", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def test_help(tmp_path):
    res = flashgen("bench", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    for frag in ("--suite", "--n", "--d", "--mode", "--out", "--providers", "--dry-run",
                 "training", "decode", "dropout", "small", "all"):
        assert frag in text, frag
    top = flashgen("--help", cwd=tmp_path)
    assert " bench " in " ".join(top.stdout.split())


def test_dry_run_lists_anchor_shapes_and_providers(tmp_path):
    res = flashgen("bench", "--dry-run", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert out.startswith("48 cases")  # 2 modes x 2 d x 2 causal x 6 N
    for mode in ("fwd", "bwd"):
        # B*N = 16k, H*d = 2048
        assert f"training {mode} d=64 full   B=32 H=32 N=512:" in out
        assert f"training {mode} d=128 causal B=1 H=16 N=16384:" in out
    line = next(x for x in out.splitlines() if "d=128 full   B=2 H=16 N=8192" in x)
    assert line.split(": ")[1] == ("flashgen, flashgen_tl, sdpa_flash, sdpa_cudnn, fa4, flex, "
                                   "naive")
    line = next(x for x in out.splitlines() if "d=64 full   B=1 H=32 N=16384" in x)
    assert "naive" not in line  # N > 8192: naive would materialise N^2
    for p in ("flashgen", "sdpa_flash", "sdpa_cudnn", "flex", "naive"):
        assert f"\n  {p}: " in out
    assert "would write bench_training.json" in out


def test_dry_run_all_suites_and_filters(tmp_path):
    res = flashgen("bench", "--dry-run", "--suite", "all", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "dropout  fwd d=128 causal B=16 H=16 N=1024 p=0.1: flashgen_p0, flashgen, " \
           "sdpa_flash, sdpa_cudnn, sdpa_efficient, naive" in out
    assert "decode   1 query token d=128 B=8 Hq=32 Hkv=8 KV=65536" in out
    for b, n in ((4, 512), (8, 59), (1, 2048)):
        for c in ("full  ", "causal"):
            assert f"small    fwd d=64 {c} B={b} H=16 N={n}:" in out
    res = flashgen("bench", "--dry-run", "--mode", "fwd", "--d", "128", "--n", "4096",
                   "--providers", "flashgen", "sdpa_cudnn", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("2 cases")
    # a provider name also selects its sub-rows (flashgen_tl: the same package on `tl`)
    assert ("training fwd d=128 causal B=4 H=16 N=4096: flashgen, flashgen_tl, sdpa_cudnn"
            in res.stdout)
    assert "bench_training_fwd_d128_n4096_flashgen-sdpa_cudnn" in res.stdout


def test_unknown_provider_is_a_usage_error(tmp_path):
    res = flashgen("bench", "--dry-run", "--providers", "fa9", cwd=tmp_path)
    assert res.returncode == 2
    assert "unknown provider fa9" in res.stderr and "Traceback" not in res.stderr


def test_zero_rounds_is_a_usage_error(tmp_path):
    res = flashgen("bench", "--dry-run", "--rounds", "0", cwd=tmp_path)
    assert res.returncode == 2
    assert "--rounds 0" in res.stderr and "Traceback" not in res.stderr


@pytest.mark.parametrize("args, message", [
    (("--n", "0"), "--n 0: sequence lengths must be at least 1"),
    (("--n", "1024", "-5"), "--n -5: sequence lengths must be at least 1"),
    (("--d", "0"), "--d 0: head dims must be at least 1"),
    (("--rounds", "-1"), "--rounds -1: give at least 1 round"),
    (("--suite", "decode", "--n", "0"), "--n 0"),
])
def test_sizes_below_one_are_one_line_usage_errors(tmp_path, args, message):
    """--n 0 used to divide by zero planning the batch (B = 16k tokens // N) and --n -5
    planned a negative batch; both are refused before anything is planned."""
    res = flashgen("bench", "--dry-run", *args, cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    err = res.stderr.strip()
    assert err.startswith("flashgen bench: error: ") and message in err, err
    assert "\n" not in err and res.stdout == ""


@pytest.mark.parametrize("args, message", [
    (["--b", "0"], "--b 0: must be at least 1"),
    (["--n", "4096", "-5"], "--n -5: must be at least 1"),
    (["--page", "0"], "--page 0: must be at least 1"),
    (["--splits", "-1"], "--splits -1: must be at least 0"),
])
def test_decode_benchmark_refuses_bad_sizes(args, message, capsys):
    from flashgen.bench import decode
    assert decode.main(args) == 2
    assert capsys.readouterr().err == f"error: {message}\n"


def test_dry_run_names_the_folder_the_run_would_write(tmp_path, monkeypatch):
    from flashgen.bench import report
    res = flashgen("bench", "--dry-run", "--n", "1024", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    # in a checkout: its benchmarks/results/, as runner.run would
    results = ROOT / "benchmarks" / "results" / "<gpu-slug>"
    assert res.stdout.rstrip().endswith(f"under {results}{os.sep}"), res.stdout
    res = flashgen("bench", "--dry-run", "--n", "1024", "--out", "mine", cwd=tmp_path)
    assert res.stdout.rstrip().endswith(f"under mine{os.sep}"), res.stdout
    # installed (no checkout around the package): ./flashgen-bench/ of the working directory
    monkeypatch.setattr(report, "CHECKOUT_DIR", tmp_path / "site-packages")
    monkeypatch.chdir(tmp_path)
    assert report.default_out_base() == tmp_path / "flashgen-bench"
    assert report.default_out_dir("NVIDIA H100") == tmp_path / "flashgen-bench" / "nvidia-h100"


def drifting_clock(rates):
    """A stand-in for do_bench on a GPU whose clock slows by 1% a call: item i's time is
    rates[i] times the clock's current factor, so an order that times every round of one
    item before the next one's would read equal items as different."""
    calls = []

    def time_one(item):
        calls.append(item)
        return rates[item] * (1.0 + 0.01 * len(calls))
    return time_one, calls


def test_interleaved_rounds_alternate_order_so_drift_lands_alike():
    time_one, calls = drifting_clock({"a": 1.0, "b": 1.0, "c": 2.0})
    times = timing.interleaved_rounds(["a", "b", "c"], 4, time_one)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c", "c", "b", "a"]
    med = {k: sorted(v)[1:3] for k, v in times.items()}
    # equal providers read equal: each one's rounds sit at mirrored places in the run
    assert sum(med["a"]) == pytest.approx(sum(med["b"]), rel=0.01)
    assert sum(med["c"]) / sum(med["a"]) == pytest.approx(2.0, rel=0.01)
    # the same drift timed round after round (all of a, then all of b) reads them apart
    time_one, _ = drifting_clock({"a": 1.0, "b": 1.0})
    seq = {k: [time_one(k) for _ in range(4)] for k in ("a", "b")}
    assert sum(seq["b"]) / sum(seq["a"]) > 1.03


def test_interleaved_rounds_drop_an_item_that_raises():
    def time_one(item):
        if item == "bad":
            raise RuntimeError("refused")
        return 1.0
    times = timing.interleaved_rounds(["ok", "bad"], 3, time_one)
    assert times["ok"] == [1.0, 1.0, 1.0]
    assert isinstance(times["bad"], RuntimeError)


def test_record_rounds_fills_a_row():
    row = {"status": "ok"}
    assert timing.record_rounds(row, [1.25, 1.0, 3.0]) == 1.25
    assert row == {"status": "ok", "ms": 1.25, "ms_rounds": [1.25, 1.0, 3.0]}
    row = {"status": "ok"}
    assert timing.record_rounds(row, [0.123456]) == 0.123456
    assert row == {"status": "ok", "ms": 0.1235}  # one round: no ms_rounds
    row = {"status": "ok"}
    assert timing.record_rounds(row, ValueError("x" * 300), width=10) is None
    assert row == {"status": "error: ValueError: xxxxxxxxxx"}
    assert timing.record_rounds({}, None) is None and timing.record_rounds({}, []) is None


def test_no_cuda_exits_2_with_a_message(tmp_path):
    res = flashgen("bench", "--suite", "small", cwd=tmp_path,
                   env_extra={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 2
    assert res.stdout == ""
    err = res.stderr.strip()
    assert err.startswith("flashgen bench: error: no CUDA GPU") and "--dry-run" in err
    assert "Traceback" not in err


def test_flops_formula():
    # anchor convention: fwd 4*B*H*Nq*Nk*d, halved when causal, bwd 2.5x
    assert suites.flops(2, 16, 8192, 8192, 128, False, "fwd") == 4 * 2 * 16 * 8192**2 * 128
    assert suites.flops(2, 16, 8192, 8192, 128, True, "fwd") == 2 * 2 * 16 * 8192**2 * 128
    assert suites.flops(1, 1, 10, 10, 8, True, "bwd") == 2.5 * 1600
    # 1 ms at B=1, H=16, N=16k, d=128, non-causal fwd = 2.2e15 FLOP/s
    assert suites.tflops(1.0, 1, 16, 16384, 128, False, "fwd") == pytest.approx(2199.02, abs=0.01)
    # V with a head dim of its own: Q K^T at d, P V at dv
    assert suites.flops(1, 1, 10, 10, 192, False, "fwd", 128) == 2 * 100 * (192 + 128)


def test_bench_times_a_specs_split_head_dims():
    """A --spec pair {qk: 192, v: 128}: the training suite's cases carry V's head dim (the
    runner makes V that wide, and counts P V's FLOPs at it) and say so in their label; the
    bundled large-dims spec's dry run lists d = 256 and 192/128."""
    res = flashgen("bench", "--dry-run", "--spec", "specs/bench/large_dims.yaml", "--n", "4096",
                   "--mode", "fwd", "--providers", "flashgen", "fa4", "sdpa_cudnn", cwd=ROOT)
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stdout.splitlines() if x.startswith("  training")]
    assert len(lines) == 4, res.stdout
    assert any("d=192/128 causal B=4 H=10 N=4096: flashgen, flashgen_tl, sdpa_cudnn, fa4" in x
               for x in lines), lines
    assert any("d=256 full   B=4 H=8 N=4096" in x for x in lines), lines
    cases = suites.plan_cases("training", [4096], [192, 256], ("fwd",), dvs={192: 128})
    assert {(c.d, c.dv) for c in cases} == {(192, 128), (256, 0)}


def synthetic_rows():
    meta = {"gpu": "Fake GPU", "torch": "2.x", "triton": "3.x"}
    rows = []
    for prov, ms in (("flashgen", 1.0), ("sdpa_flash", 2.0), ("sdpa_cudnn", 0.5)):
        rows.append({**meta, "suite": "training", "mode": "fwd", "d": 128, "causal": False,
                     "b": 4, "h": 16, "h_kv": 16, "n": 4096, "p": 0.0, "provider": prov,
                     "status": "ok", "ms": ms, "spec_sha": "abc" if prov == "flashgen" else None,
                     "tflops": round(suites.tflops(ms, 4, 16, 4096, 128, False, "fwd"), 1)})
    rows.append({**meta, "suite": "training", "mode": "fwd", "d": 128, "causal": False, "b": 4,
                 "h": 16, "h_kv": 16, "n": 4096, "p": 0.0, "provider": "flex",
                 "status": "WRONG (max err 0.5)"})
    rows.append({**meta, "suite": "small", "mode": "fwd", "d": 64, "causal": True, "b": 8,
                 "h": 16, "n": 59, "p": 0.0, "provider": "flashgen", "status": "ok",
                 "ms": 0.02, "tflops": 0.1, "host_us": 35.5, "wall_us": 36.0})
    rows.append({**meta, "suite": "small", "mode": "fwd", "d": 64, "causal": True, "b": 8,
                 "h": 16, "n": 59, "p": 0.0, "provider": "sdpa_flash", "status": "ok",
                 "ms": 0.04, "tflops": 0.05})
    rows.append({**meta, "suite": "decode", "mode": "fwd", "d": 128, "causal": True, "b": 8,
                 "h": 32, "h_kv": 8, "n": 4096, "p": 0.0, "provider": "flashgen_s0",
                 "status": "ok", "ms": 0.07, "gbps": 2000.0})
    rows.append({**meta, "suite": "decode", "mode": "fwd", "d": 128, "causal": True, "b": 8,
                 "h": 32, "h_kv": 8, "n": 4096, "p": 0.0, "provider": "sdpa_cudnn",
                 "status": "ok", "ms": 0.065, "gbps": 2070.0})
    return meta, rows


def mods_rows():
    meta = {"gpu": "Fake GPU", "torch": "2.x", "triton": "3.x"}
    return [{**meta, "suite": "mods", "mode": mode, "d": 128, "causal": True, "b": 4, "h": 16,
             "h_kv": 16, "n": 4096, "p": 0.0, "mod": mod, "provider": prov, "status": "ok",
             "ms": ms, "tflops": round(suites.tflops(ms, 4, 16, 4096, 128, True, mode), 1)}
            for mode in ("fwd", "bwd") for mod in ("softcap", "document")
            for prov, ms in (("flashgen", 0.5), ("flex", 1.0))]


def test_markdown_tables_show_values_and_ratios():
    _, rows = synthetic_rows()
    text = report.markdown_tables(rows)
    assert "**training: fwd, d=128, not causal** (TFLOP/s)" in text
    head = "| B | N | flashgen | sdpa_flash | sdpa_cudnn | flex | flashgen vs sdpa_flash | " \
           "flashgen vs sdpa_cudnn | flashgen vs flex |"
    assert head in text
    tf = suites.tflops(1.0, 4, 16, 4096, 128, False, "fwd")
    line = next(x for x in text.splitlines() if x.startswith("| 4 | 4096 |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == f"{tf:.1f}"
    assert cells[5].startswith("WRONG")
    assert cells[6:] == ["2.00", "0.50", "–"]
    # small: ms, host time, ratio = peer ms / flashgen ms
    assert "**small: fwd, d=64, causal** (ms per call)" in text
    assert "| 8 | 59 | 0.0200 (host 35.5 us) | 0.0400 | 2.00 |" in text
    # decode: GB/s, flashgen_s0 as flashgen
    assert "| 8 | 4096 | 2000.0 | 2070.0 | 0.97 |" in text


def test_write_results_csv_json_md(tmp_path):
    meta, rows = synthetic_rows()
    paths = report.write_results(rows, tmp_path / "out", "bench_test", meta)
    assert set(paths) == {"json", "csv", "md"}
    data = json.loads(paths["json"].read_text())
    assert data["meta"] == meta and data["rows"] == rows
    parsed = list(csv.DictReader(io.StringIO(paths["csv"].read_text())))
    assert len(parsed) == len(rows)
    assert list(parsed[0]) == list(report.CSV_FIELDS)
    assert parsed[0]["provider"] == "flashgen" and parsed[0]["spec_sha"] == "abc"
    assert parsed[0]["gpu"] == "Fake GPU" and parsed[0]["torch"] == "2.x"
    assert float(parsed[0]["tflops"]) == rows[0]["tflops"]
    assert parsed[3]["status"].startswith("WRONG") and parsed[3]["ms"] == ""
    assert parsed[-1]["gbps"] == "2070.0"
    md = paths["md"].read_text()
    assert md.startswith("# flashgen bench: Fake GPU, torch 2.x, triton 3.x")


@pytest.mark.parametrize("only", [None, "training", "small", "decode", "mods"])
def test_plot_writes_png_or_skips(tmp_path, capsys, only):
    """Every suite's table gets a plot (not only training's) when matplotlib is there."""
    _, rows = synthetic_rows()
    rows += mods_rows()
    if only:
        rows = [r for r in rows if r["suite"] == only]
    path = report.plot(rows, tmp_path / "p.png")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert path is None
        assert "matplotlib is not installed" in capsys.readouterr().err
    else:
        assert Path(path).read_bytes().startswith(b"\x89PNG")


def test_plot_points_per_suite():
    _, rows = synthetic_rows()
    points = [report.plot_point(r) for r in rows]
    assert points[0] == (("training", "fwd", 128, False, 0), 4096, rows[0]["tflops"], "TFLOP/s")
    assert points[3] is None  # WRONG rows are not plotted
    assert points[4] == (("small", "fwd", 64, True, 0), 8 * 59, 0.02, "ms")
    assert points[6] == (("decode", "fwd", 128, True, 8), 4096, 2000.0, "GB/s")
    mods = mods_rows()
    # the mods suite: a panel per (mode, d, mod), TFLOP/s against N
    assert report.plot_point(mods[0]) == (("mods", "fwd", 128, True, "softcap"), 4096,
                                          mods[0]["tflops"], "TFLOP/s")
    assert len({report.plot_point(r)[0] for r in mods}) == 4


USER_SPEC = """\
package: my_attn
head_dims: [80]
dtypes: [bf16]
masks: [causal]
gpu:
  name: RTX 4090
  sram_bytes: 101376
"""


def test_bench_takes_a_users_spec(tmp_path):
    (tmp_path / "my.yaml").write_text(USER_SPEC)
    res = flashgen("bench", "--dry-run", "--spec", "my.yaml", "--n", "1024", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stdout.splitlines() if x.startswith("  training")]
    # the spec's head dim and only its causal mask, both modes
    assert len(lines) == 2, res.stdout
    assert all("d=80 causal B=16 H=25 N=1024" in x for x in lines), lines
    assert "would write bench_training_my_attn_n1024.json" in res.stdout


@pytest.mark.parametrize("text, args, message", [
    (USER_SPEC.replace("[bf16]", "[fp16]"), (), "add bf16 to `dtypes`"),
    (USER_SPEC, ("--d", "64"), "has head dims [80]"),
    (USER_SPEC, ("--suite", "decode"), "--spec times the training and small suites"),
    (USER_SPEC.replace("head_dims: [80]", "head_dims: [81]"), (), "my.yaml:2"),
])
def test_bench_spec_errors_exit_2(tmp_path, text, args, message):
    (tmp_path / "my.yaml").write_text(text)
    res = flashgen("bench", "--dry-run", "--spec", "my.yaml", *args, cwd=tmp_path)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr and message in res.stderr, res.stderr


def test_bench_missing_spec_says_where_the_examples_are(tmp_path):
    from flashgen.resources import specs_dir
    res = flashgen("bench", "--dry-run", "--spec", "specs/gpt2.yaml", cwd=tmp_path)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (f"--spec specs/gpt2.yaml: no such file (the example specs are in {specs_dir()})"
            in res.stderr), res.stderr


def test_bench_without_spec_rejects_other_head_dims(tmp_path):
    res = flashgen("bench", "--dry-run", "--d", "80", cwd=tmp_path)
    assert res.returncode == 2 and "pass --spec" in res.stderr, res.stderr


def test_bundled_specs_are_found_outside_the_checkout(tmp_path):
    from flashgen.resources import bundled_spec, templates_dir
    for name in (*suites.SPECS.values(), suites.DROPOUT_SPEC):
        assert bundled_spec(name).is_file(), name
    assert (templates_dir() / "fwd.py.j2").is_file()


def test_helpers():
    assert report.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert providers.spec_sha(ROOT / "generated" / "gpt2_attn")  # a hex sha from the header
    assert suites.result_name("training") == "bench_training"
    assert suites.result_name("training", None, [64], ["bwd"]) == "bench_training_bwd_d64"


def test_mods_suite_cases_and_its_flashgen_call_match_its_reference():
    """The mods suite's cases, and, for each, the flashgen call it times (the mods_attn
    package, tiny shapes in the interpreter) against the suite's own float32 reference
    that applies the mod by hand: the bench would report WRONG on a disagreement."""
    import torch

    from flashgen.bench import mods as bench_mods

    cases = suites.plan_cases("mods", ns=[4096], ds=[128], modes=("fwd",))
    assert [c.mod for c in cases] == list(bench_mods.MOD_CASES)
    assert all(c.providers == ("flashgen", "flex") and c.b == 4 and c.h == 16 for c in cases)
    provs = providers.Providers()
    for mod in bench_mods.MOD_CASES:
        case = suites.Case("mods", "fwd", 64, True, 2, 2, 40, mod=mod)
        kw = bench_mods.inputs(mod, case.b, case.h, case.n, "cpu")
        provs._masks[(mod, case.b, case.h, case.n)] = (kw, None)
        fn = provs.get("flashgen", case)
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(2, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
        if mod == "window_sinks":  # a window shorter than the test sequence
            kw.update(window=9)
            bench_mods.WINDOW, saved = 9, bench_mods.WINDOW
        try:
            out = fn(q, k, v, case.causal, 0.0)
            ref = bench_mods.reference(mod, kw, q, k, v)
        finally:
            if mod == "window_sinks":
                bench_mods.WINDOW = saved
        assert (out[:1, :2].float() - ref).abs().max() < 3e-2, mod


# ----------------------------------------------------------------------------------------
# the package's layout: no import cycles, each module importable on its own
# ----------------------------------------------------------------------------------------

BENCH_DIR = ROOT / "flashgen" / "bench"
BENCH_MODULES = sorted(p.stem for p in BENCH_DIR.glob("*.py") if p.stem != "__init__")


def bench_imports(module: str) -> set:
    """The flashgen.bench modules `module` imports, at any depth (a function's lazy import
    counts: the old bench_suite <-> bench_decode cycle was made of those). "__init__" is
    the package itself, the command line."""
    import ast

    tree = ast.parse((BENCH_DIR / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module
            elif node.level == 0 and (node.module or "").startswith("flashgen.bench"):
                base = node.module[len("flashgen.bench."):] or None
            else:
                continue
            if base is None:  # from . import a, b: submodules, or names of __init__
                found |= {a.name if a.name in BENCH_MODULES else "__init__" for a in node.names}
            else:
                found.add(base.split(".")[0])
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("flashgen.bench."):
                    found.add(a.name.split(".")[2])
                elif a.name == "flashgen.bench":
                    found.add("__init__")
    found.discard(module)
    return found


def test_bench_package_has_no_import_cycles():
    graph = {m: bench_imports(m) for m in BENCH_MODULES}
    # the submodules never import the command line (__init__ runs first on any import of
    # the package, so an import of it from a submodule is a cycle in the making)
    assert not [m for m, deps in graph.items() if "__init__" in deps], graph
    assert set().union(*graph.values()) <= set(BENCH_MODULES), graph
    # a topological order exists: peel the modules that import nothing left, repeatedly
    left = dict(graph)
    while left:
        leaves = [m for m, deps in left.items() if not deps & set(left)]
        assert leaves, f"import cycle among {sorted(left)}: {left}"
        for m in leaves:
            del left[m]
    assert "decode" in graph["runner"] and "suites" in graph["providers"]  # the scan sees


@pytest.mark.parametrize("module", ["flashgen.bench"] + [f"flashgen.bench.{m}"
                                                          for m in BENCH_MODULES])
def test_each_bench_module_imports_alone(module):
    """Imported first in a fresh interpreter (no other module's import order to lean on);
    all but decode.py (a GPU measurement that imports torch at the top) leave torch
    unimported, so the dry run and the tuner's use of mods.py stay cheap."""
    code = (f"import sys, {module}; "
            "print('torch' in sys.modules)")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(module == "flashgen.bench.decode"), module
