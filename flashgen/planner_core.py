"""Tile planner: hardware facts -> feasible Triton tile configurations for attention kernels.

This module imports ONLY the Python standard library.  Its source file is copied verbatim into
every generated package, where at run time on an untuned GPU it picks a feasible config from the
actual device's shared memory and SM count.  It is deterministic (no randomness, no dict-order or
float-tie dependence: ties are broken on the config tuple) and cheap (375 candidates, pure
arithmetic); callers cache the result per (variant, device).

Kinds
-----
``fwd``     FlashAttention-2 forward: one program owns ``block_m`` query rows (kept resident) and
            streams K/V blocks of ``block_n`` rows through a software pipeline.
``bwd``     FlashAttention-2 backward (dK/dV pass): one program owns a K/V block of ``block_n`` rows
            (resident, with its dK/dV accumulators) and streams Q/dO blocks of ``block_m`` rows.
``decode``  Single-token decode: like ``fwd``, but the query side is tiny (1 row per head, or a
            packed GQA group), so warps split the K/V block instead of the query rows.

Shared-memory model (an ESTIMATE; against Triton's real allocation on the H100 it was
20-50% above it for the configs measured, 6a1ef70)
------------------------------------------------------------------------------------
All tiles are ``rows x d`` with ``d`` = head dim padded to a multiple of 16, times ``dtype_bytes``:

* fwd:           Q tile                   block_m * d
                 + K and V per stage      num_stages * 2 * block_n * d
                 + P staged for P @ V     block_m * block_n
* decode:        its own, measured (decode_smem_estimate): K and V for num_stages - 1
                 stages (num_stages on a 64-row wgmma tile), within 16% above the compiler
* bwd:           K and V tiles            2 * block_n * d
                 + Q and dO per stage     num_stages * 2 * block_m * d
                 + P and dS staging       2 * block_m * block_n
                   (fp32 inputs instead: a second copy of K and V, 2 * block_n * d -- the
                   tf32x3 dots' operand split; Triton 3.6 offline for sm_90, d = 64 and 128:
                   the model is then within 256 B above the compiler, where the 16-bit
                   form was 23-25% under it)
                 (all the above x dtype_bytes)
                 + fp32 LSE and D rows    num_stages * 2 * block_m * 4

Triton may reuse/alias buffers (making the real number smaller) or add layout-conversion scratch
(making it larger); the model is deliberately simple and slightly conservative.

Register model (fp32 accumulator + state elements per thread, also an estimate)
-------------------------------------------------------------------------------
* fwd:           (O accumulator block_m*d + score tile block_m*block_n + m_i,l_i 2*block_m)
                 / (32*num_warps) + REG_OVERHEAD
* decode:        the larger of that and the split reduction's (the accumulator plus a chunk
                 of partial outputs), capped at DECODE_MAX_REGS (decode_regs_estimate)
* bwd:           (dK,dV accumulators 2*block_n*d + the two live score tiles P^T and dP^T
                 2*block_m*block_n + LSE,D 2*block_m) / (32*num_warps) + REG_OVERHEAD
A config whose estimate exceeds MAX_ACC_REGS (200 of the 255 architectural registers; the rest is
needed for MMA operand fragments, addresses and temporaries) is rejected as spilling. An fp32
forward on Hopper also holds tf32x3's hi/lo parts of Q (2 * block_m * d more), capped at
FP32_FWD_MAX_REGS (calibrated offline; see the constant).

Architecture (``arch``: the compute capability as an integer, 80 for sm_80; DEFAULT_ARCH, the
H100's 90, when not given).  The 200 above was calibrated on the H100, where wgmma reads its
operands from shared memory.  Before Hopper (arch < 90) mma.sync takes both operands from
registers, so the tiles that stay resident across the loop (Q in the forward, K and V in the
backward) and the operand fragments of every streamed tile compete with the accumulators.
Measured offline with Triton 3.6.0's ptxas for sm_80 and sm_89 (docs/OTHER_GPUS.md,
benchmarks/offline_sweep.py; worst-case variants: sliding window with dropout):

* the accumulator cap is MMA_SYNC_MAX_ACC_REGS (85) instead of 200: no forward tile at or below
  85 spilled; at 101 and above some did;
* the backward runs unpipelined (num_stages 1): every dK/dV tile with 2 or 3 stages spilled
  (likely: the pipeline keeps the next Q/dO block's addresses and masks live), while the same tiles at
  one stage did not, at estimates up to 85;
* past d = 64 the backward lets two warps share a 16-row MMA tile across the head dim (as it
  does past d = 128 on every GPU): with 16 rows per warp the dK/dV accumulators alone are
  d registers per thread, and every such tile spilled at d = 128 (d = 80 and 96 follow the
  same arithmetic; they were not compiled).

That model covers head dims up to MMA_SYNC_MAX_HEAD_DIM (128), what was measured; past it no
tile meets the cap, so wider heads keep the H100's model before Hopper too, and may spill
(mma_sync_model; `flashgen plan` says so).
"""

import math
import re
from dataclasses import dataclass

KINDS = ("fwd", "bwd", "decode")

BLOCK_SIZES = (16, 32, 64, 128, 256)
WARP_COUNTS = (2, 4, 8)
STAGE_COUNTS = (1, 2, 3, 4, 5)

