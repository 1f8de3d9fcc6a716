"""Build examples/custom_spec/my_attn.yaml with flashgen's Python API into a temporary
folder, import the package it wrote, call it, and check it against plain PyTorch.

    python examples/custom_spec/build_and_call.py

The same as `flashgen build examples/custom_spec/my_attn.yaml --out DIR` and then
`import my_attn` with DIR on sys.path; a program does it in three steps: load_spec (a
typed, immutable spec, or a SpecError naming the file:line of a bad key), build_spec
(plan, render, write DIR/my_attn/) and an import. Runs on a GPU when there is one,
otherwise in Triton's CPU interpreter (about 10 seconds).
"""
import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))  # flashgen from this checkout, if not installed

from flashgen.build import build_spec  # noqa: E402
from flashgen.spec import load_spec  # noqa: E402


def reference(q, k, v, window_left=None, cap=None):
    """Plain PyTorch in float32, q (B, N, Hq, d) and k, v (B, N, Hkv, d) as flash-attn
    takes them: causal, optionally only the last window_left + 1 keys, optionally
    soft-capped scores (Gemma 2: cap * tanh(score / cap), after the 1/sqrt(d) scale)."""
    q, k, v = (t.float().transpose(1, 2) for t in (q, k, v))  # (B, H, N, d)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if cap is not None:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(q.shape[2], device=q.device)[:, None]
    j = torch.arange(k.shape[2], device=q.device)[None, :]
    visible = j <= i
    if window_left is not None:
        visible &= j >= i - window_left
    s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


def main() -> int:
    spec = load_spec(HERE / "my_attn.yaml")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    worst = 0.0
    with tempfile.TemporaryDirectory(prefix="flashgen-example-") as out:
        report = build_spec(spec, Path(out))
        print(report.summary())
        sys.path.insert(0, out)
        my_attn = importlib.import_module(spec.package)

        torch.manual_seed(0)
        q = torch.randn(2, 40, 8, 32, device=device, dtype=dtype)  # (B, N, Hq, d)
        k, v = (torch.randn(2, 40, 2, 32, device=device, dtype=dtype) for _ in range(2))
        cap = dict(spec.mods[0].params)["cap"]  # 20.0: a call that passes no `cap` gets it
        calls = {
            "causal": (my_attn.flash_attn_func(q, k, v, causal=True), reference(q, k, v)),
            "window 16 + softcap": (
                my_attn.flash_attn_func(q, k, v, window_size=(16, 0), mods=("softcap",)),
                reference(q, k, v, window_left=16, cap=cap)),
        }
        for name, (got, want) in calls.items():
            err = (got.float() - want).abs().max().item()
            worst = max(worst, err)
            print(f"{name:20s} on {device} ({dtype}): max |my_attn - PyTorch| = {err:.2e}")
        sys.path.remove(out)
    return 0 if worst < tol else 1


if __name__ == "__main__":
    sys.exit(main())
