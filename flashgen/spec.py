"""The flashgen spec: an immutable, typed model of one YAML spec file.

A spec is parsed once, by :func:`load_spec` / :func:`parse_spec`, into a frozen
:class:`Spec`.  Downstream stages (planner, code generator) never see a raw
dict or YAML node; every problem in the file is reported as a
:class:`~flashgen.errors.SpecError` naming ``file:line``, the dotted key, what
was expected and how to fix it.  Later stages report their own spec-related
problems (e.g. explicit tiles that do not fit in shared memory) through
:meth:`Spec.error`, which cites the line of the offending key.

YAML format
-----------
::

    package: gpt2_attn          # required; Python identifier, not a keyword
    head_dims: [64]             # required; multiples of 8 in 16..512, or {qk: D, v: DV}
                                # (V's own head dim); {qk, v, decode_only: true} builds
                                # decode kernels alone (then up to 576, DeepSeek's MLA)
    dtypes: [fp16, bf16]        # required; subset of fp16, bf16, fp32, fp8_e4m3
                                # (fp8: q, k, v with descales, output bf16; no decode,
                                # no mods, no variants: see check_fp8)
    masks: [none, causal]       # required; subset of none, causal, sliding_window
    dropout: true               # optional, default false
    gqa: false                  # optional, default false (allow Hq != Hkv)
    decode: false               # optional, default false (KV-cache decode kernels)
    batch_invariant: false      # optional, default false (the calls' default; needs decode)
    kv_cache_dtypes: [bf16, int8]   # optional: decode / paged-prefill caches (1-byte: scales)
    window: {left: 256, right: 0}   # required iff sliding_window is in masks
    gpu:                        # required
      name: H100                #   required, a string
      sram_bytes: 232448        #   required, 16384..1048576 (per-block smem limit)
      sm_count: 132             #   optional, >= 1
      arch: sm_90               #   optional, sm_XY (compute capability X.Y), from
                                #   sm_75; default: the H100's register model (sm_90)
    blocks: auto                # optional; or {forward/backward/decode: auto or a tile}
    seqlen_buckets: [512, 1024, 2048, 4096, 8192, 16384]   # optional

Rules worth knowing:

* Lists must be non-empty and must not repeat an entry; they are stored sorted
  (numbers) or in canonical order (:data:`DTYPES`, :data:`MASKS`).
* Types are strict: ``true`` is not an integer, ``"64"`` (quoted) is not an
  integer, ``64`` is not a list (write ``[64]``).
* ``null`` is accepted only where the default is None (``window``,
  ``gpu.sm_count``, ``gpu.arch``) and means "not given".
* ``gpu.arch``: below sm_90 mma.sync holds operands in registers, so the planner plans
  smaller, spill-free tiles there (planner_core.max_acc_regs); else the H100's model.
* Explicit tiles: ``block_m``/``block_n`` powers of two in 16..256,
  ``num_warps`` in {2, 4, 8}, ``num_stages`` in 1..5; all four required.
* Window extents are ints >= -1 (-1 = unbounded on that side), not both -1.
* Unknown and duplicate keys are errors at any level (PyYAML would silently keep
  the last duplicate, so we compose the node tree and build values ourselves).
* Errors are raised at the first problem in file order; then missing
  required keys; then cross-key checks (window vs. masks).
"""

from __future__ import annotations

import difflib
import hashlib
import keyword
import os
import re
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Callable, Mapping

import yaml
from yaml.constructor import ConstructorError, SafeConstructor
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from flashgen.errors import SpecError
from flashgen.mods import BUILTINS, KINDS, RESERVED, Mod, ModError, builtin_mod, make_mod
from flashgen.planner_core import DEFAULT_ARCH, MIN_ARCH, STAGE_COUNTS, WARP_COUNTS

__all__ = [
    "DTYPES", "FP8_DTYPES", "KV_CACHE_DTYPES", "KV_QUANT_DTYPES", "MASKS", "DEFAULT_SEQLEN_BUCKETS",
    "Loc", "BlockConfig", "Window", "GpuTarget", "Blocks", "ModVariant", "Spec",
    "load_spec", "parse_spec",
]

DTYPES = ("fp16", "bf16", "fp32", "fp8_e4m3")
# fp8 dtypes (FA3's inputs: q, k, v in fp8 with fp32 descales, the output in bf16)
FP8_DTYPES = ("fp8_e4m3",)
# KV-cache dtypes (issue 49): the queries' own, or 1-byte ones the decode and paged-prefill
# kernels dequantize in registers (fp32 scales), read with fp16 / bf16 queries
KV_CACHE_DTYPES = ("fp16", "bf16", "fp32", "fp8_e4m3", "int8")
KV_QUANT_DTYPES = ("fp8_e4m3", "int8")
MASKS = ("none", "causal", "sliding_window")
DEFAULT_SEQLEN_BUCKETS = (512, 1024, 2048, 4096, 8192, 16384)

BLOCK_STAGES = ("forward", "backward", "decode")
# the planner's candidate sets: a value it would never consider is refused here, at its line
NUM_WARPS = WARP_COUNTS
SRAM_MIN, SRAM_MAX = 16384, 1 << 20
# head dims: up to 512 for every kernel (Gemma 4's global layers; past 256 the planner
# splits the accumulators' columns across warps, planner_core.warps_across_d); a
# `decode_only` entry up to DeepSeek's latent cache (576 for Q/K, 512 for V)
HEAD_DIM_MAX = 512
DECODE_HEAD_DIM_MAX = 576


# --------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------

@dataclass(frozen=True)
class Loc:
    """Where a key sits: ``line`` is the 1-based line of the key in ``file``."""
    file: str
    line: int


