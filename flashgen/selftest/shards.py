"""The GPU test suite cut into named shards, so that one shard can be re-run alone
(`flashgen selftest --only decode`) and a hang or a crash costs one shard, not the run.

A shard is a group of test files. Its single-GPU part runs as one `python -m pytest -m
"gpu and not multigpu" FILES -n W` process (runner.py); files with `multigpu` tests form
its second part, run without xdist on a machine with 2 or more GPUs.

Every file under tests/ that holds gpu tests belongs to exactly one shard: a gpu test in a
file no shard names would never run in `flashgen selftest`. tests/test_selftest_cli.py
checks this by scanning tests/ the way `gpu_test_files` does (and against pytest's own
collection), so a new GPU test file fails CI until it is given a shard here.

`est_s` is the shard's wall time at the default settings with a cold Triton cache: the
run's --budget starts a shard only when its estimate fits the time left, and its default
timeout is 3x the estimate. They are the measured seconds of the newest full run in
docs/TESTING.md's "Last green" table (5cfc9d0 on nvidia-h200-x4, one shard a GPU, 8
workers: benchmarks/results/nvidia-h200-x4/selftest_shards.txt); update them from a
measured run (selftest.json's `seconds`) when they drift.
"""
from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import FlashgenError


@dataclass(frozen=True)
class Shard:
    name: str
    about: str
    files: tuple[str, ...]              # single-GPU tests, under xdist
    est_s: int                          # wall seconds of a measured run at the defaults
    multigpu_files: tuple[str, ...] = ()  # `multigpu` tests: >= 2 GPUs, no xdist
    multigpu_est_s: int = 0
    max_workers: int | None = None      # a shard of a few big tests gains nothing from 4

    def timeout_s(self) -> int:
        return max(180, 3 * self.est_s)

    def multigpu_timeout_s(self) -> int:
        return max(180, 3 * self.multigpu_est_s)

    def all_files(self) -> tuple[str, ...]:
        return self.files + tuple(f for f in self.multigpu_files if f not in self.files)


SHARDS: tuple[Shard, ...] = (
    Shard("tl", "the `tl` family: forward, backward, dropout, varlen, the nn.Module, the host "
          "path, head dims past 256, fp8 inputs", ("tests/test_forward.py", "tests/test_backward.py",
                                       "tests/test_dropout.py", "tests/test_varlen.py",
                                       "tests/test_module.py", "tests/test_host_path.py",
                                       "tests/test_head_dim_512.py", "tests/test_fp8.py"),
          est_s=180),
    # (test_gluon_fp8.py joined after the measured run: est_s + 65, a guess from its ~60
    # forward cases, until a run measures it)
    Shard("gluon-fwd", "the Gluon forward (Hopper): tiles, knobs, stream-K, scratch, graphs, "
          "the large head dims (256, qk 192 / v 128), fp8 inputs",
          ("tests/test_gluon.py", "tests/test_gluon_large_dims.py", "tests/test_gluon_fp8.py",
           "tests/test_gluon_d512.py"),
          est_s=300),
    Shard("gluon-bwd", "the Gluon backward, dense and with mods (persistent block lists), "
          "the large head dims' (256, qk 192 / v 128)",
          # (est_s: 185 measured; the large head dims' 60 tests guessed at +100 until run)
          ("tests/test_gluon_bwd.py", "tests/test_gluon_bwd_mods.py"), est_s=285),
    Shard("gluon-dropout", "the Gluon forward and backward with dropout (Philox in registers)",
          ("tests/test_gluon_dropout.py",), est_s=125),
    Shard("gluon-varlen", "the Gluon forward and backward on packed ragged batches",
          ("tests/test_gluon_varlen.py",), est_s=400),
    Shard("mods", "score, mask and sink mods, dense and varlen",
          ("tests/test_mods.py", "tests/test_varlen_mods.py"), est_s=215),
    # (test_batch_invariant.py's 40 s on top of the measured 135 is an estimate)
    Shard("decode", "flash_attn_with_kvcache: split-KV, paged caches, appends, rotary, "
          "quantized (fp8 / int8) caches; chunked prefill over pages; batch_invariant",
          ("tests/test_decode.py", "tests/test_decode_rotary.py", "tests/test_kv_quant.py",
           "tests/test_paged_prefill.py", "tests/test_batch_invariant.py"), est_s=175),
    Shard("mla", "MLA head dims: training, the latent decode (Gluon 576/512)",
          ("tests/test_mla.py",), est_s=90),
    Shard("ring", "context parallelism: the pieces and merge_attention_states on one GPU, the "
          "ring on 2 GPUs (NCCL)", ("tests/test_ring_pieces_gpu.py", "tests/test_merge.py"),
          est_s=85,
          multigpu_files=("tests/test_ring_gpu.py",), multigpu_est_s=210),
    # tens of GB each: conftest's gpu_memory_alone runs one at a time across workers
    Shard("row-offsets", "tensors past 2**31 elements (64-bit row offsets)",
          ("tests/test_row_offsets.py",), est_s=125, max_workers=2),
    Shard("other-gpus", "the A100 / RTX 4090 packages' planned tiles run on this GPU",
          ("tests/test_other_gpus_gpu.py",), est_s=50),
    Shard("other", "transformers integration, peak memory against SDPA",
          ("tests/test_transformers.py", "tests/test_gpu_memory.py"), est_s=240,
          max_workers=4),
    # two tests, each dealing its cases to its own worker processes (kernels compile in
    # parallel there)
    Shard("fuzz", "100 seeded fuzz cases and the sanitizer's case set against float64",
          ("tests/test_selftest_fuzz.py",), est_s=370, max_workers=2),
)

