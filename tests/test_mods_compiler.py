"""The mod expression compiler (flashgen/mods.py) and the spec's `mods:` / `variants:` keys:
the whitelist, typed errors with file:line, and the symbolic derivative against torch
autograd on the same expression."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from flashgen import mods as M
from flashgen.errors import SpecError
from flashgen.spec import parse_spec
from flashgen.variants import variants_for

SCORE = M.Expr("var", value="score")

# expressions exercising every derivative rule; tensors t ([H] fp32) and u ([B, N] fp32)
DERIVATIVE_CASES = {
    "softcap": "cap * tanh(score / cap)",
    "alibi": "score - t[h] * abs(q_idx - kv_idx)",
    "products": "score * score * 0.1 + score / (2.0 + abs(score))",
    "where": "where(score > 0.5, score * 3.0, exp(score) - 1.0)",
    "ifexp": "score if q_idx >= kv_idx else -score * u[b, kv_idx]",
    "minmax": "min(score, 2.0) + max(score * 0.5, -1.0)",
    "logsqrt": "log(1.0 + score * score) + sqrt(score * score + 1.0)",
    "neg": "-(score - 1.0) / cap",
}


@pytest.mark.parametrize("name", sorted(DERIVATIVE_CASES))
def test_derivative_matches_autograd(name):
    tensors = {"t": M.parse_tensor_decl("t", "[H] fp32"), "u": M.parse_tensor_decl("u", "[B, N] fp32")}
    expr = M.parse_expr(DERIVATIVE_CASES[name], "score", {"cap": 7.0}, tensors)
    g = torch.Generator().manual_seed(0)
    score = (torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64) * 3).requires_grad_()
    env = {"score": score, "b": torch.arange(2)[:, None, None, None],
           "h": torch.arange(3)[None, :, None, None], "q_idx": torch.arange(5)[:, None],
           "kv_idx": torch.arange(6)[None, :], "cap": 7.0,
           "t": torch.rand(3, generator=g, dtype=torch.float64),
           "u": torch.randn(2, 6, generator=g, dtype=torch.float64)}
    value = M.to_torch(expr, env)
    (auto,) = torch.autograd.grad(value.sum(), score)
    symbolic = M.to_torch(M.derivative(expr, SCORE), env)
    torch.testing.assert_close(torch.broadcast_to(torch.as_tensor(symbolic, dtype=torch.float64),
                                                  auto.shape), auto)


def test_derivative_wrt_a_tensor_element():
    decl = {"bias": M.parse_tensor_decl("bias", "[B, H, Nq, Nk] fp32")}
    expr = M.parse_expr("2.0 * tanh(score + bias[b, h, q_idx, kv_idx])", "score", {}, decl)
    load = M.loads_of(expr)[0]
    assert str(M.derivative(expr, load)) == str(M.derivative(expr, SCORE))


def test_composed_score_mods_apply_in_order():
    first = M.parse_expr("score + 1.0", "score", {}, {})
    second = M.parse_expr("score * 2.0", "score", {}, {})
    assert M.to_torch(M.combine([first, second]), {"score": 3.0}) == 8.0


# ----------------------------------------------------------------------------------------
# The whitelist: each kind of malformed expression
# ----------------------------------------------------------------------------------------
BAD = [
    ("score", "score +", "syntax error"),
    ("score", "foo(score)", "function not allowed: `foo`"),
    ("score", "score ** 2", "operator not allowed"),
    ("score", "score.real", "not allowed in a mod expression"),
    ("score", "__import__('os')", "function not allowed"),
    ("score", "'text'", "only numbers"),
    ("score", "score + temperature", "unknown name `temperature`"),
    ("score", "doc[b]", "has 2 dimensions"),
    ("score", "doc[q_idx, kv_idx]", "along extent B the index must be b"),
    ("score", "score + doc", "must be indexed"),
    ("score", "score > 0", "must be a number, not a condition"),
    ("score", "tanh(score, 2)", "tanh takes 1 argument"),
    ("score", "abs(x=score)", "keyword arguments"),
    ("score", "score and q_idx", "need conditions"),
    ("mask", "score > 0", "only defined in a score mod"),
    ("mask", "q_idx - kv_idx", "must be a condition"),
    ("mask", "where(q_idx, 1, 0) > 0", "must be a comparison"),
    ("sink", "q_idx * 1.0", "cannot depend on q_idx"),
]


@pytest.mark.parametrize("kind, text, message", BAD, ids=[t for _, t, _ in BAD])
def test_malformed_expression(kind, text, message):
    decl = {"doc": M.parse_tensor_decl("doc", "[B, N] int32")}
    with pytest.raises(M.ModError, match=message.replace("(", r"\(").replace("*", r"\*")):
        M.parse_expr(text, kind, {}, decl)


SPEC = """\
package: p
head_dims: [64]
dtypes: [bf16]
masks: [none, causal]
gpu: {{name: H100, sram_bytes: 232448}}
mods:
  cap: {{builtin: softcap, params: {{cap: 30.0}}}}
  mine:
    {kind}: "{expr}"
    tensors: {{doc: "[B, N] int32"}}
