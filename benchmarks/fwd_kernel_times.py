"""A forward's launch-config arms timed two ways in one process, on an H100:

    python benchmarks/fwd_kernel_times.py [--n 4096 1024] [--rounds 2] \
        [--arm NAME=JSON ...] [--out FILE.json]

Each arm is the package's launch config for the variant with some knobs changed
(`override_config`); "base" (dropout_p = P) and "p0" (dropout_p = 0: the same tile config on
the variant without dropout, issue 14's denominator) always run. Per arm and round: five
warm calls, then the median kernel duration of 20 calls under torch.profiler (the device's
own clock for the kernel alone, L2 warm) and triton.testing.do_bench's median (L2 flushed
between calls, host included where it is not hidden). Rounds interleave the arms. Each
row names the kernel the profiler saw, and the JSON keeps the launch meta of each arm's
plans, so an arm that ran something other than what it asked for shows.

Why both: in the twenty-ninth session two runs of dropout_fwd_knobs_ab.py (do_bench alone)
read every p = 0.1 arm of a branch within 1.5% of the base while this script read them up to
33% apart. On main the thirtieth session found both scripts reading arms apart by both
clocks (docs/PERF_NOTES.md); the branch's readings stay unexplained, so an arm's reading
still comes with its kernel duration.

JSON's keys may include "p" (that arm's dropout_p instead of P). Defaults: the dropout
suite's spec (specs/bench/dropout_d128.yaml), its causal d=128 bf16 forward, H = 16,
B * N = 16k.

--philox-rounds R renders the package with R Philox rounds instead of
families.PHILOX_ROUNDS (a measurement of what each round costs, not a generator anyone may
train with: below 7 rounds Philox4x32 is not known to pass BigCrush, and R = 0 makes the
keep mask a function of the counters). One round count a process; the thirtieth session ran
7, 5, 3, 1 and 0 (docs/PERF_NOTES.md).
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.bench.providers import load_package  # noqa: E402


def kernel_us(fn, calls: int = 20) -> tuple:
    """(median device duration in us, kernel name) of the one kernel each of `calls` calls
    of `fn` launches."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
    names = sorted({ev.name for ev in events})
    if len(events) != calls or len(names) != 1:  # one kernel a call is what the ratio assumes
        raise SystemExit(f"{len(events)} kernels in {calls} calls: {names}")
    return statistics.median(ev.device_time for ev in events), names[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "specs/bench/dropout_d128.yaml"))
    ap.add_argument("--variant", default="fwd_causal_dropout_d128_bf16")
    ap.add_argument("--n", type=int, nargs="+", default=[4096, 1024])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=JSON")
    ap.add_argument("--philox-rounds", type=int, default=None, metavar="R")
    ap.add_argument("--out")
    args = ap.parse_args()
    import triton

    from flashgen import families
    if args.philox_rounds is not None:
        families.PHILOX_ROUNDS = args.philox_rounds  # read when the package is rendered

    arms = [("base", {}), ("p0", {"p": 0.0})]
    for spec in args.arm:
        label, eq, knobs = spec.partition("=")
        if not eq:
            ap.error(f"--arm {spec}: NAME=JSON")
        arms.append((label, json.loads(knobs)))
    pkg, sha = load_package(args.spec)
    rt = pkg._runtime
    facts = rt.VARIANTS[args.variant]
    d, causal = facts["head_dim"], facts["mask"] == "causal"
    rows = []
    for n in args.n:
        b = args.tokens // n
        q, k, v = (torch.randn(b, n, args.heads, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        flops = 4 * b * args.heads * n * n * d / (2 if causal else 1)
        base = dict(rt.launch_config(args.variant, q.device, n))
        kern = {label: [] for label, _ in arms}
        names, metas = {}, {}
        bench = {label: [] for label, _ in arms}
        for _ in range(args.rounds):
            for label, knobs in arms:
                knobs = dict(knobs)
                p = knobs.pop("p", args.p)
                with rt.override_config(**{**base, **knobs}):
                    def call(p=p):
                        return pkg.flash_attn_func(q, k, v, dropout_p=p, causal=causal)
                    for _ in range(5):
                        call()
                    torch.cuda.synchronize()
                    if label not in metas:
                        # the compile-time arguments of what this arm launched
                        # (override_config cleared the plans on entry: these are its own)
                        metas[label] = [
                            {key: val for key, val in plan[0].meta.items() if "LAYOUT" not in key}
                            for plan in rt._forward_plans.values() if plan[0] is not None]
                    us, kernel = kernel_us(call)
                    kern[label].append(us)
                    # which kernel ran: an arm that silently ran another one reads as its twin
                    names.setdefault(label, set()).add(kernel)
                    bench[label].append(triton.testing.do_bench(
                        call, warmup=25, rep=100, return_mode="median") * 1e3)
        print(f"N={n} B={b} H={args.heads} d={d} p={args.p} Philox rounds "
              f"{families.PHILOX_ROUNDS}: TFLOP/s by kernel duration "
              f"(profiler) | by do_bench; each over p0's")
        p0k, p0b = statistics.median(kern["p0"]), statistics.median(bench["p0"])
        row = dict(n=n, b=b, h=args.heads, d=d, spec_sha=sha, philox_rounds=families.PHILOX_ROUNDS,
                   base=base, arms=dict(arms),
                   kernel_us=kern, do_bench_us=bench,
                   kernels={label: sorted(k) for label, k in names.items()},
                   launch_meta={label: [{key: repr(val) for key, val in m.items()} for m in ms]
                                for label, ms in metas.items()})
        for label, _ in arms:
            tk, tb = statistics.median(kern[label]), statistics.median(bench[label])
            print(f"  {label:16s} {flops / tk / 1e6:7.1f} | {flops / tb / 1e6:7.1f}"
                  f"   {p0k / tk:.3f} | {p0b / tb:.3f}   {', '.join(sorted(names[label]))}",
                  flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
             "torch": torch.__version__, "variant": args.variant, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
