"""The Gluon kernels at Q/K 512 (Gemma 4's global layers, issue 47). The forward: one kernel,
the forward template at (qk 512, v 256), run once for that pair and twice for d = 512 (over
V's and O's 256-column halves). The backward: templates/gluon/bwd_d512.py.j2, run twice
(over dK's, dQ's and dV's column halves), the default (FLASHGEN_GLUON_BWD_512=0 turns it
off). flashgen/families_large.py has the arithmetic and why.

On the CPU: which variants get them and why the others do not (dropout, mods and fp8 stay
`tl`), the tiles' shared-memory and register arithmetic, the rendered kernels' constants,
the untuned routing on an H100 (gluon_ready and gpu_key monkeypatched) and describe(). In
the slow group: every form compiles for sm_90 with no spill in its key loop. On the GPU
(-m gpu, Hopper): against the float64 reference at odd shapes.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_grads, assert_out_lse as _assert_out, cuda_qkv as _qkv
from flashgen import families, families_large
from flashgen.reference import attention_ref, visible_mask
from flashgen.space import space_for
from packages import build_and_import, compile_gluon_variants, gluon_compiles

H100 = families.GLUON_SHARED_BYTES
H100_KEY = ("NVIDIA H100 80GB HBM3|sm90|132sm", H100, 132)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gd512"), "fg_test_gluon_d512", """
        head_dims: [512, {qk: 512, v: 256}]
        dtypes: [fp16, bf16]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        mods:
          softcap: {builtin: softcap, params: {cap: 50.0}}
        variants:
          - {mask: causal, mods: [softcap]}
        """)


# ---------------------------------------------------------------------------------------
# which variants have a Gluon kernel, and why not
# ---------------------------------------------------------------------------------------
def test_forwards_get_gluon_kernels_and_the_rest_say_why_not(pkg):
    reasons = pkg._registry.GLUON
    plain = [n for n in reasons if n.startswith("fwd_") and "dropout" not in n
             and "softcap" not in n and "sdpa_mask" not in n]
    assert len(plain) == 3 * 2 * 2  # masks x pairs x dtypes
    assert all(reasons[n] is None for n in plain), {n: reasons[n] for n in plain}
    assert "draws no keep mask" in reasons["fwd_causal_dropout_d512_bf16"]
    assert "mods at Q/K 512" in reasons["fwd_causal_softcap_d512v256_bf16"]
    # the backward: a Gluon kernel for every mask and pair, not for dropout (nor mods)
    bwd = [n for n in reasons if n.startswith("bwd_") and "dropout" not in n
           and "softcap" not in n and "sdpa_mask" not in n]
    assert len(bwd) == 3 * 2 * 2 and all(reasons[n] is None for n in bwd), bwd
    assert "Q/K 512 Gluon backward draws no keep mask" in reasons["bwd_window_dropout_d512_bf16"]
    rendered = {p.stem for p in (Path(pkg.__file__).parent / "kernels" / "gluon").glob("*.py")}
    assert rendered - {"__init__"} == {n for n, r in reasons.items() if r is None}
    assert "fp16/bf16" in families.gluon_reason("fwd", False, 512, "fp32")
    assert "512/128" in families.gluon_reason("fwd", False, 512, "bf16", 128)
    assert "fp8" in families.gluon_reason("fwd", False, 512, "fp8_e4m3")


def test_rendered_kernels_are_the_512_256_kernel(pkg):
    root = Path(pkg.__file__).parent / "kernels" / "gluon"
    for name in ("fwd_d512_bf16", "fwd_causal_d512v256_fp16"):
        src = (root / f"{name}.py").read_text()
        for line in ("HEAD_DIM = gl.constexpr(512)", "HEAD_DIM_PAD = gl.constexpr(512)",
                     "QK_BOX = gl.constexpr(256)", "QK_BOXES = gl.constexpr(2)",
                     "HEAD_DIM_V = gl.constexpr(256)", "HEAD_DIM_V_PAD = gl.constexpr(256)"):
            assert line in src, (name, line)
    # the backward: its own template, 128-column boxes, a consumer's columns (d512_bwd_split)
    for name, dv in (("bwd_causal_d512_bf16", 512), ("bwd_d512v256_fp16", 256)):
        src = (root / f"{name}.py").read_text()
        assert "templates/gluon/bwd_d512.py.j2" in src.splitlines()[0]
        for line in ("HEAD_DIM = gl.constexpr(512)", f"HEAD_DIM_V = gl.constexpr({dv})",
                     "QK_BOX = gl.constexpr(128)", "QK_BOXES = gl.constexpr(4)",
                     f"V_BOXES = gl.constexpr({dv // 128})", "DK_COLS = gl.constexpr(128)",
                     f"DV_COLS = gl.constexpr({dv // 4})", "DQ_UNITS = gl.constexpr(2)",
                     "    COL_HALF,"):
            assert line in src, (name, line)
    # the package carries the module families imports
    assert (Path(pkg.__file__).parent / "_families_large.py").exists()
    assert pkg._runtime._families.v_launches(512, 512) == 2


# ---------------------------------------------------------------------------------------
# the tile: shared memory and registers (families_large)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dv", [512, 256])
def test_the_tile_fits_shared_memory_and_registers(dv):
    cfg = families.gluon_default(512, "fwd", "causal", v_dim=dv)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"]) == (128, 32, 2)
    assert cfg["q_buffers"] == 1 and cfg["regs"] == "240/24" and not cfg["overlap"]
    assert families.o_in_q(cfg, 512, dv)
    # Q 128 KiB + 2 x (32 x 768 x 2) 96 KiB + 1 KiB; an output buffer of its own: over
    shared = families.shared_bytes(512, 2, 32, 2, 1, 2, dv, True)
    assert shared == families_large.d512_shared_bytes(32, 2) == 230400 <= H100
    assert families.shared_bytes(512, 2, 32, 2, 1, 2, dv) > H100
    # O 128 + S 16 + P 16 registers a consumer thread
    assert families.fwd_accumulator_regs(32, families.gluon_v_dim(512, dv)) == 160
    assert families.config_reason(cfg, 512, 2, H100, v_dim=dv) is None
    for kw in ({"key_span": "segment"}, {"dropout": True}, {"mods": ("softcap",)}):
        assert families.gluon_default(512, "fwd", "causal", v_dim=dv, **kw) == cfg, kw
    space = space_for("fwd", 512, 2, H100, 132, (9, 0), gluon=None, mask="causal",
                      v_head_dim=dv if dv != 512 else None)
    assert space.check(space.config(cfg)) is None
    assert {(p["block_n"], p["num_stages"]) for p in space.points()
            if p["family"] == "gluon"} == {(32, 2)}


def test_what_does_not_fit_or_compile_is_rejected():
    cfg = families.gluon_default(512)
    why = families.config_reason
    assert "block_n, num_stages" in why({**cfg, "block_n": 64, "num_stages": 1}, 512, 2, H100)
    assert "block_n, num_stages" in why({**cfg, "num_stages": 3}, 512, 2, H100)
    assert "poly_exp2" in why({**cfg, "poly_exp2": 8}, 512, 2, H100)
    assert why({**cfg, "poly_exp2": 4}, 512, 2, H100) is None
    assert "shared memory" in why({**cfg, "q_buffers": 2}, 512, 2, H100)
    assert "overlap" in why({**cfg, "overlap": True}, 512, 2, H100)
    # the head dims up to 256 are unchanged by the 512 tile
    assert "block_n must be 64 or 128" in why({**families.GLUON_DEFAULT, "block_n": 32}, 128,
                                              2, H100)
    assert families.qk_boxes(512) == (2, 256) and families.qk_boxes(256) == (1, 256)
    assert families.v_launches(512, 512) == 2 and families.v_launches(512, 256) == 1
    assert families.gluon_v_dim(512, None) == 256 and families.gluon_v_dim(256, None) is None


# ---------------------------------------------------------------------------------------
# routing on an H100, and describe()
# ---------------------------------------------------------------------------------------
def test_untuned_d512_forward_takes_gluon_on_hopper(pkg, monkeypatch):
    rt = pkg._runtime
    monkeypatch.setattr(rt, "gpu_key", lambda device: H100_KEY)
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)
    monkeypatch.setattr(rt, "_configs", {})
    cuda = torch.device("cuda", 0)
    for name in ("fwd_causal_d512_bf16", "fwd_d512_fp16", "fwd_window_d512v256_bf16"):
        cfg = rt.launch_config(name, cuda, 4096)
        assert cfg["family"] == "gluon" and (cfg["block_n"], cfg["num_stages"]) == (32, 2), name
    assert rt.launch_config("bwd_causal_d512_bf16", cuda, 4096)["family"] == "gluon"
    for name in ("fwd_causal_dropout_d512_bf16", "fwd_causal_softcap_d512_bf16"):
        assert rt.launch_config(name, cuda, 4096).get("family", "tl") == "tl", name
    # the launcher: Q/K in two 256-column boxes, V and O one, O staged in the Q slots
    from triton.experimental.gluon import language as gl

    cfg = families.variant_gluon_default(pkg._registry.VARIANTS["fwd_causal_d512_bf16"])
    meta = rt._gluon_forward_launcher("fwd_causal_d512_bf16", cfg, torch.bfloat16, 512, 10, 10,
                                      varlen=False).meta
    assert meta["O_IN_Q"] and (meta["BLOCK_N"], meta["NUM_BUFFERS"]) == (32, 2)
    assert meta["QO_LAYOUT"] == gl.NVMMASharedLayout.get_default_for([1, 1, 64, 256],
                                                                     gl.bfloat16)


def test_varlen_at_d512_keeps_tl(pkg, monkeypatch):
    """The packed call has no loop over V's halves: (512, 512) takes `tl` and says why;
    (512, 256) passes that rule."""
    rt = pkg._runtime
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)
    q = torch.empty(300, 4, 512, dtype=torch.bfloat16)
    o = torch.empty(300, 4, 512, dtype=torch.bfloat16)
    k = torch.empty(300, 4, 512, dtype=torch.bfloat16)
    why = rt._varlen.gluon_varlen_reason if hasattr(rt, "_varlen") else None
    if why is None:
        from importlib import import_module
        why = import_module(f"{pkg.__name__}._varlen").gluon_varlen_reason
    reason = why("fwd_d512_bf16", {"family": "gluon"}, q, k, k, o, 300, "none")
    assert "V 256 only" in reason
    half = torch.empty(300, 4, 256, dtype=torch.bfloat16)
    reason = why("fwd_d512v256_bf16", {"family": "gluon"}, q, k, half, half, 300, "none")
    assert reason is None or "V 256 only" not in reason


def test_describe_says_two_launches_and_why_the_backward_is_opt_in(pkg):
    lines = pkg.describe().splitlines()

    def line(name):
        return next(ln for ln in lines if f" {name} " in ln)

    assert "gluon 128x32, 2-deep ring" in line("fwd_causal_d512_bf16")
    assert "2 launches over V halves" in line("fwd_causal_d512_bf16")
    assert "2 launches" not in line("fwd_causal_d512v256_bf16")
    assert "opt-in" not in line("fwd_d512_bf16")
    assert "paged prefill tl (Q/K 512" in line("fwd_d512_bf16")
    assert "tl (dropout at head dims 512/512" in line("fwd_causal_dropout_d512_bf16")
    # the backward: its kernel, two launches, on by default
    for name, stages in (("bwd_causal_d512_bf16", 1), ("bwd_d512v256_fp16", 2)):
        assert f"gluon 32x64, {stages}-deep ring" in line(name), line(name)
        assert "2 launches over dK, dQ, dV column halves" in line(name)
        assert "switched off" not in line(name) and "opt-in" not in line(name), line(name)
        assert "V halves" not in line(name)
    assert "tl (dropout at head dims 512/512" in line("bwd_window_dropout_d512_bf16")


# ---------------------------------------------------------------------------------------
# every form compiles for sm_90
# ---------------------------------------------------------------------------------------
# (variant, knobs, varlen): every mask at both pairs, dense; the (512, 256) pair packed
# (d = 512 packed calls take `tl`); the knobs the tuner may try
_CASES = [
    *[[f"fwd{m}_{d}_bf16", {}, False] for m in ("", "_causal", "_window")
      for d in ("d512", "d512v256")],
    *[[f"fwd{m}_d512v256_bf16", {}, True] for m in ("", "_causal", "_window")],
    ["fwd_causal_d512_fp16", {}, False],
    ["fwd_causal_d512_bf16", {"diag_first": True}, False],
    ["fwd_causal_d512_bf16", {"pingpong": False, "persistent": False, "stream_k": False,
                              "regs": "232/40"}, False],
    ["fwd_window_d512_bf16", {"regs": "224/56"}, False],
    ["fwd_d512_bf16", {"poly_exp2": 4}, False],
    ["fwd_causal_d512_fp16", {"poly_exp2": 2}, False],
]


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on Triton "
                    "3.6 (CI pins it)")
def test_d512_forwards_compile_for_sm90(pkg):
    """sm_90 through ptxas (Triton 3.6.0): shared memory within the model and the H100's
    budget (229,736-229,816 bytes against 230,400), the register split, every wgmma
    asynchronous, and no spill in a key loop (stack frames 0-64 bytes, outside it)."""
    rows = compile_gluon_variants(pkg, _CASES)
    v = pkg._registry.VARIANTS
    for r in rows:
        facts = v[r["variant"]]
        dv = facts.get("v_head_dim")
        cfg = {**families.variant_gluon_default(facts), **r["knobs"]}
        assert families.config_reason(cfg, 512, 2, H100, v_dim=dv) is None, r
        assert "o-in-q" in r["config"] and families.o_in_q(cfg, 512, dv), r
        model = families.shared_bytes(512, 2, cfg["block_n"], cfg["num_stages"], 1, 2, dv, True)
        assert r["shared"] <= model <= H100, r
        assert families.regs(cfg)[0] in r["setmaxnreg"], r
        assert families.regs(cfg)[1] in r["setmaxnreg"], r
        assert r["wgmma"] > 0 and not r["wgmma_notes"], r
        assert any("64x256x16" in f for f in r["gmma_forms"]), r  # P V: O's 256 columns
        assert any("64x32x16" in f for f in r["gmma_forms"]), r  # S = Q K^T: 32 keys
        assert r["loop_spills"] == 0, r
        assert r["spill_bytes"] <= 64, r


# ---------------------------------------------------------------------------------------
# on the GPU: against float64
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the Gluon kernels run on Hopper only; "
                                  "other GPUs take the tl kernels")


def _forward(pkg, q, k, v, knobs, **kw):
    """(out, lse) of the Gluon forward, asked for (small shapes fall under GLUON_MIN_FLOPS,
    where the package picks `tl`), with `knobs` over the variant's default."""
    rt = pkg._runtime
    rt._forward_plans.clear()
    with rt.override_config(family="gluon", **knobs):
        out, lse = pkg.flash_attn_func(q, k, v, return_lse=True, **kw)
        kinds = {type(p[0].fn).__name__ for p in rt._forward_plans.values() if p[0] is not None}
        assert kinds == {"GluonJITFunction"}, kinds
    return out, lse


