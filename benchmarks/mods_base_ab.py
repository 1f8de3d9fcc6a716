"""A/B of the mods package against an earlier build of it: forward and backward ms of the
mods bench's masks (B=4 H=16 N=4k bf16, d=128 and 64), interleaved rounds, medians, with
the outputs and gradients compared.

    git worktree add /tmp/base <commit> && mkdir -p /tmp/basepkgs && \
        cp -r /tmp/base/generated/mods_attn /tmp/basepkgs/mods_base
    BASE=/tmp/basepkgs PYTHONPATH=$PWD python benchmarks/mods_base_ab.py document window_sinks

(twenty-first session: the mod tensors' unit stride, then the backward's per-vector mask
loads; results in benchmarks/results/nvidia-h100-80gb-hbm3/mods_*_ab_session21.json)."""
import sys, os, json
import torch
sys.path.insert(0, os.environ.get("BASE", os.path.join(os.getcwd(), ".scratch/base")))
sys.path.insert(0, os.path.join(os.getcwd(), "generated"))
import mods_attn, mods_base
from flashgen.bench import mods as bm

def time_it(fn, iters=20):
    fn(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(iters):
        fn()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / iters

res = {}
for mod in sys.argv[1:]:
    for d in (128, 64):
        b, h, n = 4, 16, 4096
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        do = torch.randn_like(q)
        kw = bm.inputs(mod, b, h, n, "cuda")
        band, mods, _ = bm.MOD_CASES[mod]
        fwd = [lambda p=p: p.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw) for p in (mods_attn, mods_base)]
        outs = [f() for f in fwd]
        def bwd(i):
            q.grad = k.grad = v.grad = None
            outs[i].backward(do, retain_graph=True)
        g = []
        for i in (0, 1):
            bwd(i); torch.cuda.synchronize(); g.append([t.grad.clone() for t in (q, k, v)])
        diff = [float((a.float() - c.float()).abs().max()) for a, c in zip(*g)]
        fo = float((outs[0].float() - outs[1].float()).abs().max())
        tf = [[], []]; tb = [[], []]
        with torch.no_grad():
            for r in range(5):
                for i in (0, 1):
                    tf[i].append(time_it(fwd[i]))
        for r in range(5):
            for i in (0, 1):
                tb[i].append(time_it(lambda: bwd(i)))
        med = lambda x: sorted(x)[2]
        row = dict(fwd_new=med(tf[0]), fwd_old=med(tf[1]), bwd_new=med(tb[0]), bwd_old=med(tb[1]),
                   fwd_speedup=med(tf[1]) / med(tf[0]), bwd_speedup=med(tb[1]) / med(tb[0]),
                   out_diff=fo, grad_diff=diff)
        res[f"{mod} d{d}"] = row
        print(f"{mod} d{d}: fwd x{row['fwd_speedup']:.3f} ({row['fwd_new']:.3f}/{row['fwd_old']:.3f} ms) bwd x{row['bwd_speedup']:.3f} ({row['bwd_new']:.3f}/{row['bwd_old']:.3f} ms) diffs {fo:.3g} {['%.3g' % x for x in diff]}", flush=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "mods_ab.json"), "w"), indent=1)
