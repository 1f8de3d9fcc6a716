"""Varlen with equal lengths vs the dense kernel on the same tiles: the packing's own cost
(tile walk, span lookups, masked stores) with no schedule difference. H=16 d=128 bf16 causal,
16k tokens; interleaved rounds of do_bench, median TFLOP/s. Also times a second build of
llama_attn (an A/B), a package folder named by OLD_PACKAGE_DIR (default .scratch/old), e.g.
the tree before a change: `git stash; cp -r generated/llama_attn .scratch/old/; git stash pop`.

    python benchmarks/varlen_equal_lengths.py
"""
import os, statistics, sys
import torch, triton
sys.path.insert(0, os.getcwd())
import generated.llama_attn as pkg
sys.path.insert(0, os.environ.get("OLD_PACKAGE_DIR", os.path.join(os.getcwd(), ".scratch", "old")))
import llama_attn as old  # the package before the walk's table
H, D, T = 16, 128, 16384
torch.manual_seed(0)
rows = []
for L in (512, 1024, 2048, 4096):
    B = T // L
    q, k, v = (torch.randn(B, L, H, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    qv, kv, vv = (t.reshape(T, H, D) for t in (q, k, v))
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
    dense = lambda: pkg.flash_attn_func(q, k, v, causal=True)
    var = lambda: pkg.flash_attn_varlen_func(qv, kv, vv, cu, cu, L, L, causal=True)
    var_old = lambda: old.flash_attn_varlen_func(qv, kv, vv, cu, cu, L, L, causal=True)
    err = (dense().reshape(T, H, D).float() - var().float()).abs().max().item()
    flops = 4 * B * H * L * L * D / 2
    err_old = (var_old().float() - var().float()).abs().max().item()
    res = {"dense": [], "varlen": [], "old": []}
    for _ in range(5):
        for n, f in (("dense", dense), ("varlen", var), ("old", var_old)):
            res[n].append(triton.testing.do_bench(f, warmup=25, rep=100, return_mode="median"))
    d, vr, vo = (statistics.median(res[n]) for n in ("dense", "varlen", "old"))
    print(f"L={L:5d} B={B:3d}  dense {flops/d/1e9:6.1f} TF  varlen {flops/vr/1e9:6.1f} TF "
          f"(old walk {flops/vo/1e9:6.1f})  ratio {d/vr:.3f} (old {d/vo:.3f})  "
          f"max|diff| vs dense {err:.1e}, vs old {err_old:.1e}", flush=True)
