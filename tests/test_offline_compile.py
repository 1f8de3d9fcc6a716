"""The shipped specs for other GPUs (specs/gpus/) compiled offline, without their GPU, for
their architecture with Triton's bundled ptxas: every fwd/bwd kernel's shared memory must
stay within the spec's budget (no "OutOfResources: shared memory" on that GPU), and no
kernel may spill more registers than the committed baseline (tests/data/offline_*.json,
regenerate with `python -m flashgen.offline SPEC --arch N --json FILE`).

The baselines are not zero: the planner's register model was calibrated on the H100 and
its tiles spill on sm_80/sm_89 (docs/OTHER_GPUS.md), so this guards against regressions
while that is open. Slow (about 1.5 minutes for both specs on 2 cores): `pytest -n 2 -m slow`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CASES = [("a100.yaml", 80, "offline_a100_sm80.json"),
         ("rtx4090.yaml", 89, "offline_rtx4090_sm89.json")]


@pytest.mark.slow
@pytest.mark.parametrize("spec, arch, baseline", CASES, ids=["a100-sm80", "rtx4090-sm89"])
def test_kernels_fit_the_budget_offline(tmp_path, spec, arch, baseline):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["TRITON_CACHE_DIR"] = str(tmp_path / "cache")
    out = tmp_path / "resources.json"
    res = subprocess.run([sys.executable, "-m", "flashgen.offline", str(ROOT / "specs" / "gpus" / spec),
                          "--arch", str(arch), "--json", str(out)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = json.loads(out.read_text())
    base = {(r["variant"], r["function"]): r for r in
            json.loads((ROOT / "tests" / "data" / baseline).read_text())}
    assert {(r["variant"], r["function"]) for r in rows} == set(base), \
        "the spec's kernels changed: regenerate the baseline"
    over = [f"{r['variant']}.{r['function']} {r['config']}: {r['shared']} B > {r['budget']} B"
            for r in rows if r["shared"] > r["budget"]]
    assert not over, "shared memory over the spec's budget: " + "; ".join(over)
    worse = [f"{r['variant']}.{r['function']} {r['config']}: {r['spill_stores']} B spilled, "
             f"baseline {base[(r['variant'], r['function'])]['spill_stores']} B"
             for r in rows if r["spill_stores"] > base[(r["variant"], r["function"])]["spill_stores"]]
    assert not worse, "more register spills than the baseline: " + "; ".join(worse)
    assert all(r["registers"] > 0 for r in rows), "ptxas reported no register count"
