"""Self-test cases: one generated-package call, described by a small frozen record, run on
fresh random inputs and judged against the float64 reference.

A `Case` names a kind of call (`KINDS`), the selftest package that serves it
(flashgen.selftest.package) and everything about its shape: dtype, batch, heads, head
dims, lengths, masks, dropout, mods, packed or cached lengths, page size, strided inputs,
the kernel family and a seed. It round-trips through JSON (`to_json` / `from_json`), which
is how a failing fuzz case is reported and replayed (`flashgen selftest --fuzz-case
'<json>'`). `run_case` makes the case's inputs from its seed, calls the package with its
outputs' memory poisoned (every torch.empty the call makes is NaN-filled, so an element a
kernel forgets to write shows), and compares every output -- the forward, the LSE, and for
training kinds dq, dk, dv (and a mod tensor's gradient) -- with an independent float64
reference (flashgen.reference, the mods written out by hand in flashgen.selftest.modref)
at the tolerance of the dtype (flashgen.selftest.kinds: OUT_TOL, GRAD_TOL, LSE_TOL).
NaN anywhere fails; a row that sees no key must be exactly 0 with LSE -inf. With dropout the reference applies the very keep mask the
call drew (replayed by the package's `dropout_mask` from the same generator state), and
the tolerance grows by the survivors' scale.

`SANITIZE_CASES` is the fixed, small set that `flashgen selftest`'s sanitizer driver runs
under compute-sanitizer (memcheck, racecheck), as a subprocess of this module: every
kernel family and kind at odd shapes (with --set, the reference runs on the CPU, so the
sanitizer sees flashgen's kernels and few of torch's). The command line runs case sets or
single cases, one line each, and exits 1 if any fails:

    python -m flashgen.selftest.cases --set sanitize [--device cuda] [--ref-device cpu]
    python -m flashgen.selftest.cases --case '<case json>' [--case ...] [--device cpu]
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass, field

KINDS = ("train", "varlen", "decode", "paged_decode", "mla_decode", "mods", "block_mask",
         "attn_mask", "ring_merge")
PACKAGES = ("gpt2", "llama", "mla", "mods", "selftest")
DTYPES = ("fp16", "bf16", "fp32")
FAMILIES = ("auto", "gluon", "tl")
# how q, k, v (and decode's new keys) sit in memory; the bytes around a view are NaN, so a
# kernel that reads outside its tensor shows
LAYOUTS = ("none",      # contiguous
           "heads",     # a slice of a tensor with more heads
           "pad",       # rows padded by 8 elements (16-byte aligned strides)
           "odd",       # rows padded by 1 element: strides TMA cannot read (Gluon -> tl)
           "bhnd",      # heads outside the tokens in memory (the other API's layout)
           "qkv")       # q, k, v as views of one fused-projection tensor
APIS = ("flash", "sdpa", "packed")


@dataclass(frozen=True)
class Case:
    """One call of a selftest package. Lengths: `n_q` / `n_k` are the queries and keys of a
    dense call (a ring call's whole sequence is `n_q`); varlen packs `seqlens_q` /
    `seqlens_k`; decode's cache holds `n_k` rows (its capacity), of which `seqlens_k` are
    filled per batch element before the `n_new` appended ones, and `n_q` queries a step.
    `mod_params` go to the call as keyword arguments; `options` are a kind's knobs
    (ring: strategy, layout; varlen: max_extra; attn_mask: mask; decode: int_lens)."""
    kind: str
    package: str
    dtype: str = "bf16"
    batch: int = 1
    h_q: int = 2
    h_kv: int = 2
    d: int = 64
    dv: int = 0                     # V's (and the output's) head dim when not d: MLA
    n_q: int = 16
    n_k: int = 16
    causal: bool = False
    window: tuple = (-1, -1)
    dropout: float = 0.0
    mods: tuple = ()
    mod_params: tuple = ()          # ((name, value), ...), sorted
    options: tuple = ()             # ((name, value), ...), sorted
    seqlens_q: tuple = ()
    seqlens_k: tuple = ()
    n_new: int = 0
    page_size: int = 0
    num_splits: int = 0
    api: str = "flash"
    strided: str = "none"
    return_lse: bool = True
    family: str = "auto"
    tiles: int = 0                  # > 0: force square tl tiles of this size (override_config)
    seed: int = 0

    def __post_init__(self):
        for name, allowed in (("kind", KINDS), ("package", PACKAGES), ("dtype", DTYPES),
                              ("family", FAMILIES), ("strided", LAYOUTS), ("api", APIS)):
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"case {name} {value!r}: expected one of {allowed}")
        # lists (from JSON) become tuples, dicts sorted pairs: the record stays hashable
        for name in ("window", "mods", "seqlens_q", "seqlens_k"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("mod_params", "options"):
            value = getattr(self, name)
            pairs = value.items() if isinstance(value, dict) else value
            object.__setattr__(self, name, tuple(sorted((str(k), v) for k, v in pairs)))
        if len(self.window) != 2:
            raise ValueError(f"case window {self.window}: expected (left, right)")

    @property
    def v_dim(self) -> int:
        return self.dv or self.d

    def option(self, name: str, default=None):
        return dict(self.options).get(name, default)

    def to_dict(self) -> dict:
        """The fields that differ from their defaults (kind and package always)."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name in ("kind", "package") or value != f.default:
                if f.name in ("mod_params", "options"):
                    value = dict(value)
                elif isinstance(value, tuple):
                    value = list(value)
                out[f.name] = value
        return out

    def to_json(self) -> str:
        """Compact JSON without single quotes (it goes between them in a shell line)."""
        text = json.dumps(self.to_dict(), separators=(",", ":"))
        if "'" in text:  # (no field holds free text; a guard for a future one)
            raise ValueError(f"case JSON with a single quote cannot be quoted for a shell: {text}")
        return text

    @classmethod
    def from_dict(cls, data: dict) -> "Case":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"unknown case field(s) {unknown}: expected some of {sorted(names)}")
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "Case":
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"a case is a JSON object, got {type(data).__name__}")
        return cls.from_dict(data)

    def label(self) -> str:
        """A short human description: kind, package, dtype and shape."""
        if self.kind == "varlen":
            shape = f"lens q{list(self.seqlens_q)} k{list(self.seqlens_k)}"
        elif self.kind in ("decode", "paged_decode", "mla_decode"):
            shape = (f"B{self.batch} Nq{self.n_q} cache{self.n_k} "
                     f"lens{list(self.seqlens_k)}+{self.n_new}")
            if self.page_size:
                shape += f" page{self.page_size}"
        else:
            shape = f"B{self.batch} Nq{self.n_q} Nk{self.n_k}"
        dims = f"d{self.d}" + (f"v{self.dv}" if self.dv and self.dv != self.d else "")
        bits = [self.kind, self.package, self.dtype, shape, f"H{self.h_q}/{self.h_kv}", dims]
        if self.causal:
            bits.append("causal")
        if tuple(self.window) != (-1, -1):
            bits.append(f"window{tuple(self.window)}")
        if self.dropout:
            bits.append(f"p{self.dropout:g}")
        if self.mods:
            bits.append("+".join(self.mods))
        if self.strided != "none":
            bits.append(self.strided)
        if self.api != "flash":
            bits.append(self.api)
        bits.append(self.family)
        return " ".join(bits)


