"""Control kernels for compute-sanitizer racecheck on warp-specialised Gluon code.

racecheck reports two kinds of hazard on the Gluon kernels: a producer partition's plain
shared-memory store against a consumer partition's load where an mbarrier orders the two,
and a read at the kernel's entry against writes attributed to its `def` line and its
`gl.warp_specialize` call (Triton's own start-up of the partitions). The same tool on the
same machine reports both on the `handover` kernel below, which is race-free by the PTX
memory model (a store, a barrier among the producer's threads, a release arrive; an
acquire wait, the load) and computes the right answer every run: racecheck does not model
mbarrier ordering or the partitions' start-up. `flashgen selftest --sanitize` runs it
under racecheck beside the cases (flashgen/selftest/racecheck.py): a report of the flashgen
kernels counts as explained only when it is of a kind the control shows on that machine,
and a hand-over only when both of its lines are marked `# handover: BARRIER` (the author's
claim, readable next to the code, that BARRIER orders them).

Each MODE is a tiny kernel with one known answer:

  handover  producer (1 warp) st.shared -> thread_barrier -> mbarrier.arrive;
            consumer (4 warps) mbarrier.wait -> ld.shared -> arrive(empty). Race-free by
            the PTX memory model (the flashgen backward's VARLEN LSE / D hand-over).
  nowait    the same, the consumer's wait on `full` removed: a real race.
  noempty   the same, the producer's wait on `empty` removed: a real (write-after-read) race.
  tma       producer TMA load into shared memory (expect-tx), consumer wait -> ld.shared.
  noshared  warp_specialize whose partitions touch only global memory.

Run: python -m flashgen.selftest.control MODE (prints whether the result is right; exit 0
when it is). `nowait` and `noempty` are broken on purpose and may hang or fail: they are
for trying a sanitizer by hand, never run by selftest.
"""
import sys

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

ROWS = 128
STEPS = 64
BUFS = 2


@gluon.jit
def _producer(src_desc, SRC, buf, full, empty, MODE: gl.constexpr, ROWS: gl.constexpr,
              STEPS: gl.constexpr, BUFS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([ROWS // 32], [32], [1], [0])
    rows = gl.arange(0, ROWS, layout=layout)
    for i in range(STEPS):
        s = i % BUFS
        ph = (i // BUFS) & 1
        if MODE != 4:  # noempty skips it
            mbarrier.wait(empty.index(s), ph ^ 1)
        if MODE == 2:  # tma
            mbarrier.expect(full.index(s), ROWS * 4)
            tma.async_copy_global_to_shared(src_desc, [i * ROWS], full.index(s), buf.index(s))
        else:
            vals = gl.load(SRC + i * ROWS + rows)
            buf.index(s).store(vals)  # handover: full
            gl.thread_barrier()
            mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _consumer(OUT, buf, full, empty, MODE: gl.constexpr, ROWS: gl.constexpr,
              STEPS: gl.constexpr, BUFS: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])
    acc = gl.zeros([ROWS], gl.float32, layout)
    for i in range(STEPS):
        s = i % BUFS
        ph = (i // BUFS) & 1
        if MODE != 1:  # nowait skips it
            mbarrier.wait(full.index(s), ph)
        acc += buf.index(s).load(layout)  # handover: full
        gl.thread_barrier()
        mbarrier.arrive(empty.index(s), count=1)
    gl.store(OUT + gl.arange(0, ROWS, layout=layout), acc)


@gluon.jit
def _global_only(OUT, BASE: gl.constexpr, ROWS: gl.constexpr, NW: gl.constexpr):
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    r = gl.arange(0, ROWS, layout=layout)
    gl.store(OUT + BASE + r, r.to(gl.float32))


@gluon.jit
def control_kernel(src_desc, SRC, OUT, MODE: gl.constexpr, ROWS: gl.constexpr,
                   STEPS: gl.constexpr, BUFS: gl.constexpr):
    if MODE == 3:  # noshared
        gl.warp_specialize([
            (_global_only, (OUT, 0, ROWS, 4)),
            (_global_only, (OUT, ROWS, ROWS, 1)),
        ], [1], [24])
    else:
        # the backward's LSE / D slots' layout (a TMA box's, read by plain loads too)
        smem_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=0,
                                                         element_bitwidth=32, rank=1)
        buf = gl.allocate_shared_memory(gl.float32, [BUFS, ROWS], smem_layout)
        bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
        full = gl.allocate_shared_memory(gl.int64, [BUFS, 1], bar_layout)
        empty = gl.allocate_shared_memory(gl.int64, [BUFS, 1], bar_layout)
        for i in gl.static_range(BUFS):
            mbarrier.init(full.index(i), count=1)
            mbarrier.init(empty.index(i), count=1)
        gl.warp_specialize([
            (_consumer, (OUT, buf, full, empty, MODE, ROWS, STEPS, BUFS)),
            (_producer, (src_desc, SRC, buf, full, empty, MODE, ROWS, STEPS, BUFS)),
        ], [1], [24])


MODES = {"handover": 0, "nowait": 1, "tma": 2, "noshared": 3, "noempty": 4}


def main(mode: str) -> int:
    src = torch.arange(ROWS * STEPS, device="cuda", dtype=torch.float32) % 7
    out = torch.full((2 * ROWS,), float("nan"), device="cuda")
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=1)
    desc = TensorDescriptor.from_tensor(src, [ROWS], layout)
    control_kernel[(1,)](desc, src, out, MODES[mode], ROWS, STEPS, BUFS, num_warps=4)
    torch.cuda.synchronize()
    if mode == "noshared":
        want = torch.arange(ROWS, device="cuda", dtype=torch.float32).repeat(2)
    else:
        want = torch.cat([src.view(STEPS, ROWS).sum(0), torch.full((ROWS,), float("nan"),
                                                                   device="cuda")])
        out, want = out[:ROWS], want[:ROWS]
    ok = torch.equal(out, want)
    print(f"{mode}: {'right' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
