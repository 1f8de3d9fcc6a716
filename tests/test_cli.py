"""The command line, run as a user runs it: `python -m flashgen ...` in a subprocess, from a
scratch working directory, with only the repo root on PYTHONPATH."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flashgen.plan import plan_spec, variant_score_bytes
from flashgen.render import render_package
from flashgen.spec import load_spec
from flashgen.variants import variants_for

ROOT = Path(__file__).resolve().parent.parent
GPT2 = ROOT / "specs" / "gpt2.yaml"


def flashgen(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return subprocess.run([sys.executable, "-m", "flashgen", *map(str, args)], cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=120)


def flat(text: str) -> str:
    """argparse wraps help text: compare with whitespace collapsed."""
    return " ".join(text.split())


@pytest.fixture
def work(tmp_path) -> Path:
    """A scratch working directory with specs/gpt2.yaml and its tuning data, as in a
    checkout (the tuning files next to a spec are part of what a build reads)."""
    (tmp_path / "specs").mkdir()
    shutil.copy(GPT2, tmp_path / "specs" / "gpt2.yaml")
    if (GPT2.parent / "tuning").is_dir():
        shutil.copytree(GPT2.parent / "tuning", tmp_path / "specs" / "tuning")
    return tmp_path


def assert_user_error(res: subprocess.CompletedProcess, command: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr, no traceback; returns the message."""
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert res.stdout == ""
    assert "Traceback" not in res.stderr, res.stderr
    err = res.stderr.strip()
    assert "\n" not in err, err  # one paragraph
    prefix = f"flashgen {command}: error: "
    assert err.startswith(prefix), err
    return err[len(prefix):]


# ----------------------------------------------------------------------------------------
# help and usage
# ----------------------------------------------------------------------------------------