variants:
  - {{mask: causal, mods: [cap]}}
"""


def test_spec_error_names_file_line_key_and_token():
    with pytest.raises(SpecError) as e:
        parse_spec(SPEC.format(kind="mask", expr="doc[b, q_idx] == doc[b, kv_idx] or cos(q_idx)"),
                   "m.yaml")
    msg = str(e.value)
    assert "m.yaml:9" in msg and "mods.mine.mask" in msg and "`cos`" in msg
    assert "tanh" in msg  # says what is allowed


def test_spec_mod_errors():
    ok = SPEC.format(kind="mask", expr="doc[b, q_idx] == doc[b, kv_idx]")
    spec = parse_spec(ok, "m.yaml")
    names = {v.name for v in variants_for(spec)}
    assert {"fwd_causal_cap_d64_bf16", "bwd_causal_cap_d64_bf16", "fwd_sdpa_mask_d64_bf16"} <= names
    with pytest.raises(SpecError, match=r"m\.yaml:12.*'nope' is not defined"):
        parse_spec(ok.replace("mods: [cap]", "mods: [nope]"), "m.yaml")
    with pytest.raises(SpecError, match=r"is declared but the expression does not use it"):
        parse_spec(SPEC.format(kind="mask", expr="q_idx >= kv_idx"), "m.yaml")
    with pytest.raises(SpecError, match=r"built-in `softcap` has no param `cup`"):
        parse_spec(ok.replace("cap: 30.0", "cup: 30.0"), "m.yaml")
    with pytest.raises(SpecError, match=r"unknown built-in `softcapp`"):
        parse_spec(ok.replace("builtin: softcap", "builtin: softcapp"), "m.yaml")
    with pytest.raises(SpecError, match=r"'causal' cannot name a mod"):
        parse_spec(ok.replace("  cap: {builtin", "  causal: {builtin"), "m.yaml")
    with pytest.raises(SpecError, match=r"exactly one of score, mask, sink"):
        parse_spec(ok.replace('    mask: "doc', '    score: "1.0"\n    mask: "doc'), "m.yaml")
    two = ok.replace("  - {mask: causal, mods: [cap]}",
                     "  - {mask: causal, mods: [cap]}\n  - {mask: causal, mods: [cap]}")
    with pytest.raises(SpecError, match="listed twice"):
        parse_spec(two, "m.yaml")
    no_sdpa = parse_spec(ok + "attn_mask: false\n", "m.yaml")
    assert not any("sdpa_mask" in v.name for v in variants_for(no_sdpa))


def test_cli_exit_code_2_on_a_bad_mod(tmp_path):
    spec = tmp_path / "bad.yaml"
    spec.write_text(SPEC.format(kind="score", expr="score ** 2 + doc[b, q_idx]"))
    res = subprocess.run([sys.executable, "-m", "flashgen", "plan", str(spec)],
                         capture_output=True, text=True)
    assert res.returncode == 2
    assert "bad.yaml:9" in res.stderr and "Traceback" not in res.stderr


def test_builtins_parse():
    for name in M.BUILTINS:
        mod = M.builtin_mod(name, name)
        assert mod.kind in M.KINDS and mod.source


def test_tanh_on_the_special_function_unit_for_16_bit_variants_only():
    """A 16-bit kernel spells tanh as _fastmath's tanh.approx.f32 (one special-function
    instruction instead of exp and a reciprocal); fp32 kernels keep the exact spelling,
    since the approximation's ~2^-11 relative error exceeds the fp32 tolerance."""
    from flashgen.render import mod_context

    e = M.parse_expr("cap * tanh(score / cap)", "score", {"cap": 50.0}, {})
    names = {"score": "score", "cap": "P_cap"}
    assert "_tanh((" in M.to_triton(e, names, None, tanh_fn="_tanh")
    assert "tl.sigmoid" in M.to_triton(e, names, None)
    assert "gl.exp(" in M.to_triton(e, names, None, "gl")
    assert "tanh" in M.ops_of(e) and "exp" not in M.ops_of(e)

    spec = parse_spec(textwrap.dedent("""\
        package: tanh_attn
        head_dims: [64]
        dtypes: [bf16, fp32]
        masks: [causal]
        attn_mask: false
        mods:
          softcap: {builtin: softcap}
        variants:
          - {mask: causal, mods: [softcap]}
        gpu: {name: H100, sram_bytes: 232448}
        """), "t.yaml")
    by_dtype = {v.dtype: v for v in variants_for(spec) if v.mods and v.kind == "fwd"}
    fast, exact = mod_context(spec, by_dtype["bf16"]), mod_context(spec, by_dtype["fp32"])
    assert fast["fast_tanh"] and "_tanh(" in fast["score_mod"] and "_tanh(" in fast["score_grad"]
    assert not exact["fast_tanh"] and "tl.sigmoid" in exact["score_mod"]


