"""`flashgen tune` on the CPU: the studies, the search space, resumption, the JSON data and
its way into the package's dispatch, with a synthetic cost in place of GPU timing (the GPU
measure itself only has its correctness check exercised here, in Triton's interpreter)."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import types
import uuid
from pathlib import Path

import pytest
import torch

optuna = pytest.importorskip("optuna")

from flashgen import families, planner_core, tuning_data  # noqa: E402
from flashgen.build import build  # noqa: E402
from flashgen.cli import main as cli_main  # noqa: E402
from flashgen.space import KNOBS, TILE_PARAMS, Knob, space_for  # noqa: E402
from flashgen.spec import load_spec  # noqa: E402
from flashgen.measure import DecodeWorkload, Workload, WrongAnswer, gpu_measure  # noqa: E402
from flashgen.tune import (ATTR_FAIL, ATTR_INFEASIBLE, ATTR_WARM, Budget,  # noqa: E402
                           GpuInfo, StudyResult, _warm_starts, _write_results, format_summary,
                           parse_try, study_name, tune_study)
from flashgen.errors import FlashgenError  # noqa: E402

from packages import build_and_import  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
TrialState = optuna.trial.TrialState
H100 = dict(sram_bytes=232448, sm_count=132, capability=(9, 0))
FAKE_KEY = "Fake GPU 80GB|sm90|132sm"


def fwd_space(**kw):
    """The forward's tile space without template knobs (tests of the tuner's machinery)."""
    return space_for("fwd", 64, 2, **{**H100, "knobs": {}, **kw})


def cost_of(space, salt="", block_m=128):
    """A deterministic synthetic time: smooth in log2 of each tile dim (fastest near
    `block_m` x 64, 4 warps, 3 stages), plus hash jitter."""
    def cost(cfg):
        x = (abs(math.log2(cfg["block_m"] / block_m)) + 0.7 * abs(math.log2(cfg["block_n"] / 64))
             + 0.3 * abs(math.log2(cfg["num_warps"] / 4)) + 0.2 * abs(cfg["num_stages"] - 3))
        h = hashlib.sha256(f"{salt}{sorted(cfg.items())}".encode()).digest()
        return 0.1 * (1 + x) + h[0] / 1e5
    return cost


def quiet(line):
    pass


def trials_of(storage, name):
    return optuna.load_study(study_name=name, storage=storage).get_trials(deepcopy=False)


@pytest.fixture
def storage(tmp_path):
    return f"sqlite:///{tmp_path / 'tune.db'}"


# ----------------------------------------------------------------------------------------
# the search space
# ----------------------------------------------------------------------------------------

def test_space_is_the_planners_feasible_set_for_the_real_smem():
    for sram in (232448, 101376, 49152):
        plan = planner_core.plan("fwd", 64, 2, sram, 132)
        feasible = [c.config.as_dict() for c in plan.candidates if c.rejected is None]
        space = fwd_space(sram_bytes=sram)
        assert space.points() == feasible  # the planner's rank order, nothing else
        assert space.default() == plan.chosen.as_dict()
        for cand in plan.candidates:
            reason = space.check(cand.config.as_dict())
            assert reason == cand.rejected  # the planner's own reason
    # a smaller GPU has a strictly smaller space
    assert len(fwd_space(sram_bytes=49152)) < len(fwd_space())


def test_a_knob_is_one_table_line_with_its_feasibility():
    """The forward's real knobs: `tma` feasible on sm90 only; `family` and the Gluon
    family's own knobs only where the variant can run a Gluon kernel."""
    assert [k.name for k in KNOBS["fwd"]] == ["tma", "family", "pingpong", "l2_share",
                                              "persistent", "regs", "q_buffers", "overlap",
                                              "diag_first", "stream_k"]
    base = fwd_space()
    hopper = space_for("fwd", 64, 2, **H100)  # no Gluon kernel considered: tl points only
    ampere = space_for("fwd", 64, 2, **{**H100, "capability": (8, 0)})
    assert len(hopper) == 2 * len(base)  # tma doubles it; the Gluon knobs stay at defaults
    # before Hopper the planner's tiles are the spill-free ones for that architecture
    assert set(ampere.tiles) < set(hopper.tiles) and ampere.planned != hopper.planned
    assert all(p["family"] == "tl" and p["pingpong"] and p["l2_share"] == 4 and p["persistent"]
               and p["regs"] == "240/24" and p["q_buffers"] == 1 and not p["overlap"]
               and not p["diag_first"] for p in hopper.points())
    assert len(ampere) == len(fwd_space(capability=(8, 0))) and all(p["tma"] is False for p in ampere.points())
    assert ampere.check({**ampere.default(), "tma": True}).startswith("tma=True: needs sm90")
    defaults = {"tma": False, "family": "tl", "pingpong": True, "l2_share": 4,
                "persistent": True, "regs": "240/24", "q_buffers": 1, "overlap": False,
                "diag_first": False, "stream_k": True}
    assert hopper.default() == {**base.default(), **defaults}
    # tuning data that predates the knobs: tma completed with its default, `family` left
    # out (the package reads its absence: families.py)
    assert tuning_data._config_only("fwd", base.default()) == {**base.default(), "tma": False}


def test_the_gluon_family_is_searched_where_it_runs():
    space = space_for("fwd", 128, 2, **H100, gluon=None)
    gluon = [p for p in space.points() if p["family"] == "gluon"]
    tl = [p for p in space.points() if p["family"] == "tl"]
    assert tl and all(p["pingpong"] and p["l2_share"] == 4 and not p.get("tma") is None
                      for p in tl)
    # the warpgroups fix block_m and num_warps; shared memory prunes the ring depth at d=128
    assert {(p["block_m"], p["num_warps"]) for p in gluon} == {(128, 4)}
    assert {(p["block_n"], p["num_stages"]) for p in gluon} == {(128, 2), (64, 2), (64, 3), (64, 4)}
    assert all(not p["tma"] for p in gluon)
    # x pingpong x l2_share x regs x (persistent with q_buffers x overlap, or one tile a
    # program with neither: nothing to overlap there) x diag_first
    assert len(gluon) == 4 * 2 * 3 * 3 * (2 * 2 + 1) * 2
    # stream_k=False is a point of its own only for the unmasked forward, and not with
    # overlap (which turns stream-K off) or one tile a program
    unmasked = space_for("fwd", 128, 2, **H100, gluon=None, mask="none")
    off = [p for p in unmasked.points() if p["family"] == "gluon" and not p["stream_k"]]
    assert off and all(p["persistent"] and not p["overlap"] for p in off)
    assert len([p for p in unmasked.points() if p["family"] == "gluon"]) == (
        4 * 2 * 3 * 3 * (2 * 2 + 2 + 1) * 2)
    # a mask mod's block lists deal an unmasked variant's tiles: no stream-K to turn off
    sparse = space_for("fwd", 128, 2, **H100, gluon=None, mask="none", block_sparse=True)
    assert all(p["stream_k"] for p in sparse.points())
    assert "mask mod" in sparse.check({**off[0]})
    one_tile = {**families.gluon_default(128), "tma": False, "persistent": False}
    assert space.check(one_tile) is None
    assert "persistent" in space.check({**one_tile, "overlap": True})
    assert "persistent" in space.check({**one_tile, "q_buffers": 2})
    assert "family=gluon" in space.check({**space.default(), "overlap": True})
    too_deep = {**families.gluon_default(128), "tma": False, "num_stages": 3}
    assert "shared memory" in space.check(too_deep)
    # a variant without a Gluon kernel, or a GPU without Gluon, never gets a Gluon point
    no = space_for("fwd", 128, 2, **H100, gluon="fp32: wgmma takes fp16/bf16 operands")
    assert all(p["family"] == "tl" for p in no.points())
    assert no.check({**too_deep, "num_stages": 2}) == "family='gluon': fp32: wgmma takes fp16/bf16 operands"


def test_three_consumer_tiles_are_searched_where_the_kernel_has_them():
    """At d=64 without dropout or mods the forward's kernel has three-consumer partitions:
    its space adds 192-row tiles, each with the one register split that fits them, and
    the untuned default is one of them; elsewhere there are none."""
    two = space_for("fwd", 64, 2, **H100, gluon=None, mask="none")
    three = space_for("fwd", 64, 2, **H100, gluon=None, mask="none", consumers=(3, 2))
    g2 = [p for p in two.points() if p["family"] == "gluon"]
    g3 = [p for p in three.points() if p["family"] == "gluon"]
    assert {p["block_m"] for p in g2} == {128}
    assert {p["block_m"] for p in g3} == {128, 192}
    assert [p for p in g3 if p["block_m"] == 128] == g2
    big = [p for p in g3 if p["block_m"] == 192]
    assert {p["regs"] for p in big} == {"160/24"} and "160/24" not in {p["regs"] for p in g2}
    # one register split instead of three: a third of the 128-row points, the same ring
    # depths (shared memory fits every one at d=64)
    assert len(big) * 3 == len(g2)
    default = three.config(families.gluon_default(64, "fwd", "none"))
    assert default["block_m"] == 192 and three.check(default) is None and default in g3
    assert two.check(default).startswith("block_m 192 not one of")
    assert "regs must be one of 160/24" in three.check({**default, "regs": "240/24"})
    # what the tuner asks for per variant (tune._space): dropout and mods keep two
    from flashgen import tune

    gpu = tune.GpuInfo(FAKE_KEY, "Fake GPU", (9, 0), H100["sm_count"], H100["sram_bytes"])
    facts = {"head_dim": 64, "dtype": "bf16", "mask": "none", "kind": "fwd"}
    assert tune._space("fwd", facts, gpu).facts.consumers == (3, 2)
    assert tune._space("fwd", {**facts, "dropout": True}, gpu).facts.consumers == (2,)
    assert tune._space("fwd", {**facts, "mods": ["softcap"]}, gpu).facts.consumers == (2,)
    assert tune._space("fwd", {**facts, "head_dim": 128}, gpu).facts.consumers == (2,)


