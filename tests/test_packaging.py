"""pyproject.toml against the tree: every folder the wheel must carry is a listed package.

setuptools ships a data file only from a folder listed in `packages` (one that is not
gets a "Package would be ignored" warning per folder today, and its files dropped
later), so a new folder of templates, specs or tuning files, or a new subpackage of
flashgen, must be added there. Building the wheel itself is .ci/run's third stage.
"""
from __future__ import annotations

import fnmatch
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_folder_the_wheel_needs_is_a_listed_package():
    st = pyproject()["tool"]["setuptools"]
    listed = set(st["packages"])
    globs = st["package-data"]["*"]
    expected = {"flashgen"} | {
        "flashgen." + ".".join(p.parent.relative_to(ROOT / "flashgen").parts)
        for p in (ROOT / "flashgen").rglob("__init__.py") if p.parent != ROOT / "flashgen"}
    for package, folder in st["package-dir"].items():
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and "__pycache__" not in f.parts:
                assert any(fnmatch.fnmatch(f.name, g) for g in globs), (
                    f"{f.relative_to(ROOT)} matches no package-data glob {globs}: add its "
                    "extension to [tool.setuptools.package-data] in pyproject.toml")
                rel = f.parent.relative_to(ROOT / folder).parts
                expected.add(".".join((package, *rel)))
    missing, extra = sorted(expected - listed), sorted(listed - expected)
    assert not missing, (f"add {missing} to [tool.setuptools] packages in pyproject.toml "
                         "(their files would not be in the wheel)")
    assert not extra, f"pyproject.toml lists packages with no folder or files: {extra}"


def test_license_is_declared():
    project = pyproject()["project"]
    assert project["license"] == "MIT" and project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