def test_index_arithmetic_feeding_a_float_is_done_in_fp32_vectors():
    """ALiBi's slope * abs(q_idx - kv_idx): with float_names the int distance is computed
    from the kernel's fp32 index vectors (no int-to-float conversion per score); the
    value is the same, exactly, for indices below 2^24."""
    e = M.parse_expr("score - slope[h] * abs(q_idx - kv_idx)", "score", {},
                     {"slope": M.parse_tensor_decl("slope", "[H] fp32")})
    names = {"score": "score", "h": "h", "q_idx": "q_idx", "kv_idx": "kv_idx"}

    def load(node, idx):
        return f"S[{', '.join(idx)}]"

    fast = M.to_triton(e, names, load, "gl", float_names={"q_idx": "qf", "kv_idx": "kf"})
    assert "gl.abs((qf - kf))" in fast and "q_idx" not in fast
    assert "gl.abs((q_idx - kv_idx))" in M.to_triton(e, names, load, "gl")
    # a pure int expression (a mask) is left alone
    m = M.parse_expr("q_idx - kv_idx <= 16", "mask", {}, {})
    assert "qf" not in M.to_triton(m, names, load, "gl", float_names={"q_idx": "qf", "kv_idx": "kf"})


def test_heads_by_index_only():
    """h only as a tensor's index along an H extent (ALiBi's slope[h]): a call over some of
    the heads (the ring backward's head groups) is exact with the tensor narrowed to them;
    h in arithmetic or inside another index is not. The registry carries the verdict."""
    for name in ("alibi", "softcap", "relative_bias", "sliding_window_sinks"):
        assert M.heads_by_index_only(M.builtin_mod(name, name)), name
    # (the language already requires h as the index along an H extent)
    for source in ("score - 0.1 * h", "score + tab[q_idx, h]", "score + free[h, 0]",
                   "score + slope[h] * h"):
        tensors = {t: d for t, d in (("slope", "[H] fp32"), ("tab", "[Nq, R] fp32"),
                                     ("free", "[R, 4] fp32")) if t in source}
        mod = M.make_mod("m", "score", source, {}, tensors)
        assert not M.heads_by_index_only(mod), source


