"""Decode tiles x split counts on the GPU (llama_attn, Hq=32, Hkv=8, d=128, bf16, one query
token): do_bench medians and read-flush medians (see flashgen/bench/decode.py).

    python benchmarks/decode_sweep.py [--b 8] [--n 4096 16384] [--splits 1 2 3 4 6]

(H100: benchmarks/results/H100_decode_splits_sweep.log for B=8,
H100_decode_splits_sweep_b1.log for B=1)."""
import argparse
import json
import sys

import torch
import triton

sys.path.insert(0, "generated")
import llama_attn as pkg  # noqa: E402
from flashgen.bench.decode import to_pages  # noqa: E402
from flashgen.measure import read_flush_ms  # noqa: E402

HQ, HKV, D = 32, 8, 128
TILES = [(16, 128, 8, 3), (16, 128, 4, 3), (16, 128, 8, 2), (16, 64, 4, 4),
         (16, 64, 4, 5), (16, 64, 2, 5), (16, 32, 4, 5), (16, 256, 8, 1)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--b", type=int, default=8)
    ap.add_argument("--n", type=int, nargs="*", default=[4096, 16384])
    ap.add_argument("--splits", type=int, nargs="*", default=[1, 2, 3, 4, 6])
    ap.add_argument("--tiles", nargs="*", default=None, help="e.g. 16x128w8s3")
    ap.add_argument("--page", type=int, default=0, help="paged pool of this page size "
                    "(shuffled block table); 0 = contiguous cache")
    args = ap.parse_args()
    tiles = TILES
    if args.tiles:
        tiles = []
        for t in args.tiles:
            mn, rest = t.split("w")
            w, s = rest.split("s")
            bm, bn = mn.split("x")
            tiles.append((int(bm), int(bn), int(w), int(s)))
    B = args.b
    rows = []
    for n in args.n:
        g = torch.Generator(device="cuda").manual_seed(0)
        kc = torch.randn(B, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        vc = torch.randn(B, n, HKV, D, device="cuda", dtype=torch.bfloat16, generator=g)
        q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16, generator=g)
        lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
        nbytes = (2 * B * n * HKV * D + 2 * B * HQ * D) * 2
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2).float(), kc.transpose(1, 2).float(), vc.transpose(1, 2).float(),
            enable_gqa=True).transpose(1, 2)
        kw = {}
        if args.page:
            pages = n // args.page
            table = torch.randperm(B * pages, device="cuda").to(torch.int32).view(B, pages)
            kc, vc = to_pages(kc, table, args.page), to_pages(vc, table, args.page)
            kw = dict(block_table=table)
        for bm, bn, w, s in tiles:
            for splits in args.splits:
                tile = f"{bm}x{bn}w{w}s{s}"
                try:
                    with pkg._runtime.override_config(block_m=bm, block_n=bn, num_warps=w,
                                                      num_stages=s):
                        def fn():
                            return pkg.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens,
                                                               num_splits=splits, **kw)
                        out = fn()
                        err = (out.float() - ref).abs().max().item()
                        ms = triton.testing.do_bench(fn, warmup=20, rep=100, return_mode="median")
                        rf = read_flush_ms(fn)
                    r = dict(b=B, n=n, page=args.page, tile=tile, splits=splits, ms=round(ms, 4),
                             gbs=round(nbytes / ms / 1e6, 1), gbs_rf=round(nbytes / rf / 1e6, 1),
                             err=round(err, 4))
                except Exception as e:
                    r = dict(b=B, n=n, tile=tile, splits=splits, error=str(e)[:120])
                print(json.dumps(r), flush=True)
                rows.append(r)
    for n in args.n:
        ok = sorted((r for r in rows if r["n"] == n and "ms" in r), key=lambda r: -r["gbs_rf"])
        print("best", n, ok[:5])


if __name__ == "__main__":
    main()
