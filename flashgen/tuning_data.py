"""Tuning results as data: one reviewable JSON file per (package, GPU model).

    specs/tuning/<package>/<gpu-key-slug>.json      (next to the spec: <spec dir>/tuning/...)

    {
      "configs": {                                   # variant -> bucket -> winner
        "fwd_causal_d64_bf16": {
          "1024": {"block_m": 128, "block_n": 64, "num_stages": 3, "num_warps": 4,
                   "default_ms": 0.2101, "ms": 0.1893},
          ...
        }
      },
      "gpu": {"capability": [9, 0], "key": "NVIDIA H100 80GB HBM3|sm90|132sm",
              "name": "NVIDIA H100 80GB HBM3", "sm_count": 132},
      "spec_sha": "56592f9e7964",
      "versions": {"flashgen": "0.1.0", "torch": "2.13.0", "triton": "3.9.0"}
    }

Keys are sorted (buckets numerically), the text is indented and ends in a newline, and
times are rounded to 0.1 us, so writing the same results twice gives the same bytes and a
re-tune shows up as a small diff. A new tune updates only the (variant, bucket) entries it
studied. `flashgen build` embeds every file of the package into the generated package's
TUNED table (configs only), keyed by the GPU key; the runtime does the rest.

Standard library only: `flashgen build` must not need Optuna or a GPU.
"""
from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Iterable, Mapping

from .space import knob_defaults, knob_names

META_KEYS = ("ms", "default_ms")   # the non-config fields of an entry
MS_DIGITS = 4                      # ms rounded to 0.1 us: stable bytes, still 3 digits


class TuningDataWarning(UserWarning):
    """Tuning data the build cannot use (an unknown variant, an unreadable file)."""


def slug(gpu_key: str) -> str:
    """'NVIDIA H100 80GB HBM3|sm90|132sm' -> 'nvidia-h100-80gb-hbm3-sm90-132sm'."""
    return re.sub(r"[^a-z0-9]+", "-", gpu_key.lower()).strip("-") or "gpu"


def tuning_dir(spec) -> Path:
    """Where a spec's tuning files live: <spec dir>/tuning/<package>/."""
    return Path(spec.path).parent / "tuning" / spec.package


def tuning_path(spec, gpu_key: str) -> Path:
    return tuning_dir(spec) / f"{slug(gpu_key)}.json"


# ----------------------------------------------------------------------------------------
# writing
# ----------------------------------------------------------------------------------------

def _sort_key(key: str):
    return (0, int(key), "") if key.isdigit() else (1, 0, key)


def _canonical(value):
    """Dicts with sorted keys (numeric strings numerically), tuples as lists, floats that
    are whole numbers as ints."""
    if isinstance(value, Mapping):
        return {str(k): _canonical(value[k]) for k in sorted(value, key=lambda k: _sort_key(str(k)))}
    if isinstance(value, (list, tuple)):
        return [_canonical(v) for v in value]
    if isinstance(value, float) and value.is_integer() and not isinstance(value, bool):
        return int(value)
    return value


def dumps(data: Mapping) -> str:
    """The file's text: canonical, indented, newline-terminated."""
    return json.dumps(_canonical(data), indent=2, sort_keys=False, ensure_ascii=True) + "\n"


def entry(config: Mapping[str, Any], ms: float | None, default_ms: float | None) -> dict:
    """One winner: its config plus its time and the untuned (planner) config's time."""
    out = {k: v for k, v in config.items() if k not in META_KEYS}
    out["ms"] = None if ms is None else round(float(ms), MS_DIGITS)
    out["default_ms"] = None if default_ms is None else round(float(default_ms), MS_DIGITS)
    return out


def read(path: Path) -> dict:
    return json.loads(Path(path).read_text())


def merge(old: Mapping | None, *, gpu: Mapping, versions: Mapping, spec_sha: str,
          results: Mapping[str, Mapping[int, Mapping]]) -> dict:
    """`old` (a file's data or None) updated with `results` {variant: {bucket: entry}}:
    studied entries are replaced, the others kept; gpu/versions/spec_sha are the new ones."""
    configs = {v: dict(b) for v, b in (old or {}).get("configs", {}).items()}
    for variant, buckets in results.items():
        table = configs.setdefault(variant, {})
        for bucket, value in buckets.items():
            table[str(int(bucket))] = dict(value)
    return {"gpu": dict(gpu), "versions": dict(versions), "spec_sha": spec_sha,
            "configs": configs}


