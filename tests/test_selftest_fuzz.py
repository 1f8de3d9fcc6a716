"""`flashgen selftest`'s cases and fuzzer (flashgen/selftest/): the generator, the case
records and their reproducers, the judging of a case against the float64 reference --
which must pass on correct kernels and fail on broken outputs -- and a short fuzz run in
Triton's interpreter. The GPU group (shard `fuzz` of `flashgen selftest`) runs 100 fuzz
cases and the sanitizer's case set on CUDA (without the sanitizer); `flashgen selftest
--fuzz 2000` is the full run.

The selftest packages are built into a temporary cache (FLASHGEN_SELFTEST_CACHE), once
per module.
"""
import json
import os
import shlex
import subprocess
import sys

import pytest
import torch

from flashgen.selftest import fuzz as F
from flashgen.selftest import kinds, modref
from flashgen.selftest import workers as W
from flashgen.selftest.cases import KINDS, SANITIZE_CASES, Case, run_case
from flashgen.selftest.package import CACHE_ENV, selftest_packages

TINY = Case("train", "gpt2", "fp32", batch=1, h_q=2, h_kv=2, d=64, n_q=7, n_k=7, causal=True,
            tiles=16, seed=3)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    saved = os.environ.get(CACHE_ENV)
    os.environ[CACHE_ENV] = str(tmp_path_factory.mktemp("selftest-cache"))
    yield os.environ[CACHE_ENV]
    if saved is None:
        del os.environ[CACHE_ENV]
    else:
        os.environ[CACHE_ENV] = saved


@pytest.fixture(scope="module")
def gpt2(cache):
    return selftest_packages("cpu", ["gpt2"])


