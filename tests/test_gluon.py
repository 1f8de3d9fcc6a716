"""The Gluon (Hopper) kernel family.

On the CPU: which variants get a Gluon kernel and why the others do not, how the runtime
chooses the family, and -- because Gluon cannot run in Triton's interpreter -- that every
rendered Gluon kernel compiles for sm_90 through ptxas into the intended design (wgmma,
a producer/consumer register split, shared memory within the H100's budget). On the GPU
(-m gpu): the Gluon kernels against the float64 reference at shapes that cross many
tiles and persistent rounds, and the fallback to `tl` for what TMA cannot read. The rest of
the `tl` family's GPU tests run on this family with FLASHGEN_FAMILY=gluon (README).
"""
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import LSE_TOL, OUT_TOL
from packages import build_and_import, gluon_compiles
from flashgen import families
from flashgen.reference import attention_ref, visible_mask

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gluon"), "fg_test_gluon", """
        head_dims: [64, 80, 96, 128]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        """)


# ---------------------------------------------------------------------------------------
# which variants have a Gluon kernel
# ---------------------------------------------------------------------------------------
def test_gluon_kernels_are_rendered_for_eligible_variants_only(pkg):
    reasons = pkg._registry.GLUON
    kernels = Path(pkg.__file__).parent / "kernels" / "gluon"
    rendered = {p.stem for p in kernels.glob("*.py")} - {"__init__"}
    assert rendered == {n for n, r in reasons.items() if r is None}
    assert "fwd_causal_d128_bf16" in rendered and "fwd_window_d96_fp16" in rendered
    assert reasons["fwd_dropout_d128_bf16"] is None  # tests/test_gluon_dropout.py
    assert reasons["bwd_dropout_d128_bf16"] is None  # tests/test_gluon_dropout.py
    assert reasons["fwd_dropout_d64_bf16"] is None  # (since Philox-7 and packed masks)
    assert "fp32" in reasons["fwd_d128_fp32"]
    assert "head dim 80" in reasons["fwd_d80_bf16"]
    assert reasons["bwd_d128_bf16"] is None  # tests/test_gluon_bwd.py
    text = (kernels / "fwd_causal_d96_bf16.py").read_text()
    assert "HEAD_DIM = gl.constexpr(96)" in text and "HEAD_DIM_PAD = gl.constexpr(128)" in text
    assert "def fwd_causal_d96_bf16_kernel(" in text


def test_describe_names_each_variants_family(pkg):
    text = pkg.describe()
    assert "fwd_d128_bf16" in text and "gluon" in text
    assert "wgmma takes fp16/bf16 operands" in text  # an fp32 variant's reason for `tl`


def test_shared_memory_model_rejects_what_does_not_fit():
    ok = dict(families.GLUON_DEFAULT)
    assert families.config_reason(ok, 128, 2, 232448) is None
    # d=128, 4-deep ring of 128-key blocks: 64 KiB of Q/O + 256 KiB of K/V
    assert "shared memory" in families.config_reason({**ok, "num_stages": 4}, 128, 2, 232448)
    assert "block_m" in families.config_reason({**ok, "block_m": 64}, 128, 2, 232448)
    # an A100-sized budget cannot hold even the default tile at d=128
    assert "shared memory" in families.config_reason(ok, 128, 2, 166912)
    assert "regs" in families.config_reason({**ok, "regs": "248/8"}, 128, 2, 232448)
    assert families.regs({**ok, "regs": "232/40"}) == (232, 40)
    # a second Q slot per consumer: 32 KiB more at d=128, still within the H100's budget
    two = {**ok, "q_buffers": 2}
    assert families.config_reason(two, 128, 2, 232448) is None
    assert families.shared_bytes(128, 2, 128, 2, 2) == families.shared_bytes(128, 2, 128, 2) + 32768
    assert "shared memory" in families.config_reason(two, 128, 2, 220 * 1024)
    assert "q_buffers" in families.config_reason({**ok, "q_buffers": 3}, 128, 2, 232448)


def test_three_consumers_only_where_the_kernel_has_them():
    """192-row tiles (three consumer warpgroups at 160 registers) exist for the forward at
    head dims <= 64 without dropout or mods; the tile and the register split go together."""
    assert families.fwd_consumer_counts(64) == (3, 2)
    assert families.fwd_consumer_counts(64, extras=True) == (2,)
    assert families.fwd_consumer_counts(96) == families.fwd_consumer_counts(128) == (2,)
    ok = dict(families.GLUON_DEFAULT)
    three = {**ok, "block_m": 192, "regs": "160/24"}
    assert families.config_reason(three, 64, 2, 232448, (3, 2)) is None
    assert families.config_reason(ok, 64, 2, 232448, (3, 2)) is None
    assert "block_m must be 128 " in families.config_reason(three, 128, 2, 232448)
    assert "regs must be one of 160/24" in families.config_reason(
        {**three, "regs": "240/24"}, 64, 2, 232448, (3, 2))
    assert "regs must be one of 240/24" in families.config_reason(
        {**ok, "regs": "160/24"}, 64, 2, 232448, (3, 2))
    # a third consumer's Q and O staging: 2 x 64 rows x 64 x 2 bytes more at d=64
    assert families.shared_bytes(64, 2, 128, 2, 1, 3) == families.shared_bytes(64, 2, 128, 2) + 16384
    # the untuned default: the unmasked and causal d=64 forwards without dropout or mods
    # only (causal from the 4k bucket: THREE_CONSUMER_DEFAULT_MASKS), the unmasked one
    # diag_first
    causal4k = families.gluon_default(64, "fwd", "causal", bucket=4096)
    assert families.gluon_default(64, "fwd", "none") == {**causal4k, "diag_first": True}
    assert causal4k == families.gluon_default(64, "fwd", "causal", bucket=16384) == {
        **families.gluon_default(64, "fwd", "sliding_window"), "block_m": 192, "regs": "160/24",
        "pingpong": True}
    for other in (families.gluon_default(64, "fwd", "sliding_window"),
                  families.gluon_default(64, "fwd", "causal"),
                  families.gluon_default(64, "fwd", "causal", bucket=2048),
                  families.gluon_default(64, "fwd", "causal", dropout=True),
                  families.gluon_default(64, "fwd", "causal", mods=("softcap",)),
                  families.gluon_default(64, "fwd", "none", dropout=True),
                  families.gluon_default(64, "fwd", "none", mods=("softcap",)),
                  families.gluon_default(128, "fwd", "none")):
        assert other["block_m"] == 128 and other["regs"] == "240/24"


def test_kernels_hold_the_partitions_of_their_consumer_counts(pkg):
    """The rendered forward launches whichever partition list its BLOCK_M asks for, and a
    launch config the kernel has none for is a ValueError before any compile or launch."""
    root = Path(pkg.__file__).parent / "kernels" / "gluon"
    d64 = (root / "fwd_d64_bf16.py").read_text()
    assert "if NUM_CONSUMERS == 3:" in d64 and "elif NUM_CONSUMERS == 2:" in d64
    for name in ("fwd_d128_bf16.py", "fwd_dropout_d64_bf16.py"):
        text = (root / name).read_text()
        assert "NUM_CONSUMERS == 3" not in text and "if NUM_CONSUMERS == 2:" in text
    three = {**families.GLUON_DEFAULT, "block_m": 192, "regs": "160/24"}
    launcher = pkg._runtime._gluon_forward_launcher
    with pytest.raises(ValueError, match="`fwd_d128_bf16`: block_m must be 128 "):
        launcher("fwd_d128_bf16", three, torch.bfloat16, 128, 10, 10, varlen=False)
    with pytest.raises(ValueError, match="regs must be one of 160/24"):
        launcher("fwd_d64_bf16", {**three, "regs": "240/24"}, torch.bfloat16, 64, 10, 10,
                 varlen=False)
    with pytest.raises(ValueError, match="block_m must be 128"):
        launcher("fwd_dropout_d64_bf16", three, torch.bfloat16, 64, 10, 10, varlen=False)


def test_runtime_chooses_tl_where_gluon_cannot_run(pkg, monkeypatch):
    rt = pkg._runtime
    assert "CUDA" in rt.gluon_ready(torch.device("cpu")) or "interpreter" in rt.gluon_ready(
        torch.device("cpu"))
    assert rt.gluon_call_reason("fwd_d80_bf16", *([torch.empty(0)] * 4), False) == \
        pkg._registry.GLUON["fwd_d80_bf16"]
    # TMA reads 16-byte aligned rows only
    x = torch.empty(2, 3, 40, 64, dtype=torch.bfloat16)
    assert rt._descriptor_ready((x, x.stride()))
    odd = torch.empty(2, 3, 40, 68, dtype=torch.bfloat16)[..., 1:65]
    assert not rt._descriptor_ready((odd, odd.stride()))
    # an override that names the family gets the Gluon defaults under it
    with rt.override_config(family="gluon", block_n=64):
        cfg = rt.launch_config("fwd_d128_bf16", torch.device("cpu"), 4096)
    assert cfg["family"] == "gluon" and cfg["block_n"] == 64 and cfg["block_m"] == 128


def _band_costs(n, block, lo=-(1 << 30), hi=0, left=False):
    num_m = -(-n // block)
    return [families.band_tile_blocks(m, block, block, n, n, lo, hi, left, True)
            for m in range(num_m)]


@pytest.mark.parametrize("shape", [
    # (B, H, N, d, query heads per K/V head): the forward bench's causal shapes (H d = 2048,
    # B N = 16k), where the old back-and-forth deal left the busiest program 1.10-1.20x the
    # mean on the H100's 132 SMs, and a GQA 4:1 one
    (8, 32, 2048, 64, 1), (4, 32, 4096, 64, 1), (1, 32, 16384, 64, 1),
    (8, 16, 2048, 128, 1), (4, 16, 4096, 128, 1), (1, 16, 16384, 128, 1),
    (4, 32, 4096, 128, 4),
], ids=["d64-2k", "d64-4k", "d64-16k", "d128-2k", "d128-4k", "d128-16k", "d128-4k-gqa4"])
def test_band_tile_order_deals_every_tile_once_and_evenly(shape):
    b, h, n, d, kv_group = shape
    programs, bh = 132, b * h
    costs = _band_costs(n, 128)
    num_m = len(costs)
    assert costs[0] == 1 and costs[-1] == num_m  # causal: query block m sees m + 1 key blocks
    # the runtime's L2 head group (_gluon_kv_heads at the default l2_share of 4, 50 MB L2)
    head_group = max(1, (50 << 20) // 4 // (2 * n * d * 2), -(-2 * programs // num_m)) * kv_group
    table = families.band_tile_order(bh, num_m, costs, head_group, kv_group, programs)
    offsets, tiles = table[:programs + 1], table[programs + 1:]
    assert offsets[0] == 0 and offsets[-1] == len(tiles)
    assert sorted(tiles) == list(range(bh * num_m))
    load = [sum(costs[t % num_m] + families.TILE_FIXED_COST for t in tiles[offsets[p]:offsets[p + 1]])
            for p in range(programs)]
    assert max(load) <= 1.02 * sum(load) / programs
    # the groups: whole K/V heads, sizes within one K/V head of each other, every row once
    groups = families.band_head_groups(bh, head_group, kv_group)
    assert [r for g in groups for r in g] == list(range(bh))
    assert all(len(g) % kv_group == 0 and len(g) <= max(head_group, kv_group) for g in groups)
    assert max(map(len, groups)) - min(map(len, groups)) <= kv_group
    # each program runs its tiles group by group (the K/V of a group share L2)
    group_of = {r: i for i, g in enumerate(groups) for r in g}
    for p in range(programs):
        seen = [group_of[t // num_m] for t in tiles[offsets[p]:offsets[p + 1]]]
        assert seen == sorted(seen)


def test_band_tile_blocks_follow_the_window():
    # a window of 300 keys to the left: the first query blocks see fewer keys than later
    # ones, and every block sees at most the window's span of 128-key blocks
    costs = _band_costs(4096, 128, lo=-300, hi=0, left=True)
    assert costs[0] == 1 and max(costs) == 4 and costs[-1] == 4
    # rows past the keys' end see none (Nq > Nk, bottom-right causal: the top rows)
    assert families.band_tile_blocks(0, 128, 128, 1031, 257, -(1 << 30), 257 - 1031, False,
                                     True) == 0


def test_tile_tables_outlive_the_launch_plans_and_stop_at_their_cap(pkg, monkeypatch):
    """A CUDA graph keeps reading the table its launch was captured with, so tables are
    not freed with the plans; past the cap a new deal falls back to the kernel's own."""
    rt = pkg._runtime
    monkeypatch.setattr(rt, "_tile_tables", {})
    monkeypatch.setattr(rt, "_MAX_TILE_TABLES", 2)
    q = torch.empty(0)
    cfg = {"block_m": 128, "block_n": 128}

    def table(n):  # a causal deal of 4 (batch, head) rows of n queries on 8 programs
        return rt._band_tile_table(cfg, q, 4, -(-n // 128), n, n, -(1 << 30), 0, "causal",
                                   2, 1, 8)

    first = table(1024)
    assert first.dtype == torch.int32 and first.device == q.device
    offsets, tiles = first[:9].tolist(), first[9:].tolist()
    assert offsets[-1] == 32 and sorted(tiles) == list(range(32))
    with rt.override_config(block_n=64):  # clears the launch plans, not the tables
        pass
    assert table(1024) is first
    assert table(2048) is not None
    assert table(4096) is None  # the cap: the kernel deals this one itself
    assert len(rt._tile_tables) == 2


def test_triton_versions():
    assert families.triton_ok("3.6.0") and families.triton_ok("3.6")
    assert not families.triton_ok("3.9.0") and not families.triton_ok("3.60.1")


# ---------------------------------------------------------------------------------------
# every Gluon kernel compiles for sm_90 into the intended design
# ---------------------------------------------------------------------------------------
_COMPILE = r"""
import json, sys
from pathlib import Path
from flashgen import gluon_compile, families
configs = [families.GLUON_DEFAULT]
if sys.argv[2] == "own":  # each variant's own default (families.gluon_default)
    configs = None
if sys.argv[2] == "knobs":
    configs = [dict(families.GLUON_DEFAULT, block_n=64, num_stages=3, pingpong=False,
                    regs="224/56")]
if sys.argv[2].startswith("boundary"):  # the tile-boundary knobs and the key order, all on
    configs = [families.GLUON_DEFAULT,
               dict(families.GLUON_DEFAULT, q_buffers=2, overlap=True, diag_first=True)]
if sys.argv[2] == "three-varlen":  # three consumer warpgroups, 192-row tiles
    configs = [dict(families.GLUON_DEFAULT, block_m=192, regs="160/24")]
res = gluon_compile.compile_package(Path(sys.argv[1]), configs=configs,
                                    variants=sys.argv[3].split(",") if len(sys.argv) > 3 else None,
                                    varlen=sys.argv[2].endswith("-varlen"))
print(json.dumps([r.__dict__ for r in res]))
"""


def _compile(package_dir, which="default", variants=None):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [sys.executable, "-c", _COMPILE, str(package_dir), which] + (
        [",".join(variants)] if variants else [])
    out = subprocess.run(args, capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


needs_gluon_triton = pytest.mark.skipif(
    not gluon_compiles(),
    reason="the Gluon templates are verified on Triton 3.6 (CI pins it); another Triton "
           "runs the `tl` kernels only")


@needs_gluon_triton
@pytest.mark.parametrize("package", ["gpt2_attn", "llama_attn"])
def test_shipped_gluon_kernels_compile_for_sm90(package):
    rows = _compile(ROOT / "generated" / package)
    assert len(rows) >= 4
    for r in rows:
        assert r["shared"] <= 232448, r
        assert r["wgmma"] > 0, f"{r['variant']}: no wgmma in the PTX"
        # the register split: consumers up to 240 (three consumers: 160), the producer
        # down to 24
        consumer = 160 if "regs 160/24" in r["config"] else families.CONSUMER_REGS
        assert consumer in r["setmaxnreg"], r
        assert families.PRODUCER_REGS in r["setmaxnreg"], r
        # ptxas keeps a few tile-level scalars on the stack (measured 0-112 bytes); the
        # key loop's tensors must not spill
        assert r["spill_bytes"] <= 128, r
        # and ptxas kept every wgmma asynchronous (no serialisation, no early wait), and
        # no spill inside a key loop (nvdisasm's listing)
        assert not r["wgmma_notes"], r
        assert r["loop_spills"] == 0, r


@needs_gluon_triton
def test_gluon_knobs_compile(pkg):
    rows = _compile(Path(pkg.__file__).parent, "knobs",
                    ["fwd_window_d96_fp16", "fwd_causal_d64_bf16"])
    assert {r["variant"] for r in rows} == {"fwd_window_d96_fp16", "fwd_causal_d64_bf16"}
    for r in rows:
        assert r["config"] == "128x64 s3 no-pingpong regs 224/56"
        assert r["wgmma"] > 0 and r["shared"] <= 232448
        assert 224 in r["setmaxnreg"] and 56 in r["setmaxnreg"], r


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_tile_boundary_knobs_compile(pkg):
    """q_buffers, overlap and diag_first together (each alone runs a subset of that code),
    dense and packed (VARLEN), causal and window (rows with no key: an empty tile's deferred
    stores), d=64 and d=96 (padded): each compiles to the design with the default's wgmma
    count, ptxas keeps the products asynchronous, the stack stays small, and the shared
    memory is within what config_reason budgets for."""
    names = ["fwd_causal_d128_bf16", "fwd_d64_fp16", "fwd_window_d96_bf16"]
    rows = _compile(Path(pkg.__file__).parent, "boundary-varlen", names)
    assert len(rows) == len(names) * 2 * 2
    # (the default config of the unmasked dense kernel compiles its stream-K form)
    default = ("128x128 s2", "128x128 s2 stream-k", "varlen 128x128 s2")
    wgmma = {r["variant"]: r["wgmma"] for r in rows if r["config"] in default[:2]}
    base = {(r["variant"], r["config"].startswith("varlen")): r for r in rows
            if r["config"] in default}
    for r in rows:
        assert r["wgmma"] == wgmma[r["variant"]] > 0, r
        assert not r["wgmma_notes"], r
        # spills in a key loop (LDL/STL a block): the knobs add at most 3 to the
        # default's (measured: 0 with all three on; 3 with overlap alone, causal d=128, a
        # predicate register). The stack frame: the default's 0-144 bytes (the packed
        # window kernel's 144 since the varlen walk became a table: a tile's coordinates,
        # outside the key loops); with the knobs the packed window kernel's grows to ~260
        # (the carried output meets the varlen walk's registers between tiles), outside its
        # key loop
        default = base[(r["variant"], r["config"].startswith("varlen"))]
        assert r["loop_spills"] is not None and default["loop_spills"] is not None, r
        assert r["loop_spills"] <= default["loop_spills"] + 3, r
        assert r["spill_bytes"] <= (160 if r is default else 320), r
        q2 = "q2" in r["config"]
        d = int(r["variant"].split("_d")[1].split("_")[0])
        assert r["shared"] <= families.shared_bytes(d, 2, 128, 2, 2 if q2 else 1) <= 232448, r
    assert {r["config"] for r in rows} == {"128x128 s2", "varlen 128x128 s2",
                                           "128x128 s2 stream-k",
                                           "128x128 s2 q2 overlap diag-first",
                                           "varlen 128x128 s2 q2 overlap diag-first"}


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_three_consumer_forward_compiles(pkg):
    """192-row tiles, dense and packed, unmasked, causal and under a window (rows with no
    key): three consumers and the producer in 3 x 128 x 160 + 128 x 24 registers, within
    shared memory. The unmasked dense kernel (the d=64 default) keeps its products
    asynchronous with no spill in the key loop: what P's early conversion (EARLY_P) bought;
    at 168 the first consumer spilled and ptxas serialised the wgmmas. The masked kernels
    too, since a block on the band's right edge is masked by one compare an element
    against a bound a row (ROW_BOUND; with two compares the dense causal kernel spilled 12
    LDL/STL a block and 136 stack bytes, the window kernel 82 and 208)."""
    names = ["fwd_d64_bf16", "fwd_window_d64_fp16", "fwd_causal_d64_bf16"]
    rows = _compile(Path(pkg.__file__).parent, "three-varlen", names)
    assert len(rows) == len(names) * 2
    for r in rows:
        assert r["config"].startswith(("192x128 s2", "varlen 192x128 s2")), r
        assert "regs 160/24" in r["config"], r
        assert 160 in r["setmaxnreg"] and families.PRODUCER_REGS in r["setmaxnreg"], r
        assert r["wgmma"] > 0, r
        assert r["shared"] <= families.shared_bytes(64, 2, 128, 2, 1, 3) <= 232448, r
    for r in rows:
        assert not r["wgmma_notes"] and r["loop_spills"] == 0, r
        # (outside the key loop: the packed forms keep 24-56 bytes of the tile walk's scalars)
        assert r["spill_bytes"] <= (32 if r["config"].startswith("192") else 64), r


def test_wgmma_notes_are_read_from_the_ptxas_log():
    from flashgen.gluon_compile import _wgmma_notes

    log = ("ptxas info    : (C7517) warpgroup.wait is injected in around line 6094 by compiler "
           "to allow use of registers defined by GMMA in function 'k'\n"
           "ptxas info    : Used 168 registers, used 3 barriers\n")
    assert _wgmma_notes(log) == ("C7517 warpgroup.wait is injected in around line 6094 by compiler t",)
    assert _wgmma_notes("ptxas info    : Used 168 registers\n") == ()


# ---------------------------------------------------------------------------------------
# on the GPU: against float64, and the fallback
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _check(pkg, q, k, v, *, causal=False, window=(-1, -1)):
    out, lse = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window, return_lse=True)
    vis = visible_mask(q.shape[1], k.shape[1], causal=causal, window=window, bottom_right=True)
    ref, ref_lse = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis)
    out = out.transpose(1, 2)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol, rtol = OUT_TOL[q.dtype]
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), atol=atol, rtol=rtol)
    seen = torch.isfinite(ref_lse).cpu()
    assert torch.equal(torch.isfinite(lse).cpu(), seen)
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse.cpu()[seen],
                               atol=LSE_TOL[0], rtol=LSE_TOL[1])
    assert (out.cpu()[~seen] == 0).all()