@dataclass(frozen=True)
class BlockConfig:
    """An explicit tile choice for one kernel kind."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Window:
    """Default sliding-window extents in tokens; -1 = unbounded on that side."""
    left: int
    right: int


@dataclass(frozen=True)
class GpuTarget:
    name: str            # e.g. "H100"
    sram_bytes: int      # shared memory one thread block may use (FA-1's "M")
    sm_count: int | None  # optional
    arch: str | None = None  # optional, "sm_80": the compute capability the planner plans for

    @property
    def capability(self) -> int:
        """The compute capability as the planner takes it (80 for sm_80); without an
        `arch`, the H100's (planner_core.DEFAULT_ARCH)."""
        return int(self.arch[3:]) if self.arch else DEFAULT_ARCH


@dataclass(frozen=True)
class Blocks:
    """Per-kernel tile choices; None means "auto" (the planner decides)."""
    forward: BlockConfig | None
    backward: BlockConfig | None
    decode: BlockConfig | None


@dataclass(frozen=True)
class ModVariant:
    """One combination the spec asks kernels for: a band mask and mods, in the order the
    score mods apply (f2(f1(score)))."""
    mask: str               # one of MASKS
    mods: tuple[str, ...]   # names of Spec.mods entries


# the implicit mod behind scaled_dot_product_attention(attn_mask=...)
SDPA_MASK = "sdpa_mask"


@dataclass(frozen=True)
class Spec:
    path: str                        # the path as given
    sha: str                         # first 12 hex chars of sha256(file bytes)
    package: str                     # Python identifier, not a keyword
    head_dims: tuple[int, ...]       # sorted, unique
    dtypes: tuple[str, ...]          # canonical DTYPES order, unique
    masks: tuple[str, ...]           # canonical MASKS order, unique
    window: Window | None            # set iff "sliding_window" in masks
    dropout: bool
    gqa: bool
    decode: bool
    gpu: GpuTarget
    blocks: Blocks
    seqlen_buckets: tuple[int, ...]  # sorted, unique, positive
    mods: tuple[Mod, ...] = ()       # named mods, in file order (plus sdpa_mask)
    mod_variants: tuple[ModVariant, ...] = ()  # `variants:` entries (plus attn_mask's)
    attn_mask: bool = True           # build SDPA's attn_mask variants (the sdpa_mask mod)
    # (Q/K head dim, V head dim) of every head_dims entry, sorted; a plain entry d is (d, d),
    # {qk: 192, v: 128} an MLA-style pair. head_dims holds the Q/K dims.
    head_dim_pairs: tuple[tuple[int, int], ...] = ()
    # (Q/K, V) head dims of the `decode_only: true` entries: decode kernels only
    decode_only_pairs: tuple[tuple[int, int], ...] = ()
    # `kv_cache_dtypes` as written (canonical KV_CACHE_DTYPES order; () when not given)
    kv_cache_dtypes: tuple[str, ...] = ()
    batch_invariant: bool = False    # calls' default batch_invariant (flashgen/invariant.py)
    # Dotted key path -> Loc for every mapping key in the file.  Excluded from
    # ==/hash (it is derived from the same bytes as `sha`, and a mapping proxy
    # is unhashable) so that Spec can be used as a cache key.
    locs: Mapping[str, Loc] = field(
        default_factory=lambda: MappingProxyType({}),
        compare=False, hash=False, repr=False)

    def __post_init__(self):
        if not self.head_dim_pairs:
            object.__setattr__(self, "head_dim_pairs", tuple((d, d) for d in self.head_dims))

    @property
    def decode_pairs(self) -> tuple[tuple[int, int], ...]:
        """The (Q/K, V) head dims that get decode kernels (with `decode: true`): every
        head_dims entry, the decode-only ones included."""
        return tuple(sorted(self.head_dim_pairs + self.decode_only_pairs))

    @property
    def kv_quant_dtypes(self) -> tuple[str, ...]:
        """The quantized KV-cache dtypes the package reads (fp8_e4m3, int8)."""
        return tuple(d for d in self.kv_cache_dtypes if d in KV_QUANT_DTYPES)

    def loc(self, key: str) -> Loc:
        """Loc of ``key``, else of its nearest present parent, else line 1."""
        parts = key.split(".")
        while parts:
            found = self.locs.get(".".join(parts))
            if found is not None:
                return found
            parts.pop()
        return Loc(self.path, 1)

    def error(self, key: str, problem: str, expected: str, fix: str) -> SpecError:
        """A SpecError at ``loc(key)``; the caller raises it."""
        return SpecError(self.path, self.loc(key).line, key, problem, expected, fix)


# --------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------

def load_spec(path: str | os.PathLike) -> Spec:
    """Read and parse a spec file; sha is over the raw file bytes."""
    shown = os.fspath(path)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SpecError(shown, None, "<file>", f"cannot read the file ({e.strerror or e})",
                        "a readable YAML spec file",
                        "check the path, e.g. flashgen build specs/gpt2.yaml") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise SpecError(shown, line, "<file>", "the file is not valid UTF-8",
                        "a UTF-8 text file", "re-save the file as UTF-8") from None
    return _Parser(shown, _sha(data)).parse(text)


def parse_spec(text: str, path: str = "<string>") -> Spec:
    """Parse spec text; ``path`` is only used in messages and ``Spec.path``."""
    return _Parser(os.fspath(path), _sha(text.encode("utf-8"))).parse(text)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:12]


# --------------------------------------------------------------------------
# Help texts: (expected, fix) per key, looked up by full dotted key, then by
# its last component (so blocks.<stage>.block_m share one entry).
# --------------------------------------------------------------------------

_TILE_FIX = "write e.g. {block_m: 128, block_n: 64, num_warps: 4, num_stages: 2}, or auto"