MAX_ACC_REGS = 200        # fp32 accumulator/state registers per thread before we call it spilling
DEFAULT_ARCH = 90         # compute capability planned for when none is given: the H100's
MIN_ARCH = 75             # the oldest compute capability the model covers (Turing's mma.sync)
HOPPER = 90               # wgmma (operands from shared memory) from here on
MMA_SYNC_MAX_ACC_REGS = 85  # the cap before Hopper, where mma.sync operands live in registers
MMA_SYNC_MAX_HEAD_DIM = 128  # the widest (padded) head dim that cap was measured at
# fp32 forward on Hopper (tf32x3): the Q operand is split into tf32 hi and lo parts held in
# registers beside the accumulators, two more block_m x d tiles a thread's share of which
# the accumulator model does not count. Triton 3.6, offline sm_90, the estimate with the
# split -> spill stores a thread: d=128 64x32 w4 213 -> 80 B, 64x64 w4 229 -> 532 B;
# d=64 128x64 w8 133 -> 0 B, 128x64 w4 262 -> 1544 B; d=128 64x64 w2 454 -> 97796 B (the
# old model let the planner choose that one). The cap keeps the first three.
FP32_FWD_MAX_REGS = 260
REG_OVERHEAD = 4          # loop counters, scale, row bases... (most addressing is in uniform regs)
ROWS_PER_WARP = 16        # an MMA tile has 16 rows: fewer rows per warp leaves warps idle
# decode's 16 query rows are one MMA tile (mma.sync m16n8k16: its BLOCK_M < 64 takes no
# wgmma, on Hopper either), so its warps split the columns of each product -- the score
# tile's block_n keys, and V's head dim -- 8 columns an MMA (the TTGIR's warpsPerCTA is
# [1, num_warps] below 64 rows). DeepSeek's latent decode (d 576 / v 512) needs 4 warps at
# a 32-key block: the 16 x 512 fp32 output at 2 warps spilled 1.7 KB a thread and at 4
# compiled to 255 registers without a spill (sm_90, Triton 3.6 offline; docs/MODS.md); a
# taller stacked tile counts its 16-row MMA tiles too (evaluate)
MMA_COLS_PER_WARP = 8
# decode_regs_estimate's cap (the decode kind's own model: the accumulator and the split
# reduction's chunk, not the query operand, which the compiler keeps in shared memory).
# Triton 3.6 for sm_90 offline, every decode tile of 16-64 rows, 16-128 keys, 4 and 8
# warps swept at d 64, 128, 192 / 128 and 576 / 512 (benchmarks/offline_sweep.py, rows in
# benchmarks/results/offline/decode_sweep_*_sm90.jsonl; 148a0ee): no tile estimated at
# <= 164 spilled more than 36 B, every tile estimated at >= 196 spilled 112 B or more
# (64 x 128 at d 128, 4 warps; 32 rows at 576, 4 warps: 1.1 KB)
DECODE_MAX_REGS = 180
# before Hopper (sm_80 offline, d 128): 16 x 128 at 4 warps (estimated 148) did not spill,
# 32 x 128 at 4 warps (164) spilled 12 B
DECODE_MMA_SYNC_MAX_REGS = 150
# Past this padded head dim a decode tile runs at most 2 stages: the third spilled 4-12 B a
# thread at the tiles the planner would pick (d 192 / 128 16 x 128, 4 warps; 576 / 512
# 16 x 32, 4 warps with V apart -- V as K's view did not), sm_90 offline
DECODE_WIDE_HEAD_DIM = 128
DECODE_WIDE_MAX_STAGES = 2
# From this padded head dim a stacked tile of 32 rows or more takes 8 warps: at 4, 32 x 128
# spilled 28 B at d 128 (no mask) and 4-28 B at d 192 / 128, and every 32-row tile 1.1 KB at
# 576 / 512; at 8 warps none did (at d 64, 4 warps did not spill at 32 or 64 rows)
DECODE_TALL_HEAD_DIM = 128
DECODE_TALL_WARPS = 8
MAX_TARGET_TILE = 128     # cap on the FA-1-derived target tile, see _targets()
# Past this padded head dim (up to Gemma 4's 512, the spec's HEAD_DIM_MAX) the fwd / bwd
# tiles are planned by wide_regs_estimate, capped at WIDE_MAX_REGS, and one K/V stage is a
# candidate (a 32-key K/V stage is 64 KiB at d = 512: a 101 KiB GPU fits no pipelined
# backward). Calibrated with Triton 3.6 for sm_90 offline, bf16 d = 512 (estimate ->
# spill stores a thread): fwd 32x32 w8 s2/s3 105 -> 0 (184 / 245 registers), 32x32 w4
# s3 205 -> 0 (255), 64x32 w8 s2 205 -> 120 B, 64x16 w8 s2 201 -> 80 B; bwd (dK/dV) 16x16
# w8 s2 132 -> 0, s3 132 -> 20 B, 32x16 w8 s2 168 -> 40 B, 16x32 w8 s2 232 -> 16 B,
# 32x32 w8 s2 269 -> 88-276 B, 16x16 w4 s2 265 -> 188 B. Hence the cap, and 2 stages at
# most in the backward.
WIDE_HEAD_DIM = 256
WIDE_MAX_REGS = 150
WIDE_BWD_MAX_STAGES = 2

# Score weights (cost: lower is better).  One unit = one "octave" (factor 2) or one stage.
W_RESIDENT = 12           # distance of the resident tile dim from its target, per octave
W_STREAMED = 8            # distance of the streamed tile dim from its target, per octave
W_STAGES = 3              # distance from the preferred pipeline depth, per stage
W_WARPS = 1               # warp-count preference, per octave

# bwd prefers a deep pipeline: each step loads two streamed tiles (Q and dO) and the H100
# sweep (its rows in 6a1ef70) measured 4 stages 10-30% faster than 2 at the chosen tiles.
PREFERRED_STAGES = {"fwd": 3, "bwd": 4, "decode": 3}


@dataclass(frozen=True)
class TileConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int

    def as_dict(self) -> dict:
        return {
            "block_m": self.block_m,
            "block_n": self.block_n,
            "num_warps": self.num_warps,
            "num_stages": self.num_stages,
        }

    def __str__(self) -> str:
        return f"{self.block_m}x{self.block_n} w{self.num_warps} s{self.num_stages}"


@dataclass(frozen=True)
class Candidate:
    config: TileConfig
    smem_bytes: int            # estimated shared memory
    regs_per_thread: int       # estimated fp32 accumulator/state registers per thread
    rejected: str | None       # None if feasible, else a one-line reason


