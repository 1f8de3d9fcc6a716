"""The tuner and the Gluon backward, on the CPU: a trial whose config names the Gluon
family runs the package's Gluon backward with that config (its correctness check
included), and the configs the backward's space admits compile for sm_90 within the
shared memory families.bwd_shared_bytes estimates. The space, its pruning reasons and the
warm starts are in test_tune.py."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

pytest.importorskip("optuna")

from flashgen import families  # noqa: E402
from flashgen.measure import Workload  # noqa: E402
from flashgen.space import space_for  # noqa: E402

from packages import build_and_import, gluon_compiles  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
H100 = dict(sram_bytes=232448, sm_count=132, capability=(9, 0))


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    name = f"fgtunegluonbwd_{uuid.uuid4().hex[:8]}"
    pkg = build_and_import(tmp_path_factory.mktemp("tune_gluon_bwd"), name,
                           "head_dims: [128]\ndtypes: [bf16]\nmasks: [causal]\n")
    yield pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


class _Launched(Exception):
    pass


def test_the_tuners_check_runs_the_gluon_backward_a_point_names(pkg, monkeypatch):
    """The check (and the timing) wrap the call in override_config(**point): a Gluon point
    reaches _gluon_backward_plan with its own tile, ring depth and register split, and the
    check's small shape is not sent to `tl` for its size. Here the device-side reasons are
    patched away and the plan is stopped before the launch (no Hopper GPU)."""
    rt = pkg._runtime
    name = "bwd_causal_d128_bf16"
    assert pkg._registry.GLUON[name] is None
    space = space_for("bwd", 128, 2, **H100, gluon=None)
    point = space.config({**families.GLUON_BWD_DEFAULT, "num_stages": 3, "regs": "232/40"})
    assert space.check(point) is None
    planned = []

    def plan(cfg, *args):
        planned.append(dict(cfg))
        raise _Launched

    monkeypatch.setattr(rt, "gluon_backward_reason", lambda *a: None)
    monkeypatch.setattr(rt, "_gluon_backward_plan", plan)
    work = Workload(pkg, name, pkg._registry.VARIANTS[name], 1024, "cpu", check_n=24)
    with pytest.raises(_Launched):
        work.check(point)
    assert planned and {k: planned[0][k] for k in point} == point
    with rt.override_config(**point):
        assert rt._gluon_too_small(2, 2, 24, 24, 128, "causal") is None
    # a `tl` point stays on `tl`
    tl = space.default()
    with rt.override_config(**tl):
        cfg = rt.launch_config(name, torch.device("cpu"), 1024)
    assert cfg["family"] == "tl" and cfg["block_m"] == tl["block_m"]


_COMPILE = r"""
import json, sys
from pathlib import Path
from flashgen import gluon_compile, families
rows = []
for package, variant, extra in json.loads(sys.argv[1]):
    config = {**families.GLUON_BWD_DEFAULT, "kind": "bwd", **extra}
    rows += [r.__dict__ for r in gluon_compile.compile_package(
        Path(package), configs=[config], variants=[variant])]
print(json.dumps(rows))
"""


@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on "
                    "Triton 3.6; another Triton runs the `tl` kernels only")
def test_the_gluon_backward_knobs_compile_within_the_estimate():
    """A 3-deep ring at d=128 (the space's largest tile there: 231520 of 232448 bytes) and
    128 query rows a step at d=64, each with a non-default register split."""
    jobs = [(str(ROOT / "generated" / "llama_attn"), "bwd_d128_bf16",
             {"num_stages": 3, "regs": "232/40"}),
            (str(ROOT / "generated" / "gpt2_attn"), "bwd_d64_bf16",
             {"block_m": 128, "regs": "224/56"})]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, json.dumps(jobs)], capture_output=True,
                         text=True, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert [r["config"] for r in rows] == ["64x128 s3 regs 232/40", "128x128 s2 regs 224/56"]
    for (_, _, extra), r, d in zip(jobs, rows, (128, 64)):
        cfg = {**families.GLUON_BWD_DEFAULT, **extra}
        est = families.bwd_shared_bytes(d, 2, cfg["block_m"], cfg["num_stages"])
        assert 0 < est - r["shared"] <= 1024 and r["shared"] <= H100["sram_bytes"], r
        assert r["wgmma"] > 0 and set(families.regs(cfg)) <= set(r["setmaxnreg"]), r
        assert r["spill_bytes"] <= 160, r   # ptxas's stack frame: 112 and 152 measured