_HELP: dict[str, tuple[str, str]] = {
    "<document>": ("a YAML mapping of spec keys (package, head_dims, dtypes, masks, gpu, ...)",
                   "start from specs/gpt2.yaml and edit it"),
    "package": ("a Python identifier that is not a keyword, lower-case recommended",
                "write e.g. package: gpt2_attn"),
    "head_dims": ("a list of head dimensions, each a multiple of 8 from 16 to 512, or "
                  "{qk: D, v: D} for a V head dim apart from Q's and K's (MLA), with "
                  "decode_only: true for decode kernels alone (up to 576)",
                  "write e.g. head_dims: [64, 128] or head_dims: [{qk: 192, v: 128}]"),
    "dtypes": (f"a non-empty list of distinct dtypes from {', '.join(DTYPES)}",
               "write e.g. dtypes: [fp16, bf16]"),
    "masks": (f"a non-empty list of distinct masks from {', '.join(MASKS)}",
              "write e.g. masks: [none, causal]"),
    "window": ("a mapping {left, right} of ints >= -1 (-1 = unbounded), not both -1, "
               "given exactly when masks include sliding_window",
               "write e.g. window: {left: 4096, right: 0}"),
    "window.left": ("an integer >= -1 (tokens to the left; -1 = unbounded)",
                    "write e.g. left: 4096"),
    "window.right": ("an integer >= -1 (tokens to the right; -1 = unbounded)",
                     "write e.g. right: 0"),
    "head_dims.qk": ("the head dim of Q and K: a multiple of 8 from 16 to 512 (576 with "
                     "decode_only: true)",
                     "write e.g. {qk: 192, v: 128}"),
    "head_dims.v": ("the head dim of V and the output: a multiple of 8 from 16 to 512 (576 "
                    "with decode_only: true)",
                    "write e.g. {qk: 192, v: 128}"),
    "head_dims.decode_only": ("a boolean: true builds decode kernels alone for the entry "
                              "(head dims up to 576 then)",
                              "write e.g. {qk: 576, v: 512, decode_only: true}"),
    "dropout": ("a boolean: true or false", "write dropout: true or dropout: false"),
    "gqa": ("a boolean: true or false", "write gqa: true or gqa: false"),
    "decode": ("a boolean: true or false", "write decode: true or decode: false"),
    "batch_invariant": ("a boolean: true or false", "write batch_invariant: true or false"),
    "kv_cache_dtypes": (f"distinct KV-cache dtypes from {', '.join(KV_CACHE_DTYPES)}: fp8_e4m3 "
                        "and int8 are 1-byte caches read with fp16/bf16 queries; the others "
                        "the queries' own dtype (one of `dtypes`, always read)",
                        "write e.g. kv_cache_dtypes: [bf16, fp8_e4m3, int8]"),
    "gpu": ("a mapping with name, sram_bytes and optional sm_count and arch",
            "write e.g. gpu: {name: H100, sram_bytes: 232448, sm_count: 132}"),
    "gpu.name": ("a non-empty string naming the GPU", "write e.g. name: H100"),
    "gpu.sram_bytes": (f"an integer from {SRAM_MIN} to {SRAM_MAX}: the shared memory one "
                       "thread block may use", "write e.g. sram_bytes: 232448 (H100)"),
    "gpu.sm_count": ("a positive integer (number of SMs), or leave it out",
                     "write e.g. sm_count: 132 (H100)"),
    "gpu.arch": (f"sm_XY, the GPU's compute capability X.Y (sm_{MIN_ARCH} or newer), or leave "
                 "it out for the H100's register model (sm_90)",
                 "write e.g. arch: sm_80 (A100), arch: sm_89 (RTX 4090) or arch: sm_90 (H100)"),
    "blocks": ("auto, or a mapping with optional keys forward, backward, decode, each "
               "auto or {block_m, block_n, num_warps, num_stages}",
               "write blocks: auto, or e.g. blocks: {forward: auto}"),
    "forward": ("auto or {block_m, block_n, num_warps, num_stages}", _TILE_FIX),
    "backward": ("auto or {block_m, block_n, num_warps, num_stages}", _TILE_FIX),
    "block_m": ("a power of two from 16 to 256", "write e.g. block_m: 128"),
    "block_n": ("a power of two from 16 to 256", "write e.g. block_n: 64"),
    "num_warps": ("one of 2, 4, 8", "write e.g. num_warps: 4"),
    "num_stages": ("an integer from 1 to 5", "write e.g. num_stages: 3"),
    "mods": ("a mapping of mod names to {score|mask|sink: EXPRESSION, params, tensors} "
             "or {builtin: NAME, params}", "see docs/MODS.md"),
    "variants": ("a list of {mask: none|causal|sliding_window, mods: [NAMES]}",
                 "write e.g. variants: [{mask: causal, mods: [softcap]}]"),
    "attn_mask": ("a boolean: true or false (default true)",
                  "write attn_mask: true or attn_mask: false"),
    "seqlen_buckets": ("a non-empty list of distinct positive integers",
                       "write e.g. seqlen_buckets: [512, 1024, 2048, 4096, 8192, 16384]"),
}
# blocks.decode shares the tile help; top-level decode is a boolean.
_HELP["blocks.decode"] = _HELP["forward"]


def _help(key: str) -> tuple[str, str]:
    if key in _HELP:
        return _HELP[key]
    return _HELP.get(key.rsplit(".", 1)[-1], ("a valid value", "see specs/gpt2.yaml"))


# Common spellings that difflib would not map to our names.
_ALIASES = {
    "float16": "fp16", "half": "fp16", "f16": "fp16",
    "bfloat16": "bf16", "float32": "fp32", "float": "fp32", "f32": "fp32",
    "fp8": "fp8_e4m3", "e4m3": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "i8": "int8",
    "full": "none", "no_mask": "none", "window": "sliding_window",
    "sliding": "sliding_window", "local": "sliding_window",
}