def test_the_gluon_backward_is_searched_where_it_runs():
    """The backward's `family` knob: Gluon points take the backward's warpgroup tile
    (2 x 64 keys, 4 warps), 64 or 128 query rows a step and a 2- to 4-deep Q/dO ring where
    shared memory allows, each register split; `dq_tile` stays a `tl` knob and `regs` a
    Gluon one, so no config is measured twice; `persistent_bwd` is a point of its own only
    for a block mask's Gluon backward."""
    assert [k.name for k in KNOBS["bwd"]] == ["dq_tile", "family", "regs", "persistent_bwd"]
    tiles = {}
    for d in (64, 96, 128):
        space = space_for("bwd", d, 2, **H100, gluon=None)
        gluon = [p for p in space.points() if p["family"] == "gluon"]
        tl = [p for p in space.points() if p["family"] == "tl"]
        assert all(p["dq_tile"] == "mirror" for p in gluon)
        assert all(p["regs"] == "240/24" for p in tl)
        assert {(p["block_n"], p["num_warps"]) for p in gluon} == {(128, 4)}
        assert {p["regs"] for p in gluon} == set(families.REG_SPLITS)
        tiles[d] = {(p["block_m"], p["num_stages"]) for p in gluon}
        assert len(gluon) == len(tiles[d]) * len(families.REG_SPLITS)
        # the `tl` part is what it was without the knob
        assert tl == [p for p in space_for("bwd", d, 2, **H100).points()]
        default = space.config(families.gluon_default(d, "bwd"))
        assert space.check(default) is None and default in gluon
    # d=96 runs d=128's tiles; 128 query rows a step fit at d=64 only, with a 2-deep ring
    assert tiles[128] == tiles[96] == {(64, 2), (64, 3)}
    assert tiles[64] == {(64, 2), (64, 3), (64, 4), (128, 2)}

    space = space_for("bwd", 128, 2, **H100, gluon=None)
    base = space.config(families.GLUON_BWD_DEFAULT)
    reasons = {
        "block_m": (128, "needs 330752 bytes of shared memory, the GPU has 232448"),
        "num_stages": (4, "needs 265216 bytes of shared memory, the GPU has 232448"),
        "block_n": (64, "block_n must be 2 consumers x 64 keys"),
        "num_warps": (8, "num_warps must be 4 (one warpgroup per partition)"),
    }
    for name, (value, why) in reasons.items():
        assert space.check({**base, name: value}) == why, name
    assert space.check({**base, "block_m": 32}).startswith("block_m must be 64 or 128")
    assert space.check({**base, "num_stages": 1}).startswith("num_stages (the Q/dO ring")
    assert space.check({**base, "dq_tile": "128x64w8s3"}) == (
        "dq_tile='128x64w8s3': a `tl` knob (the Gluon backward computes dQ in its one kernel)")
    tl = space.default()
    assert space.check({**tl, "regs": "232/40"}) == "regs='232/40': a Gluon knob (family=gluon only)"
    # the reasons come from the GPU's shared memory: with less, the 3-deep ring goes at d=128
    smaller = space_for("bwd", 128, 2, **{**H100, "sram_bytes": 200 * 1024}, gluon=None)
    assert {p["num_stages"] for p in smaller.points() if p["family"] == "gluon"} == {2}
    # a variant without a Gluon backward, or a GPU without Gluon, never gets a Gluon point
    no = space_for("bwd", 128, 2, **H100, gluon="fp32: wgmma takes fp16/bf16 operands")
    assert all(p["family"] == "tl" for p in no.points())
    assert no.check(base) == "family='gluon': fp32: wgmma takes fp16/bf16 operands"


# (head dim, block_m, ring depth) -> shared bytes of the sm_90 compile
# (python -m flashgen.gluon_compile's compile_variant, Triton 3.6.0, bf16 bwd variants)
GLUON_BWD_COMPILED_SHARED = {
    (128, 64, 2): 198176, (128, 64, 3): 231520, (128, 128, 2): 330272, (128, 128, 3): 396896,
    (64, 64, 2): 116256, (64, 64, 3): 133216, (64, 64, 4): 150112,
    (64, 128, 2): 199200, (64, 128, 3): 233056, (64, 128, 4): 266848,
}


def test_the_gluon_backward_shared_memory_estimate_is_the_compilers_plus_a_margin():
    """families.bwd_shared_bytes (the template's allocations plus 1 KiB) is at most 1 KiB
    over what the compile reports, never under, and agrees with it on what fits an H100."""
    for (d, block_m, ring), compiled in GLUON_BWD_COMPILED_SHARED.items():
        est = families.bwd_shared_bytes(d, 2, block_m, ring)
        assert 0 < est - compiled <= 1024, (d, block_m, ring, est, compiled)
        assert (est <= H100["sram_bytes"]) == (compiled <= H100["sram_bytes"])
    # the default at d=128: the "198 KB" of shared memory of the first H100 profile (78b1817)
    assert families.bwd_shared_bytes(128, 2, 64, 2) == 198656
    assert families.bwd_shared_bytes(96, 2, 64, 2) == families.bwd_shared_bytes(128, 2, 64, 2)


def test_the_backward_warm_starts_include_the_gluon_backward_default():
    spec = load_spec(ROOT / "specs" / "llama.yaml")
    bwd = space_for("bwd", 128, 2, **H100, gluon=None)
    starts = _warm_starts(spec, "bwd", bwd)
    # untuned, the package runs the Gluon backward at d=128 on Hopper: measured first (a
    # budget-starved study then writes what the package already runs)
    assert [tag for tag, _ in starts] == ["gluon", "planner"]
    assert starts[0][1] == {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2,
                            "dq_tile": "mirror", "family": "gluon", "regs": "240/24",
                            "persistent_bwd": True}
    assert all(bwd.check(cfg) is None for _, cfg in starts)
    # the forward keeps its own Gluon default; no Gluon kernel, no Gluon warm start
    fwd = space_for("fwd", 128, 2, **H100, gluon=None)
    first = _warm_starts(spec, "fwd", fwd)[0]
    assert first[0] == "gluon" and first[1]["family"] == "gluon" and first[1]["num_warps"] == 4
    # d=64's backward is Gluon by default only from GLUON_BWD_SMALL_D_MIN_N: below, the
    # planner's `tl` tile comes first
    bwd64 = space_for("bwd", 64, 2, **H100, gluon=None)
    assert [t for t, _ in _warm_starts(spec, "bwd", bwd64, bucket=256)] == ["planner", "gluon"]
    assert [t for t, _ in _warm_starts(spec, "bwd", bwd64, bucket=4096)] == ["gluon", "planner"]
    assert [t for t, _ in _warm_starts(spec, "bwd", space_for("bwd", 128, 2, **H100))] == [
        "planner"]
    # an old `tl` winner and a --try naming the Gluon family and a register split
    old = {"block_m": 32, "block_n": 128, "num_warps": 8, "num_stages": 3, "dq_tile": "mirror"}
    tries = [parse_try("64x128w4s3:family=gluon,regs=232/40"),
             parse_try("128x128w4s2:family=gluon")]   # 128 rows a step: not at d=128
    starts = _warm_starts(spec, "bwd", bwd, incumbent=old, tries=tries, bucket=4096)
    # tuned before the family knob: the package runs the Gluon default for it on Hopper
    # (runtime.launch_config), so that is what the study measures first; the stored `tl`
    # tile comes after the defaults
    assert [tag for tag, _ in starts] == ["tuned", "planner", "gluon", "stored", "try", "try"]
    assert starts[0] == ("tuned", starts[2][1]) and starts[0][1]["family"] == "gluon"
    assert starts[3] == ("stored", {**old, "family": "tl", "regs": "240/24",
                            "persistent_bwd": True})
    assert starts[4][1]["family"] == "gluon" and starts[4][1]["regs"] == "232/40"
    assert bwd.check(starts[4][1]) is None and "shared memory" in bwd.check(starts[5][1])
    # an entry that names its family is run as stored
    named = {**old, "family": "tl"}
    assert _warm_starts(spec, "bwd", bwd, incumbent=named, bucket=4096)[0] == (
        "tuned", {**named, "regs": "240/24", "persistent_bwd": True})


def test_a_deterministic_process_tunes_the_tl_backward_only():
    """Under torch.use_deterministic_algorithms(True) the package sends every backward to
    `tl`, so the tuner does not offer the Gluon backward (its trials would time `tl`)."""
    from flashgen.tune import gluon_here

    gpu = GpuInfo(key=FAKE_KEY, name="Fake GPU", capability=(9, 0), sm_count=132,
                  sram_bytes=232448)
    facts = {"kind": "bwd", "head_dim": 128, "dtype": "bf16", "dropout": False}
    assert gluon_here("bwd", facts, gpu) is None
    torch.use_deterministic_algorithms(True)
    try:
        why = gluon_here("bwd", facts, gpu)
        assert why is not None and "deterministic" in why
        assert gluon_here("fwd", {**facts, "kind": "fwd"}, gpu) is None  # no dQ sum there
        space = space_for("bwd", 128, 2, **H100, gluon=why)
        assert {p["family"] for p in space.points()} == {"tl"}
        assert _warm_starts(load_spec(ROOT / "specs" / "llama.yaml"), "bwd", space)[-1][0] == "planner"
    finally:
        torch.use_deterministic_algorithms(False)


def test_the_persistent_block_mask_backward_is_a_knob_of_block_masks_only():
    """persistent_bwd=False (a program per key block) is searched for a mask mod's Gluon
    backward only: doubled Gluon points there, none added elsewhere, never on `tl`."""
    plain = space_for("bwd", 128, 2, **H100, gluon=None)
    masked = space_for("bwd", 128, 2, **H100, gluon=None, block_sparse=True)
    assert all(p["persistent_bwd"] for p in plain.points())
    off = [p for p in masked.points() if not p["persistent_bwd"]]
    on = [p for p in masked.points() if p["persistent_bwd"] and p["family"] == "gluon"]
    assert off and all(p["family"] == "gluon" for p in off)
    assert sorted(map(str, ({**p, "persistent_bwd": True} for p in off))) == sorted(map(str, on))
    gluon_point = next(p for p in plain.points() if p["family"] == "gluon")
    assert "block mask" in plain.check({**gluon_point, "persistent_bwd": False})
    assert "Gluon knob" in masked.check({**masked.default(), "family": "tl",
                                         "persistent_bwd": False})


def test_a_gluon_backward_winner_round_trips_through_the_tuning_data():
    """A backward entry names its family and register split; an older one keeps lacking
    them (the package reads that absence: the Gluon default at d >= 96 on Hopper)."""
    won = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 3,
           "dq_tile": "mirror", "family": "gluon", "regs": "232/40"}
    assert tuning_data._config_only("bwd", {**won, "ms": 1.0, "default_ms": 1.1}) == won
    old = {"block_m": 32, "block_n": 128, "num_warps": 8, "num_stages": 3}
    assert tuning_data._config_only("bwd", old) == {**old, "dq_tile": "mirror"}


