"""Where flashgen's data files are, in a checkout and in an installed wheel.

The Jinja templates and the example specs live at the top of the repository
(`templates/`, `specs/`); the wheel ships the same folders inside the package
(`flashgen/templates/`, `flashgen/specs/`, mapped by pyproject.toml). Each lookup takes
the installed copy when there is one and the checkout's otherwise, so `flashgen` works
the same from `pip install .`, `pip install -e .` and `python -m flashgen` in a clone.
"""
from __future__ import annotations

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
CHECKOUT_DIR = PACKAGE_DIR.parent


def _data_dir(name: str) -> Path:
    installed = PACKAGE_DIR / name
    if installed.is_dir():
        return installed
    return CHECKOUT_DIR / name


def templates_dir() -> Path:
    """The folder of Jinja templates (fwd.py.j2, package/*.j2, ...)."""
    return _data_dir("templates")


def specs_dir() -> Path:
    """The folder of the example specs (gpt2.yaml, llama.yaml, ...) and their tuning data."""
    return _data_dir("specs")


def bundled_spec(name: str) -> Path:
    """An example spec by file name, e.g. bundled_spec("gpt2.yaml")."""
    return specs_dir() / name
