"""Dropout in the Gluon (Hopper) kernels: the forward, and the backward.

Both kernels' keep mask must be the package's `_dropout.keep_mask` bit for bit: whichever
family ran the forward, the backward regenerates the mask from the same Philox counters.
The forward builds it in its S accumulator's registers; the backward, whose S^T has the
keys as rows, draws the same calls, packs their bits and moves them into S^T's registers
(templates/gluon/bwd.py.j2, "Dropout").

On the CPU: which variants get the kernels, that the dropout code compiles for sm_90 (the
`convert_layout(..., assert_trivial=True)` calls inside are checked at compile time), that
a variant without dropout compiles none of it, and -- the Gluon backward's mask functions
ported to `tl` by text and run in Triton's interpreter -- that the backward's bit
bookkeeping gives `keep_mask` element by element. On the GPU (-m gpu, Hopper): the Gluon
forward's mask against `keep_mask_kernel`; the forward and the backward of either family
against a float64 reference that applies the replayed mask; the Gluon dropout backward
against the `tl` one; and a piece of a call at global positions (Q_POS / KV_POS).
"""
import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import GRAD_TOL, LSE_TOL, OUT_TOL
from flashgen import families
from flashgen.reference import attention_ref, dropout_keep_rate, visible_mask
from packages import build_and_import, gluon_compiles

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("gdrop"), "fg_test_gluon_dropout", """
        head_dims: [64, 96, 128]
        dtypes: [fp16, bf16]
        masks: [none, causal, sliding_window]
        window: {left: 100, right: 0}
        dropout: true
        gqa: true
        """)


def _gluon_dir(pkg):
    return Path(pkg.__file__).parent / "kernels" / "gluon"


# ---------------------------------------------------------------------------------------
# which variants have a Gluon dropout kernel
# ---------------------------------------------------------------------------------------
def test_forward_dropout_variants_get_gluon_kernels(pkg):
    reasons = pkg._registry.GLUON
    fwd_drop = [n for n in reasons if n.startswith("fwd_") and "_dropout_" in n
                and not pkg._registry.VARIANTS[n].get("mods")]
    assert len(fwd_drop) == 3 * 3 * 2  # masks x head dims (64, 96, 128) x dtypes
    assert all(reasons[n] is None for n in fwd_drop), {n: reasons[n] for n in fwd_drop}
    text = (_gluon_dir(pkg) / "fwd_causal_dropout_d128_bf16.py").read_text()
    assert "DROPOUT = gl.constexpr(True)" in text
    plain = (_gluon_dir(pkg) / "fwd_causal_d128_bf16.py").read_text()
    assert "DROPOUT = gl.constexpr(False)" in plain
    # both take the dropout arguments, so the runtime launches both families alike
    for t in (text, plain):
        assert "SEED_LO, SEED_HI, RNG_OFFSET,\n" in t