def test_a_backward_study_measures_both_families(storage):
    space = space_for("bwd", 64, 2, **H100, gluon=None)
    seen = []

    def measure(cfg):
        assert space.check(cfg) is None
        seen.append(cfg)
        return 0.5 if cfg["family"] == "gluon" and cfg["num_stages"] == 3 else 1.0 + len(seen) / 100

    spec = load_spec(ROOT / "specs" / "gpt2.yaml")
    r = tune_study(storage=storage, name="bwd-families", space=space, measure=measure,
                   n_trials=6, warm_starts=_warm_starts(spec, "bwd", space), progress=quiet,
                   confirm_top=0)
    assert seen[1] == space.config(families.gluon_default(64, "bwd"))  # 128-row steps at d=64
    assert {c["family"] for c in seen} == {"tl", "gluon"} and r.complete == 6


# ----------------------------------------------------------------------------------------
# studies
# ----------------------------------------------------------------------------------------

def test_no_infeasible_config_ever_reaches_measure(storage):
    # a knob whose predicate rules out half the points, on a small-smem GPU
    knob = Knob("split", (1, 2), 1, lambda c, f: "odd" if c["split"] == 2 and c["num_warps"] == 4 else None)
    space = space_for("fwd", 64, 2, 65536, 80, (8, 6), knobs={"fwd": (knob,)})
    seen, violations = [], []

    def measure(cfg):
        if space.check(cfg) is not None:
            violations.append((cfg, space.check(cfg)))
        seen.append(cfg)
        return cost_of(space)(cfg)

    too_big = {"block_m": 256, "block_n": 256, "num_warps": 8, "num_stages": 4, "split": 1}
    assert space.check(too_big) is not None
    lines = []
    result = tune_study(storage=storage, name="feasible", space=space, measure=measure,
                        n_trials=25, warm_starts=[("planner", space.default()),
                                                  ("spec", too_big)], progress=lines.append,
                        confirm_top=0)
    assert result.complete == 25 and len(seen) == 25
    assert any("warm start spec" in ln and "skipped" in ln and "smem" in ln for ln in lines)
    assert seen[0] == space.default()
    # no point measured twice
    assert len({space.key(c) for c in seen}) == len(seen)

    # a trial that holds an infeasible point anyway (enqueued by hand) is pruned with the
    # reason, before any launch, and does not count toward --trials
    study = optuna.load_study(study_name="feasible", storage=storage)
    study.enqueue_trial(too_big)
    result = tune_study(storage=storage, name="feasible", space=space, measure=measure,
                        n_trials=27, progress=quiet, confirm_top=0)
    pruned = [t for t in trials_of(storage, "feasible") if t.state == TrialState.PRUNED]
    assert len(pruned) == 1 and "smem" in pruned[0].user_attrs[ATTR_INFEASIBLE]
    assert result.complete == 27 and len(seen) == 27 and result.pruned == 1
    assert violations == []


def test_failed_trials_are_recorded_with_reasons_and_never_chosen(storage):
    space = space_for("bwd", 128, 2, **H100)
    cost = cost_of(space)
    ranked = sorted(space.points(), key=cost)
    wrong, broken = ranked[0], ranked[1]   # the two fastest configs are bad

    def measure(cfg):
        if cfg == wrong:
            return WrongAnswer("dq differs from the float64 reference: max rel err 0.5")
        if cfg == broken:
            raise RuntimeError("triton.runtime.errors.OutOfResources: out of resource: "
                               "shared memory, Required: 263168, Hardware limit: 232448")
        return cost(cfg)

    result = tune_study(storage=storage, name="fails", space=space, measure=measure,
                        n_trials=len(space), sampler="grid", max_failures=10, progress=quiet)
    assert result.stopped == "space exhausted"
    assert result.complete == len(space) - 2 and result.failed == 2
    assert result.best_config == ranked[2] and result.best_ms == cost(ranked[2])
    failed = {space.key(space.config(t.params)): t.user_attrs[ATTR_FAIL]
              for t in trials_of(storage, "fails") if t.state == TrialState.FAIL}
    assert failed[space.key(wrong)].startswith("wrong answer: dq differs")
    assert failed[space.key(broken)].startswith("error: RuntimeError: ")
    assert "OutOfResources" in failed[space.key(broken)]
    # bad return values fail too; failures do not count toward --trials
    space2 = fwd_space()
    calls = []

    def flaky(cfg):
        calls.append(cfg)
        return [float("nan"), -1.0, "fast"][len(calls) - 1] if len(calls) <= 3 else cost(cfg)

    r2 = tune_study(storage=storage, name="flaky", space=space2, measure=flaky, n_trials=6,
                    progress=quiet, confirm_top=0)
    assert (r2.complete, r2.failed, len(calls)) == (6, 3, 9)
    reasons = sorted(t.user_attrs[ATTR_FAIL] for t in trials_of(storage, "flaky")
                     if t.state == TrialState.FAIL)
    assert all(r.startswith("error: measure returned") for r in reasons), reasons


def test_too_many_failures_stop_the_study(storage):
    space = fwd_space()

    def measure(cfg):
        raise RuntimeError("CompilationError")

    result = tune_study(storage=storage, name="allfail", space=space, measure=measure,
                        n_trials=4, progress=quiet)
    assert result.stopped == "4 failures" and result.complete == 0 and result.best_config is None


def test_resume_after_an_interrupt_loses_nothing(storage):
    space = fwd_space()
    cost = cost_of(space)
    calls = []

    def interrupted_at_6(cfg):
        calls.append(cfg)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return cost(cfg)

    with pytest.raises(KeyboardInterrupt):
        tune_study(storage=storage, name="resume", space=space, measure=interrupted_at_6,
                   n_trials=10, warm_starts=[("planner", space.default())], progress=quiet)
    before = [(t.number, t.state, t.params, t.value) for t in trials_of(storage, "resume")]
    assert [s for _, s, _, _ in before] == [TrialState.COMPLETE] * 5 + [TrialState.FAIL]
    first5 = before[:5]

    result = tune_study(storage=storage, name="resume", space=space, measure=cost,
                        n_trials=10, warm_starts=[("planner", space.default())], progress=quiet)
    after = trials_of(storage, "resume")
    complete = [t for t in after if t.state == TrialState.COMPLETE]
    assert result.complete == 10 and len(complete) == 10
    assert [(t.number, t.state, t.params, t.value) for t in after[:5]] == first5
    # the interrupted trial is marked so, not counted as a failure, and may be retried
    assert after[5].user_attrs[ATTR_FAIL] == "interrupted" and result.failed == 0
    # the warm start ran once, first
    warm = [t for t in after if t.user_attrs.get(ATTR_WARM)]
    assert len(warm) == 1 and warm[0].number == 0 and warm[0].params == space.default()
    assert result.default_ms == cost(space.default())
    # a finished study: running again measures nothing and enqueues nothing
    again = tune_study(storage=storage, name="resume", space=space,
                       measure=lambda cfg: pytest.fail("measured again"), n_trials=10,
                       warm_starts=[("planner", space.default())], progress=quiet)
    assert again.complete == 10 and len(trials_of(storage, "resume")) == len(after)


def test_batches_are_compiled_ahead_then_measured_one_by_one(storage):
    """With a compile-ahead pool (flashgen/ahead.py), trials are asked a batch at a time and
    `prepare` sees each batch's configs before any of them is measured; every measured
    config was prepared first, no point twice, the trial count and the warm start hold, and
    a timeout leaves the batch's unmeasured trials interrupted (a resume retries them)."""
    space = fwd_space()
    cost = cost_of(space)
    batches, measured = [], []

    def prepare(cfgs):
        assert all(space.check(c) is None for c in cfgs)
        batches.append([space.key(c) for c in cfgs])

    def measure(cfg):
        assert any(space.key(cfg) in b for b in batches), "measured before it was compiled"
        measured.append(space.key(cfg))
        return cost(cfg)

    result = tune_study(storage=storage, name="ahead", space=space, measure=measure,
                        n_trials=10, warm_starts=[("planner", space.default())],
                        progress=quiet, confirm_top=0, prepare=prepare, batch=4)
    assert result.complete == 10 and len(measured) == 10
    assert [len(b) for b in batches] == [4, 4, 2]   # the last batch stops at --trials
    assert len(set(measured)) == 10 and measured[0] == space.key(space.default())
    assert sorted(measured) == sorted(k for b in batches for k in b)

    # the time runs out after the next batch's first trial (a clock that ticks a second a
    # reading): the batch's other three were asked and compiled but not measured, and are
    # marked interrupted, not failed
    clock = iter(range(10_000))
    import flashgen.tune as tune_mod
    real = tune_mod.time.monotonic
    tune_mod.time.monotonic = lambda: float(next(clock))
    try:
        again = tune_study(storage=storage, name="ahead", space=space, measure=measure,
                           n_trials=20, timeout=3.5, progress=quiet, confirm_top=0,
                           prepare=prepare, batch=4)
    finally:
        tune_mod.time.monotonic = real
    trials = trials_of(storage, "ahead")
    interrupted = [t for t in trials if t.user_attrs.get(ATTR_FAIL) == "interrupted"]
    assert again.failed == 0 and again.complete == len(measured) == 11
    assert len(interrupted) == 3 and all(t.state == TrialState.FAIL for t in interrupted)
    assert len(trials) == again.complete + len(interrupted)


