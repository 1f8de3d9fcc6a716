"""The Gluon kernels past d = 256: Q/K 512 (Gemma 4's global layers, issue 47).

families.py holds the Hopper kernels' tables up to d = 256 (and is near its size limit);
this module holds what changes at Q/K 512 and is imported there. Standard library only,
no imports from families (which imports this at load): its source is copied into every
generated package as `_families_large.py` next to `_families.py`.

One kernel, the existing forward template (templates/gluon/fwd.py.j2) at Q/K 512 and V 256:
  - the (qk 512, v 256) pair runs it directly;
  - d = 512 (V 512) runs it twice, once per 256-column half of V and O (strided views: the
    same strides, a base 512 bytes on), both launches computing the same S, softmax and
    LSE. The runtime's forward does the halves (templates/package/forward.py.j2).

Why the output is split (arithmetic in 2-byte elements, fp32 accumulators; a warpgroup's
[64, n] fp32 accumulator is n / 2 registers of each of its 128 threads):
  - O at 64 rows x 512 is 256 registers a consumer thread, over the 240 a consumer of the
    two-consumer split has (and 255 is the hardware's limit) before S, P and addresses.
  - O at 64 x 256 is 128, as at d = 256: the (512, 256) kernel's consumer holds O 128 +
    S 16 + P 16 = 160 at 32-key blocks (O 128 + S 32 + P 32 = 192 at 64-key blocks).

Shared memory (sm_90: 232,448 bytes a block), two consumers of 64 query rows, O staged in
its consumer's Q slot once the tile's last S = Q K^T is done (families.o_in_q):
  - Q 2 x 64 x 512 x 2 = 128 KiB (two 256-column TMA boxes a consumer: a TMA box is at most
    256 elements a side, families.qk_boxes);
  - a K/V stage is block_n x (512 + 256) x 2 bytes: 48 KiB at 32 keys, 96 KiB at 64.
  - 32-key blocks, 2 stages: 128 + 96 = 224 KiB + 1 KiB barriers = 230,400 bytes (the
    tile, D512_FWD); 64-key blocks fit 1 stage only (the same 230,400): the next K would
    wait for both consumers' whole S = Q K^T, with no second slot to hide the load behind.
  - a third 32-key stage (272 KiB) or a second Q slot does not fit.
  So the 2-deep ring of 32-key blocks keeps d = 256's pipeline (the next block's K and V
  land while this one's products run) at 48 KiB a stage (d = 256: 64).
Compiled for sm_90 (flashgen.gluon_compile, Triton 3.6.0; tests/test_gluon_d512.py, slow):
  128 x 32, 2 stages: 229,736-229,816 bytes of shared memory, no spill in the key loop
  (stack 0-64 bytes outside it) for none / causal / window, dense and packed, with or
  without ping-pong, diag_first, regs 224-240; S = Q K^T two chains of 16
  HGMMA.64x32x16 (SS), P V HGMMA.64x256x16 (RS).
  128 x 64, 1 stage: 480-520 stack bytes, 79 LDL/STL a key block (two 256-column boxes of
  K's descriptors live beside O 128 + S 32 + P 32): rejected, D512_FWD_TILES.
  POLY_EXP2 8 (an eighth of 32 columns is under 2 elements a thread) does not compile:
  D512_POLY_EXP2.

Tensor-core work: a 128-row tile's key block is 128 x n x (512 + 256) x 2 FLOPs a launch.
Two launches run Q K^T twice: 3 x 512 products a (query, key) pair against the 2 x 512 of
one d = 512 attention, 1.5x the useful FLOPs. At the bar of issue 47 (350 TFLOP/s useful,
B=2 H=8 N=4096 causal) the kernel must execute 525 TFLOP/s; the d = 256 kernel runs
594-650 executed (H200, causal, N = 4k-16k; benchmarks/results/nvidia-h200-x4/
bench_training_large_dims.md), and a (512, 256) block moves as many K/V bytes a FLOP
(768 columns of K/V per 1536 FLOPs a query row and key, as d = 256's 512 per 1024), so the
bar asks for ~85% of d = 256's efficiency with half its key block. Plausible, not measured.

The single-launch alternative (both consumers on the same 64 query rows, each owning 256
columns of O; FlashAttention-3's d = 256 backward shape, templates/gluon/bwd_large.py.j2):
it computes S once (no 1.5x), each consumer a partial S over its 256 columns of Q and K
exchanged through shared memory every block (or one consumer's P shared as bwd_large shares
P^T). But a program then owns 64 query rows, not 128: Q 64 KiB, a K/V stage is 64 keys x
1024 columns = 128 KiB (one stage only) or 32 keys = 64 KiB (two stages, 192 KiB with Q),
and every K/V byte feeds half the rows: 64 useful FLOPs a byte against the two-launch
design's 85 (d = 256: 128), more L2 traffic a FLOP than the 128-row tiles sustain, plus a
consumer-to-consumer barrier in every key block's critical path. It also needs a new
kernel (the existing one is verified on the GPU). So the two-launch design is built; the
single-launch kernel is the next step if the GPU shows L2, not the tensor cores, bounds it.

THE BACKWARD (templates/gluon/bwd_d512.py.j2; the default, D512_BWD_ON;
FLASHGEN_GLUON_BWD_512=0 at import sends it to `tl`). H200, B=4 H=4 N=4096, d = 512:
255.2 / 243.3 TFLOP/s (not causal / causal) against `tl`'s 36.1 / 36.2 and SDPA efficient's
37.3 / 30.4 (benchmarks/results/nvidia-h200/bench_training_d512.md); the bar is 250.

Why not d = 256's kernel (templates/gluon/bwd_large.py.j2: both consumers on 64 keys, each
owning half of dK's, dV's and dQ's columns, 64-row Q/dO steps):
  - registers: a consumer would hold dK 256 + dV 256 columns at 64 keys, [64, 256] fp32 =
    128 registers each: 256 a thread, over the 240 of the split (and the 255 of sm_90);
  - so the output columns are split over two launches, as the forward's V halves: launch h
    (COL_HALF) computes the whole S^T = K Q^T (512 deep) and dP^T = V dO^T (V deep), and
    only dK[:, h], dQ[:, h] (256 columns) and dV[:, h] (V / 2): a consumer holds dK 128 +
    dV 128 columns (d = 512) = 64 + 64 registers, as at d = 256;
  - shared memory: S^T and dP^T need K and V at every column, resident for the program's
    64 keys: 2 x 64 x 512 x 2 = 128 KiB; a 64-row Q/dO step at 512 columns is 128 KiB more:
    256 KiB > 232,448 bytes before P^T, dS^T and dQ's staging. Streaming K's or V's other
    half per step instead doubles their bytes per step and still does not fit both steps'
    halves. So a step is 32 query rows: Q + dO 2 x 32 x 512 x 2 = 64 KiB.
At 32-row steps d = 256's split of S^T / dP^T by rows gives each consumer 16 rows: wgmmas
of N = 16, whose A operand (64 x 16 of K or V, 2 KiB) is read from shared memory for 16 x
64 x 16 MACs; shared memory, not the tensor cores, bounds those (below). So the consumers
split a step by product and the gradients by columns:
  consumer 0: S^T = K Q^T        [64 keys, 32 rows]  HGMMA 64x32x16 SS, 32 k-steps
              P^T = exp2(S^T scale log2e - LSE log2e), masked, stored (16-bit) to shared
  consumer 1: dP^T = V dO^T      [64, 32]            HGMMA 64x32x16 SS, V / 16 k-steps
              dS^T = P^T (dP^T - D) scale, P^T read back from shared, stored (16-bit)
  both, consumer c, launch h (128 columns of the launch's 256 each):
              dV[:, V/2 h + V/4 c : +V/4] += P^T dO[:, those]   64 x (V/4) x 32: 64x128x16
              dK[:, 256 h + 128 c : +128] += dS^T Q[:, those]   64 x 128 x 32:  64x128x16
              dQ^T[those 128 columns] = K[:, those]^T dS^T      2 units of 64 x 32 x 64
  dQ = dS K would be a wgmma of M = 32 rows (its minimum is 64): the transposed product
  has M = 64 columns (K^T read transposed from shared memory, which 16-bit wgmma allows),
  N = 32 rows, K = 64 keys; its [64, 32] tile is stored transposed into the [32, 64] fp32
  staging tile that the TMA reduce-add adds into dQ's sum. dK, dV leave from registers
  (plain stores) after the last step: a consumer's dV piece at V = 256 is 64 columns, not
  a TMA box of the 128-column descriptors.
Registers a consumer thread (of 240): dK 64 + dV 64 held (V 256: 64 + 32); a step's S^T or
  dP^T 16 (P^T, dS^T in the same), then dQ^T's two units 2 x 16: 176 at most (V 256: 144).
Shared memory (d512_bwd_shared_bytes; sm_90: 232,448 a block):
  K + V            64 x (512 + V) x 2            131,072 (V 256: 98,304)
  a Q/dO stage     32 x (512 + V) x 2 + 256       65,792 (V 256: 49,408)
  P^T, dS^T        2 x 64 x 32 x 2                  8,192
  dQ staging       2 consumers x slots x 32 x 64 x 4: 16,384 a slot
  barriers                                          1,024
  d = 512: one stage, one slot: 222,464 (compiled: 222,080); two slots 238,848 and a
  second stage 288,256 do not fit. V 256: two stages, one slot: 222,720 (compiled 222,336).
  So at d = 512 the ring is one deep (as d = 256's): the next step's Q and dO load once
  this step's dK and dV products are done with them (the next step's S^T waits on it).
Compiled for sm_90 (flashgen.gluon_compile, Triton 3.6.0; tests/test_gluon_d512.py, slow):
  every mask, both pairs: 168 registers, no stack frame (V 256 one stage: 8 bytes,
  outside the key loop), no LDL/STL in the key loop; HGMMA 64x32x16 and 64x128x16 (V 256
  also 64x64x16), all SS.
FLOPs a (query, key) pair: useful 2 x 5 x 512 = 5,120 (issue 47's 2.5 x the forward's
  4 d); executed 2 launches x 2 x (512 + 512) for S and dP + 2 x 3 x 512 for the gradients
  = 7,168: 7/5 of useful (V 256: 5,632 / 4,096 = 1.375).
Estimate (a shared-memory bandwidth model, 128 bytes a clock an SM; the tensor cores' 4,096
  FLOPs a clock an SM at 989 TFLOP/s, 132 SMs, 1.83 GHz): a d = 512 step (64 keys x 32
  rows, both consumers) reads 288 KiB of wgmma operands (S^T, dP^T 96 KiB each: a
  64x32x16 reads 3 KiB for 16 clocks of math, which takes 24 of shared memory; dK, dV 24
  each; dQ^T 48), TMA writes 64 KiB of Q/dO, dQ staging 32 KiB in and out, P^T/dS^T
  12 KiB: ~430 KiB = ~3,400 clocks against 1,792 of tensor math (7.34 MFLOP executed),
  5.24 MFLOP useful: a bound of ~370 TFLOP/s useful. The same model for d = 256's kernel
  (a 64-row step: 576 KiB, 10.5 MFLOP useful) bounds it at ~550, and it measures 380-410
  on the H200 (0.69-0.75 of the bound): at that efficiency d = 512 would reach ~255-280
  TFLOP/s, causal alike (7x the `tl` kernel; the bar is 250). Measured: 255 / 243 (above).
  Next steps if it falls short: a second Q/dO stage for the half of Q / dO that only S^T /
  dP^T read (released after the first products), or 32-key programs with 64-row steps
  (S = Q K^T M 64 N 32, dK^T / dV^T transposed accumulators: the same bytes a FLOP, twice
  the dQ reduce-add traffic).
"""
from __future__ import annotations

