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
    """The mod's tensors and params for one shape: flashgen's keyword arguments (call_inputs
    for the case's built-in)."""
    from ..mods import builtin_mod

    cases = {"softcap": ("softcap", {"cap": CAP}), "alibi": ("alibi", None),
             "document": ("document", None), "prefix_lm": ("prefix_lm", None),
             "window_sinks": ("sliding_window_sinks", {"sinks": SINKS, "window": WINDOW})}
    if mod not in cases:
        raise ValueError(f"unknown mod case {mod!r}")
    builtin, params = cases[mod]
    return call_inputs([builtin_mod(mod, builtin, params)], b, h, n, n, device)


def call_inputs(mods, b, h, n_q, n_k, device, *, small=False, seed=0):
    """The keyword arguments (tensors and params) of a call with `mods` (flashgen.mods.Mod,
    in the call's order) at one shape, valued as a model would pass them, since a block
    mask's speed depends on its sparsity: this suite's inputs, and what `flashgen tune`
    checks and times (flashgen/measure.py). Built-ins: documents 2..8 a sequence of random
    lengths (ids sorted), prefixes of N/8..N/2 tokens, ALiBi's slopes, right-padded keys
    (N/2..N real tokens a row), SDPA's attn_mask as transformers builds it for a padded
    batch (a (B, 1, Nq, Nk) causal and key-padding mask, as the fp32 0 / -inf bias the
    sdpa_mask mod takes), random sink logits and relative biases. A spec's own mods get
    random tensors of their declared shapes (check.random_tensor; integers in 8 sorted runs,
    ~N/8-token documents). Params: the mod's values (the spec's). `small` (a correctness
    check's short sequence): a sliding_window_sinks window longer than a third of the keys
    shrinks to that, so its edge falls inside. `seed`: every mod draws from its own
    generator seeded with it (so the inputs of a shape are always the same)."""
    import torch

    from ..check import mod_extents, random_tensor

    kw = {}
    for m in mods:
        g = torch.Generator().manual_seed(seed)
        made = dict(m.params)
        maker = _BUILTIN_INPUTS.get(m.builtin)
        if maker is not None:
            made.update(maker(made, g, b, h, n_q, n_k, small))
        for t in m.tensors:
            if t.name not in made:
                made[t.name] = random_tensor(t, mod_extents(b, h, n_q, n_k), g, id_runs=8)
        kw.update({k: v.to(device) if isinstance(v, torch.Tensor) else v
                   for k, v in made.items()})
    return kw


# built-in name -> fn(params, generator, b, h, n_q, n_k, small) -> {tensor or param: value}
# (call_inputs; torch imported by each, as everywhere in this module)
def _documents(params, g, b, h, n_q, n_k, small):
    # ragged documents: 2..8 per sequence, random lengths, ids sorted
    import torch

    n = max(n_q, n_k)
    ids = []
    for _ in range(b):
        cuts = torch.sort(torch.randint(1, n, (int(torch.randint(1, 8, (1,), generator=g)),),
                                        generator=g)).values
        row = torch.zeros(n, dtype=torch.int32)
        for c in cuts.tolist():
            row[c:] += 1
        ids.append(row)
    return {"doc": torch.stack(ids)}


def _prefix(params, g, b, h, n_q, n_k, small):
    import torch

    n = max(n_q, n_k)
    return {"prefix_len": torch.randint(n // 8, max(n // 2, n // 8 + 1), (b,), generator=g,
                                        dtype=torch.int32)}


def _alibi(params, g, b, h, n_q, n_k, small):
    import torch

    return {"slope": torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)])}


def _real_keys(g, b, n_q, n_k):
    """[B, Nk] bool: each row's real (unpadded) keys, the first N/2..N."""
    import torch

    lengths = torch.randint(max(n_k // 2, 1), n_k + 1, (b,), generator=g)
    return torch.arange(n_k)[None, :] < lengths[:, None]


def _key_padding(params, g, b, h, n_q, n_k, small):
    return {"keep": _real_keys(g, b, n_q, n_k)}


def _attn_mask(params, g, b, h, n_q, n_k, small):
    import torch

    causal = torch.ones(n_q, n_k, dtype=torch.bool).tril(n_k - n_q)
    visible = causal[None, None] & _real_keys(g, b, n_q, n_k)[:, None, None, :]
    return {"bias": torch.zeros(visible.shape).masked_fill(~visible, float("-inf"))}


def _sinks(params, g, b, h, n_q, n_k, small):
    import torch

    return {"sinks": torch.randn(h, generator=g)}


def _relative_bias(params, g, b, h, n_q, n_k, small):
    import torch

    return {"rel_bias": torch.randn(h, 2 * params["max_distance"] + 1, generator=g) * 0.5}


def _window(params, g, b, h, n_q, n_k, small):
    return {"window": min(params["window"], max(n_k // 3, 1))} if small else {}


_BUILTIN_INPUTS = {"document": _documents, "prefix_lm": _prefix, "alibi": _alibi,
                   "key_padding": _key_padding, "bias": _attn_mask, "sink_logits": _sinks,
                   "relative_bias": _relative_bias, "sliding_window_sinks": _window}


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
