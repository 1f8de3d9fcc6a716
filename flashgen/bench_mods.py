"""The `mods` bench suite: flashgen's mod variants (specs/mods.yaml) against FlexAttention
with the same score / mask mods, at FlexAttention's own benchmark shapes (bf16, H=16,
d=64 and 128, B*N = 16k tokens, N from 1k to 16k).

Each case's inputs (document ids, prefix lengths, ALiBi slopes) are made once and shared
by both providers; FlexAttention gets a BlockMask from create_block_mask for the mask mods
(its recommended use) and the score_mod for the score mods, compiled with
torch.compile(dynamic=False) as the training suite does. The check compares each output
on the first batch entry and two heads with a float32 PyTorch reference that applies the
mod by hand.

FLOPs: the cases whose mask keeps at most the causal half (causal + a mod, the windowed
sinks, causal documents) count the causal formula, the prefix-LM the dense one, so the
TFLOP/s of a sparse mask is a lower bound on the work done; the bar is a ratio of times
at the same shape, which no FLOP convention changes.

flashgen rows also note how many new Triton binaries the case's first call compiled: the
kernels do not specialise on the sequence length, so a new N compiles nothing once the
variant has been compiled (FlexAttention recompiles per shape unless run with dynamic
shapes)."""
from __future__ import annotations

MODS_SPEC = "mods.yaml"
# name -> (causal band, mods of the flashgen call, FLOPs counted as causal)
MOD_CASES = {
    "softcap": (True, ("softcap",), True),
    "alibi": (True, ("alibi",), True),
    "document": (True, ("document",), True),
    "prefix_lm": (False, ("prefix_lm",), False),
    "window_sinks": (False, ("window_sinks",), True),
}
MODS_N = (1024, 4096, 16384)
MODS_D = (64, 128)
MODS_H = 16
CAP, SINKS, WINDOW = 50.0, 4, 1024


def inputs(mod, b, h, n, device):
    """The mod's tensors and params for one shape: flashgen's keyword arguments."""
    import torch
    g = torch.Generator().manual_seed(0)
    if mod == "softcap":
        return {"cap": CAP}
    if mod == "alibi":
        return {"slope": torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)],
                                      device=device)}
    if mod == "document":
        # ragged documents: 2..8 per sequence, random lengths, ids sorted
        ids = []
        for _ in range(b):
            cuts = torch.sort(torch.randint(1, n, (int(torch.randint(1, 8, (1,), generator=g)),),
                                            generator=g)).values
            row = torch.zeros(n, dtype=torch.int32)
            for c in cuts.tolist():
                row[c:] += 1
            ids.append(row)
        return {"doc": torch.stack(ids).to(device)}
    if mod == "prefix_lm":
        return {"prefix_len": torch.randint(n // 8, n // 2, (b,), generator=g,
                                            dtype=torch.int32).to(device)}
    if mod == "window_sinks":
        return {"sinks": SINKS, "window": WINDOW}
    raise ValueError(f"unknown mod case {mod!r}")


def flex_mods(mod, kw, b, h, n, device):
    """(score_mod, block_mask) for FlexAttention, the same mod written its way."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    def causal(b_, h_, q, k):
        return q >= k

    score_mod, mask_mod, per_batch = None, None, False
    if mod == "softcap":
        score_mod = lambda s, b_, h_, q, k: CAP * torch.tanh(s / CAP)  # noqa: E731
        mask_mod = causal
    elif mod == "alibi":
        slope = kw["slope"]
        score_mod = lambda s, b_, h_, q, k: s - slope[h_] * (q - k).abs()  # noqa: E731
        mask_mod = causal
    elif mod == "document":
        doc = kw["doc"]
        mask_mod = lambda b_, h_, q, k: (doc[b_, q] == doc[b_, k]) & (q >= k)  # noqa: E731
        per_batch = True
    elif mod == "prefix_lm":
        plen = kw["prefix_len"]
        mask_mod = lambda b_, h_, q, k: (k < plen[b_]) | (k <= q)  # noqa: E731
        per_batch = True
    elif mod == "window_sinks":
        mask_mod = lambda b_, h_, q, k: (k <= q) & ((k < SINKS) | (q - k <= WINDOW))  # noqa: E731
    block_mask = create_block_mask(mask_mod, B=b if per_batch else None, H=None, Q_LEN=n,
                                   KV_LEN=n, device=device)
    return score_mod, block_mask


def reference(mod, kw, q, k, v):
    """float32 output of batch 0, heads 0-1, with the mod applied by hand."""
    import torch
    q, k, v = (t[:1, :2].float() for t in (q, k, v))
    n = q.shape[2]
    s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    i, j = torch.arange(n, device=q.device)[:, None], torch.arange(n, device=q.device)[None, :]
    visible = j <= i
    if mod == "softcap":
        s = CAP * torch.tanh(s / CAP)
    elif mod == "alibi":
        s = s - kw["slope"][:2].float()[:, None, None] * (i - j).abs()
    elif mod == "document":
        d = kw["doc"][0]
        visible = visible & (d[:, None] == d[None, :])
    elif mod == "prefix_lm":
        visible = (j < kw["prefix_len"][0]) | (j <= i)
    elif mod == "window_sinks":
        visible = visible & ((j < SINKS) | (i - j <= WINDOW))
    s = s.masked_fill(~visible, float("-inf"))
    return torch.softmax(s, -1) @ v


def triton_binaries(pkg) -> int:
    """How many compiled binaries the package's loaded `tl` kernels hold."""
    total = 0
    for fn in pkg._runtime._kernels.values():
        for cache in getattr(fn, "device_caches", {}).values():
            total += len(cache[0]) if isinstance(cache, tuple) else len(cache)
    return total