_CASES_GPU = [
    # (B, Nq, Nk, Hq, Hkv, dv, dtype, causal, window): one row, 59 and 257 (ragged ends of
    # 64-row slabs and 32-key blocks), Nq != Nk both ways, GQA 4:1, batch 3, a window
    (1, 1, 513, 8, 8, 512, torch.bfloat16, True, (-1, -1)),
    (3, 59, 127, 4, 1, 512, torch.float16, False, (-1, -1)),
    (3, 59, 59, 8, 2, 512, torch.bfloat16, True, (-1, -1)),
    (2, 257, 1031, 8, 2, 512, torch.bfloat16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 512, torch.float16, True, (-1, -1)),
    (2, 777, 777, 4, 1, 512, torch.bfloat16, False, (100, 0)),
    (3, 1000, 1000, 16, 4, 512, torch.bfloat16, False, (-1, -1)),
    (1, 1, 513, 8, 8, 256, torch.bfloat16, True, (-1, -1)),
    (3, 59, 127, 4, 1, 256, torch.bfloat16, False, (-1, -1)),
    (2, 257, 1031, 8, 2, 256, torch.float16, True, (-1, -1)),
    (2, 777, 777, 4, 1, 256, torch.float16, False, (100, 0)),
]
_IDS = ["d512-N1-causal", "d512-N59-mqa", "d512-N59-causal-gqa4-b3", "d512-nq<nk-causal-gqa4",
        "d512-nq>nk-causal", "d512-window-gqa4", "d512-1k-gqa4-b3", "v256-N1-causal",
        "v256-N59-mqa", "v256-nq<nk-causal-gqa4", "v256-window-gqa4"]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", _CASES_GPU, ids=_IDS)
