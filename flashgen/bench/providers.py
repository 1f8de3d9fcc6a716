"""The callables `flashgen bench` times: flashgen's generated packages (built from their
specs into a temporary folder once per process) and the peers (SDPA's flash, cuDNN and
efficient backends, FlexAttention, naive PyTorch), each as fn(q, k, v, causal, p) -> out.

The flashgen packages come from specs/gpt2.yaml (d=64) and specs/llama.yaml (d=128),
specs/bench/dropout_d128.yaml for the dropout suite, specs/mods.yaml for the mods suite,
specs/bench/fp8_d128.yaml (d=128) and gpt2.yaml (d=64) for the fp8 rows (bench/fp8.py)
(the copies inside the installed package when flashgen is installed from a wheel), or the
user's `--spec`, which replaces them for the head dims it was built for.

torch is imported only when a provider is built.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

from ..resources import bundled_spec
from . import fa4 as bench_fa4
from . import fp8 as bench_fp8
from .suites import DROPOUT_SPEC, FP8_SPECS, SPECS

_packages = {}  # (spec path, spec sha) -> (module, sha): one build per process


def load_package(spec_path, d=None, dropout=False):
    """(module, spec sha) of the package built from spec_path (default: the example spec
    for head dim d, or the dropout suite's), built once per process into a temporary folder
    and imported under a name of its own (so a user's spec may reuse an example's package
    name)."""
    import importlib.util
    import tempfile

    from ..build import build_spec
    from ..spec import load_spec

    if spec_path is None:
        spec_path = bundled_spec(DROPOUT_SPEC if dropout else SPECS[d])
    spec = load_spec(spec_path)
    key = (str(Path(spec_path).resolve()), spec.sha)
    if key not in _packages:
        out = Path(tempfile.mkdtemp(prefix="flashgen-bench-"))
        root = build_spec(spec, out).root
        name = f"flashgen_bench_{spec.package}_{spec.sha}"
        mspec = importlib.util.spec_from_file_location(
            name, root / "__init__.py", submodule_search_locations=[str(root)])
        module = importlib.util.module_from_spec(mspec)
        sys.modules[name] = module
        mspec.loader.exec_module(module)
        _packages[key] = (module, spec.sha)
    return _packages[key]


def spec_sha(package_dir) -> str | None:
    """The spec sha a generated package records in its header line."""
    init = Path(package_dir) / "__init__.py"
    if not init.is_file():
        return None
    m = re.search(r"\bsha ([0-9a-f]+)", init.read_text().split("\n", 1)[0])
    return m.group(1) if m else None


def raise_recompile_limit(limit=1024):
    """So that no FlexAttention shape silently falls back to eager after dynamo's default
    8 recompiles."""
    import torch._dynamo
    for name in ("cache_size_limit", "recompile_limit", "accumulated_cache_size_limit",
                 "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), limit))


class Providers:
    """Callables fn(q, k, v, causal, p) -> out for each provider name; built lazily.
    `spec`: the user's spec, whose package serves flashgen at its head dims."""

    def __init__(self, spec=None):
        import torch  # noqa: F401
        self.spec = spec
        self._flex = None
        self._fa4 = None  # flash_attn.cute, or the Unavailable that says why not
        self._cudnn = None  # cuDNN's frontend (the cudnn_fp8 rows), or the Unavailable
        self._masks = {}

    def package(self, d, dropout=False):
        if self.spec is not None and not dropout:
            return load_package(self.spec)
        return load_package(None, d, dropout)

    def mods_inputs(self, case, device="cuda"):
        """(flashgen kwargs, FlexAttention (score_mod, block_mask)) of a mods case."""
        from . import mods as bench_mods
        key = (case.mod, case.b, case.h, case.n)
        if key not in self._masks:
            kw = bench_mods.inputs(case.mod, case.b, case.h, case.n, device)
            self._masks[key] = (kw, None)
        kw, flex = self._masks[key]
        return kw, flex

    def get(self, name, case):
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel

        if case.suite == "mods":
            return self._get_mods(name, case)

        if name in ("flashgen", "flashgen_p0", "flashgen_tl"):
            pkg, _ = self.package(case.d, dropout=case.suite == "dropout")
            fixed_p = 0.0 if name == "flashgen_p0" else None
            family = "tl" if name == "flashgen_tl" else ""

            def run(q, k, v, causal, p):
                pkg._runtime.use_family(family)  # a no-op unless the provider changed
                return pkg.scaled_dot_product_attention(
                    q, k, v, dropout_p=p if fixed_p is None else fixed_p, is_causal=causal)
            return run
        if name.startswith("sdpa_"):
            backend = {"sdpa_flash": SDPBackend.FLASH_ATTENTION,
                       "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                       "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}[name]

            def run(q, k, v, causal, p):
                with sdpa_kernel(backend):
                    return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=causal)
            return run
        if name == "flex":
            from torch.nn.attention.flex_attention import create_block_mask
            compiled = self._compiled_flex()

            def run(q, k, v, causal, p):
                if p:
                    raise NotImplementedError("FlexAttention has no dropout")
                mask = None
                if causal:
                    key = (q.shape[2], k.shape[2])
                    if key not in self._masks:
                        self._masks[key] = create_block_mask(
                            lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=key[0],
                            KV_LEN=key[1], device=q.device)
                    mask = self._masks[key]
                return compiled(q, k, v, block_mask=mask)
            return run
        if name in ("flashgen_fp8", "flashgen_fp8_gluon", "cudnn_fp8"):
            pkg, _ = load_package(bundled_spec(FP8_SPECS[case.d]))
            if name.startswith("flashgen_fp8"):
                return bench_fp8.flashgen_fp8(pkg, "gluon" if name.endswith("gluon") else "")
            if self._cudnn is None:
                try:
                    self._cudnn = bench_fp8.load_cudnn()
                except bench_fp8.Unavailable as e:
                    self._cudnn = e
            if isinstance(self._cudnn, Exception):
                raise bench_fp8.Unavailable(str(self._cudnn))
            return bench_fp8.cudnn_fp8(self._cudnn, pkg.quantize_fp8)
        if name == "fa4":
            module = self.fa4()

            def run(q, k, v, causal, p):
                if p:
                    raise NotImplementedError("FlashAttention-4 has no dropout")
                return bench_fa4.attention(module, q, k, v, causal)
            return run
        if name == "naive":
            def run(q, k, v, causal, p):
                s = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)
                if causal:
                    nq, nk = s.shape[-2:]
                    keep = torch.ones(nq, nk, dtype=torch.bool, device=q.device).tril(nk - nq)
                    s = s.masked_fill(~keep, float("-inf"))
                a = torch.softmax(s.float(), dim=-1).to(q.dtype)
                if p:
                    a = F.dropout(a, p)
                return a @ v
            return run
        raise ValueError(f"unknown provider {name!r}")

    def fa4(self):
        """flash_attn.cute, imported once; raises fa4.Unavailable (every time it is asked
        for) when FA4 cannot run here."""
        if self._fa4 is None:
            try:
                self._fa4 = bench_fa4.load()
            except bench_fa4.Unavailable as e:
                self._fa4 = e
        if isinstance(self._fa4, bench_fa4.Unavailable):
            raise bench_fa4.Unavailable(str(self._fa4))
        return self._fa4

    def _compiled_flex(self):
        """FlexAttention compiled once for every case (its recompile limit raised: each
        shape and mask recompiles)."""
        if self._flex is None:
            import torch
            from torch.nn.attention.flex_attention import flex_attention

            raise_recompile_limit()
            self._flex = torch.compile(flex_attention, dynamic=False)
        return self._flex

    def _get_mods(self, name, case):
        from . import mods as bench_mods
        band, mods, _ = bench_mods.MOD_CASES[case.mod]
        kw, _ = self.mods_inputs(case)
        if name == "flashgen":
            pkg, _ = load_package(bundled_spec(bench_mods.MODS_SPEC))

            def run(q, k, v, causal, p):
                return pkg.scaled_dot_product_attention(q, k, v, is_causal=band, mods=mods, **kw)
            return run
        if name == "flex":
            compiled = self._compiled_flex()
            key = ("flex", case.mod, case.b, case.h, case.n)
            if key not in self._masks:
                self._masks[key] = bench_mods.flex_mods(case.mod, kw, case.b, case.h, case.n, "cuda")
            score_mod, block_mask = self._masks[key]

            def run(q, k, v, causal, p):
                return compiled(q, k, v, score_mod=score_mod, block_mask=block_mask)
            return run
        raise ValueError(f"provider {name!r} has no mods rows")

