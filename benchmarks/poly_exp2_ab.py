"""The Gluon forward with a share of its exponentials on the FMA units (`poly_exp2`), against
the same kernel with all of them on MUFU and against cuDNN, interleaved.

    python benchmarks/poly_exp2_ab.py [--rounds 4] [--d 64 128] [--polys 0 8 4 2] [--out f.json]

For d in --d, causal and not, (B, N) in (8, 2048), (4, 4096), (1, 16384), H = 2048 // d
(bf16, SDPA layout): each arm is the package's own launch config for that variant and
length (`_runtime.launch_config`, the tuned entry) with `poly_exp2` set to k (1/k of P's
columns by the cubic; 0 = all on MUFU), run through `override_config`; every round times
every arm and SDPA's cuDNN backend with `triton.testing.do_bench` (L2 flushed, median),
the order rotating per round. The table gives each arm's median TFLOP/s over rounds (4 B H
N^2 d, halved when causal), its ratio to the k = 0 arm and to cuDNN, and each arm's max
abs difference from the k = 0 output (the cubic's rounding, bf16).
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SHAPES = ((8, 2048), (4, 4096), (1, 16384))
PACKAGES = {64: "gpt2_attn", 128: "llama_attn"}


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--d", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--polys", type=int, nargs="+", default=[0, 8, 4, 2])
    ap.add_argument("--causal", choices=("both", "yes", "no"), default="both")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    polys = [0] + [k for k in args.polys if k != 0]
    causals = {"both": (False, True), "yes": (True,), "no": (False,)}[args.causal]
    rows = []
    for d in args.d:
        pkg = importlib.import_module(f"generated.{PACKAGES[d]}")
        h = 2048 // d
        for causal in causals:
            name = f"fwd_{'causal_' if causal else ''}d{d}_bf16"
            for b, n in SHAPES:
                flops = 4 * b * h * n * n * d / (2 if causal else 1)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                cfg = dict(pkg._runtime.launch_config(name, q.device, n))
                # an arm: (the context it runs in, the call); the override is entered once
                # per timing, not per call (it clears the launch plans)
                arms = {f"poly{kp}": (lambda c={**cfg, "poly_exp2": kp}:
                                      pkg._runtime.override_config(**c),
                                      lambda q=q, k=k, v=v, causal=causal:
                                      pkg.scaled_dot_product_attention(q, k, v, is_causal=causal))
                        for kp in polys}
                arms["cudnn"] = (lambda: sdpa_kernel([SDPBackend.CUDNN_ATTENTION]),
                                 lambda q=q, k=k, v=v, causal=causal:
                                 F.scaled_dot_product_attention(q, k, v, is_causal=causal))

                def run(a):
                    ctx, fn = arms[a]
                    with ctx():
                        return fn()

                base = run("poly0").float()
                diffs = {a: (run(a).float() - base).abs().max().item() for a in arms}
                nans = {a: bool(torch.isnan(run(a)).any()) for a in arms}
                ms = {a: [] for a in arms}
                names = list(arms)
                for r in range(args.rounds):
                    order = names[r % len(names):] + names[:r % len(names)]
                    for a in order:
                        ctx, fn = arms[a]
                        with ctx():
                            ms[a].append(triton.testing.do_bench(fn, warmup=10, rep=40,
                                                                 return_mode="median"))
                med = {a: statistics.median(t) for a, t in ms.items()}
                row = dict(d=d, causal=causal, B=b, N=n, H=h, config=cfg,
                           tflops={a: round(flops / m / 1e9, 1) for a, m in med.items()},
                           vs_poly0={a: round(med["poly0"] / m, 3) for a, m in med.items()},
                           vs_cudnn={a: round(med["cudnn"] / m, 3) for a, m in med.items()},
                           max_abs_diff_vs_poly0=diffs, nan=nans,
                           spread={a: round((max(t) - min(t)) / med[a], 3) for a, t in ms.items()})
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, triton {triton.__version__}, torch "
          f"{torch.__version__}; TFLOP/s, median of {args.rounds} interleaved rounds\n")
    arms = [f"poly{k}" for k in polys]
    print("| d | causal | B x N | " + " | ".join(arms) + " | cuDNN | best / poly0 | best / cuDNN |")
    print("|---|---|---|" + "---|" * (len(arms) + 3))
    for r in rows:
        best = max(arms, key=lambda a: r["tflops"][a])
        print(f"| {r['d']} | {r['causal']} | {r['B']} x {r['N']} | "
              + " | ".join(str(r["tflops"][a]) for a in arms)
              + f" | {r['tflops']['cudnn']} | {best} {r['vs_poly0'][best]} | {r['vs_cudnn'][best]} |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
