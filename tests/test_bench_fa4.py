"""FlashAttention-4 (`fa4`) as a bench provider, on the CPU: listed like the other
providers, skipped with the reason when flash_attn.cute is absent or the GPU is not
sm90/sm100, and its calls' arguments (layouts, causal and window, scale, GQA, varlen,
decode) checked against a fake `flash_attn.cute` that records them and computes real
attention in FA4's (B, N, H, d) layout."""
from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

import pytest

from flashgen.bench import fa4 as bench_fa4
from flashgen.bench import providers, report, runner, suites
from flashgen.bench import varlen as bv

from test_bench import flashgen

torch = pytest.importorskip("torch")


def attend(q, k, v, scale, causal, window):
    """float64 attention in FA4's layout: q (B, Nq, H, d), k/v (B, Nk, H_kv, d); causal and
    the window aligned bottom-right, a None side of the window unbounded."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = (q @ k.transpose(-2, -1)) * scale
    nq, nk = s.shape[-2:]
    rel = torch.arange(nk)[None, :] - torch.arange(nq)[:, None] - (nk - nq)  # key - query
    left, right = window
    keep = torch.ones(nq, nk, dtype=torch.bool)
    if causal or right is not None:
        keep &= rel <= (0 if causal else right)
    if left is not None:
        keep &= rel >= -left
    s = s.masked_fill(~keep, float("-inf"))
    return (torch.softmax(s, -1) @ v).transpose(1, 2)


class FakeFA4(types.ModuleType):
    """flash_attn.cute's two calls: records each call's arguments and returns real attention
    (as (out, lse) or out alone, like different FA4 versions)."""

    def __init__(self, tuple_out=True):
        super().__init__("flash_attn.cute")
        self.calls, self.tuple_out = [], tuple_out

    def _result(self, out):
        out = out.to(torch.bfloat16)
        return (out, torch.zeros(1)) if self.tuple_out else out

    def flash_attn_func(self, q, k, v, *args, softmax_scale=None, causal=False,
                        window_size=(None, None), num_splits=1, **kw):
        self.calls.append(dict(fn="func", q=q, k=k, v=v, args=args, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, num_splits=num_splits,
                               **kw))
        return self._result(attend(q, k, v, softmax_scale, causal, window_size))

    def flash_attn_varlen_func(self, q, k, v, *args, cu_seqlens_q=None, cu_seqlens_k=None,
                               max_seqlen_q=None, max_seqlen_k=None, softmax_scale=None,
                               causal=False, window_size=(None, None), **kw):
        self.calls.append(dict(fn="varlen", q=q, k=k, v=v, args=args, cu_seqlens_q=cu_seqlens_q,
                               cu_seqlens_k=cu_seqlens_k, max_seqlen_q=max_seqlen_q,
                               max_seqlen_k=max_seqlen_k, softmax_scale=softmax_scale,
                               causal=causal, window_size=window_size, **kw))
        if cu_seqlens_q is None:  # decode: (B, 1, H, d) against a cache or a page pool
            table, used = kw.get("page_table"), kw["seqused_k"]
            if table is not None:
                k, v = (t[table.long()].flatten(1, 2) for t in (k, v))
            return self._result(torch.cat([attend(q[b:b + 1], k[b:b + 1, :used[b]],
                                                  v[b:b + 1, :used[b]], softmax_scale, False,
                                                  (None, None)) for b in range(q.shape[0])]))
        bounds = cu_seqlens_q.tolist()
        return self._result(torch.cat([
            attend(q[None, a:b], k[None, a:b], v[None, a:b], softmax_scale, causal,
                   window_size)[0] for a, b in zip(bounds, bounds[1:])]))


@pytest.fixture
def fake(monkeypatch):
    """A fake FA4 installed as flash_attn.cute on an sm90 GPU."""
    module = FakeFA4()
    monkeypatch.setitem(sys.modules, "flash_attn", types.ModuleType("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    monkeypatch.setattr(bench_fa4, "capability", lambda: (9, 0))
    return module


@pytest.fixture(params=["no flash_attn", "flash_attn without cute"])
def absent(monkeypatch, request):
    """FA4 not importable, whatever this machine has installed: no flash_attn at all, or
    one without .cute (FlashAttention-2's package)."""
    monkeypatch.delitem(sys.modules, "flash_attn.cute", raising=False)
    if request.param == "no flash_attn":
        monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
        monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p) / "flash_attn")
                                          .exists()])
    else:
        fa2 = types.ModuleType("flash_attn")
        fa2.__path__ = []
        monkeypatch.setitem(sys.modules, "flash_attn", fa2)


def bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(torch.bfloat16)


def reference(q, k, v, scale, causal=False, window=(None, None)):
    """The bench's layout (B, H, N, d) through the fake's float64 attention."""
    return attend(*(t.transpose(1, 2) for t in (q, k, v)), scale, causal,
                  window).transpose(1, 2)


# ----------------------------------------------------------------------------------------
# listed like the other providers
# ----------------------------------------------------------------------------------------

def test_fa4_is_listed_in_help_and_dry_run(tmp_path):
    res = flashgen("bench", "--help", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    assert "sdpa_efficient, fa4, flex" in text and "FlashAttention-4" in text
    res = flashgen("bench", "--dry-run", "--suite", "all", "--n", "4096", "--d", "128",
                   cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    line = next(x for x in lines if x.startswith("  training bwd d=128 causal"))
    assert line.endswith("sdpa_flash, sdpa_cudnn, fa4, flex, naive")
    assert "fa4" in next(x for x in lines if x.startswith("  decode "))
    assert "fa4" not in next(x for x in lines if x.startswith("  dropout "))  # no dropout
    assert "fa4" not in next(x for x in lines if x.startswith("  mods "))
    assert any(x.startswith("  fa4: FlashAttention-4 (flash-attn-4") for x in lines)
    res = flashgen("bench", "--dry-run", "--providers", "flashgen", "fa4", "--mode", "bwd",
                   "--d", "64", "--n", "2048", cwd=tmp_path)
    assert res.returncode == 0, res.stderr
    assert "training bwd d=64 full   B=8 H=32 N=2048: flashgen, flashgen_tl, fa4" in res.stdout
    assert "bench_training_bwd_d64_n2048_flashgen-fa4" in res.stdout


def test_varlen_plan_has_fa4_varlen(capsys):
    cases = bv.plan(modes=("fwd",))
    assert [c["provider"] for c in cases][-1] == "fa4_varlen"
    assert bv.main(["--dry-run", "--providers", "fa4_varlen", "flashgen_varlen"]) == 0
    assert "fwd fa4_varlen" in capsys.readouterr().out
    rows = [dict(mode="fwd", provider="flashgen_varlen", tflops=300.0),
            dict(mode="fwd", provider="fa4_varlen", tflops=400.0)]
    assert "fwd: varlen / fa4_varlen = 0.750 (no bar)" in bv.bar_text(rows)


# ----------------------------------------------------------------------------------------
# skipped, with the reason
# ----------------------------------------------------------------------------------------

def training_case(mode="fwd", causal=True, n=64, d=64, h=2, b=2, names=("fa4",)):
    return suites.Case("training", mode, d, causal, b, h, n, providers=names)


def test_absent_fa4_is_skipped_naming_the_package_and_how_to_get_it(absent):
    with pytest.raises(bench_fa4.Unavailable) as e:
        providers.Providers().get("fa4", training_case())
    reason = str(e.value)
    assert reason.startswith("flash-attn-4 is not installed (no module flash_attn.cute)")
    assert "pip install flash-attn-4" in reason
    assert "docs/H100_ANCHORS.md#fa4" in reason and "/tmp/fa4-site/env.sh" in reason


def test_missing_dependency_and_broken_import_are_named(monkeypatch):
    real = importlib.import_module

    def import_module(name, *a):
        if name == "flash_attn.cute":
            raise ModuleNotFoundError("No module named 'cutlass'", name="cutlass")
        return real(name, *a)
    monkeypatch.setattr(importlib, "import_module", import_module)
    with pytest.raises(bench_fa4.Unavailable, match=r"needs the module 'cutlass', which is not "
                       r"installed; install flash-attn-4 with its dependencies"):
        bench_fa4.load()

    def broken(name, *a):
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(importlib, "import_module", broken)
    with pytest.raises(bench_fa4.Unavailable, match=r"flash_attn.cute \(flash-attn-4\) failed "
                       r"to import: OSError: libcuda.so.1"):
        bench_fa4.load()


@pytest.mark.parametrize("cap, why", [((8, 0), "this GPU is sm80"), ((12, 0), "this GPU is "
                                      "sm120"), (None, "no CUDA GPU")])
def test_other_gpus_are_skipped(fake, monkeypatch, cap, why):
    monkeypatch.setattr(bench_fa4, "capability", lambda: cap)
    with pytest.raises(bench_fa4.Unavailable) as e:
        providers.Providers().get("fa4", training_case())
    assert str(e.value) == f"flash-attn-4 runs on sm90/sm100 GPUs only; {why}"
    monkeypatch.setattr(bench_fa4, "capability", lambda: (10, 0))  # sm100 runs
    assert providers.Providers().get("fa4", training_case()) is not None


def test_runner_reports_a_skipped_provider_once_with_its_reason(absent):
    """The real check-and-skip path of the runner (on the CPU: a skipped provider never
    reaches the timing): each case's row says skipped, the log gives the reason once and
    the markdown lists it under the tables."""
    logs = []
    cases = [training_case(causal=c) for c in (False, True)]
    rows = runner.measure_attention(cases, {"gpu": "cpu"}, log=logs.append, device="cpu")
    assert [r["provider"] for r in rows] == ["fa4", "fa4"]
    assert all(r["status"].startswith("skipped: flash-attn-4 is not installed") for r in rows)
    assert all("ms" not in r and "tflops" not in r for r in rows)
    told = [x for x in logs if x.startswith("fa4: skipped: ")]
    assert len(told) == 1 and "pip install flash-attn-4" in told[0]
    md = report.markdown_tables(rows + [dict(rows[0], provider="flashgen", status="ok",
                                             tflops=100.0)])
    assert "| 2 | 64 | skipped | 100.0 | – |" in md  # no ratio to a skipped peer
    assert md.count("- fa4: skipped: flash-attn-4 is not installed") == 1


# ----------------------------------------------------------------------------------------
# the calls' arguments, through the fake
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("tuple_out", [True, False])
@pytest.mark.parametrize("causal", [False, True])
def test_training_provider_maps_layout_causal_and_scale(fake, tuple_out, causal):
    fake.tuple_out = tuple_out
    # Nq < Nk: under a causal mask every query row still sees a key (bottom-right)
    q, k, v = bf16(2, 4, 40, 64, seed=1), bf16(2, 4, 48, 64, seed=2), bf16(2, 4, 48, 64, seed=3)
    fn = providers.Providers().get("fa4", training_case(causal=causal))
    out = fn(q, k, v, causal, 0.0)
    call = fake.calls[-1]
    assert call["fn"] == "func" and call["args"] == ()  # nothing positional after v (qv)
    # (B, H, N, d) in as (B, N, H, d) views of the same memory: no copy is timed
    assert call["q"].shape == (2, 40, 4, 64) and call["k"].shape == (2, 48, 4, 64)
    assert call["q"].data_ptr() == q.data_ptr() and call["v"].data_ptr() == v.data_ptr()
    assert call["causal"] is causal and call["window_size"] == (None, None)
    assert call["softmax_scale"] == pytest.approx(1 / 8)
    assert out.shape == (2, 4, 40, 64)
    ref = reference(q, k, v, 1 / 8, causal)
    assert (out.double() - ref).abs().max() < 2e-2
    with pytest.raises(NotImplementedError, match="no dropout"):
        fn(q, k, v, causal, 0.1)


def test_runner_check_passes_the_fa4_provider_and_flags_a_layout_slip(fake, monkeypatch):
    case = training_case(causal=True, n=64)
    q, k, v = (bf16(2, 2, 64, 64, seed=s) for s in (4, 5, 6))
    ref = runner._reference(q, k, v, True)
    fn = providers.Providers().get("fa4", case)
    assert runner._check(fn, q, k, v, case, ref) is None
    # an output handed back in FA4's own layout (B, N, H, d) is WRONG, not timed (at H = N,
    # where the shapes agree and only the values tell)
    monkeypatch.setattr(bench_fa4, "_out", lambda r: (r[0] if isinstance(r, tuple) else r)
                        .transpose(1, 2))
    case = training_case(causal=False, n=4, h=4)
    q, k, v = (bf16(2, 4, 4, 64, seed=s) for s in (4, 5, 6))
    wrong = runner._check(fn, q, k, v, case, runner._reference(q, k, v, False))
    assert wrong is not None and wrong.startswith("WRONG (max err"), wrong


@pytest.mark.parametrize("window, expect", [
    (None, (None, None)), ((-1, -1), (None, None)), ((-1, 0), (None, 0)),
    ((16, -1), (16, None)), ((8, 4), (8, 4)), ((None, 3), (None, 3))])
def test_window_maps_negative_sides_to_unbounded(fake, window, expect):
    q, k, v = (bf16(1, 2, 32, 32, seed=s) for s in (7, 8, 9))
    out = bench_fa4.attention(fake, q, k, v, window=window, scale=0.3)
    call = fake.calls[-1]
    assert call["window_size"] == expect and call["softmax_scale"] == 0.3
    assert (out.double() - reference(q, k, v, 0.3, False, expect)).abs().max() < 2e-2


def test_gqa_heads_pass_through_and_bad_ratios_are_refused(fake):
    q, k, v = bf16(1, 8, 32, 32, seed=1), bf16(1, 2, 32, 32, seed=2), bf16(1, 2, 32, 32, seed=3)
    out = bench_fa4.attention(fake, q, k, v, causal=True)
    call = fake.calls[-1]
    assert call["q"].shape[2] == 8 and call["k"].shape[2] == 2 and call["v"].shape[2] == 2
    assert call["softmax_scale"] == pytest.approx(32 ** -0.5)  # the default follows d
    assert out.shape == (1, 8, 32, 32)
    assert (out.double() - reference(q, k, v, 32 ** -0.5, True)).abs().max() < 2e-2
    with pytest.raises(ValueError, match="8 query heads are not a multiple of 3"):
        bench_fa4.attention(fake, q, bf16(1, 3, 32, 32), bf16(1, 3, 32, 32))
    assert len(fake.calls) == 1  # refused before FA4 is called


@pytest.mark.parametrize("tuple_out", [True, False])
def test_varlen_call(fake, tuple_out):
    fake.tuple_out = tuple_out
    lengths = [5, 17, 10]
    cu = torch.tensor(bv.cu_seqlens(lengths), dtype=torch.int32)
    q, k, v = (bf16(32, 4, 64, seed=s) for s in (1, 2, 3))
    k, v = k[:, :2], v[:, :2]  # GQA 4/2
    out = bench_fa4.varlen_attention(fake, q, k, v, cu, cu, 17, 17, causal=True)
    call = fake.calls[-1]
    assert call["fn"] == "varlen" and call["args"] == ()
    assert call["cu_seqlens_q"] is cu and call["cu_seqlens_k"] is cu
    assert (call["max_seqlen_q"], call["max_seqlen_k"]) == (17, 17)
    assert call["causal"] is True and call["softmax_scale"] == pytest.approx(1 / 8)
    assert out.shape == (32, 4, 64)
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):  # each document on its own
        ref = attend(q[None, a:b], k[None, a:b], v[None, a:b], 1 / 8, True, (None, None))[0]
        assert (out[a:b].double() - ref).abs().max() < 2e-2


def test_decode_calls(fake):
    b, n, page = 2, 8, 4
    q, kc, vc = bf16(b, 1, 8, 64, seed=1), bf16(b, n, 2, 64, seed=2), bf16(b, n, 2, 64, seed=3)
    out = bench_fa4.decode(fake, q, kc, vc)
    call = fake.calls[-1]
    assert call["fn"] == "func" and call["num_splits"] == 0 and call["causal"] is False
    assert out.shape == (b, 1, 8, 64)
    ref = attend(q, kc, vc, 1 / 8, False, (None, None))
    assert (out.double() - ref).abs().max() < 2e-2
    # the same keys in a shuffled page pool, read through the page table
    table = torch.tensor([[3, 0], [2, 1]], dtype=torch.int32)
    pool_k, pool_v = (torch.empty(4, page, 2, 64, dtype=torch.bfloat16) for _ in range(2))
    for src, pool in ((kc, pool_k), (vc, pool_v)):
        pool[table.flatten().long()] = src.reshape(b * 2, page, 2, 64)
    used = torch.full((b,), n, dtype=torch.int32)
    paged = bench_fa4.decode(fake, q, pool_k, pool_v, used, table)
    call = fake.calls[-1]
    assert call["fn"] == "varlen" and call["page_table"] is table and call["seqused_k"] is used
    assert call["num_splits"] == 0 and call["cu_seqlens_q"] is None
    assert (paged.double() - ref).abs().max() < 2e-2


def test_version_names_the_distribution(monkeypatch):
    import importlib.metadata as md
    monkeypatch.setattr(md, "version", lambda name: {"flash-attn-4": "4.0.0b36"}[name])
    assert bench_fa4.version() == "4.0.0b36"

    def missing(name):
        raise md.PackageNotFoundError(name)
    monkeypatch.setattr(md, "version", missing)
    assert bench_fa4.version() is None
