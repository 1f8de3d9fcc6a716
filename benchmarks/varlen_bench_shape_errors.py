"""Spread of the varlen bench-shape backward's error (16 documents, 128..4096 tokens, d=128
causal bf16) against the dense flashgen backward and torch's bf16, over fresh draws: max and RMS
(how tests/test_gluon_varlen.py::test_gluon_varlen_backward_bench_shape picks its bound).

    python benchmarks/varlen_bench_shape_errors.py
"""
import os, sys
import torch
sys.path.insert(0, os.getcwd()); sys.path.insert(0, os.path.join(os.getcwd(), "tests"))
import generated.llama_attn as pkg
from flashgen.bench.varlen import ragged_lengths
lens = ragged_lengths(16, 16384, 128, 4096, 0)
c = [0]
for n in lens: c.append(c[-1] + n)
cu = torch.tensor(c, dtype=torch.int32, device="cuda")
for draw in range(5):
    q, k, v = (torch.randn(16384, 16, 128, dtype=torch.bfloat16, device="cuda", requires_grad=True) for _ in range(3))
    do = torch.randn(16384, 16, 128, dtype=torch.bfloat16, device="cuda")
    out = pkg.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    out.backward(do)
    ours = (q.grad, k.grad, v.grad)
    worst = {}
    for i in sorted({lens.index(max(lens)), lens.index(min(lens)), 3, 11}):
        s, e = c[i], c[i + 1]
        def sdpa(dtype):
            ts = [t.detach()[s:e].transpose(0, 1).to(dtype).requires_grad_() for t in (q, k, v)]
            torch.nn.functional.scaled_dot_product_attention(*ts, is_causal=True).backward(do[s:e].transpose(0, 1).to(dtype))
            return [t.grad.transpose(0, 1).double() for t in ts]
        ref, low = sdpa(torch.float64), sdpa(torch.bfloat16)
        ts = [t.detach()[s:e][None].clone().requires_grad_() for t in (q, k, v)]
        pkg.flash_attn_func(*ts, causal=True).backward(do[s:e][None])
        dense = [t.grad[0].double() for t in ts]
        for name, g, r, b, dn in zip(("dq", "dk", "dv"), ours, ref, low, dense):
            d = g[s:e].double() - r
            mx = d.abs().max().item(); rms = d.pow(2).mean().sqrt().item()
            dmx = (dn - r).abs().max().item(); drms = (dn - r).pow(2).mean().sqrt().item()
            tmx = (b - r).abs().max().item(); trms = (b - r).pow(2).mean().sqrt().item()
            print(f"draw {draw} doc {i:2d} ({e-s:4d}) {name}: max {mx:.2e} (dense x{mx/dmx:.2f}, torch x{mx/tmx:.2f})  rms {rms:.2e} (dense x{rms/drms:.3f}, torch x{rms/trms:.2f})", flush=True)
