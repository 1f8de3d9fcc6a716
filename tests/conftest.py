"""Shared test setup.

On a machine without CUDA the kernels run in Triton's interpreter on CPU tensors; the
switch must be set before triton is first imported, hence here.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Dtype -> (atol, rtol) of a kernel output against the float64 reference. The inputs are
# exactly representable in both, so the gap is the kernel's own rounding: P is rounded to
# the input dtype before the P @ V product (fp16: 11-bit mantissa, bf16: 8-bit), while
# fp32 keeps near-full precision in the dots (tf32x3).
OUT_TOL = {
    torch.float32: (2e-5, 2e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
# The log-sum-exp is computed from fp32 scores whatever the input dtype.
LSE_TOL = (1e-4, 1e-5)
# Gradients round P and dS to the input dtype before three more products each.
GRAD_TOL = {
    torch.float32: (1e-4, 1e-4),
    torch.float16: (5e-3, 5e-3),
    torch.bfloat16: (4e-2, 4e-2),
}


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def device(request):
    """Every kernel test runs on the CPU interpreter by default and on CUDA with -m gpu."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.fail("-m gpu tests need a CUDA device")
    return request.param


@pytest.fixture
def gpu_memory_alone():
    """For tests that take tens of GB of GPU memory: under pytest-xdist (`-m gpu -n 8`) at
    most one of them runs at a time, across the worker processes (a file lock), and each
    gives its cached blocks back before the next starts. Two of the 2**31-row tests at once
    ran the 80 GB H100 out of memory, and their neighbours with them."""
    try:
        import fcntl
    except ImportError:  # (no POSIX locks: run as is)
        yield
        return
    import gc
    import sys
    import tempfile

    with open(os.path.join(tempfile.gettempdir(), "flashgen-tests-gpu-memory.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            # a failed test's frames (pytest keeps them in sys.last_* for post-mortems) hold
            # its tensors: let them go, or the next such test runs out of memory as well
            for name in ("last_type", "last_value", "last_traceback", "last_exc"):
                if hasattr(sys, name):
                    setattr(sys, name, None)
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def poison(monkeypatch):
    """Fill every floating-point torch.empty / empty_like with NaN during the test, so an
    output element the kernel forgets to write shows up as NaN."""

    def poisoning(original):
        def poisoned(*args, **kwargs):
            t = original(*args, **kwargs)
            if t.is_floating_point():
                t.fill_(float("nan"))
            return t
        return poisoned

    monkeypatch.setattr(torch, "empty", poisoning(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoning(torch.empty_like))


def assert_out_lse(out, lse, ref, ref_lse, dtype):
    """out (B, N, H, dv) and lse (B, H, N) of a call against the float64 reference's
    (B, H, N, dv) and LSE: no NaN, the dtype's tolerance, -inf exactly where no key is seen
    and 0 output there."""
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    atol, rtol = OUT_TOL[dtype]
    out = out.transpose(1, 2).double().cpu()
    torch.testing.assert_close(out, ref.detach().cpu(), atol=atol, rtol=rtol)
    seen = torch.isfinite(ref_lse).cpu()
    assert torch.equal(torch.isfinite(lse).cpu(), seen)
    torch.testing.assert_close(lse.double().cpu()[seen], ref_lse.detach().cpu()[seen],
                               atol=LSE_TOL[0], rtol=LSE_TOL[1])
    assert (out[~seen] == 0).all()


def cuda_qkv(b, nq, nk, hq, hkv, d, dv, dtype, grad=False):
    """Random (B, N, H, d) q, k and v (V at head dim dv) on the GPU."""
    q = torch.randn(b, nq, hq, d, device="cuda", dtype=dtype, requires_grad=grad)
    k = torch.randn(b, nk, hkv, d, device="cuda", dtype=dtype, requires_grad=grad)
    v = torch.randn(b, nk, hkv, dv, device="cuda", dtype=dtype, requires_grad=grad)
    return q, k, v


def assert_grads(tensors, refs, dtype):
    """The .grad of (B, N, H, d) q, k, v against the float64 reference's (B, H, N, d) leaves:
    no NaN, the dtype's gradient tolerance, each named when it fails."""
    for name, got, want in zip(("dq", "dk", "dv"), tensors, refs):
        assert not torch.isnan(got.grad).any(), name
        torch.testing.assert_close(got.grad.double(), want.grad.transpose(1, 2),
                                   atol=GRAD_TOL[dtype][0], rtol=GRAD_TOL[dtype][1],
                                   msg=lambda m, name=name: f"{name}: {m}")
