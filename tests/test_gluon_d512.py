"""The Gluon forward at Q/K 512 (Gemma 4's global layers, issue 47): one kernel, the forward
template at (qk 512, v 256), run once for that pair and twice for d = 512 (over V's and O's
256-column halves; flashgen/families_large.py has the arithmetic and why).

On the CPU: which variants get it and why the others do not (the backward, dropout, mods
and fp8 stay `tl`), the tile's shared-memory and register arithmetic, the rendered
kernels' constants, the untuned routing on an H100 (gluon_ready and gpu_key monkeypatched)
and describe(). In the slow group: every form compiles for sm_90 with no spill in its key
loop. On the GPU (-m gpu, Hopper): against the float64 reference at odd shapes.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_out_lse as _assert_out, cuda_qkv as _qkv
from flashgen import families, families_large
from flashgen.reference import attention_ref, visible_mask
from flashgen.space import space_for
from packages import build_and_import, gluon_compiles

ROOT = Path(__file__).resolve().parents[1]
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
    for name in ("bwd_d512_bf16", "bwd_causal_d512v256_fp16", "bwd_window_dropout_d512_bf16"):
        assert "the backward stays `tl`" in reasons[name], name
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
    for name in ("bwd_causal_d512_bf16", "fwd_causal_dropout_d512_bf16",
                 "fwd_causal_softcap_d512_bf16"):
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


def test_describe_says_two_launches_and_why_the_backward_is_tl(pkg):
    lines = pkg.describe().splitlines()

    def line(name):
        return next(ln for ln in lines if f" {name} " in ln)

    assert "gluon 128x32, 2-deep ring" in line("fwd_causal_d512_bf16")
    assert "2 launches over V halves" in line("fwd_causal_d512_bf16")
    assert "2 launches" not in line("fwd_causal_d512v256_bf16")
    assert "opt-in" not in line("fwd_d512_bf16")
    assert "paged prefill tl (Q/K 512" in line("fwd_d512_bf16")
    assert "tl (head dims 512/512: the backward stays `tl`" in line("bwd_causal_d512_bf16")
    assert "tl (dropout at head dims 512/512" in line("fwd_causal_dropout_d512_bf16")


# ---------------------------------------------------------------------------------------
# every form compiles for sm_90
# ---------------------------------------------------------------------------------------
_COMPILE = r"""
import importlib, json, sys
from pathlib import Path
from flashgen import families, gluon_compile
from flashgen.offline import mod_arg_types
pkg_dir = Path(sys.argv[1])
sys.path.insert(0, str(pkg_dir.parent))
registry = importlib.import_module(f"{pkg_dir.name}._registry")
out = []
for name, knobs, varlen in json.loads(sys.argv[2]):
    mod = importlib.import_module(f"{pkg_dir.name}.kernels.gluon.{name}")
    facts = registry.VARIANTS[name]
    cfg = dict(families.variant_gluon_default(facts), **knobs)
    res = gluon_compile.compile_variant(mod, name, facts["head_dim"], facts["dtype"], cfg,
                                        mod_arg_types(registry, name)[0], varlen=varlen,
                                        v_dim=facts.get("v_head_dim"))
    out.append(dict(res.__dict__, knobs=knobs))
print(json.dumps(out))
"""

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
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(Path(pkg.__file__).parent),
                          json.dumps(_CASES)], capture_output=True, text=True, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == len(_CASES)
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
        from conftest import GRAD_TOL

        do = torch.randn_like(out)
        out.backward(do)
        ref.backward(do.double().transpose(1, 2))
        for name, got, want in zip(("dq", "dk", "dv"), (q, k, v), (q64, k64, v64)):
            assert not torch.isnan(got.grad).any(), name
            torch.testing.assert_close(got.grad.double(), want.grad.transpose(1, 2),
                                       atol=GRAD_TOL[dt][0], rtol=GRAD_TOL[dt][1],
                                       msg=lambda m, name=name: f"{name}: {m}")


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