# ----------------------------------------------------------------------------------------
# The generator and the records (no kernels)
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_generate_is_deterministic_and_covers_every_kind(device):
    cases = F.generate(7, 120, device)
    assert cases == F.generate(7, 120, device)
    assert cases[:30] == F.generate(7, 30, device)  # a longer run extends a shorter one
    # (so fuzz(n, seed, start=k) is a slice of one longer run)
    assert cases != F.generate(8, 120, device)
    assert {c.kind for c in F.generate(7, len(KINDS), device)} == set(KINDS)
    assert {c.family for c in cases} == {"auto", "gluon", "tl"}
    assert {c.package for c in cases} == {"gpt2", "llama", "mla", "mods", "selftest"}
    # the odd shapes the issue names turn up
    dense = [c for c in cases if c.kind not in ("varlen", "decode", "paged_decode", "mla_decode")]
    assert any(c.n_q != c.n_k for c in dense) and any(c.n_q == 1 for c in dense)
    assert {c.h_q // c.h_kv for c in cases} >= {1, 2, 4, 8}
    assert {c.strided for c in cases} >= {"none", "heads", "pad", "odd", "bhnd", "qkv"}
    assert any(c.dropout for c in cases) and any(c.mods for c in cases)
    assert any(0 in c.seqlens_q or 0 in c.seqlens_k for c in cases if c.kind == "varlen")
    assert {c.d for c in cases} >= {64, 80, 96, 128, 192, 576}
    for c in cases:
        if c.kind == "varlen":
            assert sum(c.seqlens_q) and sum(c.seqlens_k)
        elif c.kind in ("decode", "paged_decode", "mla_decode"):
            assert len(c.seqlens_k) == c.batch
            assert all(0 <= n <= c.n_k - c.n_new for n in c.seqlens_k)
            assert not c.page_size or c.n_k % c.page_size == 0
        elif c.kind == "ring_merge":
            assert c.n_q == c.n_k
            if c.option("layout") == "zigzag":
                assert c.n_q % (64 if c.dropout else 2) == 0
        if device == "cpu":  # interpreter-sized
            assert max(c.n_q, c.n_k, *c.seqlens_q, *c.seqlens_k) <= 72
        else:
            assert c.tiles == 0
            if c.kind not in ("varlen", "decode", "paged_decode", "mla_decode"):
                assert c.batch * c.h_q * c.n_q * c.n_k <= F.CUDA_MAX_SCORES
                assert max(c.n_q, c.n_k) <= F.CUDA_MAX_N


def test_case_json_round_trip_and_reproducer():
    cases = F.generate(3, 60, "cpu") + F.generate(3, 60, "cuda") + SANITIZE_CASES
    for c in cases:
        text = c.to_json()
        assert "'" not in text and "\n" not in text
        assert Case.from_json(text) == c
        line = F.reproducer(c)
        assert line == f"flashgen selftest --fuzz-case '{text}'"
        assert shlex.split(line)[:3] == ["flashgen", "selftest", "--fuzz-case"]
        assert F.parse_reproducer(line) == c
    assert json.loads(TINY.to_json())["kind"] == "train"
    with pytest.raises(ValueError, match="unknown case field"):
        Case.from_json('{"kind": "train", "package": "gpt2", "colour": 1}')
    with pytest.raises(ValueError, match="case kind"):
        Case("training", "gpt2")
    with pytest.raises(ValueError, match="not a reproducer"):
        F.parse_reproducer("flashgen selftest --fuzz 10")


def test_sanitize_set_is_representative():
    seen = {c.kind for c in SANITIZE_CASES}
    assert {"train", "varlen", "decode", "paged_decode", "mla_decode", "block_mask",
            "ring_merge"} <= seen
    assert {c.family for c in SANITIZE_CASES} >= {"gluon", "tl"}
    dense = [c for c in SANITIZE_CASES if c.kind in ("train", "block_mask", "mods")]
    assert {1, 59, 257} <= {c.n_q for c in dense} and any(c.n_q != c.n_k for c in dense)
    assert any(c.h_q // c.h_kv == 8 for c in SANITIZE_CASES)
    assert any(c.strided != "none" for c in SANITIZE_CASES)
    assert any(c.d == 96 for c in SANITIZE_CASES) and any(c.dropout for c in SANITIZE_CASES)
    assert any(c.option("latent") for c in SANITIZE_CASES if c.kind == "mla_decode")


def test_deal_keeps_kernels_together():
    cases = F.generate(5, 80, "cuda")
    dealt = W.deal(cases, 4)
    assert sorted(i for d in dealt for i in d) == list(range(80))
    owner = {i: w for w, d in enumerate(dealt) for i in d}
    for i, a in enumerate(cases):
        for j, b in enumerate(cases):
            if (a.package, a.kind, a.dtype, a.d, a.causal, a.window, a.dropout, a.mods, a.family,
                    a.tiles) == (b.package, b.kind, b.dtype, b.d, b.causal, b.window, b.dropout,
                                 b.mods, b.family, b.tiles):
                assert owner[i] == owner[j]


def test_poison_and_layouts():
    with kinds.poisoned():
        assert torch.isnan(torch.empty(3)).all() and torch.isnan(torch.zeros(2).new_empty(4)).all()
        assert torch.isnan(torch.empty_like(torch.zeros(2))).all()
    assert not torch.isnan(torch.zeros(2).new_empty(4).fill_(0)).any()
    x = torch.randn(2, 5, 3, 8)
    for layout in ("none", "heads", "pad", "odd", "bhnd"):
        v = kinds.placed(x, layout, "cpu")
        assert torch.equal(v, x) and v.stride(-1) == 1
        memory = torch.tensor([]).set_(v.untyped_storage())  # the whole buffer
        # every element around the view is NaN: a kernel that strays reads NaN
        assert int(torch.isnan(memory).sum()) == memory.numel() - v.numel()
    assert kinds.placed(x, "odd", "cpu").stride(-2) == 9  # rows 36 bytes apart: no TMA
    assert not kinds.placed(x, "bhnd", "cpu").is_contiguous()


# ----------------------------------------------------------------------------------------
# Judging: correct kernels pass, broken outputs fail
# ----------------------------------------------------------------------------------------
def test_a_handful_of_fuzz_cases_pass(cache):
    report = F.fuzz(len(KINDS), 11, "cpu")
    assert report.cases_run == len(KINDS) and not report.skipped
    assert set(report.coverage()) == set(KINDS)
    assert report.passed == len(KINDS), report.summary()
    assert all(r.errors and max(r.errors.values()) <= 1 for r in report.results)


def _broken(monkeypatch, pkg, change):
    """Make pkg.flash_attn_func return change(out) (after autograd: grads unaffected)."""
    real = pkg.flash_attn_func

    def wrapped(*args, **kwargs):
        res = real(*args, **kwargs)
        out, rest = (res[0], res[1:]) if isinstance(res, tuple) else (res, ())
        out = out + (change(out.detach()) - out.detach())
        return (out, *rest) if rest else out

    monkeypatch.setattr(pkg, "flash_attn_func", wrapped)


def test_broken_outputs_are_caught(gpt2, monkeypatch):
    pkg = gpt2["gpt2"]
    assert run_case(TINY, gpt2, "cpu").passed

    with monkeypatch.context() as m:  # off by 1e-3: 50x fp32's tolerance
        _broken(m, pkg, lambda o: o + 1e-3)
        r = run_case(TINY, gpt2, "cpu")
    assert r.failed and r.errors["out"] > 1 and "out" in r.message

    def hole(o):  # one element never written
        o = o.clone()
        o[0, 3, 1, 5] = float("nan")
        return o

    with monkeypatch.context() as m:
        _broken(m, pkg, hole)
        r = run_case(TINY, gpt2, "cpu")
    assert r.failed and "1 of" in r.message and "NaN" in r.message

    with monkeypatch.context() as m:  # a wrong reference gradient: dq, dk, dv fail
        real = modref.attention_ref
        m.setattr(modref, "attention_ref", lambda q, *a, **k: real(q * 1.01, *a, **k))
        r = run_case(TINY, gpt2, "cpu")
    assert r.failed and r.errors["dq"] > 1 and r.errors["dk"] > 1

    def boom(*args, **kwargs):
        raise RuntimeError("triton.CompilationError: out of resources\nsecond line")

    with monkeypatch.context() as m:
        m.setattr(pkg, "flash_attn_func", boom)
        r = run_case(TINY, gpt2, "cpu")
    assert r.failed and r.message.startswith("RuntimeError: triton.CompilationError") \
        and "second line" not in r.message


def test_rows_that_see_no_key_must_be_exactly_zero(gpt2, monkeypatch):
    """Causal, Nq > Nk: the first rows see no key. Within tolerance is not enough."""
    case = Case("train", "gpt2", "fp32", h_q=2, h_kv=2, d=64, n_q=9, n_k=4, causal=True, seed=5)
    assert run_case(case, gpt2, "cpu").passed

    def tiny(o):
        o = o.clone()
        o[:, 0] = 1e-30
        return o

    _broken(monkeypatch, gpt2["gpt2"], tiny)
    r = run_case(case, gpt2, "cpu")
    assert r.failed and "see no key are not 0" in r.message and r.errors["out"] <= 1


def test_dropout_is_judged_by_the_replayed_mask(gpt2, monkeypatch):
    case = Case("train", "gpt2", "fp32", h_q=2, h_kv=2, d=64, n_q=33, n_k=20, dropout=0.3,
                tiles=16, seed=8)
    first = run_case(case, gpt2, "cpu")
    torch.rand(7)  # (the generator elsewhere: the case seeds its own draw)
    again = run_case(case, gpt2, "cpu")
    assert first.passed and first.errors == again.errors  # the same mask both times
    # the same call judged by another draw's mask fails
    real = gpt2["gpt2"].dropout_mask
    monkeypatch.setattr(gpt2["gpt2"], "dropout_mask",
                        lambda *a, **k: real(*a, **k).roll(1, dims=-1))
    assert run_case(case, gpt2, "cpu").failed


def test_backward_reference_is_the_exact_backward_of_the_stored_output():
    """dS = P (dP - D) with D from the stored output: the exact gradients plus
    scale * (P dD) K for dq and scale * (P dD)^T Q for dk, dD = rowsum(dO (O - stored))."""
    from flashgen.reference import attention_ref

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 2, n, 8, generator=g, dtype=torch.float64) for n in (5, 7, 7, 5))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    vis = torch.ones(5, 7, dtype=torch.bool)
    out, lse = attention_ref(q, k, v, vis)
    stored = out.detach() + 1e-3 * torch.randn(out.shape, generator=g, dtype=torch.float64)
    t = lambda x: x.transpose(1, 2)  # noqa: E731  (B, H, N, d) -> (B, N, H, d)
    exact = torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
    got = kinds.backward_reference(t(out), lse, [q, k, v], t(do), t(stored), (0, 2, 1))
    p = torch.exp(q.detach() @ k.detach().transpose(-1, -2) / 8 ** 0.5 - lse.detach()[..., None])
    dd = ((out.detach() - stored) * do).sum(-1, keepdim=True)
    torch.testing.assert_close(got[0], exact[0] + (p * dd) @ k.detach() / 8 ** 0.5)
    torch.testing.assert_close(got[1], exact[1] + (p * dd).transpose(-1, -2) @ q.detach() / 8 ** 0.5)
    torch.testing.assert_close(got[2], exact[2])