def _suggest(word: str, choices: tuple[str, ...] | list[str]) -> str:
    """' (did you mean 'x'?)' or '' -- appended to a problem text."""
    hit = _ALIASES.get(word.lower()) if isinstance(word, str) else None
    if hit not in choices:
        close = difflib.get_close_matches(str(word), list(choices), n=1, cutoff=0.6)
        hit = close[0] if close else None
    return f" (did you mean '{hit}'?)" if hit else ""


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


# --------------------------------------------------------------------------
# The parser: walks the composed node tree in file order.
# --------------------------------------------------------------------------

_TAG = "tag:yaml.org,2002:"
_LIST = object()   # _scalar() result markers for non-scalar nodes
_MAP = object()


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _show(node: Node) -> str:
    """How a value is named in messages: as written, strings quoted."""
    if isinstance(node, SequenceNode):
        return "a list"
    if isinstance(node, MappingNode):
        return "a mapping"
    if node.tag == _TAG + "str":
        return repr(node.value)
    return node.value if node.value != "" else "null"


class _Parser:
    def __init__(self, path: str, sha: str):
        self.path = path
        self.sha = sha
        self.locs: dict[str, Loc] = {}
        self._constructor = SafeConstructor()

    # ---- errors -----------------------------------------------------------

    def fail(self, line: int | None, key: str, problem: str,
             expected: str | None = None, fix: str | None = None) -> SpecError:
        exp, fx = _help(key)
        return SpecError(self.path, line, key, problem, expected or exp, fix or fx)

    def key_line(self, key: str) -> int:
        loc = self.locs.get(key)
        return loc.line if loc else 1

    def where(self, key: str, node: Node) -> int:
        """Line for a problem with a whole value: its key's line, because a
        block list or mapping only starts on the line after the key."""
        loc = self.locs.get(key)
        return loc.line if loc else _line(node)

    # ---- document ---------------------------------------------------------

    def parse(self, text: str) -> Spec:
        root = self.compose(text)
        top = self.mapping(root, "", _TOP_SCHEMA, _TOP_REQUIRED, owner="<document>")
        self.check_window(top)
        self.check_decode_only(top)
        self.check_fp8(top)
        self.check_kv_cache(top)
        mods, mod_variants = self.check_mods(top)
        return Spec(
            path=self.path,
            sha=self.sha,
            package=top["package"],
            head_dims=tuple(sorted({qk for qk, _, only in top["head_dims"] if not only})),
            head_dim_pairs=tuple((qk, v) for qk, v, only in top["head_dims"] if not only),
            decode_only_pairs=tuple((qk, v) for qk, v, only in top["head_dims"] if only),
            dtypes=top["dtypes"],
            masks=top["masks"],
            window=top.get("window"),
            dropout=top.get("dropout", False),
            gqa=top.get("gqa", False),
            decode=top.get("decode", False),
            gpu=top["gpu"],
            blocks=top.get("blocks", Blocks(None, None, None)),
            seqlen_buckets=top.get("seqlen_buckets", DEFAULT_SEQLEN_BUCKETS),
            mods=mods,
            mod_variants=mod_variants,
            attn_mask=top.get("attn_mask", True),
            kv_cache_dtypes=top.get("kv_cache_dtypes", ()),
            batch_invariant=top.get("batch_invariant", False),
            locs=MappingProxyType(dict(self.locs)),
        )

    def compose(self, text: str) -> Node:
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
        except yaml.MarkedYAMLError as e:
            mark = e.problem_mark or e.context_mark
            problem = " ".join(p for p in (e.context, e.problem) if p) or "invalid YAML"
            raise self.fail(mark.line + 1 if mark else None, "<yaml>",
                            f"malformed YAML: {problem}",
                            "valid YAML: one mapping of 'key: value' lines",
                            "check indentation, colons, quotes and brackets on or just "
                            "before this line") from None
        except yaml.YAMLError as e:   # e.g. reader errors (control characters)
            raise self.fail(None, "<yaml>", f"malformed YAML: {e}",
                            "valid YAML text", "remove unprintable characters") from None
        if root is None:
            raise self.fail(1, "<document>", "the file is empty (no YAML document)")
        if not isinstance(root, MappingNode):
            raise self.fail(_line(root), "<document>",
                            f"the document is {_show(root)}, not a mapping")
        return root

    def check_window(self, top: dict[str, Any]) -> None:
        """window must be given exactly when sliding_window is requested."""
        sliding = "sliding_window" in top["masks"]
        window = top.get("window")
        if window is not None and not sliding:
            raise self.fail(self.key_line("window"), "window",
                            "window is given but masks do not include sliding_window",
                            fix="add sliding_window to masks, or delete the window key")
        if window is None and sliding:
            raise self.fail(self.key_line("masks"), "window",
                            "masks include sliding_window but no window is given",
                            fix="add e.g. window: {left: 4096, right: 0}, or drop "
                                "sliding_window from masks")

    def check_fp8(self, top: dict[str, Any]) -> None:
        """fp8 kernels are forward and backward only (issue 50's first part): the decode
        kernels and the mods' kernels take no descales yet, so a spec that asks for them
        beside fp8 is refused here rather than built without them."""
        fp8 = [d for d in top["dtypes"] if d in FP8_DTYPES]
        if not fp8:
            return
        for key, what in (("decode", "decode kernels"), ("mods", "mods"),
                          ("variants", "variants")):
            if key in top and top[key]:
                raise self.fail(self.key_line("dtypes"), "dtypes",
                                f"{fp8[0]} is asked for beside {key}: the fp8 kernels take "
                                f"no {what} yet",
                                "fp8 dtypes only in a spec without decode, mods or variants",
                                f"build the fp8 kernels from a spec of their own, or drop "
                                f"{key}")

    def check_kv_cache(self, top: dict[str, Any]) -> None:
        """A plain cache dtype is a query dtype; quantized ones need fp16 or bf16 queries."""
        line = self.key_line("kv_cache_dtypes")
        for d in top.get("kv_cache_dtypes", ()):
            if d not in KV_QUANT_DTYPES and d not in top["dtypes"]:
                raise self.fail(line, "kv_cache_dtypes", f"{d} is listed but `dtypes` has no "
                                f"{d}: a cache that is not quantized is in the queries' dtype",
                                fix=f"add {d} to dtypes, or drop it from kv_cache_dtypes")
        quant = [d for d in top.get("kv_cache_dtypes", ()) if d in KV_QUANT_DTYPES]
        if quant and not {"fp16", "bf16"} & set(top["dtypes"]):
            raise self.fail(line, "kv_cache_dtypes", f"{quant[0]} caches are read with fp16 or "
                            "bf16 queries, but `dtypes` has neither",
                            fix="add bf16 (or fp16) to dtypes, or drop the quantized caches")

    def check_decode_only(self, top: dict[str, Any]) -> None:
        """A decode_only entry needs decode: true, and must not repeat a full entry (whose
        decode kernels are built anyway)."""
        full = {(qk, v) for qk, v, only in top["head_dims"] if not only}
        for qk, v, only in top["head_dims"]:
            if not only:
                continue
            dims = "{qk: %d, v: %d}" % (qk, v)
            if not top.get("decode", False):
                raise self.fail(self.key_line("head_dims"), "head_dims",
                                f"the entry {dims} is decode_only but the spec builds no "
                                "decode kernels",
                                fix="add decode: true, or drop the entry")
            if (qk, v) in full:
                raise self.fail(self.key_line("head_dims"), "head_dims",
                                f"{dims} is listed both with and without decode_only; with "
                                "decode: true every entry gets decode kernels",
                                fix="drop the decode_only entry")

    def check_mods(self, top: dict[str, Any]) -> tuple:
        """Every variant names mods that exist, at most one sink, no name clashes between
        the params and tensors of one variant's mods, no two variants alike."""
        mods = {m.name: m for m in top.get("mods", ())}
        if top.get("attn_mask", True):  # variants may combine it with other mods
            mods[SDPA_MASK] = builtin_mod(SDPA_MASK, "bias")
        variants = []
        for i, (v, line) in enumerate(top.get("variants", ())):
            key = f"variants[{i}]"
            for name in v.mods:
                if name not in mods:
                    raise self.fail(line, key, f"mod {name!r} is not defined under `mods`"
                                    f"{_suggest(name, list(mods))}",
                                    fix="define it under mods:, or use a built-in: "
                                        + ", ".join(sorted(BUILTINS)))
            chosen = [mods[n] for n in v.mods]
            if sum(m.kind == "sink" for m in chosen) > 1:
                raise self.fail(line, key, "more than one sink mod",
                                fix="keep one sink per variant")
            seen: dict[str, str] = {}
            for m in chosen:
                for arg in [p for p, _ in m.params] + [t.name for t in m.tensors]:
                    if arg in seen:
                        raise self.fail(line, key, f"mods {seen[arg]!r} and {m.name!r} both take "
                                        f"an argument named {arg!r}: a call could not tell "
                                        "them apart", fix=f"rename {arg!r} in one of the mods")
                    seen[arg] = m.name
            if v in variants:
                raise self.fail(line, key, "the same variant is listed twice",
                                fix="delete one of the two entries")
            variants.append(v)
        if top.get("attn_mask", True) and ModVariant("none", (SDPA_MASK,)) not in variants:
            variants.append(ModVariant("none", (SDPA_MASK,)))
        return tuple(mods.values()), tuple(variants)

    # ---- generic shapes ---------------------------------------------------

    def mapping(self, node: Node, prefix: str, schema: dict[str, Callable],
                required: tuple[str, ...], owner: str) -> dict[str, Any]:
        """Walk a mapping in file order, checking keys and parsing values.

        ``schema`` maps each known key to ``handler(parser, dotted_key, node)``.
        Missing required keys are reported at the owning key's line, after the
        present keys (which come first in the file) have been checked.
        """
        if not isinstance(node, MappingNode):
            raise self.fail(self.where(owner, node), owner, f"{_show(node)} is not a mapping")
        first_seen: dict[str, int] = {}
        values: dict[str, Any] = {}
        for key_node, value_node in node.value:
            name = self.key_name(key_node, prefix)
            dotted = f"{prefix}.{name}" if prefix else name
            line = _line(key_node)
            if name in first_seen:
                raise self.fail(line, dotted,
                                f"duplicate key '{name}' (first given on line "
                                f"{first_seen[name]})",
                                "each key at most once in a mapping",
                                "delete one of the two entries")
            if name not in schema:
                known = list(schema)
                hint = _suggest(name, known)
                if not hint and not prefix and name in _NESTED_HOME:
                    hint = f" (it belongs under '{_NESTED_HOME[name]}')"
                raise self.fail(line, dotted, f"unknown key '{name}'{hint}",
                                "one of " + ", ".join(known) +
                                (f" under '{prefix}'" if prefix else ""),
                                "rename or delete the key")
            first_seen[name] = line
            self.locs[dotted] = Loc(self.path, line)
            values[name] = schema[name](self, dotted, value_node)
        for name in required:
            if name not in values:
                dotted = f"{prefix}.{name}" if prefix else name
                # Top-level keys have no owner line: cite line 1, like Spec.loc.
                where = self.key_line(prefix) if prefix else 1
                raise self.fail(where, dotted, f"required key '{name}' is missing")
        return values

    def key_name(self, key_node: Node, prefix: str) -> str:
        if not isinstance(key_node, ScalarNode):
            raise self.fail(_line(key_node), prefix or "<document>",
                            f"{_show(key_node)} used as a key",
                            "plain 'name: value' keys", "write each key as a plain name")
        return key_node.value

    def scalar(self, key: str, node: Node) -> Any:
        """A scalar's Python value from its resolved tag; markers for collections."""
        if isinstance(node, SequenceNode):
            return _LIST
        if isinstance(node, MappingNode):
            return _MAP
        kind = node.tag[len(_TAG):] if node.tag.startswith(_TAG) else None
        if kind == "str":
            return node.value
        if kind in ("int", "float", "bool", "null"):
            try:
                return self._constructor.construct_object(node)
            except (ConstructorError, ValueError, KeyError):   # e.g. !!bool maybe
                raise self.fail(_line(node), key,
                                f"{node.value!r} cannot be read as {kind}") from None
        raise self.fail(_line(node), key,
                        f"value of YAML type {node.tag} is not supported")

    def integer(self, key: str, node: Node) -> int:
        value = self.scalar(key, node)
        if type(value) is not int:   # bool is an int subclass: reject it
            raise self.fail(_line(node), key, f"{_show(node)} is not an integer")
        return value

    def string(self, key: str, node: Node) -> str:
        value = self.scalar(key, node)
        if type(value) is not str:
            raise self.fail(_line(node), key, f"{_show(node)} is not a string")
        return value

    def boolean(self, key: str, node: Node) -> bool:
        value = self.scalar(key, node)
        if type(value) is not bool:
            raise self.fail(_line(node), key, f"{_show(node)} is not a boolean")
        return value

    def is_null(self, key: str, node: Node) -> bool:
        return isinstance(node, ScalarNode) and self.scalar(key, node) is None

    def items(self, key: str, node: Node, item: Callable[[str, Node], Any]) -> list[Any]:
        """A non-empty list with no repeated entry; ``item`` parses each entry."""
        if not isinstance(node, SequenceNode):
            raise self.fail(self.where(key, node), key, f"{_show(node)} is not a list")
        if not node.value:
            raise self.fail(self.where(key, node), key, "the list is empty")
        values: list[Any] = []
        for entry in node.value:
            value = item(key, entry)
            if value in values:
                raise self.fail(_line(entry), key, f"{_show(entry)} is listed twice")
            values.append(value)
        return values