@pytest.mark.parametrize("knobs", [
    {}, {"pingpong": False, "persistent": False, "regs": "232/40"},
    # a cut-down persistent grid: several tiles a program, the Q slot reused tile after tile
    {"diag_first": True, "l2_share": 8, "programs": 7, "poly_exp2": 4},
], ids=["default", "no-pingpong-one-tile", "diag-first-7-programs"])
def test_gluon_d512_forward_against_float64(pkg, poison, case, knobs):
    b, nq, nk, hq, hkv, dv, dt, causal, window = case
    grads = not knobs  # (the `tl` backward behind the Gluon forward, reading its LSE)
    q, k, v = _qkv(b, nq, nk, hq, hkv, 512, dv, dt, grad=grads)
    out, lse = _forward(pkg, q, k, v, knobs, causal=causal, window_size=window)
    assert out.shape[-1] == dv
    vis = visible_mask(nq, nk, causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(q64, k64, v64, vis)
    _assert_out(out, lse, ref, ref_lse, dt)
    if grads and nq * nk <= 257 * 1031:
        do = torch.randn_like(out)
        out.backward(do)
        ref.backward(do.double().transpose(1, 2))
        assert_grads((q, k, v), (q64, k64, v64), dt)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dv", [512, 256])
def test_gluon_d512_stream_k_against_float64(pkg, poison, monkeypatch, dv):
    """An unmasked call whose last round is dealt by key block (STREAM_K; at d = 512 both
    launches share the workspace one after the other)."""
    monkeypatch.setattr(pkg._runtime._families, "STREAM_K_MIN_KEY_BLOCKS", 2)
    q, k, v = _qkv(2, 1100, 1100, 5, 5, 512, dv, torch.bfloat16)
    out, lse = _forward(pkg, q, k, v, {"programs": 11})
    vis = visible_mask(1100, 1100, causal=False, bottom_right=True)
    ref, ref_lse = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), vis)
    _assert_out(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
def test_gluon_d512_strided_output_halves(pkg, poison):
    """(B, H, N, d) inputs (transposed views, bnhd False inside) and an output that is a
    view too: the halves' views keep every stride."""
    q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2)
               for t in _qkv(2, 300, 300, 8, 2, 512, 512, torch.bfloat16))
    out, lse = _forward(pkg, q, k, v, {}, causal=True)
    vis = visible_mask(300, 300, causal=True, bottom_right=True)
    ref, ref_lse = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), vis)
    _assert_out(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name", ["fwd_causal_d512_bf16", "fwd_d512v256_fp16"])
def test_gluon_d512_is_the_default(pkg, name):
    """Untuned, on Hopper, a call large enough for the Gluon kernel's fixed cost runs it;
    the `tl` backward runs behind it."""
    facts = pkg._registry.VARIANTS[name]
    dv = facts.get("v_head_dim") or facts["head_dim"]
    dt = torch.bfloat16 if name.endswith("bf16") else torch.float16
    rt = pkg._runtime
    rt._forward_plans.clear()
    q, k, v = _qkv(2, 2048, 2048, 8, 8, 512, dv, dt, grad=True)
    out = pkg.flash_attn_func(q, k, v, causal=facts["mask"] == "causal")
    kinds = {type(p[0].fn).__name__ for p in rt._forward_plans.values() if p[0] is not None}
    assert kinds == {"GluonJITFunction"}, kinds
    out.float().sum().backward()
    assert not torch.isnan(q.grad).any() and not torch.isnan(v.grad).any()


# ---------------------------------------------------------------------------------------
# the backward (templates/gluon/bwd_d512.py.j2): its tiles, its switch, its launcher
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dv,stages", [(512, 1), (256, 2)])
def test_backward_tiles_fit_shared_memory_and_registers(dv, stages):
    fl = families_large
    cfg = families.gluon_default(512, "bwd", "causal", v_dim=dv)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"], cfg["dq_slots"]) == (32, 64, stages, 1)
    assert cfg["family"] == "gluon" and cfg["num_warps"] == 4
    # K + V, a Q/dO stage with LSE and D, P^T and dS^T, one dQ staging tile a consumer
    need = fl.d512_bwd_shared_bytes(dv, stages, 1)
    assert need == 64 * (512 + dv) * 2 + stages * (32 * (512 + dv) * 2 + 256) + 8192 + 16384 + 1024
    assert need <= H100 and fl.d512_bwd_config_reason(cfg, dv, H100) is None
    # a second dQ slot, or one more stage, does not fit
    assert "shared memory" in fl.d512_bwd_config_reason({**cfg, "dq_slots": 2}, dv, H100)
    if stages == 1:
        assert "shared memory" in fl.d512_bwd_config_reason({**cfg, "num_stages": 2}, dv, H100)
    assert "block_m" in fl.d512_bwd_config_reason({**cfg, "block_m": 64}, dv, H100)
    # dK 128 + dV dv/4 columns held, then S^T / dP^T and dQ^T's two units: within 240
    held, peak = fl.d512_bwd_regs(dv)
    assert (held, peak) == ((128, 176) if dv == 512 else (96, 144))
    assert peak <= families.regs(cfg)[0]
    assert families.bwd_boxes(512, dv, 32) != fl.d512_bwd_boxes()  # (d = 256's, not these)
    assert fl.d512_bwd_boxes()["Q"] == [1, 1, 32, 128] and fl.d512_bwd_boxes()["DS"] == [64, 32]


def test_backward_is_default_unless_switched_off(monkeypatch):
    """The Q/K 512 Gluon backward is the Hopper default; FLASHGEN_GLUON_BWD_512=0 when
    flashgen (or a package) is imported makes `tl` the default, and then the tuner does not
    time the kernel (a tuned entry would route calls to it)."""
    from flashgen import tune

    code = "from flashgen import families; print(families.gluon_by_default('bwd', False, 512))"
    env = {k: v for k, v in os.environ.items() if k != "FLASHGEN_GLUON_BWD_512"}
    for switch, want in ((None, "True"), ("0", "False"), ("1", "True")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=env if switch is None else {**env, "FLASHGEN_GLUON_BWD_512": switch})
        assert out.stdout.strip() == want, out.stderr[-2000:]
    gpu = tune.GpuInfo(key="H100|sm90|132sm", name="H100", capability=(9, 0), sm_count=132,
                       sram_bytes=H100)
    monkeypatch.setattr(families, "D512_BWD_ON", False)
    assert "FLASHGEN_GLUON_BWD_512=0" in tune.gluon_here("bwd", {"head_dim": 512, "dtype": "bf16"}, gpu)
    assert not families.gluon_by_default("bwd", False, 512)
    assert families.gluon_by_default("bwd", False, 256) == families.GLUON_BWD_LARGE_DEFAULT
    monkeypatch.setattr(families, "D512_BWD_ON", True)
    assert families.gluon_by_default("bwd", False, 512)


def test_backward_routing_and_launcher(pkg, monkeypatch):
    """Untuned on an H100: the Gluon kernel with the switch on (the default), `tl` with it
    off; its launcher's compile-time arguments and TMA boxes; packed batches keep `tl`."""
    from triton.experimental.gluon import language as gl

    rt = pkg._runtime
    monkeypatch.setattr(rt, "gpu_key", lambda device: H100_KEY)
    monkeypatch.setattr(rt, "gluon_ready", lambda device: None)
    monkeypatch.setattr(rt, "_configs", {})
    monkeypatch.setattr(rt._families, "D512_BWD_ON", False)
    cuda = torch.device("cuda", 0)
    names = ("bwd_causal_d512_bf16", "bwd_d512v256_fp16", "bwd_window_d512_bf16")
    for name in names:
        assert rt.launch_config(name, cuda, 4096).get("family", "tl") == "tl", name
        with rt.override_config(family="gluon"):  # (asked for: its own tile, switch or not)
            cfg = rt.launch_config(name, cuda, 4096)
            assert cfg["family"] == "gluon" and (cfg["block_m"], cfg["block_n"]) == (32, 64)
    monkeypatch.setattr(rt._families, "D512_BWD_ON", True)
    monkeypatch.setattr(rt, "_configs", {})
    for name in names:
        cfg = rt.launch_config(name, cuda, 4096)
        assert cfg["family"] == "gluon" and (cfg["block_m"], cfg["block_n"]) == (32, 64), name
    assert rt.launch_config("bwd_window_dropout_d512_bf16", cuda, 4096).get("family", "tl") == "tl"
    v = pkg._registry.VARIANTS
    for name, stages in (("bwd_causal_d512_bf16", 1), ("bwd_d512v256_fp16", 2)):
        cfg = families.variant_gluon_default(v[name])
        launch, (boxes, layouts) = rt._gluon_backward_launcher(name, cfg, torch.bfloat16, 512,
                                                               10, varlen=False)
        assert (launch.meta["BLOCK_M"], launch.meta["BLOCK_N"]) == (32, 64)
        assert (launch.meta["NUM_BUFFERS"], launch.meta["DQ_SLOTS"]) == (stages, 1)
        assert "DO_BUFFERS" not in launch.meta
        assert boxes["Q"] == boxes["DO"] == [1, 1, 32, 128] and boxes["K"] == [1, 1, 64, 128]
        assert boxes["DQ_ACC"] == [1, 1, 32, 64] and boxes["LSE"] == [32]
        assert launch.meta["DS_LAYOUT"] == gl.NVMMASharedLayout.get_default_for([64, 32],
                                                                               gl.bfloat16)
        assert "COL_HALF" in launch.fn.arg_names  # (the runtime's two launches)
        with pytest.raises(ValueError, match="shared memory"):
            rt._gluon_backward_launcher(name, {**cfg, "dq_slots": 2}, torch.bfloat16, 512, 10,
                                        varlen=False)
    q = torch.randn(64, 4, 512, dtype=torch.bfloat16)
    why = rt.gluon_varlen_backward_reason("bwd_causal_d512_bf16", {"family": "gluon"}, q, q, q,
                                          q, 64, "causal")
    assert "dense batches" in why


_BWD_CASES = [[f"bwd{m}_{d}_{dt}", {}] for m in ("", "_causal", "_window")
              for d in ("d512", "d512v256") for dt in ("bf16",)] + [
    ["bwd_causal_d512_fp16", {}], ["bwd_d512v256_fp16", {"regs": "232/40"}],
    ["bwd_causal_d512v256_bf16", {"num_stages": 1}]]


@pytest.mark.slow  # an offline compile of nine kernels (about 20 s on 2 cores)
@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on Triton "
                    "3.6 (CI pins it)")
