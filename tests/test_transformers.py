"""The Hugging Face transformers integration (templates/package/hf.py.j2, docs/TRANSFORMERS.md):
tiny Llama- and Gemma-2-style models built from configs with random weights (nothing is
downloaded) run a padded batch through transformers' own attention ("sdpa", or "eager"
for Gemma 2's soft-capping, which SDPA refuses) and through a generated package registered
with `register_transformers()`; logits on the real tokens and every parameter's gradient
must match, and the kernels must be the ones the docs promise (key padding as a mod, no
(B, 1, N, N) bias)."""
import sys
import warnings

import pytest
import torch

from packages import build_and_import

try:
    import transformers
except ImportError:
    # the dev extra installs it on Python >= 3.11 (transformers 5.23 needs 3.11), so a
    # missing transformers fails CI there; a GPU box or Python 3.10 may lack it
    if torch.cuda.is_available() or sys.version_info < (3, 11):
        pytest.skip("transformers is not installed (pip install -e '.[dev]')",
                    allow_module_level=True)
    raise

SPEC = """
head_dims: [16]
dtypes: [fp32]
masks: [none, causal, sliding_window]
window: {left: 3, right: 0}
gqa: true
mods:
  softcap: {builtin: softcap}
  key_padding: {builtin: key_padding}
  document: {builtin: document}
variants:
  - {mask: causal, mods: [key_padding]}
  - {mask: causal, mods: [document]}
  - {mask: causal, mods: [softcap]}
  - {mask: sliding_window, mods: [softcap]}
  - {mask: causal, mods: [softcap, key_padding]}
  - {mask: sliding_window, mods: [softcap, key_padding]}
"""

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            intermediate_size=96, num_hidden_layers=2, vocab_size=128,
            initializer_range=0.2)  # large enough weights for peaked attention rows


@pytest.fixture(scope="module")
def fa(tmp_path_factory):
    pkg = build_and_import(tmp_path_factory.mktemp("hf"), "hf_attn", SPEC)
    assert pkg.register_transformers() == "fgen"
    return pkg


@pytest.fixture
def calls(fa, monkeypatch):
    """Every flash_attn_func / flash_attn_bhnd call the integration makes: (causal, window,
    mods)."""
    seen = []
    real = fa._api.flash_attn_func

    def spy(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=None,
            return_lse=False, *, mods=None, **mod_args):
        seen.append((causal, tuple(window_size), tuple(mods or ())))
        return real(q, k, v, dropout_p, softmax_scale, causal, window_size, return_lse,
                    mods=mods, **mod_args)

    real_bhnd = fa._api.flash_attn_bhnd

    def spy_bhnd(query, key, value, dropout_p=0.0, softmax_scale=None, causal=False,
                 window_size=(-1, -1)):
        # the mod-free fast path: SDPA-layout tensors, the output laid out like query
        seen.append((causal, tuple(window_size), ()))
        out = real_bhnd(query, key, value, dropout_p, softmax_scale, causal, window_size)
        assert out.stride() == query.stride() or not query.transpose(1, 2).is_contiguous()
        return out

    monkeypatch.setattr(fa._api, "flash_attn_func", spy)
    monkeypatch.setattr(fa._api, "flash_attn_bhnd", spy_bhnd)
    return seen