# --------------------------------------------------------------------------
# Key handlers: handler(parser, dotted_key, value_node) -> typed value.
# --------------------------------------------------------------------------

def _package(p: _Parser, key: str, node: Node) -> str:
    name = p.string(key, node)
    if not name.isidentifier() or keyword.iskeyword(name):
        raise p.fail(_line(node), key, f"{name!r} is not a valid Python package name")
    return name


def _head_dims(p: _Parser, key: str, node: Node) -> tuple[tuple[int, int, bool], ...]:
    """(Q/K dim, V dim, decode only) triples: an entry d is (d, d, False); {qk: 192, v: 128}
    gives V (and the output) a head dim of its own (DeepSeek MLA's 192/128); with
    `decode_only: true` the entry builds decode kernels alone, and may then be as wide as
    DeepSeek's latent cache (576/512), past the widest forward or backward (512)."""
    def one(key: str, entry: Node, top: int = HEAD_DIM_MAX) -> int:
        d = p.integer(key, entry)
        if not 16 <= d <= top:
            raise p.fail(_line(entry), key, f"{d} is outside 16..{top}")
        if d % 8:
            raise p.fail(_line(entry), key, f"{d} is not a multiple of 8")
        return d

    def head_dim(key: str, entry: Node) -> tuple[int, int, bool]:
        if isinstance(entry, MappingNode):
            # the dims are range-checked once decode_only is known (it may come last)
            handler = lambda _p, k, n: one(k, n, DECODE_HEAD_DIM_MAX)  # noqa: E731
            pair = p.mapping(entry, key, {"qk": handler, "v": handler,
                                          "decode_only": lambda _p, k, n: p.boolean(k, n)},
                             ("qk", "v"), key)
            only = pair.get("decode_only", False)
            if not only:
                for key_node, value_node in entry.value:
                    name = key_node.value
                    if name in ("qk", "v") and pair[name] > HEAD_DIM_MAX:
                        raise p.fail(
                            _line(value_node), f"{key}.{name}",
                            f"{pair[name]} is outside 16..{HEAD_DIM_MAX}, the widest head dim "
                            "a forward or backward tile fits",
                            fix="add decode_only: true to build decode kernels alone at this "
                                "head dim (e.g. {qk: 576, v: 512, decode_only: true}), or use "
                                f"head dims up to {HEAD_DIM_MAX}")
            return pair["qk"], pair["v"], only
        d = one(key, entry)
        return d, d, False
    return tuple(sorted(p.items(key, node, head_dim)))


