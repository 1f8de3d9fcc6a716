"""The Gluon latent decode (templates/gluon/decode_mla.py.j2; the default on Hopper,
`_decode.MLA_GLUON`) against the
`tl` decode kernel of generated/mla_attn, on one GPU, interleaved: DeepSeek's absorbed
decode (q/k 576, v 512 = the K cache's first 512 dims), B=16 by default, caches of 4k and
16k tokens, 16 and 128 query heads on the one latent head, contiguous and paged (64-token
pages, shuffled). GB/s of the latent cache read once (B * L * 576 * 2 bytes, plus q and
the output), do_bench medians; and the largest difference between the two outputs (both
bf16; the GPU test compares each with float64).

    PYTHONPATH=$PWD python benchmarks/mla_decode_gluon.py [--batch 16] [--lengths 4096 16384]

Each row: {"family": "tl" | "gluon", ...}; the Gluon row also says which kernel its plan
took (a call it cannot serve stays on `tl` and says why: "mla_reason").
"""
import argparse
import json
import sys

import torch
import triton

sys.path.insert(0, ".")
from generated.mla_attn import _decode  # noqa: E402
from mla_decode import latent_decode  # noqa: E402  (benchmarks/mla_decode.py: the same cases)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--heads", type=int, nargs="+", default=[16, 128])
    ap.add_argument("--contiguous-only", action="store_true")
    args = ap.parse_args()
    b = args.batch
    gpu = torch.cuda.get_device_name()
    for n in args.lengths:
        for hq in args.heads:
            for paged in (False,) if args.contiguous_only else (False, True):
                call, moved = latent_decode(b, n, hq, paged)
                outs = {}
                for family in ("tl", "gluon", "tl", "gluon"):  # interleaved, twice
                    _decode.MLA_GLUON = family == "gluon"
                    _decode._plans.clear()
                    outs[family] = call()
                    torch.cuda.synchronize()
                    plan = next(iter(_decode._plans.values()))
                    ms = triton.testing.do_bench(call, warmup=25, rep=100, return_mode="median")
                    row = {"family": family, "batch": b, "cache": n, "hq": hq, "paged": paged,
                           "ms": round(ms, 4), "gbps": round(moved / ms / 1e6, 1), "gpu": gpu}
                    if family == "gluon":
                        row["took"] = "gluon" if plan.mla is not None else "tl"
                        row["mla_reason"] = plan.mla_reason
                        row["splits"] = plan.mla[5][2] if plan.mla is not None else None
                        row["max_abs_diff_vs_tl"] = float(
                            (outs["gluon"].float() - outs["tl"].float()).abs().max())
                    print(json.dumps(row), flush=True)
    _decode.MLA_GLUON = False
    return 0


if __name__ == "__main__":
    sys.exit(main())
