"""Where a short Gluon backward program's time goes: per-program %globaltimer stamps in an
instrumented copy of the document-mask backward (issue 16's document bar).

    PYTHONPATH=$PWD python benchmarks/gluon_bwd_trace.py [--docs 0 16] [--out trace.json]

Copies generated/mods_attn into a temporary folder and text-patches the consumers and the
producer of bwd_causal_document_d128_bf16 there (the shipped kernels carry no stamps) so
that each program writes, into int64 slots past the end of the `doc` tensor it is given
(the trace rides in the same allocation, so no new kernel argument), when each consumer
started, when its K/V wait ended, when its first step's dQ product was done, when its last
step ended, when its dK/dV stores were done, its step count, and when the producer started
and ended, with the SM it ran on. At the mods bench's shape (B=4 H=16 N=4k d=128 bf16,
`--docs 0`: the bench's documents; K > 0: K equal documents a sequence) it prints, over
the programs: the launch gap on an SM (a program's start after the last one's end there),
the K/V wait, the first step, the other steps' mean, the epilogue, and their share of the
SMs' busy time. The patch asserts on the rendered text it expects, so it fails loudly once
the template moves.
"""
import argparse
import importlib
import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANT = "bwd_causal_document_d128_bf16"
SLOTS = 16  # int64 slots a program: consumer c at 6 c + (0..5), producer at 12..15

HELPERS = '''
@gluon.jit
def _now(x):
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _smid(x):
    return gl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r,r", [x], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _stamp(T_doc, T_doc_D0, T_doc_D1, i, v):
    tr = (T_doc + T_doc_D0 * T_doc_D1).to(gl.pointer_type(gl.int64), bitcast=True)
    gl.store(tr + gl.program_id(0) * 16 + i, v.to(gl.int64))


@gluon.jit
def _producer('''

TR = "T_doc, T_doc_D0, T_doc_D1"

PATCHES = [
    # the helpers before the producer
    ("\n@gluon.jit\ndef _producer(", HELPERS),
    # (the producer already takes the doc tensor: it stages the mask's per-query ids)
    # producer start (and its SM)
    ('''    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # VARLEN: a sequence a lane
''', f'''    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])  # VARLEN: a sequence a lane
    pid0 = gl.program_id(0)
    _stamp({TR}, 12, _now(pid0))
    _stamp({TR}, 15, _smid(pid0))
'''),
    # producer end
    ('''            cnt += 1


# ----------------------------------------------------------------------------------------
# The consumers''', f'''            cnt += 1
    _stamp({TR}, 14, _now(pid0))


# ----------------------------------------------------------------------------------------
# The consumers'''),
    # consumer start
    ('''    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
''', f'''    seq_layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    pid0 = gl.program_id(0)
    _stamp({TR}, CID * 6 + 0, _now(pid0))
'''),
    ('''    mbarrier.wait(kv_ready, 0)
''', f'''    mbarrier.wait(kv_ready, 0)
    _stamp({TR}, CID * 6 + 1, _now(pid0))
'''),
    ('''            dq = warpgroup_mma_wait(0, deps=(dq, ))
''', f'''            dq = warpgroup_mma_wait(0, deps=(dq, ))
            if cnt == 0:
                _stamp({TR}, CID * 6 + 2, _now(pid0))
'''),
    ('''    # ------------------------------------------------------------------------------------
    # Epilogue: this warpgroup's rows of dK and dV''', f'''    _stamp({TR}, CID * 6 + 3, _now(pid0))
    _stamp({TR}, CID * 6 + 5, cnt)
    # ------------------------------------------------------------------------------------
    # Epilogue: this warpgroup's rows of dK and dV'''),
    ('''    gl.store(dv_ptrs, dv.to(dtype), mask=out_ok)
    tma.store_wait(0)
''', f'''    gl.store(dv_ptrs, dv.to(dtype), mask=out_ok)
    tma.store_wait(0)
    _stamp({TR}, CID * 6 + 4, _now(pid0))
'''),
]