def test_top_level_help(tmp_path):
    res = flashgen("--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = flat(res.stdout)
    assert text.startswith("usage: flashgen ")
    assert "FlashAttention" in text and "YAML spec" in text
    for command in ("build", "plan", "render", "check"):
        assert f" {command} " in text, command


@pytest.mark.parametrize("command, fragments", [
    ("build", ["idempotent", "--out", "spec"]),
    ("plan", ["FlashAttention-1", "shared-memory", "chosen", "spec"]),
    ("render", ["--variant", "fwd_causal_d64_fp16", "spec"]),
    ("check", ["--quick", "float64", "reference", "spec"]),
])
def test_command_help(tmp_path, command, fragments):
    res = flashgen(command, "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert res.stderr == ""
    text = flat(res.stdout)
    assert text.startswith(f"usage: flashgen {command} ")
    for fragment in fragments:
        assert fragment in text, (fragment, text)


@pytest.mark.parametrize("args, fragment", [
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "required: COMMAND"),
    (["build"], "required: spec"),
    (["render", "specs/gpt2.yaml", "--variant"], "--variant: expected one argument"),
], ids=["unknown-command", "no-command", "build-no-spec", "variant-no-value"])
def test_usage_errors_exit_2(work, args, fragment):
    res = flashgen(*args, cwd=work)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    assert res.stderr.startswith("usage: flashgen")
    assert fragment in res.stderr, res.stderr


# ----------------------------------------------------------------------------------------
# bad specs: exit 2, one paragraph naming file:line, the key, Expected and Fix
# ----------------------------------------------------------------------------------------

GOOD = [
    "package: demo_attn",    # 1
    "head_dims: [64]",       # 2
    "dtypes: [fp16]",        # 3
    "masks: [none, causal]",  # 4
    "gpu:",                  # 5
    "  name: H100",          # 6
    "  sram_bytes: 232448",  # 7
]


@pytest.mark.parametrize("edit, line, key, fragments", [
    ({3: "dtypes: fp16: bf16"}, 3, "<yaml>", ["malformed YAML"]),
    ({2: "head_dim: [64]"}, 2, "head_dim", ["unknown key 'head_dim'", "'head_dims'"]),
    ({7: '  sram_bytes: "232448"'}, 7, "gpu.sram_bytes", ["'232448' is not an integer"]),
    ({7: "  sram_bytes: 16384",
      8: "blocks:",
      9: "  forward: {block_m: 128, block_n: 128, num_warps: 4, num_stages: 2}"},
     9, "blocks.forward", ["smem 114688 B > budget 16384 B"]),
    ({7: "  sram_bytes: 16384"}, 7, "gpu.sram_bytes",  # fp16 d=64: the backward needs more
     ["16384 B of shared memory per block fits no tile of bwd_d64_fp16",
      "Expected: at least 20736 B",
      "set gpu.sram_bytes to your GPU's per-block opt-in shared memory (>= 20736"]),
], ids=["malformed-yaml", "unknown-key", "wrong-type", "tile-too-large", "budget-too-small"])
def test_bad_spec_is_one_paragraph_exit_2(tmp_path, edit, line, key, fragments):
    lines = list(GOOD)
    for number, text in edit.items():
        if number <= len(lines):
            lines[number - 1] = text
        else:
            lines.append(text)
    (tmp_path / "bad.yaml").write_text("\n".join(lines) + "\n")
    res = flashgen("build", "bad.yaml", "--out", "out", cwd=tmp_path)
    msg = assert_user_error(res, "build")
    assert msg.startswith(f"bad.yaml:{line}: key '{key}': "), msg
    assert "Expected: " in msg and "Fix: " in msg, msg
    assert msg.index("Expected: ") < msg.index("Fix: ")
    for fragment in fragments:
        assert fragment in msg, (fragment, msg)
    assert not (tmp_path / "out" / "demo_attn").exists()  # nothing written


def test_missing_spec_file(tmp_path):
    for command in ("build", "plan"):
        res = flashgen(command, "no/such/spec.yaml", cwd=tmp_path)
        msg = assert_user_error(res, command)
        assert msg.startswith("no/such/spec.yaml: "), msg
        assert "cannot read the file" in msg and "No such file or directory" in msg, msg
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------
# build, plan, render
# ----------------------------------------------------------------------------------------

def test_build_writes_package_and_is_idempotent(work):
    spec = load_spec(GPT2)
    files = render_package(spec, plan_spec(spec))
    n = len(files)
    kernels = {f"kernels/{v.name}.py" for v in variants_for(spec)}
    assert kernels <= set(files) and n > len(kernels) >= 6

    first = flashgen("build", "specs/gpt2.yaml", "--out", "out", cwd=work)
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines()[0] == f"{Path('out', 'gpt2_attn')}: {n} written, 0 unchanged, 0 removed"
    # how to import a package built with --out
    assert "`import gpt2_attn` with out on sys.path (e.g. PYTHONPATH=out)" in flat(first.stdout)
    pkg = work / "out" / "gpt2_attn"
    for rel, text in files.items():
        assert (pkg / rel).read_text() == text, rel

    second = flashgen("build", "specs/gpt2.yaml", "--out", "out", cwd=work)
    assert second.returncode == 0, second.stderr
    assert second.stdout.splitlines()[0] == f"{Path('out', 'gpt2_attn')}: 0 written, {n} unchanged, 0 removed"

    # --out defaults to generated/ in the working directory
    third = flashgen("build", "specs/gpt2.yaml", cwd=work)
    assert third.returncode == 0, third.stderr
    assert third.stdout.startswith(f"{Path('generated', 'gpt2_attn')}: {n} written, ")
    assert (work / "generated" / "gpt2_attn" / "__init__.py").read_text() == files["__init__.py"]


def test_plan_summary_explains_the_rule_and_the_choice(work):
    res = flashgen("plan", "specs/gpt2.yaml", cwd=work)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    spec = load_spec(GPT2)
    plans = plan_spec(spec)
    sections = {(v.kind, v.head_dim, v.dtype_bytes, variant_score_bytes(spec, v)) for v in plans}
    assert len(out.splitlines()) < 12 * len(sections)  # a summary, not 375 candidates each
    assert out.count("FA-1 rule: M = 232448 B / 2 = 116224 elements; Bc = ceil(M / 4d) = 454, "
                     "Br = min(Bc, d) = 64") == len(
        {k for k in sections if k[2] == 2})  # fwd and bwd, 2-byte dtypes, with or without
    # the attn_mask (sdpa_mask) variants, which plan their own tiles (their [q, kv] bias)
    # the rule's Bc/Br become a target tile, and the line says how
    assert "block_m (resident Q rows) <- Bc, block_n (streamed K/V rows) <- Br" in out
    assert "-> block_m 32, block_n 128" in out  # bwd: streamed Br / 4, resident Bc clamped
    for p in plans.values():
        assert f"chosen: {p.chosen} " in out
    assert "candidates feasible; rejections: " in out
    assert "--all` lists every candidate" in out
    assert "rank  block_m" not in out


def test_plan_summary_says_why_the_choice_differs_from_the_target(tmp_path):
    # 36 KiB, fp32 d=128: the FA-1 target tile does not fit, the summary says why
    (tmp_path / "s.yaml").write_text("\n".join(GOOD).replace("[64]", "[128]").replace(
        "[fp16]", "[fp32]").replace("232448", "101376") + "\n")
    res = flashgen("plan", "s.yaml", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "differs from the target tile" in res.stdout, res.stdout


def test_plan_all_prints_fa1_numbers_choice_and_rejections(work):
    res = flashgen("plan", "specs/gpt2.yaml", "--all", cwd=work)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    # FA-1: M = sram // dtype bytes elements, Bc = ceil(M / 4d), Br = min(Bc, d)
    for dtype_bytes in (2, 4):
        m = 232448 // dtype_bytes
        bc = -(-m // (4 * 64))
        assert (m, bc) in ((116224, 454), (58112, 227))
        assert f"M = 232448 // {dtype_bytes} = {m} elements" in out
        assert f"Bc = ceil(M / (4*64)) = {bc}" in out
    spec = load_spec(GPT2)
    plans = plan_spec(spec)
    sections = {(v.kind, v.head_dim, v.dtype_bytes, variant_score_bytes(spec, v)) for v in plans}
    assert {("fwd", 64, 2, 0), ("fwd", 64, 4, 0)} <= sections
    # one section per (kind, d, dtype size)
    assert out.count("Br = min(Bc, d) = 64") == len(sections)
    chosen = {f"chosen: {p.chosen.as_dict()}" for p in plans.values()}
    assert {ln for ln in out.splitlines() if ln.startswith("chosen: ")} == chosen
    assert "chosen: {'block_m': " in out
    # rejected candidates say why
    assert "> budget 232448 B" in out
    assert "no software pipelining" in out


def test_render_variant_prints_kernel_source(work):
    res = flashgen("render", "specs/gpt2.yaml", "--variant", "fwd_causal_d64_fp16", cwd=work)
    assert res.returncode == 0, res.stderr
    sha = hashlib.sha256(GPT2.read_bytes()).hexdigest()[:12]
    assert res.stdout.startswith(
        f"# @generated by flashgen from templates/fwd.py.j2 (spec gpt2.yaml sha {sha})")
    spec = load_spec(GPT2)
    assert res.stdout == render_package(spec, plan_spec(spec))["kernels/fwd_causal_d64_fp16.py"]
    assert list(work.iterdir()) == [work / "specs"]  # render writes nothing


def test_render_unknown_variant_names_the_available_ones(work):
    res = flashgen("render", "specs/gpt2.yaml", "--variant", "fwd_causal_d65_fp16", cwd=work)
    msg = assert_user_error(res, "render")
    assert "'fwd_causal_d65_fp16'" in msg
    names = [v.name for v in variants_for(load_spec(GPT2))]
    assert "fwd_causal_d64_fp16" in names and len(names) >= 6
    for name in names:
        assert name in msg, (name, msg)

    listing = flashgen("render", "specs/gpt2.yaml", cwd=work)
    assert listing.returncode == 0, listing.stderr
    first = listing.stdout.splitlines()[0]
    assert first.startswith("variants: " + ", ".join(names))
    # another kernel family's files are listed (and rendered) as <family>/<variant>
    others = first[len("variants: " + ", ".join(names)):].lstrip(", ")
    for other in filter(None, others.split(", ")):
        family, name = other.split("/")
        assert name in names, other
        res = flashgen("render", "specs/gpt2.yaml", "--variant", other, cwd=work)
        assert res.returncode == 0 and f"templates/{family}/" in res.stdout.splitlines()[0]
        break


def test_sram_bytes_the_error_suggests_builds(tmp_path):
    """The budget the sram_bytes error asks for is enough (and one byte less is not)."""
    for budget, code in ((20736, 0), (20735, 2)):  # the attn_mask (sdpa_mask) backward: its fp32 bias tile is staged too
        (tmp_path / "s.yaml").write_text("\n".join(GOOD).replace("232448", str(budget))
                                         + "\n")
        res = flashgen("build", "s.yaml", "--out", "out", cwd=tmp_path)
        assert res.returncode == code, (budget, res.stderr)


def test_version(tmp_path):
    from flashgen import __version__
    res = flashgen("--version", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == f"flashgen {__version__}"


@pytest.mark.parametrize("out", ["afile", "afile/sub"])
def test_build_out_a_file_exits_2(work, out):
    (work / "afile").write_text("not a folder")
    res = flashgen("build", "specs/gpt2.yaml", "--out", out, cwd=work)
    msg = assert_user_error(res, "build")
    assert msg.startswith(f"--out {out}"), msg


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc")
def test_build_out_unwritable_exits_2(work):
    """/proc takes no new folders (FileNotFoundError from mkdir): every OSError of the write
    is a one-line --out error, not a traceback."""
    res = flashgen("build", "specs/gpt2.yaml", "--out", "/proc/o", cwd=work)
    msg = assert_user_error(res, "build")
    assert msg.startswith("--out /proc/o: cannot write the package there: "), msg
    assert "/proc/o" in msg[len("--out /proc/o"):] and "pass --out a folder" in msg, msg


def test_plan_shows_the_gluon_section_for_hopper_only(work):
    """Gluon kernels run on sm_90 only: an RTX 4090 spec (arch: sm_89) gets one line saying
    its kernels are all `tl`; a spec without arch is planned for the H100 and gets the
    Hopper section."""
    res = flashgen("plan", ROOT / "specs" / "gpus" / "rtx4090.yaml", cwd=work)
    assert res.returncode == 0, res.stderr
    assert "gluon (" not in res.stdout and "sm90 with Triton" not in res.stdout
    assert ("== kernel families on RTX 4090 (sm_89): `tl` for every kernel (the Gluon "
            "kernels run on sm_90, Hopper, only)") in res.stdout
    res = flashgen("plan", "specs/gpt2.yaml", cwd=work)
    assert "== kernel families on sm90 with Triton" in res.stdout and "gluon (" in res.stdout
    # the MLA spec's 576/512 decode runs the Gluon latent kernel; its 192/128 one `tl`
    res = flashgen("plan", ROOT / "specs" / "mla.yaml", cwd=work)
    assert ("gluon (1): decode_causal_d576v512_bf16\n  the latent (MLA) decode kernel"
            in res.stdout), res.stdout
    assert "decode_causal_d576v512_bf16\n  why:" not in res.stdout


def test_check_planned_uses_the_specs_tiles(tmp_path, monkeypatch):
    """--planned forces the launch configs planned for the spec's GPU (on every device)."""
    import flashgen.check as check_module

    (tmp_path / "s.yaml").write_text("\n".join(GOOD).replace("[64]", "[16]") + "\n")
    seen = []
    real = check_module._check_training

    def spy(pkg, spec, variant, *args):
        seen.append(dict(pkg._runtime._override))
        return real(pkg, spec, variant, *args)
    monkeypatch.setattr(check_module, "_check_training", spy)
    import io
    out = io.StringIO()
    assert check_module.check(tmp_path / "s.yaml", quick=True, out=out, planned=True)
    assert "with the tiles planned for the spec's GPU (H100, 232448 B), tl family" in out.getvalue()
    assert seen and all(o == {"family": "tl"} for o in seen)
