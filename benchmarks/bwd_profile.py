"""The CUDA kernels of one backward call of the mods bench's masks (B=4 H=16 N=4k d=128
bf16) with torch.profiler: the Gluon dK/dV/dQ kernel beside the fixed O(N) passes around
it (the preprocess D = rowsum(dO O), zeroing the fp32 dQ sum, converting it to dQ).

    PYTHONPATH=$PWD python benchmarks/bwd_profile.py document window_sinks prefix_lm causal

Five backward calls of one graph are profiled, so q/k/v.grad accumulate: the largest
elementwise kernel (~200 us) is that accumulation (autograd's grad +=), not the
package's; `flashgen bench` times with grad_to_none and does not pay it.
"""
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from flashgen.bench import mods as bm
from flashgen.bench.providers import load_package
from flashgen.resources import bundled_spec

B, H, N, D = 4, 16, 4096, 128


def main(cases):
    pkg, _ = load_package(bundled_spec(bm.MODS_SPEC))
    for case in cases:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16,
                               requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        if case == "causal":
            out = pkg.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            kw = bm.inputs(case, B, H, N, "cuda")
            band, mods, _ = bm.MOD_CASES[case]
            out = pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)
        for _ in range(3):
            out.backward(do, retain_graph=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                out.backward(do, retain_graph=True)
            torch.cuda.synchronize()
        print("==", case)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12,
                                        max_name_column_width=60))


if __name__ == "__main__":
    main(sys.argv[1:] or ["document"])
