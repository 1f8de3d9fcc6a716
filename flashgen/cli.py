"""`flashgen build | plan | check | render | tune | bench | selftest`.

Every user error (a bad spec, a bad flag) is printed as one paragraph and exits with
status 2, without a traceback; anything else is a bug and keeps its traceback.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import __version__
from .errors import FlashgenError

EXIT_USAGE = 2


def _cmd_build(args) -> int:
    from .build import build_spec
    from .spec import load_spec

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise FlashgenError(f"--out {args.out} is a file; --out takes a folder (the package "
                            f"is written to {args.out}/<package>/)")
    spec = load_spec(args.spec)  # its own errors name the spec, not --out
    try:
        report = build_spec(spec, out)
    except OSError as e:  # any reason a folder cannot be written: missing, read-only, /proc
        reason = f"{e.strerror}: {e.filename}" if e.strerror and e.filename else str(e)
        raise FlashgenError(f"--out {args.out}: cannot write the package there: {reason}; "
                            "pass --out a folder you can write to") from None
    print(report.summary())
    print(f"import it as `import {report.root.name}` with {out} on sys.path (e.g. "
          f"PYTHONPATH={out}), or as `from {out.resolve().name} import {report.root.name}` "
          f"from {out.resolve().parent}")
    return 0


def family_summary(spec) -> str:
    """Which kernel family each variant runs on a Hopper GPU (with a Triton the Gluon
    templates were verified on) and, for the `tl` ones, why. For a spec whose gpu.arch is
    not Hopper, one line: every kernel there is `tl`. (A spec without an arch is planned
    for the H100, so it gets the Hopper summary.)"""
    from . import families
    from .render import gluon_decode_reason, gluon_reason
    from .variants import variants_for

    capability = spec.gpu.capability
    if (capability // 10, capability % 10) not in families.GLUON_CAPABILITIES:
        hopper = ", ".join(f"sm_{a}{b}" for a, b in families.GLUON_CAPABILITIES)
        return (f"== kernel families on {spec.gpu.name} ({spec.gpu.arch}): `tl` for every "
                f"kernel (the Gluon kernels run on {hopper}, Hopper, only)")
    gluon, tl = [], {}
    for v in variants_for(spec):
        why = gluon_reason(v, spec)
        if v.kind == "decode" and gluon_decode_reason(v) is None:
            why = None  # the Gluon latent (MLA) decode, templates/gluon/decode_mla.py.j2
        if why is None:
            gluon.append(v.name)
        else:
            tl.setdefault(why, []).append(v.name)
    hopper = ", ".join(f"sm{a}{b}" for a, b in families.GLUON_CAPABILITIES)
    lines = [f"== kernel families on {hopper} with Triton {', '.join(families.GLUON_TRITON)} "
             "(every other GPU, Triton or the interpreter runs `tl` for all)"]
    latent = [n for n in gluon if n.startswith("decode")]
    gluon = [n for n in gluon if n not in latent]
    if gluon:
        d = families.gluon_default(128)
        lines.append(f"gluon ({len(gluon)}): {', '.join(gluon)}")
        lines.append(f"  untuned: {d['block_m']}x{d['block_n']} tiles (2 consumer warpgroups x 64 "
                     f"rows), a {d['num_stages']}-deep K/V ring; tuned configs may pick `tl` "
                     "per bucket")
        for (qk, dv), tile in families.LARGE_HEAD_DIM_FWD.items():
            if any(v.kind == "fwd" and (v.head_dim, v.v_dim) == (qk, dv) for v in variants_for(spec)
                   if gluon_reason(v, spec) is None):
                lines.append(f"  the forward at head dims {qk}/{dv}: 128x{tile['block_n']} tiles, "
                             f"a {tile['num_stages']}-deep ring, the output staged in the Q slots")
        for (qk, dv), tile in families.LARGE_HEAD_DIM_BWD.items():
            if any(v.kind == "bwd" and (v.head_dim, v.v_dim) == (qk, dv) for v in variants_for(spec)
                   if gluon_reason(v, spec) is None):
                lines.append(f"  the backward at head dims {qk}/{dv}: 64x64 tiles (the consumers "
                             f"split dK, dV, dQ by columns), a {tile['num_stages']}-deep ring; "
                             "FLASHGEN_GLUON_BWD_LARGE=0 turns it off")
        fp8 = [n for n in gluon if n.endswith("fp8_e4m3")]
        if fp8:
            t = families.fp8_fwd_tile(128)
            lines.append(f"  the fp8 forward: 128x{t['block_n']} tiles, a {t['num_stages']}-deep "
                         "ring (d <= 64: 192-row tiles as in bf16)"
                         + ("" if families.GLUON_FP8_BY_DEFAULT else
                            "; off by default: FLASHGEN_FP8_GLUON=1 turns it on"))
    if latent:
        lines.append(f"gluon ({len(latent)}): {', '.join(latent)}\n  the latent (MLA) decode "
                     "kernel, DeepSeek's 576/512 cache")
    for why, names in tl.items():
        lines.append(f"tl ({len(names)}): {', '.join(names)}\n  why: {why}")
    return "\n".join(lines)


def _cmd_plan(args) -> int:
    from . import planner_core
    from .plan import plan_spec
    from .spec import load_spec

    from .plan import format_summary, variant_score_bytes

    spec = load_spec(args.spec)
    seen = set()
    for variant, plan in plan_spec(spec).items():
        # mods that read a [q, kv] tile per score (an attn_mask, a bias) plan their own
        # tile: a section of their own, or their choice would go unseen
        score_bytes = variant_score_bytes(spec, variant)
        key = (variant.kind, variant.head_dim, variant.v_dim, variant.dtype_bytes, score_bytes)
        if key in seen:
            continue
        seen.add(key)
        reads = f", mods reading {score_bytes} B a score" if score_bytes else ""
        # (a V head dim of its own: planned for the larger of the two)
        dims = (f"d={variant.head_dim}" if variant.v_dim == variant.head_dim else
                f"d={variant.head_dim} dv={variant.v_dim}")
        print(f"== {variant.kind} {dims} {variant.dtype_bytes}-byte dtypes"
              f"{reads} (e.g. {variant.name}) on {spec.gpu.name}")
        print(planner_core.format_plan(plan) if args.all else format_summary(plan))
        print()
    print(family_summary(spec))
    print()
    if not args.all:
        print(f"(`flashgen plan {args.spec} --all` lists every candidate tile with its "
              "estimates and why it was rejected)")
    return 0


def _cmd_render(args) -> int:
    from .plan import plan_spec
    from .render import render_package
    from .spec import load_spec

    spec = load_spec(args.spec)
    files = render_package(spec, plan_spec(spec))
    # kernels/<variant>.py by variant name; another family's kernels/<family>/<variant>.py
    # as <family>/<variant>
    kernels = {rel[len("kernels/"):-len(".py")]: text for rel, text in files.items()
               if rel.startswith("kernels/") and not rel.endswith("__init__.py")}
    if args.variant is None:
        print("variants:", ", ".join(kernels))
        print("pass --variant NAME to print one kernel's source")
        return 0
    if args.variant not in kernels:
        raise FlashgenError(f"no variant {args.variant!r} in {args.spec}; it has: "
                            f"{', '.join(kernels)}")
    sys.stdout.write(kernels[args.variant])
    return 0


def _cmd_check(args) -> int:
    from .check import check

    return 0 if check(args.spec, quick=args.quick, planned=args.planned) else 1


def _cmd_tune(args) -> int:
    from .tune import tune

    try:
        tune(args.spec, trials=args.trials, timeout=args.timeout,
             budget=args.budget if args.budget > 0 else None, storage=args.storage,
             workers=args.workers, variants=args.variants, buckets=args.buckets,
             sampler=args.sampler, seed=args.seed, worker_index=args.worker_index,
             tries=args.tries, compile_workers=args.compile_workers)
    except KeyboardInterrupt:
        print("flashgen tune: interrupted; finished trials are saved: run the same command "
              "again to resume", file=sys.stderr)
        return 130
    return 0


def _cmd_bench(args) -> int:
    from .bench import bench

    return bench(args)


def _cmd_selftest(args) -> int:
    from .selftest import run

    return run(args)


def _selftest_arguments(s: argparse.ArgumentParser) -> None:
    from .selftest import DEFAULT_BUDGET, DEFAULT_OUT
    from .selftest.sanitize import DEFAULT_TIMEOUT, TOOLS
    from .selftest.shards import names

    g = s.add_argument_group("the GPU test suite (the default)")
    g.add_argument("--only", metavar="SHARDS",
                   help=f"run these shards only, comma-separated: {', '.join(names())} (or "
                   "'all'); with --fuzz or --sanitize, the shards run too")
    g.add_argument("--part", metavar="I/N",
                   help="run part I of N of the shards (dealt by their estimated times, so "
                   "each part takes about 1/N of the run): --part 1/3, 2/3, 3/3 on a "
                   "machine that limits a command to 10 minutes")
    g.add_argument("--tests", metavar="DIR",
                   help="the tests/ folder of a flashgen checkout (default: the one at or "
                   "above the current directory)")
    g.add_argument("-n", dest="pytest_workers", type=int, metavar="N",
                   help="xdist workers a shard (default: 8 per GPU in all, capped by the "
                   "cores, shared by the shards running at once)")
    g.add_argument("--parallel", type=int, metavar="P",
                   help="shards run at once (default: 2 on one GPU)")
    g.add_argument("--timeout", type=int, metavar="S",
                   help="seconds a shard or a sanitizer tool may run (default: a shard 3x "
                   f"its estimate, a tool {DEFAULT_TIMEOUT})")
    g.add_argument("--budget", type=int, default=DEFAULT_BUDGET, metavar="S",
                   help="the run's seconds for the shards and the sanitizer tools: a shard "
                   "whose estimate does not fit is listed, not started (default "
                   f"{DEFAULT_BUDGET}: no limit)")
    z = s.add_argument_group("compute-sanitizer")
    z.add_argument("--sanitize", action="store_true",
                   help="run compute-sanitizer over the sanitize case set (both kernel "
                   "families at odd shapes)")
    z.add_argument("--sanitize-tools", metavar="TOOLS",
                   help=f"which tools, comma-separated (default: {','.join(TOOLS)}; "
                   "implies --sanitize)")
    z.add_argument("--sanitizer", metavar="PATH",
                   help="the compute-sanitizer executable (default: found on PATH, in "
                   "$CUDA_HOME/bin or /usr/local/cuda/bin)")
    z.add_argument("--sanitizer-args", metavar="ARGS",
                   help="more compute-sanitizer options, written with an = sign: "
                   "--sanitizer-args=\"--num-cuda-barriers 64\"")
    f = s.add_argument_group("the fuzzer")
    f.add_argument("--fuzz", type=int, metavar="N",
                   help="N seeded random cases against the float64 reference (on the GPU, "
                   "else in Triton's interpreter)")
    f.add_argument("--seed", type=int, default=0, help="the fuzzer's seed (default 0)")
    f.add_argument("--fuzz-start", type=int, default=0, metavar="K",
                   help="skip the seed's first K cases: --fuzz 1000 --fuzz-start 1000 runs "
                   "cases 1000..1999 of --fuzz 2000 (a long run split across calls)")
    f.add_argument("--workers", type=int, default=1, metavar="W",
                   help="the fuzzer's processes (default 1)")
    f.add_argument("--fuzz-case", metavar="JSON",
                   help="run one case, as a fuzz failure printed it, and exit")
    s.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                   help=f"where selftest.txt, selftest.json and the logs go (default "
                   f"./{DEFAULT_OUT}/)")
    s.add_argument("--dry-run", action="store_true",
                   help="list what would run (shards, workers, timeouts, commands); runs "
                   "nothing, needs no GPU")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flashgen",
        description="Generate tuned FlashAttention Triton kernels from a YAML spec.")
    p.add_argument("--version", action="version", version=f"flashgen {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", required=True)

    b = sub.add_parser("build", help="plan, render and write the package for a spec",
                       description="Plan tiles from the spec's SRAM budget, render the "
                       "kernels and write generated/<package>/ (idempotent).")
    b.add_argument("spec", help="path to a spec YAML file, e.g. specs/gpt2.yaml")
    b.add_argument("--out", default="generated", help="output folder (default: generated)")
    b.set_defaults(func=_cmd_build)

    pl = sub.add_parser("plan", help="summarise the chosen tiles (--all: every candidate)",
                        description="For each kernel kind, head dim and dtype width of the "
                        "spec: the FlashAttention-1 rule's block sizes for the spec's SRAM "
                        "budget, the target tile the planner derives from them, the chosen "
                        "tile with its shared-memory and register estimate, and how many "
                        "candidates were feasible. --all lists every candidate and why each "
                        "rejected one was dropped.")
    pl.add_argument("spec")
    pl.add_argument("--all", action="store_true",
                    help="every candidate tile (hundreds of lines per kernel kind)")
    pl.set_defaults(func=_cmd_plan)

    r = sub.add_parser("render", help="print a rendered kernel without writing anything",
                       description="Render the spec's kernels in memory and print one.")
    r.add_argument("spec")
    r.add_argument("--variant", help="canonical variant name, e.g. fwd_causal_d64_fp16")
    r.set_defaults(func=_cmd_render)

    c = sub.add_parser("check", help="build into a temp folder and verify every variant",
                       description="Build the spec into a temporary folder, import it and "
                       "compare every kernel variant with a float64 PyTorch reference on "
                       "fresh random inputs (on the GPU, or in Triton's interpreter "
                       "without one). Exits 1 if any case fails.")
    c.add_argument("spec")
    c.add_argument("--quick", action="store_true", help="one small shape per variant")
    c.add_argument("--planned", action="store_true",
                   help="launch with the tiles planned for the spec's GPU (gpu.sram_bytes), "
                   "not this GPU's: checks another GPU's package here")
    c.set_defaults(func=_cmd_check)

    from .tune import DEFAULT_BUDGET, DEFAULT_TRIALS, SAMPLERS

    t = sub.add_parser("tune", help="autotune launch configs on this GPU with Optuna (resumable)",
                       description="On a CUDA GPU: one Optuna study per (kernel variant, "
                       "sequence-length bucket) over the planner's feasible configs for this "
                       "GPU; each trial checks the config against a float64 reference, then "
                       "times it. Studies persist in the storage and resume where they "
                       "stopped; the winners go to specs/tuning/<package>/<gpu>.json, which "
                       "`flashgen build` embeds into the package's dispatch table.")
    t.add_argument("spec")
    t.add_argument("--trials", type=int, default=DEFAULT_TRIALS, metavar="N",
                   help=f"completed trials per study, counting earlier runs (default "
                   f"{DEFAULT_TRIALS})")
    t.add_argument("--timeout", type=float, metavar="S",
                   help="stop each study after S seconds (it resumes on the next run)")
    t.add_argument("--budget", type=float, default=DEFAULT_BUDGET, metavar="S",
                   help=f"the whole run's time: each study gets the seconds left divided by "
                   f"the studies left (default {DEFAULT_BUDGET:g}, so a whole spec tunes in "
                   "under 15 minutes; 0 = no limit)")
    t.add_argument("--storage", metavar="URL",
                   help="Optuna storage: an RDB URL or a journal file path (default "
                   "sqlite:///<repo>/.flashgen/tune.db)")
    t.add_argument("--workers", type=int, default=1, metavar="N",
                   help="N processes, one per GPU, sharing the storage (clamped to the GPUs)")
    t.add_argument("--variants", nargs="+", metavar="NAME",
                   help="variants to tune (names or patterns such as 'fwd_*_bf16'; default "
                   "all)")
    t.add_argument("--buckets", nargs="+", type=int, metavar="N",
                   help="sequence-length buckets to tune (default: the spec's seqlen_buckets)")
    t.add_argument("--sampler", choices=SAMPLERS, default="tpe",
                   help="tpe (Optuna's TPE over the feasible configs, default) or grid (every "
                   "feasible config, best-ranked first)")
    t.add_argument("--seed", type=int, default=0, help="sampler seed (default 0)")
    t.add_argument("--try", dest="tries", nargs="+", default=[], metavar="CFG",
                   help="configs every study measures first (after the planner's and the "
                   "tuning file's), e.g. 64x128w8s3 or 64x128w8s3:dq_tile=128x64w8s3; one "
                   "whose tile or knobs a variant cannot take is left out for it")
    t.add_argument("--compile-workers", type=int, metavar="N",
                   help="processes compiling each batch of N trials ahead of their measurement "
                   "(default: half the cores, at most 8; 1 compiles each trial as it is "
                   "measured)")
    t.add_argument("--worker-index", type=int, help=argparse.SUPPRESS)
    t.set_defaults(func=_cmd_tune)

    from .bench import add_arguments as bench_arguments

    be = sub.add_parser("bench", help="measure the generated packages beside SDPA, cuDNN, "
                        "FlexAttention and naive PyTorch (GPU)",
                        description="On a CUDA GPU: time the generated packages beside SDPA "
                        "flash, SDPA cuDNN, FlexAttention, FlashAttention-4 (fa4, where "
                        "installed; skipped with the reason otherwise) and naive PyTorch in "
                        "one run, at the "
                        "H100 anchor table's shapes (training), with dropout, decoding, or the "
                        "small seed shapes; every output is checked against a float32 "
                        "reference first. Prints markdown tables of TFLOP/s with flashgen's "
                        "ratio to each peer and writes JSON, CSV, markdown and a PNG plot "
                        "under --out. --dry-run lists the cases without a GPU.")
    bench_arguments(be)
    be.set_defaults(func=_cmd_bench)

    st = sub.add_parser("selftest", help="run the GPU test suite, compute-sanitizer or the "
                        "fuzzer on this machine; one summary",
                        description="Run the project's GPU checks on this machine and write "
                        "one summary (commit, GPUs, versions, counts, every failure with a "
                        "command that reproduces it) as text and JSON. Default: the GPU test "
                        "suite in named shards (--only to pick), the multi-GPU tests on 2+ "
                        "GPUs; --sanitize: compute-sanitizer memcheck, racecheck and "
                        "synccheck; --fuzz N: seeded random cases against the float64 "
                        "reference (also on a CPU). Exit status 0 when everything ran and "
                        "passed, 1 on failures, 2 on usage errors.")
    _selftest_arguments(st)
    st.set_defaults(func=_cmd_selftest)
    return p


def main(argv=None) -> int:
    args = parser().parse_args(argv)
    # the command line as given, for the records a command writes (selftest.json)
    args.argv = ["flashgen", *(sys.argv[1:] if argv is None else argv)]
    try:
        return args.func(args)
    except FlashgenError as e:
        print(f"flashgen {args.command}: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `flashgen plan spec.yaml | head`: the reader left; that is not an error
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
