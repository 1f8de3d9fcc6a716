"""The dropout backward on the Gluon kernel against the `tl` one, on one GPU (Hopper).

    python benchmarks/gluon_dropout_bwd_ab.py [--d 64 128] [--n 1024 4096] [--rounds 3]

bf16, causal, H = 16, B * N = 16k tokens, (B, H, N, d) tensors through the package's
scaled_dot_product_attention (as `flashgen bench` calls it). d = 128 is
specs/bench/dropout_d128.yaml's package, d = 64 is specs/gpt2.yaml's, both built from this
checkout's templates into a temporary folder with their tuned configs. Per shape, the
backward of one saved forward (the forward is not timed), as:

  gluon p=0.1        the Gluon dropout backward, its untuned default (use_family("gluon"))
  gluon-split p=0.1  the same with philox_split (each Philox call drawn once per
                     warpgroup, half its words exchanged through shared memory)
  tl p=0.1           the `tl` dropout backward at the package's tuned config
                     (use_family("tl"): what every dropout backward ran before)
  gluon p=0          the Gluon backward without dropout (the same package's p=0 variant)
  cudnn p=0.1        SDPA's cuDNN backend with dropout_p = 0.1, for scale

Each is timed with triton.testing.do_bench (grad_to_none: a training step's backward
writes fresh gradients) in interleaved rounds, so clock drift hits all alike; the median
over rounds is reported as TFLOP/s (the backward counted as 2.5 forwards, causal FLOPs
halved: 2.5 x 4 B H N^2 d / 2). The Gluon and `tl` dropout backwards of one forward are
compared (max |a - b| / max |b| per gradient: one mask, so only summation order and
rounding differ; bf16 ~1e-2) and the split variant's dK, dV against the default's (the
same arithmetic: expect them identical; dQ's fp32 reduce-adds run in no fixed order).
Prints a table; with $OUT set (the device runner's output folder) writes
$OUT/gluon_dropout_bwd_ab.json. About 1-2 minutes on an H100, most of it compiling.
"""
import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.bench.providers import load_package  # noqa: E402

SPECS = {128: ROOT / "specs/bench/dropout_d128.yaml", 64: ROOT / "specs/gpt2.yaml"}
H, TOKENS, P = 16, 16384, 0.1
CONFIGS = ("gluon p=0.1", "gluon-split p=0.1", "tl p=0.1", "gluon p=0", "cudnn p=0.1")


def bwd_tflops(ms, b, n, d):
    return 2.5 * 4 * b * H * n * n * d / 2 / (ms * 1e-3) / 1e12


def set_family(pkg, family, split=False):
    """Send the package's later calls to `family` ("gluon" / "tl"), the Gluon dropout
    backward with or without philox_split; the launch plans are rebuilt."""
    rt = pkg._runtime
    rt.use_family(family)
    rt._families.GLUON_BWD_PHILOX_SPLIT = split
    rt._configs.clear()
    rt._backward_plans.clear()


def inputs(b, n, d, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(b, H, n, d, device="cuda", dtype=torch.bfloat16, generator=g,
                        requires_grad=True) for _ in range(3)]


def saved_forward(fn, b, n, d, p, seed):
    """(q, k, v, out, do) of one forward from generator state `seed`."""
    q, k, v = inputs(b, n, d, seed)
    torch.manual_seed(seed)
    out = fn(q, k, v, p)
    return q, k, v, out, torch.randn_like(out)


def kinds(pkg):
    return sorted({str(pl[7]) for pl in pkg._runtime._backward_plans.values() if pl is not None})


