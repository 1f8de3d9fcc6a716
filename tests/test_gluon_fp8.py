"""The Gluon fp8 forward (issue 50; templates/gluon/fwd.py.j2 with `fp8`): e4m3 Q K^T and
P V wgmmas, P scaled by 2^8 and packed four keys a register, V read from a keys-major copy
(`_fp8.keys_major_v`) whose keys are reordered within every 16 as the kernel relabels P's.

On the CPU: which fp8 variants get the kernel, that the bf16 kernels render as before, the
tile arithmetic, the opt-in switch, and the keys-major copy (a `tl` kernel: the
interpreter runs it). Slow: the kernels compile for sm_90 into the design (QGMMA e4m3 in
both forms, no spill). On the GPU (-m gpu, Hopper): against float64 on the dequantized
inputs, with tests/test_fp8.py's tolerance -- the output's RMSE at most FWD_FACTOR (16) x
the bf16 kernel's on the same inputs (e4m3 keeps 2^-4 of P where bf16 keeps 2^-8), the LSE
within the e4m3 wgmma's summing error (_lse_bound) -- at odd shapes, GQA, causal, every knob; the
backward on its LSE; CUDA graphs.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from packages import build_and_import, gluon_compiles
from flashgen import families
from test_fp8 import BWD_FACTOR, FWD_FACTOR, _dequantized, _reference, _rmse

ROOT = Path(__file__).resolve().parents[1]
FP8 = "fp8_e4m3"


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gluon_fp8"), "fg_test_gluon_fp8", """
        head_dims: [32, 64, 96, 128]
        dtypes: [bf16, fp8_e4m3]
        masks: [none, causal]
        dropout: true
        gqa: true
        """)


# ---------------------------------------------------------------------------------------
# which variants, the bf16 kernels unchanged, tiles, the switch
# ---------------------------------------------------------------------------------------
def test_fp8_forwards_without_dropout_have_gluon_kernels(pkg):
    reasons = pkg._registry.GLUON
    kernels = Path(pkg.__file__).parent / "kernels" / "gluon"
    for d in (64, 96, 128):
        for mask in ("", "causal_"):
            assert reasons[f"fwd_{mask}d{d}_{FP8}"] is None
            assert (kernels / f"fwd_{mask}d{d}_{FP8}.py").exists()
            assert "backward upcasts" in reasons[f"bwd_{mask}d{d}_{FP8}"]
            assert "with dropout" in reasons[f"fwd_{mask}dropout_d{d}_{FP8}"]
    assert "built for 64, 96, 128" in reasons[f"fwd_d32_{FP8}"]
    text = (kernels / f"fwd_d128_{FP8}.py").read_text()
    assert "instr_shape=[16, BLOCK_N, 32]" in text and "k_width=4" in text
    assert "def _p_pack_fp8(p):" in text and "DESCALE," in text


def test_bf16_gluon_kernels_render_as_without_fp8(tmp_path):
    """The fp8 code is rendered for fp8 variants alone: a bf16 Gluon forward's text is the
    same whether the spec has fp8 or not (but for the header's spec sha)."""
    from flashgen.render import render_gluon_kernel
    from flashgen.spec import load_spec
    from flashgen.variants import variants_for

    texts = []
    for dtypes in ("[bf16]", "[bf16, fp8_e4m3]"):
        path = tmp_path / f"s{len(texts)}.yaml"
        path.write_text(f"package: p\nhead_dims: [64, 128]\ndtypes: {dtypes}\n"
                        "masks: [none, causal]\ngpu: {name: H100, sram_bytes: 232448}\n")
        spec = load_spec(path)
        texts.append({v.name: render_gluon_kernel(spec, v).split("\n", 1)[1]
                      for v in variants_for(spec) if v.kind == "fwd" and v.dtype == "bf16"})
    assert texts[0] == texts[1] and len(texts[0]) >= 4
    assert all("fp8" not in t and "_p_pack_fp8" not in t for t in texts[0].values())


def test_fp8_tiles_and_shared_memory():
    # 128-key blocks, a 4-deep ring (512 keys in flight: FP8_RING_KEYS), two or three consumers
    assert families.fp8_fwd_tile(128) == {"block_n": 128, "num_stages": 4}
    assert families.fp8_fwd_tile(64, 3) == {"block_n": 128, "num_stages": 4}
    # Q and K/V one byte an element, O staged in bf16: d = 128, 4 stages = 176 KiB + 1 KiB
    # (the sm_90 compile: 180,728 bytes)
    assert families.shared_bytes(128, 1, 128, 4) == 16384 + 32768 + 4 * 32768 + 1024
    assert families.shared_bytes(128, 2, 128, 2) == 65536 + 2 * 65536 + 1024  # bf16 as before
    cfg = families.gluon_default(128, "fwd", "none", fp8=True)
    assert (cfg["block_n"], cfg["num_stages"], cfg["block_m"]) == (128, 4, 128)
    assert families.config_reason(cfg, 128, 1, 232448) is None
    assert families.config_reason({**cfg, "q_buffers": 2}, 128, 1, 232448) is None
    # 256-key blocks: over the registers at d = 128 (it spilled), a tuner point at d = 64
    assert "registers" in families.config_reason({**cfg, "block_n": 256, "num_stages": 2},
                                                 128, 1, 232448)
    assert families.config_reason({**cfg, "block_n": 256, "num_stages": 2}, 64, 1, 232448,
                                  (3, 2)) is None
    assert "block_n must be" in families.config_reason({**cfg, "block_n": 256}, 128, 2, 232448)
    three = families.gluon_default(64, "fwd", "none", fp8=True)
    assert (three["block_m"], three["regs"], three["num_stages"]) == (192, "160/24", 4)
    # the variant's own default, as the runtime and gluon_compile read it
    assert families.variant_gluon_default(
        {"kind": "fwd", "mask": "causal", "dropout": False, "head_dim": 128,
         "dtype": FP8}) == {**families.gluon_default(128, "fwd", "causal"), "num_stages": 4,
                            "diag_first": True}  # (in key order the causal loop spills)


def test_gluon_fp8_is_the_default(pkg, monkeypatch):
    """The Gluon fp8 forward serves an untuned fp8 call on Hopper by default; FP8_GLUON off
    (FLASHGEN_FP8_GLUON=0) sends it to `tl` unless the family is asked for; the backward and
    dropout stay `tl`; the bf16 forward's choice is unchanged."""
    plans = pkg._runtime
    monkeypatch.setattr(plans, "gpu_key", lambda device: ("NVIDIA H100|sm90|132sm", 232448, 132))
    monkeypatch.setattr(plans, "gluon_ready", lambda device: None)
    monkeypatch.setattr(plans, "_configs", {})
    cuda = torch.device("cuda", 0)
    assert families.GLUON_FP8_BY_DEFAULT and plans.FP8_GLUON
    cfg = plans.launch_config(f"fwd_d128_{FP8}", cuda, 4096)
    assert cfg["family"] == "gluon" and (cfg["block_n"], cfg["num_stages"]) == (128, 4)
    assert plans.launch_config("fwd_d128_bf16", cuda, 4096)["family"] == "gluon"
    assert plans.launch_config(f"bwd_d128_{FP8}", cuda, 4096).get("family", "tl") == "tl"
    assert plans.launch_config(f"fwd_dropout_d128_{FP8}", cuda, 4096).get("family", "tl") == "tl"
    line = next(ln for ln in pkg.describe().splitlines() if ln.split()[:1] == [f"fwd_d128_{FP8}"])
    assert "gluon 128x128, 4-deep ring" in line and "FP8_GLUON" not in line
    monkeypatch.setattr(plans, "FP8_GLUON", False)
    monkeypatch.setattr(plans, "_configs", {})
    assert plans.launch_config(f"fwd_d128_{FP8}", cuda, 4096).get("family", "tl") == "tl"
    with plans.override_config(family="gluon"):
        assert plans.launch_config(f"fwd_causal_d64_{FP8}", cuda, 4096)["num_stages"] == 4
    line = next(ln for ln in pkg.describe().splitlines() if ln.split()[:1] == [f"fwd_d128_{FP8}"])
    assert "gluon 128x128, 4-deep ring" in line and "FLASHGEN_FP8_GLUON=0" in line


# ---------------------------------------------------------------------------------------
# V's keys-major copy (a `tl` kernel) and the kernel's relabelling of P's keys
# ---------------------------------------------------------------------------------------
def _copy_keys(n_pad):
    """The key each column of the keys-major copy holds (as _fp8.keys_major_v's docstring
    says): column 16g + 4t + 2a + c holds key 16g + 8a + 2t + c."""
    c = torch.arange(n_pad)
    return (c // 16) * 16 + ((c // 2) % 2) * 8 + ((c // 4) % 4) * 2 + c % 2


@pytest.mark.parametrize("bnhd", [True, False], ids=["bnhd", "bhnd"])
@pytest.mark.parametrize("n,d", [(1, 64), (59, 96), (257, 128)])
def test_keys_major_copy(pkg, device, bnhd, n, d):
    torch.manual_seed(n + d)
    x = torch.randn(2, n, 3, d) * 100
    v = (x if bnhd else x.transpose(1, 2)).to(torch.float8_e4m3fn).to(device)
    if not bnhd:  # a strided view, as SDPA's layout passes it
        v = v.transpose(1, 2).contiguous().transpose(1, 2)
    vt = pkg._fp8.keys_major_v(v, bnhd)
    n_pad = -(-n // 16) * 16
    assert vt.shape == (2, 3, d, n_pad) and vt.dtype == torch.float8_e4m3fn and vt.is_contiguous()
    assert pkg._fp8.keys_major_strides(v.shape, bnhd) == vt.stride()[:3]
    keys = _copy_keys(n_pad)
    src = x.transpose(1, 2).to(torch.float8_e4m3fn).view(torch.uint8)  # (B, H, N, d)
    want = torch.zeros(2, 3, d, n_pad, dtype=torch.uint8)
    want[..., keys < n] = src[:, :, keys[keys < n], :].transpose(-1, -2)
    assert torch.equal(vt.view(torch.uint8).cpu(), want)  # bytes: zeros past N


def test_relabelled_p_times_the_copy_is_p_v(pkg):
    """The kernel's relabelling of P's keys (_p_pack_fp8's reshape and permute, as rendered)
    and the copy's column order agree: P' V' = P V."""
    text = (Path(pkg.__file__).parent / "kernels" / "gluon" / f"fwd_d128_{FP8}.py").read_text()
    assert "p = gl.permute(gl.reshape(p, [rows, cols // 16, 2, 4, 2]), (0, 1, 3, 2, 4))" in text
    torch.manual_seed(0)
    n, d = 59, 64
    p = torch.rand(64, n, dtype=torch.float64)
    v = torch.randn(1, n, 2, d).to(torch.float8_e4m3fn)  # (B, N, H_kv, d)
    vt = pkg._fp8.keys_major_v(v, True)[0, 0].double()  # [d, n_pad] of head 0
    n_pad = vt.shape[-1]
    pp = torch.nn.functional.pad(p, (0, n_pad - n))
    pp = pp.reshape(64, n_pad // 16, 2, 4, 2).permute(0, 1, 3, 2, 4).reshape(64, n_pad)
    torch.testing.assert_close(pp @ vt.T, p @ v[0, :, 0].double(), rtol=1e-12, atol=1e-9)


# ---------------------------------------------------------------------------------------
# the offline sm_90 compile (slow: a few seconds a kernel)
# ---------------------------------------------------------------------------------------
_COMPILE = r"""
import json, sys
from pathlib import Path
from flashgen import gluon_compile, families
configs = json.loads(sys.argv[2]) or None
res = gluon_compile.compile_package(Path(sys.argv[1]), configs=configs,
                                    variants=sys.argv[3].split(","))
print(json.dumps([r.__dict__ for r in res]))
"""


def _compile(package_dir, configs, variants):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(package_dir), json.dumps(configs),
                          ",".join(variants)], capture_output=True, text=True, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not gluon_compiles(), reason="the Gluon templates are verified on Triton 3.6")
def test_gluon_fp8_forward_compiles_to_the_design(pkg):
    """d = 64 and 128, causal and not, each variant's own default (d = 64 unmasked: three
    consumers at 160 registers) and the tile-boundary knobs: e4m3 wgmmas for both
    products (QGMMA ... E4M3.E4M3, S = Q K^T from shared memory, P V with P from
    registers), no spill in the key loop, ptxas keeps every wgmma asynchronous, shared
    memory within families.shared_bytes' estimate and the H100's budget."""
    names = [f"fwd_d128_{FP8}", f"fwd_causal_d128_{FP8}", f"fwd_d64_{FP8}",
             f"fwd_causal_d64_{FP8}"]
    base = {**families.GLUON_DEFAULT, "kind": "fwd"}
    knobs = {**base, "num_stages": 2, "q_buffers": 2, "overlap": True, "diag_first": True}
    no_pp = {**base, "block_n": 64, "num_stages": 4, "pingpong": False, "poly_exp2": 8}
    rows = (_compile(Path(pkg.__file__).parent, None, names)
            + _compile(Path(pkg.__file__).parent, [knobs, no_pp], names))
    assert len(rows) == 3 * len(names)
    for r in rows:
        d = int(r["variant"].split("_d")[1].split("_")[0])
        qk = f"QGMMA.64x{r['config'].split('x')[1].split()[0]}x32.F32.E4M3.E4M3 SS"
        assert qk in r["gmma_forms"], r
        assert f"QGMMA.64x{d}x32.F32.E4M3.E4M3 RS" in r["gmma_forms"], r
        assert not any(f.startswith("HGMMA") for f in r["gmma_forms"]), r
        assert r["loop_spills"] == 0 and not r["wgmma_notes"], r
        # (a few bytes outside the key loop: causal d = 128 with overlap spills 24, its
        # last tile's output carried across the tile boundary beside P V's own accumulator)
        assert r["spill_bytes"] <= 32, r
        three = r["config"].startswith("192")
        assert (160 if three else 240) in r["setmaxnreg"] and 24 in r["setmaxnreg"], r
        stages = int(r["config"].split(" s")[1].split()[0])
        bn = int(r["config"].split("x")[1].split()[0])
        est = families.shared_bytes(d, 1, bn, stages, 2 if " q2" in r["config"] else 1,
                                    3 if three else 2)
        assert r["shared"] <= est <= 232448, r


# ---------------------------------------------------------------------------------------
# on the GPU: against float64 on the dequantized inputs
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _plan_families(pkg):
    return {type(p[0].fn).__name__ for p in pkg._runtime._forward_plans.values()
            if p[0] is not None}


def _fp8_inputs(pkg, src, per, hkv):
    q8, qd = pkg.quantize_fp8(src[0], per, kv_heads=hkv)
    (k8, kd), (v8, vd) = (pkg.quantize_fp8(t, per) for t in src[1:])
    return (q8, k8, v8), dict(q_descale=qd, k_descale=kd, v_descale=vd)


def _lse_bound(q, k, v, causal):
    """How far the fp8 kernel's LSE may be from float64's, per row. Hopper's e4m3 wgmma
    does not keep fp32 sums: each 32-wide step aligns its products to the largest one's
    exponent and keeps about 13 bits (DeepSeek-V3's report, 3.3.2, measured ~14), so S_j
    is off by a few 2^-13 of A_j = scale * sum_i |q_i k_ji|, and coherently so when the
    products share a sign (test_gluon_fp8_keeps_small_probabilities: 2^-10.6 of it, on
    the GPU). The LSE moves by the softmax average of those errors: 2^-9 sum_j p_j A_j,
    plus 1e-4 for the rest of the kernel (the `tl` fp8 kernel, which widens to bf16 and
    sums in fp32, is held to 1e-4 alone in tests/test_fp8.py)."""
    g = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(g, 2)
    scale = q.shape[-1] ** -0.5
    s = torch.einsum("bnhd,bmhd->bhnm", q, k) * scale
    a = torch.einsum("bnhd,bmhd->bhnm", q.abs(), k.abs()) * scale
    if causal:
        n_q, n_k = q.shape[1], k.shape[1]
        keep = torch.ones(n_q, n_k, dtype=torch.bool, device=q.device).tril(n_k - n_q)
        s = s.masked_fill(~keep, float("-inf"))
    p = torch.nan_to_num(s.softmax(-1))  # (rows that see no key: no bound needed)
    return 1e-4 + 2.0 ** -9 * (p * a).sum(-1)


def _check_fp8(pkg, src, per, causal):
    """The fp8 call on quantize_fp8's copies of the bf16-free `src` (q, k, v), in whatever
    family the caller forces, against float64 on the dequantized inputs: no NaN, the LSE
    within _lse_bound (-inf exactly where a row sees no key, whose output is 0). Returns (out,
    the reference, the dequantized inputs, their bf16 copies: the yardstick's inputs)."""
    hkv = src[1].shape[2]
    (q8, k8, v8), ds = _fp8_inputs(pkg, src, per, hkv)
    out, lse = pkg.flash_attn_func(q8, k8, v8, causal=causal, return_lse=True, **ds)
    assert out.dtype == torch.bfloat16 and not torch.isnan(out).any()
    deq = [_dequantized(x, ds[f"{n}_descale"]) for x, n in zip((q8, k8, v8), "qkv")]
    ref, ref_lse = _reference(*deq, causal)
    ref = torch.nan_to_num(ref)  # (a row that sees no key: softmax's 0/0; its output is 0)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), seen)
    if seen.any():
        err = (lse.double() - ref_lse).abs()
        assert (err <= _lse_bound(*deq, causal))[seen].all(), err[seen].max().item()
    assert (out.transpose(1, 2)[~seen] == 0).all()
    return out, ref, deq, [x.to(torch.bfloat16) for x in deq]


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, causal, per): N = 1, odd lengths, Nq != Nk both ways (rows
    # that see no key), GQA 4:1 and 8:1, d = 96 padded to 128, many tiles and rounds
    (2, 1, 1, 4, 1, 128, False, "tensor"),
    (3, 59, 59, 4, 1, 64, True, "head"),
    (2, 257, 257, 8, 2, 128, True, "head"),
    (2, 257, 1031, 8, 1, 128, True, "tensor"),
    (2, 1031, 257, 4, 4, 128, True, "head"),
    (1, 1, 513, 8, 8, 128, True, "tensor"),
    (2, 777, 777, 4, 2, 96, False, "head"),
    (1, 2048, 2048, 16, 16, 64, False, "tensor"),
    (4, 1031, 257, 16, 4, 128, True, "head"),
    (3, 1000, 1000, 8, 2, 128, False, "head"),
], ids=["n1", "odd-gqa4-causal", "257-causal", "nq<nk-gqa8", "nq>nk", "decode-row", "d96",
        "d64-2k", "nq>nk-rounds", "b3-gqa4"])