def write(path: Path, data: Mapping) -> bool:
    """Write `data` canonically, atomically; False if the file already had these bytes."""
    path = Path(path)
    text = dumps(data)
    if path.exists() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return True


def update(path: Path, *, gpu: Mapping, versions: Mapping, spec_sha: str,
           results: Mapping[str, Mapping[int, Mapping]]) -> dict:
    """Merge `results` into the file at `path` (created if missing); returns the data."""
    path = Path(path)
    old = read(path) if path.exists() else None
    data = merge(old, gpu=gpu, versions=versions, spec_sha=spec_sha, results=results)
    write(path, data)
    return data


# ----------------------------------------------------------------------------------------
# reading for the build
# ----------------------------------------------------------------------------------------

# Knobs an older entry may lack and keep lacking: an entry without `family` was tuned
# before the Gluon family existed, and the package reads that absence (on a GPU the Gluon
# kernels run on, it takes the Gluon default over that `tl`-only winner).
UNFILLED = ("family", "pingpong", "l2_share", "persistent", "regs", "q_buffers", "overlap",
            "diag_first", "stream_k", "persistent_bwd")


def _config_only(kind: str, value: Mapping) -> dict:
    """The launch config of an entry: the kind's names, knobs missing from older data
    filled with their defaults (but see UNFILLED), whole numbers as ints."""
    defaults = knob_defaults(kind)
    out = {}
    for name in knob_names(kind):
        if name in UNFILLED and name not in value:
            continue
        v = value.get(name, defaults.get(name))
        if v is None:
            raise ValueError(f"missing {name}")
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        out[name] = v
    return out


def load_tuned(spec, variants: Iterable, folder: Path | None = None,
               warn=None) -> tuple[dict, dict]:
    """Every tuning file of the spec's package, as (TUNED, info):

    TUNED {gpu key: {variant: {bucket (int): config}}} for the package's `_registry`;
    info  {gpu key: {"triton", "torch", "flashgen", "spec_sha", "variants", "buckets"}}
    for `describe()`. `variants` are the spec's Variant objects (or anything with .name and
    .kind); entries for other variants are dropped with a TuningDataWarning."""
    folder = tuning_dir(spec) if folder is None else Path(folder)
    warn = warn or (lambda msg: warnings.warn(msg, TuningDataWarning, stacklevel=3))
    kinds = {v.name: v.kind for v in variants}
    tuned: dict = {}
    info: dict = {}
    if not folder.is_dir():
        return tuned, info
    for path in sorted(folder.glob("*.json")):
        try:
            data = read(path)
            key = data["gpu"]["key"]
            configs = data["configs"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            warn(f"{path}: not a flashgen tuning file ({type(e).__name__}: {e}); ignored")
            continue
        table = tuned.setdefault(key, {})
        for variant in sorted(configs):
            if variant not in kinds:
                warn(f"{path}: variant {variant} is no longer in {Path(spec.path).name}; "
                     "its tuned configs are dropped")
                continue
            for bucket in sorted(configs[variant], key=lambda b: int(b)):
                try:
                    cfg = _config_only(kinds[variant], configs[variant][bucket])
                except (ValueError, TypeError, AttributeError) as e:
                    warn(f"{path}: {variant} bucket {bucket}: {e}; ignored")
                    continue
                table.setdefault(variant, {})[int(bucket)] = cfg
        if not table:
            del tuned[key]
            continue
        versions = data.get("versions", {})
        info[key] = {
            "triton": versions.get("triton"), "torch": versions.get("torch"),
            "flashgen": versions.get("flashgen"), "spec_sha": data.get("spec_sha"),
            "variants": len(table), "buckets": sum(len(b) for b in table.values()),
        }
    # stable order: GPU keys, then the spec's variant order, then buckets ascending
    order = list(kinds)
    tuned = {k: {v: dict(sorted(tuned[k][v].items())) for v in order if v in tuned[k]}
             for k in sorted(tuned)}
    info = {k: info[k] for k in sorted(info)}
    return tuned, info