def test_the_winner_is_chosen_by_back_to_back_retiming(storage):
    """GPU times drift (clocks, heat): the first trial of a run, on a cool GPU, reads fast.
    The winner and the default's time come from re-timing the best few side by side."""
    space = fwd_space()
    base = cost_of(space)
    default = space.default()
    truly_best = sorted(space.points(), key=base)[1]   # 10% faster than the default:

    def cost(cfg):
        return 0.9 * base(default) if cfg == truly_best else base(cfg)

    assert min(space.points(), key=cost) == truly_best != default
    calls = []

    def drifting(cfg):   # the first measurement of the run is 30% fast
        calls.append(cfg)
        return cost(cfg) * (0.7 if len(calls) == 1 else 1.0)

    retimed = []

    def retime(cfg):
        retimed.append(cfg)
        return cost(cfg)

    starts = [("planner", default), ("best", truly_best)]
    plain = tune_study(storage=storage, name="noconfirm", space=space, measure=drifting,
                       n_trials=4, warm_starts=starts, progress=quiet, confirm_top=0)
    assert plain.best_config == default and not plain.confirmed   # fooled by the drift
    calls.clear()
    lines = []
    result = tune_study(storage=storage, name="confirm", space=space, measure=drifting,
                        n_trials=4, warm_starts=starts, progress=lines.append, retime=retime,
                        confirm_top=2, confirm_rounds=3)
    assert result.confirmed and result.best_config == truly_best
    assert result.best_ms == cost(truly_best) and result.default_ms == cost(default)
    # the two fastest by trial time (the drift-flattered default and the true best), 3 rounds
    assert len(retimed) == 2 * 3
    assert {space.key(c) for c in retimed} == {space.key(truly_best), space.key(default)}
    assert any("re-timing the 2 fastest configs, 3 rounds back to back" in ln for ln in lines)
    stored = optuna.load_study(study_name="confirm", storage=storage).user_attrs["confirmed"]
    assert stored["complete"] == 4 and len(stored["entries"]) == 2
    # a finished, confirmed study is not re-timed; new trials are
    tune_study(storage=storage, name="confirm", space=space, measure=cost, n_trials=4,
               progress=quiet, retime=retime, confirm_top=2)
    assert len(retimed) == 6
    again = tune_study(storage=storage, name="confirm", space=space, measure=cost, n_trials=6,
                       progress=quiet, retime=retime, confirm_top=2, confirm_rounds=1)
    assert len(retimed) == 8 and again.confirmed and again.complete == 6
    # the default is re-timed beside the best even when it is not among the fastest
    retimed.clear()
    lines.clear()
    r = tune_study(storage=storage, name="confirm1", space=space, measure=cost, n_trials=3,
                   warm_starts=starts, progress=lines.append, retime=retime, confirm_top=1,
                   confirm_rounds=2)
    assert [space.key(c) for c in retimed].count(space.key(default)) == 2 and len(retimed) == 4
    assert any("re-timing the 1 fastest configs and the default, 2 rounds" in ln for ln in lines)
    assert r.best_config == truly_best and r.speedup == pytest.approx(1 / 0.9)


def test_one_slow_retiming_round_does_not_unseat_the_default(storage):
    """Two re-timing rounds (a budgeted run's) take the faster of each config's two times:
    a single slow round of the default -- a clock dip -- must not hand the win to a config
    that is slower in every other measurement."""
    space = fwd_space()
    base = cost_of(space)
    default = space.default()
    runner_up = next(c for c in sorted(space.points(), key=base)
                     if space.key(c) != space.key(default))

    def cost(cfg):  # the default is best; the runner-up 4% slower
        return base(default) * (1.0 if space.key(cfg) == space.key(default) else 1.04 if
                                space.key(cfg) == space.key(runner_up) else 2.0)

    seen = []

    def retime(cfg):  # the default's first re-timing reads 30% slow
        seen.append(space.key(cfg))
        slow = space.key(cfg) == space.key(default) and seen.count(space.key(default)) == 1
        return cost(cfg) * (1.3 if slow else 1.0)

    r = tune_study(storage=storage, name="slowround", space=space, measure=cost, n_trials=2,
                   warm_starts=[("planner", default), ("other", runner_up)], progress=quiet,
                   retime=retime, confirm_top=2, confirm_rounds=2)
    assert r.confirmed and seen.count(space.key(default)) == 2
    assert space.key(r.best_config) == space.key(default)
    assert r.best_ms == pytest.approx(cost(default))


def test_the_summary_times_what_the_package_ran_before(storage):
    """The first warm start is what the package runs today (a tuned entry, or the untuned
    default: on Hopper often the Gluon one, faster than the planner's `tl` config). It is
    re-timed in the confirmation round beside the winner and the planner's config, and
    `gain` (the summary's "vs before") is the winner against it, not against the planner."""
    space = fwd_space()
    base = cost_of(space)
    default = space.default()
    others = sorted((c for c in space.points() if space.key(c) != space.key(default)), key=base)
    best, before = others[0], others[len(others) // 2]
    assert len({space.key(c) for c in (best, before, default)}) == 3

    def cost(cfg):   # the planner's config is far slower than what ran before
        return 3.0 * base(best) if cfg == default else base(cfg)

    retimed, lines = [], []

    def retime(cfg):
        retimed.append(cfg)
        return cost(cfg)

    r = tune_study(storage=storage, name="before", space=space, measure=cost, n_trials=4,
                   warm_starts=[("gluon", before), ("planner", default), ("try", best)],
                   progress=lines.append, retime=retime, confirm_top=1, confirm_rounds=2)
    assert r.confirmed and r.best_config == best
    assert r.before_ms == cost(before) and r.default_ms == cost(default)
    assert r.gain == pytest.approx(cost(before) / cost(best))
    assert r.speedup == pytest.approx(cost(default) / cost(best)) and r.speedup > r.gain
    assert {space.key(c) for c in retimed} == {space.key(c) for c in (best, before, default)}
    assert any("re-timing the 1 fastest configs and the default and the one before" in ln
               for ln in lines)
    assert any(f"before {cost(before):.4f} ms" in ln for ln in lines)
    table = format_summary([r])
    assert f"{r.gain:.3f}x" in table.splitlines()[2]
    # a resumed study keeps its first run's "before", whatever the warm starts say now
    again = tune_study(storage=storage, name="before", space=space, measure=cost, n_trials=5,
                       warm_starts=[("tuned", best)], progress=lines.append, retime=retime,
                       confirm_top=1, confirm_rounds=1)
    assert again.before_ms == cost(before)


def test_warm_starts_are_enqueued_once_and_first(storage):
    space = fwd_space()
    spec_tile = {"block_m": 64, "block_n": 32, "num_warps": 2, "num_stages": 2}
    starts = [("planner", space.default()), ("spec", spec_tile)]
    for n in (3, 6):
        tune_study(storage=storage, name="warm", space=space, measure=cost_of(space),
                   n_trials=n, warm_starts=starts, progress=quiet)
    trials = trials_of(storage, "warm")
    assert trials[0].params == space.default() and trials[0].user_attrs[ATTR_WARM] == "planner"
    assert trials[1].params == spec_tile and trials[1].user_attrs[ATTR_WARM] == "spec"
    assert sum(bool(t.user_attrs.get(ATTR_WARM)) for t in trials) == 2
    assert not any(t.state == TrialState.WAITING for t in trials)
    assert len(trials) == 6


def test_try_configs_and_the_tuning_files_winner_are_warm_starts():
    """`--try` strings become points of each variant's space (knob values read through the
    space's choices); one a variant cannot take is left out for it, and the tuning file's
    current winner ("tuned") comes first, before the defaults and the tries."""
    spec = load_spec(ROOT / "specs" / "llama.yaml")
    bwd = space_for("bwd", 128, 2, **H100)
    fwd = space_for("fwd", 128, 2, **H100)
    tries = [parse_try("64x128w8s3"), parse_try("64x128w8s2:dq_tile=128x64w8s3"),
             parse_try("64x128w8s3:dq_tile=nonsense")]
    assert tries[1] == {"block_m": 64, "block_n": 128, "num_warps": 8, "num_stages": 2,
                        "dq_tile": "128x64w8s3"}
    incumbent = {"block_m": 32, "block_n": 128, "num_warps": 8, "num_stages": 3,
                 "dq_tile": "mirror", "ms": 1.0, "default_ms": 1.2}
    starts = _warm_starts(spec, "bwd", bwd, incumbent=incumbent, tries=tries)
    assert [tag for tag, _ in starts] == ["tuned", "planner", "try", "try"]
    assert starts[0][1] == bwd.config(incumbent) and "ms" not in starts[0][1]
    assert starts[3][1]["dq_tile"] == "128x64w8s3" and starts[3][1]["num_stages"] == 2
    assert all(bwd.check(cfg) is None for _, cfg in starts)
    # the forward has no dq_tile knob: only the plain tile applies to it
    assert [cfg for tag, cfg in _warm_starts(spec, "fwd", fwd, tries=tries) if tag == "try"] == [
        fwd.config(tries[0])]
    for bad in ("64x128", "64x128w8s3:dq_tile", "big"):
        with pytest.raises(FlashgenError, match="--try"):
            parse_try(bad)


def test_a_small_space_is_measured_exhaustively_then_stops(storage):
    space = space_for("bwd", 128, 2, 49152, 132)   # a tiny smem budget: few tiles fit
    assert 0 < len(space) < 20
    result = tune_study(storage=storage, name="tiny", space=space, measure=cost_of(space),
                        n_trials=500, progress=quiet)
    assert result.stopped == "space exhausted" and result.complete == len(space)
    best = min(space.points(), key=cost_of(space))
    assert result.best_config == best


def test_progress_lines_and_summary_table(storage):
    space = fwd_space()
    lines = []
    result = tune_study(storage=storage, name="prog", space=space, measure=cost_of(space),
                        n_trials=3, progress=lines.append, label="fwd_d64_fp16@1024",
                        warm_starts=[("planner", space.default())])
    assert [ln.split(" [")[0] for ln in lines[:3]] == [
        f"fwd_d64_fp16@1024: trial {i}/3" for i in (1, 2, 3)]
    assert all("best " in ln and "ETA " in ln for ln in lines[:3])
    assert lines[-1].startswith("fwd_d64_fp16@1024: done (3 trials)")
    result.variant, result.bucket = "fwd_d64_fp16", 1024
    table = format_summary([result, StudyResult(name="x", variant="bwd_d64_fp16", bucket=512,
                                                failed=2, stopped="2 failures")])
    head, rule, row, empty = table.splitlines()
    assert head.split() == ["variant", "bucket", "planner", "ms", "before", "ms", "tuned", "ms",
                            "vs", "planner", "vs", "before", "done/failed", "tuned", "config",
                            "stopped"]
    assert row.split()[:3] == ["fwd_d64_fp16", "1024", f"{result.default_ms:.4f}"]
    assert f"{result.default_ms / result.best_ms:.3f}x" in row and "3/0" in row
    assert empty.split()[:4] == ["bwd_d64_fp16", "512", "-", "-"]


def test_study_names_and_storage_kinds(tmp_path):
    assert study_name("fwd_causal_d64_bf16", 4096, "NVIDIA H100 80GB HBM3|sm90|132sm") == \
        "fwd_causal_d64_bf16@4096@nvidia-h100-80gb-hbm3-sm90-132sm"
    from flashgen.tune import default_storage, open_storage

    (tmp_path / "repo" / ".git").mkdir(parents=True)
    (tmp_path / "repo" / "sub").mkdir()
    (tmp_path / "plain").mkdir()
    assert default_storage(tmp_path / "repo" / "sub") == \
        f"sqlite:///{tmp_path / 'repo' / '.flashgen' / 'tune.db'}"   # the checkout's root
    assert default_storage(tmp_path / "plain") == \
        f"sqlite:///{tmp_path / 'plain' / '.flashgen' / 'tune.db'}"  # else the folder itself
    space = fwd_space()
    journal = open_storage(str(tmp_path / "j" / "tune.log"))
    r = tune_study(storage=journal, name="j", space=space, measure=cost_of(space), n_trials=3,
                   progress=quiet)
    assert r.complete == 3 and (tmp_path / "j" / "tune.log").stat().st_size > 0


# ----------------------------------------------------------------------------------------
# the data: JSON, build, dispatch
# ----------------------------------------------------------------------------------------

GPU = {"name": "Fake GPU 80GB", "capability": [9, 0], "sm_count": 132, "key": FAKE_KEY}
VERSIONS = {"triton": "3.9.0", "torch": "2.13.0", "flashgen": "0.1.0"}


def test_tuning_files_are_byte_stable_sorted_and_merge_only_what_was_studied(tmp_path):
    path = tmp_path / "t" / f"{tuning_data.slug(FAKE_KEY)}.json"
    cfg = {"num_warps": 4, "block_n": 64, "num_stages": 3, "block_m": 128}
    results = {"fwd_d64_fp16": {16384: tuning_data.entry(cfg, 1.23456789, 1.5),
                                512: tuning_data.entry(cfg, 0.1, 0.1),
                                2048: tuning_data.entry(cfg, 0.2, 0.3)}}
    tuning_data.update(path, gpu=GPU, versions=VERSIONS, spec_sha="abc", results=results)
    first = path.read_bytes()
    mtime = path.stat().st_mtime_ns
    tuning_data.update(path, gpu=GPU, versions=VERSIONS, spec_sha="abc", results=results)
    assert path.read_bytes() == first and path.stat().st_mtime_ns == mtime
    text = first.decode()
    assert text.endswith("}\n") and "\n  " in text
    data = json.loads(text)
    assert list(data) == ["configs", "gpu", "spec_sha", "versions"]
    assert list(data["configs"]["fwd_d64_fp16"]) == ["512", "2048", "16384"]  # numeric order
    assert list(data["configs"]["fwd_d64_fp16"]["16384"]) == [
        "block_m", "block_n", "default_ms", "ms", "num_stages", "num_warps"]
    assert data["configs"]["fwd_d64_fp16"]["16384"]["ms"] == 1.2346
    # a new tune replaces only the entries it studied
    other = dict(cfg, block_m=64)
    tuning_data.update(path, gpu=GPU, versions=dict(VERSIONS, triton="3.10.0"), spec_sha="def",
                       results={"fwd_d64_fp16": {2048: tuning_data.entry(other, 0.15, 0.3)},
                                "bwd_d64_fp16": {512: tuning_data.entry(cfg, 0.4, 0.5)}})
    data = json.loads(path.read_text())
    assert data["configs"]["fwd_d64_fp16"]["2048"]["block_m"] == 64
    assert data["configs"]["fwd_d64_fp16"]["512"]["block_m"] == 128
    assert data["configs"]["fwd_d64_fp16"]["16384"]["ms"] == 1.2346
    assert data["configs"]["bwd_d64_fp16"]["512"]["ms"] == 0.4
    assert data["versions"]["triton"] == "3.10.0" and data["spec_sha"] == "def"


@pytest.fixture(scope="module")
def tuned_pkg(tmp_path_factory):
    """A tiny package built with tuning data from a synthetic study: (pkg, spec, best)."""
    root = tmp_path_factory.mktemp("tuned")
    name = f"fgtune_{uuid.uuid4().hex[:8]}"
    spec_path = root / f"{name}.yaml"
    spec_path.write_text(f"package: {name}\nhead_dims: [64]\ndtypes: [fp16]\nmasks: [causal]\n"
                         "seqlen_buckets: [1024, 2048, 4096, 8192]\n"
                         "gpu: {name: H100, sram_bytes: 232448, sm_count: 132}\n")
    spec = load_spec(spec_path)
    space = space_for("fwd", 64, 2, **H100)   # with the forward's knobs, as `tune` uses it
    storage = f"sqlite:///{root / 'tune.db'}"
    results = []
    for bucket, block_m in ((1024, 64), (8192, 128)):   # different winners per bucket
        r = tune_study(storage=storage, name=study_name("fwd_causal_d64_fp16", bucket, FAKE_KEY),
                       space=space, measure=cost_of(space, bucket, block_m), n_trials=20,
                       warm_starts=[("planner", space.default())], progress=quiet)
        r.variant, r.bucket = "fwd_causal_d64_fp16", bucket
        results.append(r)
    gpu = GpuInfo(key=FAKE_KEY, name="Fake GPU 80GB", capability=(9, 0), sm_count=132,
                  sram_bytes=232448)
    _write_results(spec, gpu, results, quiet)
    # a file for another GPU, with a variant the spec does not have
    other = tuning_data.tuning_dir(spec) / "other-gpu.json"
    tuning_data.update(other, gpu=dict(GPU, key="Other|sm80|108sm"), versions=VERSIONS,
                       spec_sha="x", results={"fwd_window_d64_fp16": {
                           1024: tuning_data.entry(space.default(), 1.0, 1.0)}})
    with pytest.warns(tuning_data.TuningDataWarning, match="fwd_window_d64_fp16 is no longer"):
        pkg = _build_import(spec_path, root / "out", name)
    best = {r.bucket: r.best_config for r in results}
    assert best[1024] != best[8192]
    yield pkg, spec, best
    _forget(name)


def _build_import(spec_path, out, name):
    """Build the spec into `out` and import its package `name`."""
    build(spec_path, out)
    sys.path.insert(0, str(out))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(out))


