"""Stage 4, verify: `flashgen check` builds a spec into a temporary folder, imports the
package and compares every forward variant with the float64 reference on fresh random
inputs -- on the GPU when there is one, otherwise in Triton's CPU interpreter.

It is the same comparison the test suite makes, packaged for a user who has edited a spec
and wants to know the kernels they are about to ship are right on their machine.
"""
from __future__ import annotations

import importlib
import os
import sys
import tempfile
from pathlib import Path

from .build import build_spec
from .spec import load_spec
from .variants import variants_for

# dtype -> max |out - ref| allowed, relative to max(1, |ref|); see tests/conftest.py
_TOL = {"fp32": 1e-4, "fp16": 4e-3, "bf16": 3e-2}


def _cases(spec, variant, quick: bool):
    """(label, B, Nq, Nk, Hq, Hkv, causal, window) to run for a variant."""
    h_kv = 1 if spec.gqa else 2
    causal = variant.mask == "causal"
    window = (-1, -1)
    if variant.mask == "sliding_window":
        window = (spec.window.left, spec.window.right)
        # keep the window inside the short test sequences so both edges are exercised
        window = tuple(min(w, 24) if w >= 0 else w for w in window)
    cases = [("N=67", 2, 67, 67, 2 * h_kv, h_kv, causal, window)]
    if not quick:
        cases += [
            ("N=1", 1, 1, 1, 2 * h_kv, h_kv, causal, window),
            ("Nq=40,Nk=150", 1, 40, 150, 2 * h_kv, h_kv, causal, window),
            ("Nq=150,Nk=40", 1, 150, 40, 2 * h_kv, h_kv, causal, window),
        ]
    return cases


def check(spec_path, quick: bool = False, out=sys.stdout) -> bool:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    from .reference import attention_ref, visible_mask

    spec = load_spec(spec_path)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
    where = "GPU " + torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"checking {spec.package} from {spec_path} on {where}", file=out)
    ok_all = True
    with tempfile.TemporaryDirectory(prefix="flashgen-check-") as tmp:
        build_spec(spec, Path(tmp))
        sys.path.insert(0, tmp)
        try:
            sys.modules.pop(spec.package, None)
            pkg = importlib.import_module(spec.package)
            for variant in variants_for(spec):
                if variant.kind != "fwd":
                    continue
                for label, b, n_q, n_k, h_q, h_kv, causal, window in _cases(spec, variant, quick):
                    dt = dtypes[variant.dtype]
                    q = torch.randn(b, n_q, h_q, variant.head_dim, dtype=dt, device=device)
                    k, v = (torch.randn(b, n_k, h_kv, variant.head_dim, dtype=dt, device=device)
                            for _ in range(2))
                    o, lse = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window,
                                                 return_lse=True)
                    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
                    ref, ref_lse = attention_ref(q.transpose(1, 2), k.transpose(1, 2),
                                                 v.transpose(1, 2), vis)
                    o = o.transpose(1, 2).double().cpu()
                    err = ((o - ref.cpu()).abs() / ref.cpu().abs().clamp(min=1)).max().item()
                    finite = torch.isfinite(ref_lse.cpu())
                    lse_ok = torch.equal(torch.isfinite(lse.cpu()), finite)
                    ok = err <= _TOL[variant.dtype] and lse_ok and not torch.isnan(o).any()
                    ok_all &= ok
                    print(f"  {'ok  ' if ok else 'FAIL'} {variant.name:<34} {label:<14} "
                          f"max err {err:.2e} (tol {_TOL[variant.dtype]:.0e})", file=out)
        finally:
            sys.path.remove(tmp)
            for name in [m for m in sys.modules if m == spec.package or m.startswith(spec.package + ".")]:
                del sys.modules[name]
    print("all variants match the float64 reference" if ok_all else "some variants FAILED",
          file=out)
    return ok_all
