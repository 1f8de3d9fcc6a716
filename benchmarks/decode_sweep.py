"""Decode tiles x split counts on the GPU (llama_attn, B=8, Hq=32, Hkv=8, d=128, bf16, 4k and 16k
keys, do_bench medians): python benchmarks/decode_sweep.py
(H100: benchmarks/results/H100_decode_splits_sweep.log)."""
import sys, json, torch, triton
sys.path.insert(0, "generated")
import llama_attn as pkg
B, HQ, HKV, D = 8, 32, 8, 128
rows = []
for n in (4096, 16384):
    g = torch.Generator(device="cuda").manual_seed(0)
    kc = torch.randn(B, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    vc = torch.randn(B, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
    lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    nbytes = (2 * B * n * HKV * D + 2 * B * HQ * D) * 2
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2).float(), kc.transpose(1, 2).float(), vc.transpose(1, 2).float(),
        enable_gqa=True).transpose(1, 2)
    for bm, bn, w, s in [(16, 128, 8, 3), (16, 128, 4, 3), (16, 128, 8, 2), (16, 64, 4, 4),
                         (16, 64, 4, 5), (16, 64, 2, 5), (16, 32, 4, 5), (16, 256, 8, 1)]:
        for splits in (1, 2, 3, 4, 6):
            try:
                with pkg._runtime.override_config(block_m=bm, block_n=bn, num_warps=w, num_stages=s):
                    fn = lambda: pkg.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens, num_splits=splits)
                    out = fn()
                    err = (out.float() - ref).abs().max().item()
                    ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                r = dict(n=n, tile=f"{bm}x{bn}w{w}s{s}", splits=splits, ms=round(ms, 4),
                         gbs=round(nbytes / ms / 1e6, 1), err=round(err, 4))
            except Exception as e:
                r = dict(n=n, tile=f"{bm}x{bn}w{w}s{s}", splits=splits, error=str(e)[:120])
            print(json.dumps(r), flush=True)
            rows.append(r)
for n in (4096, 16384):
    ok = sorted((r for r in rows if r["n"] == n and "ms" in r), key=lambda r: r["ms"])
    print("best", n, ok[:5])
