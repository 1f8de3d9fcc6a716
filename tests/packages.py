"""Build small generated packages for tests and import them.

Each test module builds the spec it needs once into a temporary folder; the package name
is unique per spec so imports never collide in one pytest process."""
from __future__ import annotations

import importlib
import sys
import textwrap
from pathlib import Path

from flashgen.build import build


def build_and_import(root: Path, package: str, body: str):
    """Write a spec named `package` with the given YAML body (everything but `package`
    and `gpu`), build it under root and import it."""
    spec = root / f"{package}.yaml"
    spec.write_text(f"package: {package}\n" + textwrap.dedent(body) + textwrap.dedent("""
        gpu:
          name: H100
          sram_bytes: 232448
          sm_count: 132
        """))
    out = root / "out"
    build(spec, out)
    if str(out) not in sys.path:
        sys.path.insert(0, str(out))
    return importlib.import_module(package)


def gluon_compiles() -> bool:
    """Whether this Triton is one the Gluon templates are verified on (families.GLUON_TRITON;
    CI pins it), so their offline sm_90 compile tests can run; another Triton runs the `tl`
    kernels only."""
    import triton

    from flashgen import families

    return families.triton_ok(triton.__version__)