def _plan_families(pkg):
    """The kernel classes the package's forward plans launch: GluonJITFunction or the `tl`
    family's JITFunction."""
    return {type(p[0].fn).__name__ for p in pkg._runtime._forward_plans.values()
            if p[0] is not None}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, dtype, causal, window): many tiles, persistent rounds and
    # L2 head groups; ragged ends; Nq != Nk both ways; GQA 4:1 and 8:1; d=96 padded to 128
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, True, (-1, -1)),
    (2, 257, 1031, 8, 1, 128, torch.float16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 128, torch.bfloat16, True, (-1, -1)),
    (1, 2048, 2048, 16, 16, 64, torch.bfloat16, False, (-1, -1)),
    (3, 59, 127, 4, 1, 64, torch.float16, False, (-1, -1)),
    (2, 777, 777, 4, 2, 96, torch.bfloat16, False, (100, 0)),
    (1, 1, 513, 8, 8, 128, torch.bfloat16, True, (-1, -1)),
    # 4-5 tiles a program, the first six of each (b, h) seeing no key (bottom-right): tiles
    # with keys followed by empty ones, whose deferred stores run without a product
    (4, 1031, 257, 16, 4, 128, torch.bfloat16, True, (-1, -1)),
], ids=["causal-b3-gqa4", "causal-nq<nk-gqa8", "causal-nq>nk", "d64-2k", "odd-gqa4", "d96-window",
        "decode-row", "causal-nq>nk-rounds"])
