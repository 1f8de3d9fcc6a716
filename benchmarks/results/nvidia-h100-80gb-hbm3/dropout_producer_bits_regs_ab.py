"""p=0.1 Gluon forward (causal d128 bf16, H=16, B*N=16k) at each register split, and the
p=0 kernel, in this tree; median ms over interleaved rounds."""
import statistics, sys
from pathlib import Path
import torch
ROOT = Path.cwd(); sys.path.insert(0, str(ROOT))
from flashgen.bench_suite import load_package
pkg, _ = load_package(ROOT / "specs/bench/dropout_d128.yaml")
rt = pkg._runtime
H, d = 16, 128
def ms(fn, reps=20):
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in ev:
        a.record(); fn(); b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in ev)
for n in (1024, 4096):
    b = 16384 // n
    q, k, v = (torch.randn(b, n, H, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fl = 4 * b * H * n * n * d / 2
    res = {}
    for rnd in range(3):
        for regs in ("240/24", "232/40", "224/56"):
            for p in (0.0, 0.1):
                with rt.override_config(family="gluon", block_m=128, block_n=128, num_warps=4, num_stages=2, regs=regs):
                    fn = lambda: pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
                    for _ in range(5): fn()
                    res.setdefault((regs, p), []).append(ms(fn))
    for (regs, p), t in res.items():
        print(f"N={n} regs={regs} p={p}: {fl / statistics.median(t) / 1e9:.1f} TFLOP/s")
