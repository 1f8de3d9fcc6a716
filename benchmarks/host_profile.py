"""Host time per call: flashgen's generated package against torch's SDPA, on a CUDA GPU.

    python benchmarks/host_profile.py [--out host.json] [--profile] [--breakdown]
        [--package DIR]

At H=16, d=64, causal, bf16 and (B, N) = (1, 128) and (8, 59) (shapes where the GPU work
is a few microseconds, so a call's cost is its host time), for each provider:

  no_grad   a forward under torch.no_grad()
  fwd_grad  a forward on inputs that require grad (builds the autograd graph)
  bwd       out.backward(do, retain_graph=True) of one saved forward

each timed as the CPU clock around `--calls` back-to-back calls after a synchronize,
stopped before the final synchronize (so GPU time only counts where the host waits for
it): `--rounds` rounds, the providers taking turns within each round, and the median
round per provider (with the fastest and slowest round beside it). torch SDPA is F.scaled_dot_product_attention with its default
backend choice. It also checks that the flashgen calls still compile under
torch.compile(fullgraph=True) and replay in a CUDA graph, and with --profile prints a
cProfile of the no-grad and the fwd+bwd loop.

--breakdown splits a no-grad call at (1, 128) into its parts, each timed alone the same
way: the allocations, the runtime's forward, the Launcher, Triton's `compiled.run` and the
C launcher under it (with tensors and with raw pointers), the Python path with the launch
replaced by a no-op, and an autograd floor (x * 1 and its backward). --package DIR times the package `gpt2_attn` found in DIR instead
of generated/ (an A/B against another build).
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

if "--package" in sys.argv:  # before the import: which build of gpt2_attn to time
    sys.path.insert(0, str(Path(sys.argv[sys.argv.index("--package") + 1]).resolve()))
    import gpt2_attn as pkg  # noqa: E402
else:
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


def one_round(fn, calls):
    """Host us per call of one round of `calls` back-to-back calls."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def measure(calls, rounds=15):
    """Per shape and mode, `rounds` rounds in which every provider runs one round in turn
    (interleaved, so a drift of the host's speed during the run reaches every provider
    alike); the median round per provider."""
    rows = []
    for b, n in SHAPES:
        q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
        row = {"b": b, "n": n}
        cases = {}  # (provider, mode) -> (family, fn)
        for name, (family, f) in providers().items():
            if family is not None and hasattr(pkg._runtime, "use_family"):
                pkg._runtime.use_family(family)
            with torch.no_grad():
                err = (f(q, k, v).float() - ref).abs().max().item()
                assert err < 3e-2, (name, err)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            out = f(qg, kg, vg)
            do = torch.randn_like(out)

            def no_grad(f=f):
                with torch.no_grad():
                    f(q, k, v)
            cases[name, "no_grad"] = (family, no_grad)
            cases[name, "fwd_grad"] = (family, lambda f=f, qg=qg, kg=kg, vg=vg: f(qg, kg, vg))
            cases[name, "bwd"] = (family, lambda out=out, do=do: out.backward(
                do, retain_graph=True))
            if name.startswith("flashgen"):
                try:  # the backward's own Python on this thread, without the autograd engine
                    o = torch.empty_like(q)
                    lse = pkg._runtime.forward(q, k, v, o, mask="causal", lo=-(2 * n + 1),
                                               hi=0, scale=D ** -0.5)
                    args = (None, False, "causal", -(2 * n + 1), 0, D ** -0.5, 0.0)
                    pkg._ops._backward_impl(do, q, k, v, o, lse, *args)
                    cases[name, "bwd_impl"] = (family, lambda do=do, o=o, lse=lse, args=args:
                                               pkg._ops._backward_impl(do, q, k, v, o, lse,
                                                                       *args))
                except Exception as e:  # noqa: BLE001 (a measurement aid; report, go on)
                    row[f"{name}_bwd_impl"] = f"error: {type(e).__name__}: {e}"[:120]
        times = {key: [] for key in cases}
        family_now = object()
        for _ in range(rounds):
            for key, (family, fn) in cases.items():
                if family != family_now and family is not None:
                    if hasattr(pkg._runtime, "use_family"):
                        pkg._runtime.use_family(family)
                    family_now = family
                fn()  # after a family switch the plans are made again: not timed
                times[key].append(one_round(fn, calls))
        if hasattr(pkg._runtime, "use_family"):
            pkg._runtime.use_family("")
        for (name, mode), ts in times.items():
            row[f"{name}_{mode}"] = round(statistics.median(ts), 2)
            row[f"{name}_{mode}_spread"] = [round(min(ts), 2), round(max(ts), 2)]
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
    f = providers()["flashgen"][1]
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


