"""Where the host time of one small forward call goes, on the GPU machine:

    python benchmarks/host_profile.py

Times `scaled_dot_product_attention` at the seeds' small shape (B=4, N=512, H=16, d=64)
in a loop of back-to-back calls, then profiles the same loop with cProfile and prints the
functions by their own time, and times each stage of the call on its own."""
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import generated.gpt2_attn as pkg  # noqa: E402


def per_call_us(fn, calls=2000):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = (time.perf_counter() - t) / calls * 1e6
    torch.cuda.synchronize()
    return round(host, 2)


def main():
    q, k, v = (torch.randn(4, 16, 512, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    rt = pkg._runtime
    call = lambda: pkg.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    print("sdpa call", per_call_us(call), "us")
    o = torch.empty_like(q)
    fwd = lambda: rt.forward(q, k, v, o, mask="causal", lo=-(1 << 20), hi=0, scale=0.125)  # noqa: E731
    print("runtime.forward", per_call_us(fwd), "us")
    print("check_tensors", per_call_us(lambda: rt.check_tensors(q, k, v)), "us")
    print("torch.empty x1", per_call_us(lambda: torch.empty((4, 16, 512), device="cuda")), "us")
    print("F.sdpa (torch)", per_call_us(lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)), "us")
    key = next(iter(rt._forward_plans))
    launch, args = rt._forward_plans[key]
    print("launcher direct:", launch.compiled is not None)
    lse = torch.empty((4, 16, 512), device="cuda")
    print("launch only", per_call_us(lambda: launch(q, k, v, o, lse, *args, 0, 0, 0, 1.0)), "us")
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(2000):
        call()
    prof.disable()
    torch.cuda.synchronize()
    pstats.Stats(prof).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