@pytest.mark.parametrize("knobs", [
    # (block_m 128: the d=64 unmasked default's 192 rows take 160/24 registers only)
    {}, {"persistent": False, "regs": "232/40", "block_n": 64, "num_stages": 3, "pingpong": False,
         "l2_share": 8, "block_m": 128},
    # the tile-boundary knobs and the key order (families.GLUON_DEFAULT), alone and together,
    # with and without ping-pong
    {"q_buffers": 2}, {"overlap": True}, {"diag_first": True}, {"overlap": True, "q_buffers": 2},
    {"overlap": True, "q_buffers": 2, "diag_first": True, "pingpong": False, "block_n": 64,
     "num_stages": 4},
    # a share of P's exponentials by the cubic on the FMA units (rows with no key included)
    {"poly_exp2": 8}, {"poly_exp2": 2, "diag_first": True, "pingpong": False, "block_n": 64},
], ids=["default", "knobs", "q2", "overlap", "diag-first", "overlap-q2", "all-bn64", "poly8",
        "poly2-bn64"])
def test_gluon_forward_against_float64(pkg, poison, case, knobs):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, nq, nk, hq, hkv, d, dt, causal, window = case
    pkg._runtime._forward_plans.clear()
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt)
    # asked for: most of these shapes are below GLUON_MIN_FLOPS, where the package picks `tl`
    with pkg._runtime.override_config(family="gluon", **knobs):
        _check(pkg, q, k, v, causal=causal, window=window)
        assert _plan_families(pkg) == {"GluonJITFunction"}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, dtype, causal, window) at d=64: many tiles and persistent rounds,
    # ragged ends, Nq != Nk both ways, GQA 4:1 and 8:1, a window (rows with no key), a
    # decode row; 192-row tiles cut Nq = 1000 / 257 / 59 in other places than 128-row ones
    (3, 1000, 1000, 8, 2, torch.bfloat16, True, (-1, -1)),
    (2, 257, 1031, 8, 1, torch.float16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, torch.bfloat16, True, (-1, -1)),
    (1, 2048, 2048, 16, 16, torch.bfloat16, False, (-1, -1)),
    (3, 59, 127, 4, 1, torch.float16, False, (-1, -1)),
    (2, 777, 777, 4, 2, torch.bfloat16, False, (100, 0)),
    (1, 1, 513, 8, 8, torch.bfloat16, True, (-1, -1)),
], ids=["causal-b3-gqa4", "causal-nq<nk-gqa8", "causal-nq>nk", "2k", "odd-gqa4", "window",
        "decode-row"])
