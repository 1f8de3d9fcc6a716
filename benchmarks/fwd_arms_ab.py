"""Forward A/B of whole package builds against each other and cuDNN, interleaved.

    PYTHONPATH=$PWD python benchmarks/fwd_arms_ab.py --d 64 \\
        --arm main=generated/gpt2_attn \\
        --arm c3=.scratch/arms/c3/gpt2_attn:'{"family": "gluon", "regs": "160/24"}' \\
        [--shapes 8x2048 4x4096 1x16384] [--causal both] [--rounds 5] [--json OUT]

An arm is a generated package directory (built from any checkout or branch: a template
change, a different consumer count), imported under a name of its own so that several
builds of one package can sit in one process, with an optional launch config forced by
its runtime's override_config (JSON). For each shape (bf16, H = 2048 // d, SDPA layout)
every arm and SDPA's cuDNN backend are timed back to back with triton.testing.do_bench
(L2 flushed, median), the order rotating each round so that a clock drift hits every arm
alike; the table gives the median over rounds in TFLOP/s (4 B H N^2 d, halved when causal),
each arm's ratio to the first arm and to cuDNN, and the outputs' max |difference| from the
first arm's (every arm must compute the same attention).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import statistics
import sys
from pathlib import Path


def load(path: str, alias: str):
    """Import the generated package at `path` as module `alias`."""
    root = Path(path).resolve()
    spec = importlib.util.spec_from_file_location(
        alias, root / "__init__.py", submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    spec.loader.exec_module(module)
    return module


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--arm", action="append", required=True, metavar="LABEL=DIR[:JSON]")
    ap.add_argument("--shapes", nargs="+", default=["8x2048", "4x4096", "1x16384"])
    ap.add_argument("--causal", choices=("yes", "no", "both"), default="both")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    arms = {}
    for i, text in enumerate(args.arm):
        label, _, rest = text.partition("=")
        path, _, cfg = rest.partition(":")
        arms[label] = (load(path, f"fwd_arm_{i}_{Path(path).name}"), json.loads(cfg) if cfg else {})
    first = next(iter(arms))
    h = 2048 // args.d
    rows = []
    for causal in {"yes": (True,), "no": (False,), "both": (False, True)}[args.causal]:
        for shape in args.shapes:
            b, n = map(int, shape.split("x"))
            flops = 4 * b * h * n * n * args.d / (2 if causal else 1)
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, n, args.d, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            fns = {}
            for label, (pkg, cfg) in arms.items():
                def run(pkg=pkg, cfg=cfg):
                    ctx = pkg._runtime.override_config(**cfg) if cfg else contextlib.nullcontext()
                    with ctx:
                        return pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)
                fns[label] = run

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            fns["cudnn"] = cudnn
            ref = fns[first]().float()
            diffs = {label: (fn().float() - ref).abs().max().item() for label, fn in fns.items()}
            ms = {label: [] for label in fns}
            order = list(fns)
            for r in range(args.rounds):
                for label in order[r % len(order):] + order[:r % len(order)]:
                    ms[label].append(triton.testing.do_bench(fns[label], warmup=25, rep=100,
                                                             return_mode="median"))
            med = {label: statistics.median(v) for label, v in ms.items()}
            tf = {label: flops / (t * 1e-3) / 1e12 for label, t in med.items()}
            row = dict(d=args.d, causal=causal, b=b, n=n, h=h, tflops=tf, ms=ms, max_diff=diffs)
            rows.append(row)
            cells = "  ".join(f"{label} {tf[label]:.1f} ({tf[label] / tf[first]:.3f}x {first}, "
                              f"{tf[label] / tf['cudnn']:.3f}x cuDNN, diff {diffs[label]:.1e})"
                              for label in fns)
            print(f"d={args.d} {'causal' if causal else 'full  '} B={b} N={n}: {cells}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
