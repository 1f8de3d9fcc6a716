"""Stage 4, verify: `flashgen check` builds a spec into a temporary folder, imports the
package and compares every kernel variant with the float64 reference on fresh random
inputs -- on the GPU when there is one, otherwise in Triton's CPU interpreter: each forward
with the gradients of its backward (dropout against the exact keep mask the call drew), and
each decoding kernel on a ragged, paged KV cache.

It is the same comparison the test suite makes, packaged for a user who has edited a spec
and wants to know the kernels they are about to ship are right on their machine.
"""
from __future__ import annotations

import contextlib
import importlib
import os
import sys
import tempfile
from pathlib import Path

import torch  # torch does not import triton: TRITON_INTERPRET can still be set below

from .build import build_spec
from .spec import load_spec
from .variants import variants_for

# dtype -> max |got - ref| allowed, relative to max(1, |ref|); see tests/conftest.py. fp8:
# against float64 on the dequantized inputs, so what is counted is P rounded to e4m3 for
# P V (2^-4 relative an element, 16x bf16's 2^-8; tests/test_fp8.py) and its reach into D
_TOL = {"fp32": 1e-4, "fp16": 5e-3, "bf16": 4e-2, "fp8_e4m3": 0.2}
_DROPOUT_P = 0.2


def _window(spec, variant):
    if variant.mask != "sliding_window":
        return (-1, -1)
    # keep the window inside the short test sequences so both edges are exercised
    return tuple(min(w, 24) if w >= 0 else w for w in (spec.window.left, spec.window.right))


def _cases(spec, quick: bool):
    """(label, B, Nq, Nk, Hq, Hkv) to run for a training variant."""
    h_q, h_kv = (4, 1) if spec.gqa else (2, 2)
    cases = [("N=67", 2, 67, 67, h_q, h_kv)]
    if not quick:
        cases += [
            ("N=1", 1, 1, 1, h_q, h_kv),
            ("Nq=40,Nk=150", 1, 40, 150, h_q, h_kv),
            ("Nq=150,Nk=40", 1, 150, 40, h_q, h_kv),
        ]
    return cases


def _rel_err(got, ref) -> float:
    got, ref = got.double().cpu(), ref.double().cpu()
    if torch.isnan(got).any():
        return float("nan")
    return ((got - ref).abs() / ref.abs().clamp(min=1)).max().item() if ref.numel() else 0.0


def _check_training(pkg, spec, variant, label, b, n_q, n_k, h_q, h_kv, device, dtype):
    """Forward and all three gradients (the fwd and bwd variants) against autograd through
    the float64 reference; with dropout, against the exact keep mask the call used."""
    from .reference import attention_ref, visible_mask

    causal = variant.mask == "causal"
    window = _window(spec, variant)
    p = _DROPOUT_P if variant.dropout else 0.0
    fp8 = variant.dtype == "fp8_e4m3"  # bf16 inputs quantized, one scale a tensor
    q = torch.randn(b, n_q, h_q, variant.head_dim, dtype=dtype, device=device, requires_grad=True)
    k = torch.randn(b, n_k, h_kv, variant.head_dim, dtype=dtype, device=device, requires_grad=True)
    # (V and the output have V's head dim: an MLA pair's own)
    v = torch.randn(b, n_k, h_kv, variant.v_dim, dtype=dtype, device=device, requires_grad=True)
    do = torch.randn(b, n_q, h_q, variant.v_dim, dtype=dtype, device=device)
    mod_kw, score_mod, mod_mask, sink = _mod_inputs(spec, variant, b, n_q, n_k, h_q, device)
    args, deq = (q, k, v), (q, k, v)
    if fp8:  # the gradients reach q, k, v straight through (quantize_fp8)
        quant = [pkg.quantize_fp8(t) for t in (q, k, v)]
        args = tuple(x for x, _ in quant)
        mod_kw = dict(mod_kw, q_descale=quant[0][1], k_descale=quant[1][1], v_descale=quant[2][1])
        deq = tuple(x.double() * d.double() for x, d in quant)
    state = torch.get_rng_state() if device == "cpu" else torch.cuda.get_rng_state()
    out = pkg.flash_attn_func(*args, dropout_p=p, causal=causal, window_size=window, **mod_kw)
    out.backward(do)
    keep = None
    if p:
        (torch.set_rng_state if device == "cpu" else torch.cuda.set_rng_state)(state)
        keep = pkg.dropout_mask(b, h_q, n_q, n_k, p, device=device)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in deq)
    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
    if mod_mask is not None:
        vis = vis & mod_mask
    ref, _ = attention_ref(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2), vis,
                           keep=keep, dropout_p=p, score_mod=score_mod, sink=sink)
    ref.transpose(1, 2).backward(do.double())
    return max(_rel_err(out, ref.transpose(1, 2)), _rel_err(q.grad, q64.grad),
               _rel_err(k.grad, k64.grad), _rel_err(v.grad, v64.grad))