@pytest.mark.parametrize("knobs", [
    {}, {"pingpong": False}, {"block_n": 64, "num_stages": 3, "persistent": False},
    {"q_buffers": 2, "overlap": True, "diag_first": True}, {"poly_exp2": 8, "l2_share": 8},
], ids=["default", "no-pingpong", "bn64-one-tile", "q2-overlap-diag-first", "poly8"])
def test_gluon_three_consumer_forward_against_float64(pkg, poison, case, knobs):
    """Three consumer warpgroups (192-row tiles at 160 registers, the d=64 unmasked
    default) under every mask and with the other knobs, against float64."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, nq, nk, hq, hkv, dt, causal, window = case
    pkg._runtime._forward_plans.clear()
    q = torch.randn(b, nq, hq, 64, device="cuda", dtype=dt)
    k = torch.randn(b, nk, hkv, 64, device="cuda", dtype=dt)
    v = torch.randn(b, nk, hkv, 64, device="cuda", dtype=dt)
    with pkg._runtime.override_config(family="gluon", block_m=192, regs="160/24", **knobs):
        _check(pkg, q, k, v, causal=causal, window=window)
        plans = [p[0] for p in pkg._runtime._forward_plans.values() if p[0] is not None]
        assert plans and all(p.meta["BLOCK_M"] == 192 for p in plans)
        assert _plan_families(pkg) == {"GluonJITFunction"}


def _exp2_cubic(x, module):
    """The Gluon forward's _exp2_fma written in torch (fp32, the same operations and the
    shipped constants): its bits, not a second opinion of the maths."""
    x = torch.maximum(x, torch.tensor(-127.0)).where(~torch.isnan(x), x)
    t = x + module.EXP2_ROUND.value
    f = x - (t - module.EXP2_ROUND.value)
    p = ((f * module.EXP2_C3.value + module.EXP2_C2.value) * f + module.EXP2_C1.value) * f + 1.0
    scale = (t.view(torch.int32) * 8388608 + 0x3F800000).view(torch.float32)
    return p * scale


def test_exp2_cubic_constants_meet_the_stated_error(pkg):
    """The cubic behind poly_exp2, with the constants the kernels ship: within 1.02e-4 of
    2^x (relative) over the exponents P sees, exactly 1 at 0, exactly 0 from -127 down
    (-inf included), NaN kept."""
    import importlib
    module = importlib.import_module(f"{pkg.__name__}.kernels.gluon.fwd_d64_bf16")
    x = torch.cat([torch.linspace(-126.0, 0.0, 400_001), torch.tensor([-0.5, -1.5, -125.5])])
    got = _exp2_cubic(x.float(), module).double()
    ref = torch.exp2(x.double())
    assert ((got - ref).abs() / ref).max().item() < 1.02e-4
    # between -127 and -126 the result is subnormal and inexact, but below 2^-125
    tiny = _exp2_cubic(torch.linspace(-127.0, -126.0, 1001), module)
    assert ((tiny >= 0) & (tiny < 2.0 ** -125)).all()
    edge = _exp2_cubic(torch.tensor([0.0, -127.0, -300.0, float("-inf"), float("nan")]), module)
    assert edge[0].item() == 1.0 and (edge[1:4] == 0).all() and torch.isnan(edge[4])


@pytest.mark.gpu
@pytest.mark.parametrize("poly", [0, 2])
def test_gluon_forward_keeps_nan_with_the_cubic(pkg, poly):
    """A NaN key reaches every output row that sees it, whichever unit takes its column's
    exponential: key 127 is in the last eighth of its 128-wide block (the cubic's share
    at every poly_exp2), key 5 in the first (MUFU's)."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    pkg._runtime._forward_plans.clear()
    q, k, v = (torch.randn(1, 300, 4, 64, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    for key in (127, 5):
        kk = k.clone()
        kk[0, key, 1] = float("nan")
        with pkg._runtime.override_config(family="gluon", poly_exp2=poly):
            out = pkg.flash_attn_func(q, kk, v, causal=True)
        nan_rows = torch.isnan(out[0, :, 1]).any(-1).cpu()
        # bottom-right causal with Nq = Nk: row i sees keys <= i
        assert torch.equal(nan_rows, torch.arange(300) >= key), (key, poly)
        assert not torch.isnan(out[0, :, [0, 2, 3]]).any()


@pytest.mark.gpu
@pytest.mark.parametrize("n_q,n_k", [(257, 1031), (1031, 257)], ids=["nq<nk", "nq>nk"])
@pytest.mark.parametrize("knobs", [{}, {"overlap": True, "q_buffers": 2}, {"diag_first": True},
                                   {"overlap": True, "q_buffers": 2, "diag_first": True}],
                         ids=["default", "overlap-q2", "diag-first", "all"])
def test_gluon_forward_top_left_causal_against_float64(pkg, poison, n_q, n_k, knobs):
    """SDPA's causal diagonal is aligned top-left (flash_attn_func's bottom-right, above):
    other band offsets, so other tiles straddle it and, with Nq > Nk, the last rows see
    every key. GQA 4:1, 288 tiles (2-3 a program), through scaled_dot_product_attention."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, h_q, h_kv, d, dt = 4, 8, 2, 128, torch.bfloat16
    pkg._runtime._forward_plans.clear()
    q = torch.randn(b, h_q, n_q, d, device="cuda", dtype=dt)
    k = torch.randn(b, h_kv, n_k, d, device="cuda", dtype=dt)
    v = torch.randn(b, h_kv, n_k, d, device="cuda", dtype=dt)
    with pkg._runtime.override_config(family="gluon", **knobs):
        out = pkg.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert _plan_families(pkg) == {"GluonJITFunction"}
    ref, _ = attention_ref(q, k, v, visible_mask(n_q, n_k, causal=True, bottom_right=False))
    atol, rtol = OUT_TOL[dt]
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.double().cpu(), ref.cpu(), atol=atol, rtol=rtol)


# ---------------------------------------------------------------------------------------
# stream-K: the persistent forward's last rounds dealt by key block
# ---------------------------------------------------------------------------------------
def _stream_k_items(tiles, programs, start, units):
    """The kernel's walk (_sk_share, _sk_item) written out: program -> its items
    [(tile, first key block, end key block)]."""
    tail = (tiles - start) * units
    walk = {}
    for p in range(programs):
        lo, hi = start * units + p * tail // programs, start * units + (p + 1) * tail // programs
        items = [(k * programs + p, 0, units) for k in range(start // programs)]
        for t in range(lo // units, (hi - 1) // units + 1):
            items.append((t, max(lo - t * units, 0), min(hi - t * units, units)))
        walk[p] = items
    return walk


@pytest.mark.parametrize("tiles,programs,units", [
    (2048, 132, 16), (4096, 132, 32), (256, 132, 16), (133, 132, 1), (12, 5, 3), (192, 7, 8),
    (48, 5, 9), (1000, 132, 128)])
def test_stream_k_walk_covers_every_key_block_once_and_cuts_tiles_in_two(tiles, programs,
                                                                         units):
    start = families.stream_k_start(tiles, programs, {})
    assert start is not None and start % programs == 0 and programs <= tiles - start < 2 * programs
    walk = _stream_k_items(tiles, programs, start, units)
    seen = {}
    for p, items in walk.items():
        for t, lo, hi in items:
            assert 0 <= lo < hi <= units
            seen.setdefault(t, []).append((lo, hi, p))
    assert sorted(seen) == list(range(tiles))
    for t, parts in seen.items():
        parts.sort()
        assert parts[0][0] == 0 and parts[-1][1] == units, (t, parts)
        assert all(a[1] == b[0] for a, b in zip(parts, parts[1:])), (t, parts)
        assert len(parts) <= 2, (t, parts)
        if len(parts) == 2:  # program p owns the start (its last item), p + 1 the end (first of its tail)
            (_, _, p), (_, _, p1) = parts
            assert p1 == p + 1 and walk[p][-1][0] == t and walk[p1][start // programs][0] == t
    # equal shares: no program more than one key block above the mean
    work = [sum(hi - lo for _, lo, hi in items) for items in walk.values()]
    assert max(work) - tiles * units / programs < 1


def test_stream_k_only_where_the_last_round_idles():
    assert families.stream_k_start(2048, 132, {}, key_blocks=16) is None  # short tiles
    assert families.stream_k_start(2048, 132, {}, key_blocks=32) == 14 * 132
    assert families.stream_k_start(264, 132, {}) is None  # whole rounds
    assert families.stream_k_start(100, 132, {}) is None  # under one round
    assert families.stream_k_start(132 * 150 + 1, 132, {}) is None  # 0.7% idle
    assert families.stream_k_start(2048, 132, {}) == 14 * 132
    assert families.stream_k_start(2048, 132, {"stream_k": False}) is None
    assert families.stream_k_start(2048, 132, {"persistent": False}) is None
    assert families.stream_k_start(2048, 132, {"overlap": True}) is None


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, dtype, programs): tiles not a multiple of the programs (a
    # persistent grid cut down to `programs` puts many cut tiles in a small call); ragged
    # Nk, Nq != Nk both ways, GQA 4:1 and 8:1, d=96 padded, a tail of every tile (12 on 5)
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, 7),
    (2, 257, 1031, 8, 1, 128, torch.float16, 5),
    (2, 1031, 257, 4, 4, 128, torch.bfloat16, 7),
    (2, 777, 777, 4, 2, 96, torch.bfloat16, 6),
    (3, 59, 300, 4, 1, 64, torch.float16, 5),
    (1, 2048, 2048, 16, 16, 64, torch.bfloat16, None),  # the GPU's own SM count
], ids=["b3-gqa4", "nq<nk-gqa8", "nq>nk", "d96", "odd-tail-only", "d64-2k-all-sms"])
@pytest.mark.parametrize("knobs", [{}, {"block_n": 64, "num_stages": 3, "pingpong": False},
                                   {"diag_first": True, "q_buffers": 2}],
                         ids=["default", "bn64", "diag-first-q2"])
def test_gluon_stream_k_against_float64(pkg, poison, monkeypatch, case, knobs):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    # short key ranges, so many tiles are cut in a small call
    monkeypatch.setattr(pkg._runtime._families, "STREAM_K_MIN_KEY_BLOCKS", 1)
    b, nq, nk, hq, hkv, d, dt, programs = case
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt)
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt)
    extra = {"programs": programs} if programs else {}
    with pkg._runtime.override_config(family="gluon", **knobs, **extra):
        for _ in range(3):  # the slots' counters are left at 0 for the next launch
            _check(pkg, q, k, v)
        plans = [p[0] for p in pkg._runtime._forward_plans.values() if p[0] is not None]
        assert plans and all(p.meta["STREAM_K"] for p in plans)


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(3, 59, 300, 4, 1, torch.float16, 5),
                                  (2, 1000, 1000, 8, 2, torch.bfloat16, 7),
                                  (1, 2048, 2048, 16, 16, torch.bfloat16, None)],
                         ids=["odd-tail-only", "b2-gqa4", "2k-all-sms"])
def test_gluon_three_consumer_stream_k_against_float64(pkg, poison, monkeypatch, case):
    """Stream-K with three consumers: a cut tile's parts in three slots a program."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    monkeypatch.setattr(pkg._runtime._families, "STREAM_K_MIN_KEY_BLOCKS", 1)
    b, nq, nk, hq, hkv, dt, programs = case
    q = torch.randn(b, nq, hq, 64, device="cuda", dtype=dt)
    k = torch.randn(b, nk, hkv, 64, device="cuda", dtype=dt)
    v = torch.randn(b, nk, hkv, 64, device="cuda", dtype=dt)
    extra = {"programs": programs} if programs else {}
    with pkg._runtime.override_config(family="gluon", block_m=192, regs="160/24", **extra):
        for _ in range(3):  # the slots' counters are left at 0 for the next launch
            _check(pkg, q, k, v)
        plans = [p[0] for p in pkg._runtime._forward_plans.values() if p[0] is not None]
        assert plans and all(p.meta["STREAM_K"] and p.meta["BLOCK_M"] == 192 for p in plans)


@pytest.mark.gpu
@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (100, 0))],
                         ids=["causal", "window"])