def _forget(name):
    """Drop an imported test package (and its modules) from sys.modules."""
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


def test_the_best_config_reaches_the_built_package(tuned_pkg):
    pkg, spec, best = tuned_pkg
    path = tuning_data.tuning_path(spec, FAKE_KEY)
    assert path.name == "fake-gpu-80gb-sm90-132sm.json" and path.parent.parent.name == "tuning"
    data = json.loads(path.read_text())
    assert data["gpu"] == GPU and data["spec_sha"] == spec.sha
    assert set(data["versions"]) == {"triton", "torch", "flashgen"}
    tuned = pkg._registry.TUNED
    assert list(tuned) == [FAKE_KEY]     # the other GPU had only a dropped variant
    assert tuned[FAKE_KEY] == {"fwd_causal_d64_fp16": {1024: best[1024], 8192: best[8192]}}
    for cfg in tuned[FAKE_KEY]["fwd_causal_d64_fp16"].values():
        assert list(cfg) == ["block_m", "block_n", "num_warps", "num_stages", "tma", "family",
                             "pingpong", "l2_share", "persistent", "regs", "q_buffers",
                             "overlap", "diag_first", "stream_k"]  # configs only
        assert all(type(cfg[k]) is int for k in ("block_m", "block_n", "num_warps", "num_stages"))
        assert type(cfg["tma"]) is bool
    text = pkg.describe()
    assert f"{FAKE_KEY}: 1 of 4 variants, 2 (variant, bucket) configs" in text
    assert f"triton {data['versions']['triton']}" in text


def _fake_cuda(index=0):
    return types.SimpleNamespace(type="cuda", index=index)


def test_dispatch_picks_the_gpu_keys_nearest_tuned_bucket(tuned_pkg, monkeypatch):
    pkg, spec, best = tuned_pkg
    rt = pkg._runtime
    monkeypatch.setattr(rt, "gpu_key", lambda device: (FAKE_KEY, 232448, 132))
    monkeypatch.setattr(rt, "_configs", {})
    name = "fwd_causal_d64_fp16"
    assert rt.launch_config(name, _fake_cuda(), 1000) == best[1024]   # bucket 1024
    assert rt.launch_config(name, _fake_cuda(), 2048) == best[1024]   # 2048: 1024 is nearer
    assert rt.launch_config(name, _fake_cuda(), 3000) == best[8192]   # bucket 4096 -> 8192
    assert rt.launch_config(name, _fake_cuda(), 50000) == best[8192]
    with rt.override_config(block_m=16, block_n=16, num_warps=2, num_stages=1):
        assert rt.launch_config(name, _fake_cuda(), 1000)["block_m"] == 16


def test_dispatch_takes_a_tuned_gluon_backward(tuned_pkg, monkeypatch):
    """A backward entry whose winner is a Gluon config (what `flashgen tune` writes on an
    H100) is dispatched as written: the forward's fill-in of knobs tuned before they
    existed (diag_first) is the forward's alone. (It raised KeyError before.)"""
    pkg, spec, best = tuned_pkg
    rt = pkg._runtime
    name = "bwd_causal_d64_fp16"
    entry = {"block_m": 128, "block_n": 128, "num_warps": 4, "num_stages": 2,
             "dq_tile": "mirror", "family": "gluon", "regs": "232/40"}
    monkeypatch.setattr(rt, "gpu_key", lambda device: (FAKE_KEY, 232448, 132))
    monkeypatch.setattr(rt, "_configs", {})
    monkeypatch.setitem(rt.TUNED, FAKE_KEY, {**rt.TUNED.get(FAKE_KEY, {}), name: {4096: entry}})
    assert rt.launch_config(name, _fake_cuda(), 4096) == entry


def test_dispatch_on_an_untuned_gpu_plans_for_its_real_smem(tuned_pkg, monkeypatch):
    pkg, spec, best = tuned_pkg
    rt = pkg._runtime
    monkeypatch.setattr(rt, "gpu_key", lambda device: ("Small GPU|sm86|84sm", 101376, 84))
    monkeypatch.setattr(rt, "_configs", {})
    name = "fwd_causal_d64_fp16"
    for n in (1000, 8192):
        assert rt.launch_config(name, _fake_cuda(), n) == \
            planner_core.plan("fwd", 64, 2, 101376, 84, arch=86).chosen.as_dict()
    # a GPU with little shared memory gets a plan that fits it, not the H100's
    monkeypatch.setattr(rt, "gpu_key", lambda device: ("Tiny|sm75|40sm", 32768, 40))
    monkeypatch.setattr(rt, "_configs", {})
    small = planner_core.plan("fwd", 64, 2, 32768, 40, arch=75).chosen.as_dict()
    assert small != rt.PLANNED[name] and small not in best.values()
    assert rt.launch_config(name, _fake_cuda(1), 1000) == small


