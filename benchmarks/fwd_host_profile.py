"""Host time of one flashgen forward through transformers' attention interface at the Llama
step's shape (B=1 N=4096 H=16 d=128 causal bf16, with grad): cProfile of the calls by own
time, beside the wall time per call of flashgen's wrapper and transformers' SDPA path.

    python benchmarks/fwd_host_profile.py [--calls 2000]
"""
import argparse, cProfile, os, pstats, statistics, sys, time, types
import torch
sys.path.insert(0, os.getcwd())
import generated.llama_attn as pkg
from generated.llama_attn import _hf

ap = argparse.ArgumentParser()
ap.add_argument("--calls", type=int, default=2000)
cli = ap.parse_args()
B, N, H, D = 1, 4096, 16, 128
mk = lambda: (torch.randn(B, N, H, D, device="cuda", dtype=torch.bfloat16) * 0.5).requires_grad_()
qt, kt, vt = (mk().transpose(1, 2) for _ in range(3))
module = types.SimpleNamespace(is_causal=True)
scale = D ** -0.5
kwargs = dict(position_ids=None, use_cache=False)
fg = lambda: _hf.attention_forward(module, qt, kt, vt, None, dropout=0.0, scaling=scale, **kwargs)
calls = {"flashgen": fg}
try:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    calls["sdpa"] = lambda: sdpa_attention_forward(module, qt, kt, vt, None, dropout=0.0,
                                                   scaling=scale, **kwargs)
except ImportError:
    pass
for f in calls.values():
    f(); f()
for rnd in range(5):
    for name, f in calls.items():
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(40):
            f()
        t = (time.perf_counter() - t0) / 40 * 1e6
        torch.cuda.synchronize()
        print(f"round {rnd} {name:9s} {t:6.1f} us a call")
prof = cProfile.Profile()
torch.cuda.synchronize()
prof.enable()
for i in range(cli.calls):
    fg()
    if i % 50 == 49:
        torch.cuda.synchronize()
prof.disable()
pstats.Stats(prof).sort_stats("tottime").print_stats(25)