@pytest.mark.parametrize("knobs", [
    {}, {"num_stages": 2}, {"q_buffers": 2, "overlap": True, "diag_first": True},
    # (block_m 128: the d = 64 unmasked default's 192 rows take 160/24 registers only)
    {"pingpong": False, "block_n": 64, "persistent": False, "regs": "232/40", "block_m": 128},
    {"poly_exp2": 8, "block_m": 128, "regs": "240/24"},
    {"block_m": 192, "regs": "160/24"},  # three consumers (d <= 64 only)
], ids=["default", "s2", "q2-overlap-diag", "bn64-no-pp-grid", "poly8", "three"])
def test_gluon_fp8_forward_against_float64(pkg, poison, case, knobs):
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only; other GPUs take the tl kernels")
    b, nq, nk, hq, hkv, d, causal, per = case
    if knobs.get("block_m") == 192 and d > 64:
        pytest.skip("three consumers at d <= 64 only (families.fwd_consumer_counts)")
    torch.manual_seed(nq + 3 * nk + d)
    src = [torch.randn(b, n, h, d, device="cuda") for n, h in ((nq, hq), (nk, hkv), (nk, hkv))]
    pkg._runtime._forward_plans.clear()
    with pkg._runtime.override_config(family="gluon", **knobs):
        out, ref, deq, b16 = _check_fp8(pkg, src, per, causal)
        assert _plan_families(pkg) == {"GluonJITFunction"}
    out16 = pkg.flash_attn_func(*b16, causal=causal)
    e8, e16 = _rmse(out, ref), _rmse(out16, ref)
    assert e8 <= FWD_FACTOR * e16 + 1e-6, (e8, e16)
    print(f"{case} {knobs}: rmse {e8:.2e} vs bf16 {e16:.2e} ({e8 / max(e16, 1e-12):.1f}x)")


