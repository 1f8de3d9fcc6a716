"""The training suite's fp8 rows on the CPU (flashgen/bench/fp8.py): flashgen_fp8 runs the
package's fp8 kernels in the interpreter against float64 on the dequantized inputs and
quantizes each input once however often it is called; cudnn_fp8 is skipped with the reason
where cuDNN's frontend is absent; both run only when named; the timed forward is the
provider's `timed` form (cuDNN's graph without the check's dequantization)."""
from __future__ import annotations

import sys

import pytest

from flashgen.resources import bundled_spec
from flashgen.bench import providers, runner, suites, timing

torch = pytest.importorskip("torch")

TOL = 0.1  # P rounded to e4m3 for P V: 2^-4 relative an element (check.py's fp8 note)


def case(mode="fwd", causal=True, n=40):
    return suites.Case("training", mode, 64, causal, 2, 2, n,
                       providers=("flashgen_fp8", "cudnn_fp8"))


def attention64(q, k, v, causal):
    s = (q @ k.transpose(-2, -1)) * q.shape[-1] ** -0.5
    if causal:
        n = s.shape[-1]
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def test_fp8_rows_run_only_when_named():
    plain = suites.plan_cases("training", ns=[512], ds=[64], modes=("fwd",))
    assert not any(p in c.providers for c in plain for p in suites.FP8_PROVIDERS)
    named = suites.plan_cases("training", ns=[512], ds=[64], modes=("fwd",),
                              providers=["flashgen", "flashgen_fp8", "cudnn_fp8"])
    assert all({"flashgen", "flashgen_fp8", "cudnn_fp8"} <= set(c.providers) for c in named)


def test_flashgen_fp8_gluon_row_forces_the_family_and_gives_it_back():
    """flashgen_fp8_gluon (the Gluon fp8 forward, opt-in: an interleaved A/B against
    flashgen_fp8) forces the package's family per call; flashgen_fp8 gives it back (in the
    interpreter both run `tl`)."""
    named = suites.plan_cases("training", ns=[512], ds=[128], modes=("fwd",),
                              providers=["flashgen_fp8", "flashgen_fp8_gluon"])
    assert all({"flashgen_fp8", "flashgen_fp8_gluon"} <= set(c.providers) for c in named)
    q, k, v = (torch.randn(2, 2, 40, 64).to(torch.bfloat16) for _ in range(3))
    pkg, _ = providers.load_package(bundled_spec(suites.FP8_SPECS[64]))
    gluon = providers.Providers().get("flashgen_fp8_gluon", case())
    assert torch.isfinite(gluon(q, k, v, True, 0.0)).all()
    assert pkg._runtime._FORCED_FAMILY == "gluon"
    providers.Providers().get("flashgen_fp8", case())(q, k, v, True, 0.0)
    assert pkg._runtime._FORCED_FAMILY == ""


@pytest.mark.parametrize("causal", [False, True])
def test_flashgen_fp8_against_float64_quantizing_once(monkeypatch, causal):
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    pkg, _ = providers.load_package(bundled_spec(suites.FP8_SPECS[64]))
    quantize, seen = pkg.quantize_fp8, []
    monkeypatch.setattr(pkg, "quantize_fp8", lambda *a, **kw: seen.append(1) or quantize(*a, **kw))
    fn = providers.Providers().get("flashgen_fp8", case(causal=causal))
    out = fn(q, k, v, causal, 0.0)
    fn(q, k, v, causal, 0.0)
    assert len(seen) == 3  # q, k, v once, not again on the second call
    deq = [x.double() * d.double() for x, d in (quantize(t, "tensor") for t in (q, k, v))]
    ref = attention64(*deq, causal)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    err = (out.double() - ref).abs().max().item()
    assert err < TOL, err


def test_flashgen_fp8_backward_reaches_the_bf16_inputs():
    fn = providers.Providers().get("flashgen_fp8", case(mode="bwd"))
    q, k, v = (torch.randn(2, 2, 40, 64).to(torch.bfloat16).requires_grad_() for _ in range(3))
    call, grads = timing.timed_call(fn, q, k, v, case(mode="bwd"))
    call()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in grads)


def test_cudnn_fp8_skipped_with_its_reason_where_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # import cudnn raises ImportError
    logs = []
    rows = runner.measure_attention([case()], {"gpu": "cpu"}, log=logs.append, device="cpu")
    row = {r["provider"]: r for r in rows}
    assert row["cudnn_fp8"]["status"].startswith("skipped: nvidia-cudnn-frontend is not installed")
    assert any(x.startswith("cudnn_fp8: skipped:") and "p4" in x for x in logs)


def test_the_timed_forward_is_the_providers_timed_form():
    calls = []

    def fn(q, k, v, causal, p):
        calls.append("checked")

    fn.timed = lambda q, k, v, causal, p: calls.append("timed")
    call, grads = timing.timed_call(fn, None, None, None, case())
    call()
    assert calls == ["timed"] and grads is None


def test_runner_checks_fp8_rows_on_their_dequantized_inputs():
    """A causal row's first output is V's first row: e4m3's rounding of V alone (2^-4) is
    far past the bf16 rows' 3e-2 against the bf16 inputs, so fp8 rows are checked on the
    inputs they saw (their e4m3 copies dequantized) at FP8_TOL; a wrong output still fails."""
    c = case(causal=True)
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(2, 2, 40, 64, generator=g).to(torch.bfloat16) for _ in range(3))
    v = v * 4
    fn = providers.Providers().get("flashgen_fp8", c)
    out = fn(q, k, v, True, 0.0)
    bf16_ref = runner._reference(q, k, v, True)
    assert (out[:1, :2].float() - bf16_ref).abs().max().item() > runner.TOL  # the old check
    assert runner._check(fn, q, k, v, c, bf16_ref) is None

    def shifted(*a):
        return fn(*a) + 0.5
    shifted.dequantized, shifted.tol = fn.dequantized, fn.tol
    wrong = runner._check(shifted, q, k, v, c, bf16_ref)
    assert wrong is not None and wrong.startswith("WRONG (max err"), wrong