def padded_batch(device, n=10):
    """Three rows: full, right-padded (7 tokens), left-padded (6 tokens)."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, TINY["vocab_size"], (3, n), generator=gen)
    mask = torch.ones(3, n, dtype=torch.long)
    mask[1, 7:] = 0
    mask[2, :4] = 0
    return ids.to(device), mask.to(device)


def run(model, impl, ids, mask, **kwargs):
    """Logits and the gradient of the mean next-token loss over real tokens."""
    model.set_attn_implementation(impl)
    model.zero_grad()
    out = model(input_ids=ids, attention_mask=mask, **kwargs)
    # next-token loss where both tokens are real: a padded query row's output is
    # unspecified (0 with SDPA and flashgen, the mean over all keys with eager)
    real = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    pairs = real[:, :-1] & real[:, 1:]
    loss = torch.nn.functional.cross_entropy(out.logits[:, :-1][pairs], ids[:, 1:][pairs])
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    return out.logits.detach(), grads


def compare(ref, got, mask, atol=2e-4):
    (l_ref, g_ref), (l_got, g_got) = ref, got
    real = mask.bool() if mask is not None else torch.ones(l_ref.shape[:2], dtype=torch.bool)
    torch.testing.assert_close(l_got[real], l_ref[real], atol=atol, rtol=1e-4)
    for name in g_ref:
        torch.testing.assert_close(g_got[name], g_ref[name], atol=atol, rtol=1e-3,
                                   msg=lambda m, n=name: f"gradient of {n}: {m}")


def test_llama_padded_batch(fa, calls, device):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**TINY)
    model = transformers.LlamaForCausalLM(config).to(device)
    ids, mask = padded_batch(device)
    ref = run(model, "sdpa", ids, mask)
    got = run(model, "fgen", ids, mask)
    compare(ref, got, mask)
    # causal + padding ran as the key_padding mod (a (B, N) tensor), never as a bias
    assert calls and all(c == (True, (-1, -1), ("key_padding",)) for c in calls)


def test_llama_generate_left_padded(fa, calls, device):
    """Decoding with a KV cache: a left-padded prompt, then one query row per step."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(device).eval()
    ids, mask = padded_batch(device)
    ids, mask = ids[[0, 2]], mask[[0, 2]]  # generate() wants left padding
    out = {}
    for impl in ("sdpa", "fgen"):
        model.set_attn_implementation(impl)
        with torch.inference_mode():  # inference tensors: no version counters to cache by
            gen = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=3,
                                 do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        out[impl] = gen
    assert torch.equal(out["fgen"].sequences, out["sdpa"].sequences)
    for s_ref, s_got in zip(out["sdpa"].scores, out["fgen"].scores):
        torch.testing.assert_close(s_got, s_ref, atol=2e-4, rtol=1e-4)
    assert {c[2] for c in calls} == {("key_padding",)}


def test_llama_unpadded_and_packed(fa, calls, device, monkeypatch):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(device)
    ids, _ = padded_batch(device)
    # no padding: transformers passes no mask, the plain causal kernel runs
    compare(run(model, "sdpa", ids, None), run(model, "fgen", ids, None), None)
    assert calls and all(c == (True, (-1, -1), ()) for c in calls)
    calls.clear()
    # sequences packed in rows (position_ids restart): the varlen kernels on the rows
    # flattened, boundaries from position_ids (two rows: 6 + 4 and 3 + 1 + 6 tokens)
    pos = torch.stack([torch.cat([torch.arange(6), torch.arange(4)]),
                       torch.cat([torch.arange(3), torch.arange(1), torch.arange(6)])]).to(device)
    rows = ids[:2]
    seen = []
    real = fa._api.flash_attn_varlen_func

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *args, **kw):
        seen.append((cu_q.tolist(), max_q))
        return real(q, k, v, cu_q, cu_k, max_q, max_k, *args, **kw)

    monkeypatch.setattr(fa._api, "flash_attn_varlen_func", spy)
    # (transformers looks for packing only without a cache: use_cache=False)
    packed = dict(position_ids=pos, use_cache=False)
    compare(run(model, "sdpa", rows, None, **packed), run(model, "fgen", rows, None, **packed),
            None)
    assert not calls, "packed rows went through the dense kernels"
    assert seen == [([0, 6, 10, 13, 14, 20], 6)] * TINY["num_hidden_layers"], seen


