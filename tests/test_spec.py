"""Tests for the spec model and its error messages (flashgen.spec)."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import pytest

from flashgen.errors import FlashgenError, SpecError
from flashgen.spec import (
    DEFAULT_SEQLEN_BUCKETS, BlockConfig, Blocks, GpuTarget, Loc, Spec, Window,
    load_spec, parse_spec,
)

SPECS = Path(__file__).resolve().parent.parent / "specs"

# A minimal valid spec; line numbers below refer to it (package is line 1).
BASE = """\
package: demo_attn
head_dims: [64]
dtypes: [fp16]
masks: [none, causal]
gpu:
  name: H100
  sram_bytes: 232448
"""


def write(tmp_path: Path, text: str, name: str = "spec.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def fails(tmp_path: Path, text: str) -> SpecError:
    """Load `text` from a file, expect a SpecError, check the common shape."""
    path = write(tmp_path, text)
    with pytest.raises(SpecError) as info:
        load_spec(path)
    err = info.value
    msg = str(err)
    assert err.file == str(path)
    assert msg.startswith(f"{path}:{err.line}: key '{err.key}': ")
    assert "Expected: " in msg and "Fix: " in msg
    assert "\n" not in msg  # one paragraph
    return err


def check(err: SpecError, line: int, key: str, *fragments: str) -> None:
    assert (err.line, err.key) == (line, key), str(err)
    for fragment in fragments:
        assert fragment in str(err), str(err)


# ---------------------------------------------------------------- happy paths

def test_gpt2_spec_parses():
    spec = load_spec(SPECS / "gpt2.yaml")
    assert spec.package == "gpt2_attn"
    assert spec.head_dims == (64,)
    assert spec.dtypes == ("fp16", "bf16", "fp32", "fp8_e4m3")
    assert spec.masks == ("none", "causal")
    assert spec.window is None
    assert (spec.dropout, spec.gqa, spec.decode) == (True, False, False)
    assert spec.gpu == GpuTarget("H100", 232448, 132)
    assert spec.blocks == Blocks(None, None, None)
    assert spec.seqlen_buckets == DEFAULT_SEQLEN_BUCKETS == (512, 1024, 2048, 4096, 8192, 16384)
    assert len(spec.sha) == 12 and int(spec.sha, 16) >= 0


def test_llama_spec_parses():
    spec = load_spec(SPECS / "llama.yaml")
    assert spec.package == "llama_attn"
    assert spec.head_dims == (128,)
    assert spec.dtypes == ("fp16", "bf16")  # canonical order, not file order
    assert spec.masks == ("none", "causal", "sliding_window")
    assert spec.window == Window(4096, 0)
    assert (spec.dropout, spec.gqa, spec.decode) == (False, True, True)
    assert spec.gpu == GpuTarget("H100", 232448, 132)
    assert spec.blocks == Blocks(None, None, None)
    assert spec.seqlen_buckets == DEFAULT_SEQLEN_BUCKETS
    assert spec.kv_cache_dtypes == ("fp16", "bf16", "fp8_e4m3", "int8")


def test_defaults_and_normalisation(tmp_path):
    text = BASE.replace("[64]", "[128, 64]").replace("[fp16]", "[fp32, fp16]")
    spec = load_spec(write(tmp_path, text + "seqlen_buckets: [4096, 512]\n"))
    assert spec.head_dims == (64, 128)
    assert spec.dtypes == ("fp16", "fp32")
    assert spec.seqlen_buckets == (512, 4096)
    assert (spec.dropout, spec.gqa, spec.decode, spec.window) == (False, False, False, None)
    assert spec.gpu.sm_count is None
    assert spec.blocks == Blocks(None, None, None)
    assert all(isinstance(v, tuple) for v in (spec.head_dims, spec.dtypes, spec.masks))


def test_explicit_blocks(tmp_path):
    text = BASE + ("blocks:\n"
                   "  forward: {block_m: 128, block_n: 64, num_warps: 4, num_stages: 3}\n"
                   "  backward: auto\n")
    spec = load_spec(write(tmp_path, text))
    assert spec.blocks == Blocks(BlockConfig(128, 64, 4, 3), None, None)
    assert spec.loc("blocks.forward.block_m") == Loc(spec.path, 9)


def test_path_and_locs(tmp_path):
    path = write(tmp_path, BASE)
    spec = load_spec(path)
    assert spec.path == str(path)
    assert dict(spec.locs) == {
        "package": Loc(str(path), 1), "head_dims": Loc(str(path), 2),
        "dtypes": Loc(str(path), 3), "masks": Loc(str(path), 4),
        "gpu": Loc(str(path), 5), "gpu.name": Loc(str(path), 6),
        "gpu.sram_bytes": Loc(str(path), 7),
    }


def test_parse_spec_from_string():
    spec = parse_spec(BASE)
    assert spec.path == "<string>"
    assert spec.loc("gpu.sram_bytes") == Loc("<string>", 7)


# ---------------------------------------------------------------- immutability

def test_model_is_frozen():
    spec = parse_spec(BASE)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.package = "other"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.gpu.sram_bytes = 1  # type: ignore[misc]
    # Hashable and comparable by content (locs excluded), so usable as a cache key.
    assert hash(spec) == hash(parse_spec(BASE)) and spec == parse_spec(BASE)


def test_locs_is_read_only():
    spec = parse_spec(BASE)
    with pytest.raises(TypeError):
        spec.locs["package"] = Loc("x", 99)  # type: ignore[index]
    assert spec.loc("package") == Loc("<string>", 1)


def test_sha_changes_when_file_changes(tmp_path):
    path = write(tmp_path, BASE)
    before = load_spec(path).sha
    assert before == load_spec(path).sha
    path.write_text(BASE + "# a comment\n")
    after = load_spec(path).sha
    assert before != after and len(after) == 12
    assert parse_spec(BASE).sha == before  # same bytes, same sha


def test_spec_error_cites_nested_key_line(tmp_path):
    spec = load_spec(write(tmp_path, BASE))
    err = spec.error("gpu.sram_bytes", "tiles need 300000 bytes",
                     "tiles that fit in sram_bytes", "use smaller block_n")
    assert isinstance(err, SpecError) and isinstance(err, FlashgenError)
    assert (err.file, err.line, err.key) == (spec.path, 7, "gpu.sram_bytes")
    assert str(err) == (f"{spec.path}:7: key 'gpu.sram_bytes': tiles need 300000 bytes. "
                        "Expected: tiles that fit in sram_bytes. Fix: use smaller block_n.")


def test_loc_falls_back_to_parent_then_line_1():
    spec = parse_spec(BASE + "blocks: auto\n")
    assert spec.loc("blocks.forward.block_m") == Loc("<string>", 8)
    assert spec.loc("gpu.sm_count") == Loc("<string>", 5)
    assert spec.loc("window.left") == Loc("<string>", 1)


def test_error_message_format_and_pickle():
    err = SpecError("specs/gpt2.yaml", 7, "head_dims", "72.5 is not an integer",
                    "a list of head dimensions, each a multiple of 8 from 16 to 256",
                    "write e.g. head_dims: [64, 128].")
    assert str(err) == ("specs/gpt2.yaml:7: key 'head_dims': 72.5 is not an integer. "
                        "Expected: a list of head dimensions, each a multiple of 8 from "
                        "16 to 256. Fix: write e.g. head_dims: [64, 128].")
    copy = pickle.loads(pickle.dumps(err))
    assert str(copy) == str(err) and copy.line == 7
    assert str(SpecError("f.yaml", None, "<file>", "p", "e", "f")) == \
        "f.yaml: key '<file>': p. Expected: e. Fix: f."


# ---------------------------------------------------------------- document errors

def test_malformed_yaml(tmp_path):
    err = fails(tmp_path, BASE + "dropout: [true\n")
    check(err, 9, "<yaml>", "malformed YAML")


def test_malformed_yaml_bad_indent(tmp_path):
    err = fails(tmp_path, "package: demo\n  head_dims: : [64]\n")
    check(err, 2, "<yaml>", "mapping values are not allowed here")


def test_not_a_mapping(tmp_path):
    err = fails(tmp_path, "# a list\n- package\n- head_dims\n")
    check(err, 2, "<document>", "a list, not a mapping")


@pytest.mark.parametrize("text", ["", "# only a comment\n"])
def test_empty_file(tmp_path, text):
    check(fails(tmp_path, text), 1, "<document>", "empty")


def test_missing_file(tmp_path):
    with pytest.raises(SpecError) as info:
        load_spec(tmp_path / "nope.yaml")
    assert (info.value.line, info.value.key) == (None, "<file>")


# ---------------------------------------------------------------- keys

def test_unknown_key_with_suggestion(tmp_path):
    err = fails(tmp_path, BASE.replace("head_dims:", "head_dim:"))
    check(err, 2, "head_dim", "unknown key 'head_dim'", "did you mean 'head_dims'?")


def test_nested_unknown_key(tmp_path):
    err = fails(tmp_path, BASE + "  sram_byte: 1024\n")
    check(err, 8, "gpu.sram_byte", "did you mean 'sram_bytes'?", "under 'gpu'")


def test_misplaced_nested_key(tmp_path):
    err = fails(tmp_path, BASE + "sm_count: 132\n")
    check(err, 8, "sm_count", "belongs under 'gpu'")


def test_duplicate_top_level_key(tmp_path):
    err = fails(tmp_path, BASE + "head_dims: [128]\n")
    check(err, 8, "head_dims", "duplicate key 'head_dims'", "line 2")


def test_duplicate_nested_key(tmp_path):
    err = fails(tmp_path, BASE + "  name: A100\n")
    check(err, 8, "gpu.name", "duplicate key 'name'", "line 6")


def test_missing_required_key(tmp_path):
    err = fails(tmp_path, BASE.replace("dtypes: [fp16]\n", ""))
    check(err, 1, "dtypes", "required key 'dtypes' is missing")


def test_missing_required_nested_key(tmp_path):
    err = fails(tmp_path, BASE.replace("  sram_bytes: 232448\n", ""))
    check(err, 5, "gpu.sram_bytes", "required key 'sram_bytes' is missing")


def test_first_problem_in_file_order_wins(tmp_path):
    text = BASE.replace("[64]", "[100]") + "bogus: 1\n"
    check(fails(tmp_path, text), 2, "head_dims", "100 is not a multiple of 8")


# ---------------------------------------------------------------- types

def test_wrong_type_string_for_list(tmp_path):
    err = fails(tmp_path, BASE.replace("[fp16]", "fp16"))
    check(err, 3, "dtypes", "'fp16' is not a list")


def test_wrong_type_float(tmp_path):
    err = fails(tmp_path, BASE.replace("[64]", "[64, 72.5]"))
    check(err, 2, "head_dims", "72.5 is not an integer")


def test_wrong_type_quoted_number(tmp_path):
    err = fails(tmp_path, BASE.replace("232448", '"232448"'))
    check(err, 7, "gpu.sram_bytes", "'232448' is not an integer")


def test_bool_is_not_an_int(tmp_path):
    err = fails(tmp_path, BASE.replace("[64]", "[true]"))
    check(err, 2, "head_dims", "true is not an integer")


def test_int_is_not_a_bool(tmp_path):
    err = fails(tmp_path, BASE + "dropout: 1\n")
    check(err, 8, "dropout", "1 is not a boolean")


def test_gpu_not_a_mapping(tmp_path):
    err = fails(tmp_path, BASE.split("gpu:")[0] + "gpu: H100\n")
    check(err, 5, "gpu", "'H100' is not a mapping")


# ---------------------------------------------------------------- values

def test_head_dim_out_of_range(tmp_path):
    err = fails(tmp_path, BASE.replace("head_dims: [64]", "head_dims:\n  - 64\n  - 520"))
    check(err, 4, "head_dims", "520 is outside 16..512")


def test_head_dims_up_to_512_for_every_kernel():
    """Gemma 4's global layers (d = 512) and a V head dim of its own past 256."""
    spec = parse_spec(BASE.replace("[64]", "[320, 512, {qk: 512, v: 384}]") + "decode: true\n")
    assert spec.head_dims == (320, 512)
    assert spec.head_dim_pairs == ((320, 320), (512, 384), (512, 512))


