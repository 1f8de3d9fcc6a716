"""The Gluon (Hopper) backward.

On the CPU: which backward variants get a Gluon kernel, and that the runtime keeps the
`tl` backward where the Gluon one cannot serve (deterministic mode, the interpreter). The
sm_90 compile of every shipped Gluon kernel, backward included, is in test_gluon.py. On the
GPU (-m gpu): dQ, dK, dV of the Gluon kernel against autograd through the float64
reference, at shapes that cross many key blocks and query steps, ragged ends, Nq != Nk both
ways, GQA 4:1 and 8:1, d = 64 / 96 / 128, every mask; and the deterministic mode's
bitwise-reproducible `tl` fallback.
"""
import pytest
import torch

from conftest import GRAD_TOL
from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gluon_bwd"), "fg_test_gluon_bwd", """
        head_dims: [64, 80, 96, 128]
        dtypes: [fp16, bf16, fp32]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        """)


def test_backward_variants_with_a_gluon_kernel(pkg):
    reasons = pkg._registry.GLUON
    assert reasons["bwd_causal_d128_bf16"] is None
    assert reasons["bwd_window_d96_fp16"] is None
    assert reasons["bwd_d64_bf16"] is None
    assert "fp32" in reasons["bwd_d128_fp32"]
    assert "head dim 80" in reasons["bwd_d80_bf16"]
    assert reasons["bwd_dropout_d128_bf16"] is None  # tests/test_gluon_dropout.py
    gluon = __import__("pathlib").Path(pkg.__file__).parent / "kernels" / "gluon"
    text = (gluon / "bwd_causal_d96_bf16.py").read_text()
    assert "def bwd_causal_d96_bf16_kernel(" in text and "HEAD_DIM_PAD = gl.constexpr(128)" in text


def test_backward_default_config_and_reasons(pkg):
    rt = pkg._runtime
    cfg = rt._families.gluon_default(128, "bwd")
    assert cfg["family"] == "gluon" and cfg["block_n"] == 2 * rt._families.KEY_ROWS_PER_CONSUMER
    q = torch.randn(1, 2, 64, 128, dtype=torch.bfloat16)
    # on the CPU (the interpreter, or no GPU) the Gluon backward never runs
    why = rt.gluon_backward_reason("bwd_d128_bf16", q, q, q, q, "none")
    assert why is not None
    torch.use_deterministic_algorithms(True)
    try:
        assert "deterministic" in rt.gluon_backward_reason("bwd_d128_bf16", q, q, q, q, "none")
    finally:
        torch.use_deterministic_algorithms(False)


# ---------------------------------------------------------------------------------------
# on the GPU
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _grads(pkg, q, k, v, do, causal, window):
    out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
    out.backward(do)
    return q.grad, k.grad, v.grad


def _reference(q, k, v, do, causal, window):
    vis = visible_mask(q.shape[1], k.shape[1], causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = attention_ref(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2), vis)
    out.transpose(1, 2).backward(do.double())
    return q64.grad, k64.grad, v64.grad


def _bwd_plan_kinds(pkg):
    """'gluon' for each backward plan that runs the Gluon kernel, else 'tl'."""
    return {"gluon" if p is not None and p[7] == pkg._runtime._BWD_GLUON else "tl"
            for p in pkg._runtime._backward_plans.values()}


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, dtype, causal, window)
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, True, (-1, -1)),
    (2, 257, 1031, 8, 1, 128, torch.float16, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 128, torch.bfloat16, True, (-1, -1)),  # rows that see no key
    (1, 2048, 2048, 16, 16, 64, torch.bfloat16, False, (-1, -1)),
    (3, 59, 127, 4, 1, 64, torch.float16, False, (-1, -1)),
    (2, 777, 777, 4, 2, 96, torch.bfloat16, False, (100, 0)),
    (1, 1, 513, 8, 8, 128, torch.bfloat16, True, (-1, -1)),
    (2, 127, 127, 4, 4, 128, torch.bfloat16, False, (-1, -1)),
], ids=["causal-b3-gqa4", "causal-nq<nk-gqa8", "causal-nq>nk", "d64-2k", "odd-gqa4",
        "d96-window", "decode-row", "N127"])
# (bwd_head_group 5: key blocks level by level in groups of 5 (batch, K/V head) pairs, the
# last group short -- 6 pairs at causal-b3-gqa4, 8 at causal-nq>nk)
@pytest.mark.parametrize("knobs", [{}, {"regs": "232/40"}, {"bwd_head_group": 5}],
                         ids=["default", "regs", "group5"])
def test_gluon_backward_against_float64(pkg, poison, case, knobs):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, nq, nk, hq, hkv, d, dt, causal, window = case
    pkg._runtime._backward_plans.clear()
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt).requires_grad_()
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt).requires_grad_()
    v = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt).requires_grad_()
    do = torch.randn(b, nq, hq, d, device="cuda", dtype=dt)
    # the knobs are the backward's: the forward runs at its own Gluon default (a d=64
    # forward's three consumers take no 232/40 register split)
    with pkg._runtime.override_config(family="gluon"):
        out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
        with pkg._runtime.override_config(family="gluon", **knobs):
            out.backward(do)
            assert _bwd_plan_kinds(pkg) == {"gluon"}
    grads = q.grad, k.grad, v.grad
    atol, rtol = GRAD_TOL[dt]
    for name, g, r in zip("qkv", grads, _reference(q, k, v, do, causal, window)):
        assert not torch.isnan(g).any(), f"NaN in d{name}"
        torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"d{name}: {m}")


def test_descriptors_without_checks_are_the_checked_ones(pkg):
    """After a plan's first call the backward makes its TMA descriptors without Gluon's
    TensorDescriptor checks (_runtime._bare_descriptors): field for field the same
    descriptor."""
    import dataclasses

    hopper = pytest.importorskip("triton.experimental.gluon.nvidia.hopper")
    from triton.experimental.gluon import language as gl

    make = pkg._runtime._bare_descriptors()
    if make is None:  # another Triton's descriptor: the checked constructor serves every call
        assert pkg._runtime._descriptor_maker(True) is hopper.TensorDescriptor
        import triton
        assert not triton.__version__.startswith("3.6."), "3.6's descriptor is the one read"
        return
    t = torch.randn(2, 3, 40, 64, dtype=torch.bfloat16)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=4)
    args = (t, list(t.shape), list(t.stride()), [1, 1, 64, 64], layout)
    bare, checked = make(*args), hopper.TensorDescriptor(*args)
    assert type(bare) is type(checked)
    assert dataclasses.asdict(bare).keys() == dataclasses.asdict(checked).keys()
    for f in dataclasses.fields(checked):
        assert getattr(bare, f.name) is getattr(checked, f.name) or \
            getattr(bare, f.name) == getattr(checked, f.name), f.name


@pytest.mark.gpu
def test_repeated_backward_calls_reuse_the_plan_with_unchecked_descriptors(pkg, poison):
    """The second and later calls of a signature make the descriptors without the checks;
    each call's gradients against float64 (fresh inputs every call)."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = pkg._runtime
    dt = torch.bfloat16
    atol, rtol = GRAD_TOL[dt]
    with rt.override_config(family="gluon"):  # (plans cleared on entry and on exit only)
        for call in range(3):
            q, k, v = (torch.randn(2, 300, h, 128, device="cuda", dtype=dt).requires_grad_()
                       for h in (8, 2, 2))
            do = torch.randn(2, 300, 8, 128, device="cuda", dtype=dt)
            grads = _grads(pkg, q, k, v, do, True, (-1, -1))
            assert len(rt._backward_plans) == 1 and _bwd_plan_kinds(pkg) == {"gluon"}
            for name, g, r in zip("qkv", grads, _reference(q, k, v, do, True, (-1, -1))):
                assert not torch.isnan(g).any(), f"call {call}: NaN in d{name}"
                torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=atol, rtol=rtol,
                                           msg=lambda m: f"call {call}, d{name}: {m}")
    assert callable(rt._bare_descriptor)