@pytest.mark.parametrize("bounds", ["tensors", "host"])
def test_llama_flattened_batch_runs_varlen(fa, calls, device, monkeypatch, bounds):
    """A flattened batch (DataCollatorWithFlattening(return_flash_attn_kwargs=True): one row,
    position_ids restarting per sequence, cu_seq_lens_q/k and max_length_q/k) runs
    flash_attn_varlen_func on views of the row, and matches SDPA on the same row (which
    reads the packing from position_ids as a block-diagonal causal mask)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY)).to(device)
    lengths = [6, 1, 9, 4]  # a 1-token sequence among them
    n = sum(lengths)
    ids = torch.randint(0, TINY["vocab_size"], (1, n),
                        generator=torch.Generator().manual_seed(2)).to(device)
    pos = torch.cat([torch.arange(m) for m in lengths])[None].to(device)
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int64)
    if bounds == "tensors":  # int64 on the device, the max as a 0-d tensor
        cu_q = cu_k = cu.to(device)
        max_q = max_k = cu_q.diff().max()
    else:  # a list and host ints, as the collator's own batch has them
        cu_q = cu_k = cu.tolist()
        max_q = max_k = max(lengths)
    seen = []
    real = fa._api.flash_attn_varlen_func

    def spy(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args, **kw):
        seen.append((tuple(q.shape), cu_seqlens_q.dtype, max_seqlen_q, q.is_contiguous()))
        return real(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *args,
                    **kw)

    monkeypatch.setattr(fa._api, "flash_attn_varlen_func", spy)
    ref = run(model, "sdpa", ids, None, position_ids=pos, use_cache=False)
    got = run(model, "fgen", ids, None, position_ids=pos, use_cache=False,
              cu_seq_lens_q=cu_q, cu_seq_lens_k=cu_k, max_length_q=max_q,
              max_length_k=max_k)
    compare(ref, got, None)
    heads = TINY["num_attention_heads"]
    assert seen == [((n, heads, TINY["head_dim"]), torch.int32, max(lengths), True)] * \
        TINY["num_hidden_layers"], seen
    assert not calls, "the flattened row went through the dense kernels"


@pytest.mark.parametrize("padded", [True, False])
def test_gemma2_softcap_sliding_window(fa, calls, device, padded):
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        **TINY, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma2ForCausalLM(config).to(device)
    ids, mask = padded_batch(device)
    mask = mask if padded else None
    ref = run(model, "eager", ids, mask)  # SDPA refuses softcap
    got = run(model, "fgen", ids, mask)
    compare(ref, got, mask)
    pad = ("key_padding",) if padded else ()
    assert set(calls) == {(True, (3, 0), ("softcap",) + pad),
                          (True, (-1, -1), ("softcap",) + pad)}
    # the soft-capping matters at this cap: without it the logits are far off
    config.attn_logit_softcapping = None
    for layer in model.model.layers:
        layer.self_attn.attn_logit_softcapping = None
    capless = run(model, "eager", ids, mask)
    assert (capless[0] - ref[0]).abs().max() > 1e-2


@pytest.mark.parametrize("how", ["position_ids", "flattened"])
def test_gemma2_packed_rows_run_varlen_with_softcap(fa, calls, device, monkeypatch, how):
    """Gemma 2 on packed sequences (position_ids restarting in two rows, or one flattened
    row with cu_seq_lens_q/k): every layer runs flash_attn_varlen_func with the softcap mod
    (the spec's {mask: causal / sliding_window, mods: [softcap]}), none the dense kernels,
    and logits and gradients match eager on the same rows."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(
        **TINY, sliding_window=4, attn_logit_softcapping=2.0, final_logit_softcapping=30.0,
        query_pre_attn_scalar=16, layer_types=["sliding_attention", "full_attention"])
    model = transformers.Gemma2ForCausalLM(config).to(device)
    ids, _ = padded_batch(device)
    extra = {}
    if how == "position_ids":
        rows = ids[:2]
        pos = torch.stack([torch.cat([torch.arange(6), torch.arange(4)]),
                           torch.cat([torch.arange(3), torch.arange(1), torch.arange(6)])])
        want_cu = [0, 6, 10, 13, 14, 20]
    else:
        rows = ids[:1]
        pos = torch.cat([torch.arange(3), torch.arange(1), torch.arange(6)])[None]
        want_cu = [0, 3, 4, 10]
        cu = torch.tensor(want_cu, dtype=torch.int32, device=device)
        extra = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    pos = pos.to(device)
    seen = []
    real = fa._api.flash_attn_varlen_func

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, *args, mods=None, **kw):
        seen.append((cu_q.tolist(), tuple(args[3]) if len(args) > 3 else None,
                     tuple(mods or ())))
        return real(q, k, v, cu_q, cu_k, max_q, max_k, *args, mods=mods, **kw)

    monkeypatch.setattr(fa._api, "flash_attn_varlen_func", spy)
    packed = dict(position_ids=pos, use_cache=False)
    ref = run(model, "eager", rows, None, **packed)
    got = run(model, "fgen", rows, None, **packed, **extra)
    compare(ref, got, None)
    assert not calls, "packed rows went through the dense kernels"
    assert seen == [(want_cu, (3, 0), ("softcap",)), (want_cu, (-1, -1), ("softcap",))], seen


class _Layer(torch.nn.Module):
    is_causal = True


