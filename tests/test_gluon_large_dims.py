"""The Gluon forward at the large head dims: d = 256 (Gemma 2/3) and (qk 192, v 128) (MLA).

On the CPU: which variants get a Gluon kernel at these dims and why the others do not (the
backward's own kernel, opt-in: tests/test_gluon_bwd.py), the tiles families.LARGE_HEAD_DIM_FWD picks and the shared-memory and
register arithmetic behind them, the rendered kernels' head-dim constants, the launcher's
compile-time arguments (O staged in the Q slots) and the tuner's space. In the slow group:
every new (head dim, tile) compiles for sm_90 through ptxas with no spill in its key loop.
On the GPU (-m gpu, Hopper): the kernels against the float64 reference at odd shapes.
"""
from pathlib import Path

import pytest
import torch

from conftest import assert_grads, assert_out_lse as _assert_out, cuda_qkv as _qkv
from flashgen import families
from flashgen.reference import attention_ref, visible_mask
from flashgen.space import space_for
from packages import build_and_import, compile_gluon_variants, gluon_compiles

H100 = families.GLUON_SHARED_BYTES


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("glarge"), "fg_test_gluon_large", """
        head_dims: [160, 256, {qk: 192, v: 128}]
        dtypes: [fp16, bf16]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        mods:
          softcap: {builtin: softcap, params: {cap: 50.0}}
          document: {builtin: document}
          sink_logits: {builtin: sink_logits}
        variants:
          - {mask: causal, mods: [softcap]}
          - {mask: causal, mods: [document]}
          - {mask: causal, mods: [sink_logits]}
        """)


# ---------------------------------------------------------------------------------------
# which variants have a Gluon kernel, and why not
# ---------------------------------------------------------------------------------------
def test_forwards_get_gluon_kernels_and_backwards_say_why_not(pkg):
    """(The plain backwards at these dims have a Gluon kernel of their own, opt-in:
    tests/test_gluon_bwd.py; with dropout or mods they say why they run `tl`.)"""
    reasons = pkg._registry.GLUON
    fwd = [n for n in reasons if n.startswith("fwd_") and ("_d256_" in n or "_d192v128_" in n)
           and "sdpa_mask" not in n]  # (attn_mask's bias tile: `tl`, as at every head dim)
    assert len(fwd) == (3 + 3) * 2 * 2 * 2  # (masks + mods) x dropout x dims x dtypes
    assert all(reasons[n] is None for n in fwd), {n: reasons[n] for n in fwd}
    assert "[q, kv] tile" in reasons["fwd_sdpa_mask_d256_bf16"]
    for name in ("bwd_d256_bf16", "bwd_causal_d192v128_fp16"):
        assert reasons[name] is None, name
    assert "mods at head dims 256/256" in reasons["bwd_causal_softcap_d256_bf16"]
    assert "draws no keep mask" in reasons["bwd_window_dropout_d192v128_bf16"]
    # a head dim with no Gluon tiles names the ones that have
    assert "head dim 160" in reasons["fwd_d160_bf16"] and "192/128" in reasons["fwd_d160_bf16"]
    rendered = {p.stem for p in (Path(pkg.__file__).parent / "kernels" / "gluon").glob("*.py")}
    assert rendered - {"__init__"} == {n for n, r in reasons.items() if r is None}
    # other pairs, and the dtypes wgmma does not take
    assert "192/128" in families.gluon_reason("fwd", False, 128, "bf16", 64)
    assert "192/128" in families.gluon_reason("fwd", False, 256, "bf16", 128)
    assert "wgmma" in families.gluon_reason("fwd", False, 256, "fp32")
    assert families.gluon_reason("fwd", True, 192, "fp16", 128) is None


def test_describe_names_the_tiles_and_the_backwards_reason(pkg):
    lines = pkg.describe().splitlines()

    def line(name):
        return next(ln for ln in lines if f" {name} " in ln)

    assert "gluon 128x64, 2-deep ring" in line("fwd_causal_d256_bf16")
    assert "gluon 128x128, 2-deep ring" in line("fwd_d192v128_fp16")
    assert "opt-in" not in line("fwd_d256_bf16")  # the Hopper default on this branch
    # dropout at these dims is not timed: asked for only
    assert "opt-in" in line("fwd_causal_dropout_d256_bf16")
    assert "gluon 64x64" in line("bwd_causal_d256_bf16")  # (the large backward, on)
    assert "tl (dropout at head dims 256/256" in line("bwd_causal_dropout_d256_bf16")


