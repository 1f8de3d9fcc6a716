"""A/B of the Gluon large-dim backward's ring depth / dQ slots at qk 192 / v 128 (and d 256),
causal and not, H*d ~ 2048, B*N = 16k: interleaved rounds, median ms -> TFLOP/s."""
import sys, statistics, torch, triton
from pathlib import Path
sys.path.insert(0, "tests")
from flashgen.build import build
from flashgen.bench.suites import tflops
build(Path("specs/bench/large_dims.yaml"), Path("/tmp/ab192"))
sys.path.insert(0, "/tmp/ab192")
import bench_large_dims_attn as pkg
rt = pkg._runtime
G = dict(family="gluon", block_m=64, block_n=64)
ARMS = {"default": {}, "s3dq1": dict(G, num_stages=3, dq_slots=1), "s2dq1": dict(G, num_stages=2, dq_slots=1),
        "s2dq2": dict(G, num_stages=2, dq_slots=2)}
cases = [(192, 128, causal, n) for causal in (True, False) for n in (2048, 8192, 16384)]
res = {}
for rnd in range(3):
    for d, dv, causal, n in cases:
        b, h = 16384 // n, 2048 // d
        torch.manual_seed(0)
        q = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, n, h, dv, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        for arm, cfg in ARMS.items():
            try:
                o = pkg.flash_attn_func(q, k, v, causal=causal)
                do = torch.randn_like(o)
                with (rt.override_config(**cfg) if cfg else rt.override_config()):
                    fn = lambda: torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
                    ms = triton.testing.do_bench(fn, warmup=10, rep=60)
            except Exception as e:
                ms = None; print(arm, d, causal, n, "ERR", str(e)[:200], flush=True)
            res.setdefault((d, dv, causal, n, arm), []).append(ms)
            if ms:
                print(rnd, d, causal, n, arm, round(tflops(ms, b, h, n, d, causal, 'bwd', dv), 1), flush=True)
for (d, dv, causal, n, arm), ms in sorted(res.items()):
    ok = [m for m in ms if m]
    if ok:
        m = statistics.median(ok)
        print(f"qk{d} v{dv} {'causal' if causal else 'full  '} N={n:5d} {arm:8s} {tflops(m, 16384 // n, 2048 // d, n, d, causal, 'bwd', dv):7.1f} TFLOP/s  {['%.3f' % x for x in ok]}")
