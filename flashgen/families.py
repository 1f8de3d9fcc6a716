"""Kernel families: the same variant, written for different hardware.

Every variant has a `tl` kernel (``templates/<kind>.py.j2``, `triton.language`): it runs on
any GPU Triton supports and in Triton's interpreter. Some variants also get a `gluon`
kernel (``templates/gluon/<kind>.py.j2``): the FlashAttention-3 schedule for Hopper
(warp-specialised TMA producer, ping-pong wgmma consumers, persistent grid), written in
Triton's lower-level Gluon dialect. Both carry the variant's canonical name
(``kernels/<name>.py`` and ``kernels/gluon/<name>.py``); which one a call runs is part of
its launch config (``family``), so tuning may pick either.

This module says which variants have a Gluon kernel and why the others do not; the
package's runtime repeats the device-side checks (GPU, Triton version, strides) on every
call signature and falls back to `tl` when one fails. Standard library only: its source
is copied into every generated package next to the planner.
"""
from __future__ import annotations

import os

# Q/K 512 (issue 47): its names (families_large.__all__) are this module's too; a generated
# package holds that module as `_families_large`
try:
    from .families_large import *  # noqa: F401,F403
except ImportError:
    from ._families_large import *  # noqa: F401,F403

# Triton versions the Gluon templates were compiled and run on. Gluon's API changes between
# releases (warp_specialize's signature did in 3.5 -> 3.6), so any other version takes the
# `tl` kernels rather than risk a compile error at the first call.
GLUON_TRITON = ("3.6",)

# compute capabilities the Gluon kernels are written for: wgmma, setmaxnreg and TMA are
# sm_90(a) instructions, and Blackwell (sm_100) has different tensor-core instructions
GLUON_CAPABILITIES = ((9, 0),)

# head dims with a Gluon kernel (Q, K and V alike); 96 is padded to 128 inside the tiles
# (TMA zero-fills the extra columns): 33% more tensor-core work, still faster than the `tl`
# kernel at 96. 256 (Gemma 2/3) has its own tiles: LARGE_HEAD_DIM_FWD below.
GLUON_HEAD_DIMS = (64, 96, 128, 256)
# (Q/K, V) pairs beside them: DeepSeek-style MLA prefill and training (qk 192 = 128 + 64
# rotary, v 128), LARGE_HEAD_DIM_FWD too
GLUON_SPLIT_HEAD_DIMS = ((192, 128),)
# The head dims of the backward's Gluon kernel (templates/gluon/bwd.py.j2). A consumer owns
# 64 keys and holds their dK and dV in fp32 registers, (d_qk + d_v) / 2 a thread over its
# 128 threads -- 256 at d = 256, 160 at qk 192 / v 128 -- beside S^T and dP^T (32 each at
# 64-row steps) and its share of dQ (48-64): over the 240 a consumer has either way. The
# large head dims split the work another way, in a kernel of their own: LARGE_HEAD_DIM_BWD.
GLUON_BWD_HEAD_DIMS = (64, 96, 128)
# shared memory one block may use on sm_90 (227 KiB), which every Gluon kernel is for
GLUON_SHARED_BYTES = 232448

QUERY_ROWS_PER_CONSUMER = 64  # one wgmma M extent per warpgroup
# Consumer warpgroups of the backward, and of the forward unless said otherwise below
CONSUMERS = 2
# The forward may also run three consumers (192-row tiles, FlashAttention-3's shape at head
# dims <= 64), at 160 registers each: three 4-warp consumers and the 1-warp producer, which
# Gluon's partitioning budgets as a warpgroup, are 3 x 128 x 160 + 128 x 24 of the 64K
# registers. Compiled for sm_90 (gluon_compile) that fits with no spill in the key loop once
# P leaves fp32 early (the template's EARLY_P); at 168 the first consumer, which gets what
# the workers leave, spilled and ptxas serialised its wgmmas (C7512). On the H100
# (benchmarks/fwd_arms_ab.py, H=32 B*N=16k bf16, vs two consumers; docs/PERFORMANCE.md,
# Forward): non-causal 2k / 4k / 16k +3.1 / +8.0 / +10.7% with ping-pong (+1.9 / +5.0 / +6.1%
# without), causal -6.8 / -3.8 / +9.9%. Not with dropout or mods (not compiled or measured
# there: the Philox words and the mods' values need registers the split does not have).
THREE_CONSUMERS_MAX_HEAD_DIM = 64
THREE_CONSUMER_REGS = ("160/24",)
# The masks whose untuned d <= 64 forward (no dropout, no mods) takes three consumers, and
# from which length bucket up (None: every length). Causal joined once its 192-row kernel
# compiled without key-loop spills (a block on the diagonal masked by one compare an
# element against a bound a row, the template's ROW_BOUND: 0 stack bytes, 0 LDL/STL, was
# 136 / 12); a 192-row causal tile computes 11% / 9% / 2% more scores than a 128-row one at
# N = 2k / 4k / 16k, so it pays from 4k: H100, benchmarks/fwd_arms_ab.py (bf16, H=32,
# B*N=16k, 3 interleaved rounds), 192 rows with ping-pong against the package's tuned
# two-consumer tiles (192 rows, spilling, at 16k) 385.1 / 387.9 at 2k (0.993x), 433.1 /
# 418.2 at 4k (1.036x), 510.6 / 481.1 at 16k (1.061x); cuDNN 389.8 / 421.4 / 438.9
# (58df8b3; docs/PERFORMANCE.md, Forward).
THREE_CONSUMER_DEFAULT_MASKS = {"none": None, "causal": 4096}


def fwd_consumer_counts(head_dim: int, extras: bool = False) -> tuple:
    """The consumer counts a forward kernel is rendered for, the larger first (extras:
    dropout or mods, which keep two)."""
    return (3, 2) if head_dim <= THREE_CONSUMERS_MAX_HEAD_DIM and not extras else (2,)

# What an untuned Gluon launch uses, measured on the H100 (docs/PERFORMANCE.md, Forward):
# 128 x 128 tiles, a 2-deep K/V ring, ping-pong consumers at 240 registers, the producer
# at 24 (FA3's split), and L2 groups of heads sized to a quarter of L2. Three knobs are off
# until the H100 says otherwise (benchmarks/gluon_overlap_ab.py). At the persistent walk's
# tile boundary, `q_buffers` 2 gives each consumer a second Q slot, so
# a tile's Q is loaded while the tile before it still runs (32 KiB more shared memory at
# d=128) instead of after its last S = Q K^T; `overlap` runs a tile's stores (its LSE, its
# O through TMA) behind the next tile's first S = Q K^T. `diag_first` walks a tile's key
# blocks from the last down, so a causal tile starts on its masked diagonal block. Measured
# side by side against the H100 package's tuned configs (B*N = 16k, H*d = 2048, N = 2k,
# 4k, 16k; docs/PERFORMANCE.md, Forward; the raw log in fa30682):
# q_buffers=2 +0..2% at d=128 non-causal, -4% at d=64 causal; overlap -5..+2%;
# diag_first +6.4..6.6% at d=64 non-causal on all three shapes, -1..-10% elsewhere. So the
# d=64 non-causal forward defaults to diag_first (gluon_default) and all three are tuner
# knobs (space.py).
GLUON_DEFAULT = {
    "family": "gluon",
    "block_m": CONSUMERS * QUERY_ROWS_PER_CONSUMER,
    "block_n": 128,
    "num_warps": 4,
    "num_stages": 2,
    "pingpong": True,
    "l2_share": 4,
    "persistent": True,
    "regs": "240/24",
    "q_buffers": 1,
    "overlap": False,
    "diag_first": False,
    # deal the last rounds of an even (unmasked) forward by key block: see stream_k_start
    "stream_k": True,
    # 1 / poly_exp2 of each block's exponentials on the FMA units (0: all on MUFU)
    "poly_exp2": 0,
}
CONSUMER_REGS = 240  # the default split, "consumer/producer" registers per thread
PRODUCER_REGS = 24
# register splits the tuner may try: two consumer warpgroups and the producer's warpgroup
# share 64K registers (2 x 128 x consumer + 128 x producer <= 65536), in steps of 8
REG_SPLITS = ("240/24", "232/40", "224/56")


def regs(config: dict) -> tuple[int, int]:
    """(consumer, producer) registers per thread of a Gluon config."""
    c, p = str(config.get("regs", f"{CONSUMER_REGS}/{PRODUCER_REGS}")).split("/")
    return int(c), int(p)


