"""The dropout bench package's causal d128 forward at p=0.1 and p=0 (B=4 N=4096 H=16 bf16),
two calls each, for Nsight Compute to profile the second launch of each kernel. On an H100:

    python benchmarks/ncu_dropout_fwd.py      # compile first, outside the profiler
    ncu -k regex:fwd_causal --launch-skip 1 --launch-count 2 \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python benchmarks/ncu_dropout_fwd.py

(`--section SourceCounters -o FILE` then `ncu -i FILE.ncu-rep --page source --csv
--print-source sass` gives the stall samples by SASS instruction.) docs/PERF_NOTES.md,
twenty-seventh session, reads them."""
import sys, os, torch
sys.path.insert(0, os.getcwd())
from pathlib import Path
from flashgen.bench.providers import load_package
pkg, _ = load_package(Path("specs/bench/dropout_d128.yaml"))
b, n, h, d = 4, 4096, 16, 128
q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
for p in (0.1, 0.0):
    for _ in range(2):
        pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
torch.cuda.synchronize()
print("done")