# ---------------------------------------------------------------------------------------
# the tiles: shared memory and registers (families.LARGE_HEAD_DIM_FWD)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("d,dv,block_n,shared,regs", [
    # Q 64 KiB + a 2-deep ring of 64-key K/V blocks 128 KiB, O in the Q slots;
    # O 128 + S 32 + P 32 registers
    (256, 256, 64, 197632, 192),
    # Q 48 KiB (three 64-column boxes) + a 2-deep ring of 128-key blocks 160 KiB, O in Q;
    # O 64 + S 64 + P 64
    (192, 128, 128, 214016, 192),
])
def test_large_dim_defaults_fit_shared_memory_and_registers(d, dv, block_n, shared, regs):
    cfg = families.gluon_default(d, "fwd", "causal", v_dim=dv)
    assert (cfg["block_m"], cfg["block_n"], cfg["num_stages"]) == (128, block_n, 2)
    assert cfg["q_buffers"] == 1 and cfg["regs"] == "240/24" and not cfg["overlap"]
    assert families.o_in_q(cfg, d, dv)
    assert families.shared_bytes(d, 2, block_n, 2, 1, 2, dv, True) == shared <= H100
    # an output buffer of its own would not fit
    assert families.shared_bytes(d, 2, block_n, 2, 1, 2, dv) > H100
    assert families.fwd_accumulator_regs(block_n, dv) == regs <= families.regs(cfg)[0]
    assert families.config_reason(cfg, d, 2, H100, v_dim=dv) is None
    # the knobs measured at d <= 128 (a second Q slot) are not applied here
    for kw in ({"key_span": "segment"}, {"dropout": True}, {"mods": ("softcap",)}):
        assert families.gluon_default(d, "fwd", "causal", v_dim=dv, **kw) == cfg, kw


def test_what_does_not_fit_at_the_large_dims_is_rejected():
    d256 = families.gluon_default(256)
    why = families.config_reason
    # 128-key blocks: O, S and P take 256 registers a thread (and 128 KiB a K/V stage)
    assert "256 registers" in why({**d256, "block_n": 128}, 256, 2, 10 ** 9)
    assert "shared memory" in why({**d256, "num_stages": 3}, 256, 2, H100)
    assert "shared memory" in why({**d256, "q_buffers": 2}, 256, 2, H100)
    # the output staged in the Q slot cannot wait for the next tile's first S = Q K^T
    assert "overlap" in why({**d256, "overlap": True}, 256, 2, H100)
    mla = families.gluon_default(192, v_dim=128)
    # 64-key blocks, 3 deep: 200 KiB with an output buffer of its own, no O_IN_Q
    three = {**mla, "block_n": 64, "num_stages": 3}
    assert not families.o_in_q(three, 192, 128)
    assert why(three, 192, 2, H100, v_dim=128) is None
    assert why({**three, "overlap": True}, 192, 2, H100, v_dim=128) is None
    four = {**three, "num_stages": 4}  # 4 deep: the output goes to the Q slots again
    assert families.o_in_q(four, 192, 128) and why(four, 192, 2, H100, v_dim=128) is None
    # the head dims up to 128 keep their own output buffer whatever the tile
    assert not families.o_in_q({**families.GLUON_DEFAULT, "num_stages": 3}, 128)
    assert "shared memory" in why({**families.GLUON_DEFAULT, "num_stages": 3}, 128, 2, H100)


def test_qk_boxes_are_powers_of_two():
    assert families.qk_boxes(192) == (3, 64)
    assert families.qk_boxes(256) == (1, 256) and families.qk_boxes(128) == (1, 128)
    assert families.qk_boxes(96) == (1, 128) and families.qk_boxes(64) == (1, 64)


# ---------------------------------------------------------------------------------------
# the rendered kernels and the launcher
# ---------------------------------------------------------------------------------------
def test_rendered_kernels_carry_their_head_dims(pkg):
    root = Path(pkg.__file__).parent / "kernels" / "gluon"
    mla = (root / "fwd_causal_d192v128_bf16.py").read_text()
    for line in ("HEAD_DIM = gl.constexpr(192)", "HEAD_DIM_PAD = gl.constexpr(192)",
                 "QK_BOX = gl.constexpr(64)", "QK_BOXES = gl.constexpr(3)",
                 "HEAD_DIM_V = gl.constexpr(128)", "HEAD_DIM_V_PAD = gl.constexpr(128)"):
        assert line in mla, line
    d256 = (root / "fwd_d256_bf16.py").read_text()
    for line in ("HEAD_DIM = gl.constexpr(256)", "QK_BOX = gl.constexpr(256)",
                 "QK_BOXES = gl.constexpr(1)", "HEAD_DIM_V = gl.constexpr(256)"):
        assert line in d256, line
    assert "O_IN_Q: gl.constexpr" in d256


