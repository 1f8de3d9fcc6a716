"""The packed-batch (VARLEN=True) `tl` kernels compile for sm_90 offline (no GPU needed),
at the planner's tiles of the llama spec, into the dense kernels' shared memory; the
forward and dQ kernels spill no more than the dense ones (none). The dK/dV kernel at the
planner's 64 x 128 tile spills in both forms already (728 B dense, 980 B varlen when this
was written: its Q/dO/LSE/D row pointers depend on the loaded sequence start, so they
cannot be rematerialised from kernel parameters): only its compilation is asserted.
Slow (about a minute): `pytest -m slow`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = r"""
import importlib, json, sys, tempfile
from pathlib import Path
from flashgen import planner_core
from flashgen.build import build_spec
from flashgen.offline import _launches, compile_kernel
from flashgen.plan import plan_spec
from flashgen.spec import load_spec

spec = load_spec(sys.argv[1])
out = Path(tempfile.mkdtemp())
build_spec(spec, out)
sys.path.insert(0, str(out))
rows = []
for variant, plan in plan_spec(spec).items():
    if variant.name not in ("fwd_causal_d128_bf16", "bwd_causal_d128_bf16"):
        continue
    module = importlib.import_module(f"{spec.package}.kernels.{variant.name}")
    for function, constexprs, warps, stages in _launches(variant.kind, plan.chosen.as_dict(), ()):
        if function == "preprocess":
            continue
        fn = getattr(module, f"{variant.name}_{function}")
        for varlen in (False, True):
            cx = dict(constexprs)
            extra = None
            if varlen:
                del cx["CU_Q"], cx["CU_K"]
                cx["VARLEN"] = True
                extra = {"CU_Q": "*i32", "CU_K": "*i32"}
            shared, regs, stores, loads = compile_kernel(fn, "bf16", cx, warps, stages, 90, extra)
            rows.append(dict(function=f"{variant.name}.{function}", varlen=varlen,
                             shared=shared, regs=regs, spills=stores + loads))
print(json.dumps(rows))
"""


@pytest.mark.slow
def test_varlen_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(ROOT / "specs" / "llama.yaml")],
                         env=env, cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(res.stdout.strip().splitlines()[-1])
    assert len(rows) == 6
    dense = {r["function"]: r for r in rows if not r["varlen"]}
    for r in rows:
        if r["varlen"]:
            d = dense[r["function"]]
            assert r["shared"] <= d["shared"], r
            if not r["function"].endswith("dkdv_kernel"):
                assert r["spills"] <= d["spills"], r
