"""Dropout speed on the GPU: flashgen with and without dropout beside SDPA's flash and cuDNN
backends with dropout, in one run (bf16, causal, d=128, H=16, B*N=16k, p=0.1).

    python benchmarks/dropout.py [--out results.json]

The bar: flashgen's dropout forward and backward each >= 0.85x its own no-dropout speed,
and >= 1.3x cuDNN's dropout speed. Correctness of dropout is the tests' job (exact mask
replay); here each provider's output is only checked for NaN.

Superseded by `flashgen bench --suite dropout` (benchmarks/suite.py), which adds
FlexAttention and naive PyTorch and writes CSV/JSON/plots. Kept until that suite has
been run on the GPU, because the committed H100 results in benchmarks/results/ came
from this script.
"""
import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.build import build  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="*", default=[1024, 4096])
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--out")
    args = ap.parse_args()
    tmp = tempfile.mkdtemp()
    build(ROOT / "benchmarks/specs/dropout_d128.yaml", Path(tmp))
    sys.path.insert(0, tmp)
    pkg = importlib.import_module("bench_dropout_attn")

    def flashgen(p):
        return lambda q, k, v: pkg.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)

    def sdpa(backend, p):
        def run(q, k, v):
            with sdpa_kernel(backend):
                return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return run

    providers = {
        "flashgen_p0": flashgen(0.0),
        "flashgen": flashgen(args.p),
        "sdpa_flash": sdpa(SDPBackend.FLASH_ATTENTION, args.p),
        "sdpa_cudnn": sdpa(SDPBackend.CUDNN_ATTENTION, args.p),
    }
    d, h = 128, 16
    rows = []
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"bf16 causal d={d} p={args.p}")
    for n in args.n:
        b = 16384 // n
        fwd_flops = 4 * b * h * n * n * d / 2
        for mode in ("fwd", "bwd"):
            row = {"mode": mode, "n": n, "b": b, "h": h, "d": d, "p": args.p}
            for name, fn in providers.items():
                q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                       requires_grad=(mode == "bwd")) for _ in range(3))
                try:
                    if mode == "fwd":
                        out = fn(q, k, v)
                        call = lambda: fn(q, k, v)  # noqa: E731
                    else:
                        out = fn(q, k, v)
                        do = torch.randn_like(out)
                        call = lambda: out.backward(do, retain_graph=True)  # noqa: E731
                    assert not torch.isnan(out).any()
                    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                    flops = fwd_flops * (2.5 if mode == "bwd" else 1)
                    row[name] = round(flops / ms / 1e9, 1)
                except Exception as e:
                    row[name] = f"error: {type(e).__name__}: {str(e)[:80]}"
                del q, k, v
                torch.cuda.empty_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| mode | N | flashgen p=0 | flashgen p=0.1 | SDPA flash p=0.1 | cuDNN p=0.1 | vs own p=0 | vs cuDNN |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        fg, fg0, cu = r["flashgen"], r["flashgen_p0"], r["sdpa_cudnn"]
        ratio = lambda a, b_: f"{a / b_:.2f}" if isinstance(a, float) and isinstance(b_, float) else "-"  # noqa: E731
        print(f"| {r['mode']} | {r['n']} | {fg0} | {fg} | {r['sdpa_flash']} | {cu} | "
              f"{ratio(fg, fg0)} | {ratio(fg, cu)} |")


if __name__ == "__main__":
    main()