def test_backward_dropout_variants_get_gluon_kernels(pkg):
    """Every dropout backward of a Gluon head dim and dtype has a Gluon kernel (d=64 too:
    the d <= 64 rule is the forward's), taking the forward's stream and positions; the
    backward without dropout takes neither and carries no Philox code."""
    reasons = pkg._registry.GLUON
    bwd_drop = [n for n in reasons if n.startswith("bwd_") and "_dropout_" in n
                and not pkg._registry.VARIANTS[n].get("mods")]  # (sdpa_mask: a bias tile)
    assert len(bwd_drop) == 3 * 3 * 2
    assert all(reasons[n] is None for n in bwd_drop), {n: reasons[n] for n in bwd_drop}
    text = (_gluon_dir(pkg) / "bwd_causal_dropout_d64_bf16.py").read_text()
    assert "SEED_LO, SEED_HI, RNG_OFFSET, DROP_THRESHOLD, DROP_SCALE,\n" in text
    assert "Q_POS, KV_POS," in text and "def _keep_bits(" in text
    plain = (_gluon_dir(pkg) / "bwd_causal_d64_bf16.py").read_text()
    assert "SEED_LO" not in plain and "_philox" not in plain and "Q_POS" not in plain
    from flashgen import families as fam

    # the Hopper default by the rule of the backward without dropout
    assert fam.gluon_by_default("bwd", True, 128) and fam.gluon_by_default("bwd", True, 96)
    assert fam.gluon_by_default("bwd", True, 64, (), fam.GLUON_BWD_SMALL_D_MIN_N)
    assert not fam.gluon_by_default("bwd", True, 64, (), fam.GLUON_BWD_SMALL_D_MIN_N // 2)
    # the forward: Gluon at d = 128, at d = 64 from GLUON_DROPOUT_FWD_SMALL_D_MIN_N, asked for
    # at 96
    assert fam.gluon_by_default("fwd", True, 128) and not fam.gluon_by_default("fwd", True, 96)
    assert fam.gluon_by_default("fwd", True, 64, (), fam.GLUON_DROPOUT_FWD_SMALL_D_MIN_N)
    assert not fam.gluon_by_default("fwd", True, 64, (), fam.GLUON_DROPOUT_FWD_SMALL_D_MIN_N // 2)


def test_dropout_forward_default_loads_the_next_tiles_q_at_d_over_64(pkg):
    """families.DROPOUT_FWD_KNOBS: the untuned Gluon dropout forward at d = 96/128 takes a
    second Q slot per consumer (measured +2% at causal d=128 N=1k), and that tile still
    fits the H100's shared memory; d=64 and the p=0 forwards keep one slot."""
    v = pkg._registry.VARIANTS
    for name in ("fwd_causal_dropout_d128_bf16", "fwd_dropout_d96_fp16",
                 "fwd_window_dropout_d128_fp16"):
        cfg = families.variant_gluon_default(v[name])
        assert cfg["q_buffers"] == 2, name
        d = v[name]["head_dim"]
        assert families.config_reason(cfg, d, 2, 232448) is None, name
    for name in ("fwd_causal_dropout_d64_bf16", "fwd_causal_d128_bf16", "fwd_d96_fp16"):
        assert families.variant_gluon_default(v[name])["q_buffers"] == 1, name
    assert families.variant_gluon_default(v["bwd_causal_dropout_d128_bf16"]) == \
        families.gluon_default(128, "bwd")


def test_describe_lists_dropout_forwards_as_gluon(pkg):
    text = pkg.describe()
    line = next(ln for ln in text.splitlines() if "fwd_causal_dropout_d128_bf16" in ln)
    assert "gluon" in line and "opt-in" not in line
    line = next(ln for ln in text.splitlines() if "bwd_causal_dropout_d128_bf16" in ln)
    assert "gluon" in line and "opt-in" not in line and "from N" not in line
    line = next(ln for ln in text.splitlines() if "bwd_causal_dropout_d64_bf16" in ln)
    assert "gluon" in line and f"from N >= {families.GLUON_BWD_SMALL_D_MIN_N}" in line


# ---------------------------------------------------------------------------------------
# the Gluon backward's mask bookkeeping, ported to `tl` and run in the interpreter
# ---------------------------------------------------------------------------------------
def _gluon_functions(text, names):
    out = []
    for name in names:
        start = text.index(f"@gluon.jit\ndef {name}(")
        out.append(text[start:text.index("\n\n\n", start)])
    return "\n\n\n".join(out)


def _without(src, head, keep_first):
    """`src` with every `head(...)` call replaced by its first argument (keep_first) or, for
    a keyword argument (`, name=`), removed."""
    while True:
        i = src.find(head)
        if i < 0:
            return src
        k, depth, comma = i + len(head), 1 if keep_first else 0, None
        while True:
            c = src[k]
            if c in "([":
                depth += 1
            elif c in ")]":
                depth -= 1
                if depth <= 0 and (keep_first or depth < 0):
                    break
            elif c == "," and depth == (1 if keep_first else 0):
                if not keep_first:
                    break
                comma = comma if comma is not None else k
            k += 1
        if keep_first:
            src = src[:i] + src[i + len(head):comma if comma is not None else k] + src[k + 1:]
        else:
            src = src[:i] + src[k:]


def _bwd_mask_as_tl(text):
    """The Gluon backward's mask functions as `tl` source: layouts dropped (a `tl` tensor
    has none), convert_layout the identity, the opaque zero a plain one. What is left --
    the Philox calls, the byte compares, the packing, the reshapes and permutes -- is what
    decides which bit lands on which (key, query) element."""
    import re

    src = _gluon_functions(text, ["_philox", "_byte_carries", "_keep_bits", "_to_s", "_kept",
                                  "_keep_bits_split", "_to_s_split", "_kept_split"])
    src = "\n".join(ln for ln in src.splitlines()
                    if not re.match(r"\s+\w+: gl\.constexpr = .*(Layout|_layout)\(", ln))
    src = _without(src, ", layout=", keep_first=False)
    src = _without(src, "gl.convert_layout(", keep_first=True)
    src = src.replace("_opaque_zero(e_layout)", "tl.zeros([DROP_THREADS], tl.uint32)")
    src = src.replace("@gluon.jit", "@triton.jit").replace("gl.", "tl.")
    consts = "\n".join(ln.replace("gl.constexpr", "tl.constexpr") for ln in text.splitlines()
                       if ln.startswith(("PHILOX_", "DROP_THREADS", "SPLIT_N")))
    return consts + "\n\n\n" + src


def test_gluon_backward_mask_bookkeeping_is_keep_mask(pkg, tmp_path):
    """The Gluon backward's _keep_bits / _kept (and the philox_split pair), as `tl` (the
    interpreter on the CPU, the GPU with -m gpu), for both step heights (64 and 128 query
    rows), at positions and seeds of both widths, against keep_mask_kernel over the whole
    call, sliced: element [key, query] of the [64, BLOCK_M] tile must be keep[query, key].
    On Hopper the Gluon kernel itself is checked against float64
    (test_gluon_dropout_backward_*)."""
    import textwrap

    text = (_gluon_dir(pkg) / "bwd_causal_dropout_d64_bf16.py").read_text()
    path = tmp_path / "_bwd_mask_as_tl.py"  # triton.jit wants a real file
    path.write_text("import triton\nimport triton.language as tl\n" + _bwd_mask_as_tl(text)
                    + textwrap.dedent("""


        @triton.jit
        def mask_t(OUT, SEED_LO, SEED_HI, RNG_OFFSET, N_Q, N_K, DROP_THRESHOLD, Q_POS, KV_POS,
                   BLOCK_M: tl.constexpr, SPLIT: tl.constexpr):
            bh = tl.program_id(2)
            q0 = tl.program_id(0) * BLOCK_M
            k0 = tl.program_id(1) * SPLIT_N
            if SPLIT:
                bits = _keep_bits_split(SEED_LO, SEED_HI, RNG_OFFSET, bh, q0 + Q_POS,
                                        k0 + KV_POS, DROP_THRESHOLD, BLOCK_M)
                words, masks = _kept_split(bits, BLOCK_M, 0)
            else:
                bits = _keep_bits(SEED_LO, SEED_HI, RNG_OFFSET, bh, q0 + Q_POS, k0 + KV_POS,
                                  DROP_THRESHOLD, BLOCK_M)
                words, masks = _kept(bits, BLOCK_M, 0)
            keep = (words & masks) != 0  # [SPLIT_N keys, BLOCK_M queries]
            keys = k0 + tl.arange(0, SPLIT_N)[:, None]
            qs = q0 + tl.arange(0, BLOCK_M)[None, :]
            tl.store(OUT + bh * N_Q * N_K + qs * N_K + keys, keep.to(tl.int8),
                     mask=(qs < N_Q) & (keys < N_K))
        """))
    spec = importlib.util.spec_from_file_location("_bwd_mask_as_tl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    drop = importlib.import_module(f"{pkg.__name__}._dropout")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for block_m, split, (seed, stream, p, q_pos, kv_pos) in [
            (64, False, (0, 0, 0.1, 0, 0)), (128, False, (2**40 + 3, 2**31 + 9, 0.5, 32, 64)),
            (64, False, (2**62 + 11, 0xFFFFFFFF, 1 / 512, 16, 96)),
            (128, False, (5, 3, 0.9, 0, 0)), (64, True, (7, 1, 0.3, 48, 32)),
            (128, True, (2**40 + 3, 2**31 + 9, 0.5, 32, 64))]:
        bh, n_q, n_k = 2, 150, 100  # ragged in both directions
        thresh = drop.threshold(p)
        full = torch.zeros((bh, q_pos + n_q, kv_pos + n_k), dtype=torch.int8, device=device)
        drop.keep_mask_kernel[(-(-(q_pos + n_q) // 64), -(-(kv_pos + n_k) // 64), bh)](
            full, seed, stream, q_pos + n_q, kv_pos + n_k, thresh, BLOCK_M=64, BLOCK_N=64)
        want = full[:, q_pos:, kv_pos:]
        got = torch.full((bh, n_q, n_k), -1, dtype=torch.int8, device=device)
        lo, hi, stream32, thresh32, _ = pkg._runtime._gluon_dropout_args(
            (seed, stream, thresh, 1.0))
        mod.mask_t[(-(-n_q // block_m), -(-n_k // 64), bh)](
            got, lo, hi, stream32, n_q, n_k, thresh32, q_pos, kv_pos, BLOCK_M=block_m,
            SPLIT=split)
        assert torch.equal(got, want), (block_m, split, seed, p, int((got != want).sum()))


def test_gluon_philox_with_a_split_seed_is_tl_philox(pkg):
    """The Gluon forward's Philox rounds, under the seed halves the runtime passes
    (`_gluon_dropout_args`: int32 bits of the low and high words), give tl.philox's words
    at the package's round count (the template's PHILOX_ROUNDS, also checked here to be
    flashgen's).
    Gluon does not run in the interpreter, so the template's `_philox` is run as a
    triton.jit function there (its body uses only operations both dialects share)."""
    import textwrap

    mod_path = Path(pkg.__file__).parent / "kernels" / "gluon" / "fwd_causal_dropout_d128_bf16.py"
    text = mod_path.read_text()
    start = text.index("@gluon.jit\ndef _philox(")
    source = text[start:text.index("\n\n\n", start)]
    source = source.replace("@gluon.jit", "@triton.jit").replace("gl.", "tl.")
    constants = "\n".join(ln for ln in text.splitlines() if ln.startswith("PHILOX_"))
    assert f"PHILOX_ROUNDS = gl.constexpr({families.PHILOX_ROUNDS})" in constants
    path = Path(pkg.__file__).parent / "_philox_as_tl.py"  # triton.jit wants a real file
    path.write_text("import triton\nimport triton.language as tl\n"
                    + constants.replace("gl.constexpr", "tl.constexpr")
                    + "\n\n\n" + source + textwrap.dedent("""


        @triton.jit
        def both(OUT, SEED, SEED_LO, SEED_HI, N: tl.constexpr):
            i = tl.arange(0, N)
            c0 = (i * 1000003 + 12345).to(tl.uint32)
            c1 = (i * 40503 + 7).to(tl.uint32)
            c2 = (i % 5).to(tl.uint32)
            c3 = (i * 97).to(tl.uint32)
            a0, a1, a2, a3 = tl.philox(SEED, c0, c1, c2, c3, PHILOX_ROUNDS)
            b0, b1, b2, b3 = _philox(SEED_LO.to(tl.uint32), SEED_HI.to(tl.uint32), c0, c1, c2, c3)
            same = (a0 == b0) & (a1 == b1) & (a2 == b2) & (a3 == b3)
            tl.store(OUT + i, same.to(tl.int8))
        """))
    spec = importlib.util.spec_from_file_location("_philox_as_tl", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for seed in (0, 12345, 2**31 + 5, 2**40 + 3, 2**62 + 11, (1 << 63) - 1):
        lo, hi, _, _, _ = pkg._runtime._gluon_dropout_args((seed, 0, 0, 1.0))
        assert -2**31 <= lo < 2**31 and -2**31 <= hi < 2**31
        out = torch.zeros(64, dtype=torch.int8, device="cuda" if torch.cuda.is_available() else "cpu")
        mod.both[(1,)](out, seed, lo, hi, N=64)
        assert bool(out.all()), f"seed {seed}: {int((out == 0).sum())} of 64 calls differ"


# ---------------------------------------------------------------------------------------
# compiled for sm_90: the mask needs no data movement, and p=0 carries no dropout code
# ---------------------------------------------------------------------------------------
_COMPILE = r"""
import json, sys, importlib
from pathlib import Path
from flashgen import gluon_compile, families
pkg_dir = Path(sys.argv[1])
sys.path.insert(0, str(pkg_dir.parent))
out = []
registry = importlib.import_module(f"{pkg_dir.name}._registry")
for name, knobs in json.loads(sys.argv[2]):
    mod = importlib.import_module(f"{pkg_dir.name}.kernels.gluon.{name}")
    facts = registry.VARIANTS[name]
    base = families.variant_gluon_default(facts)  # what the package launches untuned
    res = gluon_compile.compile_variant(mod, name, facts["head_dim"], facts["dtype"],
                                        dict(base, **knobs))
    out.append(res.__dict__)
print(json.dumps(out))
"""


needs_gluon_triton = pytest.mark.skipif(
    not gluon_compiles(),
    reason="the Gluon templates are verified on Triton 3.6 (CI pins it)")


def _compile(pkg, cases):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE, str(Path(pkg.__file__).parent),
                          json.dumps(cases)], capture_output=True, text=True, env=env,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@needs_gluon_triton
def test_dropout_kernels_compile_for_sm90(pkg):
    """Default tiles and the other key-block width (the mask's layout depends on BLOCK_N);
    `_dropped_p` asserts at compile time that its layout conversion moves nothing."""
    knobs = {"block_n": 64, "num_stages": 3, "pingpong": False, "regs": "232/40"}
    rows = _compile(pkg, [["fwd_causal_dropout_d128_bf16", {}],
                          ["fwd_window_dropout_d96_fp16", knobs],
                          ["fwd_dropout_d128_fp16", {}]])
    for r in rows:
        assert r["wgmma"] > 0 and r["shared"] <= 232448, r
        assert families.PRODUCER_REGS in r["setmaxnreg"] or 40 in r["setmaxnreg"], r
        # ptxas keeps tile-level scalars on the stack (the p=0 kernels: 0-112 bytes); the
        # dropout forward adds a few words, not the mask (32 words a block would be 128
        # bytes a thread in the key loop)
        assert r["spill_bytes"] <= 320, r


@needs_gluon_triton
def test_dropout_backward_kernels_compile_for_sm90(pkg):
    """The Gluon dropout backward at its default steps (d=64: 128 query rows, d=96/128: 64)
    and at 64-row steps at d=64 with the other register split, and with philox_split:
    `_kept`'s convert_layout asserts at compile time that the unpacked bits sit where S^T
    holds their elements, and the Philox rounds fit beside the step's accumulators
    (offline, Triton 3.6: stack frames of 40-88 bytes against 8-64 for the backward
    without dropout)."""
    rows = _compile(pkg, [["bwd_causal_dropout_d128_bf16", {}],
                          ["bwd_dropout_d64_fp16", {}],
                          ["bwd_window_dropout_d96_bf16", {}],
                          ["bwd_causal_dropout_d64_bf16", {"block_m": 64, "regs": "232/40"}],
                          ["bwd_causal_dropout_d128_fp16", {"philox_split": True}],
                          ["bwd_dropout_d64_bf16", {"philox_split": True}]])
    for r in rows:
        assert r["wgmma"] > 0 and r["shared"] <= 232448, r
        assert families.PRODUCER_REGS in r["setmaxnreg"] or 40 in r["setmaxnreg"], r
        assert r["spill_bytes"] <= 192, r


@needs_gluon_triton
def test_p0_kernel_compiles_no_philox(pkg):
    """DROPOUT=False removes every trace of the generator: no Philox constant in the PTX."""
    code = r"""
import sys, importlib
from pathlib import Path
import triton
from flashgen import gluon_compile, families
pkg_dir = Path(sys.argv[1]); sys.path.insert(0, str(pkg_dir.parent))
seen = {}
real = triton.compile
def spy(*a, **k):
    c = real(*a, **k); seen["ptx"] = c.asm["ptx"]; return c
triton.compile = spy
for name in ("fwd_causal_d128_bf16", "fwd_causal_dropout_d128_bf16"):
    mod = importlib.import_module(f"{pkg_dir.name}.kernels.gluon.{name}")
    gluon_compile.compile_variant(mod, name, 128, "bf16", families.GLUON_DEFAULT)
    # the Philox round multiplier 0xD2511F53, as PTX writes the immediate (signed 32-bit)
    print(name, str(0xD2511F53 - (1 << 32)) in seen["ptx"] or str(0xD2511F53) in seen["ptx"])
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code, str(Path(pkg.__file__).parent)],
                         capture_output=True, text=True, env=env, cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-4000:]
    found = dict(ln.split() for ln in out.stdout.strip().splitlines()[-2:])
    assert found == {"fwd_causal_d128_bf16": "False", "fwd_causal_dropout_d128_bf16": "True"}


# ---------------------------------------------------------------------------------------
# on the GPU: the mask bit for bit, and the forward (+ the `tl` backward) against float64
# ---------------------------------------------------------------------------------------
def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_hopper = pytest.mark.skipif(not _hopper(), reason="the Gluon kernels run on Hopper only")


_words = _keep = None  # the generated forward module's mask functions (_gluon_mask_kernel)
_MASK_KERNEL = []


def _gluon_mask_kernel(mod):
    """A Gluon kernel writing the keep mask the forward module `mod` builds, tile by tile,
    in the S accumulator's layout ([64, BLOCK_N] per program, 4 warps)."""
    global _words, _keep
    if _MASK_KERNEL:
        return _MASK_KERNEL[0]
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    _words, _keep = mod._dropout_words, mod._dropped_p

    # like the forward kernel: a threshold of 1 (p = 1/512) must stay a run-time value, not
    # an int Triton specialises into a constant
    @gluon.jit(do_not_specialize=["SEED_LO", "SEED_HI", "RNG_OFFSET", "DROP_THRESHOLD"])
    def mask_kernel(OUT, SEED_LO, SEED_HI, RNG_OFFSET, N_Q, N_K, DROP_THRESHOLD,
                    BLOCK_N: gl.constexpr, FP16: gl.constexpr):
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        bh = gl.program_id(2)
        row0 = gl.program_id(0) * 64
        col0 = gl.program_id(1) * BLOCK_N
        w0, w1, w2, w3 = _words(SEED_LO, SEED_HI, RNG_OFFSET, bh, row0, col0, 64, BLOCK_N)
        rows = gl.expand_dims(row0 + gl.arange(0, 64, layout=gl.SliceLayout(1, s_layout)), 1)
        cols = gl.expand_dims(col0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout)), 0)
        # a P whose values name their columns (exact in fp16 and bf16), so that an element
        # moved within its pair or quad shows
        vals = gl.zeros([64, BLOCK_N], gl.float32, s_layout) + (cols % 128 + 1).to(gl.float32)
        if FP16:
            out = _keep(vals, w0, w1, w2, w3, DROP_THRESHOLD, s_layout, gl.float16).to(gl.float32)
        else:
            out = _keep(vals, w0, w1, w2, w3, DROP_THRESHOLD, s_layout, gl.bfloat16).to(gl.float32)
        # 1 kept with its value, 0 dropped, 2 anything else
        kept = gl.where(out == vals, 1, gl.where(out == 0.0, 0, 2))
        gl.store(OUT + bh.to(gl.int64) * N_Q * N_K + rows * N_K + cols, kept.to(gl.int8),
                 mask=(rows < N_Q) & (cols < N_K))

    _MASK_KERNEL.append(mask_kernel)
    return mask_kernel


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("block_n", [64, 128])
@pytest.mark.parametrize("fp16", [False, True], ids=["bf16", "fp16"])
@pytest.mark.parametrize("seed,stream,p", [(0, 0, 0.1), (12345, 7, 0.5), (2**40 + 3, 2**31 + 9, 0.2),
                                           (2**62 + 11, 0xFFFFFFFF, 0.9), (5, 3, 1 / 512),
                                           (6, 4, 0.999)],
                         ids=["s0", "s12345", "seed64-stream32", "seed62-streammax", "p1/512",
                              "p0.999"])
def test_gluon_mask_is_keep_mask_bit_for_bit(pkg, block_n, fp16, seed, stream, p):
    """The forward's mask as it lands in P (`_dropped_p`: PRMT, a packed fp16 compare and an
    AND per element pair) against keep_mask_kernel, at thresholds 1 to 255."""
    drop = importlib.import_module(f"{pkg.__name__}._dropout")
    mod = importlib.import_module(f"{pkg.__name__}.kernels.gluon.fwd_causal_dropout_d128_bf16")
    bh, n_q, n_k = 6, 200, 333  # ragged in both directions, several tiles and heads
    thresh = drop.threshold(p)
    want = torch.empty((bh, n_q, n_k), dtype=torch.int8, device="cuda")
    drop.keep_mask_kernel[(-(-n_q // 64), -(-n_k // 64), bh)](
        want, seed, stream, n_q, n_k, thresh, BLOCK_M=64, BLOCK_N=64)
    got = torch.full_like(want, -1)
    # the arguments as the runtime passes them to a Gluon forward (split seed, int32 bits)
    seed_lo, seed_hi, stream32, thresh32, _ = pkg._runtime._gluon_dropout_args(
        (seed, stream, thresh, 1.0))
    _gluon_mask_kernel(mod)[(-(-n_q // 64), -(-n_k // block_n), bh)](
        got, seed_lo, seed_hi, stream32, n_q, n_k, thresh32, BLOCK_N=block_n, FP16=fp16,
        num_warps=4)
    assert torch.equal(got, want), f"{(got != want).sum().item()} elements differ"
    assert abs(want.float().mean().item() - dropout_keep_rate(p)) < 0.02


def _run(pkg, b, n_q, n_k, h_q, h_kv, d, dtype, p, causal, window, seed, knobs, grads):
    """(got, ref): out and LSE (and dq, dk, dv with grads) of a Gluon forward (+ the `tl`
    backward) and of the float64 reference with the mask the call drew. (The Gluon
    backward has tests of its own below.)"""
    rt = pkg._runtime
    q = torch.randn(b, n_q, h_q, d, device="cuda", dtype=dtype, requires_grad=grads)
    k, v = (torch.randn(b, n_k, h_kv, d, device="cuda", dtype=dtype, requires_grad=grads)
            for _ in range(2))
    do = torch.randn(b, n_q, h_q, d, device="cuda", dtype=dtype)
    rt._forward_plans.clear()
    torch.manual_seed(seed)
    with rt.override_config(family="gluon", **knobs):
        out, lse = pkg.flash_attn_func(q, k, v, dropout_p=p, causal=causal, window_size=window,
                                       return_lse=True)
        kinds = {type(pl[0].fn).__name__ for pl in rt._forward_plans.values() if pl[0] is not None}
        assert kinds == {"GluonJITFunction"}, kinds
    got = [out, lse]
    if grads:  # the `tl` dropout backward behind the Gluon forward
        with rt.override_config(family="tl"):
            out.backward(do)
        got += [q.grad, k.grad, v.grad]
    torch.manual_seed(seed)
    keep = pkg.dropout_mask(b, h_q, n_q, n_k, p, device="cuda")
    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = attention_ref(q64.transpose(1, 2), k64.transpose(1, 2), v64.transpose(1, 2),
                                 vis, keep=keep, dropout_p=p)
    ref = ref.transpose(1, 2)
    want = [ref.detach(), ref_lse.detach()]
    if grads:
        ref.backward(do.double())
        want += [q64.grad, k64.grad, v64.grad]
    return got, want


def _assert_close(got, want, dtype):
    out, lse = got[0], got[1]
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol, rtol = OUT_TOL[dtype]
    torch.testing.assert_close(out.double(), want[0], atol=atol, rtol=rtol,
                               msg=lambda m: f"out: {m}")
    seen = torch.isfinite(want[1])
    assert torch.equal(torch.isfinite(lse), seen)
    torch.testing.assert_close(lse.double()[seen], want[1][seen], atol=LSE_TOL[0],
                               rtol=LSE_TOL[1], msg=lambda m: f"lse: {m}")
    for name, g, w in zip(["dq", "dk", "dv"], got[2:], want[2:]):
        assert not torch.isnan(g).any(), f"NaN in {name}"
        atol, rtol = GRAD_TOL[dtype]
        torch.testing.assert_close(g.double(), w, atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", [
    # (B, Nq, Nk, Hq, Hkv, d, dtype, p, causal, window)
    (1, 1, 1, 2, 2, 96, torch.float16, 0.2, False, (-1, -1)),
    (2, 59, 59, 4, 1, 128, torch.bfloat16, 0.1, True, (-1, -1)),
    (1, 127, 127, 2, 2, 128, torch.float16, 0.3, False, (-1, -1)),
    (2, 257, 1031, 8, 2, 128, torch.bfloat16, 0.1, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 96, torch.float16, 0.1, True, (-1, -1)),
    (1, 777, 777, 4, 2, 96, torch.bfloat16, 0.25, False, (100, 0)),
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, 0.1, True, (-1, -1)),
    (1, 300, 300, 2, 2, 128, torch.float16, 1 / 512, True, (-1, -1)),
    (1, 300, 300, 2, 2, 96, torch.float16, 0.999, False, (-1, -1)),
], ids=["N1", "N59-causal-gqa4", "N127-d128", "nq<nk-causal-gqa4", "nq>nk-d96", "window-d96",
        "causal-b3-gqa4-1k", "p1/512", "p0.999-scale256"])
@pytest.mark.parametrize("knobs", [{}, {"block_n": 64, "num_stages": 3, "pingpong": False,
                                        "persistent": False, "regs": "232/40"},
                                   {"overlap": True, "q_buffers": 2, "diag_first": True}],
                         ids=["default", "knobs", "overlap-diag-first"])
def test_gluon_dropout_forward_and_tl_backward_against_float64(pkg, poison, case, knobs):
    b, n_q, n_k, h_q, h_kv, d, dtype, p, causal, window = case
    got, want = _run(pkg, b, n_q, n_k, h_q, h_kv, d, dtype, p, causal, window, seed=17,
                     knobs=knobs, grads=True)
    _assert_close(got, want, dtype)


@pytest.mark.gpu
@needs_hopper
def test_gluon_dropout_direct_launch_with_seeds_of_both_widths(pkg, poison):
    """Repeated calls of one shape reuse a launch plan that calls the compiled kernel
    directly; Triton compiles a seed below 2**31 as i32 and a larger one as i64, so seeds
    alternating between the two must each get their own plan and the right mask."""
    rt = pkg._runtime
    b, n, h, d, p = 2, 300, 4, 128, 0.15
    q, k, v = (torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    vis = visible_mask(n, n, causal=True, bottom_right=True)
    with rt.override_config(family="gluon"):
        for seed in (3, 2**40 + 5, 11, 2**40 + 7, 3, 2**40 + 5):
            torch.manual_seed(seed)
            out = pkg.flash_attn_func(q, k, v, dropout_p=p, causal=True)
            torch.manual_seed(seed)
            keep = pkg.dropout_mask(b, h, n, n, p, device="cuda")
            ref, _ = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis,
                                   keep=keep, dropout_p=p)
            atol, rtol = OUT_TOL[torch.bfloat16]
            torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=atol, rtol=rtol)
        plans = [pl for pl in rt._forward_plans.values() if pl[0] is not None]
        assert len(plans) == 2 and all(type(pl[0].fn).__name__ == "GluonJITFunction"
                                       for pl in plans)
        assert all(pl[0].compiled is not None for pl in plans), "no direct launch"


# ---------------------------------------------------------------------------------------
# on the GPU: the Gluon dropout backward
# ---------------------------------------------------------------------------------------
def _inputs(b, n_q, n_k, h_q, h_kv, d, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(b, n_q, h_q, d, device="cuda", dtype=dtype, generator=g)
    k, v = (torch.randn(b, n_k, h_kv, d, device="cuda", dtype=dtype, generator=g)
            for _ in range(2))
    do = torch.randn(b, n_q, h_q, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, do


def _backward(pkg, family, q, k, v, do, p, causal, window, seed, knobs=None):
    """([out, dq, dk, dv], the backward plans' kinds): a forward with the package's default
    families from generator state `seed`, then its backward with `family` asked for
    (override_config: a tiny call takes it too). Kind "gluon" is the Gluon kernel."""
    rt = pkg._runtime
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out = pkg.flash_attn_func(*leaves, dropout_p=p, causal=causal, window_size=window)
    rt._backward_plans.clear()
    with rt.override_config(family=family, **(knobs or {})):
        out.backward(do)
        kinds = {pl[7] for pl in rt._backward_plans.values() if pl is not None}
    return [out.detach(), *(t.grad for t in leaves)], kinds


def _reference(pkg, q, k, v, do, p, causal, window, seed):
    """[out, dq, dk, dv] in float64 with the keep mask a call from generator state `seed`
    draws (`dropout_mask` replays it)."""
    b, n_q, h_q, _ = q.shape
    n_k = k.shape[1]
    torch.manual_seed(seed)
    keep = pkg.dropout_mask(b, h_q, n_q, n_k, p, device="cuda")
    vis = visible_mask(n_q, n_k, causal=causal, window=window, bottom_right=True)
    q64, k64, v64 = (t.detach().double().transpose(1, 2).requires_grad_() for t in (q, k, v))
    ref, _ = attention_ref(q64, k64, v64, vis, keep=keep, dropout_p=p)
    ref.backward(do.double().transpose(1, 2))
    return [t.transpose(1, 2) for t in (ref.detach(), q64.grad, k64.grad, v64.grad)]


def _assert_grads(got, want, dtype, what=""):
    for name, g, w in zip(["out", "dq", "dk", "dv"], got, want):
        assert not torch.isnan(g).any(), f"{what}NaN in {name}"
        atol, rtol = (OUT_TOL if name == "out" else GRAD_TOL)[dtype]
        torch.testing.assert_close(g.double(), w.double(), atol=atol, rtol=rtol,
                                   msg=lambda m, name=name: f"{what}{name}: {m}")


BWD_CASES = [
    # (B, Nq, Nk, Hq, Hkv, d, dtype, p, causal, window)
    (1, 1, 1, 2, 2, 64, torch.float16, 0.2, False, (-1, -1)),
    (1, 1, 1, 2, 2, 128, torch.bfloat16, 0.2, True, (-1, -1)),
    (2, 59, 59, 4, 1, 128, torch.bfloat16, 0.1, True, (-1, -1)),
    (2, 59, 59, 4, 1, 64, torch.float16, 0.3, False, (-1, -1)),
    (1, 257, 257, 2, 2, 64, torch.bfloat16, 0.3, False, (-1, -1)),
    (1, 257, 257, 4, 1, 128, torch.float16, 0.2, True, (-1, -1)),
    (2, 257, 1031, 8, 2, 128, torch.bfloat16, 0.1, True, (-1, -1)),
    (2, 1031, 257, 4, 4, 64, torch.float16, 0.1, True, (-1, -1)),
    (2, 1031, 257, 4, 2, 128, torch.bfloat16, 0.15, False, (-1, -1)),
    (1, 777, 777, 4, 2, 128, torch.bfloat16, 0.25, False, (100, 0)),
    (1, 513, 700, 4, 1, 64, torch.float16, 0.2, False, (64, 16)),
    (3, 1000, 1000, 8, 2, 128, torch.bfloat16, 0.1, True, (-1, -1)),
    (3, 600, 600, 8, 2, 64, torch.bfloat16, 0.1, True, (-1, -1)),
    (1, 256, 256, 2, 2, 96, torch.bfloat16, 0.2, True, (-1, -1)),
    (1, 300, 300, 2, 2, 128, torch.float16, 1 / 512, True, (-1, -1)),
    (1, 300, 300, 2, 2, 64, torch.float16, 0.999, False, (-1, -1)),
]
BWD_IDS = ["N1-d64", "N1-d128-causal", "N59-causal-gqa4", "N59-d64-gqa4", "N257-d64",
           "N257-causal-gqa4", "nq<nk-causal-gqa4", "nq>nk-d64-causal", "nq>nk-d128",
           "window-d128", "window-d64-nq<nk", "causal-b3-gqa4-1k", "causal-b3-gqa4-d64",
           "d96", "p1/512", "p0.999-scale256"]


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", BWD_CASES, ids=BWD_IDS)
@pytest.mark.parametrize("knobs", [{}, {"block_m": 64, "num_stages": 2, "regs": "232/40"}],
                         ids=["default", "64-row-steps"])
def test_gluon_dropout_backward_against_float64(pkg, poison, case, knobs):
    """The Gluon dropout backward (forced: these calls are small) against float64 with the
    replayed mask, at its default steps (d=64: 128 query rows; d=96/128: 64) and at 64-row
    steps with the other register split (d=64's other BLOCK_M)."""
    b, n_q, n_k, h_q, h_kv, d, dtype, p, causal, window = case
    q, k, v, do = _inputs(b, n_q, n_k, h_q, h_kv, d, dtype, seed=n_q + d)
    got, kinds = _backward(pkg, "gluon", q, k, v, do, p, causal, window, seed=17, knobs=knobs)
    assert kinds == {"gluon"}, kinds
    _assert_grads(got, _reference(pkg, q, k, v, do, p, causal, window, seed=17), dtype)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("case", [BWD_CASES[i] for i in (2, 6, 7, 9, 11, 12)],
                         ids=[BWD_IDS[i] for i in (2, 6, 7, 9, 11, 12)])
def test_gluon_dropout_backward_agrees_with_tl(pkg, case):
    """The two families' dropout backwards behind one forward, from one generator state:
    the same mask, so the same gradients up to summation order and rounding (dQ's fp32
    reduce-adds run in no fixed order; bit-equality is not expected)."""
    b, n_q, n_k, h_q, h_kv, d, dtype, p, causal, window = case
    q, k, v, do = _inputs(b, n_q, n_k, h_q, h_kv, d, dtype, seed=3)
    gluon, kinds = _backward(pkg, "gluon", q, k, v, do, p, causal, window, seed=29)
    assert kinds == {"gluon"}, kinds
    tl, kinds = _backward(pkg, "tl", q, k, v, do, p, causal, window, seed=29)
    assert "gluon" not in kinds, kinds
    assert torch.equal(gluon[0], tl[0])  # one forward: the same output
    _assert_grads(gluon, tl, dtype, "gluon vs tl: ")
    # and not by accident: a different seed drops other elements
    other, _ = _backward(pkg, "gluon", q, k, v, do, p, causal, window, seed=30)
    assert (other[3].double() - tl[3].double()).abs().max() > GRAD_TOL[dtype][0]


@pytest.mark.gpu
@needs_hopper
def test_gluon_dropout_backward_is_the_default_at_d128(pkg):
    """Untuned, on Hopper, a dropout backward at d=128 of enough work (past
    GLUON_MIN_FLOPS) runs the Gluon kernel (families.gluon_by_default)."""
    rt = pkg._runtime
    q, k, v, do = _inputs(2, 2048, 2048, 8, 8, 128, torch.bfloat16, seed=5)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    rt._backward_plans.clear()
    torch.manual_seed(11)
    out = pkg.flash_attn_func(*leaves, dropout_p=0.1, causal=True)
    out.backward(do)
    assert {pl[7] for pl in rt._backward_plans.values() if pl is not None} == {"gluon"}


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("accumulate", [False, True], ids=["dq", "dq_accum"])
def test_gluon_dropout_backward_piece_at_global_positions(pkg, d, accumulate):
    """A context-parallel piece's launch: queries [a, a + m) against keys [c, c + kn) of a
    larger call, at pos=(a, c) (the kernel's Q_POS / KV_POS), must drop what the whole call
    drops there (keep_mask_kernel over the full call, sliced) -- with dq written, or added
    into an fp32 sum as the ring backward does (dq_accum). The same launch at pos=(0, 0)
    drops other elements."""
    rt = pkg._runtime
    drop = rt._dropout()
    b, h, h_kv, n, p = 2, 4, 2, 640, 0.3
    a, m, c, kn = 80, 300, 160, 400  # a on a 16-row block, c on a 32-column block
    dtype = torch.bfloat16
    q, k, v, do = _inputs(b, m, kn, h, h_kv, d, dtype, seed=d)
    rng = torch.tensor([2**40 + 1234, 56])
    seed, stream, thresh, _ = drop.launch_args(rng, p)
    full = torch.empty(b * h, n, n, dtype=torch.int8, device="cuda")
    drop.keep_mask_kernel[(n // 64, n // 64, b * h)](full, seed, stream, n, n, thresh,
                                                     BLOCK_M=64, BLOCK_N=64)
    keep = full.view(b, h, n, n).bool()[:, :, a:a + m, c:c + kn]
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, N, H, d) <-> (B, H, N, d)
    rq, rk, rv = (t(x).double().requires_grad_() for x in (q, k, v))
    ref, _ = attention_ref(rq, rk, rv, torch.ones(m, kn, dtype=torch.bool, device="cuda"),
                           keep=keep, dropout_p=p)
    ref.backward(t(do).double())
    band = dict(mask="none", lo=-(m + kn + 1), hi=m + kn + 1, scale=d ** -0.5)

    def piece(pos):
        out = torch.empty_like(q)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        lse = rt.forward(q, k, v, out, bnhd=True, dropout_p=p, rng=rng, pos=pos, **band)
        rt._backward_plans.clear()
        if accumulate:
            acc = torch.zeros(q.shape, device="cuda", dtype=torch.float32)
            rt.backward(t(do), t(q), t(k), t(v), t(out), lse, None, t(dk), t(dv),
                        dropout_p=p, rng=rng, pos=pos, dq_accum=t(acc), **band)
            dq = acc
        else:
            dq = torch.empty_like(q)
            rt.backward(t(do), t(q), t(k), t(v), t(out), lse, t(dq), t(dk), t(dv),
                        dropout_p=p, rng=rng, pos=pos, **band)
        assert {pl[7] for pl in rt._backward_plans.values() if pl is not None} == {"gluon"}
        return out, dq, dk, dv

    with rt.override_config(family="gluon"):
        got = piece((a, c))
        local = piece((0, 0))
    want = (t(ref), t(rq.grad), t(rk.grad), t(rv.grad))
    _assert_grads(got, want, dtype)
    assert (local[3].double() - want[3]).abs().max() > 0.1  # the positions matter here