def test_head_dim_not_multiple_of_8(tmp_path):
    err = fails(tmp_path, BASE.replace("[64]", "[64, 100]"))
    check(err, 2, "head_dims", "100 is not a multiple of 8")


def test_empty_list(tmp_path):
    check(fails(tmp_path, BASE.replace("[64]", "[]")), 2, "head_dims", "empty")


def test_repeated_list_entry(tmp_path):
    check(fails(tmp_path, BASE.replace("[64]", "[64, 64]")), 2, "head_dims", "listed twice")


def test_bad_dtype_name(tmp_path):
    err = fails(tmp_path, BASE.replace("[fp16]", "[fp16, bfloat16]"))
    check(err, 3, "dtypes", "unknown name 'bfloat16'", "did you mean 'bf16'?")


def test_bad_mask_name(tmp_path):
    err = fails(tmp_path, BASE.replace("[none, causal]", "[none, casual]"))
    check(err, 4, "masks", "unknown name 'casual'", "did you mean 'causal'?")


@pytest.mark.parametrize("name", ["2fast", "my-attn", "class"])
def test_bad_package_name(tmp_path, name):
    err = fails(tmp_path, BASE.replace("demo_attn", name))
    check(err, 1, "package", f"'{name}' is not a valid Python package name")


def test_sram_bytes_out_of_range(tmp_path):
    err = fails(tmp_path, BASE.replace("232448", "1000"))
    check(err, 7, "gpu.sram_bytes", "1000 is outside 16384..1048576")


