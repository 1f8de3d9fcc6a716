"""The autotuner's search space: every launch config one kernel variant may be launched
with on one GPU, and nothing else.

A point is a flat dict: the planner's tile (``block_m``, ``block_n``, ``num_warps``,
``num_stages``) plus one entry per template knob of the variant's kind. The tile part is
the planner's feasible set for THIS GPU's real shared memory (the planner's rejections,
with their reasons, are what keeps a config from ever being launched); the knob part is
the table below.

Adding a template knob is one line in :data:`KNOBS`: its name, its choices, the value an
untuned launch uses, and optionally a predicate that returns why a point is infeasible
(or None). The tuner, the JSON data and the package's TUNED table pick it up from there;
tuning data written before the knob existed is completed with its default.

This module imports only the standard library and flashgen's planner (Optuna is imported
lazily, by :meth:`Space.distributions` alone).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from . import families, planner_core
from .planner_core import BLOCK_SIZES, STAGE_COUNTS, WARP_COUNTS, TileConfig

TILE_PARAMS = ("block_m", "block_n", "num_warps", "num_stages")
TILE_CHOICES = {"block_m": BLOCK_SIZES, "block_n": BLOCK_SIZES,
                "num_warps": WARP_COUNTS, "num_stages": STAGE_COUNTS}


@dataclass(frozen=True)
class Facts:
    """What a feasibility predicate may look at: the variant and the GPU."""
    kind: str                       # fwd | bwd | decode
    head_dim: int
    dtype_bytes: int
    sram_bytes: int                 # shared memory one block may use on THIS GPU
    sm_count: int | None
    capability: tuple[int, int] | None = None   # (major, minor); None when unknown
    # why this variant cannot run a Gluon kernel here (None: it can); see families.py
    gluon: str | None = "no Gluon kernel considered"
    mask: str | None = None         # the variant's mask (None: not said)
    block_sparse: bool = False      # a mask mod's block lists deal the forward's tiles
    # the Gluon forward's consumer counts this variant is rendered for
    # (families.fwd_consumer_counts; 3 runs 192-row tiles)
    consumers: tuple = (families.CONSUMERS,)
    # bytes the variant's mods read per score element as [block_m, block_n] tiles (a bias:
    # planner_core.smem_estimate stages them, as the package plans such a variant)
    score_bytes: int = 0
    # V's head dim where it is not Q's (MLA's 192 / 128: head_dim is then the larger, Q's,
    # as the planner's; the Gluon forward's shared memory counts each, families.config_reason)
    v_head_dim: int | None = None


Predicate = Callable[[Mapping[str, Any], Facts], "str | None"]


@dataclass(frozen=True)
class Knob:
    """A template parameter the tuner may set: ``choices`` in the order they are tried,
    ``default`` the value an untuned launch uses, ``infeasible(config, facts)`` the reason
    a point cannot run (None when it can)."""
    name: str
    choices: tuple
    default: Any
    infeasible: Predicate | None = None

    def __post_init__(self):
        if self.default not in self.choices:
            raise ValueError(f"knob {self.name}: default {self.default!r} not in {self.choices}")
        if self.name in TILE_PARAMS:
            raise ValueError(f"knob {self.name}: the tile parameters belong to the planner")


def _needs_sm90(config, facts: Facts) -> str | None:  # for knobs such as tma / warp_specialize
    if facts.capability is not None and facts.capability < (9, 0):
        return f"needs sm90 or newer, this GPU is sm{facts.capability[0]}{facts.capability[1]}"
    return None


# Template knobs per kernel kind, beyond the planner's tile. ONE LINE PER KNOB, e.g.
#   Knob("tma", (False, True), False, lambda c, f: _needs_sm90(c, f) if c["tma"] else None),
#   Knob("warp_specialize", (False, True), False),
#   Knob("grid_order", ("row", "col"), "row"),
#   Knob("num_splits", (1, 2, 4, 8, 16), 1),          # decode
# A knob here must also be read by its template and runtime (with the same default).
def _dq_tile(config, facts: Facts) -> str | None:
    """The dQ kernel's own tile must pass the planner's backward resource model, read with
    its roles swapped (the resident rows are the dQ kernel's query rows). The Gluon
    backward has no dQ kernel: its points keep the default."""
    if config.get("family") == "gluon":
        return (None if config["dq_tile"] == planner_core.DQ_MIRROR else
                "a `tl` knob (the Gluon backward computes dQ in its one kernel)")
    m, n, w, st = planner_core.dq_tile(config)
    cand = planner_core.evaluate("bwd", TileConfig(n, m, w, st),
                                 planner_core.padded_head_dim(facts.head_dim),
                                 facts.dtype_bytes, facts.sram_bytes, _arch(facts.capability),
                                 facts.score_bytes)
    return None if cand.rejected is None else cand.rejected


def _arch(capability) -> int:
    """The planner's arch (80 for sm_80) from a (major, minor) capability; the H100's when
    unknown."""
    if capability is None:
        return planner_core.DEFAULT_ARCH
    return capability[0] * 10 + capability[1]


def _family(config, facts: Facts) -> str | None:
    return facts.gluon if config["family"] == "gluon" else None


def _gluon_only(name: str, default) -> Predicate:
    """A Gluon knob: a `tl` point takes its default, so no `tl` config is measured twice."""
    return lambda c, f: (None if c.get("family") == "gluon" or c[name] == default
                         else "a Gluon knob (family=gluon only)")


def _persistent_only(name: str, default) -> Predicate:
    """A Gluon knob of the persistent walk's tile boundary: a program of the
    non-persistent grid runs one tile, so there it could only repeat the default's time."""
    gluon_only = _gluon_only(name, default)

    def infeasible(config, facts: Facts) -> str | None:
        if config[name] == default:
            return None
        return gluon_only(config, facts) or (
            None if config.get("persistent", True) else "a knob of the persistent grid's tile walk")
    return infeasible


def _stream_k(config, facts: Facts) -> str | None:
    """stream_k=False is a point of its own only where stream-K can run: a persistent
    Gluon forward without a band (families.stream_k_start)."""
    if config["stream_k"]:
        return None
    return (_persistent_only("stream_k", True)(config, facts)
            or (None if facts.mask == "none" else "a knob of the unmasked forward")
            or ("a mask mod's block lists deal the tiles, not stream-K"
                if facts.block_sparse else None)
            or ("stream-K is off with overlap anyway" if config.get("overlap") else None))


def _persistent_bwd(config, facts: Facts) -> str | None:
    """persistent_bwd=False (a program per key block) is a point of its own only for a
    Gluon backward with a block mask: the persistent form exists there alone."""
    if config["persistent_bwd"]:
        return None
    return (_gluon_only("persistent_bwd", True)(config, facts)
            or (None if facts.block_sparse else "a block mask's backward knob (its persistent form)"))


def _tma(config, facts: Facts) -> str | None:
    if not config["tma"]:
        return None
    if config.get("family") == "gluon":
        return "a `tl` knob (the Gluon kernels always load through TMA)"
    return _needs_sm90(config, facts)


KNOBS: dict[str, tuple[Knob, ...]] = {
    # unmasked K/V blocks through tensor descriptors (TMA): +9% at 256x64 w8 s3 on the H100,
    # -3% at 128x64 w8 s3 (docs/PERFORMANCE.md, Forward; the sweep's rows in 7356d63). The
    # template's warp_specialize option is left out: no gain measured, and Triton 3.6's
    # warp-specialisation pass fails on 4-warp tiles.
    # `family` picks the kernel (families.py): a Gluon point's tile is the warpgroups'
    # (block_m = 2 x 64, num_warps = 4, num_stages = the K/V ring depth), checked by
    # families.config_reason instead of the planner; `pingpong`, `l2_share` (heads grouped
    # to a 1/l2_share of L2 in the longest-first order), `persistent`, `regs`, `q_buffers`
    # `overlap`, `diag_first` and `stream_k` are its own.
    "fwd": (Knob("tma", (False, True), False, _tma),
            Knob("family", ("tl", "gluon"), "tl", _family),
            Knob("pingpong", (True, False), True, _gluon_only("pingpong", True)),
            Knob("l2_share", (4, 2, 8), 4, _gluon_only("l2_share", 4)),
            # one program per SM walking its tiles, or one per tile (the hardware schedules)
            Knob("persistent", (True, False), True, _gluon_only("persistent", True)),
            # consumer/producer registers per thread (setmaxnreg)
            # (three consumers take THREE_CONSUMER_REGS: families.config_reason)
            Knob("regs", families.REG_SPLITS + families.THREE_CONSUMER_REGS,
                 families.REG_SPLITS[0], _gluon_only("regs", families.REG_SPLITS[0])),
            # the tile boundary (families.GLUON_DEFAULT): a second Q slot per consumer
            # (shared memory: families.config_reason), a tile's stores behind the next
            # tile's first S = Q K^T
            Knob("q_buffers", (1, 2), 1, _persistent_only("q_buffers", 1)),
            Knob("overlap", (False, True), False, _persistent_only("overlap", False)),
            # a tile's key blocks from the last down (families.gluon_default)
            Knob("diag_first", (False, True), False, _gluon_only("diag_first", False)),
            # an unmasked forward's last rounds dealt by key block (families.stream_k_start)
            Knob("stream_k", (True, False), True, _stream_k)),
    # `family` as for the forward: a Gluon point's tile is the backward's warpgroups'
    # (block_n = 2 consumers x 64 keys, num_warps = 4, block_m = 64 or 128 query rows a
    # step, num_stages = the Q/dO ring depth), checked by families.bwd_config_reason
    # (shared memory) instead of the planner; `regs` is its own knob. The Gluon backward is
    # not searched under torch.use_deterministic_algorithms(True) (tune.gluon_here): its dQ
    # additions are in no fixed order, and the package sends such calls to `tl`.
    "bwd": (
        # the dQ kernel's launch, when it should differ from the dK/dV kernel's mirror
        Knob("dq_tile", (planner_core.DQ_MIRROR, "128x64w8s2", "128x64w8s3", "128x32w8s3", "64x64w4s3",
                         "64x32w4s4"), planner_core.DQ_MIRROR, _dq_tile),
        Knob("family", ("tl", "gluon"), "tl", _family),
        Knob("regs", families.REG_SPLITS, families.REG_SPLITS[0],
             _gluon_only("regs", families.REG_SPLITS[0])),
        # a block mask's backward: one program an SM taking key blocks from a counter (the
        # package's default, _runtime.GLUON_BWD_PERSISTENT_MASKS) or one per key block
        # (H100: the persistent form 1.04-1.14x for documents and windows, 0.97-0.99x for
        # prefix-LM; docs/PERFORMANCE.md, Mods)
        Knob("persistent_bwd", (True, False), True, _persistent_bwd),
        # Reachable through override_config but not tuned, both measured slower on the
        # H100 (docs/PERFORMANCE.md, Backward): `fused_dq=True` (dQ inside the dK/dV kernel) and
        # `tma=True` (unmasked Q/dO and K/V blocks through tensor descriptors: 0 to -12%
        # at 13 of 16 measured points, and the best 16k point without it stays ahead).
    ),
    # split-KV factor (0 = the package's heuristic from batch, heads, length and SMs)
    "decode": (Knob("num_splits", (0, 1, 2, 4, 8, 16, 32), 0),),
}


@dataclass(frozen=True)
class Space:
    """The feasible launch configs of one kernel variant on one GPU."""
    facts: Facts
    knobs: tuple[Knob, ...]
    planned: TileConfig                      # the planner's choice for this GPU
    tiles: tuple[TileConfig, ...]            # feasible tiles, planner's rank order
    tile_reasons: Mapping[TileConfig, str | None] = field(repr=False)   # every candidate

    # ---- naming -------------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        return TILE_PARAMS + tuple(k.name for k in self.knobs)

    def choices(self, name: str) -> tuple:
        if name == "block_m" and 3 in self.facts.consumers:
            return TILE_CHOICES[name] + (3 * families.QUERY_ROWS_PER_CONSUMER,)
        if name in TILE_CHOICES:
            return TILE_CHOICES[name]
        return next(k.choices for k in self.knobs if k.name == name)

    def key(self, config: Mapping[str, Any]) -> tuple:
        """A hashable identity of a point (its values in `names` order)."""
        return tuple(config.get(n) for n in self.names)

    def config(self, values: Mapping[str, Any]) -> dict:
        """The point named by `values` (extra keys dropped, missing knobs defaulted),
        with plain int/bool/str values."""
        return {n: _plain(values[n]) if n in values else self._default_of(n) for n in self.names}

    def _default_of(self, name: str):
        if name in TILE_PARAMS:
            return getattr(self.planned, name)
        return next(k.default for k in self.knobs if k.name == name)

    # ---- feasibility --------------------------------------------------------------------
    def check(self, config: Mapping[str, Any]) -> str | None:
        """None if the point may be launched, else the planner's or the knob's reason."""
        for name in self.names:
            if name not in config:
                return f"{name} missing"
            if config[name] not in self.choices(name):
                return f"{name} {config[name]!r} not one of {self.choices(name)}"
        tile = TileConfig(*(int(config[n]) for n in TILE_PARAMS))
        if config.get("family") == "gluon":
            # the Gluon tile is fixed by its warpgroups; the planner's model is the tl kernel's
            if self.facts.kind == "bwd":
                reason = families.bwd_config_reason(config, self.facts.head_dim,
                                                    self.facts.dtype_bytes, self.facts.sram_bytes,
                                                    self.facts.v_head_dim)
            else:
                reason = families.config_reason(config, self.facts.head_dim,
                                                self.facts.dtype_bytes, self.facts.sram_bytes,
                                                self.facts.consumers, self.facts.v_head_dim)
        else:
            reason = self.tile_reasons.get(tile, "not a planner candidate")
        if reason is not None:
            return reason
        for knob in self.knobs:
            if knob.infeasible is not None:
                reason = knob.infeasible(config, self.facts)
                if reason is not None:
                    return f"{knob.name}={config[knob.name]!r}: {reason}"
        return None

    # ---- enumeration --------------------------------------------------------------------
    def points(self) -> list[dict]:
        """Every feasible point: tiles in the planner's rank order, knobs in choice order
        (the default first). This is also the exhaustive grid. Enumerated once per space
        (the product of the Gluon forward's knobs is ~130k candidates for ~720 feasible
        points, seconds of Python that the tuner used to pay on every trial); callers get
        fresh copies."""
        cached = self.__dict__.get("_points")
        if cached is None:
            cached = self._enumerate()
            object.__setattr__(self, "_points", cached)  # frozen: the cache is not a field
        return [dict(p) for p in cached]

    def _enumerate(self) -> list[dict]:
        knob_values = [_default_first(k) for k in self.knobs]
        out = []
        tiles = list(self.tiles)
        if any(k.name == "family" for k in self.knobs) and self.facts.gluon is None:
            gluon = GLUON_BWD_TILES if self.facts.kind == "bwd" else GLUON_TILES
            tiles += [t for t in gluon if t not in tiles]
        for tile in tiles:
            for values in itertools.product(*knob_values):
                cfg = {**tile.as_dict(), **{k.name: v for k, v in zip(self.knobs, values)}}
                if self.check(cfg) is None:
                    out.append(cfg)
        return out

    def default(self) -> dict:
        """What an untuned launch on this GPU uses: the planner's tile, knob defaults."""
        return self.config({})

    def __len__(self) -> int:
        return len(self.points())

    def distributions(self) -> dict:
        """One Optuna categorical distribution per name (the box the feasible set lies in;
        the tuner's sampler only ever proposes feasible points from it)."""
        from optuna.distributions import CategoricalDistribution

        return {n: CategoricalDistribution(self.choices(n)) for n in self.names}


# the tiles a Gluon forward may take: 2 (or, at head dims <= 64, 3) consumer warpgroups x 64
# rows, 4 warps a partition, 64- or 128-key blocks, a 2- to 4-deep K/V ring (config_reason
# drops what the variant's kernel or shared memory cannot take)
GLUON_TILES = tuple(TileConfig(c * families.QUERY_ROWS_PER_CONSUMER, n, 4, s)
                    for c in (families.CONSUMERS, 3) for n in (128, 64) for s in (2, 3, 4)) + tuple(
    # (Q/K 512's tile: families_large.D512_FWD_TILES; config_reason drops it elsewhere)
    TileConfig(families.CONSUMERS * families.QUERY_ROWS_PER_CONSUMER, n, 4, s)
    for n, s in families.D512_FWD_TILES)
# the tiles a Gluon backward may take: 2 consumer warpgroups x 64 keys, 4 warps a partition,
# 64 or 128 query rows a step, a 2- to 4-deep Q/dO ring (bwd_config_reason drops what does
# not fit: at d=128 block_m 128 and a 4-deep ring, at d=64 block_m 128 past a 2-deep ring)
# (and the large head dims' 64 x 64 tiles, a 1- to 3-deep ring: families.LARGE_HEAD_DIM_BWD)
GLUON_BWD_TILES = tuple(
    TileConfig(m, families.CONSUMERS * families.KEY_ROWS_PER_CONSUMER, 4, s)
    for m in families.GLUON_BWD_BLOCK_MS for s in families.GLUON_BWD_STAGES) + tuple(
    TileConfig(families.LARGE_BWD_ROWS, families.LARGE_BWD_ROWS, 4, s)
    for s in families.LARGE_BWD_STAGES)


def _default_first(knob: Knob) -> tuple:
    return (knob.default,) + tuple(c for c in knob.choices if c != knob.default)


def _plain(value):
    """JSON/Optuna values back to Python ints where they are whole numbers."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return int(value) if float(value).is_integer() else value


def space_for(kind: str, head_dim: int, dtype_bytes: int, sram_bytes: int,
              sm_count: int | None = None, capability: tuple[int, int] | None = None,
              knobs: Mapping[str, tuple[Knob, ...]] | None = None,
              gluon: str | None = "no Gluon kernel considered",
              mask: str | None = None, block_sparse: bool = False,
              consumers: tuple = (families.CONSUMERS,), score_bytes: int = 0,
              v_head_dim: int | None = None) -> Space:
    """The search space of a `kind` kernel at `head_dim` on a GPU with `sram_bytes` of shared
    memory per block. `gluon`: why the variant cannot run a Gluon kernel on this GPU and
    Triton (None when it can: the space then holds the Gluon family's points too).
    `score_bytes`: what the variant's mods read per score element as a tile (Facts);
    `v_head_dim`: V's head dim where it is not Q's (Facts). Raises ValueError (the
    planner's message) if no tile fits."""
    plan = planner_core.plan(kind, head_dim, dtype_bytes, sram_bytes, sm_count,
                             arch=_arch(capability), score_bytes=score_bytes)
    facts = Facts(kind, head_dim, dtype_bytes, sram_bytes, sm_count,
                  tuple(capability) if capability is not None else None, gluon, mask,
                  block_sparse, tuple(consumers), score_bytes, v_head_dim)
    return Space(
        facts=facts,
        knobs=tuple((KNOBS if knobs is None else knobs).get(kind, ())),
        planned=plan.chosen,
        tiles=tuple(c.config for c in plan.candidates if c.rejected is None),
        tile_reasons={c.config: c.rejected for c in plan.candidates},
    )


def knob_names(kind: str) -> tuple[str, ...]:
    """Every config key a `kind` launch takes: the tile parameters, then its knobs."""
    return TILE_PARAMS + tuple(k.name for k in KNOBS.get(kind, ()))


def knob_defaults(kind: str) -> dict:
    return {k.name: k.default for k in KNOBS.get(kind, ())}
