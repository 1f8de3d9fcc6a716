"""Attention alone at the transformers Llama step's shape, causal bf16, in the layout
transformers hands over ((B, N, H, d) memory seen as (B, H, N, d)): flashgen vs SDPA cuDNN vs
SDPA flash, forward and backward, 4 interleaved rounds of do_bench, median us and TFLOP/s.

    python benchmarks/llama_shape_attn.py [B N H d]      # default 1 4096 16 128
"""
import json, os, statistics, sys
import torch
import triton
sys.path.insert(0, os.getcwd())
import generated.llama_attn as pkg
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F

B, N, H, D = [int(x) for x in (sys.argv[1:5] if len(sys.argv) > 4 else (1, 4096, 16, 128))]
torch.manual_seed(0)
dev = "cuda"
def mk():
    return (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_()
q, k, v = mk(), mk(), mk()
do = torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16)
flops_fwd = 4 * B * H * N * N * D / 2
def fg():
    return pkg.flash_attn_func(q, k, v, 0.0, None, True)
def sd(backend):
    def f():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                                  v.transpose(1, 2), is_causal=True).transpose(1, 2)
    return f
prov = {"flashgen": fg, "cudnn": sd(SDPBackend.CUDNN_ATTENTION), "flash": sd(SDPBackend.FLASH_ATTENTION)}
ref = fg().float()
for n, f in prov.items():
    o = f().float()
    print(n, "max|o-flashgen|", (o - ref).abs().max().item())
res = {}
for rnd in range(4):
    for n, f in prov.items():
        with torch.no_grad():
            t = triton.testing.do_bench(f, warmup=50, rep=200, return_mode="median")
        res.setdefault(n, {}).setdefault("fwd", []).append(t)
        o = f()
        def bw():
            torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        t = triton.testing.do_bench(bw, warmup=50, rep=200, return_mode="median")
        res[n].setdefault("bwd", []).append(t)
print(f"B={B} N={N} H={H} d={D} causal bf16; median of 4 rounds")
for n in prov:
    f, b = statistics.median(res[n]["fwd"]), statistics.median(res[n]["bwd"])
    print(f"{n:9s} fwd {f*1e3:7.1f} us {flops_fwd/f/1e9:6.1f} TF   bwd {b*1e3:7.1f} us {2.5*flops_fwd/b/1e9:6.1f} TF")
out = os.environ.get("OUT")
if out:
    json.dump(res, open(f"{out}/attn_b{B}_n{N}.json", "w"), indent=1)
