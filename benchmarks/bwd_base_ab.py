"""A/B of the backward: the shipped packages (generated/) against an earlier build of them
(BASE: a directory holding that build's llama_attn, gpt2_attn, mods_attn as llama_base,
gpt2_base, mods_base), bf16 TFLOP/s (4 N^2 d H B x 2.5, halved for causal and the mods'
causal cases), 5 interleaved rounds of 20 calls, medians; with the max |difference| of the
gradients between the two and between two calls of the new one.

    git worktree add /tmp/base <commit> && mkdir -p /tmp/basepkgs && for p in llama gpt2 mods; \
        do cp -r /tmp/base/generated/${p}_attn /tmp/basepkgs/${p}_base; done
    BASE=/tmp/basepkgs PYTHONPATH=$PWD python benchmarks/bwd_base_ab.py "causal d128" "document d64"

How the backward's template changes were measured before they merged (docs/PERFORMANCE.md's
backward section lists each with its result and commit). Prints the table; it writes no file."""
import sys, json, os, time
import torch
sys.path.insert(0, os.environ.get("BASE", os.path.join(os.getcwd(), ".scratch/base")))
sys.path.insert(0, os.path.join(os.getcwd(), "generated"))
import llama_attn, llama_base, mods_attn, mods_base, gpt2_attn, gpt2_base
from flashgen.bench import mods as bm

def flops(b, h, n, d, causal):
    f = 4 * b * h * n * n * d * 2.5
    return f / 2 if causal else f

def case_fn(pkg_new, pkg_old, b, h, n, d, causal, mod=None):
    torch.manual_seed(0)
    q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    outs = []
    for pkg in (pkg_new, pkg_old):
        if mod is None:
            out = pkg.scaled_dot_product_attention(q, k, v, is_causal=causal)
        else:
            kw = bm.inputs(mod, b, h, n, "cuda")
            band, mods, _ = bm.MOD_CASES[mod]
            out = pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)
        outs.append(out)
    def run(i):
        q.grad = k.grad = v.grad = None
        outs[i].backward(do, retain_graph=True)
    return run, (q, k, v)

def time_it(fn, iters=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

cases = [
    ("causal d128 (4,16,4k)", llama_attn, llama_base, 4, 16, 4096, 128, True, None),
    ("noncausal d128 (4,16,4k)", llama_attn, llama_base, 4, 16, 4096, 128, False, None),
    ("causal d128 (8,16,2k)", llama_attn, llama_base, 8, 16, 2048, 128, True, None),
    ("causal d128 (1,16,16k)", llama_attn, llama_base, 1, 16, 16384, 128, True, None),
    ("causal d64 (8,32,2k)", gpt2_attn, gpt2_base, 8, 32, 2048, 64, True, None),
    ("noncausal d64 (4,32,4k)", gpt2_attn, gpt2_base, 4, 32, 4096, 64, False, None),
    ("document d128 (4,16,4k)", mods_attn, mods_base, 4, 16, 4096, 128, True, "document"),
    ("prefix_lm d128 (4,16,4k)", mods_attn, mods_base, 4, 16, 4096, 128, True, "prefix_lm"),
    ("window_sinks d128 (4,16,4k)", mods_attn, mods_base, 4, 16, 4096, 128, True, "window_sinks"),
    ("document d64 (4,16,4k)", mods_attn, mods_base, 4, 16, 4096, 64, True, "document"),
]
only = sys.argv[1:]  # case names before " (", e.g. "causal d128": all its shapes
res = {}
for name, pn, po, b, h, n, d, causal, mod in cases:
    if only and name.split(' (')[0] not in only:
        continue
    try:
        run, (q, k, v) = case_fn(pn, po, b, h, n, d, causal, mod)
        grads = []
        for i in (0, 1, 0):
            run(i); torch.cuda.synchronize()
            grads.append([t.grad.float().clone() for t in (q, k, v)])
        diff = [float((a - c).abs().max()) for a, c in zip(grads[0], grads[1])]
        rep = [float((a - c).abs().max()) for a, c in zip(grads[0], grads[2])]
        tn, to = [], []
        for r in range(5):
            tn.append(time_it(lambda: run(0)))
            to.append(time_it(lambda: run(1)))
        tn.sort(); to.sort()
        f = flops(b, h, n, d, causal) / 1e9
        res[name] = dict(new_ms=tn[2], old_ms=to[2], new_tflops=f / tn[2], old_tflops=f / to[2],
                         speedup=to[2] / tn[2], max_diff_new_vs_old=diff, max_diff_new_repeat=rep)
        print(f"{name}: new {f/tn[2]:.1f} old {f/to[2]:.1f} TFLOP/s  x{to[2]/tn[2]:.3f}  diff {['%.3g'%x for x in diff]} rep {['%.3g'%x for x in rep]}", flush=True)
    except Exception as ex:
        print(name, "FAILED", repr(ex)[:500], flush=True)
        res[name] = dict(error=repr(ex)[:500])
out = os.environ.get("OUT", ".")
json.dump(res, open(os.path.join(out, "bwd_base_ab.json"), "w"), indent=1)
