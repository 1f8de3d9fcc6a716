"""What the compiler actually allocated for each kernel of the shipped packages: shared
memory, registers and spills, beside the planner's shared-memory estimate. Run on the GPU:

    python benchmarks/resources.py
"""
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from flashgen import planner_core  # noqa: E402

PACKAGES = {"generated.gpt2_attn": 64, "generated.llama_attn": 128}


def main():
    print("| kernel | config | smem (compiler) | smem (planner) | regs | spills |")
    print("|---|---|---|---|---|---|")
    for module, d in PACKAGES.items():
        pkg = importlib.import_module(module)
        for dtype in (torch.bfloat16, torch.float16):
            if {torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype] not in pkg._runtime.BUILT_FOR["dtypes"]:
                continue
            q, k, v = (torch.randn(2, 4096, 4, d, device="cuda", dtype=dtype, requires_grad=True)
                       for _ in range(3))
            pkg.flash_attn_func(q, k, v, causal=True).sum().backward()
        torch.cuda.synchronize()
        for (name, function), fn in pkg._runtime._kernels.items():
            cfg = pkg._runtime.launch_config(name, q.device, 4096)
            kind = pkg._runtime.VARIANTS[name]["kind"]
            est = planner_core.smem_estimate(kind, cfg["block_m"], cfg["block_n"],
                                             planner_core.padded_head_dim(d),
                                             2, cfg["num_stages"])
            for cache in fn.device_caches.values():
                binaries = next(c for c in cache if isinstance(c, dict))
                for compiled in binaries.values():
                    print(f"| {name}.{function} | {cfg['block_m']}x{cfg['block_n']} "
                          f"w{cfg['num_warps']} s{cfg['num_stages']} | {compiled.metadata.shared} "
                          f"| {est if function.endswith('kernel') else '-'} | {compiled.n_regs} "
                          f"| {compiled.n_spills} |")


if __name__ == "__main__":
    main()