@pytest.mark.gpu
@pytest.mark.parametrize("case", [(3, 1000, 1000, 8, 2, 128, 7), (3, 59, 300, 4, 1, 64, 5),
                                  (2, 777, 777, 4, 2, 96, 6)], ids=["b3-gqa4", "odd", "d96"])
def test_gluon_fp8_stream_k_against_float64(pkg, poison, monkeypatch, case):
    """Stream-K (an unmasked forward's last rounds dealt by key block, the parts merged
    across programs) with P's 2^8 in both parts' l."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    monkeypatch.setattr(pkg._runtime._families, "STREAM_K_MIN_KEY_BLOCKS", 1)
    b, nq, nk, hq, hkv, d, programs = case
    torch.manual_seed(nq)
    src = [torch.randn(b, n, h, d, device="cuda") for n, h in ((nq, hq), (nk, hkv), (nk, hkv))]
    with pkg._runtime.override_config(family="gluon", programs=programs):
        for _ in range(2):  # the slots' counters are left at 0 for the next launch
            out, ref, _, b16 = _check_fp8(pkg, src, "head", False)
        plans = [p[0] for p in pkg._runtime._forward_plans.values() if p[0] is not None]
        assert plans and all(p.meta["STREAM_K"] for p in plans)
    assert _rmse(out, ref) <= FWD_FACTOR * _rmse(pkg.flash_attn_func(*b16), ref) + 1e-6


@pytest.mark.gpu
def test_gluon_fp8_keeps_small_probabilities(pkg, poison):
    """Rows whose mass is spread over thousands of keys far below the row's largest score:
    every query sees key 0 at a score of 8 and the other 4095 near 0, so their
    probabilities relative to the row max are e^-8 = 3.4e-4, below 2^-10, where e4m3
    rounds to zero; together they hold 58% of the row's mass (V has a mean of 1, so losing
    them from O while l counts them is plain to see). The Gluon kernel rounds 2^8 P
    (e4m3-normal down to 2^-14) and is held to the usual bound; the `tl` fp8 kernel,
    which rounds P itself, is printed beside it."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    torch.manual_seed(5)
    b, n, h, d = 1, 4096, 4, 128
    u = torch.nn.functional.normalize(torch.randn(d, device="cuda"), dim=0)
    q = u * d ** 0.5 + 0.01 * torch.randn(b, n, h, d, device="cuda")
    k = 0.1 * torch.randn(b, n, h, d, device="cuda")
    k[:, 0] = 8 * u
    src = [q, k, torch.randn(b, n, h, d, device="cuda") + 1]
    with pkg._runtime.override_config(family="gluon"):
        out, ref, _, b16 = _check_fp8(pkg, src, "tensor", False)
    e8, e16 = _rmse(out, ref), _rmse(pkg.flash_attn_func(*b16), ref)
    assert e8 <= FWD_FACTOR * e16 + 1e-6, (e8, e16)
    with pkg._runtime.override_config(family="tl"):
        (q8, k8, v8), ds = _fp8_inputs(pkg, src, "tensor", h)
        e_tl = _rmse(pkg.flash_attn_func(q8, k8, v8, **ds), ref)
    print(f"small probabilities: gluon rmse {e8:.2e}, tl {e_tl:.2e}, bf16 {e16:.2e}")