def test_launcher_stages_o_in_q_where_the_tile_needs_it(pkg):
    from triton.experimental.gluon import language as gl

    launcher = pkg._runtime._gluon_forward_launcher
    v = pkg._registry.VARIANTS
    for name, d in (("fwd_causal_d256_bf16", 256), ("fwd_d192v128_bf16", 192)):
        cfg = families.variant_gluon_default(v[name])
        meta = launcher(name, cfg, torch.bfloat16, d, 10, 10, varlen=False).meta
        assert meta["O_IN_Q"] and meta["BLOCK_N"] == cfg["block_n"], name
        box = 64 if d == 192 else 256
        assert meta["QO_LAYOUT"] == gl.NVMMASharedLayout.get_default_for([1, 1, 64, box],
                                                                         gl.bfloat16)
    # a forced overlap where the output is staged in Q: a ValueError, not a compile error
    with pytest.raises(ValueError, match="`fwd_d256_bf16`: overlap stores"):
        launcher("fwd_d256_bf16", {**families.variant_gluon_default(v["fwd_d256_bf16"]),
                                   "overlap": True}, torch.bfloat16, 256, 10, 10, varlen=False)
    three = {**families.variant_gluon_default(v["fwd_d192v128_bf16"]), "block_n": 64,
             "num_stages": 3}
    assert not launcher("fwd_d192v128_bf16", three, torch.bfloat16, 192, 10, 10,
                        varlen=True).meta["O_IN_Q"]


def test_the_tuners_space_holds_the_large_dim_tiles():
    def gluon_points(d, dv):
        space = space_for("fwd", max(d, dv), 2, H100, 132, (9, 0), gluon=None, mask="causal",
                          v_head_dim=dv if dv != d else None)
        default = space.config(families.gluon_default(d, "fwd", "causal", v_dim=dv))
        assert space.check(default) is None, space.check(default)
        return {(p["block_n"], p["num_stages"]) for p in space.points()
                if p["family"] == "gluon"}

    assert gluon_points(256, 256) == {(64, 2)}
    assert gluon_points(192, 128) == {(128, 2), (64, 2), (64, 3), (64, 4)}


# ---------------------------------------------------------------------------------------
# every new (head dim, tile) compiles for sm_90
# ---------------------------------------------------------------------------------------
# (variant, knobs, varlen): the plain forwards under each mask, dense and packed, at their
# defaults; the tuner's other tiles and knobs; the mods; dropout
_CASES = [
    *[[f"fwd{m}_{d}_bf16", {}, packed] for m in ("", "_causal", "_window")
      for d in ("d256", "d192v128") for packed in (False, True)],
    ["fwd_d192v128_fp16", {"block_n": 64, "num_stages": 3}, False],
    ["fwd_causal_d192v128_bf16", {"block_n": 64, "num_stages": 4}, False],
    ["fwd_window_d192v128_bf16", {"block_n": 64, "num_stages": 3, "q_buffers": 2}, False],
    # (each of these alone keeps the key loop clean at d = 256; all three together spilled
    # 16 LDL/STL a block: a point the tuner may measure, and would find slower)
    ["fwd_causal_d256_fp16", {"pingpong": False, "diag_first": True}, False],
    ["fwd_window_d256_bf16", {"regs": "224/56"}, False],
    ["fwd_d256_bf16", {"persistent": False, "stream_k": False, "regs": "232/40"}, False],
    ["fwd_causal_softcap_d256_bf16", {}, False],
    ["fwd_causal_document_d256_bf16", {}, False],
    ["fwd_causal_sink_logits_d192v128_bf16", {}, False],
    ["fwd_causal_document_d192v128_fp16", {}, True],
    ["fwd_dropout_d256_bf16", {}, False],
    ["fwd_dropout_d192v128_fp16", {}, False],
    ["fwd_causal_dropout_d256_bf16", {}, False],
]


