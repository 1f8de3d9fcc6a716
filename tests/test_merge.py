"""merge_attention_states: two partial attention results over disjoint key sets merged
through their LSEs, against float64 references (the attention over all keys, and the
merge formula itself), its gradients, edge rows and argument checks."""
import importlib

import pytest
import torch

from flashgen.reference import attention_ref, visible_mask
from packages import build_and_import

from conftest import LSE_TOL, OUT_TOL

PACKAGE = "fg_test_merge"
SPEC = """
    head_dims: [16]
    dtypes: [fp32, fp16, bf16]
    masks: [none, causal]
    gqa: true
    """
NINF, NAN = float("-inf"), float("nan")
# (atol, rtol) of a merge against the float64 merge of the same inputs: fp32 arithmetic,
# then one rounding of the output to its dtype (half an ulp: 2^-11 fp16, 2^-8 bf16)
MERGE_TOL = {
    torch.float32: (1e-6, 1e-5),
    torch.float16: (1e-5, 1e-3),
    torch.bfloat16: (1e-5, 8e-3),
}
MERGE_LSE_TOL = (1e-5, 1e-6)  # fp32 LSEs


@pytest.fixture(scope="module")
def pkg(tmp_path_factory):
    return build_and_import(tmp_path_factory.mktemp("merge"), PACKAGE, SPEC)