@pytest.mark.gpu
@pytest.mark.parametrize("dequant", ["", "0"])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_on_the_gluon_fp8_forward(pkg, monkeypatch, causal, dequant):
    """The backward (bf16 products: the bf16 Gluon backward on dequantized copies, or with
    FLASHGEN_FP8_BWD_DEQUANT=0 `tl`'s in-kernel upcast) reads the Gluon forward's LSE and
    output: the gradients held as tests/test_fp8.py holds them."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    monkeypatch.setenv("FLASHGEN_FP8_BWD_DEQUANT", dequant)
    monkeypatch.setattr(pkg._fp8, "DEQUANT_MIN_N", 256)  # (the rule's 2048: a test shape)
    torch.manual_seed(11)
    b, n, hq, hkv, d = 2, 300, 8, 2, 128
    src = [torch.randn(b, n, h, d, device="cuda").requires_grad_() for h in (hq, hkv, hkv)]
    with pkg._runtime.override_config(family="gluon"):
        (q8, k8, v8), ds = _fp8_inputs(pkg, src, "head", hkv)
        out = pkg.flash_attn_func(q8, k8, v8, causal=causal, **ds)
        assert "GluonJITFunction" in _plan_families(pkg)
    mask = "causal" if causal else "none"
    assert pkg._fp8._gluon_bf16_backward(q8, k8, v8, mask, 0.0, True) == (dequant != "0")
    deq = [_dequantized(x, ds[f"{nm}_descale"]).requires_grad_() for x, nm in
           zip((q8, k8, v8), "qkv")]
    ref, _ = _reference(*deq, causal)
    do = torch.randn_like(ref)
    ref.backward(do)
    out.backward(do.to(torch.bfloat16))
    b16 = [x.detach().to(torch.bfloat16).requires_grad_() for x in deq]
    pkg.flash_attn_func(*b16, causal=causal).backward(do.to(torch.bfloat16))
    scale = ref.detach().pow(2).mean().sqrt().item()
    for name, s, r, b_ in zip("qkv", src, deq, b16):
        g8, g16 = _rmse(s.grad, r.grad), _rmse(b_.grad, r.grad)
        assert g8 <= BWD_FACTOR * g16 + 2 ** -7 * scale, (name, g8, g16)


@pytest.mark.gpu
def test_gluon_fp8_at_a_training_shape_and_in_a_cuda_graph(pkg, monkeypatch):
    """FP8_GLUON (on by default) sends an untuned training-shape call to the Gluon
    kernel; a captured call (the keys-major copy made inside the graph) replays on fresh
    inputs as eager calls compute them."""
    if not _hopper():
        pytest.skip("the Gluon kernels run on Hopper only")
    monkeypatch.setattr(pkg._runtime, "FP8_GLUON", True)
    pkg._runtime._configs.clear()
    pkg._runtime._forward_plans.clear()
    b, n, h, d = 2, 2048, 16, 128  # 2 x 16 x 2048^2 x 128 x 4: 69 GFLOP, above the size rule
    src = [torch.randn(b, n, h, d, device="cuda") for _ in range(3)]
    (q8, k8, v8), ds = _fp8_inputs(pkg, src, "tensor", h)
    eager = pkg.flash_attn_func(q8, k8, v8, causal=True, **ds)
    assert _plan_families(pkg) == {"GluonJITFunction"}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        pkg.flash_attn_func(q8, k8, v8, causal=True, **ds)  # warm up on the side stream
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = pkg.flash_attn_func(q8, k8, v8, causal=True, **ds)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    fresh = [torch.randn_like(t) for t in src]
    (f8, g8, h8), ds2 = _fp8_inputs(pkg, fresh, "tensor", h)
    for dst, new in zip((q8, k8, v8), (f8, g8, h8)):
        dst.copy_(new)
    for n_, t in ds.items():
        t.copy_(ds2[n_])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, pkg.flash_attn_func(q8, k8, v8, causal=True, **ds))
    monkeypatch.undo()
    pkg._runtime._configs.clear()
    pkg._runtime._forward_plans.clear()
