"""Training on packed documents: a batch of documents of different lengths packed along
one token axis (no padding), attention by the generated package's
`flash_attn_varlen_func` (flash-attn's signature, docs/VARLEN.md), forward and backward.

    python examples/varlen_training.py

A self-attention layer (a fused QKV projection, attention, an output projection) runs
the packed batch through flashgen, and a copy of it runs each document on its own
through PyTorch's scaled_dot_product_attention; the loss, the input's gradient and
both weight gradients must match. Uses generated/gpt2_attn (`flashgen build
specs/gpt2.yaml`: head dim 64). Runs on a GPU when there is one (bf16 against an fp32
copy), otherwise in Triton's CPU interpreter (fp32, a few seconds).
"""
import copy
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from generated.gpt2_attn import flash_attn_varlen_func  # noqa: E402

LENGTHS = [7, 30, 1, 19, 7]  # the documents, packed in this order: 64 tokens
HEADS, D = 4, 64


class PackedSelfAttention(nn.Module):
    def __init__(self, heads, head_dim):
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim)
        self.proj = nn.Linear(heads * head_dim, heads * head_dim)

    def forward(self, x, cu_seqlens, max_seqlen, attention):
        """x (total, dim): the documents' tokens back to back; cu_seqlens their bounds."""
        total = x.shape[0]
        q, k, v = self.qkv(x).view(total, 3, self.heads, self.head_dim).unbind(1)
        out = attention(q, k, v, cu_seqlens, max_seqlen)  # (total, heads, head_dim)
        return self.proj(out.reshape(total, -1))


def flashgen_attention(q, k, v, cu_seqlens, max_seqlen):
    # causal within each document: no token sees the previous document
    return flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                  causal=True)


def per_document_attention(q, k, v, cu_seqlens, max_seqlen):
    """The same, one document at a time, in plain PyTorch."""
    outs = []
    bounds = cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        qd, kd, vd = (t[start:end].transpose(0, 1)[None] for t in (q, k, v))  # (1, H, n, d)
        outs.append(F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)[0]
                    .transpose(0, 1))
    return torch.cat(outs)


def step(layer, x, target, cu, max_len, attention):
    """Loss, and the gradients of the input and of both weights, after one backward."""
    x = x.detach().requires_grad_()
    layer.zero_grad()
    loss = F.mse_loss(layer(x, cu, max_len, attention).float(), target)
    loss.backward()
    return loss.item(), {"input": x.grad, "qkv.weight": layer.qkv.weight.grad,
                         "proj.weight": layer.proj.weight.grad}


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    layer = PackedSelfAttention(HEADS, D).to(device)
    reference = copy.deepcopy(layer)  # fp32, the same weights
    layer.to(dtype)
    total = sum(LENGTHS)
    cu = torch.tensor([0] + LENGTHS, device=device).cumsum(0).to(torch.int32)
    x = torch.randn(total, HEADS * D, device=device)
    target = torch.randn(total, HEADS * D, device=device)

    loss, grads = step(layer, x.to(dtype), target, cu, max(LENGTHS), flashgen_attention)
    ref_loss, ref_grads = step(reference, x, target, cu, max(LENGTHS), per_document_attention)
    print(f"{len(LENGTHS)} documents of {LENGTHS} tokens packed into {total}, H={HEADS} "
          f"d={D}, on {device} ({dtype}): loss {loss:.6f} (per document in PyTorch "
          f"{ref_loss:.6f})")
    worst = abs(loss - ref_loss) / abs(ref_loss)
    for name, want in ref_grads.items():
        err = ((grads[name].float() - want).abs().max() / want.abs().max()).item()
        worst = max(worst, err)
        print(f"  gradient of {name:12s} max |flashgen - PyTorch| / max |PyTorch| = {err:.1e}")
    return 0 if worst < (3e-2 if dtype == torch.bfloat16 else 1e-4) else 1


if __name__ == "__main__":
    sys.exit(main())