# 8 xdist workers per GPU in all: what the suite has run with on the H100 (`-m gpu -n 8`)
WORKERS_PER_GPU = 8
# a shard's processes at most (startup and per-module package builds cost more than a
# ninth worker saves on a shard of a few dozen tests)
MAX_SHARD_WORKERS = 8


def names() -> list[str]:
    return [s.name for s in SHARDS]


def select(spec: str | None) -> list[Shard]:
    """The shards `--only a,b` names, in the table's order; None or 'all': every one."""
    if spec is None or spec.strip() == "all":
        return list(SHARDS)
    wanted = [w.strip() for w in spec.split(",") if w.strip()]
    by_name = {s.name: s for s in SHARDS}
    unknown = [w for w in wanted if w not in by_name]
    if unknown or not wanted:
        what = f"unknown shard {', '.join(repr(u) for u in unknown)}" if unknown else \
            "--only names no shard"
        raise FlashgenError(f"{what}; the shards are: {', '.join(names())} (or 'all'); "
                            "`flashgen selftest --dry-run` lists their files")
    return [s for s in SHARDS if s.name in wanted]


def part(selected: list[Shard], spec: str) -> list[Shard]:
    """Part I of N (`--part I/N`) of the selected shards: the shards dealt, longest estimate
    first, to whichever of N parts has the least estimated time so far, so each part of a
    run too long for one sitting (one H100 with a 10-minute limit per command) takes about
    1/N of it; the parts together are the selection, each shard in one part."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", spec or "")
    if not m or not 1 <= int(m.group(1)) <= int(m.group(2)):
        raise FlashgenError(f"--part {spec!r}: expected I/N with 1 <= I <= N, e.g. --part 1/2")
    i, n = int(m.group(1)), int(m.group(2))
    loads = [0] * n
    owner = {}
    for s in sorted(selected, key=lambda s: (-(s.est_s + s.multigpu_est_s), s.name)):
        k = loads.index(min(loads))
        owner[s.name] = k
        loads[k] += s.est_s + s.multigpu_est_s
    return [s for s in selected if owner[s.name] == i - 1]


def workers(gpus: int, cores: int, per_shard: int | None = None,
            at_once: int | None = None) -> tuple[int, int]:
    """(xdist workers per shard, shards run at once). WORKERS_PER_GPU in all, capped by the
    cores, shared by two shards at a time so that one shard's start-up (every worker imports
    torch and builds its test packages) and its tail (the last slow test) overlap the other
    shard's tests; more GPUs, more shards at once."""
    total = max(1, min(WORKERS_PER_GPU * max(gpus, 1), cores))
    if per_shard is None:
        per_shard = max(1, min(MAX_SHARD_WORKERS, total // 2))
    if at_once is None:
        at_once = max(1, total // per_shard)
    return per_shard, at_once


# ---------------------------------------------------------------------------------------
# which files hold gpu tests (read from the source: no import, no collection)
# ---------------------------------------------------------------------------------------

def _marks(tree: ast.AST, name: str) -> bool:
    """Whether the code says `<...>.mark.<name>` (a decorator, pytestmark, a param's marks);
    read from the syntax tree, so a string that mentions it does not count."""
    return any(isinstance(node, ast.Attribute) and node.attr == name
               and isinstance(node.value, ast.Attribute) and node.value.attr == "mark"
               for node in ast.walk(tree))


def _takes_device(tree: ast.AST) -> bool:
    """A test or fixture with a `device` parameter: conftest's `device` fixture is
    parametrised over cpu and a gpu-marked cuda, so such a test has a gpu case."""
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
        if "device" not in params:
            continue
        fixture = any("fixture" in ast.unparse(d) for d in node.decorator_list)
        if node.name.startswith("test") or fixture:
            return True
    return False


def _test_files(tests_dir: Path) -> list[Path]:
    return sorted(p for p in Path(tests_dir).rglob("test_*.py") if p.is_file())


def _rel(path: Path, tests_dir: Path) -> str:
    return (Path(tests_dir.name) / path.relative_to(tests_dir)).as_posix()


def gpu_test_files(tests_dir: Path) -> list[str]:
    """'tests/test_x.py' for every test file with a gpu test: a `mark.gpu` (decorator,
    pytestmark or a param's marks) or a test taking conftest's `device` fixture."""
    tests_dir = Path(tests_dir)
    found = []
    for path in _test_files(tests_dir):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        if _marks(tree, "gpu") or _takes_device(tree):
            found.append(_rel(path, tests_dir))
    return found


def multigpu_test_files(tests_dir: Path) -> list[str]:
    tests_dir = Path(tests_dir)
    return [_rel(p, tests_dir) for p in _test_files(tests_dir)
            if _marks(ast.parse(p.read_text(encoding="utf-8"), str(p)), "multigpu")]


def unassigned(tests_dir: Path, table=None) -> list[str]:
    """GPU test files that no shard names (the CPU test keeps this empty)."""
    table = SHARDS if table is None else table
    named = {f for s in table for f in s.all_files()}
    return [f for f in gpu_test_files(tests_dir) if f not in named]