def _instrumented(tmp: Path):
    dst = tmp / "mods_attn"
    shutil.copytree(ROOT / "generated" / "mods_attn", dst)
    path = dst / "kernels" / "gluon" / f"{VARIANT}.py"
    text = path.read_text()
    for old, new in PATCHES:
        assert text.count(old) == 1, f"the rendered kernel moved: {old[:70]!r}"
        text = text.replace(old, new)
    path.write_text(text)
    sys.path.insert(0, str(tmp))
    return importlib.import_module("mods_attn")


def _doc_ids(b, n, ndocs):
    from flashgen.bench import mods as bm
    if ndocs:
        return (torch.arange(n) * ndocs // n).to(torch.int32).expand(b, n).contiguous()
    return bm.inputs("document", b, 16, n, "cpu")["doc"]


def summarize(tr: torch.Tensor) -> dict:
    """The stamps [programs, 16] as per-program phases and per-SM launch gaps (us)."""
    t0 = tr[:, [0, 6, 12]].min()
    ns = lambda x: (x - t0).double() / 1e3  # noqa: E731
    start = ns(torch.minimum(torch.minimum(tr[:, 0], tr[:, 6]), tr[:, 12]))
    end = ns(torch.maximum(tr[:, 4], tr[:, 10]))
    kv = ns(torch.maximum(tr[:, 1], tr[:, 7])) - start
    first = ns(torch.maximum(tr[:, 2], tr[:, 8])) - ns(torch.maximum(tr[:, 1], tr[:, 7]))
    steps = tr[:, 5].double()
    loop_end = ns(torch.maximum(tr[:, 3], tr[:, 9]))
    rest = (loop_end - ns(torch.maximum(tr[:, 2], tr[:, 8]))) / (steps - 1).clamp(min=1)
    epi = end - loop_end
    sm = tr[:, 15]
    gaps, busy, span = [], 0.0, 0.0
    for s in sm.unique().tolist():
        idx = (sm == s).nonzero().flatten()
        order = idx[start[idx].argsort()]
        st, en = start[order], end[order]
        gaps += (st[1:] - en[:-1]).tolist()
        busy += float((en - st).sum())
        span += float(en.max() - st.min())
    med = lambda x: round(statistics.median(x.tolist() if torch.is_tensor(x) else x), 2)  # noqa
    multi = steps > 1
    return {
        "programs": tr.shape[0], "sms": int(sm.unique().numel()),
        "kernel_us": round(float(end.max()), 1),
        "median_us": {"program": med(end - start), "launch_gap": med(gaps),
                      "kv_wait": med(kv), "first_step": med(first),
                      "later_step": med(rest[multi]) if multi.any() else None,
                      "epilogue": med(epi), "steps": med(steps)},
        "share_of_sm_time": {
            "launch_gaps": round(sum(g for g in gaps if g > 0) / span, 3),
            "kv_wait": round(float(kv.sum()) / span, 3),
            "first_step": round(float(first.sum()) / span, 3),
            "later_steps": round(float((rest * (steps - 1).clamp(min=0)).sum()) / span, 3),
            "epilogue": round(float(epi.sum()) / span, 3),
            "busy": round(busy / span, 3)},
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", nargs="+", type=int, default=[0, 16])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    b, h, n, d = 4, 16, 4096, 128
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        pkg = _instrumented(Path(tmp))
        for nd in args.docs:
            ids = _doc_ids(b, n, nd)
            programs = b * h * (n // 128)
            buf = torch.zeros(b * n + programs * SLOTS * 2 + 8, dtype=torch.int32, device="cuda")
            doc = buf[:b * n].view(b, n)
            doc.copy_(ids.cuda())
            torch.manual_seed(0)
            q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            dout = torch.randn_like(q)
            o = pkg.scaled_dot_product_attention(q, k, v, is_causal=True, mods=("document",),
                                                 doc=doc)
            for _ in range(3):
                o.backward(dout, retain_graph=True)
            torch.cuda.synchronize()
            plans = {p[7] for p in pkg._runtime._backward_plans.values() if p is not None}
            tr = buf[b * n:b * n + programs * SLOTS * 2].view(torch.int64).view(programs, SLOTS)
            res = summarize(tr.cpu())
            res["backward_plans"] = sorted(map(str, plans))
            label = f"docs={nd}" if nd else "bench documents"
            out[label] = res
            print(label, json.dumps(res), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
