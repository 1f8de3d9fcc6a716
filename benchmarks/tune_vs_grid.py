"""Is the Optuna tuner as good as brute force? For each variant and bucket, measure EVERY
feasible config (the exhaustive grid over the same space `flashgen tune` searches) and run
a TPE study with at most 25% of the grid's trials; report both bests and their ratio.
The bar: best-of-study within 3% of best-of-grid.

On the GPU (studies persist in .flashgen/tune_vs_grid.db, so an interrupted run resumes):

    python benchmarks/tune_vs_grid.py specs/gpt2.yaml --variants fwd_causal_d64_bf16 \
        bwd_causal_d64_bf16 --buckets 1024 4096 [--seeds 0 1 2] [--out result.json]

Without a GPU, on a synthetic cost model (a check of the logic, not of the tuner's worth on
real kernels):

    python benchmarks/tune_vs_grid.py specs/gpt2.yaml --synthetic

Both studies end with flashgen's confirmation round (their few best configs re-timed back
to back; re-timings, not new trials), and on the GPU the two winners are re-timed side by
side once more for the ratio, so it never compares measurements taken minutes apart: GPU
times drift by several percent over a run (clocks, heat), as much as the gaps between the
best configs.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen import planner_core  # noqa: E402
from flashgen.space import Space, space_for  # noqa: E402
from flashgen.tune import _fmt_config, tune_study  # noqa: E402

BAR = 1.03
FRACTION = 0.25


def synthetic_cost(space: Space, salt: str = "") -> "callable":
    """A deterministic stand-in for a kernel's time (ms) over `space`: a roofline-ish model
    with interacting terms (tile reuse, loop overhead, occupancy from the shared-memory
    estimate, register pressure, warps per tile, pipeline depth) and +-2% hash noise."""
    f = space.facts
    d = planner_core.padded_head_dim(f.head_dim)
    preferred_stages = {"fwd": 3, "bwd": 4, "decode": 3}[f.kind]

    def cost(cfg: dict) -> float:
        bm, bn, w, s = cfg["block_m"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
        resident, streamed = (bm, bn) if f.kind == "fwd" else (bn, bm)
        reuse = 1.0 + 24.0 / resident            # reloads of the streamed operand
        overhead = 1.0 + 6.0 / streamed          # per-iteration bookkeeping
        smem = planner_core.smem_estimate(f.kind, bm, bn, d, f.dtype_bytes, s)
        ctas = max(1, min(f.sram_bytes // max(smem, 1), 32 // w))
        occupancy = 1.0 + 0.5 / (ctas * w / 4)   # too few warps in flight per SM
        regs = planner_core.regs_estimate(f.kind, bm, bn, d, w)
        spill = 1.0 + max(0, regs - 128) / 150
        rows_per_warp = (bm if f.kind == "fwd" else bn) / w
        warps = 1.0 + 0.04 * abs(math.log2(max(rows_per_warp, 1) / 32))
        stages = 1.0 + 0.05 * abs(s - preferred_stages) + (0.25 if s == 1 else 0.0)
        h = hashlib.sha256(f"{salt}{sorted(cfg.items())}".encode()).digest()
        noise = 1.0 + 0.02 * (h[0] / 255 * 2 - 1)
        return 0.1 * reuse * overhead * occupancy * spill * warps * stages * noise

    return cost


def compare(space: Space, measure, *, storage, name: str, seeds=(0,), fraction=FRACTION,
            warm_start: bool = True, confirm=None, progress=None, trials: int | None = None,
            ahead=None, variant: str = "", bucket: int = 0) -> dict:
    """Grid (every feasible point) against TPE studies with floor(fraction * grid trials)
    trials each (or `trials`), on one space. `confirm(cfg_a, cfg_b)` -> (ms_a, ms_b)
    re-times the two winners side by side (the GPU); without it the studies' own numbers
    are compared. `ahead`: a flashgen.ahead.CompileAhead pool (both compile in batches;
    `variant` and `bucket` name what it compiles)."""
    quiet = progress or (lambda line: None)
    batch = (dict(prepare=ahead.preparer(variant, bucket), batch=ahead.workers)
             if ahead is not None else {})
    grid = tune_study(storage=storage, name=f"grid/{name}", space=space, measure=measure,
                      n_trials=len(space), sampler="grid", max_failures=len(space),
                      progress=quiet, label=f"grid {name}", **batch)
    grid_trials = grid.complete + grid.failed
    budget = trials or max(1, int(fraction * grid_trials))
    runs = []
    for seed in seeds:
        starts = [("planner", space.default())] if warm_start else []
        tpe = tune_study(storage=storage, name=f"tpe-s{seed}-n{budget}/{name}", space=space,
                         measure=measure, n_trials=budget, max_measured=budget,
                         max_failures=budget, sampler="tpe", seed=seed, warm_starts=starts,
                         progress=quiet, label=f"tpe {name}", **batch)
        grid_ms, tpe_ms = grid.best_ms, tpe.best_ms
        if tpe.best_config is not None and tpe.best_config == grid.best_config:
            tpe_ms = grid_ms   # the same kernel: any gap would be measurement noise
        elif confirm is not None and tpe.best_config is not None:
            grid_ms, tpe_ms = confirm(grid.best_config, tpe.best_config)
        ratio = tpe_ms / grid_ms if tpe_ms and grid_ms else math.inf
        runs.append({"seed": seed, "tpe_trials": tpe.complete + tpe.failed,
                     "tpe_best_ms": tpe_ms, "tpe_config": tpe.best_config,
                     "grid_best_ms": grid_ms, "ratio": ratio, "within_bar": ratio <= BAR})
    return {"name": name, "space": len(space), "grid_trials": grid_trials,
            "grid_failed": grid.failed, "grid_best_ms": grid.best_ms,
            "grid_config": grid.best_config, "budget": budget, "runs": runs}


def one_family(space: Space, family: str) -> Space:
    """`space` with its `family` knob pinned to one value (so the grid and the studies
    search that family's points only)."""
    import dataclasses

    from flashgen.space import Knob

    knobs = tuple(Knob(k.name, (family,), family, k.infeasible) if k.name == "family" else k
                  for k in space.knobs)
    return dataclasses.replace(space, knobs=knobs)


def format_rows(rows) -> str:
    lines = ["| study | grid trials | grid best ms | grid config | TPE trials | TPE best ms | "
             "TPE config | ratio | within 3% |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for run in r["runs"]:
            lines.append(
                f"| {r['name']} (seed {run['seed']}) | {r['grid_trials']} | "
                f"{run['grid_best_ms']:.4f} | {_fmt_config(r['grid_config'])} | "
                f"{run['tpe_trials']} | {run['tpe_best_ms']:.4f} | "
                f"{_fmt_config(run['tpe_config'])} | {run['ratio']:.4f} | "
                f"{'yes' if run['within_bar'] else 'NO'} |")
    return "\n".join(lines)


def _gpu_confirm(workload, rounds: int = 5):
    """Re-time two configs side by side: one discarded warm-up round, then `rounds` rounds
    in alternating order (the first timing after a pause reads fast), medians."""
    def confirm(a, b):
        workload.time(a)
        workload.time(b)
        ta, tb = [], []
        for r in range(rounds):
            for cfg, out in ((a, ta), (b, tb)) if r % 2 == 0 else ((b, tb), (a, ta)):
                out.append(workload.time(cfg))
        return sorted(ta)[rounds // 2], sorted(tb)[rounds // 2]
    return confirm


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("spec")
    ap.add_argument("--variants", nargs="+", help="variant names or patterns (default: all)")
    ap.add_argument("--buckets", nargs="+", type=int, help="default: the spec's buckets")
    ap.add_argument("--seeds", nargs="+", type=int, default=[0])
    ap.add_argument("--fraction", type=float, default=FRACTION)
    ap.add_argument("--storage", help="Optuna storage (default .flashgen/tune_vs_grid.db; "
                    "in memory with --synthetic)")
    ap.add_argument("--synthetic", action="store_true",
                    help="no GPU: the synthetic cost model on the spec's target GPU")
    ap.add_argument("--trials", type=int,
                    help="TPE trials a study (default: --fraction of the grid's); 30 is what "
                    "`flashgen tune` runs by default")
    ap.add_argument("--family", choices=["tl", "gluon"],
                    help="search one kernel family only (grid and studies alike), e.g. where "
                    "the other is known to be far slower at the shape")
    ap.add_argument("--compile-workers", type=int, default=1, metavar="N",
                    help="compile each batch of N trials ahead in N processes (GPU only)")
    ap.add_argument("--out", help="write the rows as JSON")
    args = ap.parse_args(argv)

    import optuna

    from flashgen.spec import load_spec
    from flashgen.tune import (_import_built, _space, gpu_info, gpu_measure, open_storage,
                               project_root, require_cuda, select_buckets, select_variants,
                               study_name)
    from flashgen.variants import variants_for

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    spec = load_spec(args.spec)
    buckets = select_buckets(spec, args.buckets)
    rows = []
    if args.synthetic:
        storage = open_storage(args.storage) if args.storage else optuna.storages.InMemoryStorage()
        registry = {v.name: {"kind": v.kind, "head_dim": v.head_dim, "dtype": v.dtype}
                    for v in variants_for(spec)}
        for name in select_variants(registry, args.variants, print):
            v = next(x for x in variants_for(spec) if x.name == name)
            space = space_for(v.kind, v.head_dim, v.dtype_bytes, spec.gpu.sram_bytes,
                              spec.gpu.sm_count)
            for bucket in buckets:
                cost = synthetic_cost(space, salt=f"{name}@{bucket}")
                row = compare(space, cost, storage=storage, name=f"{name}@{bucket}@synthetic",
                              seeds=args.seeds, fraction=args.fraction)
                rows.append(row)
                print(json.dumps(row), flush=True)
    else:
        import tempfile

        torch = require_cuda()
        url = args.storage or f"sqlite:///{project_root() / '.flashgen' / 'tune_vs_grid.db'}"
        storage = open_storage(url)
        with tempfile.TemporaryDirectory(prefix="flashgen-tvg-") as tmp:
            pkg = _import_built(spec, Path(tmp))
            device = torch.device("cuda", 0)
            gpu = gpu_info(pkg, device)
            registry = pkg._registry.VARIANTS
            print(f"# {gpu.key}, storage {url}")
            ahead = None
            if args.compile_workers > 1:
                from flashgen.ahead import CompileAhead
                ahead = CompileAhead(Path(tmp), spec.package, spec.path,
                                     workers=args.compile_workers)
            for name in select_variants(registry, args.variants, print):
                space = _space(registry[name]["kind"], registry[name], gpu)
                if args.family:
                    space = one_family(space, args.family)
                for bucket in buckets:
                    workload = gpu_measure(pkg, name, bucket, device, spec=spec,
                                           default=space.default())
                    try:
                        row = compare(space, workload, storage=storage,
                                      name=study_name(name, bucket, gpu.key)
                                      + (f"/{args.family}" if args.family else ""),
                                      seeds=args.seeds, fraction=args.fraction,
                                      confirm=_gpu_confirm(workload), progress=print,
                                      trials=args.trials,
                                      ahead=ahead, bucket=bucket, variant=name)
                    finally:
                        workload.close()
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if ahead is not None:
                ahead.close()
    print()
    print(format_rows(rows))
    runs = [run for r in rows for run in r["runs"]]
    ok = sum(run["within_bar"] for run in runs)
    print(f"\n{ok} of {len(runs)} TPE studies within {100 * (BAR - 1):.0f}% of the grid's best "
          f"with at most {100 * args.fraction:.0f}% of its trials")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0 if ok == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