KEY_SPAN_CASES = {
    # a same-segment test anywhere in a conjunction: documents
    "doc[b, q_idx] == doc[b, kv_idx]": "segment",
    "kv_idx <= q_idx and seg[b, kv_idx] == seg[b, q_idx]": "segment",
    # a bounded number of keys a query: windows, sink tokens, either
    "q_idx - kv_idx <= w": "window",
    "kv_idx >= q_idx - 64": "window",
    "kv_idx <= q_idx and (kv_idx < w or q_idx - kv_idx <= 1024)": "window",
    # up to every key: prefix-LM, padding, causal, ids compared at one position, a
    # window bounded by a tensor (no bound known from the spec)
    "kv_idx < plen[b] or kv_idx <= q_idx": None,
    "keep[b, kv_idx]": None,
    "kv_idx <= q_idx": None,
    "seg[b, q_idx] == seg[b, q_idx]": None,
    "doc[b, q_idx] == doc[b, kv_idx] or kv_idx < 4": None,
    "kv_idx < plen[b]": None,
}


@pytest.mark.parametrize("source", sorted(KEY_SPAN_CASES))
def test_key_span_of_a_mask(source):
    """mods.key_span: what bounds the keys a query sees, which picks the forward's
    tile-boundary knobs (families.KEY_SPAN_FWD_KNOBS); a variant takes its tightest."""
    decls = {"doc": "[B, N] int32", "seg": "[B, N] int32", "plen": "[B] int32",
             "keep": "[B, Nk] bool"}
    tensors = {t: d for t, d in decls.items() if f"{t}[" in source}
    mod = M.make_mod("m", "mask", source, {"w": 256} if "w" in source.split() else {},
                     tensors)
    assert M.key_span(mod) == KEY_SPAN_CASES[source]
    builtins = {n: M.key_span(M.builtin_mod(n, n)) for n in M.BUILTINS}
    assert builtins["document"] == "segment" and builtins["sliding_window_sinks"] == "window"
    assert builtins["prefix_lm"] is None and builtins["softcap"] is None
    assert M.variant_key_span([M.builtin_mod("w", "sliding_window_sinks"),
                               M.builtin_mod("d", "document")]) == "segment"


# mask source -> (sources of its per-query loads, of its per-key loads): what the Gluon
# backward stages per step / reads once per program (mods.split_vector_loads)
VECTOR_LOAD_CASES = {
    "doc[b, q_idx] == doc[b, kv_idx]": (["doc[b, q_idx]"], ["doc[b, kv_idx]"]),
    "keep[b, kv_idx]": ([], ["keep[b, kv_idx]"]),
    # a query's rows of a per-head table are per step (h is the step's head)...
    "hd[b, h, q_idx] >= kv_idx": (["hd[b, h, q_idx]"], []),
    # ...a key's are not per program (a program serves a K/V head's query heads)
    "hd[b, h, kv_idx] >= q_idx": ([], []),
    # an index computed from both, or from another load, stays per score
    "tab[b, q_idx - kv_idx] == 0": ([], []),
    "tab[b, doc[b, q_idx]] == doc[b, kv_idx]": (["doc[b, q_idx]"], ["doc[b, kv_idx]"]),
    # a float tensor (a bias) is left alone
    "wt[b, q_idx] > 0.5": ([], []),
    # the same load twice is staged once
    "(doc[b, q_idx] == doc[b, kv_idx]) and (doc[b, q_idx] >= 0)": (["doc[b, q_idx]"],
                                                                    ["doc[b, kv_idx]"]),
}