# Which Gluon kernels replace the `tl` ones by default on Hopper (untuned, or tuned before
# the `family` knob): those whose current form has run on the H100 and beaten `tl` there.
#  - the forward without dropout (docs/PERFORMANCE.md, Forward);
#  - the backward at d >= 96 (d=96 runs the d=128 tiles), and at d=64 from N = 2048 up
#    (GLUON_BWD_SMALL_D_MIN_N): bf16 d=128, B*N = 16k, H=16,
#    457 / 365 / 519 TFLOP/s at 4k non-causal / 4k causal / 16k non-causal against 366 /
#    288 / 410 for the `tl` backward in the same run (a8067fc); d=64 below at
#    GLUON_BWD_SMALL_D_MIN_N;
#  - the dropout forward at d = 128, and at d = 64 from N = GLUON_DROPOUT_FWD_SMALL_D_MIN_N
#    (GLUON_DROPOUT_FWD_DIMS): forced onto each family side by side (causal bf16 p=0.1,
#    Philox-7, the mask on packed pairs; f0f9712, 86ff347; docs/PERFORMANCE.md, Dropout),
#    Gluon / `tl` TFLOP/s, H=16 B*N=16k at N = 1k / 4k: d=128 333.0 / 231.6 and 423.7 /
#    308.6, d=64 200.6 / 190.0 and 280.9 / 259.0; d=64 at GPT-2 small's H=12 B*N=8k,
#    N = 512 / 1k / 2k: 110.0 / 128.3, 173.9 / 173.5, 216.9 / 209.5. d = 96 (the d = 128
#    tiles, padded) has not been timed with dropout and stays on `tl`;
#  - the dropout backward by the rule of the backward without dropout (d >= 96; d=64 from
#    GLUON_BWD_SMALL_D_MIN_N): its keep mask is drawn while the step's first two products
#    run, and the `tl` dropout backward it replaces ran at 0.63x cuDNN's on the H100 (bf16
#    causal d=128 p=0.1, N=4k: 204 TFLOP/s against ~365 for the Gluon p=0 backward,
#    502cfb0; measured since: docs/PERFORMANCE.md, Dropout);
#  - a kernel with mods only where every kind of mod it has is in
#    GLUON_MOD_KINDS_BY_DEFAULT[its kind].
# Any other Gluon kernel runs when a tuned entry names it, or with FLASHGEN_FAMILY=gluon.
#
# The switch for the kernels with mods, per kernel kind: a Gluon kernel of that kind whose
# mods are all of the listed kinds is the Hopper default (untuned, or tuned without
# `family`), as the plain kernels are. All three kinds of mod -- score mods, sinks and mask
# mods with block sparsity -- ran right on the H100 in both kernels and faster than `tl`
# at every mod of the mods bench (bf16 d=128 B=4 N=4096, TFLOP/s, Gluon vs `tl`): forward
# softcap 361.5 vs 212.1, alibi 376.5 vs 332.6, document 741.0 vs 626.1, prefix_lm 955.5 vs
# 542.5, window+sinks 821.7 vs 563.2; backward 276.2 / 346.5 / 517.7 / 668.0 / 459.8 vs
# 169.0 / 240.8 / 449.3 / 370.8 / 361.9 (44e95cb; the raw rows in 93ef72b).
GLUON_MOD_KINDS_BY_DEFAULT = {"fwd": frozenset({"score", "sink", "mask"}),
                              "bwd": frozenset({"score", "sink", "mask"})}


# The backward at d <= 64 goes Gluon from this length bucket up (bf16, H=32, B*N = 16k on the
# H100, TFLOP/s, Gluon with 128-row steps vs the `tl` backward's tuned tiles, one backward
# a CUDA event pair, interleaved): with the kernel's descriptors made on the device,
# non-causal 266.8 / 330.2 / 404.2 vs 264.1 / 307.6 / 346.5 at N = 2k / 4k / 16k, causal
# 182.1 / 260.3 / 376.4 vs 174.2 / 234.7 / 306.4, and `tl` ahead below 2k; with host-made
# descriptors, N = 512 non-causal 163.9 / 163.8 vs 146.3 / 163.2 and causal 91.0 / 99.5 vs
# 80.1 / 86.3, N = 1k non-causal 225.2 / 223.0 vs 214.3 / 214.9 and causal 149.6 / 139.7
# vs 153.6 / 132.9 (two rounds each; docs/PERFORMANCE.md, Backward). Shorter calls
# were not measured and keep `tl` (as do calls under GLUON_MIN_FLOPS).
GLUON_BWD_SMALL_D_MIN_N = 512
# the head dims whose dropout forward goes Gluon by default (see above), at d <= 64 from
# this length bucket up
GLUON_DROPOUT_FWD_DIMS = (64, 128)
GLUON_DROPOUT_FWD_SMALL_D_MIN_N = 1024


def gluon_by_default(kind: str, dropout: bool, head_dim: int, mod_kinds=(),
                     n: int | None = None, dtype: str = "", fp8_on: bool | None = None) -> bool:
    """Whether the Gluon kernel of a variant replaces the `tl` one by default on Hopper, for
    calls of length bucket n (None: the variant as a whole, where a length rule counts as
    not by default). An fp8 variant's (dtype) when fp8_on (the runtime's FP8_GLUON,
    FLASHGEN_FP8_GLUON; None: GLUON_FP8_BY_DEFAULT)."""
    if dtype.startswith("fp8") and not (GLUON_FP8_BY_DEFAULT if fp8_on is None else fp8_on):
        return False
    if dropout and kind == "fwd" and (head_dim not in GLUON_DROPOUT_FWD_DIMS or mod_kinds):
        return False  # (with mods as well: not measured, so `tl`)
    if mod_kinds and not set(mod_kinds) <= GLUON_MOD_KINDS_BY_DEFAULT.get(kind, frozenset()):
        return False
    if kind == "bwd" and head_dim in LARGE_BWD_QK_DIMS | {D512}:  # (LARGE_HEAD_DIM_BWD, D512_BWD_ON)
        return GLUON_BWD_LARGE_DEFAULT if head_dim != D512 else D512_BWD_ON
    min_n = gluon_min_n(kind, dropout, head_dim)
    if min_n is not None:
        return n is not None and n >= min_n
    return kind in ("fwd", "bwd")


def gluon_min_n(kind: str, dropout: bool, head_dim: int) -> int | None:
    """The length bucket from which a variant's Gluon kernel is the Hopper default (`tl`
    below it), or None where no length rule applies: the backward at d <= 64, and the
    dropout forward at d <= 64."""
    if head_dim > 64:
        return None
    if kind == "bwd":
        return GLUON_BWD_SMALL_D_MIN_N
    return GLUON_DROPOUT_FWD_SMALL_D_MIN_N if kind == "fwd" and dropout else None


KEY_ROWS_PER_CONSUMER = 64  # the backward's consumers own 64 keys each (one wgmma M extent)

# The untuned Gluon backward: a program owns 128 keys (two consumers x 64) and steps over
# 64 query rows at a time through a 2-deep Q/dO ring. (block_m / block_n keep the `tl`
# backward's meaning: query rows per step / key rows per program.)
GLUON_BWD_DEFAULT = {
    "family": "gluon",
    "block_m": 64,
    "block_n": CONSUMERS * KEY_ROWS_PER_CONSUMER,
    "num_warps": 4,
    "num_stages": 2,
    "regs": "240/24",
}


# Rounds of the dropout keep mask's Philox4x32 generator, in every kernel family and in the
# package's mask replay (_dropout.keep_mask): 7, FlashAttention-2's dropout generator
# (csrc/flash_attn/src/philox.cuh: six rounds and a last one), the fewest Salmon et al.
# (SC'11) found to pass TestU01's BigCrush; cuRAND and `tl.philox` default to 10 for a
# safety margin. The rounds are most of what dropout costs the kernels (each a 32 x 32-bit
# product's high and low words per counter pair on the half-rate integer multiplier), and
# the drop decision reads one byte a draw, so the generator's statistical margin beyond
# BigCrush buys nothing a keep mask can show (docs/PERFORMANCE.md, Dropout, for what the
# three rounds cost on the H100).
PHILOX_ROUNDS = 7

