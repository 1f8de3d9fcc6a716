"""`flashgen check`: builds a spec into a temporary folder and verifies every variant."""
import io

import flashgen.reference
from flashgen.check import check

SPEC = """\
package: fg_test_check
head_dims: [16]
dtypes: [fp32]
masks: [causal]
dropout: true
gqa: true
gpu: {name: H100, sram_bytes: 232448}
"""


def test_check_passes_on_correct_kernels(tmp_path):
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC)
    out = io.StringIO()
    assert check(spec, quick=True, out=out)
    text = out.getvalue()
    assert "ok   fwd_causal_d16_fp32 (+ bwd)" in text
    assert "ok   fwd_causal_dropout_d16_fp32 (+ bwd)" in text
    assert "ok   fwd_sdpa_mask_dropout_d16_fp32 (+ bwd)" in text  # attn_mask, with dropout
    assert "FAIL" not in text


def test_check_fails_when_results_disagree(tmp_path, monkeypatch):
    """A reference that disagrees with the kernels must make the check fail (exit 1)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.replace("dropout: true", "dropout: false"))
    real = flashgen.reference.attention_ref

    def off_by_a_bit(*args, **kwargs):
        out, lse = real(*args, **kwargs)
        return out * 1.01, lse

    monkeypatch.setattr(flashgen.reference, "attention_ref", off_by_a_bit)
    out = io.StringIO()
    assert not check(spec, quick=True, out=out)
    assert "FAIL fwd_causal_d16_fp32" in out.getvalue()


def test_check_takes_a_boolean_mod_tensor(tmp_path):
    """A mask mod reading a bool tensor (key_padding's `keep`): its reference mask stays
    boolean (the check's reference turned it into int64, which masked_fill refused)."""
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.replace("dropout: true", "dropout: false").replace("gqa: true", """\
gqa: true
attn_mask: false
mods:
  pad: {builtin: key_padding}
variants:
  - {mask: causal, mods: [pad]}"""))
    out = io.StringIO()
    assert check(spec, quick=True, out=out)
    assert "ok   fwd_causal_pad_d16_fp32 (+ bwd)" in out.getvalue()


def test_check_verifies_fp8_variants(tmp_path, monkeypatch):
    """fp8 variants: bf16 inputs quantized with one scale a tensor, against float64 on the
    dequantized inputs (the check raised KeyError on them). A descale the kernel ignored
    would be caught: the reference multiplies by it."""
    spec = tmp_path / "s.yaml"
    spec.write_text(SPEC.replace("dtypes: [fp32]", "dtypes: [bf16, fp8_e4m3]")
                    .replace("dropout: true", "dropout: false"))
    out = io.StringIO()
    assert check(spec, quick=True, out=out)
    assert "ok   fwd_causal_d16_fp8_e4m3 (+ bwd)" in out.getvalue()

    real = flashgen.reference.attention_ref
    monkeypatch.setattr(flashgen.reference, "attention_ref",
                        lambda *a, **kw: (lambda o, lse: (o * 1.3, lse))(*real(*a, **kw)))
    out = io.StringIO()
    assert not check(spec, quick=True, out=out)
    assert "FAIL fwd_causal_d16_fp8_e4m3" in out.getvalue()
