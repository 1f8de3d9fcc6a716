"""Every example runs as a user runs it: `python examples/NAME.py` in a fresh process from
another folder, without TRITON_INTERPRET (an example switches the interpreter on itself
when there is no GPU), and exits 0 -- each checks itself against plain PyTorch and prints
its largest error. About 45 s of CPU time for all of them (80 s on 2 busy cores)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = {  # script -> what it must print (its check's line)
    "quickstart.py": "max |flashgen - torch SDPA|",
    "gpt.py": "steps of both models",
    "custom_spec/build_and_call.py": "max |my_attn - PyTorch|",
    "transformers_llama.py": "max |logits fgen - sdpa|",
    "decode_paged.py": "max |flashgen - PyTorch| per call",
    "varlen_training.py": "max |flashgen - PyTorch| / max |PyTorch|",
}


def test_every_example_is_run_here():
    scripts = {p.relative_to(ROOT / "examples").as_posix()
               for p in (ROOT / "examples").rglob("*.py")}
    assert scripts == set(EXAMPLES), "add the new example to EXAMPLES in this file"


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_matches_pytorch(script, tmp_path):
    if script.startswith("transformers") and importlib.util.find_spec("transformers") is None:
        pytest.skip("transformers is not installed (pip install -e '.[dev]' on Python 3.11+)")
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    res = subprocess.run([sys.executable, str(ROOT / "examples" / script)], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, (res.stdout[-2000:], res.stderr[-4000:])
    assert EXAMPLES[script] in res.stdout, res.stdout