def _mod_inputs(spec, variant, b, n_q, n_k, h_q, device):
    """(keyword arguments, reference score mod, reference mask, reference sink) for a
    variant's mods: random tensors of the declared shapes (ids sorted along their last
    extent, like document ids), params at their defaults; the reference evaluates the
    same expression trees in float64 on the host (mod_reference)."""
    if not variant.mods:
        return {}, None, None, None
    by_name = {m.name: m for m in spec.mods}
    ms = [by_name[n] for n in variant.mods]
    extents = mod_extents(b, h_q, n_q, n_k)
    kw = {"mods": variant.mods}
    for m in ms:
        for t in m.tensors:
            kw[t.name] = random_tensor(t, extents).to(device)
    return (kw, *mod_reference(ms, kw, b, h_q, n_q, n_k))


def mod_extents(b, h_q, n_q, n_k) -> dict:
    """The values of a mod tensor's symbolic extents for one call's shape."""
    return {"B": b, "H": h_q, "Nq": n_q, "Nk": n_k, "N": max(n_q, n_k)}


def random_tensor(t, extents: dict, generator=None, id_runs: int | None = None):
    """A random CPU tensor for the mod tensor declaration `t` (flashgen.mods.TensorDecl) at
    one call's `extents` (mod_extents; another name's extent is 17): integers sorted along
    the last extent in `id_runs` runs (default: one per 8 elements), like document ids;
    booleans True at 70%; floats normal with std 0.5."""
    shape = [d if isinstance(d, int) else extents.get(d, 17) for d in t.dims]
    if t.type == "int":
        runs = id_runs if id_runs is not None else max(2, shape[-1] // 8)
        x = torch.sort(torch.randint(0, runs, shape, generator=generator), -1).values
    elif t.type == "bool":
        x = torch.rand(shape, generator=generator) > 0.3
    else:
        x = torch.randn(shape, generator=generator) * 0.5
    return x.to(M_DTYPES[t.dtype])


def mod_reference(ms, kw: dict, b, h_q, n_q, n_k):
    """(score mod, mask, sink) of the float64 reference (flashgen.reference.attention_ref)
    for a call with the mods `ms` (flashgen.mods.Mod, in the call's order) and the keyword
    arguments `kw` (their tensors; a param not in `kw` takes its default): the mods'
    expression trees evaluated with torch on the host, in float64. The score mod takes
    scores on any device and returns them there (differentiably); the mask is a bool
    tensor broadcastable to (B, H, Nq, Nk), the sink (B, H) float64, both on the host."""
    from . import mods as M

    env = {}
    for m in ms:
        for t in m.tensors:
            x = kw[t.name].detach().cpu()
            env[t.name] = (x.double() if x.is_floating_point() else
                           x if x.dtype == torch.bool else x.long())
        env.update({p: kw.get(p, default) for p, default in m.params})
    grid = {"b": torch.arange(b)[:, None, None, None], "h": torch.arange(h_q)[None, :, None, None],
            "q_idx": torch.arange(n_q)[:, None], "kv_idx": torch.arange(n_k)[None, :]}
    score = M.combine([m.expr for m in ms if m.kind == "score"])
    masks = [m.expr for m in ms if m.kind == "mask"]
    sink = next((m.expr for m in ms if m.kind == "sink"), None)
    score_mod = None if score is None else (
        lambda s: M.to_torch(score, {**env, **grid, "score": s.cpu()}).to(s.device))
    mask = None
    for e in masks:
        m_ = torch.as_tensor(M.to_torch(e, {**env, **grid}))
        mask = m_ if mask is None else mask & m_
    sink_val = None if sink is None else torch.as_tensor(M.to_torch(sink, {
        **env, "b": torch.arange(b)[:, None], "h": torch.arange(h_q)[None, :]})).double().expand(b, h_q)
    return score_mod, mask, sink_val


M_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
            "int32": torch.int32, "int64": torch.int64, "bool": torch.bool}


