"""The Gluon forward past d = 256: Q/K 512 (Gemma 4's global layers, issue 47).

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
"""
from __future__ import annotations

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
    if head_dim == D512 and (v_dim or head_dim) == 2 * D512_V:
        return D512_V
    return v_dim


def v_launches(head_dim: int, v_dim: int | None) -> int:
    """Launches of the Gluon forward a call of (head_dim, v_dim) takes: one per D512_V
    columns of V at d = 512, else one."""
    return D512_PAIRS.get((head_dim, v_dim or head_dim), 1)


def d512_reason(kind: str, dropout: bool, head_dim: int, v_dim: int, dtype: str) -> str | None:
    """Why a Q/K 512 variant has no Gluon kernel (None when it has one): the forward only
    (the backward's dK, dV at 512 columns need another split: `tl` runs it), no dropout
    (its keep mask and rounds were not compiled or measured at 32-key blocks), no fp8,
    and the pairs (512, 512) and (512, 256)."""
    pair = f"{head_dim}/{v_dim}"
    if (head_dim, v_dim) not in D512_PAIRS:
        return (f"head dims {pair}: the Q/K 512 Gluon forward serves "
                f"{', '.join(f'{a}/{b}' for a, b in D512_PAIRS)}")
    if kind != "fwd":
        return (f"head dims {pair}: the backward stays `tl` at Q/K 512 (no Gluon backward: "
                "dK and dV at 512 columns exceed a consumer's registers)")
    if dtype not in ("fp16", "bf16"):
        return f"{dtype} at head dims {pair}: the Q/K 512 Gluon forward takes fp16/bf16"
    if dropout:
        return (f"dropout at head dims {pair}: the Q/K 512 Gluon forward draws no keep mask "
                "(not compiled or timed); the `tl` kernel runs it")
    return None


def d512_shared_bytes(block_n: int, num_stages: int, q_buffers: int = 1,
                      consumers: int = 2, v_dim: int = D512_V) -> int:
    """Shared memory of the Q/K 512 forward with O in the Q slots (the module's arithmetic;
    families.shared_bytes computes the same from the general model)."""
    rows = consumers * 64
    return (q_buffers * rows * D512 + num_stages * block_n * (D512 + v_dim)) * 2 + 1024
