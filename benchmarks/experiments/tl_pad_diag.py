"""Where the `tl` forward's output goes wrong on padded rows (d = 96, causal, GQA 4:1):
which input's layout matters, which rows / heads / columns are wrong, which kernel ran."""
import itertools
import os
DEV = os.environ.get("DIAG_DEVICE", "cuda")
import torch
from flashgen.selftest.package import selftest_packages
from flashgen.selftest.kinds import placed

pkg = selftest_packages(DEV, ["selftest"])["selftest"]
pkg._runtime.use_family("tl")
launched = []
orig = pkg._runtime.Launcher.__call__ if hasattr(pkg._runtime, "Launcher") else None
import importlib
lm = importlib.import_module(pkg.__name__ + "._launch")
orig_call = lm.Launcher.__call__
def spy(self, *args):
    launched.append((getattr(self.fn, "__name__", str(self.fn)), self.grid,
                     {k: v for k, v in self.meta.items()}))
    return orig_call(self, *args)
lm.Launcher.__call__ = spy

def ref(q, k, v, causal, window):
    B, N, H, d = q.shape
    Hk = k.shape[2]
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))
    kd = kd.repeat_interleave(H // Hk, 1); vd = vd.repeat_interleave(H // Hk, 1)
    s = qd @ kd.transpose(-1, -2) / d ** 0.5
    i = torch.arange(N, device=q.device)[:, None]; j = torch.arange(k.shape[1], device=q.device)[None]
    vis = torch.ones_like(s[0, 0], dtype=torch.bool)
    if causal: vis &= j <= i
    if window[0] >= 0: vis &= j >= i - window[0]
    s = s.masked_fill(~vis, float("-inf"))
    return (s.softmax(-1) @ vd).transpose(1, 2)

for d, hk, causal, window in ((96, 1, True, (-1, -1)), (96, 1, False, (64, 0)), (80, 1, True, (-1, -1)), (96, 4, True, (-1, -1)), (64, 1, True, (-1, -1))):
    g = torch.Generator().manual_seed(3)
    qv = torch.randn((1, 257, 4, d), generator=g).bfloat16()
    kv = torch.randn((1, 257, hk, d), generator=g).bfloat16()
    vv = torch.randn((1, 257, hk, d), generator=g).bfloat16()
    r = ref(qv.to(DEV), kv.to(DEV), vv.to(DEV), causal, window)
    for lay in itertools.product(("none", "pad", "odd"), repeat=3):
        if len(set(lay) - {"none"}) > 1: continue
        q, k, v = (placed(x, l, DEV) for x, l in zip((qv, kv, vv), lay))
        launched.clear()
        if d == 64:
            continue  # (not in the selftest package)
        out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
        torch.cuda.synchronize() if DEV == "cuda" else None
        err = (out.double() - r).abs()
        bad = err > 0.05
        where = bad.nonzero()
        desc = ""
        if len(where):
            rows = where[:, 1].unique(); heads = where[:, 2].unique(); cols = where[:, 3].unique()
            desc = (f"rows {rows.min().item()}..{rows.max().item()} ({len(rows)}) heads {heads.tolist()} "
                    f"cols {cols.min().item()}..{cols.max().item()} ({len(cols)})")
        print(f"d{d} hk{hk} causal={causal} window={window} q,k,v={lay}: max err {err.max().item():.3g} bad {int(bad.sum())} {desc}")
        print("   launched:", [(n, gr, {k2: v2 for k2, v2 in m.items() if k2 in ('BLOCK_M','BLOCK_N','USE_TMA','num_stages','num_warps','ROW64')}) for n, gr, m in launched][:2], flush=True)