def test_sm_count_below_one(tmp_path):
    check(fails(tmp_path, BASE + "  sm_count: 0\n"), 8, "gpu.sm_count", "0 is less than 1")


def test_gpu_arch(tmp_path):
    assert load_spec(write(tmp_path, BASE)).gpu.arch is None
    assert load_spec(write(tmp_path, BASE)).gpu.capability == 90  # the H100's model
    assert load_spec(write(tmp_path, BASE + "  arch: null\n")).gpu.arch is None
    spec = load_spec(write(tmp_path, BASE + "  arch: sm_80\n"))
    assert (spec.gpu.arch, spec.gpu.capability) == ("sm_80", 80)
    assert spec.loc("gpu.arch") == Loc(str(tmp_path / "spec.yaml"), 8)
    assert load_spec(write(tmp_path, BASE + "  arch: sm_120\n")).gpu.capability == 120


def test_shipped_gpu_specs_name_their_arch():
    assert load_spec(SPECS / "gpus" / "a100.yaml").gpu.arch == "sm_80"
    assert load_spec(SPECS / "gpus" / "rtx4090.yaml").gpu.arch == "sm_89"


@pytest.mark.parametrize("value, problem", [
    ("80", "80 is a number, not an architecture name"),
    ("8.9", "8.9 is a number, not an architecture name"),
    ("sm80", "'sm80' is not an architecture name sm_XY"),
    ("SM_80", "'SM_80' is not an architecture name sm_XY"),
    ("sm_8", "'sm_8' is not an architecture name sm_XY"),
    ("sm_90a", "'sm_90a' is not an architecture name sm_XY"),
    ("sm_70", "sm_70 is older than sm_75"),
    ("true", "true is not an architecture name"),
    ("[sm_80]", "a list is not an architecture name"),
])
def test_bad_gpu_arch(tmp_path, value, problem):
    err = fails(tmp_path, BASE + f"  arch: {value}\n")
    check(err, 8, "gpu.arch", problem, "sm_XY", "arch: sm_80 (A100)")


