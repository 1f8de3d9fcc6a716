"""`flashgen bench`: a thin wrapper over benchmarks/suite.py (the measuring code lives in
the repository's benchmarks/ folder, next to this package)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from .errors import FlashgenError

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_suite():
    """benchmarks/suite.py as a module (benchmarks/ is a folder of scripts, not a package)."""
    path = BENCHMARKS / "suite.py"
    if not path.is_file():
        raise FlashgenError(f"no {path}: `flashgen bench` runs from a flashgen checkout "
                            f"(pip install -e .), which has the benchmarks/ folder")
    if "flashgen_bench_suite" in sys.modules:
        return sys.modules["flashgen_bench_suite"]
    spec = importlib.util.spec_from_file_location("flashgen_bench_suite", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def add_arguments(p) -> None:
    load_suite().add_arguments(p)


def bench(args) -> int:
    suite = load_suite()
    unknown = [p for p in (args.providers or []) if p not in suite.PROVIDERS]
    if unknown:
        raise FlashgenError(f"unknown provider {', '.join(unknown)}; one of "
                            f"{', '.join(suite.PROVIDERS)}")
    cases = suite.plan_cases(args.suite, args.n, args.d, args.mode, args.providers)
    if args.dry_run:
        print(suite.dry_run_text(cases))
        name = suite.result_name(args.suite, args.n, args.d, args.mode, args.providers)
        print(f"would write {name}.json, .csv, .md and .png under "
              f"{args.out or 'benchmarks/results/<gpu-slug>/'}")
        return 0
    import torch
    if not torch.cuda.is_available():
        raise FlashgenError("no CUDA GPU: `flashgen bench` measures on a GPU (run "
                            "`flashgen bench --dry-run` to list the cases and providers)")
    suite.run(args.suite, args.n, args.d, args.mode, args.providers, args.out, args.plot,
              log=lambda s: print(s, flush=True))
    return 0
