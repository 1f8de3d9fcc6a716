"""The Gluon dropout forward's tile-boundary knobs, against the package's own config. On an H100:

    python benchmarks/dropout_fwd_knobs_ab.py [--n 1024 4096] [--rounds 4] [--out FILE.json]

Issue 14's dropout bar is the forward at p = 0.1 over the same kernel at p = 0 (causal
d=128 bf16, H=16, B*N = 16k; specs/bench/dropout_d128.yaml, what `flashgen bench --suite
dropout` builds). The knobs the mods' short tiles gained from (`q_buffers` 2: the next
tile's Q loads while this one runs; `overlap`: a tile's stores behind the next tile's first
product; `diag_first`) were measured on the training anchors without dropout only. Each arm
is the package's launch config with one change (`override_config`), timed with
triton.testing.do_bench (median) and by its kernel's device time under torch.profiler
(`fwd_kernel_times.kernel_us`, with the kernel's name), arms interleaved round by round;
p = 0 at the base config gives the ratio. An arm the config check refuses (shared memory)
prints its reason. (The profiler's reading was added in the twenty-ninth session, after two
runs of this script read every p = 0.1 arm level where kernel durations did not.)
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

sys.path.insert(0, str(ROOT / "benchmarks"))
from fwd_kernel_times import kernel_us  # noqa: E402

SPEC = ROOT / "specs/bench/dropout_d128.yaml"
H, D, TOKENS, P = 16, 128, 16384, 0.1
ARMS = {"base": {}, "q_buffers=1": {"q_buffers": 1}, "q_buffers=2": {"q_buffers": 2},
        "overlap": {"overlap": True},
        "q2+overlap": {"q_buffers": 2, "overlap": True}, "diag_first": {"diag_first": True},
        "pingpong=False": {"pingpong": False}}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--arm", action="append", default=[], metavar="NAME=JSON",
                    help="an extra arm: a name and the override_config knobs as JSON, timed "
                         "at p = 0.1 and (as 'NAME p=0') at p = 0")
    args = ap.parse_args()
    extra = {}
    for spec in args.arm:
        label, _, knobs = spec.partition("=")
        extra[label] = json.loads(knobs)
    import triton

    pkg, sha = load_package(SPEC)
    rt = pkg._runtime
    name = f"fwd_causal_dropout_d{D}_bf16"
    rows = []
    for n in args.n:
        b = TOKENS // n
        q, k, v = (torch.randn(b, n, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        flops = 4 * b * H * n * n * D / 2
        base = dict(rt.launch_config(name, q.device, n))
        arms = {label: ({**base, **change}, P)
                for label, change in (ARMS.items() if not extra else [("base", {})])}
        arms["base p=0"] = (base, 0.0)
        for label, change in extra.items():
            arms[label] = ({**base, **change}, P)
            arms[label + " p=0"] = ({**base, **change}, 0.0)
        times = {label: [] for label in arms}
        kernel = {label: [] for label in arms}  # the profiler's device time of the kernel
        kernels = {}
        errors = {}
        for _ in range(args.rounds):
            for label, (cfg, p) in arms.items():
                if label in errors:
                    continue
                try:
                    with rt.override_config(**cfg):
                        def call(p=p):
                            return pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
                        times[label].append(triton.testing.do_bench(
                            call, warmup=25, rep=100, return_mode="median"))
                        # the same arm by its kernel's duration, with the kernel's name: in
                        # the twenty-ninth session this script's do_bench readings put
                        # arms level that kernel durations put 33% apart
                        us, name_seen = kernel_us(call)
                        kernel[label].append(us)
                        kernels.setdefault(label, set()).add(name_seen)
                except Exception as ex:  # a config the kernel family refuses
                    errors[label] = repr(ex)[:200]
        tf = {label: flops / statistics.median(t) / 1e9 for label, t in times.items() if t}
        tk = {label: flops / statistics.median(t) / 1e6 for label, t in kernel.items() if t}
        shown = {key: base.get(key) for key in ("family", "block_n", "num_stages", "q_buffers",
                                                "overlap", "diag_first", "pingpong")}
        print(f"N={n} B={b} base config {shown}")
        for label, t in tf.items():
            print(f"  {label:16s} {t:7.1f} TFLOP/s  x{t / tf['base']:.3f} of base"
                  f"  p=0.1/p=0 {t / tf['base p=0']:.3f}   by kernel duration {tk[label]:7.1f}"
                  f"  x{tk[label] / tk['base']:.3f}  p=0.1/p=0 {tk[label] / tk['base p=0']:.3f}"
                  f"  ({', '.join(sorted(kernels[label]))})")
        for label, why in errors.items():
            print(f"  {label:16s} refused: {why}")
        rows.append(dict(n=n, b=b, h=H, d=D, spec_sha=sha, base=shown, tflops=tf,
                         tflops_by_kernel_duration=tk,
                         kernels={label: sorted(k) for label, k in kernels.items()},
                         errors=errors))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
             "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
