"""Dropout's keep-mask generator at Philox4x32-10 against Philox4x32-7, on one GPU (Hopper).

    python benchmarks/philox_rounds_ab.py [--d 128 64] [--n 1024 4096] [--rounds 3]
                                          [--baseline TEMPLATES_DIR] [--heads 16]
                                          [--tokens 16384] [--knobs JSON ...]

flashgen.families.PHILOX_ROUNDS sets the rounds every kernel family draws the dropout keep
mask with (7 ships: FlashAttention-2's count). This builds the dropout benchmark's package
(d = 128: specs/bench/dropout_d128.yaml; d = 64: specs/gpt2.yaml) twice from this
checkout, at 10 and at 7 rounds (each under a name of its own, with the spec's tuning
data), and times, causal bf16, H = 16, B * N = 16k tokens (--heads, --tokens: e.g. GPT-2
small's attention is --d 64 --heads 12 --tokens 8192 --n 1024), (B, H, N, d) tensors through
scaled_dot_product_attention, in interleaved rounds (triton.testing.do_bench medians):

  fwd gluon p=0.1 r10 / r7   the Gluon dropout forward (use_family("gluon"); d >= 96)
  fwd tl p=0.1 r10 / r7      the `tl` dropout forward at the package's tuned tile
  fwd p=0                    the package's forward without dropout (its default family)
  bwd p=0.1 r10 / r7         the backward of one saved forward, the package's default
                             family (Gluon on Hopper at these shapes)
  bwd p=0                    the same without dropout

With --knobs, also the Gluon dropout forward of the 7-round build under
override_config(family="gluon", **knobs) for each JSON object given (e.g. '{"pingpong":
false}'), labelled by it. With --baseline, a third build at 7 rounds from another copy of the templates folder
(e.g. an earlier commit's: `git archive REV templates | tar -x -C DIR`), labelled "base",
for A/B runs of a template change.

TFLOP/s with the anchors' formula (causal FLOPs halved; the backward 2.5 forwards), and
the ratios to p = 0 that issue 14's dropout bar is about (>= 0.85). A check first: at
each round count, the Gluon and `tl` forwards of one generator state agree (one mask),
and r7's kept share is the documented 1 - T / 256. With $OUT set, writes
$OUT/philox_rounds_ab.json.
"""
import argparse
import contextlib
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from flashgen import families  # noqa: E402
from flashgen.build import build_spec  # noqa: E402
from flashgen.spec import parse_spec  # noqa: E402

SPECS = {128: ROOT / "specs/bench/dropout_d128.yaml", 64: ROOT / "specs/gpt2.yaml"}
H, TOKENS, P = 16, 16384, 0.1


