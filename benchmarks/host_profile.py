"""Host time per call: flashgen's generated package against torch's SDPA, on a CUDA GPU.

    python benchmarks/host_profile.py [--out host.json] [--profile]

At H=16, d=64, causal, bf16 and (B, N) = (1, 128) and (8, 59) (shapes where the GPU work
is a few microseconds, so a call's cost is its host time), for each provider:

  no_grad   a forward under torch.no_grad()
  fwd_grad  a forward on inputs that require grad (builds the autograd graph)
  bwd       out.backward(do, retain_graph=True) of one saved forward

each timed as the CPU clock around `--calls` back-to-back calls after a synchronize,
stopped before the final synchronize (so GPU time only counts where the host waits for
it), median of 7 rounds. torch SDPA is F.scaled_dot_product_attention with its default
backend choice. It also checks that the flashgen calls still compile under
torch.compile(fullgraph=True) and replay in a CUDA graph, and with --profile prints a
cProfile of the no-grad and the fwd+bwd loop.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generated.gpt2_attn as pkg  # noqa: E402

H, D = 16, 64
SHAPES = ((1, 128), (8, 59))


def host_us(fn, calls):
    rounds = []
    for _ in range(7):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
        torch.cuda.synchronize()
    return round(statistics.median(rounds), 2)


def providers():
    """name -> (kernel family to force, or None, call). flashgen_tl forces the `tl` family
    where the package would pick the Gluon forward (Hopper)."""
    fg = lambda q, k, v: pkg.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    names = {"flashgen": ("", fg)}
    if hasattr(pkg._runtime, "use_family"):
        names["flashgen_tl"] = ("tl", fg)
    names["torch_sdpa"] = (None, lambda q, k, v: F.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    return names


def measure(calls):
    rows = []
    for b, n in SHAPES:
        q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        row = {"b": b, "n": n}
        for name, (family, f) in providers().items():
            if family is not None and hasattr(pkg._runtime, "use_family"):
                pkg._runtime.use_family(family)
            with torch.no_grad():
                err = (f(q, k, v).float() - ref).abs().max().item()
                assert err < 3e-2, (name, err)
                row[f"{name}_no_grad"] = host_us(lambda: f(q, k, v), calls)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            row[f"{name}_fwd_grad"] = host_us(lambda: f(qg, kg, vg), calls)
            out = f(qg, kg, vg)
            do = torch.randn_like(out)
            row[f"{name}_bwd"] = host_us(lambda: out.backward(do, retain_graph=True), calls)
            if name.startswith("flashgen"):
              try:  # the backward's own Python on this thread, without the autograd engine
                lse = pkg._runtime.forward(qg.detach(), kg.detach(), vg.detach(),
                                           torch.empty_like(q), mask="causal",
                                           lo=-(1 << 30), hi=0, scale=D ** -0.5)
                args = (None, False, "causal", -(1 << 30), 0, D ** -0.5, 0.0)
                row[f"{name}_bwd_impl"] = host_us(lambda: pkg._ops._backward_impl(
                    do, qg.detach(), kg.detach(), vg.detach(), out.detach(), lse, *args),
                    calls)
              except Exception as e:  # noqa: E722 (a measurement aid; report and go on)
                row[f"{name}_bwd_impl"] = f"error: {type(e).__name__}: {e}"[:120]
        if hasattr(pkg._runtime, "use_family"):
            pkg._runtime.use_family("")
        for mode in ("no_grad", "fwd_grad", "bwd"):
            row[f"ratio_{mode}"] = round(row[f"flashgen_{mode}"] / row[f"torch_sdpa_{mode}"], 3)
            if "flashgen_tl_no_grad" in row:
                row[f"ratio_tl_{mode}"] = round(row[f"flashgen_tl_{mode}"]
                                                / row[f"torch_sdpa_{mode}"], 3)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def check_compile_and_graph():
    """torch.compile(fullgraph=True) forward+backward, and a CUDA-graph replay, against
    eager results."""
    q, k, v = (torch.randn(2, H, 100, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    do = torch.randn_like(q)

    def f(q, k, v):
        return pkg.scaled_dot_product_attention(q, k, v, is_causal=True)

    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True)
    out_c = compiled(q, k, v)
    out_c.backward(do)
    grads_c = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out_e = f(q, k, v)
    out_e.backward(do)
    result = {"compile_fullgraph_out_err": (out_c - out_e).abs().max().item(),
              "compile_fullgraph_grad_err": max((a - t.grad).abs().max().item()
                                                for a, t in zip(grads_c, (q, k, v)))}
    static = [t.detach().clone() for t in (q, k, v)]
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                f(*static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out_g = f(*static)
        new = [torch.randn_like(t) for t in static]
        for s, t in zip(static, new):
            s.copy_(t)
        graph.replay()
        torch.cuda.synchronize()
        result["cuda_graph_replay_err"] = (out_g - f(*new)).abs().max().item()
    print(json.dumps(result), flush=True)
    return result


def profile(calls):
    q, k, v = (torch.randn(1, H, 128, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    f = providers()["flashgen"]
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    for label, fn in (("no_grad", lambda: f(q, k, v)),
                      ("fwd+bwd", lambda: f(qg, kg, vg).sum().backward())):
        with torch.no_grad() if label == "no_grad" else torch.enable_grad():
            fn()
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(calls):
                fn()
            prof.disable()
        torch.cuda.synchronize()
        print(f"== cProfile, flashgen {label}, {calls} calls")
        pstats.Stats(prof).sort_stats("tottime").print_stats(12)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call "
          f"(median of 7 rounds of {args.calls} calls), H={H}, d={D}, causal, bf16", flush=True)
    rows = measure(args.calls)
    extra = check_compile_and_graph()
    print("\n| B, N | mode | flashgen us | flashgen, tl family us | torch SDPA us | ratio | "
          "ratio, tl |\n|---|---|---|---|---|---|---|")
    for r in rows:
        for mode in ("no_grad", "fwd_grad", "bwd", "bwd_impl"):
            print(f"| {r['b']}, {r['n']} | {mode} | {r.get(f'flashgen_{mode}')} | "
                  f"{r.get(f'flashgen_tl_{mode}')} | {r.get(f'torch_sdpa_{mode}')} | "
                  f"{r.get(f'ratio_{mode}')} | {r.get(f'ratio_tl_{mode}')} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                              "torch": torch.__version__, "rows": rows,
                                              **extra}, indent=1))
    if args.profile:
        profile(args.calls)


if __name__ == "__main__":
    main()
