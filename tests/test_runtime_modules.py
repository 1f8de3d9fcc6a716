"""Source files stay short enough to read, and the generated package's runtime, split into
modules by concern, still behaves as the one `_runtime` module the rest of the package, the
tests and applications use (templates/package/runtime.py.j2)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from packages import build_and_import

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 1000


def test_no_source_file_is_over_a_thousand_lines():
    files = [*(ROOT / "flashgen").rglob("*.py"), *(ROOT / "templates" / "package").glob("*.j2")]
    assert files
    long = {str(f.relative_to(ROOT)): n for f in files
            if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines (split them along a seam): {long}"


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("parts"), "fg_test_parts", """
        head_dims: [32]
        dtypes: [fp32]
        masks: [none, causal]
        dropout: true
        """)


def parts(pkg):
    return pkg._runtime._PARTS


def test_every_name_of_the_runtime_modules_is_one_of_runtime(pkg):
    rt = pkg._runtime
    for part in parts(pkg):
        for name, value in vars(part).items():
            if not name.startswith("__"):
                assert getattr(rt, name) is value, f"{part.__name__}.{name}"
    # a name means one thing across the modules
    for name in {n for p in parts(pkg) for n in vars(p) if not n.startswith("__")}:
        holders = {id(vars(p)[name]) for p in parts(pkg) if name in vars(p)}
        assert len(holders) == 1 or name in rt._REBOUND, name


def test_names_a_module_rebinds_are_read_from_it(pkg):
    """A `global` name is rebound in its module, so a copy on _runtime or in another module
    would go stale: each is in _REBOUND, bound at the top level of exactly one module."""
    rt = pkg._runtime
    rebound = set()
    for part in parts(pkg):
        for node in ast.walk(ast.parse(Path(part.__file__).read_text())):
            if isinstance(node, ast.Global):
                rebound.update(node.names)
    assert rebound == set(rt._REBOUND)
    for name in rebound:
        assert sum(name in vars(p) for p in parts(pkg)) == 1, name
        assert name not in vars(rt) and name in dir(rt)
    rt.use_family("tl")
    try:
        assert rt._FORCED_FAMILY == "tl"
    finally:
        rt.use_family("")
    assert rt._FORCED_FAMILY == ""


def test_an_assignment_on_runtime_reaches_the_modules_that_read_it(pkg, monkeypatch):
    rt = pkg._runtime
    monkeypatch.setattr(rt, "VARLEN_GLUON_DROPOUT", False)
    assert pkg._varlen.VARLEN_GLUON_DROPOUT is False
    assert pkg._varlen_backward.VARLEN_GLUON_DROPOUT is False
    monkeypatch.undo()
    assert pkg._varlen.VARLEN_GLUON_DROPOUT is pkg._varlen_backward.VARLEN_GLUON_DROPOUT is True

    def spy(*args, **kwargs):
        raise AssertionError("spied")
    monkeypatch.setattr(rt, "kernel", spy)
    assert pkg._forward.kernel is pkg._backward.kernel is pkg._launch.kernel is spy
    before = pkg._launch._launch_hooks
    monkeypatch.setattr(rt, "_launch_hooks", "hooks")  # a rebound name: its module's
    assert pkg._launch._launch_hooks == rt._launch_hooks == "hooks"
    assert "_launch_hooks" not in vars(rt)
    monkeypatch.undo()  # (pytest restores it through the property, not by deleting it)
    assert pkg._launch._launch_hooks is rt._launch_hooks is before
    assert pkg._forward.kernel is pkg._launch.kernel is rt.kernel is not spy
    rt.brand_new = 1  # a name no module holds stays on _runtime
    assert rt.brand_new == 1 and not any(hasattr(p, "brand_new") for p in parts(pkg))
    del rt.brand_new