def test_a_cut_down_persistent_grid_deals_band_tiles_too(pkg, poison, causal, window):
    """The `programs` key (tests only) cuts the grid for every deal: the host's table of a
    band mask is dealt to that many programs, so every tile still runs."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    q = torch.randn(3, 1000, 8, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(3, 1000, 2, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    with pkg._runtime.override_config(family="gluon", programs=7):
        _check(pkg, q, k, v, causal=causal, window=window)
        plans = [p[0] for p in pkg._runtime._forward_plans.values() if p[0] is not None]
        assert [p.grid[0] for p in plans] == [7]


@pytest.mark.gpu
def test_gluon_stream_k_in_a_cuda_graph_and_with_dropout(pkg, monkeypatch):
    """Replays of a captured stream-K forward (its workspace made during the capture) on
    fresh inputs, against float64; and dropout, whose keep mask depends on (row, key) only,
    gives the same output cut into parts as whole (stream_k=False) up to rounding."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    monkeypatch.setattr(pkg._runtime._families, "STREAM_K_MIN_KEY_BLOCKS", 1)
    dt = torch.bfloat16
    shape_q, shape_kv = (2, 1000, 8, 128), (2, 1000, 2, 128)
    q, k, v = (torch.randn(s, device="cuda", dtype=dt) for s in (shape_q, shape_kv, shape_kv))
    with pkg._runtime.override_config(family="gluon", programs=7):
        pkg.flash_attn_func(q, k, v)  # compile outside the capture
        pkg._runtime._sk_workspaces.clear()  # so the capture makes its own
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph):
            out = pkg.flash_attn_func(q, k, v)
        torch.cuda.current_stream().wait_stream(stream)
        for _ in range(3):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            graph.replay()
            ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   visible_mask(1000, 1000, causal=False, bottom_right=True))
            atol, rtol = OUT_TOL[dt]
            torch.testing.assert_close(out.transpose(1, 2).double().cpu(), ref.cpu(), atol=atol,
                                       rtol=rtol)
    outs = []
    for sk in (True, False):
        with pkg._runtime.override_config(family="gluon", programs=7, stream_k=sk):
            torch.manual_seed(7)
            outs.append(pkg.flash_attn_func(q, k, v, dropout_p=0.1))
            plans = [p[0] for p in pkg._runtime._forward_plans.values() if p[0] is not None]
            assert [p.meta["STREAM_K"] for p in plans] == [sk]
    assert not torch.isnan(outs[0]).any()
    torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_launch_scratch_is_kept_per_stream_and_fresh_under_capture(pkg, poison):
    """The Gluon forward's global scratch (its device-made tensor descriptors) comes from
    one buffer per (device, stream), grown to the largest launch, instead of an allocation
    per launch; another stream gets its own; a launch captured into a CUDA graph gets its
    own from the graph's pool. Every call against float64, the graph's replays on fresh
    inputs after eager calls on its capture stream with other inputs."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = pkg._runtime
    dt = torch.bfloat16

    def inputs(n):
        return [torch.randn(2, n, h, 128, device="cuda", dtype=dt) for h in (8, 2, 2)]

    with rt.override_config(family="gluon"):
        rt._launch_scratches.clear()
        for n in (300, 300, 1000, 300):
            _check(pkg, *inputs(n), causal=True)
        launcher = next(p[0] for p in rt._forward_plans.values() if p[0] is not None)
        assert launcher.scratch > 0, "the Gluon forward took no scratch: nothing tested"
        dev = torch.cuda.current_device()
        kept = {k: v for k, v in rt._launch_scratches.items() if k[0] == dev}
        assert len(kept) == 1  # one buffer on this stream, grown for N = 1000
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            _check(pkg, *inputs(300), causal=True)
        torch.cuda.current_stream().wait_stream(side)
        assert len([k for k in rt._launch_scratches if k[0] == dev]) == 2
        q, k, v = inputs(300)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side), torch.cuda.graph(graph):
            out = pkg.flash_attn_func(q, k, v, causal=True)
        torch.cuda.current_stream().wait_stream(side)
        before = {key: buf.data_ptr() for key, buf in rt._launch_scratches.items()}
        for _ in range(2):
            for t in (q, k, v):
                t.copy_(torch.randn_like(t))
            with torch.cuda.stream(side):
                _check(pkg, *inputs(300), causal=True)  # an eager call between replays
                graph.replay()
            torch.cuda.current_stream().wait_stream(side)
            ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   visible_mask(300, 300, causal=True, bottom_right=True))
            atol, rtol = OUT_TOL[dt]
            torch.testing.assert_close(out.transpose(1, 2).double().cpu(), ref.cpu(),
                                       atol=atol, rtol=rtol)
        assert {key: buf.data_ptr() for key, buf in rt._launch_scratches.items()} == before


@pytest.mark.gpu
def test_launch_scratch_comes_from_an_application_allocator(pkg, poison):
    """An application that set its own allocator with triton.set_allocator gets the Gluon
    forward's global scratch from it (through Triton's launcher), call after call, and the
    package's kept buffer again once the application's allocator is gone."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    from triton.runtime import _allocation
    rt = pkg._runtime
    asked = []

    def app_allocator(size, align, stream):
        asked.append(size)
        return torch.empty(size, dtype=torch.int8, device="cuda")

    inputs = [torch.randn(2, 300, h, 128, device="cuda", dtype=torch.bfloat16) for h in (8, 2, 2)]
    with rt.override_config(family="gluon"):
        _check(pkg, *inputs, causal=True)  # the plan and its direct launch
        launcher = next(p[0] for p in rt._forward_plans.values() if p[0] is not None)
        assert launcher.scratch > 0, "the Gluon forward took no scratch: nothing tested"
        token = _allocation._allocator.set(app_allocator)
        try:
            for _ in range(2):
                _check(pkg, *inputs, causal=True)
        finally:
            _allocation._allocator.reset(token)
        assert len(asked) == 2 and all(size >= launcher.scratch for size in asked)
        _check(pkg, *inputs, causal=True)
        assert len(asked) == 2