def test_dispatch_on_an_untuned_gpu_plans_for_its_architecture(tuned_pkg, monkeypatch):
    # the same shared memory, sm_80 vs sm_90: before Hopper the planner's spill-free tile
    pkg, spec, best = tuned_pkg
    rt = pkg._runtime
    name = "fwd_causal_d64_fp16"
    got = {}
    for arch in (80, 90):
        monkeypatch.setattr(rt, "gpu_key", lambda device, a=arch: (f"GPU|sm{a}|108sm", 166912, 108))
        monkeypatch.setattr(rt, "_configs", {})
        got[arch] = rt.launch_config(name, _fake_cuda(), 1000)
        assert got[arch] == planner_core.plan("fwd", 64, 2, 166912, 108, arch=arch).chosen.as_dict()
    assert got[80] != got[90] and got[80]["num_warps"] == 8  # 128x64 w8 (85 regs cap), not w4
    assert rt.key_arch("NVIDIA A100-SXM4-80GB|sm80|108sm") == 80
    assert rt.key_arch("NVIDIA GeForce RTX 5090|sm120|170sm") == 120
    assert rt.key_arch("no capability") == planner_core.DEFAULT_ARCH


# ----------------------------------------------------------------------------------------
# the CLI and the GPU measure's correctness check
# ----------------------------------------------------------------------------------------

