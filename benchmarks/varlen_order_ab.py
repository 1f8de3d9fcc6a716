"""Issue 17: A/B of the varlen Gluon schedules on the bench's workload, one
process, arms interleaved round by round. Backward: VARLEN_GLUON_BWD_HEADS 1 (the old
head-major order) vs 4 (the new default) vs 2 and 16. Forward: VARLEN_GLUON_ROUNDS 8 (the
default: two head groups of 8 on the bench) vs 16 (one group) vs 4. Each arm's gradients
/ output are compared with the first arm's (the kernels' math is the same, only the order
differs). Prints medians of the rounds' do_bench medians, TFLOP/s.

    python benchmarks/varlen_order_ab.py [ROUNDS]   (GPU; PYTHONPATH=repo root)"""
import statistics
import sys

import torch
import triton

from flashgen.bench import varlen as bv

pkg = bv._package(128)
rt = pkg._runtime
lengths = bv.ragged_lengths(16, 16384, 128, 4096, 0)
cu = torch.tensor(bv.cu_seqlens(lengths), dtype=torch.int32, device="cuda")
H, D, mx = 16, 128, max(lengths)
torch.manual_seed(0)
q, k, v = (torch.randn(16384, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
           for _ in range(3))
ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 5


def fwd():
    return pkg.flash_attn_varlen_func(q, k, v, cu, cu, mx, mx, causal=True)


def set_arm(kind, value):
    if kind == "bwd":
        rt.VARLEN_GLUON_BWD_HEADS = value
    else:
        rt.VARLEN_GLUON_ROUNDS = value
    rt._forward_plans.clear()
    rt._backward_plans.clear()


def ab(kind, arms):
    flops = bv.document_flops(lengths, H, D, True, kind)
    times = {a: [] for a in arms}
    first = None
    for a in arms:  # warm up / compile, and check each arm against the first
        set_arm(kind, a)
        o = fwd()
        if kind == "bwd":
            torch.manual_seed(1)
            do = torch.randn_like(o)
            for t in (q, k, v):
                t.grad = None
            o.backward(do)
            got = [t.grad.float().clone() for t in (q, k, v)]
        else:
            got = [o.float().clone()]
        if first is None:
            first = got
        err = max((x - y).abs().max().item() for x, y in zip(got, first))
        print(f"{kind} arm {a}: max |diff| vs arm {arms[0]} = {err:.3g}", flush=True)
    for r in range(ROUNDS):
        order = arms if r % 2 == 0 else arms[::-1]
        for a in order:
            set_arm(kind, a)
            o = fwd()
            if kind == "fwd":
                call = fwd
                grads = None
            else:
                do = torch.randn_like(o)
                call = lambda: o.backward(do, retain_graph=True)  # noqa: E731
                grads = [q, k, v]
            call()
            ms = triton.testing.do_bench(call, warmup=10, rep=40, grad_to_none=grads,
                                         return_mode="median")
            times[a].append(ms)
    for a in arms:
        ms = statistics.median(times[a])
        print(f"{kind} {'VARLEN_GLUON_BWD_HEADS' if kind == 'bwd' else 'VARLEN_GLUON_ROUNDS'}"
              f"={a}: {ms:.4f} ms {flops / ms / 1e9:.1f} TFLOP/s  (rounds: "
              f"{', '.join(f'{flops / t / 1e9:.1f}' for t in times[a])})", flush=True)


default_heads, default_rounds = rt.VARLEN_GLUON_BWD_HEADS, rt.VARLEN_GLUON_ROUNDS
ab("bwd", [1, 4, 2, 16])
set_arm("bwd", default_heads)
ab("fwd", [8, 16, 4])
set_arm("fwd", default_rounds)