def test_misplaced_arch(tmp_path):
    check(fails(tmp_path, BASE + "arch: sm_80\n"), 8, "arch", "belongs under 'gpu'")


def test_bucket_not_positive(tmp_path):
    err = fails(tmp_path, BASE + "seqlen_buckets: [512, 0]\n")
    check(err, 8, "seqlen_buckets", "0 is not positive")


# ---------------------------------------------------------------- blocks

TILE = "{block_m: %s, block_n: 64, num_warps: %s, num_stages: %s}"


def test_non_power_of_two_block(tmp_path):
    text = BASE + "blocks:\n  backward: auto\n  forward: " + TILE % (96, 4, 2) + "\n"
    err = fails(tmp_path, text)
    check(err, 10, "blocks.forward.block_m", "96 is not a power of two")


def test_bad_num_warps(tmp_path):
    err = fails(tmp_path, BASE + "blocks:\n  decode: " + TILE % (64, 3, 2) + "\n")
    check(err, 9, "blocks.decode.num_warps", "3 is not one of 2, 4, 8")


def test_bad_num_stages(tmp_path):
    err = fails(tmp_path, BASE + "blocks: {forward: " + TILE % (64, 4, 9) + "}\n")
    check(err, 8, "blocks.forward.num_stages", "9 is outside 1..5")