@dataclass
class CaseResult:
    """What running a case gave. `errors`: for each output, the worst element's
    |got - ref| / (atol + rtol |ref|) -- at most 1 passes (NaN or inf: never). `passed` is
    False for a skipped case too (`skipped` says why); `failed` is a real failure."""
    case: Case
    passed: bool
    errors: dict = field(default_factory=dict)
    message: str = ""
    skipped: str = ""
    note: str = ""      # e.g. the family a case asked for and could not get here
    seconds: float = 0.0

    @property
    def failed(self) -> bool:
        return not self.passed and not self.skipped

    def line(self) -> str:
        """One line: status, seconds, the case's label, the worst error, the message."""
        status = "ok  " if self.passed else ("skip" if self.skipped else "FAIL")
        worst = max(self.errors.items(), key=lambda kv: _sortable(kv[1]), default=None)
        parts = [f"{status} {self.seconds:6.2f}s {self.case.label()}"]
        if worst is not None:
            parts.append(f"worst {worst[0]} {worst[1]:.2f}x tol")
        if self.skipped:
            parts.append(f"skipped: {self.skipped}")
        if self.message:
            parts.append(self.message)
        if self.note:
            parts.append(f"({self.note})")
        return " | ".join(parts)


def _sortable(x: float) -> float:
    return float("inf") if x != x else x


