"""The Gluon backward's program order under a causal mask: head-major against key blocks
level by level in groups of heads (HEAD_GROUP, the runtime's _gluon_bwd_head_group), on one
GPU (Hopper).

    python benchmarks/bwd_head_group_ab.py [--rounds 3] [--shapes 1,16,4096,128[,HKV] ...]

For each (B, H, N, d[, H_KV]) shape (H_KV < H: GQA; the package must be built with it), bf16 causal, (B, H, N, d) tensors through the example
packages' scaled_dot_product_attention (d = 128: specs/llama.yaml, d = 64:
specs/gpt2.yaml, built from this checkout), the backward of one saved forward is timed as

  head-major   the Gluon default config with bwd_head_group = 1 (the order before)
  grouped      the Gluon default config, the runtime's group (printed as G)
  package      the package as it runs by default (tuned config, the runtime's group)
  cudnn        SDPA's cuDNN backend

with triton.testing.do_bench (grad_to_none) in interleaved rounds; TFLOP/s (2.5 x the
causal forward's 4 B H N^2 d / 2). dK and dV must be bit-identical between the two orders
(one program writes each key block's), dQ within fp32 summation order. With $OUT set,
writes $OUT/bwd_head_group_ab.json.
"""
import argparse
import contextlib
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

SHAPES = ["1,16,4096,128", "8,16,2048,128", "4,16,4096,128", "1,16,16384,128",
          "8,32,2048,64", "4,32,4096,64"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--shapes", nargs="+", default=SHAPES)
    ap.add_argument("--also", nargs="*", type=int, default=[],
                    help="more arms: the Gluon default config at these forced group sizes")
    args = ap.parse_args()
    import triton
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    started = time.perf_counter()
    rows = []
    print("| B | H | N | d | G | head-major | grouped | package | cudnn | grouped / head-major "
          "| grouped / cudnn | dK,dV same | dQ max rel |\n|" + "---|" * 13, flush=True)
    for shape in args.shapes:
        b, h, n, d, *rest = map(int, shape.split(","))
        hkv = rest[0] if rest else h
        pkg, _ = load_package(None, d)
        rt = pkg._runtime
        g = torch.Generator(device="cuda").manual_seed(b * n + d)
        q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k, v = (torch.randn(b, hkv, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                for _ in range(2))
        do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
        group = rt._gluon_bwd_head_group({}, f"bwd_causal_d{d}_bf16", q, b * hkv, -(-n // 128))

        def saved(fn):
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = fn(qg, kg, vg)
            return out, [qg, kg, vg]

        def flash(qg, kg, vg):
            return pkg.scaled_dot_product_attention(qg, kg, vg, is_causal=True,
                                                    enable_gqa=hkv != h)

        def cudnn(qg, kg, vg):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qg, kg, vg, is_causal=True,
                                                      enable_gqa=hkv != h)

        def ctx(override):
            return rt.override_config(**override) if override else contextlib.nullcontext()

        arms = {"head-major": (flash, dict(family="gluon", bwd_head_group=1)),
                "grouped": (flash, dict(family="gluon")),
                "package": (flash, None), "cudnn": (cudnn, None),
                **{f"G={g}": (flash, dict(family="gluon", bwd_head_group=g)) for g in args.also}}
        calls, grads = {}, {}
        for label, (fn, override) in arms.items():
            out, leaves = saved(fn)

            def call(out=out):
                out.backward(do, retain_graph=True)
            with ctx(override):
                call()
            grads[label] = [t.grad.clone() for t in leaves]
            calls[label] = (call, leaves, override)
        same = all(torch.equal(a, c) for a, c in zip(grads["head-major"][1:], grads["grouped"][1:]))
        dq_rel = ((grads["head-major"][0].float() - grads["grouped"][0].float()).abs().max()
                  / grads["head-major"][0].float().abs().max()).item()
        samples = {label: [] for label in calls}
        for _ in range(args.rounds):
            for label, (call, leaves, override) in calls.items():
                with ctx(override):  # (entered once: it clears the launch plans)
                    samples[label].append(triton.testing.do_bench(
                        call, warmup=25, rep=100, grad_to_none=leaves, return_mode="median"))
        flops = 2.5 * 4 * b * h * n * n * d / 2
        tf = {label: flops / (statistics.median(s) * 1e-3) / 1e12 for label, s in samples.items()}
        rows.append(dict(b=b, h=h, h_kv=hkv, n=n, d=d, group=group, tflops=tf, samples_ms=samples,
                         dkdv_identical=same, dq_max_rel=dq_rel))
        print(f"| {b} | {h}{'' if hkv == h else f'/{hkv}'} | {n} | {d} | {group} | "
              + " | ".join(f"{tf[a]:.1f}" for a in ("head-major", "grouped", "package", "cudnn"))
              + f" | {tf['grouped'] / tf['head-major']:.3f} | {tf['grouped'] / tf['cudnn']:.3f}"
              f" | {same} | {dq_rel:.1e} |", flush=True)
        if args.also:
            print("    " + ", ".join(f"G={g}: {tf[f'G={g}']:.1f}" for g in args.also), flush=True)
        del calls, grads, q, k, v, do
        torch.cuda.empty_cache()
    print(f"({args.rounds} interleaved rounds; {time.perf_counter() - started:.0f} s)")
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "bwd_head_group_ab.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "triton": triton.__version__, "torch": torch.__version__,
                                    "rows": rows}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