@pytest.mark.parametrize("source", list(VECTOR_LOAD_CASES))
def test_split_vector_loads_of_a_mask(source):
    decls = {"doc": "[B, N] int32", "keep": "[B, Nk] bool", "hd": "[B, H, N] int32",
             "wt": "[B, N] fp32", "tab": "[B, S] int32"}
    tensors = {t: d for t, d in decls.items() if f"{t}[" in source}
    mod = M.make_mod("m", "mask", source, {}, tensors)
    q_loads, kv_loads = M.split_vector_loads(mod.expr, {t.name: t for t in mod.tensors})
    assert ([M.to_source(x) for x in q_loads], [M.to_source(x) for x in kv_loads]) == \
        VECTOR_LOAD_CASES[source]


def test_gluon_backward_reads_a_documents_ids_per_vector():
    """The rendered document backward: the producer stages the query rows' ids in a
    shared-memory slot, the consumers read the keys' ids once, and the partial blocks'
    mask compares the two without a global load."""
    root = Path(__file__).resolve().parent.parent / "generated" / "mods_attn"
    text = (root / "kernels" / "gluon" / "bwd_causal_document_d128_bf16.py").read_text()
    mask = next(line for line in text.splitlines() if "visible = visible & (" in line
                and "mq0" in line)
    assert "gl.load" not in mask and "mkv0" in mask
    assert "MQ_SMEM0.index(s).store(mqv0)" in text
    # once a program (a program per key block), once an item (the persistent form)
    assert text.count("mkv0 = ") == 2


def test_key_span_picks_the_forward_tile_boundary_knobs():
    from flashgen import families

    assert families.gluon_default(128, "fwd", "causal", ("d",), "segment")["block_n"] == 64
    assert families.gluon_default(128, "fwd", "causal", ("d",), "segment")["q_buffers"] == 2
    assert families.gluon_default(128, "fwd", "none", ("w",), "window")["q_buffers"] == 2
    assert families.gluon_default(128, "fwd", "none", ("p",)) == families.gluon_default(
        128, "fwd", "none", ("p",), None)
    assert families.gluon_default(128, "fwd", "none", ("p",))["q_buffers"] == 1
    # the backward has no such knobs
    assert families.gluon_default(128, "bwd", "causal", ("d",), "segment") == \
        families.gluon_default(128, "bwd", "causal", ("d",))


def test_shipped_mods_package_carries_the_key_span_and_describes_its_tile():
    """The registry of the shipped mods package records each variant's key span, and
    describe() shows the Gluon tile it gives the forward (a document's 64-key blocks and
    second Q slot; prefix-LM keeps the plain tile)."""
    import importlib.util

    root = Path(__file__).resolve().parent.parent / "generated" / "mods_attn"
    spec = importlib.util.spec_from_file_location("mods_attn_reg_ks", root / "_registry.py")
    reg = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reg)
    v = reg.VARIANTS
    assert v["fwd_causal_document_d128_bf16"]["key_span"] == "segment"
    assert v["fwd_causal_document_softcap_d64_fp16"]["key_span"] == "segment"
    assert v["fwd_window_sinks_d128_bf16"]["key_span"] == "window"
    assert "key_span" not in v["fwd_prefix_lm_d128_bf16"]
    sys.path.insert(0, str(root.parent))
    try:
        import mods_attn
        lines = {ln.split()[0]: ln for ln in mods_attn.describe().splitlines()
                 if ln.strip().startswith(("fwd_causal_document_d128_bf16",
                                           "fwd_prefix_lm_d128_bf16"))}
    finally:
        sys.path.remove(str(root.parent))
    assert "gluon 128x64" in lines["fwd_causal_document_d128_bf16"]
    assert "2 Q slots" in lines["fwd_causal_document_d128_bf16"]
    assert "gluon 128x128" in lines["fwd_prefix_lm_d128_bf16"]
    assert "2 Q slots" not in lines["fwd_prefix_lm_d128_bf16"]


