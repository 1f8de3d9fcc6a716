"""Where the host time of a transformers-wrapped flashgen call goes (B=1 N=4096 H=16 d=128
causal bf16, grad): each part timed alone, interleaved rounds, median us per call.

    python benchmarks/host_parts.py [--compare generated.llama_attn_head ...]

--compare adds the wrapper's and flash_attn_bhnd's calls of other builds of the package
(a copy of an older generated/llama_attn under another name), timed in the same rounds."""
import argparse, importlib, os, statistics, sys, time, types
import torch
import torch.nn.functional as F
sys.path.insert(0, os.getcwd())
ap = argparse.ArgumentParser()
ap.add_argument("--compare", nargs="*", default=[])
ap.add_argument("--rounds", type=int, default=7)
cli = ap.parse_args()
import generated.llama_attn as pkg
from generated.llama_attn import _hf, _api, _runtime, _ops

B, N, H, D = 1, 4096, 16, 128
dev = "cuda"
def mk(g=True):
    return (torch.randn(B, N, H, D, device=dev, dtype=torch.bfloat16) * 0.5).requires_grad_(g)
q, k, v = mk(), mk(), mk()
qn, kn, vn = mk(False), mk(False), mk(False)
qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
module = types.SimpleNamespace(is_causal=True)
mask, lo, hi = _api._flash_band(N, N, True, None)
scale = D ** -0.5
o = torch.empty_like(qn)
real = _api.flash_attn_bhnd
stub_out = torch.empty_like(q)
def wrapper_stub():
    _hf._api.flash_attn_bhnd = lambda *a, **kw: stub_out
    try:
        return _hf.attention_forward(module, qt, kt, vt, None, dropout=0.0, scaling=scale)
    finally:
        _hf._api.flash_attn_bhnd = real
class Dummy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, args):
        out = torch.empty_like(q)
        ctx.save_for_backward(q, k, v, out)
        return out
    @staticmethod
    def backward(ctx, do):
        return do, do, do, None
parts = {
    "3 transposes": lambda: (qt.transpose(1, 2), kt.transpose(1, 2), vt.transpose(1, 2)),
    "hf wrapper, stub call": wrapper_stub,
    "hf wrapper": lambda: _hf.attention_forward(module, qt, kt, vt, None, dropout=0.0, scaling=scale),
    "flash_attn_bhnd grad": lambda: _api.flash_attn_bhnd(qt, kt, vt, 0.0, scale, True, (-1, -1)),
    "flash_attn_func grad": lambda: pkg.flash_attn_func(q, k, v, 0.0, scale, True, (-1, -1)),
    "flash_attn_func nograd": lambda: pkg.flash_attn_func(qn, kn, vn, 0.0, scale, True, (-1, -1)),
    "runtime.forward": lambda: _runtime.forward(qn, kn, vn, o, mask=mask, lo=lo, hi=hi, scale=scale, bnhd=True, need_lse=False),
    "empty_like + empty lse": lambda: (torch.empty_like(q), torch.empty((B, H, N), device=dev, dtype=torch.float32)),
    "dummy autograd Function": lambda: Dummy.apply(q, k, v, None),
    "sdpa grad (+T+contig)": lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True).transpose(1, 2).contiguous(),
    "sdpa nograd": lambda: F.scaled_dot_product_attention(qn.transpose(1, 2), kn.transpose(1, 2), vn.transpose(1, 2), is_causal=True),
}
try:  # transformers' own SDPA path, what attn_implementation="sdpa" runs per layer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    parts["transformers sdpa_attention_forward grad"] = lambda: sdpa_attention_forward(
        module, qt, kt, vt, None, dropout=0.0, scaling=scale)
except ImportError:
    pass
for name in cli.compare:
    other = importlib.import_module(name)
    parts[f"hf wrapper [{name}]"] = (lambda o: lambda: o._hf.attention_forward(
        module, qt, kt, vt, None, dropout=0.0, scaling=scale))(other)
    parts[f"flash_attn_bhnd grad [{name}]"] = (lambda o: lambda: o._api.flash_attn_bhnd(
        qt, kt, vt, 0.0, scale, True, (-1, -1)))(other)
for f in parts.values():
    f(); f()
torch.cuda.synchronize()
res = {n: [] for n in parts}
for rnd in range(cli.rounds):
    for n, f in parts.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(40):
            r = f()
        res[n].append((time.perf_counter() - t0) / 40 * 1e6)
        del r
        torch.cuda.synchronize()
for n, r in res.items():
    print(f"{n:48s} {statistics.median(r):7.1f} us  (min {min(r):6.1f})")
