"""The forward kernels of two checkouts side by side: this one's generated llama_attn (d=128)
and gpt2_attn (d=64) packages against those of the checkout at $ALT (packages rebuilt there
first), interleaved do_bench rounds (5, median), bf16, B*N = 16k, H*d = 2048, N = 2k / 4k /
16k, causal and not; prints TFLOP/s, alt / main and the outputs' largest difference. On an
H100, from this checkout's root:

    ALT=/path/to/other/checkout python benchmarks/fwd_tree_ab.py

How a template change to the forward is measured before it merges (the twenty-seventh
session's row-max tree, `results/nvidia-h100-80gb-hbm3/rowmax_tree_ab_session27.*`); with
OUT set, the rows go to $OUT/rowmax_tree_ab_session27.json."""
import importlib, json, os, shutil, statistics, sys, torch, triton
ALT = os.environ["ALT"]
sys.path.insert(0, os.getcwd())
def load(root, pkg, alias):
    dst = f"/tmp/abpkgs/{alias}"
    os.makedirs("/tmp/abpkgs", exist_ok=True)
    if os.path.exists(dst): shutil.rmtree(dst)
    shutil.copytree(os.path.join(root, "generated", pkg), dst)
    if "/tmp/abpkgs" not in sys.path: sys.path.insert(0, "/tmp/abpkgs")
    return importlib.import_module(alias)
rows = []
for pkg, d in (("llama_attn", 128), ("gpt2_attn", 64)):
    A, B_ = load(os.getcwd(), pkg, pkg + "_main"), load(ALT, pkg, pkg + "_alt")
    h = 2048 // d
    for causal in (False, True):
        for n in (2048, 4096, 16384):
            b = 16384 // n
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            oa = A.flash_attn_func(q, k, v, 0.0, None, causal); ob = B_.flash_attn_func(q, k, v, 0.0, None, causal)
            diff = (oa.float() - ob.float()).abs().max().item()
            fl = 4 * b * h * n * n * d / (2 if causal else 1)
            t = {"main": [], "alt": []}
            for _ in range(5):
                for name, P in (("main", A), ("alt", B_)):
                    t[name].append(triton.testing.do_bench(lambda: P.flash_attn_func(q, k, v, 0.0, None, causal), warmup=25, rep=100, return_mode="median"))
            tf = {kk: fl / statistics.median(vv) / 1e9 for kk, vv in t.items()}
            row = dict(d=d, causal=causal, n=n, b=b, h=h, main=tf["main"], alt=tf["alt"], ratio=tf["alt"] / tf["main"], max_diff=diff)
            rows.append(row)
            print(f"d={d} causal={causal!s:5} N={n:5d}: main {tf['main']:6.1f} alt {tf['alt']:6.1f} TFLOP/s  alt/main {tf['alt']/tf['main']:.3f}  max|diff| {diff:.2e}", flush=True)
if os.environ.get("OUT"):
    json.dump(rows, open(os.path.join(os.environ["OUT"], "rowmax_tree_ab_session27.json"), "w"), indent=1)