def test_incomplete_tile(tmp_path):
    err = fails(tmp_path, BASE + "blocks:\n  forward:\n    block_m: 64\n")
    check(err, 9, "blocks.forward.block_n", "required key 'block_n' is missing")


def test_blocks_bad_word(tmp_path):
    check(fails(tmp_path, BASE + "blocks: manual\n"), 8, "blocks", "neither auto nor a mapping")


# ---------------------------------------------------------------- window

SLIDING = BASE.replace("[none, causal]", "[none, sliding_window]")


def test_window_without_sliding_window_mask(tmp_path):
    err = fails(tmp_path, BASE + "window: {left: 256, right: 0}\n")
    check(err, 8, "window", "masks do not include sliding_window")


def test_sliding_window_without_window(tmp_path):
    err = fails(tmp_path, SLIDING)
    check(err, 4, "window", "no window is given")


def test_window_both_unbounded(tmp_path):
    err = fails(tmp_path, SLIDING + "window:\n  left: -1\n  right: -1\n")
    check(err, 8, "window", "both extents are -1")


def test_window_extent_below_minus_one(tmp_path):
    err = fails(tmp_path, SLIDING + "window: {left: 256, right: -2}\n")
    check(err, 8, "window.right", "-2 is below -1")


def test_window_missing_extent(tmp_path):
    err = fails(tmp_path, SLIDING + "window: {left: 256}\n")
    check(err, 8, "window.right", "required key 'right' is missing")


def test_window_ok(tmp_path):
    spec = load_spec(write(tmp_path, SLIDING + "window: {left: -1, right: 0}\n"))
    assert spec.window == Window(-1, 0)
    assert spec.masks == ("none", "sliding_window")


