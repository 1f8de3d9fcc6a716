"""What limits dropout speed: time the dropout forward/backward with the keep-mask generator
swapped for cheaper stand-ins (not for use: the stand-ins are not random). On the GPU:

    python benchmarks/dropout_rng_experiment.py

  philox10 -- what ships: Philox4x32-10, 8 keep decisions per call
  philox7  -- Philox4x32-7 (passes BigCrush per Salmon et al. 2011, less margin)
  hash     -- one multiply-xorshift per 8 decisions: the cost of everything but Philox
  mma_layout -- Philox4x32-10 with the 8 draws of a call laid out as the tensor-core
              accumulator holds them (rows r and r+8, columns 8 apart, pairs of adjacent
              columns), so the mask is built in registers with no layout conversion
              (a real generator, a different element-to-draw mapping; see MMA_LAYOUT)
and p = 0 (no dropout code) as the baseline. `--check` instead runs each package's forward
and backward against a float64 reference with the package's replayed mask (CPU
interpreter or GPU) and checks the keep rate.
"""
import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch

if not torch.cuda.is_available():  # --check on a CPU: Triton's interpreter
    os.environ.setdefault("TRITON_INTERPRET", "1")
import triton  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.build import build  # noqa: E402
from flashgen.reference import attention_ref, visible_mask  # noqa: E402

SPEC = (ROOT / "benchmarks/specs/dropout_d128.yaml").read_text()
PHILOX = "r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3)"
STANDINS = {
    "philox10": PHILOX,
    "philox7": "r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3, 7)",
    "hash": ("h = (c0 * 0x9E3779B9) ^ (c1 * 0x85EBCA6B) ^ (c2 * 0xC2B2AE35) ^ c3\n"
             "    r0 = h * 0x27D4EB2F\n    r1 = r0 ^ (r0 >> 15)\n    r2 = r1 * 0x165667B1\n"
             "    r3 = r2 ^ (r2 >> 13)"),
    "mma_layout": None,  # MMA_LAYOUT replaces the whole keep_mask
}


# keep_mask with a mapping that matches the accumulator's register layout. Element (row, col)
# with row = row0 + 16 g + 8 wh + rr and col = col0 + 16 q + 8 wl + 2 t + k takes half k of
# word 2 wh + wl of the Philox call with counter (4 (col0 / 16 + q) + t, row0 + 16 g + rr).
# Hopper's MMA accumulator gives each thread rows rr and rr + 8 of a 16-row slab and columns
# 2t, 2t + 1, then every 8th column: the joined axes (wh, wl, k) are exactly those
# in-thread positions, so the 7-D permute + reshape below is free. Compiled offline for
# sm_90 (Triton 3.6 and 3.9) inside a QK^T / exp2 / where loop: no convert_layout beyond
# the p = 0 kernel's, where the shipped join/reshape adds three (and 24-80 registers).
# Needs tiles of >= 16 rows and columns starting at multiples of 16.
MMA_LAYOUT = """@triton.jit
def keep_mask(SEED, RNG_OFFSET, bh, rows, col_start, DROP_THRESHOLD,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    row0 = tl.min(rows, 0)  # the tile's first row (rows is row0 + arange)
    g = tl.arange(0, BLOCK_R // 16)
    rr = tl.arange(0, 8)
    q = tl.arange(0, BLOCK_C // 16)
    t = tl.arange(0, 4)
    zero = tl.zeros([BLOCK_R // 16, 8, BLOCK_C // 16, 4], dtype=tl.uint32)
    crow = (row0 + 16 * g[:, None] + rr[None, :]).to(tl.uint32)  # [R/16, 8]
    ccol = (4 * (col_start // 16 + q[:, None]) + t[None, :]).to(tl.uint32)  # [C/16, 4]
    c0 = zero + ccol[None, None, :, :]
    c1 = zero + crow[:, :, None, None]
    c2 = zero + bh.to(tl.uint32)
    c3 = zero + RNG_OFFSET.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3)
    x = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # [g, rr, q, t, wl, wh]
    y = tl.join(x & 0xFFFF, x >> 16)  # [g, rr, q, t, wl, wh, k]
    y = tl.permute(y, (0, 5, 1, 2, 4, 3, 6))  # [g, wh, rr, q, wl, t, k]
    return tl.reshape(y, [BLOCK_R, BLOCK_C]) >= DROP_THRESHOLD
"""


def _swap_keep_mask(text):
    start = text.index("@triton.jit\ndef keep_mask(")
    end = text.index("@triton.jit", start + 1)
    return text[:start] + MMA_LAYOUT + "\n\n" + text[end:]


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
        dropout_py.write_text(_swap_keep_mask(text) if code is None else text.replace(PHILOX, code))
        pkgs[name] = importlib.import_module(f"exp_{name}")
    if "--check" in sys.argv:
        for name, pkg in pkgs.items():
            check(name, pkg)
        return
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


def check(label, pkg, b=2, h=2, n=77, d=128, p=0.3):
    """Forward and backward against float64 with the mask the call drew (replayed by the
    package's dropout_mask), causal, at a ragged N; and the keep rate over a large mask."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen).to(dev, torch.bfloat16)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    torch.manual_seed(11)
    out = pkg.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
    grads = torch.autograd.grad(out, (q, k, v), do)
    torch.manual_seed(11)
    keep = pkg.dropout_mask(b, h, n, n, p, device=dev)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    vis = visible_mask(n, n, causal=True, bottom_right=False)
    ref, _ = attention_ref(q64, k64, v64, vis, keep=keep, dropout_p=p)
    want = torch.autograd.grad(ref, (q64, k64, v64), do.double())
    errs = [(out.double() - ref).abs().max().item()]
    errs += [(g.double() - w).abs().max().item() for g, w in zip(grads, want)]
    rate = pkg.dropout_mask(4, 8, 512, 512, p, device=dev).float().mean().item()
    print(f"{label}: max abs err out/dq/dk/dv {', '.join(f'{e:.3g}' for e in errs)}; "
          f"keep rate {rate:.4f} (1 - p = {1 - p})", flush=True)


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
