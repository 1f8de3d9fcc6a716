"""The float64 reference the kernels are judged against (by the tests and by `flashgen check`): the attention formula written out
naively, with masks built from their definitions rather than from the package's code."""
from __future__ import annotations

import math

import torch


def visible_mask(n_q: int, n_k: int, *, causal: bool, window=(-1, -1), bottom_right: bool):
    """[n_q, n_k] bool: which keys each query may see.

    PyTorch (top-left): causal means torch.ones(n_q, n_k).tril().
    flash-attn (bottom-right): query i sits at key position i + n_k - n_q; causal means
    key j <= that position; window (left, right) keeps position - left <= j <= position + right,
    with -1 meaning unbounded on that side."""
    if not bottom_right:
        assert window == (-1, -1)
        m = torch.ones(n_q, n_k, dtype=torch.bool)
        return m.tril() if causal else m
    pos = torch.arange(n_q)[:, None] + (n_k - n_q)
    j = torch.arange(n_k)[None, :]
    left, right = window
    if causal:
        right = 0
    m = torch.ones(n_q, n_k, dtype=torch.bool)
    if left >= 0:
        m &= j >= pos - left
    if right >= 0:
        m &= j <= pos + right
    return m


def dropout_keep_rate(dropout_p: float) -> float:
    """The keep rate the packages apply for dropout_p, from its documented definition: one
    byte draw per element, dropped when below T = round(256 p) (halves up), T clamped to
    [1, 255] for p > 0; kept elements are scaled by its inverse."""
    if dropout_p == 0.0:
        return 1.0
    t = min(max(math.floor(dropout_p * 256 + 0.5), 1), 255)
    return (256 - t) / 256


def attention_ref(q, k, v, visible, scale=None, keep=None, dropout_p=0.0, score_mod=None,
                  sink=None):
    """q (B, Hq, Nq, d), k/v (B, Hkv, Nk, d), any dtype -> (out, lse) in float64.
    A row that sees no key gives out 0 and lse -inf. With dropout, `keep` is the
    (B, Hq, Nq, Nk) bool mask and out = (P * keep / r) @ V with r the keep rate applied
    for p (`dropout_keep_rate`: 1 - p rounded to 1/256); the LSE is unaffected.
    `visible` broadcasts to (B, Hq, Nq, Nk); score_mod maps the scaled scores to new ones;
    sink (B, Hq) adds one logit per row to the softmax denominator (no value row).
    Differentiable: autograd through it gives the reference gradients."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    if score_mod is not None:
        s = score_mod(s)
    s = s.masked_fill(~visible.to(s.device), float("-inf"))
    if sink is not None:
        s = torch.cat([s, sink.double().to(s.device)[..., None, None].expand(*s.shape[:3], 1)], -1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None])
    p = torch.nan_to_num(p, nan=0.0)  # rows with lse = -inf
    if sink is not None:
        p = p[..., :-1]
    if keep is not None:
        p = p * keep.to(p.device) / dropout_keep_rate(dropout_p)
    return p @ v, lse