# The Gluon dropout backward draws each step's keep mask in the consumers (templates/gluon/
# bwd.py.j2, "Dropout"): a Philox call's words land on two warps of S^T, and by default
# both warps draw the call (BLOCK_M / 16 calls a thread a step). With philox_split (an
# override_config / tuned-config key, read by the runtime's launcher) each call is drawn
# once and half its words cross to the other warp through shared memory: ~60 fewer
# instructions a step at d=128 (1090 against 1148 in the consumer's step loop, sm_90
# offline; 744 without dropout), ~3.6 KB more shared memory, and a warpgroup barrier a step.
# H100 (57d76da; docs/PERFORMANCE.md, Dropout; bf16 causal H=16 B*N=16k p=0.1, TFLOP/s,
# split vs not, dK/dV identical): d=64 1k 173.2 vs 155.1, 4k 268.5 vs 235.4; d=128 1k 230.4 vs
# 221.1, 4k 372.1 vs 347.6 (`tl` 93.4 / 135.8 / 142.7 / 224.1; p=0 Gluon 200.6 / 331.4 /
# 260.4 / 417.1). So it is on by default.
GLUON_BWD_PHILOX_SPLIT = True
PHILOX_SPLIT_SHARED_BYTES = 3632  # the exchange's scratch, sm_90 compile at d = 64 and 128


def bwd_head_group(pairs: int, num_n: int, sms: int) -> int:
    """The dense Gluon backward's group under a causal mask (HEAD_GROUP; the runtime's
    _gluon_bwd_head_group says why): the smallest divisor of the (batch, K/V head) pairs
    whose key blocks (num_n a pair) fill a wave of `sms` programs to within one level."""
    return next(g for g in range(1, pairs + 1)
                if pairs % g == 0 and (g * num_n >= sms - num_n or g == pairs))


# What the Gluon backward's tile may be (bwd_config_reason): BLOCK_N is fixed by the consumer
# count rendered into the kernel (CONSUMERS x KEY_ROWS_PER_CONSUMER keys per program);
# BLOCK_M, the query rows of one step through the Q/dO ring, is the N extent of
# S^T = K Q^T and the M extent of the dQ = dS K product (one warpgroup: at least 64), and
# 128 fits shared memory at d=64 only; the ring is 2 to 4 deep where shared memory allows.
GLUON_BWD_BLOCK_MS = (64, 128)
GLUON_BWD_STAGES = (2, 3, 4)


# The forward's tile-boundary knobs where a mask mod bounds the keys a query sees
# (mods.key_span): such tiles are a few key blocks long, so what a tile's start and end
# cost (its Q load, a first block with no P V behind it, the last P V) is a large share.
# q_buffers 2 loads the next tile's Q during this one; a document's 64-key blocks also
# cut its partial blocks (the documents' edges) in half. H100, mods bench masks (B=4
# H=16 N=4096 d=128 bf16, benchmarks/mods_knobs_ab.py; docs/PERFORMANCE.md, Mods),
# knob / base: document q_buffers 2 1.079-1.087, with block_n 64 1.198 (1.28x
# FlexAttention); 4 and 16 equal documents a sequence 1.117 / 1.128 (q_buffers only);
# sliding window + sinks q_buffers 2 1.067, block_n 64 none. Where a query may see every key (prefix-LM, plain
# causal through a document mask with one document) the knobs gain nothing or lose
# (prefix_lm q_buffers 2: 0.949), so they follow the span.
KEY_SPAN_FWD_KNOBS = {
    "segment": {"q_buffers": 2, "block_n": 64},
    "window": {"q_buffers": 2},
}


# The dropout forward at d > 64 loads a tile's Q while the tile before it runs (q_buffers
# 2). Its consumers' key loop is longer (the Philox rounds) and latency-bound (ncu:
# issue slots 37% busy, the consumers' stalls mostly fixed-latency dependencies and
# dispatch; docs/PERFORMANCE.md, Dropout), so a tile's start, where the Q wait and a first
# block with no P V behind it sit, costs more of the tile than without dropout. H100,
# causal d=128 bf16 p=0.1, H=16 B*N=16k (4 interleaved rounds; 8ce23f7,
# docs/PERFORMANCE.md, Dropout): 336.4 vs 330.0 TFLOP/s at N=1k (1.020x), 409.2 vs 408.8
# at 4k (1.001x); overlap, diag_first and no ping-pong 0.975-1.011x. Not taken at d=64,
# where q_buffers 2 cost the causal forward 4% without dropout.
DROPOUT_FWD_KNOBS = {"q_buffers": 2}


# ----------------------------------------------------------------------------------------
# The forward's tiles at the large head dims: d = 256 and (qk 192, v 128)
# ----------------------------------------------------------------------------------------
# Shared memory, 2-byte elements, sm_90's 232,448 bytes a block (GLUON_SHARED_BYTES):
#   Q: 2 consumers x 64 rows x d_qk; O staging: 2 x 64 x d_v; the K/V ring: stages x
#   block_n x (d_qk + d_v); about 1 KiB of barriers.
#   d = 256: Q 64 KiB, O 64 KiB, 64 KiB a 64-key stage (128 KiB a 128-key one).
#     128 x 64, 2 stages: 64 + 64 + 128 = 256 KiB, over; with O staged in its consumer's
#     Q slot once the tile's last S = Q K^T is done (o_in_q) 192 KiB (197,632 bytes).
#     3 stages or 128-key blocks: 256 KiB even then.
#   192 / 128: Q 48 KiB (192 columns are three 64-column TMA boxes: qk_boxes), O 32 KiB,
#     640 bytes a key of a stage.
#     128 x 128, 2 stages: 48 + 32 + 160 = 240 KiB, over; O in Q: 208 KiB (214,016).
#     128 x 64, 3 stages: 48 + 32 + 120 = 200 KiB with O apart (a tuner point).
# Registers a consumer thread (a warpgroup's [64, n] fp32 accumulator is n / 2 of its 128
# threads' registers), of CONSUMER_REGS = 240:
#   d = 256, 64 keys: O 128, S 32, the last block's P carried fp32 into the next 32:
#     192, and ~30 of addresses, row statistics and the softmax's temporaries. 128 keys
#     would be O 128 + S 64 + P 64 = 256, over, so the 64-key block is the register file's
#     choice as well as shared memory's.
#   192 / 128, 128 keys: O 64, S 64, P 64: d = 128's budget (the Q K^T product's third
#     64-column box is a third wgmma into the same S, no registers).
# FlashAttention-3 (hopper/tile_size.h; FA4's _tile_size_fwd_sm90 the same) runs 128 x 80
# at d = 256 and 128 x 128 at 192 / 128, 2 stages, with O aliasing its V buffers (the
# producer waits for the epilogue before the next tile's first V); here O takes the Q slot
# instead (the producer waits for it before the next tile's Q), and a Gluon tensor's
# extents are powers of two, hence 64 keys rather than 80.
# The tile-boundary knobs measured at d <= 128 (KEY_SPAN_FWD_KNOBS, DROPOUT_FWD_KNOBS: a
# second Q slot, 64-key blocks) are not applied here: a second Q slot does not fit.
LARGE_HEAD_DIM_FWD = {(256, 256): {"block_n": 64, "num_stages": 2},
                      (192, 128): {"block_n": 128, "num_stages": 2}}