import os

# what families.py re-exports (a star import: one list, in the source and in a package)
__all__ = ["D512", "D512_V", "D512_FWD", "D512_FWD_TILES", "D512_POLY_EXP2", "D512_BWD_ON",
           "D512_BWD_OFF_REASON", "D512_PAGED_REASON", "is_d512", "gluon_v_dim", "v_launches",
           "d512_reason", "is_d512_bwd", "d512_bwd_default", "d512_bwd_boxes",
           "d512_bwd_config_reason"]

# Q/K head dim of this kernel, and the V width one launch computes
D512 = 512
D512_V = 256
# (qk, v) pairs the (512, 256) kernel serves, and how many launches over V's columns each
# takes
D512_PAIRS = {(512, 256): 1, (512, 512): 2}

# The untuned tile (block_m 128 = two 64-row consumers, as GLUON_DEFAULT): see above.
D512_FWD = {"block_n": 32, "num_stages": 2}
# (block_n, num_stages) a tuner or an override may take at Q/K 512 (64 x 1 spills, above)
D512_FWD_TILES = ((32, 2),)
# the POLY_EXP2 fractions a 32-key block compiles with
D512_POLY_EXP2 = (0, 2, 4)


def is_d512(head_dim: int, v_dim: int | None = None) -> bool:
    """Whether (head_dim, v_dim) is served by the Q/K 512 Gluon forward."""
    return (head_dim, v_dim or head_dim) in D512_PAIRS


