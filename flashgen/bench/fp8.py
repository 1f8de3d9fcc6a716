"""The fp8 rows of the training suite: flashgen's fp8 kernels (`flashgen_fp8`) and cuDNN's
fp8 SDPA through its Python frontend (`cudnn_fp8`, nvidia-cudnn-frontend's graphs), forward
and backward on e4m3 Q, K, V with one scale a tensor (TransformerEngine's recipe).

Both start from the suite's bf16 q, k, v. Quantizing them (`quantize_fp8`) happens once per
input tensor, outside the timed calls: a training recipe quantizes in the producer's
epilogue, and what is compared is the attention. flashgen writes O in bf16 (FA3's
contract). cuDNN writes O in e4m3 with its scale (what its fp8 forward produces and
TransformerEngine hands to the next fp8 GEMM): the timed forward is the graph alone
(`fn.timed`, timing.timed_call), and only the correctness check dequantizes O. cuDNN's
backward takes dO in e4m3 (quantized once per dO tensor) and writes dQ, dK, dV in e4m3
with scales from their amax in a first, calibrating run (delayed scaling's); they are
dequantized to the bf16 leaves' gradients inside the timed backward (three elementwise
kernels, ~1% of an fp8 backward at B*N = 16k, H*d = 2048).

cuDNN is optional: Unavailable (the row says "skipped: <why>") where the frontend is not
installed or the GPU has no fp8 tensor cores. torch is imported inside the functions.
"""
from __future__ import annotations

from .fa4 import Unavailable

E4M3_MAX = 448.0
# The output's max error against float32 on the dequantized inputs (runner._check): P
# rounded to e4m3 keeps 2^-4 of each probability; `flashgen check` holds fp8 variants to
# the same 0.2 (measured 1.8e-2..9.0e-2 there)
FP8_TOL = 0.2


class _Quantized:
    """quantize_fp8 of the last input tensors seen, by storage and autograd state: the
    bench calls a provider many times on the same q, k, v."""

    def __init__(self, quantize):
        self.quantize, self.key, self.value = quantize, None, None

    def __call__(self, *tensors):
        key = tuple((t.data_ptr(), tuple(t.shape), t.requires_grad) for t in tensors)
        if key != self.key:
            self.key, self.value = key, tuple(self.quantize(t) for t in tensors)
        return self.value

    def dequantized(self, *tensors):
        """The float32 values the kernels see: x_fp8 * descale (one descale a tensor)."""
        return tuple(x8.float() * d.float() for x8, d in self(*tensors))


def _checked_on_fp8(run, quantized):
    run.dequantized, run.tol = quantized.dequantized, FP8_TOL
    return run


def flashgen_fp8(pkg, family: str = ""):
    """fn(q, k, v, causal, p) on (B, H, N, d) bf16: the package's fp8 kernels on e4m3
    copies (one descale a tensor), bf16 out; the gradients reach q, k, v straight through.
    family: "" the package's choice (on Hopper the Gluon fp8 forward; `tl` with
    FLASHGEN_FP8_GLUON=0), "gluon" the Gluon family forced
    (`flashgen_fp8_gluon`: an interleaved A/B in one run)."""
    quantized = _Quantized(lambda t: pkg.quantize_fp8(t, "tensor"))

    def run(q, k, v, causal, p):
        if p:
            raise NotImplementedError("the fp8 rows run without dropout")
        pkg._runtime.use_family(family)  # a no-op unless another provider changed it
        (q8, qd), (k8, kd), (v8, vd) = quantized(q, k, v)
        return pkg.scaled_dot_product_attention(q8, k8, v8, is_causal=causal, q_descale=qd,
                                                k_descale=kd, v_descale=vd)
    return _checked_on_fp8(run, quantized)


def load_cudnn():
    """The cudnn frontend module, or Unavailable saying why not."""
    import torch
    try:
        import cudnn
    except ImportError as e:
        raise Unavailable(f"nvidia-cudnn-frontend is not installed ({e}); the wheel is staged "
                          "with FA4's parts (part p4)") from None
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
        raise Unavailable("cuDNN's fp8 attention needs a GPU with fp8 tensor cores (sm_89+)")
    return cudnn


def _scalar(x):
    import torch
    return torch.full((1, 1, 1, 1), float(x), dtype=torch.float32, device="cuda")