@pytest.mark.gpu
def test_unaligned_strides_fall_back_to_tl(pkg, poison):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    pkg._runtime._forward_plans.clear()
    # a head dim sliced at an odd offset: rows are not 16-byte aligned, TMA cannot read them
    big = torch.randn(2, 300, 4, 137, device="cuda", dtype=torch.bfloat16)
    q, k, v = big[..., 1:129], big[..., 3:131], big[..., 5:133]
    with pkg._runtime.override_config(family="gluon"):  # asked for, and still refused
        _check(pkg, q, k, v, causal=True)
        assert _plan_families(pkg) == {"JITFunction"}
        assert "TMA" in pkg._runtime.gluon_call_reason("fwd_causal_d128_bf16", q, k, v, q, True)


@pytest.mark.gpu
def test_tiny_calls_take_tl_and_lengths_reuse_one_gluon_binary(pkg):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = pkg._runtime
    rt._forward_plans.clear()
    q = torch.randn(8, 59, 16, 64, device="cuda", dtype=torch.bfloat16)
    pkg.flash_attn_func(q, q, q, causal=True)  # 0.06 GFLOP: below GLUON_MIN_FLOPS
    if rt._FORCED_FAMILY != "gluon":  # FLASHGEN_FAMILY=gluon sends even this one to Gluon
        assert _plan_families(pkg) == {"JITFunction"}
    fn = rt.kernel("fwd_causal_d64_bf16", family="gluon")

    def binaries():
        # (the module-scoped package is shared with the other tests of this worker, which
        # compile this kernel at other configs: count what this test's calls add)
        return {key for cache in fn.device_caches.values()
                for key in next(c for c in cache if isinstance(c, dict))}
    before = binaries()
    with rt.override_config(family="gluon"):
        for n_q, n_k in [(100, 100), (37, 1000), (1, 513), (2048, 2048), (250, 250)]:
            q = torch.randn(2, n_q, 4, 64, dtype=torch.bfloat16, device="cuda")
            k, v = (torch.randn(2, n_k, 4, 64, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            _check(pkg, q, k, v, causal=True)
    new = binaries() - before
    assert len(new) <= 1 and len(binaries()) >= 1, (
        f"{len(new)} new Gluon binaries for one variant and five lengths")


def test_plan_names_each_variants_family(capsys):
    from flashgen.cli import main

    assert main(["plan", str(ROOT / "specs" / "llama.yaml")]) == 0
    out = capsys.readouterr().out
    assert "== kernel families on sm90 with Triton 3.6" in out
    gluon = next(ln for ln in out.splitlines() if ln.startswith("gluon ("))
    assert gluon.startswith("gluon (12): ") and "fwd_window_d128_bf16" in gluon
    assert "fwd_sdpa_mask_d128_bf16" not in gluon  # a bias tile: `tl` (render.gluon_reason)
    assert "bwd_causal_d128_bf16" in gluon
    assert "why: no Gluon decode kernel yet" in out


def _mask_mod_variants(registry):
    """The forward variants of a package's registry that have a mask mod."""
    return [n for n, v in registry.VARIANTS.items() if v["kind"] == "fwd" and any(
        registry.MODS[m]["kind"] == "mask" for m in v.get("mods", ()))]


def _check_mods_rows(rows, stack=160):
    for r in rows:
        assert r["wgmma"] > 0 and r["shared"] <= 232448, r
        consumer = 224 if "regs 224/56" in r["config"] else families.CONSUMER_REGS
        assert consumer in r["setmaxnreg"], r
        # the plain forwards: up to 112 B; score mods / sinks 112-136; mask mods 0-96
        # (the block list merged into walk order: with a full and a partial list the
        # consumers' key loop spilled its pointers, 136 B)
        assert r["spill_bytes"] <= stack, r


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_gluon_forwards_with_mods_compile():
    """The Gluon forward renders score mods (before the online softmax step, in raw units),
    sinks (in the epilogue) and mask mods (block-sparse: only the partial blocks of the
    block mask run the band and the mask mod): they compile for sm_90 into the same design.
    One variant per mask mod of specs/mods.yaml here (every one, both tiles: the slow test
    below). Backwards with mods stay on `tl`, with the reason."""
    pkg_dir = ROOT / "generated" / "mods_attn"
    variants = ["fwd_causal_softcap_d128_bf16", "fwd_causal_sink_logits_d64_fp16",
                "fwd_causal_document_d128_bf16", "fwd_causal_document_softcap_d64_fp16",
                "fwd_prefix_lm_d128_fp16", "fwd_window_sinks_d64_bf16",
                "fwd_causal_softcap_key_padding_d128_bf16"]  # + alibi: tested on GPU
    rows = _compile(pkg_dir, "own", variants=variants)
    assert sorted(r["variant"] for r in rows) == sorted(variants)
    _check_mods_rows(rows)
    # a document mask (mods.key_span "segment") compiles at its own tile: 64-key blocks and
    # a second Q slot per consumer (families.KEY_SPAN_FWD_KNOBS)
    doc = next(r for r in rows if r["variant"] == "fwd_causal_document_d128_bf16")
    assert doc["config"].startswith("128x64 s2") and " q2" in doc["config"], doc
    text = (pkg_dir / "kernels" / "gluon" / "fwd_causal_softcap_d128_bf16.py").read_text()
    # a 16-bit variant takes tanh from the special-function unit (_fastmath.py)
    assert "def _score_mod(" in text and "_tanh(" in text and "tanh_approx_gl as _tanh" in text
    assert "BLOCK_IDX" not in text and "def _mask_mod(" not in text


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@needs_gluon_triton
def test_tile_boundary_knobs_compile_with_mods():
    """The knobs with a block-sparse walk (diag_first reverses the list: partial blocks
    first), a score mod and a sink (normalised at a tile's end, stored one tile later)."""
    variants = ["fwd_causal_document_softcap_d64_fp16", "fwd_causal_sink_logits_d128_bf16"]
    rows = _compile(ROOT / "generated" / "mods_attn", "boundary", variants)
    assert len(rows) == 4
    _check_mods_rows(rows)
    for r in rows:
        assert not r["wgmma_notes"], r
        assert r["loop_spills"] == 0, r


@needs_gluon_triton
@pytest.mark.slow
def test_every_gluon_mask_mod_forward_compiles():
    """Every mask-mod forward of the shipped mods package, at the default tile and at the
    tuner's other corner (128 x 64, a 3-deep ring, no ping-pong, 224/56 registers)."""
    import importlib.util

    pkg_dir = ROOT / "generated" / "mods_attn"
    spec = importlib.util.spec_from_file_location("mods_attn_reg", pkg_dir / "_registry.py")
    reg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reg)
    variants = _mask_mod_variants(reg)
    assert len(variants) == 20  # document, document+softcap, prefix-LM, window+sinks, padding
    for which in ("default", "knobs"):
        rows = _compile(pkg_dir, which, variants)
        assert sorted(r["variant"] for r in rows) == sorted(variants)
        _check_mods_rows(rows)


@needs_gluon_triton
def test_gluon_mask_mods_with_score_mods_and_sinks(tmp_path):
    """A mask mod together with a score mod and a sink (gpt-oss: a window with sinks and a
    learned sink logit per head) renders into one kernel: the partial blocks run the band
    and the mask after the score mod, the sink joins the epilogue; it compiles for sm_90."""
    pkg = build_and_import(tmp_path, "fg_gluon_mask_sink", """
        head_dims: [128]
        dtypes: [bf16]
        masks: [none, causal]
        gqa: true
        attn_mask: false
        mods:
          document: {builtin: document}
          softcap: {builtin: softcap}
          sink_logits: {builtin: sink_logits}
          window_sinks: {builtin: sliding_window_sinks}
          head_sink: {sink: "sink_w[h]", tensors: {sink_w: "[H] fp32"}}
        variants:
          - {mask: causal, mods: [document, softcap, sink_logits]}
          - {mask: none, mods: [window_sinks, head_sink]}
        """)
    names = ["fwd_causal_document_softcap_sink_logits_d128_bf16",
             "fwd_window_sinks_head_sink_d128_bf16"]
    for name in names:
        assert pkg._registry.GLUON[name] is None
        text = (Path(pkg.__file__).parent / "kernels" / "gluon" / f"{name}.py").read_text()
        assert "def _mask_mod(" in text and "BLOCK_IDX" in text and "sink = (" in text
        assert "LONGEST_FIRST = gl.constexpr(True)" in text  # the band order for mask mods
    assert "def _score_mod(" in (Path(pkg.__file__).parent / "kernels" / "gluon" /
                                 f"{names[0]}.py").read_text()
    _check_mods_rows(_compile(Path(pkg.__file__).parent, variants=names))


def test_gluon_reasons_for_mods():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "mods_attn_registry", ROOT / "generated" / "mods_attn" / "_registry.py")
    reg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reg)
    assert reg.GLUON["fwd_causal_softcap_d128_bf16"] is None
    assert reg.GLUON["fwd_causal_sink_logits_d128_bf16"] is None
    for name in _mask_mod_variants(reg):
        assert reg.GLUON[name] is None, name  # mask mods: block-sparse Gluon forwards
    # the backward takes score mods, mask mods and sinks (tests/test_gluon_bwd_mods.py),
    # not a tensor with a gradient
    assert reg.GLUON["bwd_causal_softcap_d128_bf16"] is None
    assert reg.GLUON["bwd_causal_document_d128_bf16"] is None
    assert "gradient" in reg.GLUON["bwd_sdpa_mask_d128_bf16"]
    assert "[q, kv] tile" in reg.GLUON["fwd_sdpa_mask_d128_bf16"]
    assert "[q, kv] tile" in reg.GLUON["fwd_relative_bias_d128_bf16"]
    assert "[q, kv] tile" in reg.GLUON["fwd_softcap_sdpa_mask_d128_bf16"]


def test_gluon_kernels_with_mods_follow_the_switch():
    """A Gluon kernel with mods is the default exactly where all of its mods' kinds are in
    families.GLUON_MOD_KINDS_BY_DEFAULT[its kernel kind]; others run with
    FLASHGEN_FAMILY=gluon / override_config."""
    assert families.gluon_by_default("fwd", False, 128)
    for kinds in (("score",), ("mask",), ("sink",), ("mask", "score")):
        for kind in ("fwd", "bwd"):
            want = set(kinds) <= families.GLUON_MOD_KINDS_BY_DEFAULT[kind]
            assert families.gluon_by_default(kind, False, 128, kinds) == want
