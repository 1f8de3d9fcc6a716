"""Peak memory on the GPU: forward + backward at N = 16k must need no more than SDPA's
flash backend (both keep O(N) state: q, k, v, o, the LSE and the gradients)."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from packages import build_and_import


@pytest.mark.gpu
def test_peak_memory_fwd_bwd_16k_not_above_sdpa_flash(tmp_path):
    pkg = build_and_import(tmp_path, "fg_test_mem", """
        head_dims: [128]
        dtypes: [bf16]
        masks: [causal]
        """)
    q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    do = torch.randn_like(q)

    def peak(fn):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*leaves).backward(do)  # warm up: compile, allocator pools
        for t in leaves:
            t.grad = None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn(*leaves).backward(do)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    def sdpa_flash(q, k, v):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    ours = peak(lambda q, k, v: pkg.scaled_dot_product_attention(q, k, v, is_causal=True))
    theirs = peak(sdpa_flash)
    print(f"peak extra memory fwd+bwd N=16k: flashgen {ours / 2**20:.1f} MiB, "
          f"SDPA flash {theirs / 2**20:.1f} MiB")
    assert ours <= theirs
