"""The per-call host path of the generated package: validation once per call signature,
launch plans (forward and backward) reused, the eager autograd path off the custom-op
dispatcher, and torch.compile still on the operators."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from packages import build_and_import

TILES = dict(block_m=16, block_n=16, num_warps=4, num_stages=2)


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("host"), "fg_test_host", """
        head_dims: [32]
        dtypes: [fp32]
        masks: [none, causal]
        dropout: true
        gqa: true
        """)


def qkv(b=1, h=2, n=40, d=32, device="cpu", grad=False):
    return [torch.randn(b, h, n, d, device=device).requires_grad_(grad) for _ in range(3)]


def sdpa_ref(q, k, v, causal):
    return F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal)


def test_a_repeated_signature_skips_validation(pkg, device, monkeypatch):
    q, k, v = qkv(device=device)
    pkg.scaled_dot_product_attention(q, k, v, is_causal=True)

    def refuse(*args, **kwargs):
        raise AssertionError("validated again")
    monkeypatch.setattr(pkg._runtime, "check_tensors", refuse)
    q, k, v = qkv(device=device)  # new tensors, same signature
    out = pkg.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(out.double(), sdpa_ref(q, k, v, True), atol=2e-5, rtol=2e-5)
    # another signature (length, strides, scalar argument) is validated again
    for call in (lambda: pkg.scaled_dot_product_attention(*qkv(n=41, device=device)),
                 lambda: pkg.scaled_dot_product_attention(
                     *(t.transpose(2, 3).contiguous().transpose(2, 3) for t in qkv(device=device))),
                 lambda: pkg.scaled_dot_product_attention(q, k, v, is_causal=False)):
        with pytest.raises(AssertionError, match="validated again"):
            call()


def test_a_cached_signature_still_rejects_bad_arguments(pkg, device):
    q, k, v = qkv(device=device)
    pkg.scaled_dot_product_attention(q, k, v)
    pkg.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    with pytest.raises(ValueError, match="dropout_p must be a number in"):
        pkg.scaled_dot_product_attention(q, k, v, dropout_p=1.5)
    with pytest.raises(ValueError, match="cannot both be set"):
        pkg.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(40, 40, dtype=torch.bool),
                                         is_causal=True)
    with pytest.raises(ValueError, match="must share a dtype"):
        pkg.scaled_dot_product_attention(q, k.double(), v)
    with pytest.raises(ValueError, match="window_size"):
        pkg.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                            window_size=(-2, 0))


def test_outputs_and_returned_lse_are_never_shared(pkg, device):
    """A no-grad call that drops the LSE writes it to a scratch buffer; the outputs and
    an LSE the caller asked for are fresh tensors every call."""
    q, k, v = qkv(device=device)
    a = pkg.scaled_dot_product_attention(q, k, v)
    a_copy = a.clone()
    b = pkg.scaled_dot_product_attention(*qkv(device=device))
    assert a.data_ptr() != b.data_ptr() and torch.equal(a, a_copy)
    t = [x.transpose(1, 2) for x in (q, k, v)]
    o1, l1 = pkg.flash_attn_func(*t, return_lse=True)
    l1_copy = l1.clone()
    pkg.flash_attn_func(*t)  # drops its LSE
    o2, l2 = pkg.flash_attn_func(*t, return_lse=True)
    assert l1.data_ptr() != l2.data_ptr() and torch.equal(l1, l1_copy) and torch.equal(l1, l2)


def test_eager_autograd_runs_off_the_custom_op_dispatcher(pkg, device, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("custom op dispatched in eager mode")
    monkeypatch.setattr(pkg._ops, "fwd_op", refuse)
    monkeypatch.setattr(pkg._ops, "bwd_op", refuse)
    q, k, v = qkv(device=device, grad=True)
    do = torch.randn_like(q)
    with pkg._runtime.override_config(**TILES):
        pkg.scaled_dot_product_attention(q, k, v, is_causal=True).backward(do)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*refs, is_causal=True).backward(do.double())
    for got, ref in zip((q, k, v), refs):
        torch.testing.assert_close(got.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


def test_backward_plans_are_made_once_per_signature(pkg, device):
    plans = pkg._runtime._backward_plans
    before = len(plans)
    for _ in range(3):
        q, k, v = qkv(n=33, device=device, grad=True)
        pkg.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    assert len(plans) == before + 1
    launches = next(reversed(plans.values()))
    if device == "cuda":  # after the first call, the launches skip Triton's binding
        assert all(launches[i].compiled is not None for i in (0, 2, 4))
        import triton
        if triton.__version__.startswith("3.6."):  # ... and CudaLauncher's Python frame
            assert all(launches[i].launch is launches[i].compiled.run.launch
                       for i in (0, 2, 4))


def test_a_repeated_signature_reuses_its_launch_plan_until_plans_are_cleared(pkg, device,
                                                                              monkeypatch):
    """The API's signature cache keeps the forward's launch plan beside the signature; a
    call with other pointer alignment, or after the runtime's plans are cleared (a new
    config, a forced family), makes its plan again."""
    rt = pkg._runtime
    made, looked_up = [], []
    real = rt._forward_plan

    def counting(*args, **kwargs):
        made.append(1)
        return real(*args, **kwargs)

    class CountingPlans(rt._Plans):
        def get(self, key, default=None):
            looked_up.append(1)
            return super().get(key, default)
    monkeypatch.setattr(rt, "_forward_plan", counting)
    monkeypatch.setattr(rt, "_forward_plans", CountingPlans())

    def call(t):
        out = pkg.flash_attn_func(*t, causal=True)
        ref = sdpa_ref(*(x.transpose(1, 2) for x in t), True).transpose(1, 2)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)

    fresh = lambda: [x.transpose(1, 2) for x in qkv(n=37, device=device)]
    call(fresh())
    rt._forward_plans.clear()
    made.clear()
    call(fresh())
    assert len(made) == 1
    looked_up.clear()
    for _ in range(2):
        call(fresh())
    assert len(made) == 1 and not looked_up, "the signature's kept plan was not reused"
    # the same shapes and strides 4 bytes off a 16-byte boundary: its own plan
    base = torch.randn(1 * 37 * 2 * 32 + 1, device=device)
    q = base[1:].view(1, 37, 2, 32)
    call([q, *fresh()[1:]])
    assert len(made) == 2
    call(fresh())
    assert len(made) == 2
    rt._forward_plans.clear()
    call(fresh())
    assert len(made) == 3, "a plan kept across a clear of the runtime's plans"
    with rt.override_config(**TILES):
        call(fresh())
    assert len(made) == 4


@pytest.fixture
def direct_launch(pkg, monkeypatch):
    """The runtime with a stand-in for Triton 3.6's CudaLauncher (the name and fields
    _direct_launch reads; its __call__ does what 3.6's does: the scratch from the allocator
    in effect, then the C launch), a Kernel whose compile returns it, and torch.empty on the
    CPU recording what it made. Triton's NullAllocator is in effect for the test: an
    earlier test in this thread may have left another one set."""
    import types

    import triton
    if not triton.__version__.startswith("3.6."):
        pytest.skip("the direct launch is for Triton 3.6's launcher")
    from triton.runtime import _allocation
    rt = pkg._runtime
    launched, made = [], []

    class CudaLauncher:
        global_scratch_size, global_scratch_align, profile_scratch_size, num_ctas = 64, 128, 0, 1
        launch_cooperative_grid, launch_pdl = False, False

        def launch(self, *args):
            launched.append(args)

        def __call__(self, gx, gy, gz, stream, function, *args):
            scratch = _allocation._allocator.get()(gx * gy * gz * 64, 128, stream)
            self.launch(gx, gy, gz, stream, function, False, False, scratch, None, *args)

    compiled = types.SimpleNamespace(run=CudaLauncher(), function="FN", packed_metadata="META")

    class Kernel:
        arg_names = ["a", "b", "X"]

        def __getitem__(self, grid):
            return lambda *args, **meta: compiled

    real_empty = torch.empty

    def empty(*size, dtype=None, device=None, **kw):
        made.append((size, device))
        return real_empty(*size, dtype=dtype)

    state = {"stream": 11, "capturing": False}
    monkeypatch.setattr(rt, "_interpreting", lambda: False)
    monkeypatch.setattr(rt, "_launch_hooks", types.SimpleNamespace(launch_enter_hook=None))
    monkeypatch.setattr(rt, "_current_device", lambda: 0)
    monkeypatch.setattr(rt, "_raw_stream", lambda device: state["stream"])
    monkeypatch.setattr(rt, "_stream_capturing", lambda: state["capturing"])
    monkeypatch.setattr(rt, "_launch_scratches", {})
    monkeypatch.setattr(rt, "_allocation", _allocation)
    monkeypatch.setattr(torch, "empty", empty)
    token = _allocation._allocator.set(_allocation.NullAllocator())
    try:
        yield types.SimpleNamespace(rt=rt, Kernel=Kernel, launched=launched, made=made,
                                    state=state, allocation=_allocation)
    finally:
        _allocation._allocator.reset(token)


def test_direct_launch_passes_a_scratch_buffer_kept_per_stream(direct_launch):
    """The Launcher's direct path for a kernel with global scratch (the Gluon forward's
    device-made descriptors): the C launch gets the grid, the stream, the function, then a
    scratch buffer of (per-program bytes x programs) in the global-scratch slot, kept per
    (device, stream) and grown, a fresh one under CUDA-graph capture, and the kernel's own
    arguments after the metadata."""
    rt, Kernel, launched, made, state = (direct_launch.rt, direct_launch.Kernel,
                                         direct_launch.launched, direct_launch.made,
                                         direct_launch.state)
    small, big = rt.Launcher(Kernel(), (4, 2), {"X": 7}), rt.Launcher(Kernel(), (8, 2), {"X": 7})
    small(1, 2)  # the first call: Triton's own path, which sets up the direct one
    assert not launched and small.scratch == 64 * 4 * 2
    small(1, 2)
    small(3, 4)
    (first, second) = launched
    assert first[:5] == (4, 2, 1, 11, "FN") and first[5:7] == (False, False)
    assert first[7].numel() == 512 and first[8] is None and first[9] == "META"
    assert first[10:13] == (None, None, None) and first[13:] == (1, 2, 7)
    assert second[7] is first[7] and second[13:] == (3, 4, 7)
    assert made == [((512,), 0)]
    big(1, 2)
    big(1, 2)  # a larger launch on the stream grows its buffer
    assert launched[-1][7].numel() == 1024 and rt._launch_scratches[(0, 11)] is launched[-1][7]
    small(1, 2)  # ... which serves the smaller one too
    assert launched[-1][7] is launched[-2][7] and len(made) == 2
    state["stream"] = 12  # another stream: its own
    small(1, 2)
    assert launched[-1][7] is not launched[-2][7] and set(rt._launch_scratches) == {(0, 11), (0, 12)}
    state["capturing"] = True  # under capture: a fresh one each launch, none kept
    small(1, 2)
    small(1, 2)
    assert launched[-1][7] is not launched[-2][7] and len(made) == 5
    assert launched[-1][7] is not rt._launch_scratches[(0, 12)]


def test_direct_launch_takes_the_scratch_from_an_application_allocator(direct_launch):
    """While the application has its own allocator set (triton.set_allocator), a direct
    launch of a kernel with global scratch takes the scratch from it, through Triton's
    launcher, not from the package's kept buffer; with a generated package's allocator or
    none, the kept buffer again."""
    import types

    rt, launched, allocation = direct_launch.rt, direct_launch.launched, direct_launch.allocation
    asked = []

    def app_allocator(size, align, stream):
        asked.append((size, align, stream))
        return torch.zeros(size, dtype=torch.int8)

    launcher = rt.Launcher(direct_launch.Kernel(), (4, 2), {"X": 7})
    launcher(1, 2)  # Triton's own path, which sets up the direct one
    token = allocation._allocator.set(app_allocator)
    try:
        launcher(3, 4)
    finally:
        allocation._allocator.reset(token)
    assert asked == [(512, 128, 11)], "the application's allocator was not asked"
    assert launched[-1][:5] == (4, 2, 1, 11, "FN") and launched[-1][7].numel() == 512
    assert launched[-1][9] == "META" and launched[-1][13:] == (3, 4, 7)
    assert not rt._launch_scratches  # nothing kept from the application's memory
    # a generated package's allocator (this one's, another package's), then none
    other = types.SimpleNamespace(flashgen_scratch=True)
    for allocator in (rt._torch_scratch, other, allocation.NullAllocator()):
        token = allocation._allocator.set(allocator)
        try:
            launcher(5, 6)
        finally:
            allocation._allocator.reset(token)
    assert len(asked) == 1 and launched[-1][7] is launched[-2][7] is launched[-3][7]
    assert launched[-1][7] is rt._launch_scratches[(0, 11)] and launched[-1][13:] == (5, 6, 7)


def test_per_stream_caches_drop_their_oldest_entry_when_full(pkg, monkeypatch):
    """stream_buffers and the launch scratch keep _MAX_STREAM_ENTRIES entries each: a new
    stream beyond that drops the oldest one (a program making streams without end does not
    grow them), a stream that has one keeps using it, and a replaced entry is not a new one."""
    rt = pkg._runtime
    monkeypatch.setattr(rt, "_MAX_STREAM_ENTRIES", 3)
    cache, made = {}, []

    def make():
        made.append(torch.zeros(1))
        return made[-1]
    cpu = torch.device("cpu")
    first = [rt.stream_buffers(cache, cpu, make, extra=(i,)) for i in range(3)]
    assert rt.stream_buffers(cache, cpu, make, extra=(0,)) is first[0] and len(made) == 3
    fourth = rt.stream_buffers(cache, cpu, make, extra=(3,))
    assert list(cache) == [(cpu, 0, 1), (cpu, 0, 2), (cpu, 0, 3)] and cache[(cpu, 0, 3)] is fourth
    assert rt.stream_buffers(cache, cpu, make, extra=(0,)) is not first[0]  # dropped: made again
    assert list(cache) == [(cpu, 0, 2), (cpu, 0, 3), (cpu, 0, 0)]
    # a buffer that no longer fits is replaced in place, nothing dropped
    rt.stream_buffers(cache, cpu, make, extra=(2,), fits=lambda b: False)
    assert list(cache) == [(cpu, 0, 2), (cpu, 0, 3), (cpu, 0, 0)] and cache[(cpu, 0, 2)] is made[-1]

    real_empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *size, dtype=None, device=None: real_empty(*size, dtype=dtype))
    monkeypatch.setattr(rt, "_stream_capturing", lambda: False)
    monkeypatch.setattr(rt, "_launch_scratches", {})
    kept = [rt._launch_scratch(0, stream, 64) for stream in (11, 12, 13)]
    assert rt._launch_scratch(0, 11, 64) is kept[0]
    rt._launch_scratch(0, 14, 64)
    assert list(rt._launch_scratches) == [(0, 12), (0, 13), (0, 14)]
    assert rt._launch_scratch(0, 12, 128) is not kept[1]  # grown in place
    assert list(rt._launch_scratches) == [(0, 12), (0, 13), (0, 14)]


def test_torch_compile_uses_the_operators(pkg):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def f(q, k, v):
        return pkg.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    q, k, v = qkv(grad=True)
    loss = torch.compile(f, backend=backend, fullgraph=True)(q, k, v)
    loss.backward()
    assert any(pkg._ops.NAMESPACE in g for g in graphs), graphs
    assert q.grad is not None


@pytest.mark.gpu
def test_cuda_graph_capture_replays_forward_and_backward(pkg):
    """Captured in a CUDA graph (no host syncs on the call path), replayed on new inputs."""
    q, k, v = qkv(b=2, n=100, device="cuda", grad=True)
    do = torch.randn_like(q)
    static = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up: compile, make the plans
            pkg.scaled_dot_product_attention(*static, is_causal=True).backward(do)
    torch.cuda.current_stream().wait_stream(stream)
    for t in static:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pkg.scaled_dot_product_attention(*static, is_causal=True)
        out.backward(do)
    with torch.no_grad():
        for s, t in zip(static, (q, k, v)):
            s.copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out.double(), sdpa_ref(q, k, v, True), atol=2e-5, rtol=2e-5)
    refs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*refs, is_causal=True).backward(do.double())
    for s, ref in zip(static, refs):
        torch.testing.assert_close(s.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


def test_eager_autograd_skips_function_apply_wrapper(pkg, device, monkeypatch):
    """Eager grad calls go to Function.apply's C++ half directly (the Python wrapper's
    functorch argument scan is a third of the path's host time), with the same gradients."""
    def refuse(*args, **kwargs):
        raise AssertionError("Function.apply's Python wrapper called")
    for cls in (pkg._ops._Attention, pkg._ops._AttentionOut):
        monkeypatch.setattr(cls, "apply", refuse)
    q, k, v = qkv(device=device, grad=True)
    out, lse = pkg.flash_attn_func(*(t.transpose(1, 2) for t in (q, k, v)), return_lse=True)
    out.sum().backward()
    assert q.grad is not None and lse.shape == (1, 2, 40)
    pkg.scaled_dot_product_attention(q, k, v).sum().backward()