def run_case(case: Case, packages: dict, device, ref_device=None) -> CaseResult:
    """Run one case on `device` ("cpu": Triton's interpreter; "cuda"), against the float64
    reference computed on `ref_device` (default: `device`). Never raises for a problem of
    the case: a kernel's exception (a compile failure, an illegal argument) is this case's
    failure, with its message."""
    from . import kinds  # (imports torch)

    start = time.perf_counter()
    try:
        errors, problems, note = kinds.run(case, packages[case.package], str(device),
                                             str(ref_device or device))
    except Exception as e:  # noqa: BLE001 -- a case's exception is its result
        return CaseResult(case, False, message=kinds.describe_exception(e),
                          seconds=time.perf_counter() - start)
    bad = [name for name, err in errors.items() if not err <= 1.0]
    messages = list(problems) + [f"{name} {errors[name]:.3g}x tol" for name in bad]
    return CaseResult(case, not messages, errors, "; ".join(messages), note=note,
                      seconds=time.perf_counter() - start)


def _sanitize_cases() -> list[Case]:
    """Every kind, both families (`tl` and, on Hopper, Gluon), at odd shapes: N = 1, 59, 257,
    Nq != Nk, GQA 8:1, strided inputs, d = 96; each a single small set of launches (the
    sanitizer runs kernels 10-100x slower)."""
    C = Case
    cases = []
    for family in ("gluon", "tl"):
        cases += [
            C("train", "gpt2", "fp16", batch=3, h_q=2, h_kv=2, d=64, n_q=59, n_k=59, causal=True,
              family=family, seed=1),
            C("train", "llama", "bf16", batch=1, h_q=8, h_kv=1, d=128, n_q=59, n_k=257,
              causal=True, family=family, seed=2),
            C("train", "selftest", "bf16", batch=1, h_q=4, h_kv=1, d=96, n_q=257, n_k=257,
              window=(64, 0), strided="pad", family=family, seed=3),
            C("train", "gpt2", "bf16", batch=1, h_q=2, h_kv=2, d=64, n_q=127, n_k=127,
              causal=True, dropout=0.2, family=family, seed=4),
            C("varlen", "selftest", "bf16", batch=4, h_q=8, h_kv=1, d=96, seqlens_q=(59, 0, 1, 200),
              seqlens_k=(59, 3, 0, 257), causal=True, family=family, seed=5),
            C("block_mask", "mods", "bf16", batch=2, h_q=4, h_kv=1, d=64, n_q=257, n_k=257,
              causal=True, mods=("document",), family=family, seed=6),
            C("mods", "mods", "bf16", batch=1, h_q=4, h_kv=4, d=128, n_q=59, n_k=59, causal=True,
              mods=("sink_logits",), family=family, seed=7),
            C("mla_decode", "mla", "bf16", batch=2, h_q=16, h_kv=1, d=576, dv=512, n_q=1,
              n_k=256, seqlens_k=(59, 255), n_new=1, page_size=64, causal=True,
              options={"latent": 1}, family=family, seed=8),
            C("ring_merge", "llama", "bf16", batch=1, h_q=8, h_kv=1, d=128, n_q=258, n_k=258,
              causal=True, family=family, seed=9),
        ]
    cases += [
        # the large head dims' Gluon backward (opt-in: asked for here), its P^T / dS^T
        # hand-over between the consumers under racecheck
        C("train", "mla", "bf16", batch=2, h_q=8, h_kv=2, d=192, dv=128, n_q=59, n_k=257,
          causal=True, family="gluon", seed=17),
        C("train", "selftest", "fp32", batch=1, h_q=2, h_kv=1, d=80, n_q=1, n_k=1, seed=10),
        C("train", "selftest", "bf16", batch=2, h_q=2, h_kv=2, d=96, n_q=59, n_k=127,
          strided="odd", seed=11),
        C("train", "selftest", "fp32", batch=1, h_q=8, h_kv=1, d=96, n_q=59, n_k=59,
          causal=True, dropout=0.3, window=(16, -1), seed=12),
        C("varlen", "gpt2", "fp16", batch=3, h_q=2, h_kv=2, d=64, seqlens_q=(0, 59, 1),
          seqlens_k=(0, 59, 1), causal=True, dropout=0.1, seed=13),
        C("decode", "llama", "bf16", batch=3, h_q=8, h_kv=1, d=128, n_q=1, n_k=257,
          seqlens_k=(0, 59, 256), n_new=1, num_splits=3, causal=True, seed=14),
        C("paged_decode", "selftest", "bf16", batch=3, h_q=4, h_kv=1, d=96, n_q=2, n_k=256,
          seqlens_k=(1, 100, 250), n_new=2, page_size=16, causal=True, seed=15),
        C("attn_mask", "mods", "bf16", batch=2, h_q=2, h_kv=2, d=64, n_q=59, n_k=257,
          api="sdpa", options={"mask": "float"}, seed=16),
    ]
    return cases