def build(spec_path: Path, rounds: int, templates: Path | None = None, label: str = ""):
    """The spec's package rendered at `rounds` Philox rounds, imported under its own name
    (the text gets a comment, so the spec sha and the custom-op namespace differ; the
    path stays, so the spec's tuning files are found)."""
    from flashgen import render

    saved = families.PHILOX_ROUNDS, render.TEMPLATES_DIR
    families.PHILOX_ROUNDS = rounds
    if templates is not None:
        render.TEMPLATES_DIR = Path(templates).resolve()
    try:
        spec = parse_spec(spec_path.read_text() + f"\n# Philox rounds: {rounds} {label}\n",
                          str(spec_path))
        root = build_spec(spec, Path(tempfile.mkdtemp(prefix="flashgen-philox-"))).root
    finally:
        families.PHILOX_ROUNDS, render.TEMPLATES_DIR = saved
    name = f"philox_ab_{spec.package}_r{rounds}{label}"
    mspec = importlib.util.spec_from_file_location(name, root / "__init__.py",
                                                   submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(mspec)
    sys.modules[name] = module
    mspec.loader.exec_module(module)
    return module


def flops(b, h, n, d, mode):
    f = 4 * b * h * n * n * d / 2
    return 2.5 * f if mode == "bwd" else f


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, nargs="+", default=[128, 64], choices=sorted(SPECS))
    ap.add_argument("--n", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--baseline", type=Path, help="a templates folder for a third build")
    ap.add_argument("--heads", type=int, default=H)
    ap.add_argument("--tokens", type=int, default=TOKENS)
    ap.add_argument("--knobs", nargs="+", default=[], type=json.loads,
                    help="Gluon forward knob sets to time at 7 rounds (JSON objects)")
    args = ap.parse_args()
    h = args.heads
    import triton

    started = time.perf_counter()
    rows, checks = [], []
    for d in args.d:
        pkgs = {f"r{r}": build(SPECS[d], r) for r in (10, 7)}
        if args.baseline:
            pkgs["base"] = build(SPECS[d], 7, args.baseline, "base")
        gluon_fwd = pkgs["r7"]._runtime.GLUON.get(f"fwd_causal_dropout_d{d}_bf16") is None
        for n in args.n:
            b = args.tokens // n
            g = torch.Generator(device="cuda").manual_seed(n + d)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
                       for _ in range(3))

            def fwd(pkg, family, p):
                def call():
                    pkg._runtime.use_family(family)
                    return pkg.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
                return call

            # one mask per generator state, whichever family draws it
            for r, pkg in pkgs.items():
                outs = {}
                for fam in (("gluon", "tl") if gluon_fwd else ("tl",)):
                    torch.manual_seed(5)
                    outs[fam] = fwd(pkg, fam, P)().float()
                pkg._runtime.use_family("")
                torch.manual_seed(5)
                keep = pkg.dropout_mask(b, h, n, n, P, device="cuda")
                rel = ((outs["gluon"] - outs["tl"]).abs().max() / outs["tl"].abs().max()).item() \
                    if gluon_fwd else None
                share = keep.float().mean().item()
                del keep
                checks.append(dict(d=d, n=n, rounds=r, gluon_vs_tl=rel, kept=share))
                print(f"check d={d} N={n} {r}: gluon vs tl fwd max rel {rel}, kept share "
                      f"{share} (documented {1 / pkg.dropout_scale(P):.4f})",
                      flush=True)

            calls = {}
            for r, pkg in pkgs.items():
                if gluon_fwd:
                    calls[f"fwd gluon p=0.1 {r}"] = ("fwd", fwd(pkg, "gluon", P), None)
                calls[f"fwd tl p=0.1 {r}"] = ("fwd", fwd(pkg, "tl", P), None)
            calls["fwd p=0"] = ("fwd", fwd(pkgs["r7"], "", 0.0), None)
            knobbed = {}
            if gluon_fwd:
                for knobs in args.knobs:
                    label = "fwd gluon p=0.1 r7 " + ",".join(f"{k}={v}" for k, v in knobs.items())
                    calls[label] = ("fwd", fwd(pkgs["r7"], "", P), None)
                    knobbed[label] = knobs
            for label, pkg, p in [(f"bwd p=0.1 {r}", pkg, P) for r, pkg in pkgs.items()] + [
                    ("bwd p=0", pkgs["r7"], 0.0)]:
                pkg._runtime.use_family("")
                qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
                torch.manual_seed(9)
                out = pkg.scaled_dot_product_attention(qg, kg, vg, dropout_p=p, is_causal=True)
                do = torch.randn_like(out)

                def back(pkg=pkg, out=out, do=do):
                    pkg._runtime.use_family("")
                    out.backward(do, retain_graph=True)
                calls[label] = ("bwd", back, [qg, kg, vg])
            samples = {label: [] for label in calls}
            for _ in range(args.rounds):
                for label, (mode, call, grads) in calls.items():
                    ctx = (pkgs["r7"]._runtime.override_config(family="gluon", **knobbed[label])
                           if label in knobbed else contextlib.nullcontext())
                    with ctx:
                        samples[label].append(triton.testing.do_bench(
                            call, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))
            for pkg in pkgs.values():
                pkg._runtime.use_family("")
            ms = {label: statistics.median(s) for label, s in samples.items()}
            tf = {label: flops(b, h, n, d, calls[label][0]) / (t * 1e-3) / 1e12
                  for label, t in ms.items()}
            rows.append(dict(d=d, n=n, b=b, h=h, ms=ms, tflops=tf, samples_ms=samples))
            print(f"\nd={d} N={n} B={b} (TFLOP/s; x = / p=0 of the same direction)")
            for label, t in tf.items():
                base = tf["fwd p=0"] if label.startswith("fwd") else tf["bwd p=0"]
                print(f"  {label:22s} {t:7.1f}  x {t / base:.3f}")
            del calls, samples
            torch.cuda.empty_cache()
    print(f"({args.rounds} interleaved rounds; {time.perf_counter() - started:.0f} s)")
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "philox_rounds_ab.json"
        path.write_text(json.dumps({"device": torch.cuda.get_device_name(),
                                    "triton": triton.__version__, "torch": torch.__version__,
                                    "dropout_p": P, "rows": rows, "checks": checks}, indent=1))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