@pytest.mark.gpu
def test_deterministic_mode_takes_the_reproducible_tl_backward(pkg):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = pkg._runtime
    q = torch.randn(2, 1024, 8, 128, device="cuda", dtype=torch.bfloat16).requires_grad_()
    do = torch.randn_like(q)
    runs = []
    torch.use_deterministic_algorithms(True)
    try:
        rt._backward_plans.clear()
        with rt.override_config(family="gluon"):
            for _ in range(2):
                q.grad = None
                pkg.flash_attn_func(q, q, q, causal=True).backward(do)
                runs.append(q.grad.clone())
            assert _bwd_plan_kinds(pkg) == {"tl"}
    finally:
        torch.use_deterministic_algorithms(False)
    assert torch.equal(runs[0], runs[1])


def test_which_gluon_kernels_run_by_default():
    from flashgen import families

    # what has run on the H100 and beaten `tl` there: the forward without dropout, the
    # backward at d >= 96 (d=64 from GLUON_BWD_SMALL_D_MIN_N); the dropout backward by the
    # same rule; the dropout forward at d = 64 and 128 (d = 96 and with mods when asked for)
    assert families.gluon_by_default("fwd", False, 64)
    assert families.gluon_by_default("bwd", False, 128)
    assert families.gluon_by_default("bwd", False, 96)
    # d=64: `tl` below GLUON_BWD_SMALL_D_MIN_N, Gluon (128-row steps) from it up
    assert not families.gluon_by_default("bwd", False, 64)
    assert not families.gluon_by_default("bwd", False, 64, (), families.GLUON_BWD_SMALL_D_MIN_N // 2)
    assert families.gluon_by_default("bwd", False, 64, (), families.GLUON_BWD_SMALL_D_MIN_N)
    assert families.gluon_default(64, "bwd")["block_m"] == 128
    assert families.gluon_default(128, "bwd")["block_m"] == 64
    assert families.gluon_by_default("fwd", True, 128)
    assert not families.gluon_by_default("fwd", True, 64)  # (a length rule at d = 64)
    assert families.gluon_by_default("fwd", True, 64, (), families.GLUON_DROPOUT_FWD_SMALL_D_MIN_N)
    assert not families.gluon_by_default("fwd", True, 64, (), 512)
    assert not families.gluon_by_default("fwd", True, 96)
    assert not families.gluon_by_default("fwd", True, 128, ("score",))
    assert families.gluon_by_default("bwd", True, 128)
    assert families.gluon_by_default("bwd", True, 96)
    assert not families.gluon_by_default("bwd", True, 64)
    assert not families.gluon_by_default("bwd", True, 64, (), families.GLUON_BWD_SMALL_D_MIN_N // 2)
    assert families.gluon_by_default("bwd", True, 64, (), families.GLUON_BWD_SMALL_D_MIN_N)


def test_causal_backward_head_groups(pkg):
    """The dense Gluon backward's program order: under a causal mask, the smallest divisor
    of the (batch, K/V head) pairs whose key blocks fill a 132-SM wave to within one level
    (families.bwd_head_group); head-major (1) without a causal mask or off a GPU; a config's
    bwd_head_group wins."""
    from flashgen import families

    assert families.bwd_head_group(16, 32, 132) == 4  # (1, 16, 4k): 4 x 32 blocks a wave
    assert families.bwd_head_group(128, 16, 132) == 8  # (8, 16, 2k)
    assert families.bwd_head_group(8, 32, 132) == 4  # GQA 4:1 at (1, 32, 4k): K/V heads
    assert families.bwd_head_group(16, 128, 132) == 1  # 16k: 128 blocks a head already
    assert families.bwd_head_group(6, 2, 132) == 6  # few blocks: every pair in one group
    rt = pkg._runtime
    q = torch.empty(1, 16, 4096, 128, dtype=torch.bfloat16)
    for name in ("bwd_causal_d128_bf16", "bwd_d128_bf16", "bwd_window_d128_bf16"):
        assert rt._gluon_bwd_head_group({}, name, q, 16, 32) == 1  # (a CPU tensor; unmasked)
    assert rt._gluon_bwd_head_group({"bwd_head_group": 5}, "bwd_causal_d128_bf16", q, 16, 32) == 5


# ---------------------------------------------------------------------------------------
# The large head dims: d = 256 and (qk 192, v 128) (templates/gluon/bwd_large.py.j2, issue
# 47). The default on Hopper; FLASHGEN_GLUON_BWD_LARGE=0 switches it off
# (families.GLUON_BWD_LARGE_DEFAULT); the GPU tests below ask for it (override_config).
# ---------------------------------------------------------------------------------------
LARGE = [(256, 256), (192, 128)]
H100 = 232448


@pytest.fixture(scope="module")
def large_pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gluon_bwd_large"), "fg_test_gluon_bwd_large", """
        head_dims: [256, {qk: 192, v: 128}]
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


def test_large_head_dim_backwards_get_their_own_gluon_kernel(large_pkg):
    reasons = large_pkg._registry.GLUON
    for name in ("bwd_d256_bf16", "bwd_causal_d256_fp16", "bwd_window_d256_bf16",
                 "bwd_d192v128_fp16", "bwd_causal_d192v128_bf16", "bwd_window_d192v128_bf16"):
        assert reasons[name] is None, (name, reasons[name])
    assert "draws no keep mask" in reasons["bwd_causal_dropout_d256_bf16"]
    assert "mods at head dims 256/256" in reasons["bwd_causal_softcap_d256_bf16"]
    root = __import__("pathlib").Path(large_pkg.__file__).parent / "kernels" / "gluon"
    d256 = (root / "bwd_causal_d256_bf16.py").read_text()
    assert "templates/gluon/bwd_large.py.j2" in d256.splitlines()[0]
    for line in ("QK_BOX = gl.constexpr(128)", "QK_BOXES = gl.constexpr(2)",
                 "V_BOX = gl.constexpr(128)", "MASK_RIGHT = gl.constexpr(True)"):
        assert line in d256, line
    mla = (root / "bwd_d192v128_bf16.py").read_text()
    for line in ("QK_BOX = gl.constexpr(64)", "QK_BOXES = gl.constexpr(3)",
                 "V_BOX = gl.constexpr(64)", "V_BOXES = gl.constexpr(2)"):
        assert line in mla, line
    # each consumer's (first, count) of dK boxes, dV boxes, dQ units, rendered into its call
    assert "0, 2, 0, 1, 0, 1," in mla and "2, 1, 1, 1, 1, 2," in mla
    line = next(ln for ln in large_pkg.describe().splitlines() if " bwd_causal_d256_bf16 " in ln)
    assert "gluon 64x64, 1-deep ring" in line and "FLASHGEN_GLUON_BWD_LARGE" not in line


@pytest.mark.parametrize("d,dv", LARGE, ids=["d256", "mla"])
def test_large_head_dim_backward_tiles_fit(d, dv):
    """families.LARGE_HEAD_DIM_BWD's arithmetic: each consumer's columns, its registers
    within the 240 of the split, the default tile within sm_90's shared memory."""
    from flashgen import families

    split = families.large_bwd_split(d, dv)
    cols = []
    for c in split["consumers"]:
        cols.append(c["dk"][1] * split["qk_box"] + c["dv"][1] * split["v_box"]
                    + c["dq"][1] * families.DQ_UNIT)
    assert cols[0] == cols[1] == (2 * d + dv) // 2  # the three products' columns, halved
    covered = [sum(c[k][1] for c in split["consumers"]) for k in ("dk", "dv", "dq")]
    assert covered == [split["qk_boxes"], split["v_boxes"], d // families.DQ_UNIT]
    regs = families.large_bwd_regs(d, dv)
    assert max(p for _, p in regs) <= 192 < families.CONSUMER_REGS
    cfg = families.gluon_default(d, "bwd", v_dim=dv)
    assert (cfg["block_m"], cfg["block_n"], cfg["regs"]) == (64, 64, "240/24")
    assert families.bwd_config_reason(cfg, d, 2, H100, dv) is None
    need = families.large_bwd_shared_bytes(d, dv, 2, cfg["num_stages"], cfg["dq_slots"])
    assert need == {256: 214528, 192: 206848}[d] <= H100
    # one more Q/dO stage does not fit with two dQ slots a consumer
    assert "shared memory" in families.bwd_config_reason(
        {**cfg, "num_stages": cfg["num_stages"] + 1}, d, 2, H100, dv)
    if d == 256:  # not even with one (the ring stays one deep, as FA3's and FA4's)
        assert "shared memory" in families.bwd_config_reason(
            {**cfg, "num_stages": 2, "dq_slots": 1}, d, 2, H100, dv)
        # a second Q slot alone fits with one dQ slot a consumer
        assert families.bwd_config_reason({**cfg, "num_stages": 2, "do_stages": 1,
                                           "dq_slots": 1}, d, 2, H100, dv) is None
    else:
        assert families.bwd_config_reason({**cfg, "num_stages": 3, "dq_slots": 1}, d, 2, H100,
                                          dv) is None
    assert "block_m and block_n" in families.bwd_config_reason({**cfg, "block_n": 128}, d, 2,
                                                               H100, dv)


def test_large_head_dim_backward_is_the_default_with_a_switch(large_pkg, monkeypatch):
    import os
    import subprocess
    import sys

    from flashgen import families

    code = "from flashgen import families; print(families.gluon_by_default('bwd', False, 256))"
    env = {k: v for k, v in os.environ.items() if k != "FLASHGEN_GLUON_BWD_LARGE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "True", out.stderr[-2000:]
    monkeypatch.setattr(families, "GLUON_BWD_LARGE_DEFAULT", False)
    for d in (256, 192):
        assert not families.gluon_by_default("bwd", False, d)
        assert families.gluon_by_default("fwd", False, d)  # (the forward: unchanged)
    assert families.gluon_by_default("bwd", False, 128)  # (the d <= 128 kernel: unchanged)
    monkeypatch.setattr(large_pkg._runtime._families, "GLUON_BWD_LARGE_DEFAULT", False)
    line = next(ln for ln in large_pkg.describe().splitlines() if " bwd_causal_d256_bf16 " in ln)
    assert "off (FLASHGEN_GLUON_BWD_LARGE=0)" in line
    # FLASHGEN_GLUON_BWD_LARGE=0 when the package (or flashgen) is imported turns it off
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**env, "FLASHGEN_GLUON_BWD_LARGE": "0"})
    assert out.stdout.strip() == "False", out.stderr[-2000:]


def test_large_head_dim_backward_launcher(large_pkg):
    """The runtime's compile-time arguments and TMA boxes (families.bwd_boxes), a forced
    config that does not fit refused before the compile, and packed batches sent to `tl`."""
    from triton.experimental.gluon import language as gl

    rt = large_pkg._runtime
    v = large_pkg._registry.VARIANTS
    for name, d, box, stages in (("bwd_causal_d256_bf16", 256, 128, 1),
                                 ("bwd_d192v128_fp16", 192, 64, 2)):
        cfg = rt._families.variant_gluon_default(v[name])
        launch, (boxes, layouts) = rt._gluon_backward_launcher(name, cfg, torch.bfloat16, d, 10,
                                                               varlen=False)
        assert (launch.meta["BLOCK_M"], launch.meta["BLOCK_N"]) == (64, 64)
        assert (launch.meta["NUM_BUFFERS"], launch.meta["DO_BUFFERS"]) == (stages, stages)
        assert launch.meta["DQ_SLOTS"] == 2
        assert boxes["Q"] == boxes["K"] == [1, 1, 64, box] and boxes["DQ_ACC"] == [1, 1, 64, 64]
        # P^T and dS^T: a 64-byte swizzle, one block a consumer's 32 columns
        assert launch.meta["DS_LAYOUT"].swizzle_byte_width == 64
        assert layouts["QD_LAYOUT"] == gl.NVMMASharedLayout.get_default_for([1, 1, 64, box],
                                                                             gl.bfloat16)
        with pytest.raises(ValueError, match="shared memory"):
            rt._gluon_backward_launcher(name, {**cfg, "num_stages": 3}, torch.bfloat16, d, 10,
                                        varlen=False)
    q = torch.randn(64, 4, 256, dtype=torch.bfloat16)
    why = rt.gluon_varlen_backward_reason("bwd_causal_d256_bf16", {"family": "gluon"}, q, q, q,
                                          q, 64, "causal")
    assert "dense batches" in why


def test_large_head_dim_backward_stays_out_of_the_tuner(monkeypatch):
    """Switched off, the tuner measures `tl` alone at these dims; on (the default), its
    space holds the kernel's 64 x 64 tiles that fit (d = 256: a one-deep ring)."""
    from flashgen import families, tune
    from flashgen.space import space_for

    gpu = tune.GpuInfo(key="H100|sm90|132sm", name="H100", capability=(9, 0), sm_count=132,
                       sram_bytes=H100)
    monkeypatch.setattr(families, "GLUON_BWD_LARGE_DEFAULT", False)
    for facts in ({"head_dim": 256, "dtype": "bf16"},
                  {"head_dim": 192, "v_head_dim": 128, "dtype": "fp16"}):
        assert "FLASHGEN_GLUON_BWD_LARGE=0" in tune.gluon_here("bwd", facts, gpu)
    assert "FLASHGEN_GLUON_BWD_LARGE" not in (tune.gluon_here("bwd", {"head_dim": 128,
                                                                      "dtype": "bf16"}, gpu) or "")
    monkeypatch.setattr(families, "GLUON_BWD_LARGE_DEFAULT", True)
    for d, dv, stages in ((256, None, {1}), (192, 128, {1, 2})):
        space = space_for("bwd", d, 2, H100, 132, (9, 0), gluon=None, mask="causal",
                          v_head_dim=dv)
        gluon = [p for p in space.points() if p["family"] == "gluon"]
        assert {(p["block_m"], p["block_n"]) for p in gluon} == {(64, 64)}
        assert {p["num_stages"] for p in gluon} == stages
        default = space.config(families.gluon_default(d, "bwd", v_dim=dv))
        assert space.check(default) is None, space.check(default)


_LARGE_COMPILE = r"""
import importlib, json, sys
from pathlib import Path
from flashgen import families, gluon_compile
pkg_dir = Path(sys.argv[1])
sys.path.insert(0, str(pkg_dir.parent))
registry = importlib.import_module(f"{pkg_dir.name}._registry")
out = []
for name, knobs in json.loads(sys.argv[2]):
    mod = importlib.import_module(f"{pkg_dir.name}.kernels.gluon.{name}")
    facts = registry.VARIANTS[name]
    cfg = dict(families.variant_gluon_default(facts), **knobs)
    res = gluon_compile.compile_variant(mod, name, facts["head_dim"], facts["dtype"], cfg,
                                        v_dim=facts.get("v_head_dim"))
    out.append(dict(res.__dict__, knobs=knobs))
print(json.dumps(out))
"""

# (variant, knobs): every mask at both head dims and dtypes' defaults, and the other points
# that fit (one dQ slot a consumer; d = 256 a second Q slot; 192 / 128 one and three Q/dO
# stages; another register split). GQA is a run-time loop over the query heads of a K/V
# head: the same binary.
_LARGE_CASES = [
    ["bwd_d256_bf16", {}], ["bwd_causal_d256_bf16", {}], ["bwd_window_d256_fp16", {}],
    ["bwd_d192v128_fp16", {}], ["bwd_causal_d192v128_bf16", {}],
    ["bwd_window_d192v128_bf16", {}],
    ["bwd_causal_d256_bf16", {"dq_slots": 1}],
    ["bwd_d256_bf16", {"num_stages": 2, "do_stages": 1, "dq_slots": 1}],
    ["bwd_causal_d256_fp16", {"regs": "232/40"}],
    ["bwd_d192v128_bf16", {"num_stages": 3, "dq_slots": 1}],
    ["bwd_causal_d192v128_fp16", {"num_stages": 1}],
]


@pytest.mark.slow  # an offline compile of eleven kernels (about 40 s on 2 cores)
def test_large_head_dim_backwards_compile_for_sm90(large_pkg):
    """sm_90 through ptxas (Triton 3.6.0): no stack frame at all (no spill anywhere, the key
    loop included), the 240/24 register split (setmaxnreg), shared memory within the model
    (families.large_bwd_shared_bytes) and sm_90's 227 KiB, every wgmma asynchronous and as
    many as the consumers' columns make."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from flashgen import families
    from packages import gluon_compiles

    if not gluon_compiles():
        pytest.skip("the Gluon templates are verified on Triton 3.6 (CI pins it)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", _LARGE_COMPILE, str(Path(large_pkg.__file__).parent),
                          json.dumps(_LARGE_CASES)], capture_output=True, text=True, env=env,
                         cwd=str(root))
    assert out.returncode == 0, out.stderr[-4000:]
    rows = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(rows) == len(_LARGE_CASES)
    for r in rows:
        facts = large_pkg._registry.VARIANTS[r["variant"]]
        d, dv = facts["head_dim"], facts.get("v_head_dim") or facts["head_dim"]
        cfg = {**families.variant_gluon_default(facts), **r["knobs"]}
        model = families.large_bwd_shared_bytes(d, dv, 2, cfg["num_stages"], cfg["dq_slots"],
                                                cfg.get("do_stages"))
        assert r["shared"] <= model <= H100, r
        assert set(families.regs(cfg)) <= set(r["setmaxnreg"]), r
        assert r["spill_bytes"] == 0 and r["loop_spills"] == 0, r
        assert not r["wgmma_notes"], r
        # a consumer's wgmma instructions a step (K = 16 each): S^T and dP^T over the head
        # dims, 64 query rows into each dK and dV box, 64 keys into each dQ unit
        split = families.large_bwd_split(d, dv)
        assert r["wgmma"] == sum(d // 16 + dv // 16 + (c["dk"][1] + c["dv"][1] + c["dq"][1]) * 4
                                 for c in split["consumers"]), r


# on the GPU: the large head dims' kernel against float64 (asked for: override_config)
_LARGE_GPU_CASES = [
    # (B, Nq, Nk, Hq, Hkv, d, dv, dtype, causal, window): one query row, 59 and 257 (ragged
    # 64-row steps and 64-key blocks), Nq != Nk both ways (rows that see no key), GQA 4:1
    # and MQA, a window, many key blocks and steps
    *[(b, nq, nk, hq, hkv, d, dv, dt, causal, window)
      for d, dv in LARGE for b, nq, nk, hq, hkv, dt, causal, window in (
          (1, 1, 513, 8, 8, torch.bfloat16, True, (-1, -1)),
          (3, 59, 59, 4, 1, torch.float16, False, (-1, -1)),
          (2, 257, 257, 8, 2, torch.bfloat16, True, (-1, -1)),
          (2, 257, 1031, 8, 2, torch.float16, True, (-1, -1)),
          (2, 1031, 257, 4, 4, torch.bfloat16, True, (-1, -1)),
          (2, 777, 777, 4, 1, torch.bfloat16, False, (100, 0)),
          (3, 1000, 1000, 16, 4, torch.bfloat16, False, (-1, -1)))],
]
_LARGE_IDS = [f"{'d256' if c[5] == 256 else 'mla'}-{tag}" for c, tag in zip(
    _LARGE_GPU_CASES, ["N1-causal", "N59-mqa", "N257-causal-gqa4", "nq<nk-causal-gqa4",
                       "nq>nk-causal", "window-mqa", "1k-gqa4"] * 2)]


def _large_inputs(b, nq, nk, hq, hkv, d, dv, dt, seed=0):
    torch.manual_seed(seed)
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dt).requires_grad_()
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dt).requires_grad_()
    v = torch.randn(b, nk, hkv, dv, device="cuda", dtype=dt).requires_grad_()
    do = torch.randn(b, nq, hq, dv, device="cuda", dtype=dt)
    return q, k, v, do


def _assert_large_grads(grads, refs, dt):
    atol, rtol = GRAD_TOL[dt]
    for name, g, r in zip("qkv", grads, refs):
        assert not torch.isnan(g).any(), f"NaN in d{name}"
        torch.testing.assert_close(g.double().cpu(), r.cpu(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"d{name}: {m}")


@pytest.mark.gpu
@pytest.mark.parametrize("case", _LARGE_GPU_CASES, ids=_LARGE_IDS)
@pytest.mark.parametrize("knobs", [
    {}, {"dq_slots": 1, "regs": "232/40"}, {"bwd_head_group": 5},
    # a second Q slot (the dO ring one deep), and (192 / 128 only) a one-deep and a
    # three-deep Q/dO ring
    {"num_stages": 2, "do_stages": 1, "dq_slots": 1},
    {"num_stages": 1}, {"num_stages": 3, "dq_slots": 1},
], ids=["default", "dq-slots-1-regs", "group5", "q2-do1", "mla-s1", "mla-s3"])
def test_gluon_large_head_dim_backward_against_float64(large_pkg, poison, case, knobs):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, nq, nk, hq, hkv, d, dv, dt, causal, window = case
    if "num_stages" in knobs and "do_stages" not in knobs and d == 256:
        pytest.skip("d = 256 has a one-deep ring (a second stage does not fit)")
    pkg = large_pkg
    pkg._runtime._backward_plans.clear()
    q, k, v, do = _large_inputs(b, nq, nk, hq, hkv, d, dv, dt)
    with pkg._runtime.override_config(family="gluon"):
        out = pkg.flash_attn_func(q, k, v, causal=causal, window_size=window)
        with pkg._runtime.override_config(family="gluon", **knobs):
            out.backward(do)
            assert _bwd_plan_kinds(pkg) == {"gluon"}
    _assert_large_grads((q.grad, k.grad, v.grad), _reference(q, k, v, do, causal, window), dt)


@pytest.mark.gpu
@pytest.mark.parametrize("d,dv", LARGE, ids=["d256", "mla"])
def test_gluon_large_head_dim_backward_piece_sums_into_fp32(large_pkg, d, dv):
    """A context-parallel piece's launch (the ring backward's): dQ added into the caller's
    fp32 sum (dq_accum), dK and dV in fp32, which the kernel stores from registers (its
    plain-store path) instead of through the K / V slots."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = large_pkg._runtime
    b, n, h, h_kv, dt = 2, 300, 8, 2, torch.bfloat16
    q, k, v, do = _large_inputs(b, n, n, h, h_kv, d, dv, dt, seed=3)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, N, H, d) <-> (B, H, N, d)
    band = dict(mask="causal", lo=-(2 * n + 1), hi=0, scale=d ** -0.5)
    with rt.override_config(family="gluon"):
        out = torch.empty(b, n, h, dv, device="cuda", dtype=dt)
        lse = rt.forward(q.detach(), k.detach(), v.detach(), out, bnhd=True, **band)
        rt._backward_plans.clear()
        acc = torch.full((b, n, h, d), 0.5, device="cuda", dtype=torch.float32)
        dk = torch.empty(k.shape, device="cuda", dtype=torch.float32)
        dv_ = torch.empty(v.shape, device="cuda", dtype=torch.float32)
        rt.backward(t(do), t(q.detach()), t(k.detach()), t(v.detach()), t(out), lse, None,
                    t(dk), t(dv_), dq_accum=t(acc), **band)
        assert _bwd_plan_kinds(large_pkg) == {"gluon"}
    refs = _reference(q, k, v, do, True, (-1, -1))
    _assert_large_grads((acc - 0.5, dk, dv_), refs, dt)


@pytest.mark.gpu
@pytest.mark.parametrize("switch", [False, True], ids=["default-tl", "switched-on"])
def test_large_head_dim_backward_default_follows_the_switch(large_pkg, monkeypatch, switch):
    """Untuned, a large call's backward runs the Gluon kernel, right, unless
    families.GLUON_BWD_LARGE_DEFAULT is off (FLASHGEN_GLUON_BWD_LARGE=0): then `tl`."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    rt = large_pkg._runtime
    monkeypatch.setattr(rt._families, "GLUON_BWD_LARGE_DEFAULT", switch)
    rt._configs.clear()
    rt._backward_plans.clear()
    try:
        q, k, v, do = _large_inputs(1, 2048, 2048, 8, 2, 256, 256, torch.bfloat16, seed=5)
        pkg = large_pkg
        pkg.flash_attn_func(q, k, v, causal=True).backward(do)
        assert _bwd_plan_kinds(pkg) == ({"gluon"} if switch else {"tl"})
        _assert_large_grads((q.grad, k.grad, v.grad), _reference(q, k, v, do, True, (-1, -1)),
                            torch.bfloat16)
    finally:
        rt._configs.clear()
        rt._backward_plans.clear()