def test_d512_backwards_compile_for_sm90(pkg):
    """sm_90 through ptxas (Triton 3.6.0): shared memory within families_large's model and
    the H100's budget (222,080 bytes at d = 512, 222,336 at V 256 with two stages), no
    spill in the key loop, wgmmas 64x32x16 (S^T, dP^T, dQ^T) and 64x128x16 (dK, dV)."""
    rows = compile_gluon_variants(pkg, [[n, k, False] for n, k in _BWD_CASES])
    v = pkg._registry.VARIANTS
    for r in rows:
        facts = v[r["variant"]]
        dv = facts.get("v_head_dim") or 512
        cfg = {**families.variant_gluon_default(facts), **r["knobs"]}
        assert families_large.d512_bwd_config_reason(cfg, dv, H100) is None, r
        model = families_large.d512_bwd_shared_bytes(dv, cfg["num_stages"], cfg["dq_slots"])
        assert r["shared"] <= model <= H100, r
        assert families.regs(cfg)[0] in r["setmaxnreg"], r
        assert r["wgmma"] > 0 and not r["wgmma_notes"], r
        assert any("64x32x16" in f for f in r["gmma_forms"]), r  # S^T, dP^T, dQ^T
        assert any("64x128x16" in f for f in r["gmma_forms"]), r  # dK (and dV at d = 512)
        assert r["loop_spills"] == 0, r
        assert r["spill_bytes"] <= 64, r


