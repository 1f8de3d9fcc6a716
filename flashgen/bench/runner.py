"""The GPU run behind `flashgen bench` (flashgen/bench/__init__.py is its command line):
every case's providers checked, then timed, then the tables and files written.

Method: every provider's output is first checked against a float32 reference (SDPA's math
backend on a slice: batch 0, heads 0-1); a wrong provider is marked WRONG and not timed; a
provider that refuses a shape gets "error: ..." in its cell (never fatal); an optional
provider that cannot run on this machine (FA4 not installed, another GPU) is "skipped", its
reason logged once and listed under the tables. Timing:
flashgen/bench/timing.py. With dropout, the check is the provider at p=0 against the
reference, and at p>0 a finite output of the reference's magnitude.

torch and triton are imported inside the functions: importing this module costs nothing.
"""
from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from ..resources import bundled_spec
from . import fa4 as bench_fa4
from . import mods as bench_mods
from .providers import Providers, load_package, raise_recompile_limit
from .report import cell_text, default_out_dir, markdown_tables, plot, write_results
from .suites import (keep, plan_cases, result_name, spec_causals, spec_head_dims,
                     spec_package, spec_v_dims, tflops)
from .timing import host_time_us, interleaved_rounds, record_rounds, timed_call

TOL = 3e-2  # bf16 output against the float32 reference (as every suite)


def _reference(q, k, v, causal):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q[:1, :2].float(), k[:1, :2].float(),
                                              v[:1, :2].float(), is_causal=causal)


def _check(fn, q, k, v, case, ref):
    """None if fn's output matches the reference, else the WRONG status. An fp8 provider
    (fn.dequantized, fn.tol: flashgen/bench/fp8.py) is checked against the reference on the
    inputs it saw, its e4m3 copies dequantized: e4m3's own rounding of q, k, v (2^-4) is
    not the kernel's error, and in a causal row with few keys it alone exceeds TOL."""
    import torch
    if getattr(fn, "dequantized", None) is not None:
        out = fn(q, k, v, case.causal, 0.0)
        ref8 = _reference(*fn.dequantized(q, k, v), case.causal)
        err = (out[:1, :2].float() - ref8).abs().max().item()
        return None if err < fn.tol else f"WRONG (max err {err:.3g} against the dequantized inputs)"
    if case.p:
        out0 = fn(q, k, v, case.causal, 0.0)
        err = (out0[:1, :2].float() - ref).abs().max().item()
        if not err < TOL:
            return f"WRONG (p=0 max err {err:.3g})"
        out = fn(q, k, v, case.causal, case.p)
        if not torch.isfinite(out).all():
            return "WRONG (non-finite output with dropout)"
        ratio = out[:1, :2].float().abs().mean().item() / max(ref.abs().mean().item(), 1e-12)
        if not 0.5 < ratio < 2.0:
            return f"WRONG (dropout output magnitude {ratio:.2f}x the reference)"
        return None
    out = fn(q, k, v, case.causal, 0.0)
    err = (out[:1, :2].float() - ref).abs().max().item()
    return None if err < TOL else f"WRONG (max err {err:.3g})"


def measure_attention(cases, meta, log=print, spec=None, progress=None, rounds=1,
                      device="cuda"):
    """Rows for the training, dropout and small suites' cases. `spec`: a user's spec whose
    package is flashgen (see Providers); `progress` advances once per provider and round
    measured. With `rounds` > 1 the providers of a case are timed in alternating order
    `rounds` times (interleaved_rounds) and each row's ms is the median of its rounds
    (`ms_rounds` in the JSON keeps them all). `device`: "cpu" lets the tests run the
    check-and-skip path (a provider that reaches the timing needs CUDA)."""
    import torch
    import triton

    provs = Providers(spec)
    rows, told = [], set()
    torch.manual_seed(0)
    for case in cases:
        q, k, v = (torch.randn(case.b, case.h, case.n, d, device=device,
                               dtype=torch.bfloat16) for d in (case.d, case.d, case.dv or case.d))
        if case.suite == "mods":
            ref = bench_mods.reference(case.mod, provs.mods_inputs(case)[0], q, k, v)
        else:
            ref = _reference(q, k, v, case.causal)
        case_rows, ready = [], {}
        for name in case.providers:
            row = {**meta, **{k_: v_ for k_, v_ in asdict(case).items() if k_ != "providers"},
                   "provider": name, "h_kv": case.h, "status": "ok"}
            case_rows.append(row)
            try:
                if name.startswith("flashgen") and case.suite != "mods":
                    row["spec_sha"] = provs.package(case.d, case.suite == "dropout")[1]
                fn = provs.get(name, case)
                if name == "fa4":  # its betas differ in speed: the row names the one timed
                    row["note"] = f"{bench_fa4.PACKAGE} {bench_fa4.version() or '(version?)'}"
                if case.suite == "mods" and name == "flashgen":
                    pkg, row["spec_sha"] = load_package(bundled_spec(bench_mods.MODS_SPEC))
                    before = bench_mods.triton_binaries(pkg)
                    fn(q, k, v, case.causal, 0.0)
                    row["note"] = (f"{bench_mods.triton_binaries(pkg) - before} new binaries "
                                   "at this shape")
                wrong = _check(fn, q, k, v, case, ref)
                if wrong:
                    row["status"] = wrong
                else:
                    ready[name] = fn
            except bench_fa4.Unavailable as e:
                row["status"] = f"skipped: {e}"
                if name not in told:
                    told.add(name)
                    log(f"{name}: skipped: {e}")
            except Exception as e:  # a provider that refuses a shape is reported, not fatal
                row["status"] = f"error: {type(e).__name__}: {str(e)[:100]}"
            if name not in ready and progress is not None:
                progress.advance(f"{case.label().strip()} {name}", steps=rounds)

        timed = dict.fromkeys(ready, 0)

        def time_one(name):
            timed[name] += 1
            call, grads = timed_call(ready[name], q, k, v, case)
            try:
                return triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads,
                                               return_mode="median")
            finally:
                del call
                torch.cuda.empty_cache()
                if progress is not None:
                    progress.advance(f"{case.label().strip()} {name}")

        times = interleaved_rounds(list(ready), rounds, time_one)
        for row in case_rows:
            name = row["provider"]
            ms = record_rounds(row, times.get(name))
            if name in timed and progress is not None:  # the rounds a failure skipped
                progress.advance(f"{case.label().strip()} {name}", steps=rounds - timed[name])
            if ms is not None:
                row["tflops"] = round(tflops(ms, case.b, case.h, case.n, case.d,
                                             case.causal, case.mode, case.dv), 1)
                if case.suite == "small" and name == "flashgen":
                    call, _ = timed_call(ready[name], q, k, v, case)
                    row["host_us"], row["wall_us"] = host_time_us(call)
                    del call
            rows.append(row)
            log(f"{case.label()} {name:14s} {cell_text(row)}")
        del q, k, v, ref, ready
        torch.cuda.empty_cache()
    return rows


