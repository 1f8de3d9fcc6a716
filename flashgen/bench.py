"""`flashgen bench`: the command-line side of flashgen/bench_suite.py (argument checks, the
dry run, the GPU check); the measuring code is bench_suite.py."""
from __future__ import annotations

from pathlib import Path

from . import bench_suite as suite
from .errors import FlashgenError


def load_suite():
    """The measuring module (kept as a function for callers of the old script loader)."""
    return suite


def add_arguments(p) -> None:
    suite.add_arguments(p)


def _resolve(args):
    """(head dims, causalities, package name) of the run; a user error is a FlashgenError."""
    if args.rounds < 1:
        raise FlashgenError(f"--rounds {args.rounds}: give at least 1 round")
    unknown = [p for p in (args.providers or []) if p not in suite.PROVIDERS]
    if unknown:
        raise FlashgenError(f"unknown provider {', '.join(unknown)}; one of "
                            f"{', '.join(suite.PROVIDERS)}")
    if args.spec is None:
        bad = [d for d in (args.d or []) if d not in suite.SPECS]
        if bad:
            raise FlashgenError(f"--d {' '.join(map(str, bad))}: the example packages have "
                                f"head dims {sorted(suite.SPECS)}; pass --spec YOUR.yaml to "
                                "time another head dim")
        return args.d, (False, True), None
    from .spec import load_spec
    if not Path(args.spec).is_file():
        raise FlashgenError(f"--spec {args.spec}: no such file")
    spec = load_spec(args.spec)  # a bad spec is a SpecError (exit 2) here, before any GPU work
    if "bf16" not in spec.dtypes:
        raise FlashgenError(f"--spec {args.spec}: the benchmark runs in bf16, which the spec's "
                            f"dtypes {list(spec.dtypes)} lack: add bf16 to `dtypes`")
    causals = suite.spec_causals(args.spec)
    if not causals:
        raise FlashgenError(f"--spec {args.spec}: the benchmark times the `none` and `causal` "
                            f"masks, and the spec has neither (masks {list(spec.masks)})")
    bad = [d for d in (args.d or []) if d not in spec.head_dims]
    if bad:
        raise FlashgenError(f"--d {' '.join(map(str, bad))}: {args.spec} has head dims "
                            f"{list(spec.head_dims)}")
    if args.suite not in ("training", "small"):
        raise FlashgenError(f"--spec times the training and small suites, not "
                            f"--suite {args.suite}")
    return args.d or list(spec.head_dims), causals, spec.package


def bench(args) -> int:
    ds, causals, package = _resolve(args)
    cases = suite.plan_cases(args.suite, args.n, ds, args.mode, args.providers, causals)
    if args.dry_run:
        print(suite.dry_run_text(cases))
        name = suite.result_name(args.suite, args.n, ds if args.spec is None else args.d,
                                 args.mode, args.providers, package)
        print(f"would write {name}.json, .csv, .md and .png under "
              f"{args.out or 'benchmarks/results/<gpu-slug>/'}")
        return 0
    import torch
    if not torch.cuda.is_available():
        raise FlashgenError("no CUDA GPU: `flashgen bench` measures on a GPU (run "
                            "`flashgen bench --dry-run` to list the cases and providers)")
    suite.run(args.suite, args.n, args.d, args.mode,
              args.providers, args.out, args.plot, log=lambda s: print(s, flush=True),
              spec=args.spec, rounds=args.rounds)
    return 0