SANITIZE_CASES: list[Case] = _sanitize_cases()
CASE_SETS = {"sanitize": SANITIZE_CASES}


def run_cases(cases, device, ref_device=None, packages=None, out=sys.stdout) -> list[CaseResult]:
    """Run `cases` in this process, printing one line each to `out` (None: silent)."""
    from .package import selftest_packages

    if packages is None:
        packages = selftest_packages(device, sorted({c.package for c in cases}))
    results = []
    for case in cases:
        result = run_case(case, packages, device, ref_device)
        results.append(result)
        if out is not None:
            print(result.line(), file=out, flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m flashgen.selftest.cases",
        description="Run flashgen self-test cases against the float64 reference (one line "
                    "per case; exit status 1 if any fails).")
    parser.add_argument("--set", choices=sorted(CASE_SETS), action="append", default=[],
                        help="a fixed set of cases (sanitize: the compute-sanitizer set)")
    parser.add_argument("--case", action="append", default=[], metavar="JSON",
                        help="one case as JSON (a fuzz failure's reproducer)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present)")
    parser.add_argument("--ref-device", default=None,
                        help="where the float64 reference runs (default: cpu for --set "
                             "sanitize, so the sanitizer checks only flashgen's kernels; "
                             "else the device)")
    args = parser.parse_args(argv)
    cases = [c for name in args.set for c in CASE_SETS[name]]
    try:
        cases += [Case.from_json(text) for text in args.case]
    except (ValueError, TypeError) as e:
        parser.error(f"--case: {e}")
    if not cases:
        parser.error("nothing to run: pass --set or --case")
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    ref_device = args.ref_device or ("cpu" if args.set else device)
    results = run_cases(cases, device, ref_device)
    failed = [r for r in results if r.failed]
    print(f"{len(results)} cases: {sum(r.passed for r in results)} passed, {len(failed)} failed, "
          f"{sum(bool(r.skipped) for r in results)} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
