"""Where the stream-K forward's time goes on the GPU: per-(program, consumer) %globaltimer
stamps in an instrumented copy of a generated Gluon forward.

    python benchmarks/gluon_stream_k_trace.py [--out trace.json]

Copies generated/llama_attn (d=128) and generated/gpt2_attn (d=64) to generated/tr<d>_*,
text-patches the consumer of fwd_d<d>_bf16 in the copy (the shipped kernels carry no
stamps) so each consumer warpgroup writes, past the stream-K workspace, when it started,
when it reached its first tail item (the end of the round-robin part), when its take-over
began and ended (the wait for the next program's part, the merge, the counter reset), when
its hand-over was done, and when it ended. With stream-K forced on at every length
(STREAM_K_MIN_KEY_BLOCKS = 1) it runs (B, N) = (8, 2k), (4, 4k), (1, 16k) at H d = 2048,
three launches each, and prints per shape the span and the min / median / max over the
consumers (microseconds from the earliest start). The patch asserts on the rendered text
it expects, so it fails loudly once the template moves. It leaves the generated/tr<d>_*
copies behind (untracked): run it on the device machine's copy of the tree.
"""
import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# the stamp helpers, inserted before the consumer
HELPERS = '''
@gluon.jit
def _now(x):
    return gl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [x], dtype=gl.int64,
                                     is_pure=False, pack=1)


@gluon.jit
def _stamp(SK_WS, CID: gl.constexpr, i: gl.constexpr, v):
    P = gl.num_programs(0)
    base = P * NUM_CONSUMERS * (SPLIT_M * (HEAD_DIM_PAD + 2))
    tr = (SK_WS + base).to(gl.pointer_type(gl.int64), bitcast=True)
    gl.store(tr + (gl.program_id(0) * NUM_CONSUMERS + CID) * 8 + i, v)


@gluon.jit
def _consumer('''

# (rendered text, the same with stamps) in the consumer
PATCHES = [
    ('''        n_tiles = _my_tile_count(NUM_TILES, TILE_ORDER, TILE_TABLE)
    if TILE_TABLE:
        TILE_ORDER = _my_tile_list(TILE_ORDER)
    for k in range(0, n_tiles):
''',
     '''        n_tiles = _my_tile_count(NUM_TILES, TILE_ORDER, TILE_TABLE)
    if TILE_TABLE:
        TILE_ORDER = _my_tile_list(TILE_ORDER)
    pid0 = gl.program_id(0)
    _stamp(SK_WS, CID, 0, _now(pid0))
    _stamp(SK_WS, CID, 6, n_tiles.to(gl.int64))
    for k in range(0, n_tiles):
        if k == SK_START // gl.num_programs(0):
            _stamp(SK_WS, CID, 1, _now(pid0))
'''),
    ('''                _sk_hand_over(SK_WS, SK_FLAGS, acc, m_i, l_i, gl.minimum(u_hi, 0), CID, row_s,
                              o_layout)
''',
     '''                _sk_hand_over(SK_WS, SK_FLAGS, acc, m_i, l_i, gl.minimum(u_hi, 0), CID, row_s,
                              o_layout)
                _stamp(SK_WS, CID, 4, _now(pid0))
'''),
    ('''            elif u_hi < n_units:
                acc, m_i, l_i = _sk_take_over(''',
     '''            elif u_hi < n_units:
                _stamp(SK_WS, CID, 2, _now(pid0))
                acc, m_i, l_i = _sk_take_over('''),
    ('''                                              gl.minimum(u_lo, 0), CID, row_s, o_layout)
''',
     '''                                              gl.minimum(u_lo, 0), CID, row_s, o_layout)
                _stamp(SK_WS, CID, 3, _now(pid0))
'''),
]