def test_kv_cache_dtypes(tmp_path):
    """kv_cache_dtypes: the quantized caches (fp8_e4m3, int8) get their loads in the
    fp16/bf16 decode and dropout-free forward kernels, named as before (no new variant);
    a plain entry must be one of `dtypes`; quantized caches need fp16 or bf16 queries."""
    from flashgen.render import kernel_context
    from flashgen.variants import reads_quantized_kv, variants_for

    text = BASE.replace("[fp16]", "[fp16, fp32]") + "decode: true\n"
    spec = load_spec(write(tmp_path, text + "kv_cache_dtypes: [int8, fp16, fp8_e4m3]\n"))
    assert spec.kv_cache_dtypes == ("fp16", "fp8_e4m3", "int8")  # canonical order
    assert spec.kv_quant_dtypes == ("fp8_e4m3", "int8")
    assert spec.loc("kv_cache_dtypes").line == 9
    quant = {v.name for v in variants_for(spec) if reads_quantized_kv(spec, v)}
    assert quant == {"decode_d64_fp16", "decode_causal_d64_fp16", "fwd_d64_fp16",
                     "fwd_causal_d64_fp16", "fwd_sdpa_mask_d64_fp16"}  # (mods: score, sink)
    assert all(kernel_context(spec, v)["kv_quant"] == (v.name in quant) for v in variants_for(spec))
    assert load_spec(write(tmp_path, text)).kv_quant_dtypes == ()  # the default: none
    err = fails(tmp_path, text + "kv_cache_dtypes: [bf16, int8]\n")
    check(err, 9, "kv_cache_dtypes", "bf16 is listed but `dtypes` has no bf16", "add bf16")
    err = fails(tmp_path, BASE.replace("[fp16]", "[fp32]") + "kv_cache_dtypes: [int8]\n")
    check(err, 8, "kv_cache_dtypes", "int8 caches are read with fp16 or bf16 queries")
    err = fails(tmp_path, text + "kv_cache_dtypes: [fp8]\n")
    check(err, 9, "kv_cache_dtypes", "unknown name 'fp8' (did you mean 'fp8_e4m3'?)")
    err = fails(tmp_path, text + "kv_cache_dtypes: int8\n")
    check(err, 9, "kv_cache_dtypes", "is not a list", "kv_cache_dtypes: [bf16, fp8_e4m3, int8]")
    err = fails(tmp_path, text + "kv_cache_dtypes: [int8, int8]\n")
    check(err, 9, "kv_cache_dtypes", "listed twice")


def test_fp8_dtype(tmp_path):
    """fp8_e4m3 is a dtype of its own (its variants named ..._fp8_e4m3); with decode or mods
    it is refused at the dtypes line (the fp8 kernels take neither yet)."""
    from flashgen.variants import variants_for

    spec = load_spec(write(tmp_path, BASE.replace("[fp16]", "[bf16, fp8_e4m3]")))
    assert spec.dtypes == ("bf16", "fp8_e4m3")
    names = {v.name for v in variants_for(spec)}
    assert {"fwd_causal_d64_fp8_e4m3", "bwd_d64_fp8_e4m3"} <= names
    # attn_mask's implicit variants (on by default) are built for bf16 only
    assert not any(n.endswith("fp8_e4m3") and "sdpa_mask" in n for n in names)
    err = fails(tmp_path, BASE.replace("[fp16]", "[fp8_e4m3]") + "decode: true\n")
    check(err, 3, "dtypes", "fp8_e4m3 is asked for beside decode", "drop decode")


def test_batch_invariant_key(tmp_path):
    """`batch_invariant` (issue 49): a boolean, default false, the calls' default; true
    needs decode: true, reported by the plan stage at its line (flashgen/invariant.py)."""
    from flashgen.plan import plan_spec

    assert load_spec(write(tmp_path, BASE)).batch_invariant is False
    spec = load_spec(write(tmp_path, BASE + "decode: true\nbatch_invariant: true\n"))
    assert spec.batch_invariant is True
    check(fails(tmp_path, BASE + "batch_invariant: 1\n"), 8, "batch_invariant",
          "1 is not a boolean", "write batch_invariant: true or false")
    spec = load_spec(write(tmp_path, BASE + "decode: false\nbatch_invariant: true\n"))
    with pytest.raises(SpecError) as info:
        plan_spec(spec)
    check(info.value, 9, "batch_invariant", "builds no decode kernels", "add decode: true")