# on the GPU: the backward against float64, switched on (families.D512_BWD_ON, what
# FLASHGEN_GLUON_BWD_512=1 sets at import)
_BWD_GPU_CASES = [
    # (B, Nq, Nk, Hq, Hkv, dv, dtype, causal, window): one row, 59 and 257 (ragged 32-row
    # steps and 64-key blocks), Nq != Nk both ways (rows that see no key), GQA 4:1, MQA, a
    # window, many steps; both pairs
    (1, 1, 513, 8, 8, 512, torch.bfloat16, True, (-1, -1)),
    (3, 59, 59, 4, 1, 512, torch.float16, False, (-1, -1)),
    (2, 257, 257, 8, 2, 512, torch.bfloat16, True, (-1, -1)),
    (2, 257, 1031, 8, 2, 512, torch.float16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 512, torch.bfloat16, True, (-1, -1)),
    (2, 777, 777, 4, 1, 512, torch.bfloat16, False, (100, 0)),
    (3, 1000, 1000, 16, 4, 512, torch.bfloat16, False, (-1, -1)),
    (1, 1, 513, 8, 8, 256, torch.bfloat16, True, (-1, -1)),
    (3, 59, 127, 4, 1, 256, torch.float16, False, (-1, -1)),
    (2, 257, 1031, 8, 2, 256, torch.bfloat16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 256, torch.float16, True, (-1, -1)),
    (2, 777, 777, 4, 1, 256, torch.bfloat16, False, (100, 0)),
]
_BWD_IDS = ["d512-N1-causal", "d512-N59-mqa", "d512-N257-causal-gqa4",
            "d512-nq<nk-causal-gqa4", "d512-nq>nk-causal", "d512-window-mqa", "d512-1k-gqa4-b3",
            "v256-N1-causal", "v256-N59-nq<nk-mqa", "v256-nq<nk-causal-gqa4",
            "v256-nq>nk-causal", "v256-window-mqa"]