def test_tune_without_cuda_exits_2_with_a_message(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    res = subprocess.run([sys.executable, "-m", "flashgen", "tune", str(ROOT / "specs" / "gpt2.yaml"),
                          "--trials", "3", "--storage", f"sqlite:///{tmp_path / 'x.db'}"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    msg = res.stderr.strip()
    assert msg.startswith("flashgen tune: error: ") and "CUDA" in msg and "\n" not in msg
    assert not (tmp_path / "x.db").exists()  # nothing was created


def test_tune_cli_reports_bad_flags_and_no_cuda_in_process(monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = str(ROOT / "specs" / "gpt2.yaml")
    assert cli_main(["tune", spec]) == 2
    assert "CUDA GPU" in capsys.readouterr().err
    assert cli_main(["tune", spec, "--trials", "0"]) == 2
    assert "--trials must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli_main(["tune", spec, "--sampler", "random"])


@pytest.fixture(scope="module")
def check_pkg(tmp_path_factory):
    name = f"fgtunecheck_{uuid.uuid4().hex[:8]}"
    pkg = build_and_import(tmp_path_factory.mktemp("check"), name,
                           "head_dims: [32]\ndtypes: [fp32]\nmasks: [causal]\ndropout: true\n")
    yield pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.fixture(scope="module")
def decode_pkg(tmp_path_factory):
    name = f"fgtunedecode_{uuid.uuid4().hex[:8]}"
    pkg = build_and_import(tmp_path_factory.mktemp("decode"), name,
                           "head_dims: [32]\ndtypes: [fp32]\nmasks: [causal, sliding_window]\n"
                           "window: {left: 16, right: 0}\ngqa: true\ndecode: true\n")
    yield pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.mark.parametrize("mask", ["causal", "window"])
def test_the_decode_measure_checks_ragged_caches_and_rejects_a_wrong_answer(
        decode_pkg, mask, monkeypatch):
    """Decoding variants are tuned too: the check runs flash_attn_with_kvcache on a ragged
    cache (GQA 4:1) against the float64 reference, with the config's split count."""
    name = f"decode_{mask}_d32_fp32"
    work = gpu_measure(decode_pkg, name, 4096, "cpu")
    assert isinstance(work, DecodeWorkload) and work.gqa is False
    work = DecodeWorkload(decode_pkg, name, decode_pkg._registry.VARIANTS[name], 4096, "cpu",
                          window=(16, 0), gqa=True, check_n=50)
    for splits in (0, 1, 4):
        cfg = {"block_m": 16, "block_n": 16, "num_warps": 2, "num_stages": 1,
               "num_splits": splits}
        assert work.check(cfg) is None, splits
    real = decode_pkg.flash_attn_with_kvcache

    def off_by_a_bit(*args, **kwargs):
        out = real(*args, **kwargs)
        out[1:] += 0.01 * out.abs().max()   # wrong only for the half-full cache
        return out

    monkeypatch.setattr(decode_pkg, "flash_attn_with_kvcache", off_by_a_bit)
    reason = work.check(cfg)
    assert reason is not None and reason.startswith("out differs"), reason
    assert "cache length 28 of 50" in reason


@pytest.fixture(scope="module")
def mla_pkg(tmp_path_factory):
    name = f"fgtunemla_{uuid.uuid4().hex[:8]}"
    pkg = build_and_import(tmp_path_factory.mktemp("mla"), name,
                           "head_dims: [{qk: 48, v: 32}]\ndtypes: [fp32]\nmasks: [causal]\n"
                           "gqa: true\ndecode: true\n")
    yield pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


@pytest.mark.parametrize("kind", ["decode", "fwd", "bwd"])
def test_the_measures_build_v_at_the_variants_v_head_dim(mla_pkg, kind, monkeypatch):
    """An MLA variant (V's head dim 32, Q's and K's 48) is checked and timed with V at V's
    head dim: before, the measures built V at Q's and the package refused every trial, so
    such variants (DeepSeek's 576 / 512 decode) could not be tuned."""
    name = f"{kind}_causal_d48v32_fp32"
    facts = mla_pkg._registry.VARIANTS[name]
    assert facts["v_head_dim"] == 32
    cls = DecodeWorkload if kind == "decode" else Workload
    work = cls(mla_pkg, name, facts, 4096, "cpu", gqa=True, check_n=40)
    cfg = {"block_m": 16, "block_n": 16, "num_warps": 2, "num_stages": 1}
    if kind == "decode":
        cfg["num_splits"] = 2
    seen = []
    call = "flash_attn_with_kvcache" if kind == "decode" else "flash_attn_func"
    real = getattr(mla_pkg, call)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.shape[-1], k.shape[-1], v.shape[-1]))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(mla_pkg, call, spy)
    assert work.check(cfg) is None
    assert seen and set(seen) == {(48, 48, 32)}
    # the timed shape's V too (built, not run: timing needs CUDA)
    if kind == "decode":
        q, k_cache, v_cache = work._cache(2, 1, 8, 4)
        assert (q.shape[-1], k_cache.shape[-1], v_cache.shape[-1]) == (48, 48, 32)
    else:
        q, k, v = work._inputs(1, 2, 2, 8, False)
        assert (q.shape[-1], k.shape[-1], v.shape[-1]) == (48, 48, 32)


def test_the_tune_space_plans_at_the_larger_head_dim():
    """The tuner's space (and its default) plans an MLA variant at the larger of its head
    dims, as the package plans it at run time."""
    from flashgen.tune import GpuInfo, _space

    facts = {"kind": "decode", "mask": "causal", "head_dim": 24, "v_head_dim": 40,
             "dtype": "bf16"}
    gpu = GpuInfo(key="H100|sm90|132sm", name="H100", **H100)
    assert _space("decode", facts, gpu).facts.head_dim == 40


def test_decode_space_has_the_split_knob():
    space = space_for("decode", 128, 2, **H100)
    assert space.default()["num_splits"] == 0
    assert {p["num_splits"] for p in space.points()} == {0, 1, 2, 4, 8, 16, 32}


def test_budget_shares_the_time_left_among_the_studies_left(monkeypatch):
    now = [100.0]
    monkeypatch.setattr("flashgen.tune.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    clock = Budget(120.0, 4)
    assert clock.share() == 30.0
    now[0] += 10.0          # the first study finished early
    clock.done()
    assert clock.share() == pytest.approx(110.0 / 3)
    clock.done()
    assert clock.share() == pytest.approx(55.0)
    assert not clock.spent()
    now[0] += 500.0         # over budget: `tune` skips the studies left
    assert clock.share() == 0.0 and clock.spent()
    assert Budget(None, 3).share() is None and not Budget(None, 3).spent()


def test_a_trial_that_would_overrun_the_timeout_is_not_started(storage, monkeypatch):
    """Each trial here takes 3 s (fake clock). With 7 s, the study runs two trials and
    stops: a third would end at 9 s. Before, it started one whenever the clock still read
    under the timeout, and ended at 9 s, taking the overrun from later studies."""
    now = [0.0]
    monkeypatch.setattr("flashgen.study.time", types.SimpleNamespace(monotonic=lambda: now[0]))
    space = fwd_space()

    def measure(cfg):
        now[0] += 3.0
        return 1.0

    r = tune_study(storage=storage, name="overrun", space=space, measure=measure, n_trials=10,
                   timeout=7.0, warm_starts=[("planner", space.default())], progress=quiet,
                   min_trials=1, confirm_top=0)
    assert r.complete == 2 and r.stopped == "timeout" and now[0] == 6.0
    # a study whose share is below one trial still measures its min_trials
    r = tune_study(storage=storage, name="short", space=space, measure=measure, n_trials=10,
                   timeout=1.0, progress=quiet, min_trials=1, confirm_top=0)
    assert r.complete == 1


def test_a_study_with_one_config_is_not_retimed(storage):
    """Re-timing compares configs back to back; with a single config measured (a budgeted
    study that only reached its default) there is nothing to compare, and at the long
    buckets each timing of a slow variant costs seconds."""
    space = fwd_space()
    retimed = []
    r = tune_study(storage=storage, name="one", space=space, measure=lambda cfg: 2.0,
                   n_trials=1, warm_starts=[("planner", space.default())], progress=quiet,
                   retime=lambda cfg: retimed.append(cfg) or 1.0, confirm_top=2)
    assert retimed == [] and not r.confirmed and r.best_ms == 2.0 == r.default_ms


@pytest.mark.parametrize("kind, dropout", [("fwd", False), ("bwd", False), ("fwd", True)])
def test_the_gpu_measures_check_rejects_a_wrong_answer(check_pkg, kind, dropout, monkeypatch):
    """The check the GPU measure runs before timing, here in Triton's interpreter; dropout
    variants are checked against the reference with the call's replayed keep mask."""
    name = f"{kind}_causal{'_dropout' if dropout else ''}_d32_fp32"
    cfg = {"block_m": 16, "block_n": 16, "num_warps": 2, "num_stages": 1}
    work = Workload(check_pkg, name, check_pkg._registry.VARIANTS[name], 1024, "cpu",
                    check_n=24)
    assert work.check(cfg) is None
    real = check_pkg.flash_attn_func

    def off_by_a_bit(*args, **kwargs):   # a "fast but wrong" kernel
        out = real(*args, **kwargs)
        return out + 0.01 * out.detach().abs().max()

    monkeypatch.setattr(check_pkg, "flash_attn_func", off_by_a_bit)
    if kind == "fwd":
        reason = work.check(cfg)
        assert reason.startswith("out differs from the float64 reference"), reason
        assert ("with the call's dropout mask" in reason) == dropout
    else:  # the output shift does not change gradients: break the backward config instead
        monkeypatch.setattr(check_pkg, "flash_attn_func", real)
        bad = dict(cfg)
        orig = check_pkg._runtime.backward

        def wrong_backward(*args, **kwargs):
            orig(*args, **kwargs)
            args[6].mul_(1.5)   # dq
        monkeypatch.setattr(check_pkg._runtime, "backward", wrong_backward)
        reason = work.check(bad)
        assert reason is not None and reason.startswith("dq differs"), reason


# ----------------------------------------------------------------------------------------
# benchmarks/tune_vs_grid.py's logic
# ----------------------------------------------------------------------------------------

def _load_tune_vs_grid():
    spec = importlib.util.spec_from_file_location("tune_vs_grid",
                                                  ROOT / "benchmarks" / "tune_vs_grid.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tune_vs_grid_compares_a_quarter_budget_with_the_exhaustive_grid():
    tvg = _load_tune_vs_grid()
    # the tile space alone: with the dQ knob TPE happens to hit the grid's best, and this
    # test needs a run that does not (for `confirm`)
    space = space_for("bwd", 64, 2, **H100, knobs={})
    cost = tvg.synthetic_cost(space, salt="t")
    row = tvg.compare(space, cost, storage=optuna.storages.InMemoryStorage(), name="t",
                      seeds=(0, 1))
    assert row["grid_trials"] == len(space) and row["budget"] == len(space) // 4
    best = min(space.points(), key=cost)
    assert row["grid_config"] == best and row["grid_best_ms"] == cost(best)
    for run in row["runs"]:
        assert run["tpe_trials"] <= row["budget"]
        assert run["ratio"] == run["tpe_best_ms"] / row["grid_best_ms"] >= 1.0
        assert run["within_bar"] == (run["ratio"] <= 1.03)
    table = tvg.format_rows([row])
    assert table.count("\n") == 3 and "| t (seed 1) |" in table
    # `confirm` (the GPU's back-to-back re-timing) replaces the studies' own numbers
    row2 = tvg.compare(space, cost, storage=optuna.storages.InMemoryStorage(), name="t",
                       confirm=lambda a, b: (1.0, 1.02))
    assert row2["runs"][0]["ratio"] == pytest.approx(1.02) and row2["runs"][0]["within_bar"]


def test_a_zero_timeout_still_measures_min_trials(storage):
    """A budgeted run whose time is spent still measures each study's first warm start
    (the default config), so every variant gets a default-vs-tuned row."""
    space = fwd_space()
    calls = []

    def measure(cfg):
        calls.append(cfg)
        return 1.0

    result = tune_study(storage=storage, name="min", space=space, measure=measure, n_trials=10,
                        timeout=0.0, warm_starts=[("planner", space.default())],
                        progress=quiet, min_trials=1, confirm_top=0)
    assert result.stopped == "timeout" and calls == [space.default()]


def test_compile_ahead_worker_keeps_one_measure_and_reports_failures(monkeypatch):
    """flashgen/ahead.py's worker side, in-process with a stand-in measure: one measure per
    (variant, bucket), replaced (and closed) when the study changes; a config that raises
    comes back as its reason instead of killing the worker."""
    from flashgen import ahead, measure

    made, closed = [], []

    class Fake:
        def __init__(self, variant, bucket):
            self.key, self.ran = (variant, bucket), []
            made.append(self)

        def compile_once(self, config):
            if config.get("bad"):
                raise RuntimeError("out of resource: shared memory")
            self.ran.append(config)

        def close(self):
            closed.append(self.key)

    monkeypatch.setattr(measure, "gpu_measure",
                        lambda pkg, variant, bucket, device, spec=None: Fake(variant, bucket))
    monkeypatch.setattr(ahead, "_STATE", {"pkg": None, "spec": None, "device": None})
    assert ahead._compile("fwd_d64_bf16", 4096, {"block_n": 64}) is None
    assert ahead._compile("fwd_d64_bf16", 4096, {"block_n": 128}) is None
    assert "shared memory" in ahead._compile("fwd_d64_bf16", 4096, {"bad": True})
    assert ahead._compile("fwd_d64_bf16", 2048, {"block_n": 64}) is None
    assert [m.key for m in made] == [("fwd_d64_bf16", 4096), ("fwd_d64_bf16", 2048)]
    assert made[0].ran == [{"block_n": 64}, {"block_n": 128}] and closed == [("fwd_d64_bf16", 4096)]


# ----------------------------------------------------------------------------------------
# variants with mods
# ----------------------------------------------------------------------------------------

MODS_BODY = """
head_dims: [32]
dtypes: [fp32]
masks: [none, causal]
gqa: true
decode: true
mods:
  softcap: {builtin: softcap, params: {cap: 2.0}}
  document: {builtin: document}
  prefix_lm: {builtin: prefix_lm}
variants:
  - {mask: causal, mods: [document, softcap]}
  - {mask: none, mods: [prefix_lm]}
"""


@pytest.fixture(scope="module")
def mods_pkg(tmp_path_factory):
    name = f"fgtunemods_{uuid.uuid4().hex[:8]}"
    yield build_and_import(tmp_path_factory.mktemp("mods"), name, MODS_BODY)
    _forget(name)


def _shipped_mods_registry():
    """generated/mods_attn's registry (bf16/fp16, d=64/128: the Gluon kernels' variants)."""
    path = ROOT / "generated" / "mods_attn" / "_registry.py"
    spec = importlib.util.spec_from_file_location("mods_attn_registry_tune", path)
    reg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reg)
    return reg


def _mod_kinds(reg, name):
    return tuple(sorted({reg.MODS[m]["kind"] for m in reg.VARIANTS[name].get("mods", ())}))


def test_variants_with_mods_are_selected_and_only_decode_ones_skipped(mods_pkg):
    """The forward and backward with mods are tuned under their own names (they were all
    skipped before); a decode variant with mods is skipped with the reason."""
    from flashgen.tune import select_variants

    said = []
    names = select_variants(mods_pkg._registry.VARIANTS, ["*document*", "*prefix_lm*"],
                            said.append)
    assert names == ["fwd_causal_document_softcap_d32_fp32",
                     "bwd_causal_document_softcap_d32_fp32",
                     "fwd_prefix_lm_d32_fp32", "bwd_prefix_lm_d32_fp32"]
    assert said == [f"{v}: skipped, the decode measure makes no mod inputs yet (a decode "
                    "call's q_idx is its cache position; the variant runs its base variant's "
                    "tuned config)" for v in ("decode_causal_document_softcap_d32_fp32",
                                              "decode_prefix_lm_d32_fp32")]
    # a whole-spec run takes SDPA's attn_mask variants (the sdpa_mask mod) as well
    every = select_variants(mods_pkg._registry.VARIANTS, None, quiet)
    assert {"fwd_sdpa_mask_d32_fp32", "bwd_sdpa_mask_d32_fp32"} <= set(every)
    with pytest.raises(FlashgenError, match="makes no mod inputs"):
        gpu_measure(mods_pkg, "decode_prefix_lm_d32_fp32", 4096, "cpu")


def test_a_mods_trial_checks_and_times_the_call_with_its_mod_inputs(mods_pkg, monkeypatch,
                                                                   storage):
    """A study of a variant with mods, through the GPU measure's own check and timed call
    (the timing itself a stand-in: one run of the timed backward, a fixed time): both call
    flash_attn_func with mods=(...) and the mods' arguments at their own shape -- the
    check's document ids and cap at the check's (B, N), the timed call's at the bucket's,
    made once per shape with the mods bench's generator (ragged documents) -- and the
    check's reference applies them."""
    from flashgen import measure
    from flashgen.bench import mods as bench_mods
    from flashgen.mods import builtin_mod

    name = "bwd_causal_document_softcap_d32_fp32"
    monkeypatch.setattr(measure, "TOKENS", 128)   # the timed shape: B = 2, H = 2, N = 64
    monkeypatch.setattr(measure, "HIDDEN", 64)
    monkeypatch.setattr(measure, "bench_ms", lambda fn, grads=None: (fn(), 1.0)[1])
    real = mods_pkg.flash_attn_func
    calls = []

    def spy(q, k, v, *args, **kwargs):
        calls.append((tuple(q.shape), kwargs))
        return real(q, k, v, *args, **kwargs)

    monkeypatch.setattr(mods_pkg, "flash_attn_func", spy)
    work = Workload(mods_pkg, name, mods_pkg._registry.VARIANTS[name], 64, "cpu", gqa=True,
                    check_n=40)
    space = space_for("bwd", 32, 4, **{**H100, "knobs": {}})
    r = tune_study(storage=storage, name="mods", space=space, measure=work, n_trials=2,
                   warm_starts=[("planner", space.default())], progress=quiet, confirm_top=0)
    assert (r.complete, r.failed) == (2, 0)
    by_shape = {}
    for shape, kw in calls:
        assert kw["mods"] == ("document", "softcap") and kw["cap"] == 2.0
        assert kw["doc"].dtype == torch.int32 and kw["doc"].shape == (shape[0], shape[1])
        by_shape.setdefault(shape[:3], []).append(kw["doc"])
    # the check (B=2, N=40, 4 query heads: GQA) twice, the timed forward once
    assert {s: len(d) for s, d in by_shape.items()} == {(2, 40, 4): 2, (2, 64, 2): 1}
    assert by_shape[(2, 40, 4)][0] is by_shape[(2, 40, 4)][1]   # made once per shape
    mods = [builtin_mod("document", "document"), builtin_mod("softcap", "softcap", {"cap": 2.0})]
    timed = by_shape[(2, 64, 2)][0]
    assert torch.equal(timed, bench_mods.call_inputs(mods, 2, 2, 64, 64, "cpu")["doc"])
    assert all(2 <= len(row.unique()) <= 8 for row in timed)   # 2..8 documents a sequence
    assert all(bool((row[1:] >= row[:-1]).all()) for row in timed)


def test_the_check_of_a_mods_variant_rejects_a_call_that_ignores_its_mods(mods_pkg,
                                                                         monkeypatch):
    """A config whose result is right without the mods but wrong with them fails its trial:
    the float64 reference applies the mods (a prefix-LM call computed as plain causal)."""
    name = "fwd_prefix_lm_d32_fp32"
    work = Workload(mods_pkg, name, mods_pkg._registry.VARIANTS[name], 4096, "cpu",
                    check_n=40)
    cfg = {"block_m": 16, "block_n": 16, "num_warps": 2, "num_stages": 1}
    assert work.check(cfg) is None
    prefix = work.mod_args(2, 2, 40, small=True)["prefix_len"]
    assert prefix.shape == (2,) and bool(((prefix >= 5) & (prefix < 20)).all())  # N/8..N/2
    real = mods_pkg.flash_attn_func

    def no_prefix(q, k, v, *args, **kwargs):
        return real(q, k, v, *args, **{**kwargs, "prefix_len": torch.zeros_like(prefix)})

    monkeypatch.setattr(mods_pkg, "flash_attn_func", no_prefix)
    reason = work.check(cfg)
    assert reason is not None and reason.startswith(
        "out differs from the float64 reference with the mods prefix_lm"), reason


def test_the_space_of_a_block_mask_backward_with_mods_has_persistent_bwd(monkeypatch):
    """The shipped mods package's variants as `flashgen tune` sees them on an H100: a mask
    mod's Gluon backward searches persistent_bwd (a program per key block as well as the
    persistent form), a score mod's does not; a variant the package has no Gluon kernel
    for (a bias tile: sdpa_mask) gets no Gluon point, and its tiles are planned with the
    bias's shared memory, as the package plans them; the first warm start is what the
    untuned package runs (the mods variant's own Gluon default)."""
    from flashgen.tune import _space

    monkeypatch.setattr(families, "triton_ok", lambda version: True)
    reg = _shipped_mods_registry()
    gpu = GpuInfo(key=FAKE_KEY, name="Fake GPU", **H100)
    spec = load_spec(ROOT / "specs" / "mods.yaml")

    def space_of(name):
        facts = reg.VARIANTS[name]
        return _space(facts["kind"], facts, gpu, _mod_kinds(reg, name), reg.GLUON.get(name))

    for d in (64, 128):
        doc = space_of(f"bwd_causal_document_d{d}_bf16")
        off = [p for p in doc.points() if not p["persistent_bwd"]]
        assert off and all(p["family"] == "gluon" for p in off)
        assert len(off) == sum(p["family"] == "gluon" for p in doc.points()) // 2
        starts = _warm_starts(spec, "bwd", doc,
                              variant=reg.VARIANTS[f"bwd_causal_document_d{d}_bf16"],
                              bucket=4096, mod_kinds=("mask",))
        assert starts[0][0] == "gluon" and starts[0][1]["persistent_bwd"] is True
        assert starts[0][1]["family"] == "gluon" and doc.check(starts[0][1]) is None
        cap = space_of(f"bwd_causal_softcap_d{d}_bf16")
        assert all(p["persistent_bwd"] for p in cap.points())
        assert any(p["family"] == "gluon" for p in cap.points())
    for name in ("fwd_sdpa_mask_d128_bf16", "bwd_sdpa_mask_d128_bf16",
                 "bwd_relative_bias_d64_bf16"):
        space = space_of(name)
        assert {p["family"] for p in space.points()} == {"tl"}, name
        assert {k: space.default()[k] for k in TILE_PARAMS} == reg.PLANNED[name], name
    assert reg.PLANNED["fwd_sdpa_mask_d128_bf16"] != reg.PLANNED["fwd_d128_bf16"]


def test_a_mods_variant_starts_from_its_base_variants_entry_until_it_has_its_own():
    """What the package runs before a mods variant is tuned (the study's first warm start
    and its "before"): its base variant's entry, but not a Gluon one where its own Gluon
    kernel is not the default, and a Gluon entry where it has no Gluon kernel runs the
    planner's `tl` config; once it has entries of its own, those."""
    from flashgen.tune import _incumbent

    spec = load_spec(ROOT / "specs" / "mods.yaml")
    facts = {"kind": "bwd", "mask": "causal", "dropout": False, "head_dim": 128,
             "dtype": "bf16", "mods": ["document"], "key_span": "segment"}
    tl = {"block_m": 32, "block_n": 128, "num_warps": 8, "num_stages": 3, "dq_tile": "mirror",
          "family": "tl", "regs": "240/24", "persistent_bwd": True}
    gl = {**tl, "block_m": 64, "num_warps": 4, "num_stages": 2, "family": "gluon"}
    incumbents = {"bwd_causal_d128_bf16": {"4096": tl}}
    assert _incumbent(incumbents, "bwd_causal_document_d128_bf16", facts, 4096) == (tl, True)
    assert _incumbent(incumbents, "bwd_causal_document_d128_bf16", facts, 1024) == (None, False)
    own = {**incumbents, "bwd_causal_document_d128_bf16": {"1024": gl}}
    assert _incumbent(own, "bwd_causal_document_d128_bf16", facts, 1024) == (gl, False)
    assert _incumbent(own, "bwd_causal_document_d128_bf16", facts, 4096) == (None, False)
    plain = {**facts, "mods": []}
    assert _incumbent(incumbents, "bwd_causal_d128_bf16", plain, 4096) == (tl, False)

    space = space_for("bwd", 128, 2, **H100, gluon=None, block_sparse=True)
    starts = _warm_starts(spec, "bwd", space, incumbent=tl, inherited=True, variant=facts,
                          bucket=4096, mod_kinds=("mask",))
    assert starts[0] == ("base's tuned", tl)
    starts = _warm_starts(spec, "bwd", space, incumbent=gl, inherited=True, variant=facts,
                          bucket=4096, mod_kinds=("mask",))
    assert starts[0] == ("base's tuned", gl)
    # a mods variant whose Gluon backward is opt-in does not run the base's Gluon winner
    # (runtime.launch_config): its first start is the planner's tile
    kinds = families.GLUON_MOD_KINDS_BY_DEFAULT
    try:
        families.GLUON_MOD_KINDS_BY_DEFAULT = {**kinds, "bwd": frozenset()}
        starts = _warm_starts(spec, "bwd", space, incumbent=gl, inherited=True, variant=facts,
                              bucket=4096, mod_kinds=("mask",))
    finally:
        families.GLUON_MOD_KINDS_BY_DEFAULT = kinds
    assert starts[0] == ("planner", space.default())
    # no Gluon kernel for the variant here: a Gluon entry runs the planner's `tl` config
    no_gluon = space_for("bwd", 128, 2, **H100, gluon="a bias tile", block_sparse=True)
    starts = _warm_starts(spec, "bwd", no_gluon, incumbent=gl, variant=facts, bucket=4096,
                          mod_kinds=("mask",))
    assert starts[0] == ("tuned", no_gluon.default())


@pytest.fixture(scope="module")
def tuned_mods_pkg(tmp_path_factory):
    """A tiny package with mods whose tuning file holds an entry for a mods variant (as
    `flashgen tune` writes it) and one for a base variant: (pkg, entries)."""
    root = tmp_path_factory.mktemp("tunedmods")
    name = f"fgtunedmods_{uuid.uuid4().hex[:8]}"
    spec_path = root / f"{name}.yaml"
    spec_path.write_text(
        f"package: {name}\nhead_dims: [64]\ndtypes: [fp16]\nmasks: [causal]\n"
        "seqlen_buckets: [1024, 4096]\nattn_mask: false\n"
        "mods: {document: {builtin: document}, softcap: {builtin: softcap}}\n"
        "variants: [{mask: causal, mods: [document]}, {mask: causal, mods: [softcap]}]\n"
        "gpu: {name: H100, sram_bytes: 232448, sm_count: 132}\n")
    spec = load_spec(spec_path)
    own = {"block_m": 64, "block_n": 128, "num_warps": 4, "num_stages": 2, "dq_tile": "mirror",
           "family": "gluon", "regs": "232/40", "persistent_bwd": False}
    base = {"block_m": 32, "block_n": 128, "num_warps": 8, "num_stages": 3, "dq_tile": "mirror",
            "family": "tl", "regs": "240/24", "persistent_bwd": True}
    results = [StudyResult(name="x", variant="bwd_causal_document_d64_fp16", bucket=4096,
                           best_config=own, best_ms=1.0, default_ms=1.5),
               StudyResult(name="y", variant="bwd_causal_d64_fp16", bucket=4096,
                           best_config=base, best_ms=1.2, default_ms=1.5)]
    gpu = GpuInfo(key=FAKE_KEY, name="Fake GPU 80GB", capability=(9, 0), sm_count=132,
                  sram_bytes=232448)
    said = []
    _write_results(spec, gpu, results, said.append)
    assert "bwd_causal_document_d64_fp16@4096" in said[0]
    yield _build_import(spec_path, root / "out", name), own, base
    _forget(name)


def test_a_tuned_mods_variant_runs_its_own_entry(tuned_mods_pkg, monkeypatch):
    """The entry written under a mods variant's name is what the built package launches for
    it (its persistent_bwd included); an untuned mods variant keeps running its base
    variant's entry; describe() counts the mods variants tuned under their own name."""
    pkg, own, base = tuned_mods_pkg
    rt = pkg._runtime
    assert rt.TUNED[FAKE_KEY]["bwd_causal_document_d64_fp16"] == {4096: own}
    monkeypatch.setattr(rt, "gpu_key", lambda device: (FAKE_KEY, 232448, 132))
    monkeypatch.setattr(rt, "_configs", {})
    got = rt.launch_config("bwd_causal_document_d64_fp16", _fake_cuda(), 4096)
    assert got == own and rt._gluon_bwd_persistent(got) is False
    assert rt.launch_config("bwd_causal_softcap_d64_fp16", _fake_cuda(), 4096) == base
    assert rt.launch_config("bwd_causal_d64_fp16", _fake_cuda(), 4096) == base
    text = pkg.describe()
    assert f"{FAKE_KEY}: 2 of 6 variants, 2 (variant, bucket) configs" in text
    assert ("variants with mods: 1 of 4 tuned under their own name "
            "(bwd_causal_document_d64_fp16); the others run their base variant's configs") in text
