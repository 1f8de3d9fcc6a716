"""The Gluon dropout forward against its own p=0 kernel, with the keep mask's work moved or
swapped for stand-ins (not for use: `no_philox` is not random). On an H100:

    python benchmarks/gluon_dropout_experiment.py [--n 1024 4096] [--seed S] [--json FILE]

  late      -- what ships: block j's Philox rounds, compare and select right after its
               softmax, each round's products as umulhi + mul
  early     -- the Philox rounds between issuing S = Q K^T and waiting for it (the slot
               where the warpgroup waits; 32 more words live across the wait)
  wide      -- late, each round's two products as one 64-bit product (IMAD.WIDE)
  no_philox -- late with the Philox call replaced by four xors: the cost of everything
               but the generator (counters, compare, select)
against p=0 (the same package's kernel without dropout code) and the `tl` kernel at p=0.1.
Causal, d=128, H=16, B*N = 16k, bf16, (B, H, N, d) tensors through
scaled_dot_product_attention, TFLOP/s (causal FLOPs halved), median of do_bench (L2
flushed) over three interleaved rounds. --seed: torch.manual_seed before the timing (the
seed's width changed the kernel the first template compiled to; default: the generator's
own 64-bit seed).
"""
import argparse
import importlib
import json
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen.build import build  # noqa: E402

SPEC = (ROOT / "specs/bench/dropout_d128.yaml").read_text()
KERNEL = "kernels/gluon/fwd_causal_dropout_d128_bf16.py"
WORDS = """                    w0, w1, w2, w3 = _dropout_words(SEED_LO, SEED_HI, RNG_OFFSET, bh, row0, n0,
                                                    SPLIT_M, BLOCK_N)
"""
WAIT = "                # S has landed (P V may still be running): its softmax overlaps P V\n"
ROUND = """        c0 = gl.umulhi(PHILOX_ROUND_B, _c2) ^ c1 ^ k0
        c2 = gl.umulhi(PHILOX_ROUND_A, _c0) ^ c3 ^ k1
        c1 = _c2 * PHILOX_ROUND_B
        c3 = _c0 * PHILOX_ROUND_A
"""
WIDE = """        pb = _c2.to(gl.uint64) * PHILOX_ROUND_B
        pa = _c0.to(gl.uint64) * PHILOX_ROUND_A
        c0 = (pb >> 32).to(gl.uint32) ^ c1 ^ k0
        c2 = (pa >> 32).to(gl.uint32) ^ c3 ^ k1
        c1 = pb.to(gl.uint32)
        c3 = pa.to(gl.uint32)
"""
PHILOX_CALL = """    return _philox(SEED_LO.to(gl.uint32), SEED_HI.to(gl.uint32),
                   c0, c1, c2, c3)
"""


def early(text):
    assert WORDS in text and WAIT in text
    return text.replace(WORDS, "").replace(WAIT, WORDS.replace("    ", "", 1) + WAIT)


VARIANTS = {
    "late": lambda t: t,
    "early": early,
    "wide": lambda t: t.replace(ROUND, WIDE),
    "no_philox": lambda t: t.replace(PHILOX_CALL, "    return c0 ^ c1, c0 ^ c2, c1 ^ c3, c0 ^ c3\n"),
}


def packages(tmp):
    pkgs = {}
    for name, edit in VARIANTS.items():
        spec = tmp / f"{name}.yaml"
        spec.write_text(SPEC.replace("package: bench_dropout_attn", f"package: gdx_{name}"))
        build(spec, tmp)
        path = tmp / f"gdx_{name}" / KERNEL
        text = path.read_text()
        new = edit(text)
        assert name == "late" or new != text, f"{name}: the edit matched nothing"
        path.write_text(new)
        pkgs[name] = importlib.import_module(f"gdx_{name}")
    return pkgs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--seed", type=int)
    ap.add_argument("--json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    sys.path.insert(0, str(tmp))
    pkgs = packages(tmp)
    base = pkgs["late"]
    cases = [("p=0 gluon", base, 0.0, "gluon"), ("tl p=0.1", base, 0.1, "tl")]
    cases += [(f"{name} p=0.1", pkg, 0.1, "gluon") for name, pkg in pkgs.items()]
    rows = []
    for n in args.n:
        b, h, d = 16384 // n, 16, 128
        flops = 4 * b * h * n * n * d / 2
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        if args.seed is not None:
            torch.manual_seed(args.seed)
        times = {label: [] for label, *_ in cases}
        for _ in range(3):
            for label, pkg, p, family in cases:
                pkg._runtime.use_family(family)
                fn = lambda: pkg.scaled_dot_product_attention(  # noqa: E731
                    q, k, v, dropout_p=p, is_causal=True)
                fn()
                times[label].append(triton.testing.do_bench(fn, warmup=25, rep=100,
                                                            return_mode="median"))
        p0 = sorted(times["p=0 gluon"])[1]
        print(f"\ncausal d=128 N={n} B={b} H={h} bf16, seed {torch.cuda.initial_seed()}, "
              "TFLOP/s and ratio to p=0 gluon")
        print("| kernel | TFLOP/s | x p=0 |\n|---|---|---|")
        for label, ts in times.items():
            ms = sorted(ts)[1]
            rows.append({"n": n, "seed": torch.cuda.initial_seed(), "kernel": label, "ms": ms,
                         "tflops": flops / ms / 1e9, "ratio_to_p0": p0 / ms})
            print(f"| {label} | {flops / ms / 1e9:.1f} | {p0 / ms:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                               "triton": triton.__version__, "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