def merge_ref(out_a, lse_a, out_b, lse_b):
    """The merge in float64 from its definition (torch autograd gives its gradients): a
    side whose LSE is -inf has weight 0 and its output is not read."""
    both = (lse_a == NINF) & (lse_b == NINF)  # (kept out of logaddexp: its gradient NaNs)
    la, lb = (torch.where(both, 0.0, t.double()) for t in (lse_a, lse_b))
    lse = torch.logaddexp(la, lb)
    wa, wb = (torch.where(both, 0.0, torch.exp(t - lse)).transpose(-1, -2)[..., None]
              for t in (la, lb))  # (..., N, H, 1)
    out_a, out_b = (torch.where(w > 0, t.double(), 0.0) for w, t in ((wa, out_a), (wb, out_b)))
    return wa * out_a + wb * out_b, torch.where(both, NINF, lse)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("b,n_q,n_p,n_s,h_q,h_kv", [
    (1, 1, 7, 1, 2, 2),      # one query row
    (3, 59, 40, 59, 4, 2),   # batch 3, GQA
    (2, 127, 33, 100, 2, 1), # n_q > n_s: the first 27 rows see no suffix key (LSE -inf)
])
def test_split_keys_match_all_keys(pkg, device, poison, dtype, b, n_q, n_p, n_s, h_q, h_kv):
    """A call that sees every prefix key merged with a causal call on the suffix keys
    (cascade attention), against float64 attention over all keys with that mask and, where
    it is one (n_s >= n_q), against flash_attn_func(causal=True) over all keys."""
    torch.manual_seed(n_q)
    q = torch.randn(b, n_q, h_q, 16, dtype=dtype, device=device)
    k, v = (torch.randn(b, n_p + n_s, h_kv, 16, dtype=dtype, device=device) for _ in range(2))
    out_a, lse_a = pkg.flash_attn_func(q, k[:, :n_p], v[:, :n_p], return_lse=True)
    out_b, lse_b = pkg.flash_attn_func(q, k[:, n_p:], v[:, n_p:], causal=True,
                                       return_lse=True)
    assert (lse_b == NINF).any() == (n_q > n_s)
    out_b[(lse_b == NINF).transpose(1, 2)] = NAN  # rows no key reached are not read
    out, lse = pkg.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert out.shape == q.shape and lse.shape == (b, h_q, n_q)
    assert not out.isnan().any() and not lse.isnan().any()

    want, want_lse = merge_ref(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(out.double(), want, atol=MERGE_TOL[dtype][0],
                               rtol=MERGE_TOL[dtype][1])
    torch.testing.assert_close(lse.double(), want_lse, atol=MERGE_LSE_TOL[0],
                               rtol=MERGE_LSE_TOL[1])

    vis = torch.cat([torch.ones(n_q, n_p, dtype=torch.bool),
                     visible_mask(n_q, n_s, causal=True, bottom_right=True)], dim=1)
    ref, ref_lse = attention_ref(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), vis)
    torch.testing.assert_close(out.double(), ref.transpose(1, 2), atol=OUT_TOL[dtype][0],
                               rtol=OUT_TOL[dtype][1])
    torch.testing.assert_close(lse.double(), ref_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])
    if n_s < n_q:  # (not a causal mask over all keys: every row sees the whole prefix)
        return
    full, full_lse = pkg.flash_attn_func(q, k, v, causal=True, return_lse=True)
    torch.testing.assert_close(out.float(), full.float(), atol=2 * OUT_TOL[dtype][0],
                               rtol=2 * OUT_TOL[dtype][1])
    torch.testing.assert_close(lse, full_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def test_varlen_layout(pkg, device):
    """flash_attn_varlen_func's (total, H, d) outputs with (H, total) LSEs merge as they are."""
    torch.manual_seed(1)
    cu = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    cu_q, cu_k = cu(0, 5, 12), cu(0, 9, 20)
    q = torch.randn(12, 2, 16, device=device)
    k, v = torch.randn(20, 2, 16, device=device), torch.randn(20, 2, 16, device=device)
    halves = [pkg.flash_attn_varlen_func(q, k[sl], v[sl], cu_q, cu_h, 7, 6, return_lse=True)
              for sl, cu_h in ((slice(0, 9), cu(0, 4, 9)), (slice(9, 20), cu(0, 5, 11)))]
    # sequence 0's keys are k[0:4] + k[9:14], sequence 1's k[4:9] + k[14:20]
    out, lse = pkg.merge_attention_states(*halves[0], *halves[1])
    kk = torch.cat([k[0:4], k[9:14], k[4:9], k[14:20]])
    vv = torch.cat([v[0:4], v[9:14], v[4:9], v[14:20]])
    full, full_lse = pkg.flash_attn_varlen_func(q, kk, vv, cu_q, cu_k, 7, 11, return_lse=True)
    torch.testing.assert_close(out, full, atol=4e-5, rtol=4e-5)
    torch.testing.assert_close(lse, full_lse, atol=LSE_TOL[0], rtol=LSE_TOL[1])


def test_strided_inputs_and_leading_dims(pkg, device):
    """Views with any strides (a non-unit-stride head dim included) and extra leading dims
    give the bits of the contiguous call."""
    torch.manual_seed(2)
    base = torch.randn(2, 3, 9, 4, 32, device=device)[..., ::2]  # (2, 3, N=9, H=4, d=16)
    out_b = torch.randn(2, 3, 4, 9, 16, device=device).transpose(-2, -3)
    lse_a = torch.randn(2, 3, 9, 4, device=device).transpose(-1, -2)
    lse_b = torch.randn(2, 3, 4, 9, device=device)
    got = pkg.merge_attention_states(base, lse_a, out_b, lse_b)
    want = pkg.merge_attention_states(base.contiguous(), lse_a.contiguous(), out_b.contiguous(),
                                      lse_b)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    ref = merge_ref(base, lse_a, out_b, lse_b)
    torch.testing.assert_close(got[0].double(), ref[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_edge_rows(pkg, device, poison, dtype):
    """Both sides -inf: (0, -inf), no NaN; one side -inf: the other side exactly, whatever
    the unseen side holds; a NaN or +inf LSE: a NaN row, other rows untouched."""
    torch.manual_seed(3)
    n, h, d = 6, 2, 16
    out_a, out_b = (torch.randn(1, n, h, d, dtype=dtype, device=device) for _ in range(2))
    lse_a, lse_b = (torch.randn(1, h, n, device=device) * 4 for _ in range(2))
    lse_a[0, 0, 0] = lse_b[0, 0, 0] = NINF      # no key on either side
    lse_a[0, 0, 1] = NINF                       # only b saw keys
    lse_b[0, 1, 2] = NINF                       # only a saw keys
    lse_a[0, 1, 3], lse_b[0, 1, 3] = 80.0, -80.0  # exp(160) would overflow fp32
    lse_a[0, 0, 4] = NAN
    lse_b[0, 1, 5] = float("inf")
    out_a[0, 0, 0] = out_a[0, 1, 0] = out_b[0, 0, 0] = NAN  # unseen rows hold NaN
    out_a[0, 1, 0] = out_b[0, 2, 1] = float("inf")
    out, lse = pkg.merge_attention_states(out_a, lse_a, out_b, lse_b)
    assert (out[0, 0, 0] == 0).all() and lse[0, 0, 0] == NINF
    assert torch.equal(out[0, 1, 0], out_b[0, 1, 0]) and lse[0, 0, 1] == lse_b[0, 0, 1]
    assert torch.equal(out[0, 2, 1], out_a[0, 2, 1]) and lse[0, 1, 2] == lse_a[0, 1, 2]
    assert torch.isfinite(out[0, 3, 1]).all() and lse[0, 1, 3] == 80.0
    assert out[0, 4, 0].isnan().all() and lse[0, 0, 4].isnan()
    assert out[0, 5, 1].isnan().all() and lse[0, 1, 5].isnan()
    bad = torch.zeros(1, h, n, dtype=torch.bool, device=device)
    bad[0, 0, 4] = bad[0, 1, 5] = True
    assert (lse.isnan() == bad).all()
    assert (out.isnan().any(-1) == bad.transpose(1, 2)).all()
    want, want_lse = merge_ref(out_a, lse_a, out_b, lse_b)
    keep = ~bad.transpose(1, 2)
    torch.testing.assert_close(out[keep].double(), want[keep], atol=MERGE_TOL[dtype][0],
                               rtol=MERGE_TOL[dtype][1])
    torch.testing.assert_close(lse[~bad].double(), want_lse[~bad], atol=MERGE_LSE_TOL[0],
                               rtol=MERGE_LSE_TOL[1])


def test_gradcheck_float64(pkg, device):
    """torch.autograd.gradcheck on the op itself (fp64 outputs and LSEs compute in fp64),
    with rows where one side saw no key (their gradients are 0)."""
    torch.manual_seed(4)
    b, n, h, d = 1, 3, 2, 4
    x = [torch.randn(shape, dtype=torch.float64, device=device)
         for shape in ((b, n, h, d), (b, h, n), (b, n, h, d), (b, h, n))]
    x[1][0, 0, 1] = NINF
    x[3][0, 1, 2] = NINF
    assert torch.autograd.gradcheck(pkg.merge_attention_states,
                                    [t.requires_grad_() for t in x])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradients_match_float64_reference(pkg, device, poison, dtype):
    """Gradients w.r.t. all four inputs from both outputs, against autograd through the
    float64 merge; rows with one or both sides -inf included (zero gradient on an unseen
    side, whose NaN output is not read)."""
    torch.manual_seed(5)
    b, n, h, d = 3, 59, 2, 16
    out_a, out_b = (torch.randn(b, n, h, d, dtype=dtype, device=device) for _ in range(2))
    lse_a, lse_b = (torch.randn(b, h, n, device=device) * 3 for _ in range(2))
    lse_a[:, 0, :5] = NINF
    lse_b[:, 0, 3:8] = NINF
    out_a[:, :5, 0] = NAN
    x = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    dout = torch.randn(b, n, h, d, dtype=dtype, device=device)
    dlse = torch.randn(b, h, n, device=device)
    out, lse = pkg.merge_attention_states(*x)
    got = torch.autograd.grad((out, lse), x, (dout, dlse))
    xr = [t.detach().double().requires_grad_() for t in x]
    ro, rl = merge_ref(*xr)
    want = torch.autograd.grad((ro, rl), xr, (dout.double(), dlse.double()))
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.dtype == x[i].dtype and not g.isnan().any(), i
        tol = MERGE_TOL[dtype] if i % 2 == 0 else (1e-5, 1e-5)
        torch.testing.assert_close(g.double(), w, atol=tol[0], rtol=tol[1], msg=f"input {i}")
    assert (got[0][:, :5, 0] == 0).all() and (got[1][:, 0, :5] == 0).all()
    both = slice(3, 5)  # both sides -inf at rows 3, 4 of head 0
    for g in (got[2][:, both, 0], got[3][:, 0, both]):
        assert (g == 0).all()


def test_only_out_used_in_backward(pkg):
    """A backward through the output alone (the LSE's gradient materialized as zeros)."""
    torch.manual_seed(6)
    x = [torch.randn(2, 5, 2, 16, requires_grad=True), torch.randn(2, 2, 5, requires_grad=True),
         torch.randn(2, 5, 2, 16, requires_grad=True), torch.randn(2, 2, 5, requires_grad=True)]
    out, _ = pkg.merge_attention_states(*x)
    out.sum().backward()
    xr = [t.detach().double().requires_grad_() for t in x]
    merge_ref(*xr)[0].sum().backward()
    for t, r in zip(x, xr):
        torch.testing.assert_close(t.grad.double(), r.grad, atol=1e-6, rtol=1e-5)


def test_empty(pkg):
    out, lse = pkg.merge_attention_states(torch.zeros(2, 0, 3, 16), torch.zeros(2, 3, 0),
                                          torch.zeros(2, 0, 3, 16), torch.zeros(2, 3, 0))
    assert out.shape == (2, 0, 3, 16) and lse.shape == (2, 3, 0)


def _args(**change):
    args = dict(out_a=torch.zeros(2, 5, 3, 16), lse_a=torch.zeros(2, 3, 5),
                out_b=torch.zeros(2, 5, 3, 16), lse_b=torch.zeros(2, 3, 5))
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (dict(out_a=[0.0]), "out_a must be a torch.Tensor"),
    (dict(lse_b=None), "lse_b must be a torch.Tensor"),
    (dict(out_a=torch.zeros(5, 16), lse_a=torch.zeros(5)), r"out_a must be \(\.\.\., N, H, d\)"),
    (dict(out_b=torch.zeros(2, 5, 3, 8)), "out_b has shape"),
    (dict(out_a=torch.zeros(2, 5, 3, 16, dtype=torch.int32)), "out_a must be float16"),
    (dict(out_b=torch.zeros(2, 5, 3, 16, dtype=torch.float16)), "out_b has dtype"),
    (dict(lse_a=torch.zeros(2, 5, 3)), r"lse_a must have shape \(2, 3, 5\)"),
    (dict(lse_b=torch.zeros(2, 3, 5, dtype=torch.float16)), "lse_b must be torch.float32"),
    (dict(lse_a=torch.zeros(2, 3, 5, dtype=torch.float64)), "lse_a must be torch.float32"),
    (dict(lse_b=torch.zeros(2, 3, 5, device="meta")), "lse_b is on meta but out_a is on cpu"),
    (dict(out_b=torch.zeros(2, 5, 3, 16, device="meta")), "out_b is on meta"),
])
def test_bad_arguments_refused_before_launch(pkg, monkeypatch, change, match):
    kernels = importlib.import_module(PACKAGE + "._ring_merge")
    def no_launch(*args, **kwargs):
        raise AssertionError("launched")
    monkeypatch.setattr(kernels, "merge", no_launch)
    with pytest.raises(ValueError, match=match):
        pkg.merge_attention_states(**_args(**change))