def packed_ref_grad(qkv, do, heads, kv_heads, causal):
    """The float64 gradient of a packed (B, N, H + 2 H_kv, d) call, through SDPA."""
    ref = qkv.detach().double().requires_grad_()
    q, k, v = (t.transpose(1, 2) for t in ref.split((heads, kv_heads, kv_heads), dim=2))
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=causal).transpose(1, 2)
    out.backward(do.double())
    return out.detach(), ref.grad


@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (4, 2)])
def test_packed_attention_gradient_comes_back_packed(pkg, device, heads, kv_heads):
    """One packed QKV tensor in, one packed gradient out: the autograd node is the packed
    Function's (no split and concatenation in the graph), and the gradient is SDPA's."""
    qkv = torch.randn(2, 33, heads + 2 * kv_heads, 32, device=device, requires_grad=True)
    do = torch.randn(2, 33, heads, 32, device=device)
    with pkg._runtime.override_config(**TILES):
        out = pkg._api.packed_attention(qkv, heads, kv_heads, causal=True)
        assert "PackedAttention" in out.grad_fn.name()
        out.backward(do)
    ref_out, ref_grad = packed_ref_grad(qkv, do, heads, kv_heads, True)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    assert qkv.grad.shape == qkv.shape
    torch.testing.assert_close(qkv.grad.double(), ref_grad, atol=1e-4, rtol=1e-4)
    with torch.no_grad():  # and without gradients, the same output
        torch.testing.assert_close(pkg._api.packed_attention(qkv, heads, kv_heads, causal=True),
                                   out.detach())


