"""Where the equal-length varlen gap goes: the dense forward persistent or not, and the varlen
forward's head groups (VARLEN_GLUON_ROUNDS), interleaved rounds, TFLOP/s (H100 numbers: PERF_NOTES,
seventeenth session).

    python benchmarks/varlen_probe.py
"""
import contextlib, os, statistics, sys
import torch, triton
sys.path.insert(0, os.getcwd())
import generated.llama_attn as pkg
rt = pkg._runtime
H, D, T = 16, 128, 16384
torch.manual_seed(0)


@contextlib.contextmanager
def setting(rounds=None, **kw):
    old = rt.VARLEN_GLUON_ROUNDS, rt.VARLEN_GLUON_ROUNDS_SHORT
    if rounds is not None:  # whatever the length (the runtime's rule has two values)
        rt.VARLEN_GLUON_ROUNDS = rt.VARLEN_GLUON_ROUNDS_SHORT = rounds
    rt._forward_plans.clear()
    try:
        with (rt.override_config(**kw) if kw else contextlib.nullcontext()):
            yield
    finally:
        rt.VARLEN_GLUON_ROUNDS, rt.VARLEN_GLUON_ROUNDS_SHORT = old
        rt._forward_plans.clear()


for L in (1024, 2048, 4096):
    B = T // L
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qv, kv, vv = (t.reshape(T, H, D) for t in (q, k, v))
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
    flops = 4 * B * H * L * L * D / 2
    dense = lambda: pkg.flash_attn_func(q, k, v, causal=True)
    var = lambda: pkg.flash_attn_varlen_func(qv, kv, vv, cu, cu, L, L, causal=True)
    cfg = dict(rt.launch_config("fwd_causal_d128_bf16", q.device, L))
    arms = {"dense": (dense, {}), "dense_pers": (dense, {**cfg, "persistent": True}),
            "dense_nonpers": (dense, {**cfg, "persistent": False}),
            "var": (var, {}), "var_r8": (var, {"rounds": 8}), "var_r2": (var, {"rounds": 2}), "var_r32": (var, {"rounds": 32}),
            "var_r1000": (var, {"rounds": 1000})}
    res = {n: [] for n in arms}
    for _ in range(5):
        for n, (f, kw) in arms.items():
            with setting(**kw):
                f()
                res[n].append(triton.testing.do_bench(f, warmup=20, rep=80, return_mode="median"))
    print(f"L={L} cfg={cfg}")
    print("   " + "  ".join(f"{n} {flops / statistics.median(v) / 1e9:6.1f}" for n, v in res.items()),
          flush=True)