def _names(choices: tuple[str, ...]):
    """Handler for a list of names from ``choices``, stored in canonical order."""
    def handler(p: _Parser, key: str, node: Node) -> tuple[str, ...]:
        def name(key: str, entry: Node) -> str:
            # `none` is a plain string in YAML; a real null (~, null) is not a name.
            value = p.scalar(key, entry)
            if type(value) is not str:
                raise p.fail(_line(entry), key, f"{_show(entry)} is not a name")
            if value not in choices:
                raise p.fail(_line(entry), key,
                             f"unknown name {value!r}{_suggest(value, choices)}")
            return value
        chosen = p.items(key, node, name)
        return tuple(c for c in choices if c in chosen)
    return handler


def _window(p: _Parser, key: str, node: Node) -> Window | None:
    if p.is_null(key, node):
        return None
    w = p.mapping(node, key, {"left": _extent, "right": _extent}, ("left", "right"), key)
    if w["left"] == -1 and w["right"] == -1:
        raise p.fail(p.where(key, node), key, "both extents are -1 (unbounded): that is no window",
                     fix="bound at least one side, e.g. window: {left: 4096, right: 0}, "
                         "or use mask none")
    return Window(w["left"], w["right"])


def _extent(p: _Parser, key: str, node: Node) -> int:
    n = p.integer(key, node)
    if n < -1:
        raise p.fail(_line(node), key, f"{n} is below -1")
    return n