def _check_decode(pkg, spec, variant, device, dtype):
    """A ragged, paged KV cache with one query per sequence."""
    from .reference import attention_ref, visible_mask

    b, h_kv, page, pages = 3, 1 if spec.gqa else 2, 16, 6
    h_q, d = 2 * h_kv if spec.gqa else h_kv, variant.head_dim
    k_cache = torch.randn(b * pages, page, h_kv, d, dtype=dtype, device=device)
    v_cache = torch.randn(b * pages, page, h_kv, variant.v_dim, dtype=dtype, device=device)
    table = torch.randperm(b * pages, device=device).view(b, pages).to(torch.int32)
    lengths = [0, 37, page * pages]
    q = torch.randn(b, 1, h_q, d, dtype=dtype, device=device)
    causal, window = variant.mask == "causal", _window(spec, variant)
    out = pkg.flash_attn_with_kvcache(
        q, k_cache, v_cache, cache_seqlens=torch.tensor(lengths, dtype=torch.int32, device=device),
        block_table=table, causal=causal, window_size=window)
    err = 0.0
    for i, n in enumerate(lengths):
        rows = table[i].long().repeat_interleave(page) * page + torch.arange(page * pages, device=device) % page
        kk = k_cache.flatten(0, 1)[rows[:n]][None].transpose(1, 2)
        vv = v_cache.flatten(0, 1)[rows[:n]][None].transpose(1, 2)
        vis = visible_mask(1, n, causal=causal, window=window, bottom_right=True)
        ref, _ = attention_ref(q[i:i + 1].transpose(1, 2), kk, vv, vis)
        err = max(err, _rel_err(out[i:i + 1], ref.transpose(1, 2)))
    return err


def check(spec_path, quick: bool = False, out=sys.stdout, planned: bool = False) -> bool:
    """Compare every variant with the float64 reference. `planned`: launch every kernel
    with the config the package plans for the spec's own GPU (`gpu.sram_bytes`) on the `tl`
    family, whatever GPU runs the check, so an A100's or RTX 4090's tiles can be verified
    on an H100 (without it a CUDA run uses the tiles planned or tuned for this GPU)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = "cuda" if torch.cuda.is_available() else "cpu"

    spec = load_spec(spec_path)
    # (fp8: bf16 inputs that _check_training quantizes)
    dtypes = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32,
              "fp8_e4m3": torch.bfloat16}
    where = "GPU " + torch.cuda.get_device_name() if device == "cuda" else "CPU (Triton interpreter)"
    print(f"checking {spec.package} from {spec_path} on {where}", file=out)
    ok_all = True
    with tempfile.TemporaryDirectory(prefix="flashgen-check-") as tmp:
        build_spec(spec, Path(tmp))
        sys.path.insert(0, tmp)
        try:
            sys.modules.pop(spec.package, None)
            pkg = importlib.import_module(spec.package)
            if planned:
                print("  with the tiles planned for the spec's GPU "
                      f"({spec.gpu.name}, {spec.gpu.sram_bytes} B), tl family", file=out)
            forced = (pkg._runtime.override_config(family="tl") if planned
                      else contextlib.nullcontext())
            forced.__enter__()
            for variant in variants_for(spec):
                dt = dtypes[variant.dtype]
                if variant.kind == "fwd":
                    runs = [(label, _check_training(pkg, spec, variant, label, *shape, device, dt))
                            for label, *shape in _cases(spec, quick)]
                    name = f"{variant.name} (+ bwd)"
                elif variant.kind == "decode":
                    runs = [("paged, ragged", _check_decode(pkg, spec, variant, device, dt))]
                    name = variant.name
                else:  # backward variants are checked through their forward's gradients
                    continue
                for label, err in runs:
                    ok = err <= _TOL[variant.dtype]  # NaN compares False
                    ok_all &= ok
                    print(f"  {'ok  ' if ok else 'FAIL'} {name:<40} {label:<14} "
                          f"max rel err {err:.2e} (tol {_TOL[variant.dtype]:.0e})", file=out)
        finally:
            if planned:
                forced.__exit__(None, None, None)
            sys.path.remove(tmp)
            for name in [m for m in sys.modules if m == spec.package or m.startswith(spec.package + ".")]:
                del sys.modules[name]
    print("all variants match the float64 reference" if ok_all else "some variants FAILED",
          file=out)
    return ok_all
