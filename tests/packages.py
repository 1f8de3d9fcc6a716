"""Build small generated packages for tests and import them.

Each test module builds the spec it needs once into a temporary folder; the package name
is unique per spec so imports never collide in one pytest process."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
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


_COMPILE_VARIANTS = r"""
import importlib, json, sys
from pathlib import Path
from flashgen import families, gluon_compile
from flashgen.offline import mod_arg_types
pkg_dir = Path(sys.argv[1])
sys.path.insert(0, str(pkg_dir.parent))
registry = importlib.import_module(f"{pkg_dir.name}._registry")
out = []
for name, knobs, varlen in json.loads(sys.argv[2]):
    mod = importlib.import_module(f"{pkg_dir.name}.kernels.gluon.{name}")
    facts = registry.VARIANTS[name]
    cfg = dict(families.variant_gluon_default(facts), **knobs)
    res = gluon_compile.compile_variant(mod, name, facts["head_dim"], facts["dtype"], cfg,
                                        mod_arg_types(registry, name)[0], varlen=varlen,
                                        v_dim=facts.get("v_head_dim"))
    out.append(dict(res.__dict__, knobs=knobs))
print(json.dumps(out))
"""


def compile_gluon_variants(pkg, cases) -> list:
    """Compile a built package's Gluon kernels for sm_90 (gluon_compile, outside Triton's
    interpreter, in a subprocess): cases are [variant, knobs over its Gluon default,
    varlen]; one gluon_compile result dict a case (plus its knobs), in order."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_VARIANTS,
                          str(Path(pkg.__file__).parent), json.dumps(cases)],
                         capture_output=True, text=True, env=env,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == len(cases)
    return rows