def _boolean(p: _Parser, key: str, node: Node) -> bool:
    return p.boolean(key, node)


def _gpu(p: _Parser, key: str, node: Node) -> GpuTarget:
    g = p.mapping(node, key, _GPU_SCHEMA, ("name", "sram_bytes"), key)
    return GpuTarget(g["name"], g["sram_bytes"], g.get("sm_count"), g.get("arch"))


def _gpu_name(p: _Parser, key: str, node: Node) -> str:
    name = p.string(key, node)
    if not name.strip():
        raise p.fail(_line(node), key, "the name is empty")
    return name


def _sram_bytes(p: _Parser, key: str, node: Node) -> int:
    n = p.integer(key, node)
    if not SRAM_MIN <= n <= SRAM_MAX:
        raise p.fail(_line(node), key, f"{n} is outside {SRAM_MIN}..{SRAM_MAX}")
    return n


def _sm_count(p: _Parser, key: str, node: Node) -> int | None:
    if p.is_null(key, node):
        return None
    n = p.integer(key, node)
    if n < 1:
        raise p.fail(_line(node), key, f"{n} is less than 1")
    return n


def _arch(p: _Parser, key: str, node: Node) -> str | None:
    if p.is_null(key, node):
        return None
    value = p.scalar(key, node)
    if type(value) in (int, float):   # arch: 80 or arch: 8.0
        raise p.fail(_line(node), key, f"{_show(node)} is a number, not an architecture name")
    if type(value) is not str:
        raise p.fail(_line(node), key, f"{_show(node)} is not an architecture name")
    match = re.fullmatch(r"sm_([1-9][0-9]{1,2})", value)
    if match is None:
        raise p.fail(_line(node), key, f"{value!r} is not an architecture name sm_XY")
    if int(match.group(1)) < MIN_ARCH:
        raise p.fail(_line(node), key,
                     f"{value} is older than sm_{MIN_ARCH}, the oldest the planner models")
    return value


def _is_auto(p: _Parser, key: str, node: Node) -> bool:
    return isinstance(node, ScalarNode) and p.scalar(key, node) == "auto"


def _blocks(p: _Parser, key: str, node: Node) -> Blocks:
    if _is_auto(p, key, node):
        return Blocks(None, None, None)
    if not isinstance(node, MappingNode):
        raise p.fail(p.where(key, node), key, f"{_show(node)} is neither auto nor a mapping")
    stages = p.mapping(node, key, {s: _block_config for s in BLOCK_STAGES}, (), key)
    return Blocks(*(stages.get(s) for s in BLOCK_STAGES))


def _block_config(p: _Parser, key: str, node: Node) -> BlockConfig | None:
    if _is_auto(p, key, node):
        return None
    if not isinstance(node, MappingNode):
        raise p.fail(p.where(key, node), key, f"{_show(node)} is neither auto nor a mapping")
    c = p.mapping(node, key, _TILE_SCHEMA, tuple(_TILE_SCHEMA), key)
    return BlockConfig(c["block_m"], c["block_n"], c["num_warps"], c["num_stages"])


def _tile_size(p: _Parser, key: str, node: Node) -> int:
    n = p.integer(key, node)
    if not (16 <= n <= 256 and _is_pow2(n)):
        raise p.fail(_line(node), key, f"{n} is not a power of two from 16 to 256")
    return n


def _num_warps(p: _Parser, key: str, node: Node) -> int:
    n = p.integer(key, node)
    if n not in NUM_WARPS:
        raise p.fail(_line(node), key, f"{n} is not one of {', '.join(map(str, NUM_WARPS))}")
    return n


def _num_stages(p: _Parser, key: str, node: Node) -> int:
    n = p.integer(key, node)
    if n not in STAGE_COUNTS:
        raise p.fail(_line(node), key, f"{n} is outside {STAGE_COUNTS[0]}..{STAGE_COUNTS[-1]}")
    return n


def _seqlen_buckets(p: _Parser, key: str, node: Node) -> tuple[int, ...]:
    def bucket(key: str, entry: Node) -> int:
        n = p.integer(key, entry)
        if n <= 0:
            raise p.fail(_line(entry), key, f"{n} is not positive")
        return n
    return tuple(sorted(p.items(key, node, bucket)))


def _mods(p: _Parser, key: str, node: Node) -> tuple[Mod, ...]:
    if not isinstance(node, MappingNode):
        raise p.fail(p.where(key, node), key, f"{_show(node)} is not a mapping")
    out = []
    for key_node, value_node in node.value:
        name = p.key_name(key_node, key)
        dotted = f"{key}.{name}"
        if not name.isidentifier() or name in RESERVED or name == SDPA_MASK or \
                not name.islower():
            raise p.fail(_line(key_node), dotted, f"{name!r} cannot name a mod",
                         "a lower-case identifier that is not " + ", ".join(sorted(RESERVED)),
                         "rename the mod, e.g. gemma_softcap")
        if any(m.name == name for m in out):
            raise p.fail(_line(key_node), dotted, f"duplicate mod {name!r}",
                         fix="delete one of the two entries")
        p.locs[dotted] = Loc(p.path, _line(key_node))
        out.append(_mod(p, dotted, name, value_node))
    return tuple(out)