@dataclass(frozen=True)
class Plan:
    kind: str
    head_dim: int
    head_dim_padded: int
    dtype_bytes: int
    sram_bytes: int
    sm_count: int | None
    fa1_bc: int
    fa1_br: int
    chosen: TileConfig
    candidates: tuple[Candidate, ...]  # feasible ones ranked best-first, then the rejected ones
    arch: int = DEFAULT_ARCH           # the compute capability planned for (80 = sm_80)
    score_bytes: int = 0               # a mod's [q, kv] tile per score element (smem_estimate)


# ----------------------------------------------------------------------------------------------
# Head-dim helpers and the FA-1 rule
# ----------------------------------------------------------------------------------------------

def padded_head_dim(head_dim: int) -> int:
    """Round ``head_dim`` up to a multiple of 16 (the MMA K granularity)."""
    if head_dim <= 0:
        raise ValueError(f"head_dim must be positive, got {head_dim}")
    return -(-head_dim // 16) * 16


def head_dim_chunks(head_dim: int) -> tuple[tuple[int, int], ...]:
    """Split the 16-padded head dim into power-of-two chunks >= 16, largest first, as
    (offset, size) pairs, so d=80 -> ((0,64),(64,16)); 96 -> ((0,64),(64,32)); 128 -> ((0,128),);
    24 -> ((0,32),); 192 -> ((0,128),(128,64)); 256 -> ((0,256),).

    Why: tl.arange needs powers of two; tiling the head dim in chunks avoids padding 80 up to 128
    (60% wasted MMA work).  The chunks are the binary decomposition of the padded dim, which is a
    multiple of 16, so every chunk is a power of two >= 16."""
    remaining = padded_head_dim(head_dim)
    chunks = []
    offset = 0
    while remaining:
        size = 1 << (remaining.bit_length() - 1)
        chunks.append((offset, size))
        offset += size
        remaining -= size
    return tuple(chunks)


def decode_split_pairs(v_dim_padded: int) -> int:
    """(row, split) pairs of partial outputs the decode kernel's split reduction loads at
    once ([BLOCK_M, SPLIT_CHUNK, V] fp32, templates/decode.py.j2's SPLIT_PAIRS): a 16-row
    tile's 8 splits up to V dim 128; past it 512 // V (a power of two) splits: at V 512, 2
    spilled 52 B a thread at 16 x 32, 4 warps, and 1 did not (sm_90 offline)."""
    if v_dim_padded <= 128:
        return 16 * 8
    return 16 * (1 << (max(1, 512 // v_dim_padded).bit_length() - 1))


def decode_split_chunk(block_m: int, v_dim_padded: int) -> int:
    """Splits the reduction of a BLOCK_M-row decode tile loads per step (at least 1)."""
    return max(1, decode_split_pairs(v_dim_padded) // block_m)


# A decode call stacks the KV_GROUP x N_q query rows sharing a KV head into one tile of
# at most this many rows (stacked_decode_tile); more rows take several row blocks, each
# re-reading the keys and values.
MAX_STACKED_ROWS = 64


def stacked_decode_tile(config: dict, rows: int, head_dim: int, dtype_bytes: int,
                        sram_bytes: int, arch: int = DEFAULT_ARCH,
                        score_bytes: int = 0) -> dict:
    """The launch config of a decode call with ``rows`` = KV_GROUP x N_q stacked query rows:
    ``config`` (planned or tuned for a 16-row tile) with block_m doubled towards ``rows``
    (at most MAX_STACKED_ROWS) while the decode model accepts the taller tile -- with the
    config's warps, else more, and its stages, else down to 2 where shared memory runs out
    -- so every K/V byte is read by as few row blocks as compile without spilling. A small
    group keeps the small tile (16 rows: the config itself). ``head_dim``: the larger of
    Q's and V's. Sm_90 offline (benchmarks/results/offline/decode_sweep_*_sm90.jsonl,
    148a0ee): at DeepSeek's 576 / 512, 128 heads take 32 x 32 at 8 warps (4 row blocks; 4
    warps spilled 1.1 KB and 64 rows 1.6 KB); at d 128, 64 rows take 64 x 128 at 8 warps.
    ``score_bytes``: a mod's [q, kv] tile (smem_estimate)."""
    bm, bn = config["block_m"], config["block_n"]
    warps, stages = config["num_warps"], config["num_stages"]
    want = min(1 << max(int(rows) - 1, 0).bit_length(), MAX_STACKED_ROWS)
    d = padded_head_dim(head_dim)
    while bm < want:
        grown = None
        for w in (w for w in WARP_COUNTS if w >= warps):
            for st in range(stages, min(stages, 2) - 1, -1):
                cand = evaluate("decode", TileConfig(2 * bm, bn, w, st), d, dtype_bytes,
                                sram_bytes, arch, score_bytes)
                if cand.rejected is None:
                    grown = (w, st)
                    break
            if grown:
                break
        if grown is None:
            break
        bm, (warps, stages) = 2 * bm, grown
    return {**config, "block_m": bm, "num_warps": warps, "num_stages": stages}


# batch_invariant=True (issue 49) pins one tile a decode variant: its kernel folds each
# split into a second [block_m, V] fp32 accumulator beside the key loop's. At d 128 (sm_90
# offline, Triton 3.6, the fold's forms) 64 x 64 at 8 warps ran in 207-211 registers with
# no spill, where 64 x 128 at 8 warps spilled 44-212 B and 64 x 64 at 4 warps or 128 x 64
# at 8 warps 8-56 B: this model (both accumulators, the score tile, four row vectors)
# gave 85 for the first and 101-166 for the others. A quantized cache with per-token scales
# (32 rows: KV_QUANT_MAX_STACKED_ROWS) spilled 24-56 B at 32 x 128, 8 warps, 3 stages, and
# with a window 12-20 B at 2 stages; 32 x 64 at 2 stages none.
INVARIANT_MAX_REGS = 90
INVARIANT_TOKEN_SCALE_TILE = (64, 2)  # (block_n, num_stages) at most


def invariant_decode_tile(config: dict, head_dim: int, v_dim: int, dtype_bytes: int,
                          sram_bytes: int, arch: int = DEFAULT_ARCH, score_bytes: int = 0,
                          rows: int = MAX_STACKED_ROWS, token_scales: bool = False) -> dict:
    """The batch-invariant kernel's launch config: the tallest stacked tile
    (stacked_decode_tile at ``rows``) at 8 warps, then its key block and then its rows
    halved (not below 16), until the fold's registers fit INVARIANT_MAX_REGS; with a
    quantized cache's per-token scales, at most INVARIANT_TOKEN_SCALE_TILE."""
    cfg = stacked_decode_tile(config, rows, max(head_dim, v_dim), dtype_bytes, sram_bytes,
                              arch, score_bytes)
    dv = padded_head_dim(v_dim)
    while True:
        bm, bn = cfg["block_m"], cfg["block_n"]
        elems = 2 * bm * dv + bm * bn + 4 * bm
        if -(-elems // (32 * cfg["num_warps"])) + REG_OVERHEAD <= INVARIANT_MAX_REGS:
            break
        if cfg["num_warps"] < WARP_COUNTS[-1]:
            cfg = {**cfg, "num_warps": WARP_COUNTS[-1]}
        elif bn > 16:
            cfg = {**cfg, "block_n": bn // 2}
        elif bm > 16:
            cfg = {**cfg, "block_m": bm // 2}
        else:
            break
    if token_scales:
        bn, stages = INVARIANT_TOKEN_SCALE_TILE
        cfg = {**kv_quant_tile(cfg, "decode", True), "block_n": min(cfg["block_n"], bn),
               "num_stages": min(cfg["num_stages"], stages)}
    return cfg


# A quantized KV cache (fp8 / int8, issue 49) is converted to the queries' dtype in
# registers, which the plain configs' registers did not leave room for everywhere (sm_90
# offline, d = 128, Triton 3.6, the forms flashgen/offline.py compiles): decode's 64-row
# tile spilled 12 B a thread (fp8, a scale per head) and 132 / 224 B (per-token scales),
# 32 rows none; with per-token scales (two [BLOCK_N] vectors a key block) decode's 16 x 128
# at 4 warps spilled 24-44 B (8 warps: none) and the paged prefill's 128 x 128 at 8 warps
# 308 / 320 B (128 x 64: none). Not yet timed on a GPU against other fixes.
KV_QUANT_MAX_STACKED_ROWS = 32


def kv_quant_tile(config: dict, kind: str, token_scales: bool) -> dict:
    """The launch config of a `kind` ("decode" or "fwd") kernel reading a quantized KV
    cache, from the plain one: with per-token scales, decode takes 8 warps at key blocks of
    128 or more, and the forward at most 64 keys a block (see KV_QUANT_MAX_STACKED_ROWS's
    note)."""
    if not token_scales:
        return config
    if kind == "decode" and config["num_warps"] < 8 and config["block_n"] >= 128:
        return {**config, "num_warps": 8}
    if kind == "fwd" and config["block_n"] > 64:
        return {**config, "block_n": 64}
    return config


# `flashgen tune` times decoding with 8 sequences x 8 KV heads = 64 programs per split; a
# tuned num_splits is rescaled at run time to keep the same total grid for other shapes.
TUNED_DECODE_PROGRAMS = 64

DQ_MIRROR = "mirror"


def dq_tile(config) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of the backward's dQ kernel from a launch
    config: its `dq_tile` knob "MxNwWsS" (M query rows resident, N keys per step), or by
    default ("mirror") the dK/dV tile with its roles swapped -- block_n query rows
    resident, block_m keys per step."""
    value = config.get("dq_tile", DQ_MIRROR)
    if value == DQ_MIRROR:
        return config["block_n"], config["block_m"], config["num_warps"], config["num_stages"]
    return parse_tile(value)


def parse_tile(text: str) -> tuple[int, int, int, int]:
    """(block_m, block_n, num_warps, num_stages) of a tile written "MxNwWsS", e.g.
    "128x64w8s3" (the dq_tile knob's values, `flashgen tune --try`); ValueError otherwise."""
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(\d+)", text.strip())
    if match is None:
        raise ValueError(f"{text!r} is not a tile BLOCK_MxBLOCK_NwWARPSsSTAGES such as 64x128w8s3")
    m, n, w, stages = map(int, match.groups())
    return m, n, w, stages


def fa1_blocks(sram_bytes: int, head_dim: int, dtype_bytes: int) -> tuple[int, int]:
    """FlashAttention-1 rule: with M = SRAM size in elements (sram_bytes // dtype_bytes),
    Bc = ceil(M / (4 d)), Br = min(Bc, d).  Returns (Bc, Br)."""
    if head_dim <= 0 or dtype_bytes <= 0 or sram_bytes <= 0:
        raise ValueError("sram_bytes, head_dim and dtype_bytes must be positive")
    m = sram_bytes // dtype_bytes
    bc = -(-m // (4 * head_dim))
    return bc, min(bc, head_dim)


# ----------------------------------------------------------------------------------------------
# Resource models
# ----------------------------------------------------------------------------------------------

def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown kernel kind {kind!r}; expected one of {KINDS}")


def decode_wgmma(block_m: int, arch: int = DEFAULT_ARCH) -> bool:
    """Whether Triton compiles a decode tile's products as Hopper wgmma (64-row tiles on
    sm_90 and up; seen in the TTGIR, Triton 3.6) rather than mma.sync (every warp along the
    key / value columns, warpsPerCTA [1, num_warps])."""
    return block_m >= 64 and arch >= HOPPER


def smem_estimate(kind, block_m, block_n, head_dim_padded, dtype_bytes, num_stages,
                  score_bytes: int = 0, arch: int = DEFAULT_ARCH) -> int:
    """Estimated shared memory in bytes (see the module docstring for the model).
    ``score_bytes``: bytes a mod reads per score element (e.g. 4 for an fp32 bias indexed by
    query and key), which the software pipeline stages like K and V: num_stages - 1 more
    [block_m, block_n] tiles (measured offline: an fp32 bias at 128x64, 3 stages, added
    64 KiB to the H100 forward). ``arch``: only the decode model depends on it."""
    _check_kind(kind)
    d = head_dim_padded
    staged = max(num_stages - 1, 0) * block_m * block_n * score_bytes
    if kind == "bwd":
        scratch = 2 * block_n * d if dtype_bytes == 4 else 2 * block_m * block_n
        elems = 2 * block_n * d + num_stages * 2 * block_m * d + scratch
        return elems * dtype_bytes + num_stages * 2 * block_m * 4 + staged
    if kind == "decode":
        return decode_smem_estimate(block_m, block_n, d, d, dtype_bytes, num_stages,
                                    arch) + staged
    elems = block_m * d + num_stages * 2 * block_n * d + block_m * block_n
    return elems * dtype_bytes + staged


def decode_smem_estimate(block_m, block_n, head_dim_padded, v_dim_padded, dtype_bytes,
                         num_stages, arch: int = DEFAULT_ARCH) -> int:
    """Shared memory of a decode tile (V read on its own, the costlier form; a latent
    cache's V_IS_K form needs less). Measured with Triton 3.6 for sm_90 (offline, the
    serving form of offline._launches; at d 64, 128 and 576 / 512 within 8 B a key a stage
    above the compiler for every tile of 2 and 3 stages swept -- 16, 32 and 64 rows, 16-128
    keys, 4 and 8 warps -- and above it at one stage;
    benchmarks/results/offline/decode_sweep_*_sm90.jsonl, 148a0ee): the Q tile,
    num_stages - 1 K and V blocks in flight (cp.async into shared memory; one unpipelined)
    and P staged for P @ V; a wgmma tile (decode_wgmma: 64 rows) stages num_stages K/V
    blocks and no P. At least the fp32 accumulator's layout conversion (block_m x V dim x
    4 B), which a one-stage 64-row tile needed. The forward's model (every stage counted, P
    for every tile) was 1.5-2.7x the compiler's at the latent dims and rejected 16 x 32 at 3
    stages (240640 B estimated, 158720 B compiled)."""
    d, dv = head_dim_padded, v_dim_padded
    if decode_wgmma(block_m, arch):
        stages = num_stages
        elems = block_m * d + stages * block_n * (d + dv)
    else:
        stages = max(num_stages - 1, 1)
        elems = block_m * d + stages * block_n * (d + dv) + block_m * block_n
    # + two 4-byte vectors a key a stage: a mod's per-key loads (a document id, a padding
    # flag), which the pipeline stages with K (the document mod's +128 B a stage at 32 keys)
    return max(elems * dtype_bytes + stages * block_n * 8, block_m * dv * 4)


def regs_estimate(kind, block_m, block_n, head_dim_padded, num_warps) -> int:
    """Estimated fp32 accumulator/state registers per thread (see the module docstring)."""
    _check_kind(kind)
    d = head_dim_padded
    if kind == "bwd":
        # dK, dV accumulators plus the two live score tiles P^T and dP^T
        elems = 2 * block_n * d + 2 * block_m * block_n + 2 * block_m
    elif kind == "decode":
        return decode_regs_estimate(block_m, block_n, d, d, num_warps)
    else:
        elems = block_m * d + block_m * block_n + 2 * block_m
    return -(-elems // (32 * num_warps)) + REG_OVERHEAD


def decode_regs_estimate(block_m, block_n, head_dim_padded, v_dim_padded, num_warps) -> int:
    """Registers a thread of a decode tile holds at its peak, in 32-bit words: the larger of
    the key loop's (the fp32 output accumulator, the score tile, m and l) and the split
    reduction's (the accumulator it restarts plus a [block_m, decode_split_chunk, V] chunk
    of partial outputs), over the tile's threads. The reduction is the peak of every
    stacked tile of 32 rows or more (it spilled where the loop alone did not: d 128, 32 x
    128, 4 warps, 620 B with 8 splits a step, 0 without the reduction; sm_90 offline)."""
    threads = 32 * num_warps
    loop = block_m * v_dim_padded + block_m * block_n + 2 * block_m
    reduction = block_m * v_dim_padded * (1 + decode_split_chunk(block_m, v_dim_padded))
    return -(-max(loop, reduction) // threads) + REG_OVERHEAD


def _warp_dim(kind: str) -> str:
    # The tile dimension the warps split: query rows in fwd; the resident K/V rows in bwd; the K/V
    # block's columns of the score tile in decode (its query side is a single 16-row MMA tile,
    # too small to split; MMA_COLS_PER_WARP).
    return "block_m" if kind == "fwd" else "block_n"


def warps_across_d(kind: str, d: int, in_regs: bool = False) -> int:
    """How many warps may share one 16-row MMA tile, side by side along the head dim
    (fwd / bwd; Triton lays warps along the accumulator's columns when its rows run out).
    Past d = 128 the backward's dK/dV accumulators (2 x block_n x d fp32) only fit in
    registers that way, as FA-2's d = 256 backward does: two warps. Before Hopper, where the
    resident K and V tiles are in registers too, past d = 64 (16 rows per warp would hold d
    accumulator registers a thread, over the cap with the score tiles from d = 80 on). Past
    WIDE_HEAD_DIM a 16-row tile's fp32 output alone is 256 registers a thread of one warp
    at d = 512, so any warp count may share a tile's rows there (the forward's 32 x 32 at 8
    warps, the backward's 16 x 16 at 8 compiled without spills, sm_90) and the register
    cap (wide_regs_estimate) decides."""
    if d > WIDE_HEAD_DIM and kind in ("fwd", "bwd"):
        return max(WARP_COUNTS)
    if kind != "bwd":
        return 1
    return 2 if d > 128 or (in_regs and d > 64) else 1


def wide_regs_estimate(kind: str, cfg: "TileConfig", d: int, dtype_bytes: int) -> int:
    """Past WIDE_HEAD_DIM (16-bit inputs): regs_estimate plus the MMA operand fragments a
    thread holds in registers -- the forward's Q tile, the backward's K and V (resident)
    and Q and dO (streamed) tiles, two 16-bit elements a register. Triton 3.6 runs these
    tiles' products as mma.sync (wgmma needs 64-row tiles, whose output is 128 registers a
    thread even at 8 warps), which takes its operands from registers as before Hopper."""
    rows = cfg.block_m if kind == "fwd" else 2 * (cfg.block_m + cfg.block_n)
    frags = -(-rows * d * dtype_bytes // (4 * 32 * cfg.num_warps))
    return regs_estimate(kind, cfg.block_m, cfg.block_n, d, cfg.num_warps) + frags


def operands_in_registers(arch: int) -> bool:
    """True before Hopper: mma.sync takes its operands from registers (wgmma, from sm_90 on,
    reads them from shared memory)."""
    return arch < HOPPER


def mma_sync_model(arch: int, head_dim_padded: int) -> bool:
    """Whether the pre-Hopper register model applies: before Hopper, at the head dims it was
    measured for (up to MMA_SYNC_MAX_HEAD_DIM). Past that no tile keeps the fp32 output
    accumulator within its cap (16 rows per warp x d > 128 columns is over 64 registers a
    thread before anything else), so wider heads are planned with the H100's model, and
    may spill before Hopper: format_summary says so."""
    return operands_in_registers(arch) and head_dim_padded <= MMA_SYNC_MAX_HEAD_DIM


def spill_warning(plan: "Plan") -> "str | None":
    """Why the planner cannot promise that ``plan``'s tile compiles without register spills
    on its architecture (None when it can: sm_90 and up, or the measured pre-Hopper cases).
    The offline compile test allows spills only where this says so."""
    if not operands_in_registers(plan.arch):
        return None
    where = arch_name(plan.arch)
    if plan.head_dim_padded > MMA_SYNC_MAX_HEAD_DIM:
        return (f"d = {plan.head_dim} on {where}: past d = {MMA_SYNC_MAX_HEAD_DIM} no tile keeps "
                f"its accumulators within the pre-Hopper cap ({MMA_SYNC_MAX_ACC_REGS} regs/thread), "
                "so it is planned with the H100's model and may spill (not measured)")
    if plan.kind == "bwd" and plan.score_bytes:
        return (f"a mod's [q, kv] tile (e.g. attn_mask's fp32 bias) in the backward on {where}: "
                "the dK/dV kernel holds it and its gradient beside the accumulators; compiled "
                "offline at the planned tiles it spilled 8-56 B/thread (docs/OTHER_GPUS.md), "
                "and the register model counting it leaves no feasible tile, so it may spill")
    if plan.dtype_bytes == 4:
        return (f"fp32 on {where}: tf32x3 splits every operand into two 32-bit halves, four "
                "times the registers of a 16-bit operand; the forward spilled at the planned "
                "tiles when compiled offline (docs/OTHER_GPUS.md), so it may spill")
    return None


def max_acc_regs(arch: int = DEFAULT_ARCH, head_dim_padded: int = 0) -> int:
    """The cap on regs_estimate for a GPU of compute capability ``arch`` (module docstring)."""
    return MMA_SYNC_MAX_ACC_REGS if mma_sync_model(arch, head_dim_padded) else MAX_ACC_REGS


def arch_name(arch: int) -> str:
    return f"sm_{arch}"


def evaluate(kind: str, cfg: TileConfig, d: int, dtype_bytes: int, sram_bytes: int,
             arch: int = DEFAULT_ARCH, score_bytes: int = 0) -> Candidate:
    """The resource model's verdict on one tile for a GPU of compute capability ``arch``:
    its estimates and why it is rejected (``score_bytes``: see smem_estimate)."""
    smem = smem_estimate(kind, cfg.block_m, cfg.block_n, d, dtype_bytes, cfg.num_stages,
                         score_bytes, arch)
    regs = regs_estimate(kind, cfg.block_m, cfg.block_n, d, cfg.num_warps)
    reasons = []
    in_regs = mma_sync_model(arch, d)
    if kind == "bwd" and in_regs:
        # before Hopper the backward's pipeline costs more registers than it saves time
        # in spills: every pipelined dK/dV tile spilled on sm_80/sm_89 (module docstring)
        if cfg.num_stages != 1:
            reasons.append(f"num_stages {cfg.num_stages} on {arch_name(arch)}: the pipelined "
                           "backward spills before Hopper (1 stage)")
    elif cfg.num_stages == 1 and kind in ("fwd", "bwd") and d <= WIDE_HEAD_DIM:
        # (past WIDE_HEAD_DIM one K/V stage is what fits some GPUs: ranked last, not refused)
        reasons.append("num_stages 1: no software pipelining")
    dim = _warp_dim(kind)
    across = warps_across_d(kind, d, in_regs)
    if kind == "decode":
        # the score tile's 16 x MMA_COLS_PER_WARP MMA tiles, at least one a warp (a 16-row
        # tile: MMA_COLS_PER_WARP key columns a warp)
        need = MMA_COLS_PER_WARP * cfg.num_warps // max(cfg.block_m // ROWS_PER_WARP, 1)
        if cfg.block_n < need:
            reasons.append(f"num_warps {cfg.num_warps} needs block_n >= {need} at "
                           f"{cfg.block_m} rows ({MMA_COLS_PER_WARP} key columns per warp "
                           f"and {ROWS_PER_WARP} rows)")
        if d > DECODE_WIDE_HEAD_DIM and cfg.num_stages > DECODE_WIDE_MAX_STAGES:
            reasons.append(f"num_stages {cfg.num_stages} at d = {d} > {DECODE_WIDE_HEAD_DIM}: "
                           f"the loads in flight spill (decode, {DECODE_WIDE_MAX_STAGES} "
                           "stages at most)")
        if (d >= DECODE_TALL_HEAD_DIM and cfg.block_m >= 2 * ROWS_PER_WARP
                and cfg.num_warps < DECODE_TALL_WARPS):
            reasons.append(f"num_warps {cfg.num_warps} at {cfg.block_m} rows and d = {d}: "
                           f"spills (decode from d = {DECODE_TALL_HEAD_DIM}: "
                           f"{DECODE_TALL_WARPS} warps)")
    else:
        need = ROWS_PER_WARP * cfg.num_warps // across
        if getattr(cfg, dim) < need:
            reasons.append(f"num_warps {cfg.num_warps} needs {dim} >= {need} ({ROWS_PER_WARP} rows per warp)")
    cap = (max_acc_regs(arch, d) if kind != "decode" else DECODE_MMA_SYNC_MAX_REGS
           if operands_in_registers(arch) else DECODE_MAX_REGS)
    wide = kind in ("fwd", "bwd") and d > WIDE_HEAD_DIM and dtype_bytes <= 2
    if wide:
        frag_regs = wide_regs_estimate(kind, cfg, d, dtype_bytes)
        if frag_regs > WIDE_MAX_REGS:
            reasons.append(f"accumulator and operand fragments {frag_regs} regs/thread > "
                           f"{WIDE_MAX_REGS} at d = {d}: spills")
        if kind == "bwd" and cfg.num_stages > WIDE_BWD_MAX_STAGES:
            reasons.append(f"num_stages {cfg.num_stages} at d = {d} > {WIDE_HEAD_DIM}: spills "
                           f"(backward, {WIDE_BWD_MAX_STAGES} stages at most)")
    elif regs > cap:
        where = f" on {arch_name(arch)}" if in_regs else ""
        reasons.append(f"accumulator {regs} regs/thread > {cap}{where}: spills")
    elif kind == "fwd" and dtype_bytes == 4 and not in_regs and d <= 128:
        # (past d = 128 no tile passes this; those are planned as before and may spill)
        split = regs + -(-2 * cfg.block_m * d // (32 * cfg.num_warps))
        if split > FP32_FWD_MAX_REGS:
            reasons.append(f"fp32: accumulator and tf32x3's split Q {split} regs/thread > "
                           f"{FP32_FWD_MAX_REGS}: spills")
    if smem > sram_bytes:
        reasons.append(f"smem {smem} B > budget {sram_bytes} B")
    return Candidate(cfg, smem, regs, "; ".join(reasons) if reasons else None)


# ----------------------------------------------------------------------------------------------
# Ranking
# ----------------------------------------------------------------------------------------------

def _floor_pow2(x: int) -> int:
    return 1 << (max(int(x), 1).bit_length() - 1)


def _targets(kind: str, bc: int, br: int) -> tuple:
    """Target (block_m, block_n) derived from the FA-1 rule.

    FA-1 sizes two blocks from SRAM: a large one, Bc (it keeps 4 Bc x d tiles in SRAM), and a small
    one, Br = min(Bc, d).  In FA-1 the large block is the one that stays resident (K/V, outer loop)
    and the small one is streamed (Q, inner loop).  We map them by role, not by name:
      fwd:    resident = Q rows (block_m) <- Bc,  streamed = K/V rows (block_n) <- Br
      bwd:    resident = K/V rows (block_n) <- Bc, streamed = Q/dO rows (block_m) <- Br
      decode: the query side is one 16-row MMA tile (1 row per head, or a packed GQA group);
              the K/V block (block_n) <- Bc.
    Both are floored to a power of two (FA-1 sizes are upper bounds) and clamped to [16, 128]:
    FA-1 assumed the resident block lives in SRAM, whereas in FA-2 its accumulator lives in
    registers, and beyond 128 rows a CTA either spills or needs so many warps that it halves the
    number of CTAs in flight; 128 also matches two 64-row Hopper warpgroup MMAs."""
    def fit(x: int) -> int:
        return min(max(_floor_pow2(x), BLOCK_SIZES[0]), MAX_TARGET_TILE)

    if kind == "fwd":
        return fit(bc), fit(br)
    if kind == "bwd":
        # Each streamed query row brings four tiles against the resident block (Q, dO and
        # the P, dP score rows) where the forward brings one, so the streamed target is
        # Br / 4, but at least 32 rows to keep the MMAs fed. Measured on the H100 (bf16,
        # N=4096, the sweep's rows in 6a1ef70): 32 x 128 beat 64 x 128 by 4% at d=64 and
        # 64 x 128 spilled 142-202 registers.
        return max(fit(br // 4), 32), fit(bc)
    return BLOCK_SIZES[0], fit(bc)


def _cost(kind: str, cfg: TileConfig, target_m: int, target_n: int) -> float:
    """Lower is better.  A sum of simple, independently-motivated terms:

    * tile shape: distance (in octaves) of each tile dim from its FA-1 target.  The resident dim is
      weighted more (W_RESIDENT > W_STREAMED) because it is the one loaded once and reused across the
      whole inner loop, so shrinking it costs more reuse than shrinking the per-iteration block.
    * pipeline depth: distance from the preferred number of stages.  fwd/decode: 3 (enough K/V loads
      in flight to hide HBM latency behind one QK^T + PV step); bwd: 4 (each step loads two
      streamed tiles, Q and dO; measured 10-30% faster than 2 stages on the H100).
    * warps: fwd/bwd prefer FEWER warps: every warp reads the whole streamed tile from shared memory
      for its MMAs, so smem read traffic grows with num_warps; the register cap keeps per-warp
      fragments from spilling.  decode is memory-bound and its MMAs are tiny, so it prefers 4 warps
      (128 threads issuing loads) and does not pay the traffic argument.
    """
    log2 = math.log2
    if kind == "fwd":
        resident, r_target, streamed, s_target = cfg.block_m, target_m, cfg.block_n, target_n
    else:  # bwd: K/V rows resident; decode: the K/V block is the dim that matters most
        resident, r_target, streamed, s_target = cfg.block_n, target_n, cfg.block_m, target_m
    cost = W_RESIDENT * abs(log2(resident) - log2(r_target))
    cost += W_STREAMED * abs(log2(streamed) - log2(s_target))
    cost += W_STAGES * abs(cfg.num_stages - PREFERRED_STAGES[kind])
    if kind == "decode":
        cost += W_WARPS * abs(log2(cfg.num_warps) - 2)
    else:
        cost += W_WARPS * log2(cfg.num_warps)
    return cost


def _rank_key(kind: str, cand: Candidate, target_m: int, target_n: int) -> tuple:
    c = cand.config
    # Ties: bigger tile (more reuse) first, then the config tuple, so the order is total.
    return (_cost(kind, c, target_m, target_n), -(c.block_m * c.block_n),
            c.block_m, c.block_n, c.num_warps, c.num_stages)


# ----------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------

def plan(kind: str, head_dim: int, dtype_bytes: int, sram_bytes: int, sm_count: int | None = None,
         explicit: TileConfig | None = None, arch: int = DEFAULT_ARCH,
         score_bytes: int = 0) -> Plan:
    """Enumerate every candidate, reject the infeasible ones with a reason, rank the feasible ones
    and pick the best (or validate ``explicit``).  Raises ValueError if nothing is feasible or if
    ``explicit`` is infeasible (the message is the rejection reason).

    ``arch``: the compute capability of the GPU (80 for sm_80), which sets the register model
    (module docstring); the H100's when not given.

    ``sm_count`` is recorded in the plan but not used in the score: the grid size depends on the
    sequence length, which is not known at plan time."""
    _check_kind(kind)
    if dtype_bytes not in (1, 2, 4):
        raise ValueError(f"dtype_bytes must be 1, 2 or 4, got {dtype_bytes}")
    if sram_bytes <= 0:
        raise ValueError(f"sram_bytes must be positive, got {sram_bytes}")
    d = padded_head_dim(head_dim)
    bc, br = fa1_blocks(sram_bytes, head_dim, dtype_bytes)
    target_m, target_n = _targets(kind, bc, br)

    all_cands = [
        evaluate(kind, TileConfig(bm, bn, nw, ns), d, dtype_bytes, sram_bytes, arch, score_bytes)
        for bm in BLOCK_SIZES for bn in BLOCK_SIZES for nw in WARP_COUNTS for ns in STAGE_COUNTS
    ]
    feasible = sorted((c for c in all_cands if c.rejected is None),
                      key=lambda c: _rank_key(kind, c, target_m, target_n))
    rejected = [c for c in all_cands if c.rejected is not None]

    what = f"{kind} d={head_dim} dtype_bytes={dtype_bytes} sram {sram_bytes} B"
    if arch != DEFAULT_ARCH:
        what += f" {arch_name(arch)}"
    if explicit is not None:
        for field, allowed in (("block_m", BLOCK_SIZES), ("block_n", BLOCK_SIZES),
                               ("num_warps", WARP_COUNTS), ("num_stages", STAGE_COUNTS)):
            value = getattr(explicit, field)
            if value not in allowed:
                raise ValueError(f"tile config {explicit}: {field} {value} not in {allowed}")
        cand = evaluate(kind, explicit, d, dtype_bytes, sram_bytes, arch, score_bytes)
        if cand.rejected is not None:
            raise ValueError(f"tile config {explicit} infeasible for {what}: {cand.rejected}")
        chosen = explicit
    else:
        if not feasible:
            # Name the "closest" candidate (fewest violated rules, then least smem) so the error
            # says which resource ran out.
            closest = min(rejected, key=lambda c: (c.rejected.count(";"), c.smem_bytes,
                                                   c.regs_per_thread))
            counts = {rule: sum(rule in c.rejected for c in rejected)
                      for rule in ("pipelining", "num_warps", "regs/thread", "smem")}
            summary = ", ".join(f"{rule} {n}" for rule, n in counts.items())
            raise ValueError(f"no feasible tile config for {what}; closest candidate "
                             f"{closest.config}: {closest.rejected} "
                             f"(of {len(rejected)} candidates, rejected by {summary})")
        chosen = feasible[0].config

    return Plan(kind=kind, head_dim=head_dim, head_dim_padded=d, dtype_bytes=dtype_bytes,
                sram_bytes=sram_bytes, sm_count=sm_count, fa1_bc=bc, fa1_br=br, chosen=chosen,
                candidates=tuple(feasible + rejected), arch=arch, score_bytes=score_bytes)


def format_plan(plan: Plan) -> str:
    """Readable table: the FA-1 rule numbers, then every candidate with its estimates and status."""
    m_elems = plan.sram_bytes // plan.dtype_bytes
    lines = [
        f"kind={plan.kind} head_dim={plan.head_dim} (padded {plan.head_dim_padded}, chunks "
        f"{list(head_dim_chunks(plan.head_dim))}) dtype_bytes={plan.dtype_bytes} "
        f"sram={plan.sram_bytes} B sm_count={plan.sm_count} arch={arch_name(plan.arch)} "
        f"(accumulator cap {max_acc_regs(plan.arch, plan.head_dim_padded)} regs/thread)",
        f"FA-1 rule: M = {plan.sram_bytes} // {plan.dtype_bytes} = {m_elems} elements; "
        f"Bc = ceil(M / (4*{plan.head_dim})) = {plan.fa1_bc}; Br = min(Bc, d) = {plan.fa1_br}",
        f"chosen: {plan.chosen.as_dict()}",
        *([f"MAY SPILL: {spill_warning(plan)}"] if spill_warning(plan) else []),
        "",
        f"{'rank':>4}  {'block_m':>7} {'block_n':>7} {'warps':>5} {'stages':>6} "
        f"{'smem B':>8} {'regs':>5}  status",
    ]
    rank = 0
    for cand in plan.candidates:
        c = cand.config
        if cand.rejected is None:
            rank += 1
            status = "chosen" if c == plan.chosen else "ok"
            r = str(rank)
        else:
            status = cand.rejected
            r = "-"
        lines.append(f"{r:>4}  {c.block_m:>7} {c.block_n:>7} {c.num_warps:>5} {c.num_stages:>6} "
                     f"{cand.smem_bytes:>8} {cand.regs_per_thread:>5}  {status}")
    return "\n".join(lines)
