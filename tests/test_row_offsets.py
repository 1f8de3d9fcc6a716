"""Calls whose rows inside one (batch, head) slice span 2**31 or more elements are refused
with a ValueError before any launch: the kernels address such rows with 32-bit offsets
(batch and head offsets are 64-bit), and on the GPU a wrapped offset was an illegal memory
access (2 x H200: a (1, 81920, 384, 128) ring shard). Meta tensors stand in for the
multi-GB inputs: the check reads shapes and strides only."""
import pytest
import torch

import generated.llama_attn as pkg

rt = pkg._runtime


def meta(*shape):
    return torch.empty(shape, device="meta", dtype=torch.bfloat16)


def test_a_slice_past_2_31_elements_is_refused_and_the_fix_named():
    q = meta(1, 81920, 384, 128)  # flash-attn layout: rows 384 * 128 elements apart
    with pytest.raises(ValueError, match=r"2\*\*31.*B, H, N, d memory layout"):
        rt.check_row_offsets(1, 81920, q=q)
    # the same tensor with each head's rows contiguous is addressable
    rt.check_row_offsets(2, 81920, q=meta(1, 384, 81920, 128))
    # the last row that still fits: (rows - 1) * stride + d - 1 < 2**31
    rows = (2 ** 31 - 128) // (384 * 128) + 1
    rt.check_row_offsets(1, rows, q=meta(1, rows, 384, 128))
    with pytest.raises(ValueError):
        rt.check_row_offsets(1, rows + 1, q=meta(1, rows + 1, 384, 128))


def test_the_forward_and_backward_plans_check_before_any_launch():
    big = meta(1, 81920, 384, 128)
    with pytest.raises(ValueError, match=r"q \(1, 81920, 384, 128\)"):
        rt._forward_plan(big, big, big, big, True, "causal", 0, 0, 0.1, False)
    t = big.transpose(1, 2)  # the backward's (B, H, N, d) views of flash-attn tensors
    with pytest.raises(ValueError, match="2\\*\\*31"):
        rt._backward_plan(t, t, t, t, t, t, t, t, "causal", 0, 0, 0.1, False)
