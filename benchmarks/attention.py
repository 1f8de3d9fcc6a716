"""Attention throughput on the GPU: flashgen's generated packages beside SDPA's flash
(FlashAttention-2) and cuDNN backends, in one run, at the shapes of the H100 anchor table
(B*N = 16k tokens, H*d = 2048, bf16).

    python benchmarks/attention.py [--mode fwd bwd] [--out results.json] [--n 512 1024 ...]

FLOPs = 4*B*H*N*N*d for the forward, halved when causal, and 2.5x that for the backward
(the FlashAttention papers' convention). "bwd" times the backward call alone,
`o.backward(do, retain_graph=True)`. Each provider's output is checked against SDPA's math
backend in float32 on a slice of the same inputs before it is timed. Times are do_bench
medians with the L2 flushed between calls.

Superseded by `flashgen bench --suite training` (benchmarks/suite.py), which adds
FlexAttention and naive PyTorch and writes CSV/JSON/plots. Kept until that suite has
been run on the GPU, because the committed H100 results in benchmarks/results/ came
from this script.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PACKAGES = {64: "generated.gpt2_attn", 128: "generated.llama_attn"}


def sdpa_with(backend):
    def run(q, k, v, causal):
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def flashgen_provider(d):
    pkg = importlib.import_module(PACKAGES[d])

    def run(q, k, v, causal):
        return pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def flops(b, h, n, d, causal, mode):
    f = 4 * b * h * n * n * d
    f = f / 2 if causal else f
    return 2.5 * f if mode == "bwd" else f


def timed_call(fn, q, k, v, causal, mode):
    """The callable do_bench times: the forward, or the backward of one saved forward."""
    if mode == "fwd":
        return lambda: fn(q, k, v, causal)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v, causal)
    do = torch.randn_like(out)
    return lambda: out.backward(do, retain_graph=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="*", default=[512, 1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--d", type=int, nargs="*", default=[64, 128])
    ap.add_argument("--mode", nargs="*", default=["fwd", "bwd"], choices=["fwd", "bwd"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    providers = {
        "sdpa_flash": sdpa_with(SDPBackend.FLASH_ATTENTION),
        "sdpa_cudnn": sdpa_with(SDPBackend.CUDNN_ATTENTION),
    }
    rows = []
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}, triton {triton.__version__}, bf16")
    for mode, d in [(m, d) for m in args.mode for d in args.d]:
        h = 2048 // d
        fg = flashgen_provider(d)
        for causal in (False, True):
            for n in args.n:
                b = max(16384 // n, 1)
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16)
                           for _ in range(3))
                # reference on a slice of the batch, in float32 through SDPA's math path
                with sdpa_kernel(SDPBackend.MATH):
                    ref = F.scaled_dot_product_attention(q[:1, :2].float(), k[:1, :2].float(),
                                                         v[:1, :2].float(), is_causal=causal)
                row = {"gpu": gpu, "mode": mode, "d": d, "causal": causal, "n": n, "b": b, "h": h}
                for name, fn in [("flashgen", fg), *providers.items()]:
                    try:
                        out = fn(q, k, v, causal)
                        err = (out[:1, :2].float() - ref).abs().max().item()
                        if not err < 3e-2:
                            row[name] = f"WRONG (max err {err:.3g})"
                            continue
                        ms = triton.testing.do_bench(timed_call(fn, q, k, v, causal, mode),
                                                     warmup=25, rep=100, return_mode="median")
                        row[name] = round(flops(b, h, n, d, causal, mode) / ms / 1e9, 1)
                    except Exception as e:  # a backend that refuses a shape is reported, not fatal
                        row[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
                    torch.cuda.empty_cache()
                rows.append(row)
                print(json.dumps(row), flush=True)
                del q, k, v, ref
                torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| mode | d | causal | N | flashgen | SDPA flash | SDPA cuDNN | vs flash | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        fgv, fl, cu = r["flashgen"], r["sdpa_flash"], r["sdpa_cudnn"]
        ratio = (lambda a, b_: f"{a / b_:.2f}" if isinstance(a, float) and isinstance(b_, float) else "-")
        print(f"| {r['mode']} | {r['d']} | {r['causal']} | {r['n']} | {fgv} | {fl} | {cu} | {ratio(fgv, fl)} | {ratio(fgv, cu)} |")


if __name__ == "__main__":
    main()