def measure_decode(cases, meta, log=print):
    """Rows for the decode suite, from flashgen/bench/decode.py's own measurement."""
    from . import decode

    raise_recompile_limit()  # decode.py's FlexAttention rows compile one graph per shape

    wanted = set(p for c in cases for p in c.providers)
    by_b = {}
    for c in cases:
        by_b.setdefault(c.b, []).append(c.n)
    package, sha = load_package(None, 128)
    rows = []
    for b, ns in by_b.items():
        for drow in decode.bench(bs=[b], ns=ns, log=log, package=package):
            for name, val in drow.items():
                if name in decode.ROW_META or not keep([name], wanted):
                    continue
                row = {**meta, "suite": "decode", "mode": "fwd", "d": decode.D,
                       "causal": True, "b": drow["b"], "h": decode.H_Q, "h_kv": decode.H_KV,
                       "n": drow["n"], "p": 0.0, "provider": name,
                       "spec_sha": sha if name.startswith("flashgen") else None}
                if isinstance(val, dict):
                    row.update(status="ok", ms=val["ms"], gbps=val["GB/s"],
                               note=f"gqa: {val['gqa']}" if val.get("gqa") else None)
                    if name == "flashgen_s0":
                        row["host_us"] = drow.get("host_us")
                    elif name == "flashgen_paged_s0":
                        row["host_us"] = drow.get("paged_host_us")
                    if "ms_read_flush" in val:  # the same call, L2 flushed by a read
                        rows.append(dict(row, provider=name + "_rf", ms=val["ms_read_flush"],
                                         gbps=val["GB/s_read_flush"], host_us=None))
                else:
                    row["status"] = str(val)
                rows.append(row)
    return rows


def environment():
    import torch
    import triton
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "triton": triton.__version__}


def run(suite="all", ns=None, ds=None, modes=("fwd", "bwd"), providers=None, out=None,
        plot_it=True, log=print, spec=None, progress=True, rounds=1):
    """Measure every case of the suite(s); write JSON/CSV/markdown (and a PNG) under out
    (default: report.default_out_dir); print the tables. `spec`: a user's spec, whose package
    is timed as flashgen at its head dims (and only with its masks); `rounds`: see
    measure_attention. Returns (rows, paths)."""
    from ..progress import Progress

    causals, package, case_ds, dvs = (False, True), None, ds, None
    if spec is not None:
        causals, package = spec_causals(spec), spec_package(spec)
        case_ds, dvs = ds or spec_head_dims(spec), spec_v_dims(spec)
    cases = plan_cases(suite, ns, case_ds, modes, providers, causals, dvs)
    meta = environment()
    log(f"# {meta['gpu']}, torch {meta['torch']}, triton {meta['triton']}, bf16; "
        f"{len(cases)} cases" + (f", {rounds} interleaved rounds" if rounds > 1 else ""))
    attention = [c for c in cases if c.suite != "decode"]
    bar = Progress(sum(len(c.providers) for c in attention) * rounds, "flashgen bench") if (
        progress and attention) else None
    rows = []
    rows += measure_attention(attention, meta, log, spec=spec, progress=bar, rounds=rounds)
    if bar is not None:
        bar.close()
    decode_cases = [c for c in cases if c.suite == "decode"]
    if decode_cases:
        rows += measure_decode(decode_cases, meta, log)
    out_dir = Path(out) if out else default_out_dir(meta["gpu"])
    name = result_name(suite, ns, ds, modes, providers, package)
    paths = write_results(rows, out_dir, name, meta)
    if plot_it:
        png = plot(rows, out_dir / f"{name}.png")
        if png:
            paths["png"] = Path(png)
    log("")
    log(markdown_tables(rows))
    for kind, path in paths.items():
        log(f"wrote {path}")
    return rows, paths
