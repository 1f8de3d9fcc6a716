"""`flashgen bench`: flashgen's generated packages measured beside SDPA, cuDNN,
FlexAttention, FlashAttention-4 (where installed) and naive PyTorch on a GPU. This file is
the command line (arguments, their checks, the dry run, the GPU check); the rest of the
package, which imports nothing from here:

    suites.py     what is measured: suites, shapes, providers, the case list, FLOPs (pure)
    providers.py  the callables timed: flashgen's packages (built from their specs) and peers
    fa4.py        FlashAttention-4 as a peer: whether it runs here (else why not), its calls
    fp8.py        the fp8 rows: flashgen's fp8 kernels and cuDNN's fp8 graphs (opt-in names)
    timing.py     interleaved rounds, the callable do_bench times, host time
    report.py     markdown tables, CSV, JSON, the PNG plot, the default output folder
    runner.py     the GPU run: check every provider, time it, write the results
    decode.py     the decode suite's measurement (also `python -m flashgen.bench.decode`)
    mods.py       the mods suite's cases, inputs and reference (the tuner uses its inputs)
    varlen.py     the packed-varlen benchmark, `python -m flashgen.bench.varlen`
    prefill.py    chunked prefill over a paged cache, `python -m flashgen.bench.prefill`

Everything the dry run needs is pure Python; torch and triton are imported when measuring.
"""
from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import FlashgenError
from . import suites
from .report import default_out_base


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--suite", choices=(*suites.SUITES, "all"), default="training",
                    help="which shapes to measure (default training: the H100 anchor table)")
    ap.add_argument("--spec", metavar="SPEC",
                    help="time the package of this spec as flashgen (training and small "
                    "suites, at its head dims and masks; it needs bf16) instead of the "
                    "example specs' packages")
    ap.add_argument("--n", type=int, nargs="+", metavar="N",
                    help="sequence lengths of the training and dropout suites, KV lengths of "
                    "decode (default: the anchor table's)")
    ap.add_argument("--d", type=int, nargs="+", metavar="D",
                    help="head dims of the training suite (default: 64 and 128, or the "
                    "--spec's head dims)")
    ap.add_argument("--mode", nargs="+", choices=("fwd", "bwd"), default=["fwd", "bwd"],
                    help="fwd and/or bwd (training and dropout suites; default both)")
    ap.add_argument("--providers", nargs="+", metavar="NAME",
                    help=f"only these providers ({', '.join(suites.PROVIDERS)}; default all)")
    ap.add_argument("--out", metavar="DIR",
                    help="where the JSON, CSV, markdown and PNG go (default "
                    "benchmarks/results/<gpu-slug>/ in a checkout, ./flashgen-bench/<gpu-slug>/ "
                    "otherwise)")
    ap.add_argument("--no-plot", dest="plot", action="store_false",
                    help="skip the PNG (written whenever matplotlib is installed)")
    ap.add_argument("--rounds", type=int, default=1, metavar="R",
                    help="time each case's providers R times in alternating order and report "
                    "each one's median round (default 1); use 3-5 when a ratio between "
                    "providers is what you read: the GPU's clock drifts during a run")
    ap.add_argument("--dry-run", action="store_true",
                    help="list the cases and providers without running anything (no GPU needed)")


def _check_sizes(args) -> None:
    """Sizes and counts are at least 1 (a 0 would divide by zero planning the batch, a
    negative one would plan a nonsense shape)."""
    if args.rounds < 1:
        raise FlashgenError(f"--rounds {args.rounds}: give at least 1 round")
    for flag, values, what in (("--n", args.n, "sequence lengths"),
                               ("--d", args.d, "head dims")):
        bad = [v for v in values or () if v < 1]
        if bad:
            raise FlashgenError(f"{flag} {' '.join(map(str, bad))}: {what} must be at "
                                "least 1")


def _resolve(args):
    """(head dims, causalities, package name) of the run; a user error is a FlashgenError."""
    _check_sizes(args)
    unknown = [p for p in (args.providers or []) if p not in suites.PROVIDERS]
    if unknown:
        raise FlashgenError(f"unknown provider {', '.join(unknown)}; one of "
                            f"{', '.join(suites.PROVIDERS)}")
    if args.spec is None:
        bad = [d for d in (args.d or []) if d not in suites.SPECS]
        if bad:
            raise FlashgenError(f"--d {' '.join(map(str, bad))}: the example packages have "
                                f"head dims {sorted(suites.SPECS)}; pass --spec YOUR.yaml to "
                                "time another head dim")
        return args.d, (False, True), None
    from ..spec import load_spec
    if not Path(args.spec).is_file():
        from ..resources import specs_dir
        raise FlashgenError(f"--spec {args.spec}: no such file (the example specs are in "
                            f"{specs_dir()})")
    spec = load_spec(args.spec)  # a bad spec is a SpecError (exit 2) here, before any GPU work
    if "bf16" not in spec.dtypes:
        raise FlashgenError(f"--spec {args.spec}: the benchmark runs in bf16, which the spec's "
                            f"dtypes {list(spec.dtypes)} lack: add bf16 to `dtypes`")
    causals = suites.spec_causals(args.spec)
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
    dvs = suites.spec_v_dims(args.spec) if args.spec is not None else None
    cases = suites.plan_cases(args.suite, args.n, ds, args.mode, args.providers, causals, dvs)
    if args.dry_run:
        print(suites.dry_run_text(cases))
        name = suites.result_name(args.suite, args.n, ds if args.spec is None else args.d,
                                  args.mode, args.providers, package)
        # the folder the real run would use (runner.run: --out, else report.default_out_dir)
        where = Path(args.out) if args.out else default_out_base() / "<gpu-slug>"
        print(f"would write {name}.json, .csv, .md and .png under {where}{os.sep}")
        return 0
    import torch
    if not torch.cuda.is_available():
        raise FlashgenError("no CUDA GPU: `flashgen bench` measures on a GPU (run "
                            "`flashgen bench --dry-run` to list the cases and providers)")
    from .runner import run
    run(args.suite, args.n, args.d, args.mode,
        args.providers, args.out, args.plot, log=lambda s: print(s, flush=True),
        spec=args.spec, rounds=args.rounds)
    return 0