@pytest.mark.slow  # a long offline compile (the CPU group stays under 10 minutes)
@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on Triton "
                    "3.6 (CI pins it)")
def test_large_dim_forwards_compile_for_sm90(pkg):
    """sm_90 through ptxas (Triton 3.6.0; commit messages and the module's docstring have
    the numbers): the register split, shared memory within the model (o_in_q) and the H100's
    budget, every wgmma asynchronous, and no spill in a key loop -- the plain, packed and
    mod kernels' stack frames 0-64 bytes, outside the loop. The dropout forward at these
    dims (opt-in: not timed) keeps P's halves on the stack across the masked blocks' V wait
    (causal d=256: 12 LDL/STL a block, 16-bit; 0 unmasked), so it is held to a bound, not 0."""
    rows = compile_gluon_variants(pkg, _CASES)
    v = pkg._registry.VARIANTS
    for r in rows:
        facts = v[r["variant"]]
        d, dv = facts["head_dim"], facts.get("v_head_dim") or facts["head_dim"]
        cfg = {**families.variant_gluon_default(facts), **r["knobs"]}
        staged = families.o_in_q(cfg, d, dv)
        assert ("o-in-q" in r["config"]) == staged, r
        model = families.shared_bytes(d, 2, cfg["block_n"], cfg["num_stages"],
                                      cfg["q_buffers"], 2, dv, staged)
        assert r["shared"] <= model <= H100, r
        assert families.regs(cfg)[0] in r["setmaxnreg"], r
        assert families.regs(cfg)[1] in r["setmaxnreg"], r
        assert r["wgmma"] > 0 and not r["wgmma_notes"], r
        assert r["loop_spills"] is not None, r
        if facts["dropout"]:
            assert r["loop_spills"] <= (0 if facts["mask"] == "none" else 16), r
            assert r["spill_bytes"] <= 128, r
        else:
            assert r["loop_spills"] == 0, r
            assert r["spill_bytes"] <= 64, r


# ---------------------------------------------------------------------------------------
# on the GPU: against float64
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the Gluon kernels run on Hopper only; "
                                  "other GPUs take the tl kernels")


def _forward(pkg, q, k, v, knobs, launches=None, **kw):
    """(out, lse) of the Gluon forward, asked for (most shapes here are below
    GLUON_MIN_FLOPS, where the package picks `tl`), with `knobs` over the variant's default;
    the `tl` backward follows it (the Gluon one at these dims is opt-in: test_gluon_bwd.py). `launches`: a list that
    gets the call's Launchers (override_config empties the plan caches on its way out)."""
    rt = pkg._runtime
    rt._forward_plans.clear()
    with rt.override_config(family="gluon", **knobs):
        out, lse = pkg.flash_attn_func(q, k, v, return_lse=True, **kw)
        made = [p[0] for p in rt._forward_plans.values() if p[0] is not None]
        kinds = {type(launch.fn).__name__ for launch in made}
        assert kinds == {"GluonJITFunction"}, kinds
    if launches is not None:
        launches.extend(made)
    return out, lse


_CASES_GPU = [
    # (B, Nq, Nk, Hq, Hkv, d, dv, dtype, causal, window): one row, 59 and 257 (ragged ends
    # of 64- and 128-row tiles), Nq != Nk both ways, GQA 4:1 and MQA, a window (rows with
    # no key), many tiles and persistent rounds
    (1, 1, 513, 8, 8, 256, 256, torch.bfloat16, True, (-1, -1)),
    (3, 59, 127, 4, 1, 256, 256, torch.float16, False, (-1, -1)),
    (2, 257, 1031, 8, 2, 256, 256, torch.bfloat16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 256, 256, torch.float16, True, (-1, -1)),
    (2, 777, 777, 4, 1, 256, 256, torch.bfloat16, False, (100, 0)),
    (3, 1000, 1000, 16, 4, 256, 256, torch.bfloat16, False, (-1, -1)),
    (1, 1, 513, 8, 8, 192, 128, torch.bfloat16, True, (-1, -1)),
    (3, 59, 127, 4, 1, 192, 128, torch.bfloat16, False, (-1, -1)),
    (2, 257, 1031, 8, 2, 192, 128, torch.float16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 192, 128, torch.bfloat16, True, (-1, -1)),
    (2, 777, 777, 4, 1, 192, 128, torch.float16, False, (100, 0)),
    (3, 1000, 1000, 16, 4, 192, 128, torch.bfloat16, True, (-1, -1)),
]
_IDS = ["d256-N1-causal", "d256-N59-gqa4", "d256-nq<nk-causal-gqa4", "d256-nq>nk-causal",
        "d256-window-mqa", "d256-1k-gqa4", "mla-N1-causal", "mla-N59-mqa",
        "mla-nq<nk-causal-gqa4", "mla-nq>nk-causal", "mla-window-mqa", "mla-1k-causal-gqa4"]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", _CASES_GPU, ids=_IDS)
