"""One process, two ways of timing the same backward: does a Gluon backward config win in
the interleaved A/B and lose in `flashgen bench`, or does one of the two mislead?

    PYTHONPATH=$PWD python benchmarks/bwd_block_m_check.py [--d 64] [--mod document]
        [--arms 'm64={"block_m": 64}' 'm128={"block_m": 128}'] [--rounds 3] [--json OUT]

The twenty-second session measured the d=64 document backward at 64 query rows a step
1.140x faster than at 128 in `benchmarks/mods_knobs_ab.py` (one saved forward, arms
interleaved under `override_config`, the best of 3 do_bench medians) and then 0.93x
in the `flashgen bench --suite mods` run after making it the default (a fresh forward per
case, one do_bench median, Flex between cases). Here each arm is timed, under the same
config, by both: (a) the A/B's way and (b) `flashgen bench`'s own measurement
(`bench.runner.measure_attention` on the mods case, flashgen only), alternating the arms
and the ways round by round; the launch config each arm ran is printed from the runtime.
The arm's knobs reach the backward variants only (override_config would move the forward
that (b) runs first too: its first version read (b) as failed for that reason). Twenty-
third session: both ways agree (m64 658-662 vs m128 578 TFLOP/s).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--mod", default="document")
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--arms", nargs="+", default=['m64={"block_m": 64}',
                                                  'm128={"block_m": 128}'])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()

    import torch
    import triton

    from flashgen.bench import mods as bm
    from flashgen.bench.providers import load_package
    from flashgen.bench.runner import measure_attention
    from flashgen.bench.suites import Case, tflops
    from flashgen.resources import bundled_spec

    arms = {}
    for spec in args.arms:
        label, _, text = spec.partition("=")
        arms[label] = json.loads(text)
    pkg, sha = load_package(bundled_spec(bm.MODS_SPEC))
    rt = pkg._runtime
    band, mods, causal_count = bm.MOD_CASES[args.mod]
    b, h, n, d = 16384 // args.n, bm.MODS_H, args.n, args.d
    kw = bm.inputs(args.mod, b, h, n, "cuda")
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)
    out = pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)
    name = [x for x in rt.VARIANTS if x.startswith("bwd_") and f"_d{d}_bf16" in x
            and tuple(rt.VARIANTS[x].get("mods", ())) == tuple(mods)
            and rt.VARIANTS[x]["mask"] == ("causal" if band else "none")][0]
    case = Case("mods", "bwd", d, causal_count, b, h, n, providers=("flashgen",), mod=args.mod)
    # The arm's knobs reach the backward variants only: override_config would also move
    # the forward that flashgen bench's way runs before timing (a 64-row Gluon forward is
    # not what the patch under test changes, and its result failed the bench's check).
    plain_config, arm_knobs = rt.launch_config, {}

    def bwd_only_config(variant, device, n_):
        cfg = plain_config(variant, device, n_)
        return {**cfg, **arm_knobs} if variant.startswith("bwd_") else cfg

    rt.launch_config = bwd_only_config
    ab, bench, configs, status = ({a: [] for a in arms}, {a: [] for a in arms}, {},
                                  {a: [] for a in arms})
    for r in range(args.rounds):
        for a in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            arm_knobs.clear()
            arm_knobs.update(arms[a])
            rt._backward_plans.clear()  # plans hold the config they were made with
            configs[a] = dict(rt.launch_config(name, q.device, n))
            out.backward(do, retain_graph=True)
            ab[a].append(triton.testing.do_bench(
                lambda: out.backward(do, retain_graph=True), warmup=25, rep=100,
                grad_to_none=[q, k, v], return_mode="median"))
            rows = measure_attention([case], {}, log=lambda *_: None)
            bench[a].append(rows[0].get("ms"))
            status[a].append(rows[0].get("status"))
    rt.launch_config = plain_config
    result = {}
    for a in arms:
        t_ab = min(ab[a])
        t_bench = statistics.median([t for t in bench[a] if t is not None] or [float("nan")])
        result[a] = dict(config=configs[a], ab_ms=ab[a], bench_ms=bench[a], status=status[a],
                         ab_tflops=round(tflops(t_ab, b, h, n, d, causal_count, "bwd"), 1),
                         bench_tflops=round(tflops(t_bench, b, h, n, d, causal_count, "bwd"), 1))
        print(f"{a}: {configs[a]}\n  A/B way {result[a]['ab_tflops']} TFLOP/s {ab[a]}\n"
              f"  bench way {result[a]['bench_tflops']} TFLOP/s {bench[a]} {status[a]}",
              flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"variant": name, "spec_sha": sha,
                                               "arms": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