def test_packed_attention_through_strides_and_offsets(pkg, device):
    """A packed tensor that is itself a strided view (an offset slice of a wider buffer)."""
    wide = torch.randn(1, 20, 9, 32, device=device)
    qkv = wide[:, :, 2:8].detach().requires_grad_()  # offset 64 elements, row stride 9 * 32
    base = torch.randn(1, 20, 7, 32, device=device)
    view = base[:, :, 1:].detach().requires_grad_()
    for t in (qkv, view):
        out = pkg._api.packed_attention(t, 2, 2, causal=False)
        do = torch.randn_like(out)
        out.backward(do)
        ref_out, ref_grad = packed_ref_grad(t, do, 2, 2, False)
        torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(t.grad.double(), ref_grad, atol=1e-4, rtol=1e-4)


def test_qkvpacked_func_returns_a_packed_gradient(pkg, device):
    qkv = torch.randn(2, 24, 3, 2, 32, device=device, requires_grad=True)
    out = pkg.flash_attn_qkvpacked_func(qkv, causal=True)
    do = torch.randn_like(out)
    out.backward(do)
    ref_out, ref_grad = packed_ref_grad(qkv.view(2, 24, 6, 32), do, 2, 2, True)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(qkv.grad.double().view(2, 24, 6, 32), ref_grad,
                               atol=1e-4, rtol=1e-4)


