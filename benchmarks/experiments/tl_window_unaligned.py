"""The `tl` forward's wrong answers with a sliding window on rows whose stride is not a
multiple of 16 elements (docs/TESTING.md, Open findings): which launch or kernel change
makes them right. Runs the four cases the fuzzer and the sanitize set found, with the
launch config overridden as MODE says (base: none), and prints each case's result line
and the forward config it ran.

    python tl_window_unaligned.py MODE      (MODE: base, stages1, stages2, bm64, w8)
"""
import json
import sys

import torch

from flashgen.selftest.cases import Case, run_case
from flashgen.selftest.package import selftest_packages

CASES = [
    '{"kind":"train","package":"selftest","h_q":4,"h_kv":1,"d":96,"n_q":257,"n_k":257,'
    '"window":[64,0],"strided":"pad","family":"tl","seed":3}',
    '{"kind":"varlen","package":"selftest","h_q":8,"d":80,"window":[75,-1],"dropout":0.1,'
    '"seqlens_q":[264,1],"seqlens_k":[264,1],"strided":"pad","family":"tl","seed":329754793}',
    '{"kind":"train","package":"selftest","batch":2,"h_kv":1,"d":80,"n_q":1177,"n_k":1177,'
    '"causal":true,"window":[851,0],"dropout":0.5,"strided":"odd","family":"tl",'
    '"seed":857220855}',
    '{"kind":"varlen","package":"selftest","d":80,"causal":true,"window":[667,0],'
    '"dropout":0.5,"options":{"q_scale":0.25},"seqlens_q":[1,1,76,1224,1,26,46,44],'
    '"seqlens_k":[1,98,1,1224,1,0,496,44],"strided":"pad","seed":509681791}',
    # controls: the first case contiguous, and causal without a window
    '{"kind":"train","package":"selftest","h_q":4,"h_kv":1,"d":96,"n_q":257,"n_k":257,'
    '"window":[64,0],"family":"tl","seed":3}',
    '{"kind":"train","package":"selftest","h_q":4,"h_kv":1,"d":96,"n_q":257,"n_k":257,'
    '"causal":true,"strided":"pad","family":"tl","seed":3}',
]

OVERRIDES = {"base": None, "stages1": dict(num_stages=1), "stages2": dict(num_stages=2),
             "bm64": dict(block_m=64, block_n=64), "w8": dict(num_warps=8)}


def main(mode: str) -> None:
    pkgs = selftest_packages("cuda", ["selftest"])
    rt = pkgs["selftest"]._runtime
    dev = torch.device("cuda")
    for name in ("fwd_window_d96_bf16", "fwd_window_dropout_d80_bf16"):
        print(mode, name, "config at n=256:", rt.launch_config(name, dev, 256))
    for text in CASES:
        case = Case.from_json(text)
        override = OVERRIDES.get(mode)
        ctx = rt.override_config(**override) if override else None
        if ctx:
            with ctx:
                result = run_case(case, pkgs, "cuda")
        else:
            result = run_case(case, pkgs, "cuda")
        print(mode, "PASS" if result.passed else "FAIL",
              json.dumps({k: round(v, 3) for k, v in result.errors.items()}), result.message,
              text[:90], flush=True)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "base")
