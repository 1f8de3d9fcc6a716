"""The generated packages `flashgen selftest` runs its cases on, built from the specs that
ship with flashgen and cached between runs.

Every package is built from a bundled spec (`flashgen.resources.bundled_spec`: the wheel's
copy when installed, the checkout's otherwise -- never tests/ or generated/, which a wheel
does not have) under a name of its own, `fgst_<key>`, so that it can share a process with
the user's or the test suite's build of the same spec (`generated/gpt2_attn` and ours are
different modules; the custom-op namespaces differ too). The bundled tuning data is kept:
the fuzzer should run the launch configs a user's package runs.

Cache: `$FLASHGEN_SELFTEST_CACHE`, else `~/.cache/flashgen/selftest/`, in a folder named
by flashgen's version and a hash of everything a build reads (the specs, their tuning
files, the templates and flashgen's own modules), so an edit to any of them builds afresh.
A package is built only when its folder is missing (~2 s a spec), into a temporary folder
renamed into place, under a file lock: parallel workers never see half a package.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import os
import re
import sys
import tempfile
from pathlib import Path
from types import ModuleType

from .. import __version__
from ..resources import PACKAGE_DIR, bundled_spec, templates_dir

# key -> the bundled spec it is built from (flashgen/specs/*.yaml in a wheel)
SPECS = {
    "gpt2": "gpt2.yaml",        # d 64, fp16/bf16/fp32, none/causal, dropout, MHA
    "llama": "llama.yaml",      # d 128, GQA, sliding windows, decode
    "mla": "mla.yaml",          # {qk: 192, v: 128} training and decode, 576/512 latent decode
    "mods": "mods.yaml",        # every built-in mod, attn_mask, decode with mods
    "selftest": "selftest/selftest.yaml",  # d 80/96, fp32 with GQA, dropout with GQA and windows
}
PREFIX = "fgst_"
CACHE_ENV = "FLASHGEN_SELFTEST_CACHE"


def module_name(key: str) -> str:
    """The import name of a selftest package: fgst_gpt2, fgst_selftest, ..."""
    return PREFIX + key


def _spec_package(text: str) -> str:
    match = re.search(r"(?m)^package:\s*([A-Za-z_][A-Za-z0-9_]*)", text)
    if match is None:
        raise ValueError("a bundled spec without a `package:` line")
    return match.group(1)


def _inputs_hash() -> str:
    """A short hash of every file a build reads: the bundled specs and their tuning data,
    the templates and flashgen's modules (an editable install changes them without a new
    version)."""
    h = hashlib.sha256()
    files = []
    for name in SPECS.values():
        path = bundled_spec(name)
        files.append(path)
        tuning = path.parent / "tuning" / _spec_package(path.read_text())
        if tuning.is_dir():
            files += sorted(tuning.glob("*.json"))
    files += sorted(templates_dir().rglob("*.j2"))
    files += sorted(PACKAGE_DIR.glob("*.py"))
    for path in files:
        h.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def cache_dir() -> Path:
    """The folder the selftest packages live in (created on demand)."""
    root = os.environ.get(CACHE_ENV) or str(Path.home() / ".cache" / "flashgen" / "selftest")
    return Path(root) / f"{__version__}-{_inputs_hash()}"


@contextlib.contextmanager
def _locked(folder: Path):
    """An exclusive lock on `folder` across processes (POSIX; elsewhere none: a concurrent
    build then at worst renders the same files twice)."""
    folder.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(folder / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build(key: str, root: Path) -> None:
    """Render the bundled spec `key` as package fgst_<key> into root/fgst_<key>."""
    from ..emit import emit
    from ..plan import plan_spec
    from ..render import render_package
    from ..spec import parse_spec
    from ..tuning_data import load_tuned

    path = bundled_spec(SPECS[key])
    text = path.read_text()
    original = _spec_package(text)
    name = module_name(key)
    spec = parse_spec(re.sub(r"(?m)^package:\s*\S+", f"package: {name}", text, count=1),
                      str(path))
    plans = plan_spec(spec)
    # the tuning data is filed under the spec's own package name
    tuned, info = load_tuned(spec, plans, folder=path.parent / "tuning" / original)
    files = render_package(spec, plans, tuned, info)
    with tempfile.TemporaryDirectory(prefix=f".{name}-", dir=root) as tmp:
        emit(files, Path(tmp) / name)
        os.replace(Path(tmp) / name, root / name)


def ensure_built(keys=None) -> Path:
    """Build the packages `keys` (default: all of SPECS) that the cache lacks; returns the
    cache folder."""
    keys = list(SPECS) if keys is None else list(keys)
    unknown = [k for k in keys if k not in SPECS]
    if unknown:
        raise ValueError(f"unknown selftest package(s) {unknown}: expected some of {list(SPECS)}")
    root = cache_dir()
    if all((root / module_name(k) / "__init__.py").is_file() for k in keys):
        return root
    with _locked(root):
        for key in keys:
            if not (root / module_name(key) / "__init__.py").is_file():
                _build(key, root)
    return root


def selftest_packages(device=None, keys=None) -> dict[str, ModuleType]:
    """{key: imported package} for the selftest packages (`keys`, default all of SPECS),
    built into the cache first where missing. `device` ("cpu" or "cuda"; None: cuda when
    there is one): on the CPU the kernels run in Triton's interpreter, which must be on
    before triton is imported -- it is switched on here when triton is not imported yet,
    and a RuntimeError says so when it is too late."""
    import torch  # (torch does not import triton)

    device = str(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.startswith("cpu"):
        require_interpreter()
    root = ensure_built(keys)
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return {key: importlib.import_module(module_name(key))
            for key in (list(SPECS) if keys is None else keys)}


def require_interpreter() -> None:
    """Switch Triton's CPU interpreter on (kernels on CPU tensors need it), or raise if
    triton was imported without it."""
    if "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "CPU cases run in Triton's interpreter, which must be switched on before triton "
            "is imported: run with TRITON_INTERPRET=1 in the environment")