def gluon_v_dim(head_dim: int, v_dim: int | None) -> int | None:
    """The V (and O) width of the Gluon forward kernel of (head_dim, v_dim): D512_V for the
    d = 512 pair, which runs it over V's halves; v_dim otherwise (None stays None)."""
    return D512_V if v_launches(head_dim, v_dim) > 1 else v_dim


def v_launches(head_dim: int, v_dim: int | None) -> int:
    """Launches of the Gluon forward a call of (head_dim, v_dim) takes: one per D512_V
    columns of V at d = 512, else one."""
    return D512_PAIRS.get((head_dim, v_dim or head_dim), 1)


def d512_reason(kind: str, dropout: bool, head_dim: int, v_dim: int, dtype: str) -> str | None:
    """Why a Q/K 512 variant has no Gluon kernel (None when it has one): the forward and
    the backward (bwd_d512.py.j2, D512_BWD_ON), no dropout (its keep mask and
    rounds were not compiled or measured at these tiles), no fp8, and the pairs (512, 512)
    and (512, 256)."""
    pair = f"{head_dim}/{v_dim}"
    if (head_dim, v_dim) not in D512_PAIRS:
        return (f"head dims {pair}: the Q/K 512 Gluon forward serves "
                f"{', '.join(f'{a}/{b}' for a, b in D512_PAIRS)}")
    if kind not in ("fwd", "bwd"):
        return f"no Gluon {kind} kernel at head dims {pair}"
    what = "forward" if kind == "fwd" else "backward"
    if dtype not in ("fp16", "bf16"):
        return f"{dtype} at head dims {pair}: the Q/K 512 Gluon {what} takes fp16/bf16"
    if dropout:
        return (f"dropout at head dims {pair}: the Q/K 512 Gluon {what} draws no keep mask "
                "(not compiled or timed); the `tl` kernel runs it")
    return None