def _patch(path: Path) -> None:
    s = path.read_text()
    assert s.count("\n@gluon.jit\ndef _consumer(") == 1
    s = s.replace("\n@gluon.jit\ndef _consumer(", HELPERS, 1)
    c0 = s.index("def _consumer(")
    head, body = s[:c0], s[c0:]
    for old, new in PATCHES:
        assert body.count(old) == 1, old
        body = body.replace(old, new)
    # the last stamp: before the consumer's final store_wait
    i = body.rindex("    tma.store_wait(0)\n", 0, body.index("\n@gluon.jit", 10))
    path.write_text(head + body[:i] + "    _stamp(SK_WS, CID, 5, _now(pid0))\n" + body[i:])


def main(argv=None) -> int:
    import importlib
    import shutil
    import statistics

    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None, help="write the summary as JSON here")
    args = ap.parse_args(argv)
    out = {}
    for d, src in ((128, "llama_attn"), (64, "gpt2_attn")):
        dst = ROOT / "generated" / f"tr{d}_{src}"
        if dst.exists(): shutil.rmtree(dst)
        shutil.copytree(ROOT / "generated" / src, dst)
        _patch(dst / "kernels/gluon" / f"fwd_d{d}_bf16.py")
        pkg = importlib.import_module(f"generated.tr{d}_{src}")
        rt = pkg._runtime
        rt._families.STREAM_K_MIN_KEY_BLOCKS = 1
        cache = {}
        def ws(launch, device, dd, rt=rt, cache=cache):
            slots = launch.grid[0] * (launch.meta["BLOCK_M"] // 64)
            floats = slots * 64 * (rt._families.head_dim_pad(dd) + 2)
            if floats not in cache:
                cache[floats] = (torch.zeros(floats + slots * 16, device=device, dtype=torch.float32),
                                 torch.zeros(slots * 32, device=device, dtype=torch.int32))
            return cache[floats]
        rt._sk_workspace = ws
        h = 2048 // d
        for b, n in ((8, 2048), (4, 4096), (1, 16384)):
            q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            base = dict(rt.launch_config(f"fwd_d{d}_bf16", torch.device("cuda"), n))
            with rt.override_config(**{**base, "stream_k": True}):
                for _ in range(5): pkg.flash_attn_func(q, k, v)
                torch.cuda.synchronize()
                runs = []
                for rep in range(3):
                    buf, _ = next(iter(cache.values()))
                    buf.zero_()
                    pkg.flash_attn_func(q, k, v)
                    torch.cuda.synchronize()
                    slots = torch.cuda.get_device_properties(0).multi_processor_count * 2
                    floats = buf.numel() - slots * 16
                    tr = buf[floats:].view(torch.int64).view(slots, 8).cpu()
                    t0 = tr[:, 0].min().item()
                    rel = lambda col: [(x - t0) / 1000.0 for x in tr[:, col].tolist()]
                    start, tail, w0, w1, ho, end = (rel(i) for i in range(6))
                    waits = [b_ - a_ for a_, b_, r in zip(w0, w1, tr[:, 2].tolist()) if r > 0]
                    tails = [x for x, r in zip(tail, tr[:, 1].tolist()) if r > 0]
                    hos = [x - t for x, t, r in zip(ho, tail, tr[:, 4].tolist()) if r > 0]
                    res = dict(span_us=max(end), start_max=max(start),
                               tail_start=(min(tails), statistics.median(tails), max(tails)),
                               end=(min(end), statistics.median(end), max(end)),
                               wait_us=(min(waits), statistics.median(waits), max(waits)) if waits else None,
                               n_wait=len(waits), handover_after_tail_us=(statistics.median(hos), max(hos)) if hos else None,
                               last10_end=sorted(end)[-10:])
                    runs.append(res)
                out[f"d{d} {b}x{n}"] = runs
                r = runs[-1]
                print(f"d{d} {b}x{n}: span {r['span_us']:.1f} us; tail start min/med/max {[round(x,1) for x in r['tail_start']]}; "
                      f"end {[round(x,1) for x in r['end']]}; take-overs (wait + merge) {r['n_wait']} min/med/max {[round(x,2) for x in r['wait_us']] if r['wait_us'] else None}; "
                      f"hand-over at tail+{[round(x,1) for x in r['handover_after_tail_us']] if r['handover_after_tail_us'] else None}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