# score mods that only shift the score, and ones that do more
OFFSET_CASES = {
    "alibi": ("score - t[h] * abs(q_idx - kv_idx)", True),
    "bias_first": ("u[b, kv_idx] * cap + score", True),
    "two_shifts": ("(score + t[h] * q_idx) - u[b, kv_idx] / cap", True),
    "where_shift": ("score + where(q_idx >= kv_idx, t[h], -t[h] * 2.0)", True),
    "scaled": ("2.0 * score + t[h]", False),
    "softcap": ("cap * tanh(score / cap)", False),
    "score_in_shift": ("score + score * t[h]", False),
}


@pytest.mark.parametrize("name", sorted(OFFSET_CASES))
def test_score_offset_and_its_unit_factor(name):
    """score_offset(e) is h with e = score + h exactly (None when the score's coefficient is
    not 1), and scale_into(h, k) is h * k with k on a per-tile factor where h has one."""
    text, affine = OFFSET_CASES[name]
    tensors = {"t": M.parse_tensor_decl("t", "[H] fp32"), "u": M.parse_tensor_decl("u", "[B, N] fp32")}
    expr = M.parse_expr(text, "score", {"cap": 7.0}, tensors)
    offset = M.score_offset(expr)
    assert (offset is not None) == affine
    if not affine:
        return
    assert "score" not in M.free_names(offset)
    g = torch.Generator().manual_seed(1)
    env = {"score": torch.randn(2, 3, 5, 6, generator=g, dtype=torch.float64) * 3,
           "b": torch.arange(2)[:, None, None, None], "h": torch.arange(3)[None, :, None, None],
           "q_idx": torch.arange(5)[:, None], "kv_idx": torch.arange(6)[None, :], "cap": 7.0,
           "t": torch.rand(3, generator=g, dtype=torch.float64) + 0.5,
           "u": torch.randn(2, 6, generator=g, dtype=torch.float64), "K": -0.37}
    want = M.to_torch(expr, env)
    torch.testing.assert_close(env["score"] + M.to_torch(offset, env), want)
    k = M.Expr("var", value="K")
    scaled = M.scale_into(offset, k)
    torch.testing.assert_close(torch.as_tensor(M.to_torch(scaled, env) / env["K"]).expand_as(want),
                               (want - env["score"]))


def test_scale_into_puts_the_factor_on_the_per_tile_term():
    """ALiBi's shift in raw units multiplies slope[h] (one number a tile) by the unit factor,
    not each score: the rendered Gluon text has no per-element multiply by it."""
    tensors = {"slope": M.parse_tensor_decl("slope", "[H] fp32")}
    expr = M.parse_expr("score - slope[h] * abs(q_idx - kv_idx)", "score", {}, tensors)
    scaled = M.scale_into(M.score_offset(expr), M.Expr("var", value="K"))
    assert str(scaled) == "((slope[h] * -(K)) * abs((q_idx - kv_idx)))"


def test_gluon_kernels_add_alibi_as_a_shift(tmp_path):
    """The shipped ALiBi variant's Gluon kernels take the shift path (no multiply into
    natural units and back per score); softcap, which is not a shift, keeps the general
    one."""
    from flashgen.build import build

    root = build(Path(__file__).resolve().parents[1] / "specs" / "mods.yaml", tmp_path).root
    kernels = root / "kernels" / "gluon"
    fwd = (kernels / "fwd_causal_alibi_d128_bf16.py").read_text()
    bwd = (kernels / "bwd_causal_alibi_d128_bf16.py").read_text()
    assert "return qk + (" in fwd and "* (-mod_k))" in fwd
    assert "(st * QK_SCALE_LOG2 - gl.expand_dims(lse, 0))" in bwd and "* (-LOG2E))" in bwd
    soft = (kernels / "fwd_causal_softcap_d128_bf16.py").read_text()
    assert "return qk + (" not in soft and "score = qk * natural" in soft