def test_one_key_seen_by_many_rows(gpt2, cache):
    """Every row sees the one key: dS = 0 exactly, and dK gathers 54 rows' roundings of
    D = rowsum(dO * O) -- within tolerance only against the stored output's backward."""
    packages = selftest_packages("cpu", ["selftest"])
    case = Case("train", "selftest", "bf16", h_q=2, h_kv=1, d=80, n_q=27, n_k=1, dropout=0.1,
                strided="bhnd", tiles=32, seed=1443290321)
    assert run_case(case, packages, "cpu").passed


def test_gluon_case_runs_tl_here_and_says_so(gpt2):
    r = run_case(Case("train", "gpt2", "fp16", n_q=5, n_k=5, family="gluon", seed=1), gpt2, "cpu")
    assert r.passed and r.note.startswith("family gluon ran as tl")
    report = F.FuzzReport(0, "cpu", [r])
    assert report.notes == {r.note: 1} and "note: 1 x family gluon ran as tl" in report.summary()


def test_failures_carry_reproducers():
    bad = F.run_many([TINY, Case("train", "gpt2", "fp32", d=48, seed=2)], "cpu")
    assert bad.passed == 1 and len(bad.failed) == 1
    failure = bad.failed[0]
    assert "ValueError" in failure.message and "48" in failure.message
    assert F.parse_reproducer(failure.reproducer) == failure.case
    assert failure.reproducer in bad.summary()