def _bwd_kinds(pkg):
    rt = pkg._runtime
    return {"gluon" if p is not None and p[7] == rt._BWD_GLUON else "tl"
            for p in rt._backward_plans.values()}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case,knobs", [
    *((c, k) for k in ({}, {"regs": "232/40", "bwd_head_group": 3}) for c in _BWD_GPU_CASES),
    # (a one-deep ring at v 256 only: d = 512's default is one already)
    *((c, {"num_stages": 1}) for c in _BWD_GPU_CASES if c[5] == 256)],
    ids=[*(f"{i}-{k}" for k in ("default", "regs-group3") for i in _BWD_IDS),
         *(f"{i}-s1" for i, c in zip(_BWD_IDS, _BWD_GPU_CASES) if c[5] == 256)])
def test_gluon_d512_backward_against_float64(pkg, poison, monkeypatch, case, knobs):
    b, nq, nk, hq, hkv, dv, dt, causal, window = case
    rt = pkg._runtime
    monkeypatch.setattr(rt._families, "D512_BWD_ON", True)
    monkeypatch.setattr(rt, "_configs", {})
    rt._backward_plans.clear()
    q, k, v = _qkv(b, nq, nk, hq, hkv, 512, dv, dt, grad=True)
    do = torch.randn(b, nq, hq, dv, device="cuda", dtype=dt)
    with rt.override_config(family="gluon"):
        out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
        with rt.override_config(family="gluon", **knobs):  # (the backward's knobs only)
            out.backward(do)
            assert _bwd_kinds(pkg) == {"gluon"}
    vis = visible_mask(nq, nk, causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, vis)
    ref.backward(do.double().transpose(1, 2))
    assert_grads((q, k, v), (q64, k64, v64), dt)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("switch", [False, True], ids=["default-tl", "switched-on"])