@pytest.mark.parametrize("knobs", [
    {}, {"pingpong": False, "persistent": False, "regs": "232/40"},
    # a cut-down persistent grid: several tiles a program, the Q slot reused tile after tile
    {"diag_first": True, "l2_share": 8, "programs": 7},
    # (192 / 128 only) 64-key blocks, 3 deep (an output buffer of its own) and 4 deep (in Q)
    {"block_n": 64, "num_stages": 3}, {"block_n": 64, "num_stages": 4, "poly_exp2": 8},
], ids=["default", "no-pingpong-one-tile", "diag-first-7-programs", "mla-bn64-s3", "mla-bn64-s4"])
def test_gluon_large_dim_forward_against_float64(pkg, poison, case, knobs):
    b, nq, nk, hq, hkv, d, dv, dt, causal, window = case
    if "block_n" in knobs and d == 256:
        pytest.skip("d = 256 has one tile (128 x 64, 2 deep)")
    grads = not knobs  # (the `tl` backward behind the default's forward, its LSE)
    q, k, v = _qkv(b, nq, nk, hq, hkv, d, dv, dt, grad=grads)
    out, lse = _forward(pkg, q, k, v, knobs, causal=causal, window_size=window)
    vis = visible_mask(nq, nk, causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(q64, k64, v64, vis)
    _assert_out(out, lse, ref, ref_lse, dt)
    if grads:
        do = torch.randn_like(out)
        out.backward(do)
        ref.backward(do.double().transpose(1, 2))
        assert_grads((q, k, v), (q64, k64, v64), dt)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,dv", [(256, 256), (192, 128)], ids=["d256", "mla"])
def test_gluon_large_dim_stream_k_against_float64(pkg, poison, monkeypatch, d, dv):
    """An unmasked call whose last round is dealt by key block (STREAM_K: a tile cut
    between two programs, its parts merged through the workspace, [64, d_v] fp32 a slot)."""
    monkeypatch.setattr(pkg._runtime._families, "STREAM_K_MIN_KEY_BLOCKS", 2)
    q, k, v = _qkv(2, 1100, 1100, 5, 5, d, dv, torch.bfloat16)
    launches = []
    out, lse = _forward(pkg, q, k, v, {"programs": 11}, launches)
    assert launches and all(launch.meta["STREAM_K"] for launch in launches)
    vis = visible_mask(1100, 1100, causal=False, bottom_right=True)
    ref, ref_lse = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), vis)
    _assert_out(out, lse, ref, ref_lse, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,dv,dtype,causal,window", [
    (256, 256, torch.bfloat16, True, (-1, -1)),
    (256, 256, torch.float16, False, (100, 0)),
    (192, 128, torch.bfloat16, True, (-1, -1)),
    (192, 128, torch.float16, False, (-1, -1)),
], ids=["d256-causal", "d256-window", "mla-causal", "mla-full"])
def test_gluon_large_dim_varlen_against_float64(pkg, poison, d, dv, dtype, causal, window):
    """flash_attn_varlen_func: the Gluon forward with VARLEN=True (a sequence's last 64-row
    slab stored row by row from the Q slot it was staged in), the `tl` backward behind it."""
    from test_varlen import assert_all, cu, reference

    lq = [130, 0, 1, 59, 257, 64, 200, 1, 127, 300]
    lk = [130, 3, 1, 300, 100, 64, 0, 7, 127, 257]
    q = torch.randn(sum(lq), 8, d, dtype=dtype, device="cuda", requires_grad=True)
    k = torch.randn(sum(lk), 2, d, dtype=dtype, device="cuda", requires_grad=True)
    v = torch.randn(sum(lk), 2, dv, dtype=dtype, device="cuda", requires_grad=True)
    rt = pkg._runtime
    rt._forward_plans.clear()
    with rt.override_config(family="gluon"):
        out, lse = pkg.flash_attn_varlen_func(q, k, v, cu(lq, "cuda"), cu(lk, "cuda"), max(lq),
                                              max(lk), causal=causal, window_size=window,
                                              return_lse=True)
        ran = {type(p[0].fn).__name__ for key, p in rt._forward_plans.items()
               if key[0] == "varlen" and p[0] is not None}
        assert ran == {"GluonJITFunction"}, ran
        do = torch.randn_like(out)
        out.backward(do)
    ref = reference(q, k, v, lq, lk, do, causal=causal, window=window)
    assert_all((out, lse, q.grad, k.grad, v.grad), ref, dtype)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,dv", [(256, 256), (192, 128)], ids=["d256", "mla"])