# ----------------------------------------------------------------------------------------
# The backward at the large head dims: d = 256 and (qk 192, v 128) (templates/gluon/
# bwd_large.py.j2)
# ----------------------------------------------------------------------------------------
# The d <= 128 kernel gives each consumer 64 keys and every column of their dK and dV:
# (d_qk + d_v) / 2 fp32 registers a thread, 256 at d = 256. Here both consumers work on the
# same 64 keys and split the head dim's columns (FlashAttention-3's d = 256 shape): a
# consumer holds dK's and dV's columns of its TMA boxes and makes dQ's columns of its
# 64-column units; S^T and dP^T are cut along the step's 64 query rows (32 a consumer) and
# P^T, dS^T pass through shared memory, since every consumer's dV, dK and dQ product reads
# all 64 rows of them. Columns (large_bwd_split): d = 256: Q, K, dK and dO, V, dV in boxes
# of 128, consumer c owns box c of each and dQ's units 2c, 2c + 1 (128 columns of each of
# the three products a consumer). 192 / 128: boxes of 64 (Q, K three, dO, V two); consumer 0
# owns dK boxes 0-1, dV box 0, dQ unit 0, consumer 1 dK box 2, dV box 1, dQ units 1-2: 256
# product columns each.
# Registers a consumer thread ([64, n] fp32 over a warpgroup's 128 threads: n / 2), of
# CONSUMER_REGS = 240 (large_bwd_regs):
#   d = 256: dK 64 + dV 64 held across the steps; a step's S^T and dP^T 16 + 16 (P^T and
#   dS^T, and their 16-bit copies, in the same registers), then dQ's two units 2 x 32: 192
#   at most, the rest for LSE, D (8 each), addresses. 192 / 128: 96 + 32 and 64 + 64.
# Shared memory, 2-byte elements (large_bwd_shared_bytes), of sm_90's 232,448 bytes:
#   K, V 64 x (d_qk + d_v) x 2; a Q/dO stage the same plus LSE and D (512 bytes); P^T and
#   dS^T 2 x 64 x 64 x 2 = 16 KiB; dQ staging, 2 consumers x dq_slots [64, 64] fp32 tiles of
#   16 KiB; 1 KiB for the barriers.
#   d = 256: 64 KiB + one stage 64.5 KiB + 16 KiB + 2 x 2 slots 64 KiB = 214,528 bytes. A
#     second stage does not fit, even with one slot a consumer (247,808): the Q/dO ring is
#     one deep, as FA4's d = 256 backward (Q: 1, dO: 1). A second slot for Q alone fits with
#     one dQ slot a consumer (do_stages 1, a config key: 214,784), so that the next Q loads
#     during the whole step (FlashAttention-3's C++ kernel: Q 2, dO 1): an A/B for the GPU.
#   192 / 128: 40 KiB + two stages 81 KiB + 16 KiB + 64 KiB = 206,848 bytes; three stages
#     with one slot a consumer 215,552 (a tuner point), with two 248,320 (over).
# Compiled for sm_90 (gluon_compile, Triton 3.6.0; tests/test_gluon_bwd.py, slow): no stack
# frame in any tile above, the consumers' SASS up to R214 (d = 256) and R158 (192 / 128) of
# the 240, shared memory 214,128 and 206,368 bytes at the defaults.
# The Hopper default at these dims since its GPU tests passed (88 against float64 on an
# H200) and it timed 2.05-2.59x the `tl` kernel, 0.79-1.22x cuDNN (192 causal the low end;
# benchmarks/results/nvidia-h200-x4/bench_training_large_dims.md). FLASHGEN_GLUON_BWD_LARGE=0
# when the package is imported sends it back to `tl`. Varlen, dropout and mods keep `tl`.
LARGE_HEAD_DIM_BWD = {(256, 256): {"num_stages": 1, "dq_slots": 2},
                      (192, 128): {"num_stages": 2, "dq_slots": 2}}
LARGE_BWD_ROWS = 64  # BLOCK_M = BLOCK_N: one wgmma M extent; half the rows a consumer's S^T
LARGE_BWD_STAGES = (1, 2, 3)  # Q/dO ring depths (shared memory decides: d = 256 takes 1)
DQ_UNIT = 64  # columns of a dQ reduce-add
GLUON_BWD_LARGE_DEFAULT = os.environ.get("FLASHGEN_GLUON_BWD_LARGE", "1") != "0"
LARGE_BWD_QK_DIMS = frozenset(qk for qk, _ in LARGE_HEAD_DIM_BWD)


def large_bwd(head_dim: int, v_dim: int | None = None) -> bool:
    """Whether (head_dim, v_dim) is served by the large head dims' Gluon backward."""
    return (head_dim, v_dim or head_dim) in LARGE_HEAD_DIM_BWD


