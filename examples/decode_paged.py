"""Decoding with a paged KV cache: the generated package's `flash_attn_with_kvcache`
(flash-attn's signature) serving two sequences whose keys and values live in pages of a
shared pool, found through a block table, as a serving engine keeps them.

    python examples/decode_paged.py

A prompt is written into the pages and attended to in one call (prefill), then each step
appends one token's k/v in place and attends to everything cached; every output is
checked against plain PyTorch attention over the same tokens kept in ordinary tensors.
Uses generated/llama_attn (`flashgen build specs/llama.yaml`: head dim 128, GQA, decode
kernels). Runs on a GPU when there is one (bf16), otherwise in Triton's CPU interpreter
(fp16, a few seconds).
"""
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # must be set before triton is imported
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from generated.llama_attn import flash_attn_with_kvcache  # noqa: E402

B, H_Q, H_KV, D = 2, 8, 2, 128  # 4 query heads share each key/value head
PAGE, PAGES_PER_SEQ = 16, 4  # room for 64 tokens a sequence
PROMPT = (11, 23)  # the two prompts' lengths
STEPS = 4


def reference(q, k, v):
    """Causal attention in float32 for one sequence, q (Nq, Hq, d), k/v (Nk, Hkv, d): query
    i is token Nk - Nq + i and sees every token up to itself."""
    q, k, v = (t.float().transpose(0, 1) for t in (q, k, v))  # (H, N, d)
    k, v = (t.repeat_interleave(H_Q // H_KV, dim=0) for t in (k, v))
    s = q @ k.transpose(-1, -2) / D ** 0.5
    n_q, n_k = s.shape[-2:]
    visible = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
    return (torch.softmax(s.masked_fill(~visible, float("-inf")), -1) @ v).transpose(0, 1)


def main() -> int:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    torch.manual_seed(0)

    def new(n, heads):  # n tokens' worth of (B, n, heads, D) vectors
        return torch.randn(B, n, heads, D, device=device, dtype=dtype)

    # the pool: pages of PAGE tokens, handed out to the sequences in a shuffled order
    k_pool = torch.zeros(B * PAGES_PER_SEQ, PAGE, H_KV, D, device=device, dtype=dtype)
    v_pool = torch.zeros_like(k_pool)
    block_table = torch.randperm(B * PAGES_PER_SEQ, device=device).to(torch.int32)
    block_table = block_table.view(B, PAGES_PER_SEQ)  # row b: sequence b's pages in order
    cached = torch.zeros(B, dtype=torch.int32, device=device)  # tokens cached a sequence
    # the same keys and values in plain tensors, for the reference
    keys = [torch.empty(0, H_KV, D, device=device, dtype=dtype) for _ in range(B)]
    values = list(keys)
    errors = []

    def check(b, q, k, v, out):
        """Append sequence b's new k, v to its history; the error of its output."""
        keys[b], values[b] = torch.cat([keys[b], k]), torch.cat([values[b], v])
        return (out.float() - reference(q, keys[b], values[b])).abs().max().item()

    # prefill: each prompt written into its pages and attended to, causal (one call a
    # sequence, as the prompts differ in length)
    for b, n in enumerate(PROMPT):
        q, k, v = new(n, H_Q)[:1], new(n, H_KV)[:1], new(n, H_KV)[:1]
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=cached[b:b + 1],
                                      block_table=block_table[b:b + 1], causal=True)
        errors.append(check(b, q[0], k[0], v[0], out[0]))
    cached += torch.tensor(PROMPT, dtype=torch.int32, device=device)

    # decoding: one call a step for the whole batch; each sequence's new k, v go in at its
    # own position (cache_seqlens), through its own pages
    for _ in range(STEPS):
        q, k, v = new(1, H_Q), new(1, H_KV), new(1, H_KV)
        out = flash_attn_with_kvcache(q, k_pool, v_pool, k, v, cache_seqlens=cached,
                                      block_table=block_table, causal=True)
        errors.append(max(check(b, q[b], k[b], v[b], out[b]) for b in range(B)))
        cached += 1

    print(f"paged KV cache on {device} ({dtype}): {B} sequences, pages of {PAGE} tokens, "
          f"Hq={H_Q} Hkv={H_KV} d={D}; {cached.tolist()} tokens cached after the prompts "
          f"and {STEPS} steps")
    print("max |flashgen - PyTorch| per call (the prefills, then each step): "
          + ", ".join(f"{e:.1e}" for e in errors))
    return 0 if max(errors) < 2e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
