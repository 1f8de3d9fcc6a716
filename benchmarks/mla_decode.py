"""DeepSeek-style latent decode (MLA, q/k 576, v 512 = a view of the K cache's first 512
dims) through generated/mla_attn's flash_attn_with_kvcache: GB/s of the latent cache read
once (B * L * 576 * 2 bytes, plus q and the output), do_bench medians, for 16 and 128 query
heads on the one latent head, contiguous and paged (64-token pages).

    PYTHONPATH=$PWD python benchmarks/mla_decode.py [--batch 16] [--lengths 1024 4096 16384]
"""
import argparse
import json
import sys

import torch
import triton

sys.path.insert(0, ".")
from generated.mla_attn import flash_attn_with_kvcache  # noqa: E402


def latent_decode(b: int, n: int, hq: int, paged: bool):
    """One case's inputs, seeded (torch.manual_seed(0)): a bf16 latent cache of b x n tokens
    (paged: 64-token pages in a shuffled block table), hq query heads on its one latent
    head, every row's length n. Returns (call, moved): a function that runs the decode
    (V = the cache's first 512 dims) and the bytes it moves (the cache read once, q and
    the output). benchmarks/mla_decode_gluon.py times the same cases."""
    torch.manual_seed(0)
    if paged:
        pages = b * n // 64
        cache = torch.randn(pages, 64, 1, 576, device="cuda", dtype=torch.bfloat16)
        table = torch.randperm(pages, device="cuda").view(b, n // 64).to(torch.int32)
    else:
        cache = torch.randn(b, n, 1, 576, device="cuda", dtype=torch.bfloat16)
        table = None
    q = torch.randn(b, 1, hq, 576, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((b,), n, device="cuda", dtype=torch.int32)
    moved = b * n * 576 * 2 + q.numel() * 2 + b * hq * 512 * 2

    def call():
        return flash_attn_with_kvcache(q, cache, cache[..., :512], cache_seqlens=lens,
                                       block_table=table, softmax_scale=576 ** -0.5,
                                       causal=True)
    return call, moved


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    args = ap.parse_args()
    b = args.batch
    for n in args.lengths:
        for hq in (16, 128):
            for paged in (False, True):
                call, moved = latent_decode(b, n, hq, paged)
                call()
                ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                print(json.dumps({"batch": b, "cache": n, "hq": hq, "paged": paged,
                                  "ms": round(ms, 4), "gbps": round(moved / ms / 1e6, 1),
                                  "gpu": torch.cuda.get_device_name()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
