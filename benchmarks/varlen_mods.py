"""Packed ragged batches with mods on the GPU: flash_attn_varlen_func(..., mods=...) beside
the same call without mods, the same mods on the `tl` varlen kernels (the Gluon varlen
kernels switched off: _runtime.VARLEN_GLUON_MODS = False), and FlexAttention on the packed
row with a causal document BlockMask and the same score mod (how FlexAttention does
packed sequences).

    PYTHONPATH=$PWD python benchmarks/varlen_mods.py [--docs 16] [--total 16384] [--d 128]
                                                      [--h 16] [--out results.json]

The workload is flashgen.bench.varlen's (16 documents of 128..4096 tokens, 16k tokens,
bf16, causal bottom-right per document). Mods: softcap (cap 30, Gemma 2's score mod),
ALiBi (a per-head slope), and prefix-LM (a mask mod: a document's first quarter seen by
all its rows, the rest causal; no band, block lists per sequence); all run the Gluon
varlen kernels on Hopper (`_tl` rows: VARLEN_GLUON_MODS / VARLEN_GLUON_MASK_MODS off). FLOPs count each
document on its own (bench.varlen.document_flops), so every row's TFLOP/s compare. Every
output is checked against float32 math of the per-document reference on a slice of heads
before it is timed, and in the backward rows its gradients too; times are do_bench
medians (L2 flushed), forward, and the backward of one saved forward.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flashgen.bench.varlen import cu_seqlens, document_flops, ragged_lengths  # noqa: E402
from flashgen.build import build  # noqa: E402

CAP = 30.0


def package(d: int):
    """specs/mods.yaml built into a temporary folder (its own head dims include 64/128)."""
    import importlib
    out = Path(tempfile.mkdtemp(prefix="fg_varlen_mods_"))
    build(ROOT / "specs" / "mods.yaml", out)
    sys.path.insert(0, str(out))
    return importlib.import_module("mods_attn")


def reference(q, k, v, lengths, score, heads=2, mask=None):
    """float32 math of the first `heads` heads, one document at a time: (total, heads, d);
    mask(doc, i, j) replaces the causal mask when given."""
    outs, start = [], 0
    for doc, n in enumerate(lengths):
        qs, ks, vs = (t[start:start + n, :heads].float().transpose(0, 1) for t in (q, k, v))
        s = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
        h = torch.arange(heads, device=q.device)[:, None, None]
        i = torch.arange(n, device=q.device)[:, None]
        j = torch.arange(n, device=q.device)[None, :]
        hide = (j > i) if mask is None else ~mask(doc, i, j)
        s = score(s, h, i, j).masked_fill(hide, float("-inf"))
        outs.append((torch.softmax(s, -1) @ vs).transpose(0, 1))
        start += n
    return torch.cat(outs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--docs", type=int, default=16)
    ap.add_argument("--total", type=int, default=16384)
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    pkg = package(args.d)
    rt = pkg._runtime
    lengths = ragged_lengths(args.docs, args.total, 128, 4096, 0)
    total, h, d = args.total, args.h, args.d
    torch.manual_seed(0)
    q, k, v = (torch.randn(total, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cu = torch.tensor(cu_seqlens(lengths), dtype=torch.int32, device="cuda")
    max_len = max(lengths)
    slope = torch.tensor([2.0 ** (-8 * (i + 1) / h) for i in range(h)], device="cuda")
    doc_ids = torch.repeat_interleave(torch.arange(len(lengths), device="cuda"),
                                      torch.tensor(lengths, device="cuda"))

    def softcap_ref(s, h_, i, j):
        return CAP * torch.tanh(s / CAP)

    def alibi_ref(s, h_, i, j):
        return s - slope[h_] * (i - j).abs()

    prefix = torch.tensor([n // 4 for n in lengths], dtype=torch.int32, device="cuda")

    def prefix_ref(doc, i, j):
        return (j < int(prefix[doc])) | (j <= i)

    def flashgen(mods, kw, causal=True):
        def call(q_, k_, v_):
            return pkg.flash_attn_varlen_func(q_, k_, v_, cu, cu, max_len, max_len,
                                              causal=causal, mods=mods, **kw)
        return call

    providers = {
        "flashgen_varlen_nomods": (flashgen(None, {}), None),
        "flashgen_varlen_softcap": (flashgen(("softcap",), {"cap": CAP}), softcap_ref),
        "flashgen_varlen_softcap_tl": (flashgen(("softcap",), {"cap": CAP}), softcap_ref),
        "flashgen_varlen_alibi": (flashgen(("alibi",), {"slope": slope}), alibi_ref),
        "flashgen_varlen_alibi_tl": (flashgen(("alibi",), {"slope": slope}), alibi_ref),
        "flashgen_varlen_prefix_lm": (flashgen(("prefix_lm",), {"prefix_len": prefix}, False),
                                      (lambda s, h_, i, j: s), prefix_ref),
        "flashgen_varlen_prefix_lm_tl": (flashgen(("prefix_lm",), {"prefix_len": prefix}, False),
                                         (lambda s, h_, i, j: s), prefix_ref),
    }
    providers = {k: (v if len(v) == 3 else (*v, None)) for k, v in providers.items()}
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        def doc_causal(b_, h_, qi, ki):
            return (doc_ids[qi] == doc_ids[ki]) & (qi >= ki)
        block_mask = create_block_mask(doc_causal, B=None, H=None, Q_LEN=total, KV_LEN=total,
                                       device="cuda")
        flex = torch.compile(flex_attention, dynamic=False)

        def flex_softcap(score, b_, h_, qi, ki):
            return CAP * torch.tanh(score / CAP)

        def flex_alibi(score, b_, h_, qi, ki):
            # in-document positions: the documents' starts cancel in qi - ki
            return score - slope[h_] * (qi - ki).abs()

        def flex_call(mod):
            def call(q_, k_, v_):
                o = flex(q_.transpose(0, 1)[None], k_.transpose(0, 1)[None],
                         v_.transpose(0, 1)[None], score_mod=mod, block_mask=block_mask)
                return o[0].transpose(0, 1)
            return call
        providers["flex_document_softcap"] = (flex_call(flex_softcap), softcap_ref, None)
        providers["flex_document_alibi"] = (flex_call(flex_alibi), alibi_ref, None)
        starts = torch.tensor(cu_seqlens(lengths)[:-1], device="cuda")

        def doc_prefix(b_, h_, qi, ki):
            same = doc_ids[qi] == doc_ids[ki]
            return same & ((ki - starts[doc_ids[ki]] < prefix[doc_ids[ki]]) | (qi >= ki))
        prefix_mask = create_block_mask(doc_prefix, B=None, H=None, Q_LEN=total, KV_LEN=total,
                                        device="cuda")

        def flex_prefix(q_, k_, v_):
            o = flex(q_.transpose(0, 1)[None], k_.transpose(0, 1)[None],
                     v_.transpose(0, 1)[None], block_mask=prefix_mask)
            return o[0].transpose(0, 1)
        providers["flex_document_prefix_lm"] = (flex_prefix, (lambda s, h_, i, j: s), prefix_ref)
    except ImportError:
        pass

    rows = []
    for mode in ("fwd", "bwd"):
        for name, (fn, score, mask) in providers.items():
            # prefix-LM: the visible pairs (a quarter of each document seen whole, the rest
            # causal), counted as the causal FLOPs plus the prefix's upper triangle
            flops = document_flops(lengths, h, d, True, mode)
            if "prefix" in name:
                extra = sum((n // 4) * (n // 4 - 1) / 2 for n in lengths)
                per_pair = document_flops([2], h, d, False, mode) / 4
                flops += extra * per_pair
            rt.VARLEN_GLUON_MODS = not name.endswith("_tl")
            rt.VARLEN_GLUON_MASK_MODS = not name.endswith("_tl")
            rt._forward_plans.clear()
            rt._backward_plans.clear()
            row = {"mode": mode, "provider": name, "docs": args.docs, "total": total, "h": h,
                   "d": d, "gpu": torch.cuda.get_device_name(), "status": "ok"}
            try:
                if score is not None and mode == "fwd":
                    want = reference(q, k, v, lengths, score, mask=mask)
                    err = (fn(q, k, v)[:, :2].float() - want).abs().max().item()
                    if not err <= 3e-2:
                        raise RuntimeError(f"max |out - reference| = {err:.3g}")
                    row["max_err"] = round(err, 5)
                grads = None
                if mode == "fwd":
                    call = lambda: fn(q, k, v)  # noqa: E731
                else:
                    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
                    o = fn(qg, kg, vg)
                    do = torch.randn_like(o)
                    call = lambda: o.backward(do, retain_graph=True)  # noqa: E731
                    grads = [qg, kg, vg]
                    if score is not None:  # the gradients of two heads against float32 math
                        call()
                        leaves = [t[:, :2].detach().float().requires_grad_() for t in (q, k, v)]
                        ref = reference(*leaves, lengths, score, mask=mask)
                        want = torch.autograd.grad(ref, leaves, do[:, :2].float())
                        err = max(float((t.grad[:, :2].float() - w).abs().max() / max(1.0, float(w.abs().max())))
                                  for t, w in zip(grads, want))
                        if not err <= 5e-2:
                            raise RuntimeError(f"max |grad - reference| = {err:.3g} (relative)")
                        row["max_grad_err"] = round(err, 5)
                ms = triton.testing.do_bench(call, warmup=25, rep=100, grad_to_none=grads,
                                             return_mode="median")
                row["ms"] = round(ms, 4)
                row["tflops"] = round(flops / (ms * 1e-3) / 1e12, 1)
                if name.startswith("flashgen"):  # which family ran
                    fam = [p[2] for p in rt._forward_plans.values() if p[0] is not None]
                    row["gluon_fwd"] = bool(fam) and fam[0] == rt._GLUON
                    if mode == "bwd":
                        fam = [p[-1] for p in rt._backward_plans.values() if p is not None]
                        row["gluon_bwd"] = bool(fam) and fam[0] == rt._GLUON
            except Exception as e:  # reported, not fatal
                row["status"] = f"error: {type(e).__name__}: {str(e)[:160]}"
            print(json.dumps(row), flush=True)
            rows.append(row)
    rt.VARLEN_GLUON_MODS = True
    rt.VARLEN_GLUON_MASK_MODS = True
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