def d512_shared_bytes(block_n: int, num_stages: int, q_buffers: int = 1,
                      consumers: int = 2, v_dim: int = D512_V) -> int:
    """Shared memory of the Q/K 512 forward with O in the Q slots (the module's arithmetic;
    families.shared_bytes computes the same from the general model)."""
    rows = consumers * 64
    return (q_buffers * rows * D512 + num_stages * block_n * (D512 + v_dim)) * 2 + 1024


# ----------------------------------------------------------------------------------------
# The backward (templates/gluon/bwd_d512.py.j2): the arithmetic is in the docstring above
# ----------------------------------------------------------------------------------------
D512_BWD_ROWS = 32  # query rows a step (BLOCK_M)
D512_BWD_KEYS = 64  # keys a program (BLOCK_N): a wgmma M extent
D512_BWD_BOX = 128  # columns of a Q / K / dO / V TMA box
D512_BWD_DQ_UNIT = 64  # columns of a dQ reduce-add
# the untuned tile of each pair: ring depth and dQ staging tiles a consumer (the largest
# that fit: above)
D512_BWD = {(512, 512): {"num_stages": 1, "dq_slots": 1},
            (512, 256): {"num_stages": 2, "dq_slots": 1}}
# The package routes the Q/K 512 backward to the Gluon kernel (when no tuning says
# otherwise) unless FLASHGEN_GLUON_BWD_512=0 at import (an escape hatch, as for d = 256)
D512_BWD_ON = os.environ.get("FLASHGEN_GLUON_BWD_512", "1") != "0"
D512_BWD_OFF_REASON = "switched off (FLASHGEN_GLUON_BWD_512=0)"
# Why a paged cache or seqused_k at Q/K 512 runs the `tl` varlen forward (the runtime's
# serving rule and describe())
D512_PAGED_REASON = "Q/K 512 over a paged cache or seqused_k: not compiled or verified in Gluon"


