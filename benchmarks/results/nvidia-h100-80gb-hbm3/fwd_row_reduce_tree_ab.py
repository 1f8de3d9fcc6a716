"""A/B: HEAD's Gluon forward vs tree-reduced row max (tmax) and max+sum (tree), with cuDNN,
interleaved per round, SDPA layout (B, H, N, d), bf16, H*d = 2048."""
import importlib, json, os, statistics, sys
import torch, triton
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
root = os.path.dirname(os.path.abspath(__file__))
for arm in ("old", "tree", "tmax"):
    sys.path.insert(0, os.path.join(root, "arms", arm))
ARMS = {a: {64: importlib.import_module(f"gpt2_attn_{a}"), 128: importlib.import_module(f"llama_attn_{a}")}
        for a in ("old", "tmax", "tree")}
SHAPES = [(64, False, 8, 2048), (64, False, 4, 4096), (64, False, 1, 16384), (64, True, 8, 2048),
          (128, False, 8, 2048), (128, False, 4, 4096), (128, True, 8, 2048), (128, True, 4, 4096)]
ROUNDS = int(os.environ.get("ROUNDS", 6))
rows = []
for d, causal, b, n in SHAPES:
    h = 2048 // d
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    fns = {a: (lambda p=ARMS[a][d]: p.scaled_dot_product_attention(q, k, v, is_causal=causal)) for a in ARMS}
    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    fns["cudnn"] = cudnn
    ref = cudnn().float()
    err = {a: (fns[a]().float() - ref).abs().max().item() for a in ARMS}
    t = {a: [] for a in fns}
    for r in range(ROUNDS):
        order = list(fns) if r % 2 == 0 else list(fns)[::-1]
        for a in order:
            t[a].append(triton.testing.do_bench(fns[a], warmup=10, rep=60))
    fl = 4 * b * h * n * n * d / (2 if causal else 1)
    row = {"d": d, "causal": causal, "B": b, "N": n, "maxerr_vs_cudnn": err,
           **{a: round(fl / statistics.median(x) / 1e9, 1) for a, x in t.items()},
           "spread": {a: round((max(x) - min(x)) / statistics.median(x), 3) for a, x in t.items()}}
    for a in ARMS:
        row[f"{a}/cudnn"] = round(row[a] / row["cudnn"], 3)
    row["tree/old"] = round(row["tree"] / row["old"], 3)
    row["tmax/old"] = round(row["tmax"] / row["old"], 3)
    rows.append(row); print(json.dumps(row), flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "ab_tree.json"), "w"), indent=1)