def test_workers_return_results_in_case_order(cache):
    cases = [TINY, Case("decode", "llama", "bf16", batch=2, h_q=4, h_kv=1, d=128, n_q=1,
                        n_k=20, seqlens_k=(3, 19), n_new=1, causal=True, seed=4),
             Case("train", "gpt2", "fp32", d=48, seed=2)]
    seen = []
    report = F.run_many(cases, "cpu", workers=2, progress=lambda d, t, r: seen.append(d))
    assert [r.case for r in report.results] == cases and sorted(seen) == [1, 2, 3]
    assert [r.passed for r in report.results] == [True, True, False]


def test_cases_command_line(cache):
    ok, bad = TINY.to_json(), Case("train", "gpt2", "fp32", d=48).to_json()
    run = subprocess.run([sys.executable, "-m", "flashgen.selftest.cases", "--device", "cpu",
                          "--case", ok, "--case", bad], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    lines = run.stdout.splitlines()
    assert run.returncode == 1, run.stdout + run.stderr
    assert lines[0].startswith("ok") and lines[1].startswith("FAIL")
    assert "2 cases: 1 passed" in lines[2]


# ----------------------------------------------------------------------------------------
# On a GPU
# ----------------------------------------------------------------------------------------
def _gpu_workers() -> int:
    """Worker processes for a GPU test: half the cores, at most 8 (the shard runs two)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


@pytest.mark.gpu
def test_fuzz_on_cuda(cache):
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    report = F.fuzz(100, 0, "cuda", workers=_gpu_workers())
    print(report.summary())
    assert report.cases_run == 100 and not report.failed, report.summary()


@pytest.mark.gpu
def test_sanitize_set_passes_on_cuda(cache):
    """The sanitizer's cases, without the sanitizer (`flashgen selftest --sanitize` runs
    them under it)."""
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    report = F.run_many(SANITIZE_CASES, "cuda", workers=_gpu_workers(), ref_device="cpu")
    assert report.passed == len(SANITIZE_CASES), report.summary()


# Wrong answers the fuzzer and the sanitize set found on an H100 (2026-11-28): the `tl`
# forward on V rows not 16-element aligned (a 1- or 8-element pad) at a split head dim (80,
# 96) -- 17-67x the tolerance in the narrow chunk's columns; Triton 3.6 miscompiles that
# chunk's P @ V on Hopper, and the runtime now copies such V (_plans.v_in_place).
FOUND_ON_THE_GPU = [
    '{"kind":"train","package":"selftest","h_q":4,"h_kv":1,"d":96,"n_q":257,"n_k":257,'
    '"window":[64,0],"strided":"pad","family":"tl","seed":3}',
    '{"kind":"varlen","package":"selftest","h_q":8,"d":80,"window":[75,-1],"dropout":0.1,'
    '"seqlens_q":[264,1],"seqlens_k":[264,1],"strided":"pad","family":"tl","seed":329754793}',
    '{"kind":"train","package":"selftest","batch":2,"h_kv":1,"d":80,"n_q":1177,"n_k":1177,'
    '"causal":true,"window":[851,0],"dropout":0.5,"strided":"odd","family":"tl",'
    '"seed":857220855}',
    '{"kind":"varlen","package":"selftest","d":80,"causal":true,"window":[667,0],'
    '"dropout":0.5,"options":{"q_scale":0.25},"seqlens_q":[1,1,76,1224,1,26,46,44],'
    '"seqlens_k":[1,98,1,1224,1,0,496,44],"strided":"pad","seed":509681791}',
]


@pytest.mark.gpu
@pytest.mark.parametrize("text", FOUND_ON_THE_GPU, ids=range(len(FOUND_ON_THE_GPU)))
def test_found_on_the_gpu(cache, text):
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    case = Case.from_json(text)
    result = run_case(case, selftest_packages("cuda", [case.package]), "cuda")
    assert result.passed, result.line()


def test_found_on_the_gpu_passes_in_the_interpreter(cache):
    """The first of them, in the interpreter (where it passes: the defect is the compiled
    kernel's), so the case itself stays runnable and right."""
    case = Case.from_json(FOUND_ON_THE_GPU[0])
    result = run_case(case, selftest_packages("cpu", [case.package]), "cpu")
    assert result.passed, result.line()


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["handover", "tma", "noshared"])
def test_racecheck_control_kernel_is_right(mode):
    """The control kernel `--sanitize` runs under racecheck (selftest/control.py) is right
    on this GPU: the kinds of report it draws are then the tool's, not the kernel's."""
    if not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the control is a Hopper (sm90) Gluon kernel")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "flashgen.selftest.control", mode],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0 and f"{mode}: right" in proc.stdout, proc.stdout + proc.stderr