def is_d512_bwd(head_dim: int, v_dim: int | None = None) -> bool:
    """Whether (head_dim, v_dim) is served by the Q/K 512 Gluon backward."""
    return (head_dim, v_dim or head_dim) in D512_BWD


def d512_bwd_default(head_dim: int, v_dim: int | None = None) -> dict:
    """The untuned tile's keys of the Q/K 512 backward (over GLUON_BWD_DEFAULT's)."""
    return {"block_m": D512_BWD_ROWS, "block_n": D512_BWD_KEYS,
            **D512_BWD[(head_dim, v_dim or head_dim)]}


def d512_bwd_boxes(block_m: int = D512_BWD_ROWS) -> dict:
    """The TMA boxes of the Q/K 512 backward's descriptors (as families.bwd_boxes): every
    operand in 128-column boxes, dQ's reduce-adds in 64, P^T / dS^T whole [64, 32] tiles."""
    box, keys = D512_BWD_BOX, D512_BWD_KEYS
    return {"Q": [1, 1, block_m, box], "DO": [1, 1, block_m, box], "K": [1, 1, keys, box],
            "V": [1, 1, keys, box], "DQ_ACC": [1, 1, block_m, D512_BWD_DQ_UNIT],
            "LSE": [block_m], "DS": [keys, block_m]}


def d512_bwd_split(v_dim: int = D512) -> dict:
    """The columns of the Q/K 512 backward (its template's constants): Q, K, dO, V in boxes
    of D512_BWD_BOX columns; a consumer owns, in each launch, dK's and dQ's a quarter of 512
    (one Q / K box, dq_units reduce-add units) and dV's v_dim / 4 (within one dO / V box)."""
    box = D512_BWD_BOX
    return {"box": box, "qk_boxes": D512 // box, "v_boxes": v_dim // box,
            "dk_cols": D512 // 4, "dv_cols": v_dim // 4,
            "dq_units": D512 // 4 // D512_BWD_DQ_UNIT}


def d512_bwd_shared_bytes(v_dim: int = D512, num_buffers: int = 1, dq_slots: int = 1,
                          dtype_bytes: int = 2) -> int:
    """Shared memory of the Q/K 512 backward: K and V, the Q/dO ring with LSE and D, P^T
    and dS^T, two consumers' fp32 dQ staging tiles, 1 KiB of barriers."""
    rows, keys, cols = D512_BWD_ROWS, D512_BWD_KEYS, D512 + v_dim
    return (keys * cols * dtype_bytes + num_buffers * (rows * cols * dtype_bytes + 2 * rows * 4)
            + 2 * keys * rows * dtype_bytes + 2 * dq_slots * rows * D512_BWD_DQ_UNIT * 4 + 1024)


def d512_bwd_regs(v_dim: int = D512) -> tuple:
    """(held, peak) fp32 accumulator registers a consumer thread of the Q/K 512 backward:
    dK's 128 and dV's v_dim / 4 columns at 64 keys, then a step's [64, 32] S^T or dP^T and
    dQ^T's two [64, 32] units ([64, n] fp32 over 128 threads: n / 2)."""
    held = (D512 // 4 + v_dim // 4) // 2
    return held, held + D512_BWD_ROWS // 2 + 2 * D512_BWD_ROWS // 2


def d512_bwd_config_reason(config: dict, v_dim: int, sram_bytes: int) -> str | None:
    """Why a launch config of the Q/K 512 backward cannot run (None when it can)."""
    if (config.get("block_m"), config.get("block_n")) != (D512_BWD_ROWS, D512_BWD_KEYS):
        return (f"block_m and block_n must be {D512_BWD_ROWS} and {D512_BWD_KEYS} at head "
                f"dims 512/{v_dim}")
    if config.get("num_warps") != 4:
        return "num_warps must be 4 (one warpgroup per partition)"
    if config.get("num_stages") not in (1, 2) or config.get("dq_slots", 1) not in (1, 2):
        return "num_stages and dq_slots must be 1 or 2"
    need = d512_bwd_shared_bytes(v_dim, config["num_stages"], config.get("dq_slots", 1))
    if need > sram_bytes:
        return f"needs {need} bytes of shared memory, the GPU has {sram_bytes}"
    return None