def _mod(p: _Parser, key: str, name: str, node: Node) -> Mod:
    schema = {k: _raw for k in ("builtin", *KINDS, "params", "tensors", "doc")}
    m = p.mapping(node, key, schema, (), key)
    kinds = [k for k in KINDS if k in m]
    params = _mod_numbers(p, f"{key}.params", m["params"]) if "params" in m else {}
    tensors = _mod_strings(p, f"{key}.tensors", m["tensors"]) if "tensors" in m else {}
    try:
        if "builtin" in m:
            if kinds or "tensors" in m:
                raise p.fail(p.key_line(key), key, "a built-in mod takes only `params`",
                             fix="drop the expression and tensors, or drop `builtin`")
            return builtin_mod(name, p.string(f"{key}.builtin", m["builtin"]), params)
        if len(kinds) != 1:
            raise p.fail(p.key_line(key), key,
                         "a mod needs exactly one of score, mask, sink (or builtin)",
                         fix="write e.g. softcap: {score: \"cap * tanh(score / cap)\", "
                             "params: {cap: 50.0}}")
        kind = kinds[0]
        text_node = m[kind]
        text = p.string(f"{key}.{kind}", text_node)
        doc = p.string(f"{key}.doc", m["doc"]) if "doc" in m else ""
        return make_mod(name, kind, text, params, tensors, None, doc)
    except ModError as e:
        where = kinds[0] if kinds else ("builtin" if "builtin" in m else "")
        line = p.key_line(f"{key}.{where}") if where else p.key_line(key)
        token = f" (at `{e.token}`)" if e.token and e.token not in e.problem else ""
        raise p.fail(line, f"{key}.{where}" if where else key, e.problem + token,
                     e.allowed or "a valid mod", "fix the expression; see docs/MODS.md") from None


def _raw(p: _Parser, key: str, node: Node) -> Node:
    return node


def _mod_numbers(p: _Parser, key: str, node: Node) -> dict:
    if not isinstance(node, MappingNode):
        raise p.fail(p.where(key, node), key, f"{_show(node)} is not a mapping",
                     "a mapping of param names to numbers", "write e.g. params: {cap: 50.0}")
    out = {}
    for k, v in node.value:
        name = p.key_name(k, key)
        value = p.scalar(f"{key}.{name}", v)
        if type(value) not in (int, float):
            raise p.fail(_line(v), f"{key}.{name}", f"{_show(v)} is not a number",
                         "a number", "write e.g. cap: 50.0")
        p.locs[f"{key}.{name}"] = Loc(p.path, _line(k))
        out[name] = value
    return out


def _mod_strings(p: _Parser, key: str, node: Node) -> dict:
    if not isinstance(node, MappingNode):
        raise p.fail(p.where(key, node), key, f"{_show(node)} is not a mapping",
                     "a mapping of tensor names to declarations",
                     "write e.g. tensors: {doc: \"[B, N] int32\"}")
    out = {}
    for k, v in node.value:
        name = p.key_name(k, key)
        out[name] = p.string(f"{key}.{name}", v)
        p.locs[f"{key}.{name}"] = Loc(p.path, _line(k))
    return out


def _variants(p: _Parser, key: str, node: Node) -> tuple:
    if not isinstance(node, SequenceNode) or not node.value:
        raise p.fail(p.where(key, node), key, f"{_show(node)} is not a non-empty list")
    out = []
    for i, entry in enumerate(node.value):
        k = f"{key}[{i}]"
        v = p.mapping(entry, k, {"mask": _one_mask, "mods": _mod_names}, ("mods",), k)
        out.append((ModVariant(v.get("mask", "none"), v["mods"]), _line(entry)))
    return tuple(out)


def _one_mask(p: _Parser, key: str, node: Node) -> str:
    value = p.scalar(key, node)
    if value not in MASKS:
        raise p.fail(_line(node), key, f"{_show(node)} is not a mask{_suggest(str(value), MASKS)}",
                     "one of " + ", ".join(MASKS), "write e.g. mask: causal")
    return value


def _mod_names(p: _Parser, key: str, node: Node) -> tuple:
    def name(key: str, entry: Node) -> str:
        return p.string(key, entry)
    return tuple(p.items(key, node, name))


# Schemas; dict order is the canonical key order used in "did you mean" lists.
_TOP_SCHEMA: dict[str, Callable] = {
    "package": _package,
    "head_dims": _head_dims,
    "dtypes": _names(DTYPES),
    "masks": _names(MASKS),
    "window": _window,
    "dropout": _boolean,
    "gqa": _boolean,
    "decode": _boolean,
    "batch_invariant": _boolean,
    "kv_cache_dtypes": _names(KV_CACHE_DTYPES),
    "gpu": _gpu,
    "blocks": _blocks,
    "seqlen_buckets": _seqlen_buckets,
    "mods": _mods,
    "variants": _variants,
    "attn_mask": _boolean,
}
_TOP_REQUIRED = ("package", "head_dims", "dtypes", "masks", "gpu")
_GPU_SCHEMA: dict[str, Callable] = {
    "name": _gpu_name, "sram_bytes": _sram_bytes, "sm_count": _sm_count, "arch": _arch,
}
_TILE_SCHEMA: dict[str, Callable] = {
    "block_m": _tile_size, "block_n": _tile_size,
    "num_warps": _num_warps, "num_stages": _num_stages,
}

# Nested key -> its parent, to redirect e.g. a top-level `sm_count:` to `gpu`.
_NESTED_HOME: dict[str, str] = {
    **{k: "gpu" for k in _GPU_SCHEMA},
    **{k: "window" for k in ("left", "right")},
    **{k: "blocks" for k in ("forward", "backward")},
    **{k: "blocks.<kernel>" for k in _TILE_SCHEMA},
}
