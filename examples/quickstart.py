"""Call the package that `flashgen build specs/gpt2.yaml` generated, and compare it with
PyTorch's own scaled_dot_product_attention.

Runs on a GPU when there is one; otherwise in Triton's CPU interpreter (slow, but the same
kernel code).
"""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F  # noqa: E402

from generated.gpt2_attn import describe, scaled_dot_product_attention  # noqa: E402

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.float16 if device == "cuda" else torch.float32
torch.manual_seed(0)
# GPT-2 small: 12 heads of 64; batch 2, 128 tokens
q, k, v = (torch.randn(2, 12, 128, 64, device=device, dtype=dtype) for _ in range(3))

out = scaled_dot_product_attention(q, k, v, is_causal=True)
ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
err = (out.float() - ref).abs().max().item()

print(describe())
print(f"\ncausal attention on {device} ({dtype}), shape {tuple(out.shape)}: "
      f"max |flashgen - torch SDPA| = {err:.2e}")
sys.exit(0 if err < 1e-2 else 1)
