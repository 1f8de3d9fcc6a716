"""A/B of the Gluon backward's persistent walk (`persistent`, templates/gluon/bwd.py.j2's
PERSISTENT: one program per SM walking key blocks pid, pid + P, ...) against one program
per key block, with SDPA's cuDNN backward beside them, interleaved.

    python benchmarks/gluon_bwd_persistent_ab.py [--rounds 5] [--out results.json]

For d in (64, 128), causal and not, (B, N) in (8, 2048), (4, 4096), (1, 16384) with
H = 2048 // d, plus the transformers Llama shape (B=1, N=4096, H=16, d=128, causal), bf16 in
SDPA's layout: the package's backward (out.backward on a retained graph; the forward runs
once, outside the timing) at the variant's tuned config (runtime.launch_config; where that
is not the Gluon family -- d=64 below GLUON_BWD_SMALL_D_MIN_N -- the Gluon default, and the
row says so) with persistent=False and persistent=True, and cuDNN's backward. Each round
times the three back to back, the order alternating per round; override_config is entered
once per timing (it clears the plans), with a backward before do_bench so the plan is made
outside it. triton.testing.do_bench (grad_to_none, median). TFLOP/s: backward FLOPs = 2.5 x
the forward's 4 B H N^2 d, halved when causal; the medians over rounds, the ratios, each
arm's spread over rounds, and max |dq|, |dk|, |dv| differences between the two Gluon arms
(the same work per key block; dQ's fp32 sum is added in another order).
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
ARMS = ("grid", "persistent", "cudnn")


def cases():
    for d in (64, 128):
        for causal in (False, True):
            for b, n in SHAPES:
                yield d, causal, b, n, 2048 // d, ""
    yield 128, True, 1, 4096, 16, "llama"


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    import triton
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    rows = []
    for d, causal, b, n, h, tag in cases():
        pkg = importlib.import_module(f"generated.{PACKAGES[d]}")
        rt = pkg._runtime
        name = f"bwd_{'causal_' if causal else ''}d{d}_bf16"
        cfg = dict(rt.launch_config(name, torch.device("cuda"), n))
        forced = cfg.get("family") != "gluon"
        if forced:
            cfg = {**rt.PLANNED[name], **rt._gluon_default(name)}
        cfg.pop("persistent", None)
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
                   for _ in range(3))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
        out = pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out_c = F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        def run(arm):
            if arm == "cudnn":
                out_c.backward(do, retain_graph=True)
            else:
                out.backward(do, retain_graph=True)

        def arm_ctx(arm):
            import contextlib
            if arm == "cudnn":
                return contextlib.nullcontext()
            return rt.override_config(**cfg, persistent=arm == "persistent")

        grads, kinds = {}, {}
        for arm in ARMS[:2]:
            with arm_ctx(arm):
                for t in (q, k, v):
                    t.grad = None
                run(arm)
                grads[arm] = [t.grad.float().clone() for t in (q, k, v)]
                kinds[arm] = {(p[7], p[2].meta.get("PERSISTENT"), p[2].grid[0])
                              for p in rt._backward_plans.values()
                              if p is not None and p[7] == rt._BWD_GLUON}
        diff = [round((a - c).abs().max().item(), 5)
                for a, c in zip(grads["grid"], grads["persistent"])]
        ms = {arm: [] for arm in ARMS}
        for r in range(args.rounds):
            for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
                with arm_ctx(arm):
                    run(arm)  # the plan, made outside the timing
                    ms[arm].append(triton.testing.do_bench(
                        lambda: run(arm), warmup=25, rep=100, grad_to_none=[q, k, v],
                        return_mode="median"))
        med = {arm: statistics.median(ms[arm]) for arm in ARMS}
        tf = {arm: round(2.5 * 4 * b * h * n * n * d / (2 if causal else 1)
                         / (med[arm] * 1e-3) / 1e12, 1) for arm in ARMS}
        row = dict(d=d, causal=causal, b=b, n=n, h=h, shape=tag or None,
                   config={k_: v_ for k_, v_ in cfg.items() if k_ != "kind"},
                   gluon_forced=forced, launches={a: sorted(map(list, kinds[a])) for a in kinds},
                   tflops=tf, ms={a: [round(x, 4) for x in ms[a]] for a in ARMS},
                   spread={a: round((max(ms[a]) - min(ms[a])) / med[a], 3) for a in ARMS},
                   persistent_vs_grid=round(med["grid"] / med["persistent"], 3),
                   grid_vs_cudnn=round(med["cudnn"] / med["grid"], 3),
                   persistent_vs_cudnn=round(med["cudnn"] / med["persistent"], 3),
                   max_abs_diff_dq_dk_dv=diff)
        rows.append(row)
        print(f"d={d} {'causal' if causal else 'full  '} B={b} N={n} H={h}{' ' + tag if tag else ''}"
              f"{' (gluon forced)' if forced else ''}: TFLOP/s grid {tf['grid']} persistent "
              f"{tf['persistent']} cudnn {tf['cudnn']}; persistent/grid "
              f"{row['persistent_vs_grid']}, vs cudnn {row['grid_vs_cudnn']} / "
              f"{row['persistent_vs_cudnn']}; spread {row['spread']}; max |diff| {diff}",
              flush=True)
        del out, out_c, q, k, v, do, grads
        torch.cuda.empty_cache()
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