def breakdown(calls):
    """Where a no-grad call's host time goes (see the module docstring)."""
    rt = pkg._runtime
    b, n = SHAPES[0]
    q, k, v = (torch.randn(b, H, n, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = torch.empty_like(q)
    fg = providers()["flashgen"][1]
    rows = {}
    with torch.no_grad():
        fg(q, k, v)
        rows["sdpa"] = host_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
                               calls)
        rows["flashgen"] = host_us(lambda: fg(q, k, v), calls)
        rows["empty_like_out"] = host_us(
            lambda: torch.empty_like(q, memory_format=torch.contiguous_format), calls)
        rows["empty_lse"] = host_us(
            lambda: torch.empty((b, H, n), device=q.device, dtype=torch.float32), calls)
        rows["runtime_forward"] = host_us(lambda: rt.forward(
            q, k, v, o, mask="causal", lo=-(2 * n + 1), hi=0, scale=D ** -0.5, need_lse=False),
            calls)
        plan = rt._forward_plans[next(key for key in rt._forward_plans
                                      if key[1] == q.shape and key[0] is False)]
        launch, args, lse = plan[0], plan[1], plan[4]
        drop = () if plan[2] == getattr(rt, "_GLUON", 2) else rt._NO_DROP
        rows["launcher"] = host_us(lambda: launch(q, k, v, o, lse, *args, *drop), calls)
        c = launch.compiled
        if c is not None:
            stream = torch.cuda.current_stream().cuda_stream
            tail = (*args, *drop, *launch.tail)
            rows["compiled_run"] = host_us(lambda: c.run(
                *launch.grid, stream, c.function, c.packed_metadata, None, None, None,
                q, k, v, o, lse, *tail), calls)
            run = c.run
            if hasattr(run, "launch") and not getattr(run, "global_scratch_size", 1):
                head = (run.launch_cooperative_grid, run.launch_pdl, None, None,
                        c.packed_metadata, None, None, None)
                rows["c_launch"] = host_us(lambda: run.launch(
                    *launch.grid, stream, c.function, *head, q, k, v, o, lse, *tail), calls)
                ptrs = [t.data_ptr() for t in (q, k, v, o, lse)]
                rows["c_launch_int_ptrs"] = host_us(lambda: run.launch(
                    *launch.grid, stream, c.function, *head, *ptrs, *tail), calls)
        rows["stream_and_device"] = host_us(
            lambda: (torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())), calls)
        saved = rt.Launcher.__call__
        rt.Launcher.__call__ = lambda self, *a: None
        try:
            rows["python_and_alloc_no_launch"] = host_us(lambda: fg(q, k, v), calls)
        finally:
            rt.Launcher.__call__ = saved
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    fg(qg, kg, vg)
    rt.Launcher.__call__ = lambda self, *a: None
    try:
        rows["grad_python_and_alloc_no_launch"] = host_us(lambda: fg(qg, kg, vg), calls)
    finally:
        rt.Launcher.__call__ = saved
    x = qg.detach().clone().requires_grad_()
    rows["autograd_floor_fwd_x_times_1"] = host_us(lambda: x * 1, calls)
    y = x * 1
    dy = torch.randn_like(y)
    rows["autograd_floor_bwd_x_times_1"] = host_us(lambda: y.backward(dy, retain_graph=True),
                                                   calls)
    cpu = [t.cpu() for t in (q, k, v)]
    rows["python_calibration_signature_ns"] = round(1e3 * host_us(lambda: (
        cpu[0].shape, cpu[1].shape, cpu[2].shape, cpu[0].stride(), cpu[1].stride(),
        cpu[2].stride(), cpu[0].dtype, cpu[1].dtype, cpu[2].dtype, cpu[0].device,
        cpu[1].device, cpu[2].device, 0.0, True, None, False).__hash__(), calls * 10), 1)
    print(json.dumps({"breakdown": rows}), flush=True)
    print("\n| part of a no-grad call at (1, 128) | us |\n|---|---|")
    for key, val in rows.items():
        print(f"| {key} | {val} |")
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--package", help="a folder holding the gpt2_attn package to time")
    args = ap.parse_args()
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; host us per call "
          f"(median of {args.rounds} interleaved rounds of {args.calls} calls), H={H}, d={D}, causal, bf16", flush=True)
    rows = measure(args.calls, args.rounds)
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
    if args.breakdown:
        extra["breakdown"] = breakdown(args.calls)
        if args.out:
            Path(args.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(),
                                                  "torch": torch.__version__, "rows": rows,
                                                  **extra}, indent=1))
    if args.profile:
        profile(args.calls)


if __name__ == "__main__":
    main()
