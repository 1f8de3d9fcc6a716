"""The spread of single backward calls at the transformers Llama step's shape (B=1 N=4096
H=16 d=128 causal bf16, (B, N, H, d) memory): flashgen vs SDPA cuDNN, each call timed alone
with CUDA events, back to back and behind a large matmul (as in the model), and the kernels
of flashgen's calls under torch.profiler (min / median / max per kernel). Written after
llama_shape_attn.py read flashgen's backward at 726 us in one run against 467 us elsewhere,
and the training step's ratio to SDPA moved 1.005-1.039 between runs of one session.

    python benchmarks/llama_bwd_spread.py [--calls 60]
"""
import argparse, os, statistics, sys
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
sys.path.insert(0, os.getcwd())
import generated.llama_attn as pkg

ap = argparse.ArgumentParser()
ap.add_argument("--calls", type=int, default=60)
cli = ap.parse_args()
B, N, H, D = 1, 4096, 16, 128
dev = "cuda"
torch.manual_seed(0)
mk = lambda: (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_()
q, k, v = mk(), mk(), mk()
do = torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16)
a = torch.randn(N, 2048, device=dev, dtype=torch.bfloat16)
w = torch.randn(2048, 5632, device=dev, dtype=torch.bfloat16)
qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))


def fg():
    return pkg._api.flash_attn_bhnd(qt, kt, vt, 0.0, None, True).transpose(1, 2)


def cudnn():
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2)


def spread(f, behind_matmul):
    o = f()
    times = []
    for _ in range(cli.calls):
        if behind_matmul:
            a @ w
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) * 1e3)
    times.sort()
    return times


for _ in range(2):
    for name, f in (("flashgen", fg), ("cudnn", cudnn)):
        for behind in (False, True):
            t = spread(f, behind)
            n = len(t)
            print(f"{name:9s} {'behind matmul' if behind else 'back to back':14s} bwd us: "
                  f"min {t[0]:7.1f}  p10 {t[n // 10]:7.1f}  median {t[n // 2]:7.1f}  "
                  f"p90 {t[9 * n // 10]:7.1f}  max {t[-1]:7.1f}")

from torch.profiler import profile, ProfilerActivity
o = fg()
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    for _ in range(30):
        a @ w
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
per = {}
for ev in prof.events():
    if ev.device_type == torch.autograd.DeviceType.CUDA:
        per.setdefault(ev.name[:70], []).append(ev.device_time if hasattr(ev, "device_time") else ev.cuda_time)
for name, ts in sorted(per.items(), key=lambda kv: -sum(kv[1])):
    ts.sort()
    print(f"{len(ts):4d} x {name:70s} min {ts[0]:7.1f} med {ts[len(ts) // 2]:7.1f} max {ts[-1]:7.1f} us")
rt = pkg._runtime
for key, plan in rt._backward_plans.items():
    for item in plan if isinstance(plan, tuple) else (plan,):
        meta = getattr(item, "meta", None)
        if meta is not None:
            print("backward launch", getattr(item, "grid", None),
                  {k: v for k, v in meta.items() if not isinstance(v, torch.Tensor)})
