"""The chunked-prefill benchmark's pure parts and its inputs on the CPU
(flashgen/bench/prefill.py): contexts and FLOPs, the plan and its refusals, the dry run,
and that each page size's shuffled pool holds exactly the packed keys (the paged and the
packed calls then agree in the interpreter, as the GPU run checks before timing)."""
from __future__ import annotations

import pytest

from flashgen.bench import prefill

torch = pytest.importorskip("torch")


def test_contexts_spread_evenly_and_flops_count_visible_pairs():
    assert prefill.contexts(5, 16) == [0, 4, 8, 12, 16]
    assert prefill.contexts(1, 7) == [7]
    # one sequence, context 2, chunk 3: new tokens see 3, 4, 5 keys = 12 pairs
    assert prefill.prefill_flops([2], 3, h=1, d=1) == 4.0 * 12


def test_plan_dry_run_and_refusals():
    cases = prefill.plan()
    assert [c["provider"] for c in cases] == ["flashgen_paged16", "flashgen_paged64",
                                              "flashgen_varlen", "flashgen_bi_paged16",
                                              "flashgen_bi_paged64", "flashgen_bi_varlen",
                                              "fa4_paged16", "fa4_paged64", "fa4_varlen"]
    assert cases[0]["contexts"][0] == 0 and cases[0]["contexts"][-1] == 16384
    text = prefill.dry_run_text(cases)
    assert "32 sequences x 512 new tokens" in text and "H=32/8" in text
    for kw, message in [(dict(h=30), "multiple of --h-kv"), (dict(d=64), "d = 128"),
                        (dict(seqs=0), "at least 1"), (dict(providers=["x"]), "unknown")]:
        with pytest.raises(ValueError, match=message):
            prefill.plan(**kw)
    assert prefill.main(["--dry-run", "--seqs", "4"]) == 0
    assert prefill.main(["--h", "30"]) == 2


def test_paged_pools_hold_the_packed_keys():
    case = prefill.plan(seqs=3, chunk=5, max_context=40, h=4, h_kv=2)[0]
    q, k, v, cu_q, cu_k, max_k, paged = prefill.inputs(dict(case, d=128), (16, 7), "cpu")
    assert q.shape == (15, 4, 128) and cu_k.tolist() == [0, 5, 30, 75] and max_k == 45
    for p, (pk, pv, table, used) in paged.items():
        assert used.tolist() == [5, 25, 45]
        for i, n in enumerate(used.tolist()):
            rows = torch.arange(n)
            got = pk[table[i, rows // p].long(), rows % p]
            assert torch.equal(got, k[cu_k[i]:cu_k[i] + n])
            assert torch.equal(pv[table[i, rows // p].long(), rows % p], v[cu_k[i]:cu_k[i] + n])


def test_paged_calls_agree_with_the_packed_call_in_the_interpreter():
    """The calls the GPU run times, on the CPU at a small size: each page size's paged call
    gives the packed varlen call's output (the check before timing); FA4 is skipped here."""
    case = prefill.plan(seqs=3, chunk=5, max_context=40, h=4, h_kv=2)[0]
    data = prefill.inputs(case, (16, 7), "cpu")
    calls = prefill._callables(case, data, (16, 7))
    ref = calls["flashgen_varlen"]().float()
    assert ref.shape == (15, 4, 128) and torch.isfinite(ref).all()
    for p in (16, 7):
        assert (calls[f"flashgen_paged{p}"]().float() - ref).abs().max() <= prefill.TOL
    assert all(isinstance(calls[n], Exception) or callable(calls[n])
               for n in ("fa4_varlen", "fa4_paged16"))


def test_batch_invariant_cost_rows():
    """batch_invariant=True's cost (issue 49: <= 15%) is measured here (flashgen_bi_paged<P>,
    flashgen_bi_varlen), in the decode suite (flashgen_bi_s0, flashgen_bi_paged_s0) and in
    the varlen bench (flashgen_bi)."""
    from flashgen.bench import suites, varlen

    assert "flashgen_bi" in suites.DECODE_PROVIDERS and "flashgen_bi" in varlen.PROVIDERS
    rows = [dict(provider="flashgen_paged16", tflops=300.0),
            dict(provider="flashgen_bi_paged16", tflops=270.0),
            dict(provider="flashgen_varlen", tflops=300.0),
            dict(provider="flashgen_bi_varlen", tflops=200.0)]
    text = prefill.bar_text(rows, (16,))
    assert "flashgen_bi_paged16 costs +11.1% against flashgen_paged16 (meets the bar 15%)" in text
    assert "flashgen_bi_varlen costs +50.0% against flashgen_varlen (MISSES the bar 15%)" in text
