# python benchmarks/flush_experiment.py (H100: benchmarks/results/H100_flush_experiment.log)
"""How much of a memory-bound kernel's time is do_bench's L2 flush (a 256 MB zero_ that
leaves up to 50 MB of dirty lines to write back during the timed kernel)?"""
import sys, json, torch, statistics
sys.path.insert(0, "generated")
import llama_attn as pkg
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
B, HQ, HKV, D = 8, 32, 8, 128
dirty = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
clean = torch.empty(256 << 20, dtype=torch.int8, device="cuda")
def flush_dirty(): dirty.zero_()
def flush_clean(): clean.sum(dtype=torch.int32)  # reads evict; no dirty lines left behind
def flush_both(): dirty.zero_(); clean.sum(dtype=torch.int32)
def timeit(fn, flush, reps=100):
    fn(); torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for s, e in ev:
        if flush: flush()
        s.record(); fn(); e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in ev)
for n in (4096, 16384, 65536):
    kc = torch.randn(B, n, HKV, D, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(B, 1, HQ, D, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((B,), n, dtype=torch.int32, device="cuda")
    nbytes = (2 * B * n * HKV * D + 2 * B * HQ * D) * 2
    qt, kt, vt = q.transpose(1, 2), kc.transpose(1, 2), vc.transpose(1, 2)
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(qt, kt, vt, enable_gqa=True)
    fns = {"flashgen": lambda: pkg.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lens),
           "sdpa_cudnn": cudnn, "copy_K": lambda: kc.clone()}
    for name, fn in fns.items():
        row = {"n": n, "provider": name}
        for fl_name, fl in (("dirty_zero", flush_dirty), ("clean_read", flush_clean),
                            ("zero_then_read", flush_both), ("none", None)):
            ms = timeit(fn, fl)
            b = nbytes if name != "copy_K" else 2 * kc.numel() * 2
            row[fl_name] = f"{ms:.4f} ms {b / ms / 1e6:.0f} GB/s"
        print(json.dumps(row), flush=True)
