"""Does FlexAttention run earlier in the same process slow flashgen's d=64 document backward?

    PYTHONPATH=$PWD python benchmarks/bwd_flex_probe.py flex|noflex

Times the mods bench's document backward (B=4 H=16 N=4096 d=64, bf16) the way `flashgen
bench` does (one saved forward, do_bench median), after compiling and running Flex's
alibi and document backwards (`flex`) or alone (`noflex`), then profiles five backward
calls (kernel, preprocess, dQ conversion). Written when the twenty-third session's suite
runs read that backward at 387-661 TFLOP/s with 64-row steps (docs/PERF_NOTES.md).
"""
import sys

import torch
import triton
from flashgen.bench import mods as bm
from flashgen.bench.providers import Providers
from flashgen.bench.suites import Case
from flashgen.bench.timing import timed_call
from torch.profiler import profile, ProfilerActivity

with_flex = sys.argv[1] == "flex"
provs = Providers(None)
b, h, n, d = 4, bm.MODS_H, 4096, 64
torch.manual_seed(0)
q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
if with_flex:
    for mod in ("alibi", "document"):
        c = Case("mods", "bwd", d, True, b, h, n, providers=("flex",), mod=mod)
        fn = provs.get("flex", c)
        call, grads = timed_call(fn, q, k, v, c)
        print("flex", mod, triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))
c = Case("mods", "bwd", d, True, b, h, n, providers=("flashgen",), mod="document")
fn = provs.get("flashgen", c)
call, grads = timed_call(fn, q, k, v, c)
print("flashgen document bwd ms", triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads, return_mode="median"))
for _ in range(3):
    call()
torch.cuda.synchronize()
with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
    for _ in range(5):
        for g in grads: g.grad = None
        call()
    torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