def large_bwd_split(head_dim: int, v_dim: int | None = None) -> dict:
    """The columns of the large head dims' backward: Q, K, dK in `qk_boxes` TMA boxes of
    `qk_box` columns, dO, V, dV in `v_boxes` of `v_box`, and for each consumer the (first,
    count) of the dK boxes, dV boxes and dQ units (DQ_UNIT columns) it owns. A box is half
    the head dim where that is a power of two (256: 128), else 64; consumer 0 takes the
    first half of the dK boxes (rounded up), of the dV boxes and of the dQ units (rounded
    down), so both make about the same product columns."""
    v_dim = v_dim or head_dim

    def box(d):
        return d // 2 if (d // 2) & (d // 2 - 1) == 0 else 64

    qk_box, v_box = box(head_dim), box(v_dim)
    nk, nv, nq = head_dim // qk_box, v_dim // v_box, head_dim // DQ_UNIT
    k0, v0, q0 = -(-nk // 2), nv // 2, nq // 2
    return {"qk_box": qk_box, "qk_boxes": nk, "v_box": v_box, "v_boxes": nv,
            "consumers": [{"dk": (0, k0), "dv": (0, v0), "dq": (0, q0)},
                          {"dk": (k0, nk - k0), "dv": (v0, nv - v0), "dq": (q0, nq - q0)}]}


def bwd_boxes(head_dim: int, v_dim: int | None, block_m: int) -> dict:
    """The TMA boxes of a Gluon backward's descriptors, by kernel argument (dK and dV take
    K's and V's), and `DS`: the shape whose default shared layout P^T / dS^T take (the
    large head dims': a swizzle block per consumer's columns)."""
    if large_bwd(head_dim, v_dim):
        split, rows = large_bwd_split(head_dim, v_dim), LARGE_BWD_ROWS
        qk, v = split["qk_box"], split["v_box"]
        return {"Q": [1, 1, block_m, qk], "DO": [1, 1, block_m, v], "K": [1, 1, rows, qk],
                "V": [1, 1, rows, v], "DQ_ACC": [1, 1, block_m, DQ_UNIT], "LSE": [block_m],
                "DS": [rows, block_m // CONSUMERS]}
    d = head_dim_pad(head_dim)
    keys = KEY_ROWS_PER_CONSUMER
    return {"Q": [1, 1, block_m, d], "DO": [1, 1, block_m, d], "K": [1, 1, keys, d],
            "V": [1, 1, keys, d], "DQ_ACC": [1, 1, block_m, d // CONSUMERS], "LSE": [block_m],
            "DS": [keys, block_m]}


def large_bwd_regs(head_dim: int, v_dim: int | None = None) -> list:
    """(held, peak) fp32 accumulator registers a thread of each consumer: its dK and dV
    columns across the steps, plus the larger of a step's S^T and dP^T ([64, 32] each) and
    its dQ units ([64, 64] each)."""
    split = large_bwd_split(head_dim, v_dim)
    rows = LARGE_BWD_ROWS
    out = []
    for c in split["consumers"]:
        held = (c["dk"][1] * split["qk_box"] + c["dv"][1] * split["v_box"]) * rows // 128
        step = max(2 * rows * (rows // CONSUMERS) // 128, c["dq"][1] * DQ_UNIT * rows // 128)
        out.append((held, held + step))
    return out


def large_bwd_shared_bytes(head_dim: int, v_dim: int | None, dtype_bytes: int,
                           num_buffers: int, dq_slots: int, do_buffers: int | None = None) -> int:
    """Shared memory of the large head dims' backward (LARGE_HEAD_DIM_BWD's arithmetic):
    K and V, the Q ring with LSE (num_buffers deep) and the dO ring with D (do_buffers,
    default num_buffers), P^T and dS^T, the consumers' fp32 dQ staging tiles, and 1 KiB
    for the barriers."""
    v_dim = v_dim or head_dim
    rows, cols = LARGE_BWD_ROWS, head_dim + v_dim
    kv = rows * cols * dtype_bytes
    ring = (num_buffers * (rows * head_dim * dtype_bytes + rows * 4)
            + (do_buffers or num_buffers) * (rows * v_dim * dtype_bytes + rows * 4))
    pds = 2 * rows * rows * dtype_bytes
    dq = CONSUMERS * dq_slots * rows * DQ_UNIT * 4
    return kv + ring + pds + dq + 1024


def large_bwd_config_reason(config: dict, head_dim: int, v_dim: int | None, dtype_bytes: int,
                            sram_bytes: int) -> str | None:
    """Why a launch config of the large head dims' backward cannot run (None when it can)."""
    rows = LARGE_BWD_ROWS
    if config.get("block_m") != rows or config.get("block_n") != rows:
        return f"block_m and block_n must be {rows} at head dims {head_dim}/{v_dim or head_dim}"
    if config.get("num_warps") != 4:
        return "num_warps must be 4 (one warpgroup per partition)"
    stages = (config.get("num_stages"), config.get("do_stages", config.get("num_stages")))
    if not set(stages) <= set(LARGE_BWD_STAGES):
        return "num_stages and do_stages (the Q and dO ring depths) must be 1, 2 or 3"
    if config.get("dq_slots", 2) not in (1, 2):
        return "dq_slots (dQ staging tiles a consumer) must be 1 or 2"
    if str(config.get("regs", REG_SPLITS[0])) not in REG_SPLITS:
        return f"regs must be one of {', '.join(REG_SPLITS)} (consumer/producer per thread)"
    peak = max(p for _, p in large_bwd_regs(head_dim, v_dim))
    if peak > regs(config)[0]:
        return f"the accumulators take {peak} registers a consumer thread, the split gives {regs(config)[0]}"
    need = large_bwd_shared_bytes(head_dim, v_dim, dtype_bytes, stages[0],
                                  config.get("dq_slots", 2), stages[1])
    if need > sram_bytes:
        return f"needs {need} bytes of shared memory, the GPU has {sram_bytes}"
    return None


# ----------------------------------------------------------------------------------------
# The forward on fp8 inputs (issue 50): e4m3 Q, K, V with descales, bf16 O
# ----------------------------------------------------------------------------------------
# FlashAttention-3's recipe in the same kernel (templates/gluon/fwd.py.j2, `fp8`): both
# products e4m3 wgmmas, P re-quantized to e4m3 in registers (scaled by 2^8), V read from a
# keys-major copy the runtime makes per call (an 8-bit wgmma's B operand must be K-major).
# Head dims with that kernel (V's head dim equal; 96 runs the 128 tiles): at 256 the bf16
# output would not fit in the e4m3 Q slot that O_IN_Q stages it in.
GLUON_FP8_HEAD_DIMS = (64, 96, 128)
# It replaces the `tl` fp8 forward by default on Hopper (FLASHGEN_FP8_GLUON=0 turns it
# off): tests/test_gluon_fp8.py passed on an H200 (65, 8 skipped), and it timed 794-834
# TFLOP/s non-causal, 700-796 causal at d = 128, 4k-16k (bf16 Gluon: 535-615).
GLUON_FP8_BY_DEFAULT = True
# Chunked prefill over a paged KV cache (issue 49) on the Gluon varlen forward: its
# producer reads K/V through the block table (templates/gluon/fwd.py.j2, PAGE_SIZE). The
# The default on Hopper (FLASHGEN_PAGED_GLUON=0 turns it off): on an H200 it timed 0.89x
# (page 16) and 1.02x (page 64) the dense varlen forward, where the `tl` paged kernel
# timed 0.56 / 0.58; its GPU tests (tests/test_paged_prefill.py, test_gluon_varlen.py,
# test_batch_invariant.py, test_kv_quant.py: 121) passed with it on.
GLUON_PAGED_BY_DEFAULT = True
PAGED_MIN_BOX_ROWS = 8  # a page box starts on a 128-byte swizzle atom: 8 rows of 128 bytes


def paged_gluon_reason(dtype: str, dropout: bool, page_size: int, block_n: int) -> str | None:
    """Why the Gluon forward does not read a paged cache of page_size keys (0: seqused_k
    over packed K/V) at key blocks of block_n (None when it does): a block is whole pages
    of 8+ rows (several TMA boxes on one barrier), or a page whole blocks (one box at an
    offset); fp8 and dropout are not served there (forward-only calls, no fp8 pages)."""
    if dtype.startswith("fp8"):
        return f"{dtype}: the Gluon fp8 forward reads a keys-major V copy, not pages"
    if dropout:
        return "dropout: a paged call is forward-only inference (no dropout)"
    if page_size and not (page_size % block_n == 0 or (
            block_n % page_size == 0 and page_size >= PAGED_MIN_BOX_ROWS)):
        return (f"page size {page_size} at {block_n}-key blocks: the Gluon forward takes pages "
                f"of {PAGED_MIN_BOX_ROWS}+ keys dividing the block, or multiples of it")
    return None


# Registers a forward consumer thread holds besides the accumulators and P
# (fwd_accumulator_regs): row statistics, the softmax's temporaries, addresses, barrier
# phases. The fp8 kernels compiled for sm_90 (gluon_compile, P packed four keys a
# register): 128-key blocks at d = 64 / 128, causal or not, two consumers at 240 or three
# at 160, no spill; 256-key blocks (224 of 240 registers by the estimate at d = 128) spilled
# 96 stack bytes, 30 LDL/STL a block and serialised the wgmmas (C7512); at d = 64 (192)
# none unmasked but 352 bytes / 58 a block causal (the mask's column indices). With a
# fresh P V accumulator a block (fwd_accumulator_regs) d = 128's 208 held and d = 64's 144
# at 160 compiled without a spill in the key loop (causal d = 128 with diag_first only:
# in key order 10 spills a block, the mask's indices again).
FWD_REG_OVERHEAD = 16
# The deepest K/V ring fp8_fwd_tile asks for, in keys: an fp8 block's products take half
# the time of a bf16 one's (twice the tensor-core rate), so twice the bf16 default's keys
# in flight (2 stages x 128) cover the same load latency. Not measured yet (an A/B of 2 to
# 4 stages is the GPU's to run).
FP8_RING_KEYS = 512


def fp8_fwd_tile(head_dim: int, consumers: int = CONSUMERS,
                 sram_bytes: int = GLUON_SHARED_BYTES) -> dict:
    """The fp8 forward's key block and K/V ring depth: 128-key blocks (FlashAttention-3
    runs 224 at d = 128; a Gluon tile is a power of two and 256 spills, FWD_REG_OVERHEAD),
    in the deepest ring of at most FP8_RING_KEYS keys (2 to 4 stages) that fits shared
    memory (Q and K/V one byte an element, O staged in bf16: 176 KiB at d = 128, 4 stages)."""
    for stages in range(min(4, FP8_RING_KEYS // 128), 1, -1):
        if shared_bytes(head_dim, 1, 128, stages, 1, consumers) <= sram_bytes:
            return {"block_n": 128, "num_stages": stages}
    return {"block_n": 128, "num_stages": 2}


def gluon_default(head_dim: int, kind: str = "fwd", mask: str | None = None,
                  mods: tuple = (), key_span: str | None = None,
                  dropout: bool = False, bucket: int | None = None,
                  v_dim: int | None = None, fp8: bool = False) -> dict:
    """The untuned Gluon config of a kernel kind for a head dim (and, for the forward,
    its mask, mods and the mods' key span, KEY_SPAN_FWD_KNOBS, and dropout at d > 64,
    DROPOUT_FWD_KNOBS). At d <= 64 the forward's
    consumers run without ping-pong: a block's products take half as long as at d=128
    while its softmax does not, so taking turns only idles the tensor cores (d=64 N=16k: 466 vs 439 TFLOP/s). A d <= 64 forward
    without a mask or mods walks its key blocks from the last down (diag_first: +6.5% on
    the H100, see GLUON_DEFAULT), in 192-row tiles of three consumers that do take turns
    (THREE_CONSUMER_REGS; +3..+11% over two consumers at N = 2k-16k); so does the causal
    one from the length bucket THREE_CONSUMER_DEFAULT_MASKS names (`bucket`: the call's;
    None, no length, keeps two consumers), with its key blocks in order. d = 256 and
    (qk 192, v: v_dim 128) take LARGE_HEAD_DIM_FWD's tiles; fp8 (e4m3 inputs) the key
    block and ring depth of fp8_fwd_tile."""
    large = LARGE_HEAD_DIM_FWD.get((head_dim, v_dim or head_dim))
    if kind == "fwd" and is_d512(head_dim, v_dim):
        large = D512_FWD  # (families_large: its shared-memory and register arithmetic)
    if kind == "fwd" and large is not None:
        return {**GLUON_DEFAULT, **large}
    if kind == "bwd" and is_d512_bwd(head_dim, v_dim):  # (the Q/K 512 backward: families_large)
        return {**GLUON_BWD_DEFAULT, **d512_bwd_default(head_dim, v_dim)}
    if kind == "bwd" and large_bwd(head_dim, v_dim):
        return {**GLUON_BWD_DEFAULT, "block_m": LARGE_BWD_ROWS, "block_n": LARGE_BWD_ROWS,
                **LARGE_HEAD_DIM_BWD[(head_dim, v_dim or head_dim)]}
    if kind == "bwd":
        cfg = dict(GLUON_BWD_DEFAULT)
        if head_dim <= 64:
            # 128 query rows a step: the products of a 64-row step at d=64 are too short
            # for the step's fixed costs (barriers, the dQ hand-over): 64-row steps with a
            # 2- to 4-deep ring ran 3-10% slower on the H100 at N = 2k-16k
            cfg["block_m"] = 128
        return cfg
    cfg = dict(GLUON_DEFAULT)
    if head_dim <= 64:
        cfg["pingpong"] = False
        if mask == "none" and not mods:
            cfg["diag_first"] = True
        min_n = THREE_CONSUMER_DEFAULT_MASKS.get(mask, 0)
        if (mask in THREE_CONSUMER_DEFAULT_MASKS and not mods
                and (min_n is None or (bucket is not None and bucket >= min_n))
                and 3 in fwd_consumer_counts(head_dim, dropout)):
            cfg.update(block_m=3 * QUERY_ROWS_PER_CONSUMER, regs=THREE_CONSUMER_REGS[0],
                       pingpong=True)
    cfg.update(KEY_SPAN_FWD_KNOBS.get(key_span, {}))
    if dropout and head_dim > 64:
        cfg.update(DROPOUT_FWD_KNOBS)
    if fp8:
        cfg.update(fp8_fwd_tile(head_dim, cfg["block_m"] // QUERY_ROWS_PER_CONSUMER))
        if mask == "causal" and head_dim > 64:
            cfg["diag_first"] = True  # (in key order the loop spills: FWD_REG_OVERHEAD)
    return cfg


def variant_gluon_default(facts: dict, bucket: int | None = None) -> dict:
    """gluon_default for a variant as a package's registry records it (VARIANTS[name]), at
    a call's length bucket (None: no length)."""
    return gluon_default(facts["head_dim"], facts["kind"], facts["mask"],
                         tuple(facts.get("mods", ())), facts.get("key_span"),
                         bool(facts.get("dropout")), bucket, facts.get("v_head_dim"),
                         str(facts.get("dtype", "")).startswith("fp8"))


# The persistent forward's last round, dealt by key block when whole tiles would leave
# more than this share of it idle (stream_k_start) ...
STREAM_K_MIN_IDLE = 0.01
# ... and its tiles have at least this many key blocks: with 16 (N = 2048 at BLOCK_N = 128)
# the tail's extra item a program (its own Q load, a first block with no P V product to
# hide behind, an epilogue, the merge) cost what the even deal saved: -1.1% at d=128 and
# -3.0% at d=64, against +1.6..+4.2% at 32 and 128 (H100, docs/PERFORMANCE.md, Forward)
STREAM_K_MIN_KEY_BLOCKS = 32


def stream_k_config(config: dict) -> bool:
    """Whether a Gluon forward config deals an even call's last rounds by key block: the
    knob on, a persistent grid, and no OVERLAP (whose deferred stores a handed-over part has
    none of). What stream_k_start asks of the config, and the form gluon_compile compiles."""
    return bool(config.get("stream_k", GLUON_DEFAULT["stream_k"])
                and config.get("persistent", True) and not config.get("overlap", False))


def stream_k_start(tiles: int, programs: int, config: dict,
                   key_blocks: int = STREAM_K_MIN_KEY_BLOCKS) -> "int | None":
    """How many tiles of an even forward (every tile the same `key_blocks` key blocks) the
    persistent grid deals whole, round-robin, before it deals the rest by key block
    (STREAM_K), or None to deal every tile whole. 2048 equal tiles on 132 programs are
    15.52 rounds: whole tiles make that 16, 3% of the time idle (the non-causal d=128
    forward at B N = 16k, H d = 2048 on the H100). The tail keeps between P and 2P tiles,
    so every program's share of it is at least a tile long and a tile is cut between two
    programs at most. Off with the config key stream_k=False (a tuner knob), on a
    non-persistent grid, with OVERLAP (whose deferred stores a handed-over part has none
    of), for tiles of fewer than STREAM_K_MIN_KEY_BLOCKS key blocks, or when the rounds
    come out (nearly) whole."""
    if (not stream_k_config(config) or tiles <= programs
            or key_blocks < STREAM_K_MIN_KEY_BLOCKS):
        return None
    rounds = tiles / programs
    if rounds / -(-tiles // programs) > 1.0 - STREAM_K_MIN_IDLE:
        return None
    return (tiles // programs - 1) * programs


# A call with less tensor-core work than this (4 B H Nq Nk d FLOPs, halved when causal) runs
# the `tl` kernel: the persistent Gluon kernel's fixed cost (descriptors made on the device,
# barrier setup, the partitions' start) outweighs such a call's math. H100, H=16, d=64,
# (B, N): (8, 59) 14.6 us on Gluon vs 9.4 on `tl` (0.1 GFLOP), (4, 512) 26.3 vs 21.5
# (4.3 GFLOP) and causal 21.7 vs 20.4 (2.1); (1, 2048) causal 36.3 vs 45.2 (8.6 GFLOP),
# non-causal level (17 GFLOP; docs/PERFORMANCE.md, Forward; 7234c07, a397467).
GLUON_MIN_FLOPS = 8e9


def head_dim_pad(head_dim: int) -> int:
    """The power-of-two tile width a Gluon kernel uses for `head_dim`."""
    p = 16
    while p < head_dim:
        p *= 2
    return p


def qk_boxes(head_dim: int) -> tuple[int, int]:
    """(boxes, columns a box) of a Gluon forward's Q and K tiles: TMA boxes and Gluon
    tensors are powers of two wide, so 192 is three 64-column boxes, S = Q K^T one wgmma a
    box into the same accumulator (padded to one 256-column box it would be a third more
    work and, at 128-key blocks, 64 KiB more shared memory than fits); any other head dim
    is one box of head_dim_pad columns (96: 128, zero-filled), but past 256, TMA's largest
    box side: 512 is two boxes of 256."""
    pad = head_dim_pad(head_dim)
    if pad > 256:
        return pad // 256, 256
    if pad != head_dim and head_dim % 64 == 0:
        return head_dim // 64, 64
    return 1, pad


def gluon_reason(kind: str, dropout: bool, head_dim: int, dtype: str,
                 v_dim: int | None = None) -> str | None:
    """Why a variant has no Gluon kernel (None when it has one); v_dim: V's head dim where
    it is not Q's."""
    if kind not in ("fwd", "bwd"):
        return f"no Gluon {kind} kernel yet: the `tl` kernel serves it on every GPU"
    if dtype.startswith("fp8"):
        if kind != "fwd":
            return (f"{dtype}: the fp8 backward upcasts to bf16 in the `tl` kernel (issue 50: "
                    "no Gluon fp8 backward yet)")
        if dropout:
            return f"{dtype} with dropout: the Gluon fp8 forward has none; the `tl` kernel runs it"
        if (v_dim or head_dim) != head_dim or head_dim not in GLUON_FP8_HEAD_DIMS:
            return (f"{dtype} at head dim {head_dim}{f'/{v_dim}' if v_dim not in (None, head_dim) else ''}: "
                    f"the Gluon fp8 forward is built for "
                    f"{', '.join(map(str, GLUON_FP8_HEAD_DIMS))}; the `tl` kernel runs it")
        return None
    if dtype not in ("fp16", "bf16"):
        return f"{dtype}: wgmma takes fp16/bf16 operands; the `tl` kernel runs fp32 as tf32x3"
    pair = (head_dim, v_dim or head_dim)
    if head_dim == D512:
        return d512_reason(kind, dropout, *pair, dtype)
    if pair[0] == pair[1] and head_dim not in GLUON_HEAD_DIMS:
        return (f"head dim {head_dim}: the Gluon tiles are built and verified for "
                f"{', '.join(map(str, GLUON_HEAD_DIMS))} and (q/k, v) "
                f"{', '.join(f'{a}/{b}' for a, b in GLUON_SPLIT_HEAD_DIMS)}")
    if pair[0] != pair[1] and pair not in GLUON_SPLIT_HEAD_DIMS:
        return (f"head dims {pair[0]}/{pair[1]} (q/k, v): the Gluon tiles are built for "
                f"the pairs {', '.join(f'{a}/{b}' for a, b in GLUON_SPLIT_HEAD_DIMS)} and "
                f"equal dims {', '.join(map(str, GLUON_HEAD_DIMS))}")
    if kind == "bwd" and large_bwd(*pair):
        if dropout:
            return (f"dropout at head dims {pair[0]}/{pair[1]}: the large head dims' Gluon "
                    "backward draws no keep mask yet; the `tl` backward runs this one")
        return None
    if kind == "bwd" and (pair[0] != pair[1] or head_dim not in GLUON_BWD_HEAD_DIMS):
        return (f"head dims {pair[0]}/{pair[1]}: the Gluon backward is built for "
                f"{', '.join(map(str, GLUON_BWD_HEAD_DIMS))} (its dK, dV accumulators "
                "are d fp32 registers a thread each; the `tl` backward runs this one)")
    return None


# The Gluon latent (MLA) decode (templates/gluon/decode_mla.py.j2; verified on the H100,
# docs/PERFORMANCE.md, DeepSeek MLA): 64 stacked query rows a program, key blocks of
# BLOCK_N in a NUM_BUFFERS-deep ring, two output warpgroups at O_REGS registers a thread
# (each holds [64, 256] fp32 of O: 128), a 1-warp producer at PRODUCER_REGS; the softmax
# warpgroup (the default partition) gets what is left of the 64K registers.
MLA_DECODE = {"rows": 64, "block_n": 64, "num_buffers": 2, "o_regs": 192, "producer_regs": 24,
              "num_warps": 4}


# what describe() and the host say of it until an H100 run has checked and timed it
MLA_DECODE_STATUS = ("on by default where the GPU runs Gluon (issue 16; verified on the H100 "
                     "against float64, 3.7-5.5x the `tl` kernel at 128 heads); "
                     "_decode.MLA_GLUON = False or FLASHGEN_FAMILY=tl keeps `tl`")


def mla_decode_shared_bytes(head_dim: int, dtype_bytes: int, block_n: int,
                            num_buffers: int) -> int:
    """Shared memory of the Gluon latent decode: Q [64, head_dim], the key ring
    (num_buffers x [block_n, head_dim]), P [64, block_n], the fp32 row factors [64] and the
    barriers (256 bytes reserved for them)."""
    rows = MLA_DECODE["rows"]
    return ((rows + num_buffers * block_n) * head_dim + rows * block_n) * dtype_bytes + rows * 4 + 256


def shared_bytes(head_dim: int, dtype_bytes: int, block_n: int, num_buffers: int,
                 q_buffers: int = 1, consumers: int = CONSUMERS, v_dim: int | None = None,
                 o_in_q: bool = False) -> int:
    """Shared memory of a Gluon forward tile: Q (q_buffers slots) and O staging per
    consumer (none with o_in_q: O is staged in the Q slot), the K/V ring, and the mbarriers
    (a few hundred bytes; 1 KiB is reserved for them). v_dim: V's head dim where it is not
    Q's. dtype_bytes 1 is fp8: Q, K, V in e4m3, O staged in bf16."""
    boxes, width = qk_boxes(head_dim)
    d, dv = boxes * width, head_dim_pad(gluon_v_dim(head_dim, v_dim) or head_dim)
    rows = consumers * QUERY_ROWS_PER_CONSUMER
    o_bytes = 2 if dtype_bytes == 1 else dtype_bytes
    qo = q_buffers * d * rows * dtype_bytes + (0 if o_in_q else dv) * rows * o_bytes
    kv = num_buffers * block_n * (d + dv) * dtype_bytes
    return qo + kv + 1024


def overlap_reason(config: dict, head_dim: int, v_dim: int | None = None,
                   dtype_bytes: int = 2) -> str | None:
    """Why a Gluon forward config cannot take `overlap` (None when it can, or has it off):
    a tile's stores run during the next tile, whose Q then fills the slot the output is
    staged in where o_in_q. (config_reason, and the runtime's launcher for a forced
    config.)"""
    if config.get("overlap", GLUON_DEFAULT["overlap"]) and o_in_q(config, head_dim, v_dim,
                                                                  dtype_bytes):
        return ("overlap stores a tile's output during the next tile, whose Q then fills the "
                "slot the output is staged in at this head dim (o_in_q)")
    return None


def fwd_accumulator_regs(block_n: int, v_dim: int, fp8: bool = False) -> int:
    """Registers a consumer thread of the Gluon forward holds in its key loop's wgmma
    accumulators and P: O ([64, v_dim] fp32), S and the last block's P carried in fp32
    ([64, block_n] each), n / 2 a thread for a [64, n] fp32 tile over a warpgroup's 128
    threads (LARGE_HEAD_DIM_FWD). The rest of CONSUMER_REGS holds the softmax's row
    statistics, temporaries and addresses (~30-50 measured). fp8 carries P as its e4m3
    operand (the template's EARLY_P): n / 8 a thread; and the last block's P V in a fresh
    accumulator of O's size (the e4m3 wgmma's short sums, templates/gluon/fwd.py.j2)."""
    if fp8:
        return head_dim_pad(v_dim) + block_n // 2 + block_n // 8
    return (head_dim_pad(v_dim) + 2 * block_n) // 2


def o_in_q(config: dict, head_dim: int, v_dim: int | None = None, dtype_bytes: int = 2) -> bool:
    """Whether a Gluon forward config stages each consumer's output in its Q slot (the
    kernel's O_IN_Q; LARGE_HEAD_DIM_FWD says why): at head dims above 128, where an output
    buffer of its own does not fit in sm_90's shared memory beside the config's Q slots and
    K/V ring. (At d <= 128 the measured kernels keep their own buffer: with one the next
    tile's Q loads while this tile's output is still being stored.)"""
    v_dim = gluon_v_dim(head_dim, v_dim) or head_dim  # (d = 512: the kernel's V half)
    boxes, width = qk_boxes(head_dim)
    if max(head_dim, v_dim) <= 128 or head_dim_pad(v_dim) > boxes * width:
        return False  # (an output wider than the Q slot could not be staged there)
    need = shared_bytes(head_dim, dtype_bytes, config["block_n"], config["num_stages"],
                        config.get("q_buffers", GLUON_DEFAULT["q_buffers"]),
                        config.get("block_m", CONSUMERS * QUERY_ROWS_PER_CONSUMER)
                        // QUERY_ROWS_PER_CONSUMER, v_dim)
    return need > GLUON_SHARED_BYTES


def bwd_shared_bytes(head_dim: int, dtype_bytes: int, block_m: int, num_buffers: int) -> int:
    """Shared memory of a Gluon backward tile, from templates/gluon/bwd.py.j2's allocations:
    the Q/dO ring (each slot a [block_m, d] tile of Q and of dO, and fp32 LSE and D for its
    rows), the program's K and V ([64, d] per consumer), every consumer's dS^T
    double-buffered ([64, block_m] each), the fp32 dQ staging tiles of the TMA reduce-adds
    ([block_m, d / CONSUMERS] per consumer), and 1 KiB for the rest. The sm_90 compile
    (flashgen/gluon_compile.py, Triton 3.6.0) reports 544-608 bytes beyond the tiles
    (mbarriers, the partitions' arguments, alignment), so this is 416-480 bytes over:

        d    block_m  ring   estimate   compiled
        128  64       2      198656     198176     (the default)
        128  64       3      231936     231520     (fits the H100's 232448)
        128  128      2      330752     330272
        64   64       2      116736     116256
        64   64       4      150528     150112
        64   128      2      199680     199200
        64   128      3      233472     233056     (does not fit)
    """
    d = head_dim_pad(head_dim)
    keys = CONSUMERS * KEY_ROWS_PER_CONSUMER
    ring = num_buffers * (2 * block_m * d * dtype_bytes + 2 * block_m * 4)
    kv = 2 * keys * d * dtype_bytes
    ds = 2 * keys * block_m * dtype_bytes
    dq = block_m * d * 4
    return ring + kv + ds + dq + 1024


def bwd_config_reason(config: dict, head_dim: int, dtype_bytes: int,
                      sram_bytes: int, v_dim: int | None = None) -> str | None:
    """Why a Gluon backward launch config cannot run (None when it can): the backward's
    counterpart of config_reason. The program's keys are the consumers' (block_n), the
    query step is one or two wgmma extents (block_m), and the whole tile must fit in one
    block's shared memory (bwd_shared_bytes; the large head dims: large_bwd_config_reason)."""
    if large_bwd(head_dim, v_dim):
        return large_bwd_config_reason(config, head_dim, v_dim, dtype_bytes, sram_bytes)
    keys = CONSUMERS * KEY_ROWS_PER_CONSUMER
    if config.get("block_n") != keys:
        return f"block_n must be {CONSUMERS} consumers x {KEY_ROWS_PER_CONSUMER} keys"
    if config.get("num_warps") != 4:
        return "num_warps must be 4 (one warpgroup per partition)"
    if config.get("block_m") not in GLUON_BWD_BLOCK_MS:
        return ("block_m must be 64 or 128 (the query rows of a step are the M extent of "
                "the dQ product: at least one warpgroup's 64)")
    if config.get("num_stages") not in GLUON_BWD_STAGES:
        return "num_stages (the Q/dO ring depth) must be 2, 3 or 4"
    if str(config.get("regs", REG_SPLITS[0])) not in REG_SPLITS:
        return f"regs must be one of {', '.join(REG_SPLITS)} (consumer/producer per thread)"
    need = bwd_shared_bytes(head_dim, dtype_bytes, config["block_m"], config["num_stages"])
    if config.get("philox_split"):  # (a dropout variant's: the others ignore the key)
        need += PHILOX_SPLIT_SHARED_BYTES
    if need > sram_bytes:
        return f"needs {need} bytes of shared memory, the GPU has {sram_bytes}"
    return None


def consumer_reason(config: dict, consumers: tuple = (CONSUMERS,)) -> str | None:
    """Why a Gluon forward config's tile and register split do not match the consumer
    warpgroups the kernel has (`consumers`, fwd_consumer_counts): None when they do. The
    runtime checks a launch config with it too, so that a forced or tuned config the kernel
    has no partitions for is an error, not a kernel that starves its registers."""
    rows = tuple(c * QUERY_ROWS_PER_CONSUMER for c in consumers)
    if config.get("block_m") not in rows:
        return (f"block_m must be {' or '.join(map(str, rows))} (consumer warpgroups x "
                f"{QUERY_ROWS_PER_CONSUMER} rows) for this kernel")
    n_consumers = config["block_m"] // QUERY_ROWS_PER_CONSUMER
    splits = THREE_CONSUMER_REGS if n_consumers == 3 else REG_SPLITS
    if str(config.get("regs", REG_SPLITS[0])) not in splits:
        return (f"regs must be one of {', '.join(splits)} with {n_consumers} consumers "
                "(consumer/producer per thread)")
    return None


def config_reason(config: dict, head_dim: int, dtype_bytes: int, sram_bytes: int,
                  consumers: tuple = (CONSUMERS,), v_dim: int | None = None) -> str | None:
    """Why a Gluon launch config cannot run (None when it can): the tile shape is fixed by
    the warpgroups (`consumers`: the counts the variant's kernel is rendered for,
    fwd_consumer_counts), and the whole tile must fit in one block's shared memory (v_dim:
    V's head dim where it is not Q's; at the large head dims the output may be staged in
    the Q slots, o_in_q)."""
    reason = consumer_reason(config, consumers)
    if reason is not None:
        return reason
    n_consumers = config["block_m"] // QUERY_ROWS_PER_CONSUMER
    if config.get("num_warps") != 4:
        return "num_warps must be 4 (one warpgroup per partition)"
    fp8 = dtype_bytes == 1  # (e4m3 Q, K, V: O is bf16, P an e4m3 operand)
    v_dim = gluon_v_dim(head_dim, v_dim)  # (d = 512: the kernel's V half)
    if is_d512(head_dim, v_dim):
        if ((config.get("block_n"), config.get("num_stages")) not in D512_FWD_TILES
                or config.get("poly_exp2", 0) not in D512_POLY_EXP2):
            return (f"at Q/K 512 (block_n, num_stages) must be one of {D512_FWD_TILES} and "
                    f"poly_exp2 one of {D512_POLY_EXP2} (families_large)")
    elif config.get("block_n") not in ((64, 128, 256) if fp8 else (64, 128)):
        return ("block_n must be 64 or 128 (S is one wgmma N extent; 256 spills"
                + (", but for fp8 at d <= 64: FWD_REG_OVERHEAD)" if fp8 else ")"))
    elif config.get("num_stages") not in (2, 3, 4):
        return "num_stages (the K/V ring depth) must be 2, 3 or 4"
    q_buffers = config.get("q_buffers", GLUON_DEFAULT["q_buffers"])
    if q_buffers not in (1, 2):
        return "q_buffers (Q slots per consumer) must be 1 or 2"
    held = fwd_accumulator_regs(config["block_n"], v_dim or head_dim, fp8)
    if held + (FWD_REG_OVERHEAD if fp8 else 0) > regs(config)[0]:
        return (f"block_n {config['block_n']} at this head dim: O, S and P alone take {held} "
                f"registers a consumer thread{f' (and ~{FWD_REG_OVERHEAD} the rest)' if fp8 else ''}, "
                f"the split gives {regs(config)[0]}")
    reason = overlap_reason(config, head_dim, v_dim, dtype_bytes)
    if reason is not None:
        return reason
    staged = o_in_q(config, head_dim, v_dim, dtype_bytes)
    need = shared_bytes(head_dim, dtype_bytes, config["block_n"], config["num_stages"],
                        q_buffers, n_consumers, v_dim, staged)
    if need > sram_bytes:
        return f"needs {need} bytes of shared memory, the GPU has {sram_bytes}"
    return None


def triton_ok(version: str) -> bool:
    return any(version == v or version.startswith(v + ".") for v in GLUON_TRITON)


# ----------------------------------------------------------------------------------------
# The persistent forward's tile order under a band mask
# ----------------------------------------------------------------------------------------
# A causal tile's cost grows with its query block, so how the tiles are dealt to the
# persistent programs decides when the last one finishes. Dealing a longest-first list
# back and forth in rounds of one tile a program evens the totals out only while a round's
# tiles have similar lengths; the head groups that keep K/V in L2 restart the list from
# the longest tiles every group, a round then straddles two groups, and the busiest program
# got 1.18-1.20x the mean at d=128 (B, N) = (8, 2k), (4, 4k), (1, 16k) -- where the causal
# forward ran at 0.79-0.82 of the non-causal one's TFLOP/s on the H100. The runtime
# therefore deals such calls on the host, once per call signature: head groups of equal
# size, each group's tiles longest first, and each round of P tiles (P programs) handed out
# longest tile to least-loaded program. The same cost model puts the busiest program
# within 2% of the mean on those shapes. The kernel reads its tiles from the table.
TILE_FIXED_COST = 1.0  # a tile's own cost (Q load, epilogue, stores) in key-block units


def band_tile_blocks(m_blk: int, block_m: int, block_n: int, n_q: int, n_k: int, lo: int,
                     hi: int, mask_left: bool, mask_right: bool) -> int:
    """Key blocks the Gluon forward visits for query block m_blk under the band
    i + lo <= j <= i + hi (the kernel's _key_range)."""
    m_start = m_blk * block_m
    m_last = min(m_start + block_m, n_q) - 1
    first, end = 0, n_k
    if mask_left:
        first = (max(m_start + lo, 0) // block_n) * block_n
    if mask_right:
        end = min(max(m_last + hi + 1, 0), n_k)
    first = min(first, end)
    return -(-(end - first) // block_n)


def band_head_groups(batch_heads: int, head_group: int, kv_group: int) -> list[range]:
    """The (batch, query head) rows of each L2 head group, in walk order: as few groups as
    head_group allows, cut to sizes that differ by at most one K/V head (kv_group query
    heads, never split), so that no small group is left over at the end."""
    units = batch_heads // kv_group  # (batch, K/V head) pairs; bh = unit * kv_group + i
    n_groups = -(-units // max(1, head_group // kv_group))
    base, extra = divmod(units, n_groups)
    groups, first = [], 0
    for g in range(n_groups):
        size = (base + (g < extra)) * kv_group
        groups.append(range(first, first + size))
        first += size
    return groups


def band_tile_order(batch_heads: int, num_m: int, costs, head_group: int, kv_group: int,
                    programs: int) -> list[int]:
    """The table a persistent Gluon forward walks under a band mask: `programs` + 1
    offsets, then every tile (bh * num_m + m_blk) once, program p's tiles in
    [offsets[p], offsets[p + 1]) in the order it runs them. `costs[m_blk]` is a query
    block's cost (every head's is the same); head_group query heads (a multiple of
    kv_group, the query heads that share a K/V head) share L2 (band_head_groups)."""
    levels = sorted(range(num_m), key=lambda m: (-costs[m], -m))
    tiles = [(m, bh) for group in band_head_groups(batch_heads, head_group, kv_group)
             for m in levels for bh in group]
    load = [0.0] * programs
    mine: list[list[int]] = [[] for _ in range(programs)]
    for start in range(0, len(tiles), programs):
        chunk = sorted(tiles[start:start + programs], key=lambda t: -costs[t[0]])
        idle = sorted(range(programs), key=lambda p: (load[p], p))
        for (m, bh), p in zip(chunk, idle):
            load[p] += costs[m] + TILE_FIXED_COST
            mine[p].append(bh * num_m + m)
    offsets = [0]
    for lst in mine:
        offsets.append(offsets[-1] + len(lst))
    return offsets + [t for lst in mine for t in lst]