def test_gluon_d512_backward_default_follows_the_switch(pkg, monkeypatch, switch):
    """Untuned, a large Q/K 512 call's backward runs `tl` unless the switch is on."""
    rt = pkg._runtime
    monkeypatch.setattr(rt._families, "D512_BWD_ON", switch)
    monkeypatch.setattr(rt, "_configs", {})
    rt._backward_plans.clear()
    q, k, v = _qkv(1, 2048, 2048, 8, 2, 512, 512, torch.bfloat16, grad=True)
    pkg.flash_attn_func(q, k, v, causal=True).float().sum().backward()
    assert _bwd_kinds(pkg) == ({"gluon"} if switch else {"tl"})
    assert not torch.isnan(q.grad).any() and not torch.isnan(k.grad).any()


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dv", [512, 256])
def test_gluon_d512_backward_piece_sums_into_fp32(pkg, monkeypatch, dv):
    """A context-parallel piece's launch: dQ added into the caller's fp32 sum (dq_accum),
    dK and dV in fp32 (both launches' halves into the same tensors)."""
    rt = pkg._runtime
    monkeypatch.setattr(rt._families, "D512_BWD_ON", True)
    b, n, h, h_kv, dt = 2, 300, 8, 2, torch.bfloat16
    q, k, v = _qkv(b, n, n, h, h_kv, 512, dv, dt)
    do = torch.randn(b, n, h, dv, device="cuda", dtype=dt)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, N, H, d) <-> (B, H, N, d)
    band = dict(mask="causal", lo=-(2 * n + 1), hi=0, scale=512 ** -0.5)
    with rt.override_config(family="gluon"):
        out = torch.empty(b, n, h, dv, device="cuda", dtype=dt)
        lse = rt.forward(q, k, v, out, bnhd=True, **band)
        rt._backward_plans.clear()
        acc = torch.full((b, n, h, 512), 0.5, device="cuda", dtype=torch.float32)
        dk = torch.empty(k.shape, device="cuda", dtype=torch.float32)
        dv_ = torch.empty(v.shape, device="cuda", dtype=torch.float32)
        rt.backward(t(do), t(q), t(k), t(v), t(out), lse, None, t(dk), t(dv_),
                    dq_accum=t(acc), **band)
        assert _bwd_kinds(pkg) == {"gluon"}
    vis = visible_mask(n, n, causal=True, bottom_right=True)
    q64, k64, v64 = (x.double().transpose(1, 2).requires_grad_() for x in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, vis)
    ref.backward(do.double().transpose(1, 2))
    from conftest import GRAD_TOL

    for name, got, want in (("dq", acc - 0.5, q64), ("dk", dk, k64), ("dv", dv_, v64)):
        torch.testing.assert_close(got.double(), want.grad.transpose(1, 2),
                                   atol=GRAD_TOL[dt][0], rtol=GRAD_TOL[dt][1],
                                   msg=lambda m, name=name: f"{name}: {m}")
