"""What limits dropout speed: time the dropout forward/backward with the keep-mask generator
swapped for cheaper stand-ins (not for use: the stand-ins are not random). On the GPU:

    python benchmarks/dropout_rng_experiment.py

  philox10 -- what ships: Philox4x32-10, 8 keep decisions per call
  philox7  -- Philox4x32-7 (passes BigCrush per Salmon et al. 2011, less margin)
  hash     -- one multiply-xorshift per 8 decisions: the cost of everything but Philox
and p = 0 (no dropout code) as the baseline.
"""
import importlib
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.build import build  # noqa: E402

SPEC = (ROOT / "benchmarks/specs/dropout_d128.yaml").read_text()
PHILOX = "r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3)"
STANDINS = {
    "philox10": PHILOX,
    "philox7": "r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3, 7)",
    "hash": ("h = (c0 * 0x9E3779B9) ^ (c1 * 0x85EBCA6B) ^ (c2 * 0xC2B2AE35) ^ c3\n"
             "    r0 = h * 0x27D4EB2F\n    r1 = r0 ^ (r0 >> 15)\n    r2 = r1 * 0x165667B1\n"
             "    r3 = r2 ^ (r2 >> 13)"),
}


def main():
    tmp = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(tmp))
    pkgs = {}
    for name, code in STANDINS.items():
        spec = tmp / f"{name}.yaml"
        spec.write_text(SPEC.replace("package: bench_dropout_attn", f"package: exp_{name}"))
        build(spec, tmp)
        dropout_py = tmp / f"exp_{name}" / "_dropout.py"
        text = dropout_py.read_text()
        assert PHILOX in text
        dropout_py.write_text(text.replace(PHILOX, code))
        pkgs[name] = importlib.import_module(f"exp_{name}")
    b, h, n, d = 4, 16, 4096, 128
    flops = 4 * b * h * n * n * d / 2
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    print(f"causal d=128 N={n} B={b} H={h} bf16, TFLOP/s")
    print("| keep-mask generator | fwd | bwd |")
    print("|---|---|---|")
    cases = [("p=0 (no dropout code)", pkgs["philox10"], 0.0)]
    cases += [(name, pkg, 0.1) for name, pkg in pkgs.items()]
    for label, pkg, p in cases:
        try:
            measure(label, pkg, p, q, k, v, flops)
        except Exception as e:  # a stand-in that does not compile is reported, not fatal
            print(f"| {label} | error: {type(e).__name__}: {str(e)[:60]} | |")


def measure(label, pkg, p, q, k, v, flops):
    fwd = lambda: pkg.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # noqa: E731
    out = fwd()
    do = torch.randn_like(out)
    ms_f = triton.testing.do_bench(fwd, warmup=25, rep=100, return_mode="median")
    ms_b = triton.testing.do_bench(lambda: out.backward(do, retain_graph=True), warmup=25,
                                   rep=100, return_mode="median")
    print(f"| {label} | {flops / ms_f / 1e9:.1f} | {2.5 * flops / ms_b / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
