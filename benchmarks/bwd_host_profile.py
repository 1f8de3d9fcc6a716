"""Host time of one flashgen backward call at the transformers Llama step's shape (B=1
N=4096 H=16 d=128 causal bf16, (B, N, H, d) memory seen as (B, H, N, d)): the wall time of
torch.autograd.grad returning (the kernels are asynchronous) for flashgen and SDPA cuDNN,
and a cProfile of flashgen's calls, by own time. Written after llama_bwd_spread.py timed a
single backward call at ~580 us against ~370 us of its kernels.

    python benchmarks/bwd_host_profile.py [--calls 200]
"""
import argparse, cProfile, os, pstats, statistics, sys, time
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.getcwd())
import generated.llama_attn as pkg

ap = argparse.ArgumentParser()
ap.add_argument("--calls", type=int, default=200)
cli = ap.parse_args()
B, N, H, D = 1, 4096, 16, 128
torch.manual_seed(0)
mk = lambda: (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
q, k, v = mk(), mk(), mk()
do = torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16)
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
outs = {"flashgen": pkg._api.flash_attn_bhnd(qt, kt, vt, 0.0, None, True).transpose(1, 2)}
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    outs["cudnn"] = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)


def host_us(o, calls):
    times = []
    for _ in range(calls):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times), min(times)


for rnd in range(3):
    for name, o in outs.items():
        med, lo = host_us(o, 40)
        print(f"round {rnd} {name:9s} autograd.grad returns after {med:7.1f} us (min {lo:6.1f})")
o = outs["flashgen"]
torch.cuda.synchronize()
prof = cProfile.Profile()
# (CUDA backward nodes run on the autograd engine's device thread, which cProfile does not
# see: run them on this one)
with torch.autograd.set_multithreading_enabled(False):
    med, lo = host_us(o, 40)
    print(f"single-threaded engine: flashgen autograd.grad returns after {med:7.1f} us")
    prof.enable()
    for _ in range(cli.calls):
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    prof.disable()
torch.cuda.synchronize()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