def test_other_masks_and_missing_kernels(fa, device):
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, device=device)
    k, v = (torch.randn(2, 2, 8, 16, device=device) for _ in range(2))

    def reference(mask):
        return torch.nn.functional.scaled_dot_product_attention(
            q, repeat_kv(k, 2), repeat_kv(v, 2), attn_mask=mask).transpose(1, 2)

    # a mask that is no band AND key padding: the additive-bias path, with one warning
    mask = torch.rand(2, 1, 8, 8, device=device) > 0.3
    mask[..., 0] = True
    with pytest.warns(UserWarning, match="additive bias"):
        out, weights = fa._hf.attention_forward(_Layer(), q, k, v, mask)
    assert weights is None and out.shape == (2, 8, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, reference(mask), atol=2e-5, rtol=2e-5)
    # ... which cannot soft-cap: a clear error
    with pytest.raises(ValueError, match="soft-capping"):
        fa._hf.attention_forward(_Layer(), q, k, v, mask, softcap=5.0)
    # sliding window + padding, a combination this spec lacks: the bias path, naming the
    # spec entry that would give it a kernel
    keep = torch.ones(2, 8, dtype=torch.bool, device=device)
    keep[1, 6:] = False
    i = torch.arange(8, device=device)
    band = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - 4)
    mask = band[None, None] & keep[:, None, None, :]
    with pytest.warns(UserWarning, match=r"mask: sliding_window, mods: \[key_padding\]"):
        out, _ = fa._hf.attention_forward(_Layer(), q, k, v, mask, sliding_window=4)
    torch.testing.assert_close(out, reference(mask), atol=2e-5, rtol=2e-5)
    # sliding window + padding + softcap needs its variant: the error names it
    with pytest.raises(ValueError, match=r"\{mask: none, mods: \[softcap, key_padding\]\}"):
        fa._hf.attention_forward(_Layer(), q, k, v, keep[:, None, None, :].expand(2, 1, 8, 8),
                                 softcap=5.0, is_causal=False)


def test_unmasked_calls_skip_the_mask_analysis(fa, device, monkeypatch):
    """A call with no mask, window, cap or packed batch goes straight to the kernels (the
    host-paced B = 1 forward), with the general path's result; anything else still reads
    the mask and kwargs."""
    from transformers.integrations.sdpa_attention import repeat_kv

    torch.manual_seed(0)
    q = torch.randn(2, 4, 8, 16, device=device)
    k, v = (torch.randn(2, 2, 8, 16, device=device) for _ in range(2))

    def general(*args, **kwargs):
        raise AssertionError("took the general path")
    monkeypatch.setattr(fa._hf, "_packed_bounds", general)
    for causal, kwargs in ((True, {}), (False, dict(position_ids=None, use_cache=False,
                                                      output_attentions=False,
                                                      cu_seq_lens_q=None))):
        layer = _Layer()
        layer.is_causal = causal
        out, weights = fa._hf.attention_forward(layer, q, k, v, None, scaling=0.3, **kwargs)
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.double(), repeat_kv(k, 2).double(), repeat_kv(v, 2).double(), is_causal=causal,
            scale=0.3).transpose(1, 2)
        assert weights is None and out.shape == (2, 8, 4, 16) and out.is_contiguous()
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
    # what changes the call (or warns) takes the general path
    for kwargs in (dict(output_attentions=True), dict(cu_seq_lens_q=torch.tensor([0, 8])),
                   dict(sliding_window=4), dict(softcap=5.0)):
        with pytest.raises(AssertionError, match="general path"):
            fa._hf.attention_forward(_Layer(), q, k, v, None, **kwargs)
    # a causal prefill into a longer (static cache) key axis is cut by the general path
    with pytest.raises(AssertionError, match="general path"):
        fa._hf.attention_forward(_Layer(), q, torch.cat([k, k], 2), torch.cat([v, v], 2), None)


def test_register_needs_transformers(fa, monkeypatch):
    with pytest.raises(ValueError, match="contains 'flash'"):
        fa.register_transformers("flashgen")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(ImportError, match="pip install transformers"):
        fa.register_transformers()


def test_softcap_with_an_arbitrary_mask_uses_the_sdpa_mask_variant(tmp_path):
    """With {mask: none, mods: [softcap, sdpa_mask]} in the spec, soft-capping with a mask
    that is no band runs (the bias after the softcap), against float64."""
    pkg = build_and_import(tmp_path, "fg_test_hf_capmask", """
        head_dims: [16]
        dtypes: [fp32]
        masks: [none, causal]
        gqa: true
        mods:
          softcap: {builtin: softcap}
        variants:
          - {mask: none, mods: [softcap, sdpa_mask]}
        """)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 8, 16, generator=g)
    k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(2))
    mask = torch.rand(2, 1, 8, 8, generator=g) > 0.3
    mask[..., 0] = True
    out, _ = pkg._hf.attention_forward(_Layer(), q, k, v, mask, softcap=5.0)
    kk, vv = (t.repeat_interleave(2, 1).double() for t in (k, v))
    s = 5.0 * torch.tanh(q.double() @ kk.transpose(-1, -2) / 4.0 / 5.0)
    ref = (torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ vv).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)