def test_packed_dropout_matches_separate_inputs(pkg, device):
    """The packed path draws the same dropout mask as flash_attn_func and regenerates it
    in the backward: same seed, same output and gradients."""
    qkv = torch.randn(1, 40, 6, 32, device=device, requires_grad=True)
    do = torch.randn(1, 40, 2, 32, device=device)
    torch.manual_seed(7)
    out = pkg._api.packed_attention(qkv, 2, 2, dropout_p=0.3, causal=True)
    out.backward(do)
    sep = [t.detach().clone().requires_grad_() for t in qkv.detach().split((2, 2, 2), dim=2)]
    torch.manual_seed(7)
    out_sep = pkg.flash_attn_func(*sep, dropout_p=0.3, causal=True)
    out_sep.backward(do)
    torch.testing.assert_close(out, out_sep, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(qkv.grad, torch.cat([t.grad for t in sep], dim=2),
                               atol=1e-5, rtol=1e-5)


def test_packed_attention_validates_once_and_still_rejects_bad_arguments(pkg, device,
                                                                          monkeypatch):
    qkv = torch.randn(1, 16, 6, 32, device=device)
    pkg._api.packed_attention(qkv, 2, 2)
    with pytest.raises(ValueError, match="num_heads \\+ 2 \\* num_kv_heads"):
        pkg._api.packed_attention(qkv, 2, 1)
    with pytest.raises(ValueError, match="num_heads \\+ 2 \\* num_kv_heads"):
        pkg._api.packed_attention(qkv[0], 2, 2)
    with pytest.raises(ValueError, match="dropout_p must be a number in"):
        pkg._api.packed_attention(qkv, 2, 2, dropout_p=1.5)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        pkg._api.packed_attention(torch.randn(1, 16, 7, 32, device=device), 3, 2)

    def refuse(*args, **kwargs):
        raise AssertionError("validated again")
    monkeypatch.setattr(pkg._runtime, "check_tensors", refuse)
    pkg._api.packed_attention(torch.randn(1, 16, 6, 32, device=device), 2, 2)  # cached


def test_torch_compile_traces_packed_attention(pkg):
    torch._dynamo.reset()
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return gm.forward

    def f(qkv):
        return pkg._api.packed_attention(qkv, 2, 2, causal=True).sum()

    qkv = torch.randn(1, 24, 6, 32, requires_grad=True)
    torch.compile(f, backend=backend, fullgraph=True)(qkv).backward()
    assert any(pkg._ops.NAMESPACE in g for g in graphs), graphs
    eager = qkv.detach().clone().requires_grad_()
    f(eager).backward()
    torch.testing.assert_close(qkv.grad, eager.grad, atol=1e-5, rtol=1e-5)
