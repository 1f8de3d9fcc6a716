"""The varlen benchmark's CPU parts: the workload's lengths, cu_seqlens, FLOPs, the plan,
the dry run and the bar's arithmetic. The measuring needs a GPU."""
import pytest

from flashgen.bench import varlen as bv


def test_ragged_lengths_are_the_bars_workload():
    lengths = bv.ragged_lengths(16, 16384, 128, 4096, seed=0)
    assert len(lengths) == 16 and sum(lengths) == 16384
    assert min(lengths) == 128 and max(lengths) == 4096
    assert lengths != sorted(lengths, reverse=True), "packed in a shuffled order"
    assert lengths == bv.ragged_lengths(16, 16384, 128, 4096, seed=0), "deterministic"
    assert bv.ragged_lengths(1, 77, 1, 100) == [77]
    with pytest.raises(ValueError, match="cannot split"):
        bv.ragged_lengths(4, 100, 30, 40)


def test_cu_seqlens_and_flops():
    assert bv.cu_seqlens([3, 0, 5]) == [0, 3, 3, 8]
    f = bv.document_flops([2, 4], h=1, d=1, causal=False, mode="fwd")
    assert f == 4 * (4 + 16)
    assert bv.document_flops([2, 4], 1, 1, True, "bwd") == 2.5 * f / 2


def test_plan_and_dry_run():
    cases = bv.plan(modes=("fwd", "bwd"))
    assert [c["provider"] for c in cases] == list(bv.PROVIDERS) * 2
    dense = next(c for c in cases if c["provider"] == "flashgen_dense")
    varlen = next(c for c in cases if c["provider"] == "flashgen_varlen")
    assert dense["flops"] == bv.document_flops([4096] * 4, 16, 128, True, "fwd")
    assert varlen["flops"] == bv.document_flops(varlen["lengths"], 16, 128, True, "fwd")
    text = bv.dry_run_text(cases)
    assert "16 documents, 16384 tokens" in text and "B=4 x N=4096" in text
    with pytest.raises(ValueError, match="unknown provider"):
        bv.plan(providers=["nope"])
    with pytest.raises(ValueError, match="multiple"):
        bv.plan(dense_n=3000)
    assert bv.main(["--dry-run", "--modes", "fwd"]) == 0
    assert bv.main(["--dry-run", "--rounds", "0"]) == 2


@pytest.mark.parametrize("flag", ["--docs", "--total", "--min-len", "--max-len", "--d", "--h",
                                  "--dense-n"])
@pytest.mark.parametrize("value", ["0", "-5"])
def test_sizes_below_one_are_refused(flag, value, capsys):
    """--dense-n 0 used to divide by zero (total % dense_n); every size is at least 1."""
    assert bv.main(["--dry-run", flag, value]) == 2
    assert capsys.readouterr().err == f"error: {flag} {value}: must be at least 1\n"


def test_bar_text():
    rows = [dict(mode="fwd", provider="flashgen_varlen", tflops=380.0),
            dict(mode="fwd", provider="flashgen_dense", tflops=400.0),
            dict(mode="fwd", provider="flex_document", tflops=300.0)]
    text = bv.bar_text(rows)
    assert "varlen / flashgen_dense = 0.950 (meets the bar 0.95)" in text
    assert "varlen / flex_document = 1.267 (meets" in text


def test_length_matched_baseline():
    lengths = bv.ragged_lengths(16, 16384, 128, 4096, seed=0)
    batches = bv.matched_batches(lengths, 16384)
    assert set(batches) == set(lengths)
    assert batches[4096] == 4 and batches[128] == 128
    assert all(abs(b * n - 16384) <= n / 2 for n, b in batches.items())
    # at one rate everywhere the matched time is the documents' FLOPs at that rate
    flat = {n: 400.0 for n in batches}
    ms = bv.matched_time_ms(lengths, flat, 16, 128, "fwd")
    assert ms == pytest.approx(bv.document_flops(lengths, 16, 128, True, "fwd") / 400e12 * 1e3)
    # a slower short length costs its documents' share only: halving the 128-token rate
    # adds exactly that document's time once more
    slow = {**flat, 128: 200.0}
    extra = bv.document_flops([128], 16, 128, True, "fwd") / 400e12 * 1e3
    assert bv.matched_time_ms(lengths, slow, 16, 128, "fwd") == pytest.approx(ms + extra)
    rows = [dict(mode="bwd", provider="flashgen_varlen", tflops=300.0),
            dict(mode="bwd", provider="flashgen_dense", tflops=400.0),
            dict(mode="bwd", provider="flashgen_dense_matched", tflops=320.0)]
    text = bv.bar_text(rows)
    assert "bwd: varlen / flashgen_dense_matched = 0.938 (the packing's own overhead" in text
    assert "bwd: varlen / flashgen_dense = 0.750 (MISSES the bar 0.95)" in text