def compare(pkg, b, n, d):
    """max |a - b| / max |b| of dq, dk, dv: Gluon vs `tl` dropout backward of one forward,
    and whether the split variant's dK, dV equal the default's bit for bit."""
    set_family(pkg, "")
    q, k, v, out, do = saved_forward(lambda q, k, v, p: pkg.scaled_dot_product_attention(
        q, k, v, dropout_p=p, is_causal=True), b, n, d, P, seed=7)
    grads = {}
    for label, family, split in (("gluon", "gluon", False), ("split", "gluon", True),
                                 ("tl", "tl", False)):
        set_family(pkg, family, split)
        grads[label] = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        assert ("gluon" in kinds(pkg)) == (family == "gluon"), (label, kinds(pkg))
    set_family(pkg, "")
    rel = {name: ((a.float() - t.float()).abs().max() / t.float().abs().max()).item()
           for name, a, t in zip(("dq", "dk", "dv"), grads["gluon"], grads["tl"])}
    same = all(torch.equal(a, s) for a, s in zip(grads["gluon"][1:], grads["split"][1:]))
    return rel, same


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128], choices=sorted(SPECS))
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    started = time.perf_counter()
    rows = []
    print("| d | N | B | " + " | ".join(CONFIGS) + " | gluon / tl | gluon / cudnn | "
          "gluon vs tl (dq, dk, dv) | split dK,dV same |\n|" + "---|" * (len(CONFIGS) + 7),
          flush=True)
    for d in args.d:
        pkg, sha = load_package(SPECS[d])

        def flashgen(q, k, v, p):
            return pkg.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

        def cudnn(q, k, v, p):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

        for n in args.n:
            b = TOKENS // n
            # (the forward behind each timed backward, the family the backward runs on)
            setups = {
                "gluon p=0.1": (flashgen, P, ("gluon", False)),
                "gluon-split p=0.1": (flashgen, P, ("gluon", True)),
                "tl p=0.1": (flashgen, P, ("tl", False)),
                "gluon p=0": (flashgen, 0.0, ("gluon", False)),
                "cudnn p=0.1": (cudnn, P, None),
            }
            calls, used = {}, {}
            for label, (fn, p, mode) in setups.items():
                set_family(pkg, "")  # the forward as the package runs it
                try:
                    q, k, v, out, do = saved_forward(fn, b, n, d, p, seed=1)
                    out.backward(do, retain_graph=True)  # (and its backward runs here)
                except RuntimeError as e:  # e.g. no cuDNN attention with dropout
                    print(f"({label}: {type(e).__name__}: {str(e)[:120]})", flush=True)
                    continue
                calls[label] = ((lambda out=out, do=do: out.backward(do, retain_graph=True)),
                                [q, k, v], mode)
            samples = {label: [] for label in calls}
            for _ in range(args.rounds):
                for label, (call, grads, mode) in calls.items():
                    if mode is not None:
                        set_family(pkg, *mode)
                    ms = triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads,
                                                 return_mode="median")
                    samples[label].append(ms)
                    if mode is not None:
                        used[label] = kinds(pkg)
            set_family(pkg, "")
            ms = {label: statistics.median(s) for label, s in samples.items()}
            tf = {label: bwd_tflops(t, b, n, d) for label, t in ms.items()}
            tf.update({c: float("nan") for c in CONFIGS if c not in tf})
            rel, same = compare(pkg, b, n, d)
            row = dict(d=d, n=n, b=b, h=H, spec_sha=sha, ms=ms, tflops=tf, samples_ms=samples,
                       backward_kinds=used, gluon_vs_tl_rel=rel, split_dkdv_identical=same)
            rows.append(row)
            print(f"| {d} | {n} | {b} | " + " | ".join(f"{tf[c]:.1f}" for c in CONFIGS)
                  + f" | {tf['gluon p=0.1'] / tf['tl p=0.1']:.2f}x"
                  + f" | {tf['gluon p=0.1'] / tf['cudnn p=0.1']:.2f}x"
                  + " | " + ", ".join(f"{rel[g]:.1e}" for g in ("dq", "dk", "dv"))
                  + f" | {same} |", flush=True)
            torch.cuda.empty_cache()
    print(f"(TFLOP/s, median of {args.rounds} interleaved do_bench rounds; "
          f"{time.perf_counter() - started:.0f} s)")
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "gluon_dropout_bwd_ab.json"
        path.write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "triton": triton.__version__,
             "torch": torch.__version__, "dropout_p": P, "causal": True, "dtype": "bf16",
             "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