class CudnnFp8:
    """cuDNN's fp8 forward and backward graphs for one (shape, causal), built on first use."""

    def __init__(self, cudnn, q, k, v, causal, training):
        import torch
        self.cudnn, self.causal, self.training = cudnn, causal, training
        fp8 = cudnn.data_type.FP8_E4M3
        self.q8, self.k8, self.v8 = (torch.empty_like(t, dtype=torch.uint8) for t in (q, k, v))
        self.d = {n: _scalar(1.0) for n in ("q", "k", "v")}
        b, h, n, dv = v.shape[0], q.shape[1], q.shape[2], v.shape[3]
        self.o8 = torch.empty(b, h, n, dv, dtype=torch.uint8, device="cuda")
        self.stats = torch.empty(b, h, n, 1, dtype=torch.float32, device="cuda")
        self.amax_o = _scalar(0.0)
        self.s = {"descale_s": _scalar(1 / E4M3_MAX), "scale_s": _scalar(E4M3_MAX),
                  "scale_o": _scalar(1.0)}
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT)
        t = {x: g.tensor_like(getattr(self, x + "8")).set_data_type(fp8) for x in "qkv"}
        sc = {x: g.tensor_like(self.d[x]) for x in "qkv"}
        ss = {x: g.tensor_like(y) for x, y in self.s.items()}
        o, stats, _, amax_o = g.sdpa_fp8(
            q=t["q"], k=t["k"], v=t["v"], descale_q=sc["q"], descale_k=sc["k"],
            descale_v=sc["v"], descale_s=ss["descale_s"], scale_s=ss["scale_s"],
            scale_o=ss["scale_o"], generate_stats=training, attn_scale=q.shape[3] ** -0.5,
            use_causal_mask=causal)
        o.set_output(True).set_dim(list(self.o8.shape)).set_stride(list(self.o8.stride())) \
            .set_data_type(fp8)
        if training:
            stats.set_output(True).set_dim(list(self.stats.shape)) \
                .set_stride(list(self.stats.stride())).set_data_type(cudnn.data_type.FLOAT)
        amax_o.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]) \
            .set_data_type(cudnn.data_type.FLOAT)
        self.fwd_graph = self._build(g)
        self.fwd_pack = {t["q"]: self.q8, t["k"]: self.k8, t["v"]: self.v8, o: self.o8,
                         amax_o: self.amax_o, **{sc[x]: self.d[x] for x in "qkv"},
                         **{ss[x]: self.s[x] for x in self.s}}
        if training:
            self.fwd_pack[stats] = self.stats
        self.workspace = torch.empty(self.fwd_graph.get_workspace_size(), dtype=torch.uint8,
                                     device="cuda")
        self.bwd_graph = None
        self.loaded = None  # the quantized inputs the buffers hold (load)
        self.do_key = None  # the dO tensor do8 was quantized from (backward)

    def _build(self, g):
        heur = self.cudnn.heur_mode
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([heur.A, heur.FALLBACK])
        g.check_support()
        g.build_plans()
        return g

    def _run(self, graph, pack):
        import torch
        if graph.get_workspace_size() > self.workspace.numel():
            self.workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8,
                                         device="cuda")
        graph.execute(pack, self.workspace)

    def load(self, q8, qd, k8, kd, v8, vd):
        """Point the graphs at new e4m3 inputs: copy them into the packs' buffers (once per
        input tensor, outside the timed calls) and set O's scale from V's (|O| <= max |v|)."""
        import torch
        for buf, x in ((self.q8, q8), (self.k8, k8), (self.v8, v8)):
            buf.copy_(x.view(torch.uint8))
        for name, d in (("q", qd), ("k", kd), ("v", vd)):
            self.d[name].fill_(float(d.reshape(-1)[0]))
        self.s["scale_o"].fill_(1.0 / float(vd.reshape(-1)[0]))

    def forward(self):
        self._run(self.fwd_graph, self.fwd_pack)
        return self.o8

    def output(self):
        """O in bf16 (the check's; not in the timed forward)."""
        import torch
        return (self.o8.view(torch.float8_e4m3fn).float() / self.s["scale_o"].reshape(1)) \
            .to(torch.bfloat16)

    def backward(self, do):
        """dQ, dK, dV (bf16) for dO (bf16): dO quantized once per tensor; the first call
        builds the graph and calibrates the gradients' scales from their amax."""
        import torch
        key = (do.data_ptr(), tuple(do.shape))
        if self.do_key != key:
            amax = do.detach().abs().amax().float().clamp(min=1e-12)
            self.do8 = (do.float() * (E4M3_MAX / amax)).to(torch.float8_e4m3fn).view(torch.uint8)
            self.descale_do = (amax / E4M3_MAX).reshape(1, 1, 1, 1)
            self.do_key = key
        if self.bwd_graph is None:
            self._build_backward()
            self._run(self.bwd_graph, self.bwd_pack)  # calibration: amax -> scales
            for g in ("dQ", "dK", "dV", "dP"):
                amax = self.b_amax[g].clamp(min=1e-12)
                self.b_scale[g].copy_(E4M3_MAX / amax)
                if g == "dP":
                    self.descale_dp.copy_(amax / E4M3_MAX)
        self.bwd_pack[self.do_t] = self.do8
        self.bwd_pack[self.descale_do_t] = self.descale_do
        self._run(self.bwd_graph, self.bwd_pack)
        return tuple((x.view(torch.float8_e4m3fn).float() / self.b_scale[g].reshape(1))
                     .to(torch.bfloat16) for x, g in ((self.dq8, "dQ"), (self.dk8, "dK"),
                                                      (self.dv8, "dV")))

    def _build_backward(self):
        import torch
        cudnn = self.cudnn
        fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32)
        self.dq8, self.dk8, self.dv8 = (torch.empty_like(x) for x in (self.q8, self.k8, self.v8))
        self.b_scale = {x: _scalar(1.0) for x in ("dQ", "dK", "dV", "dP")}
        self.b_amax = {x: _scalar(0.0) for x in ("dQ", "dK", "dV", "dP")}
        self.descale_dp = _scalar(1.0)
        t = {x: g.tensor_like(getattr(self, x + "8")).set_data_type(fp8) for x in "qkvo"}
        self.do_t = g.tensor_like(self.do8).set_data_type(fp8)
        stats = g.tensor_like(self.stats)
        # O's descale is V's: the forward wrote O at scale_o = 1 / descale_v
        desc = {"q": self.d["q"], "k": self.d["k"], "v": self.d["v"], "o": self.d["v"],
                "s": self.s["descale_s"], "dP": self.descale_dp}
        dt = {x: g.tensor_like(y) for x, y in desc.items()}
        self.descale_do_t = g.tensor_like(self.descale_do)
        st = {x: g.tensor_like(y) for x, y in self.b_scale.items()}
        scale_s = g.tensor_like(self.s["scale_s"])
        dq, dk, dv, aq, ak, av, ap = g.sdpa_fp8_backward(
            q=t["q"], k=t["k"], v=t["v"], o=t["o"], dO=self.do_t, stats=stats,
            descale_q=dt["q"], descale_k=dt["k"], descale_v=dt["v"], descale_o=dt["o"],
            descale_dO=self.descale_do_t, descale_s=dt["s"], descale_dP=dt["dP"],
            scale_s=scale_s, scale_dQ=st["dQ"], scale_dK=st["dK"], scale_dV=st["dV"],
            scale_dP=st["dP"], attn_scale=self.q8.shape[3] ** -0.5, use_causal_mask=self.causal)
        for out, buf in ((dq, self.dq8), (dk, self.dk8), (dv, self.dv8)):
            out.set_output(True).set_dim(list(buf.shape)).set_stride(list(buf.stride())) \
                .set_data_type(fp8)
        for out in (aq, ak, av, ap):
            out.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
        self.bwd_graph = self._build(g)
        self.bwd_pack = {t["q"]: self.q8, t["k"]: self.k8, t["v"]: self.v8, t["o"]: self.o8,
                         stats: self.stats, scale_s: self.s["scale_s"],
                         dq: self.dq8, dk: self.dk8, dv: self.dv8,
                         **{dt[x]: desc[x] for x in desc},
                         **{st[x]: self.b_scale[x] for x in st},
                         aq: self.b_amax["dQ"], ak: self.b_amax["dK"], av: self.b_amax["dV"],
                         ap: self.b_amax["dP"]}