@pytest.mark.parametrize("mod", ["softcap", "document", "sink_logits"])
def test_gluon_large_dim_mods_against_float64(pkg, poison, d, dv, mod):
    """A score mod, a mask mod (block lists at the 128 x block_n tile) and a sink, causal,
    GQA 4:1, N = 257 (ragged tiles)."""
    from test_mods import documents, reference

    b, n, h, h_kv = 2, 257, 8, 2
    q, k, v = _qkv(b, n, n, h, h_kv, d, dv, torch.bfloat16)
    kw, ref_kw = {}, {}
    if mod == "softcap":
        kw["cap"] = 3.0  # small enough that tanh bends most scores
        ref_kw["score"] = lambda s, b, h, i, j: 3.0 * torch.tanh(s / 3.0)
    elif mod == "document":
        doc = documents(b, n, "cuda")
        ids = doc.cpu().long()
        kw["doc"] = doc
        ref_kw["mask"] = lambda b, h, i, j: ids[b, i] == ids[b, j]
    else:
        kw["sinks"] = torch.linspace(-2.0, 2.0, h, device="cuda")
        ref_kw["sink"] = kw["sinks"].cpu()
    out, lse = _forward(pkg, q, k, v, {}, causal=True, mods=(mod,), **kw)
    ref, ref_lse = reference(*(t.cpu() for t in (q, k, v)), causal=True, **ref_kw)
    _assert_out(out, lse, ref.transpose(1, 2), ref_lse, torch.bfloat16)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d,dv,causal", [(256, 256, True), (192, 128, False)],
                         ids=["d256-causal", "mla-full"])
def test_gluon_large_dim_dropout_against_float64(pkg, poison, d, dv, causal):
    """The dropout forward (opt-in at these dims): its keep mask is the package's
    `_dropout.keep_mask`, replayed into the float64 reference."""
    b, n, h, p, seed = 2, 300, 4, 0.1, 11
    q, k, v = _qkv(b, n, n, h, h, d, dv, torch.float16)
    torch.manual_seed(seed)
    out, lse = _forward(pkg, q, k, v, {}, causal=causal, dropout_p=p)
    torch.manual_seed(seed)
    keep = pkg.dropout_mask(b, h, n, n, p, device="cuda")
    vis = visible_mask(n, n, causal=causal, bottom_right=True)
    ref, ref_lse = attention_ref(*(t.transpose(1, 2) for t in (q, k, v)), vis, keep=keep,
                                 dropout_p=p)
    _assert_out(out, lse, ref, ref_lse, torch.float16)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("name", ["fwd_causal_d256_bf16", "fwd_d192v128_fp16"])
def test_gluon_large_dim_is_the_default(pkg, name):
    """Untuned, on Hopper, a call large enough for the Gluon kernel's fixed cost runs it;
    its backward runs too (test_gluon_bwd.py holds it against float64)."""
    facts = pkg._registry.VARIANTS[name]
    d, dv = facts["head_dim"], facts.get("v_head_dim") or facts["head_dim"]
    dt = torch.bfloat16 if name.endswith("bf16") else torch.float16
    rt = pkg._runtime
    rt._forward_plans.clear()
    q, k, v = _qkv(2, 2048, 2048, 8, 8, d, dv, dt, grad=True)
    out = pkg.flash_attn_func(q, k, v, causal=facts["mask"] == "causal")
    kinds = {type(p[0].fn).__name__ for p in rt._forward_plans.values() if p[0] is not None}
    assert kinds == {"GluonJITFunction"}, kinds
    out.float().sum().backward()
    assert not torch.isnan(q.grad).any() and not torch.isnan(v.grad).any()
