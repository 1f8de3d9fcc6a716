"""What limits dropout speed: time the dropout forward/backward with the keep-mask generator
swapped for cheaper stand-ins (not for use: the stand-ins are not random). On the GPU:

    python benchmarks/dropout_rng_experiment.py

  philox10 -- what ships: Philox4x32-10, 16 keep decisions per call (one byte each; 8
              16-bit ones when the table in docs/PERF_NOTES.md was measured), laid out
              as the tensor-core accumulator holds them (rows r and r+8, pairs of
              adjacent columns 8 apart), so the mask is built with no layout conversion
  philox7  -- Philox4x32-7 (passes BigCrush per Salmon et al. 2011, less margin)
  hash     -- one multiply-xorshift per 16 decisions: the cost of everything but Philox
  row_major -- Philox4x32-10 with the first mapping: 8 16-bit draws for 8 neighbouring
              keys of one row, converted to the accumulator's layout (see ROW_MAJOR; its
              16-bit draws against today's byte threshold drop almost nothing: timing only)
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

SPEC = (ROOT / "specs/bench/dropout_d128.yaml").read_text()
PHILOX = "r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3)"
STANDINS = {
    "philox10": PHILOX,
    "philox7": "r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3, 7)",
    "hash": ("h = (c0 * 0x9E3779B9) ^ (c1 * 0x85EBCA6B) ^ (c2 * 0xC2B2AE35) ^ c3\n"
             "    r0 = h * 0x27D4EB2F\n    r1 = r0 ^ (r0 >> 15)\n    r2 = r1 * 0x165667B1\n"
             "    r3 = r2 ^ (r2 >> 13)"),
    "row_major": None,  # ROW_MAJOR replaces the whole keep_mask
}


# The keep mask's first mapping (shipped until the mapping moved to the accumulator's layout):
# the 8 draws of a Philox call decide 8 neighbouring keys of one row, so the mask is built
# row-major and converted to the accumulator's layout (three convert_layouts per block in
# the forward, compiled offline for sm_90).
ROW_MAJOR = """@triton.jit
def keep_mask(SEED, RNG_OFFSET, bh, row_start, col_start, DROP_THRESHOLD,
              BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    rows = row_start + tl.arange(0, BLOCK_R)
    zero = tl.zeros([BLOCK_R, BLOCK_C // 8], dtype=tl.uint32)
    groups = (col_start // 8 + tl.arange(0, BLOCK_C // 8)).to(tl.uint32)  # [BLOCK_C // 8]
    c0 = zero + groups[None, :]
    c1 = zero + rows.to(tl.uint32)[:, None]
    c2 = zero + bh.to(tl.uint32)
    c3 = zero + RNG_OFFSET.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(SEED, c0, c1, c2, c3)  # 4 x [BLOCK_R, BLOCK_C // 8] uint32
    words = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK_R, BLOCK_C // 2])
    draws = tl.reshape(tl.join(words & 0xFFFF, words >> 16), [BLOCK_R, BLOCK_C])  # 16-bit
    return draws >= DROP_THRESHOLD
"""


def _swap_keep_mask(text):
    start = text.index("@triton.jit\ndef keep_mask(")
    end = text.index("@triton.jit", start + 1)
    return text[:start] + ROW_MAJOR + "\n\n" + text[end:]


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