def cudnn_fp8(cudnn, quantize):
    """fn(q, k, v, causal, p) -> bf16 O through cuDNN's fp8 graphs, with autograd; fn.timed
    is the same call returning cuDNN's e4m3 O (the forward the bench times). `quantize`:
    a package's quantize_fp8 (one scale a tensor)."""
    import torch

    graphs = {}
    quantized = _Quantized(lambda t: quantize(t.detach(), "tensor"))

    def graph(q, k, v, causal):
        key = (tuple(q.shape), tuple(v.shape), causal, q.requires_grad)
        if key not in graphs:
            graphs.clear()  # one shape at a time: the suite's cases run one after another
            graphs[key] = CudnnFp8(cudnn, q, k, v, causal, training=q.requires_grad)
        g = graphs[key]
        (q8, qd), (k8, kd), (v8, vd) = quantized(q, k, v)
        if g.loaded is not quantized.value:
            g.load(q8, qd, k8, kd, v8, vd)
            g.loaded = quantized.value
        return g

    class _Attention(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v, g):
            ctx.g = g
            g.forward()
            return g.output()

        @staticmethod
        def backward(ctx, do):
            return (*ctx.g.backward(do.contiguous()), None)

    def run(q, k, v, causal, p):
        if p:
            raise NotImplementedError("the fp8 rows run without dropout")
        g = graph(q, k, v, causal)
        if q.requires_grad:
            return _Attention.apply(q, k, v, g)
        g.forward()
        return g.output()

    def timed(q, k, v, causal, p):
        return graph(q, k, v, causal).forward()

    run.timed = timed
    return _checked_on_fp8(run, quantized)
