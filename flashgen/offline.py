"""Compile a spec's kernels for a GPU architecture without that GPU (or any GPU).

Triton compiles a @triton.jit function for an explicit target (GPUTarget("cuda", 80, 32)
is an A100, 89 an RTX 4090) with the ptxas it bundles; nothing needs a driver. For each
kernel of each variant this module compiles what the package would launch with the
planner's config for the spec's budget and architecture (`gpu.arch`), and reports what the
compiler allocated: shared memory (Triton's metadata) and registers and spill bytes (ptxas
-v). This is how CI proves that a spec's kernels fit its shared-memory budget and do not
spill registers on GPUs it has never seen (tests/test_offline_compile.py);
`python -m flashgen.offline SPEC` prints the table for the spec's `gpu.arch` (`--arch 80`
compiles for another).

The kernels must be imported without TRITON_INTERPRET (an interpreted @triton.jit
function cannot be compiled), so the test runs this in a subprocess.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

_TRITON_DTYPES = {"fp16": "fp16", "bf16": "bf16", "fp32": "fp32"}
# pointer arguments of the kernels that are not of the variant's dtype
_FP32_POINTERS = {"LSE", "DELTA", "DQ_ACC", "PARTIAL_O", "PARTIAL_LSE", "M_PARTIAL"}
_INT_POINTERS = {"LOCKS": "*i32", "CU_Q": "*i32", "CU_K": "*i32", "SEQUSED_Q": "*i32",
                 "SEQUSED_K": "*i32", "BT": "*i32"}
# the packed-batch (varlen) kernels' cumulative and used lengths, the paged cache's block
# table and a quantized cache's scales: None, a constexpr, in a dense launch
_VARLEN_POINTERS = ("CU_Q", "CU_K", "SEQUSED_Q", "SEQUSED_K", "BT", "KS", "VS")
# a variant that reads quantized KV caches (registry `kv_quant`): its launches without one
# (KS, VS None), and the forms compiled with one -- decode with an fp8 cache and per-token
# scales (the costliest: the scales' loads beside the tile's), the append quantizing into
# an int8 cache (the per-token amax), the paged prefill over an int8 cache
_KV_PLAIN = dict(KS=None, VS=None, KV_QUANT=0, KV_SCALE_TOKEN=False)
_KV_SCALES = {"KS": "*fp32", "VS": "*fp32"}
_KV_FP8 = dict(_KV_SCALES, K="*fp8e4nv", V="*fp8e4nv")
_KV_INT8 = dict(_KV_SCALES, K="*i8", V="*i8")
_DENSE = dict(CU_Q=None, CU_K=None, VARLEN=False)
# the forward's serving arguments (chunked prefill over a paged cache), unused in a dense one
_FWD_DENSE = dict(SEQUSED_Q=None, SEQUSED_K=None, BT=None, PAGE_SIZE=0)
_FLOATS = {"QK_SCALE_LOG2", "SCALE", "DROP_SCALE", "SM_SCALE"}
_WIDE_INTS = {"SEED"}
# a context-parallel piece's global start row / column (variants with mods or dropout)
_POSITIONS = {"Q_POS", "KV_POS"}
# the decode kernels' pointers (templates/decode.py.j2): everything else there is an int
# (lengths, page size, capacity, the workspace offset) or the fp32 scale
_DECODE_POINTERS = {"Q": None, "K": None, "V": None, "O": None, "KN": None, "VN": None,
                    "LSE": "*fp32", "OP": "*fp32", "CNT": "*i32", "SEQLENS": "*i32",
                    "BT": "*i32", "COS": None, "SIN": None, "CACHE_IDX": "*i32",
                    "LEFTPAD": "*i32"}


@dataclass
class KernelResources:
    variant: str
    function: str
    config: str
    shared: int        # bytes of shared memory the compiled kernel uses
    registers: int
    spill_stores: int  # bytes per thread
    spill_loads: int
    budget: int        # the spec's sram_bytes
    may_spill: str = ""  # the planner's own warning that this tile may spill (spill_warning)

    def row(self) -> str:
        return (f"| {self.variant}.{self.function} | {self.config} | {self.shared} | "
                f"{self.budget} | {self.registers} | {self.spill_stores} | {self.spill_loads} |"
                + (f" planner: may spill ({self.may_spill}) |" if self.may_spill else ""))


_MOD_POINTERS = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "int32": "*i32",
                 "int64": "*i64", "bool": "*i8"}
# BLOCK_IDX: the Gluon forward's; PROG_ORDER: the Gluon backward's program order
_BLOCK_LISTS = ("FULL_CNT", "FULL_IDX", "PART_CNT", "PART_IDX", "BLOCK_IDX", "PROG_ORDER")


def mod_arg_types(registry, name: str) -> tuple[dict, dict]:
    """(signature types of a variant's mod arguments, its GRAD_<T> constexprs set True),
    read from its package's registry: tensors are pointers of their declared dtype,
    params fp32 or i32 by their default, a tensor's gradient buffer and the block lists
    pointers; strides and extents fall through to i32 in _signature."""
    facts = registry.VARIANTS[name]
    if not facts.get("mods"):
        return {}, {}
    types = {name_: "*i32" for name_ in _BLOCK_LISTS}
    # a piece's global start row / column (context parallelism), which q_idx / kv_idx add
    types.update(Q_POS="i32", KV_POS="i32")
    for mod in facts["mods"]:
        decl = registry.MODS[mod]
        for t, _, dt in decl["tensors"]:
            types[f"T_{t}"] = _MOD_POINTERS[dt]
            types[f"DT_{t}"] = "*fp32"
        for p, default in decl["params"].items():
            types[f"P_{p}"] = "i32" if isinstance(default, int) else "fp32"
    grads = registry.MOD_COMBOS["+".join(facts["mods"])]["grads"]
    return types, {f"GRAD_{t.upper()}": True for t in grads}


def _signature(fn, dtype: str, extra: dict | None = None, decode: bool = False):
    sig, attrs = {}, {}
    for i, p in enumerate(fn.params):
        name = p.name
        # (the decode kernels' BT is their page table, a pointer in the paged forms)
        if p.is_constexpr or (name in _VARLEN_POINTERS and not (extra and name in extra)
                              and not (decode and name == "BT")):
            sig[name] = "constexpr"  # a dense launch passes None
            continue
        if extra and name in extra:  # a mod's argument (mod_arg_types)
            sig[name] = extra[name]
        elif decode:
            if name in _DECODE_POINTERS:
                sig[name] = _DECODE_POINTERS[name] or "*" + _TRITON_DTYPES[dtype]
            else:
                sig[name] = "fp32" if name in _FLOATS else "i32"
        elif name in _FP32_POINTERS:
            sig[name] = "*fp32"
        elif name in _INT_POINTERS:
            sig[name] = _INT_POINTERS[name]
        elif name in _POSITIONS or name == "NUM_BLOCKS":  # (a paged cache's pool size)
            sig[name] = "i32"
        elif name.isupper() and not name.startswith(("N_", "H_", "KV_", "LO_", "HI_", "DROP_",
                                                    "RNG_", "SEED", "QK_", "SCALE", "SM_")) \
                and not name.endswith("_ROW"):  # DELTA_ROW: a row length, not a tensor
            sig[name] = "*" + _TRITON_DTYPES[dtype]
        elif name in _FLOATS:
            sig[name] = "fp32"
        elif name in _WIDE_INTS:
            sig[name] = "i64"
        else:
            sig[name] = "i32"
        # what a launch specialises on: 16-byte aligned pointers, and strides that are
        # multiples of 16 elements (any head count times a head dim that is a multiple of 16)
        if sig[name].startswith("*") or name.startswith("stride_"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _launches(kind: str, config: dict, function_names, row64: bool = False, dims=None,
              kv_quant: bool = False):
    """(function, constexprs, num_warps, num_stages[, argument types]) the runtime launches
    for a config; row64: the form a call whose (batch, head) slices span 2**31 elements gets
    (ROW64). dims: (Q/K head dim, V head dim) of a decode variant. kv_quant: the variant
    reads quantized KV caches (registry `kv_quant`): its plain launches pass no scales, and
    the forms with a quantized cache are compiled too (argument types of their own)."""
    out = _plain_launches(kind, config, row64, dims)
    if not kv_quant:
        return out
    from . import planner_core

    out = [(f, {**_KV_PLAIN, **c}, w, s) for f, c, w, s in out]
    # the runtime's config for a cache with per-token scales (planner_core.kv_quant_tile)
    q = planner_core.kv_quant_tile(config, kind, True)
    bm, bn, w, s = q["block_m"], q["block_n"], q["num_warps"], q["num_stages"]
    if kind == "fwd":  # the paged prefill (chunked prefill over an int8 cache)
        paged = dict(BLOCK_M=bm, BLOCK_N=bn, USE_TMA=False, WARP_SPECIALIZE=False, VARLEN=True,
                     PAGE_SIZE=64, ROW64=row64, SEQUSED_Q=None, SEQUSED_K=None, KV_QUANT=2,
                     KV_SCALE_TOKEN=True)
        out.append(("kernel", paged, w, s, dict(_KV_INT8, CU_Q="*i32", CU_K="*i32", BT="*i32")))
    elif kind == "decode" and bm <= planner_core.KV_QUANT_MAX_STACKED_ROWS:
        def quantized(c, code):  # KS, VS become typed pointers (the form's argument types)
            return {**{k: v for k, v in c.items() if k not in ("KS", "VS")},
                    "KV_QUANT": code, "KV_SCALE_TOKEN": True}
        kernel = next(c for f, c, _, _ in out if f == "kernel" and not c.get("V_IS_K"))
        _, append, aw, ast = next(x for x in out if x[0] == "append")
        out += [("kernel", quantized(kernel, 1), w, s, _KV_FP8),
                ("append", quantized(append, 2), aw, ast, _KV_INT8)]
    return out


def _plain_launches(kind: str, config: dict, row64: bool = False, dims=None):
    """_launches' forms without a quantized cache."""
    from . import planner_core
    bm, bn, w, s = config["block_m"], config["block_n"], config["num_warps"], config["num_stages"]
    dense = dict(_DENSE, ROW64=row64)
    if kind == "fwd":
        return [("kernel", dict(BLOCK_M=bm, BLOCK_N=bn, USE_TMA=False, WARP_SPECIALIZE=False,
                                **dense, **_FWD_DENSE), w, s)]
    if kind == "bwd":
        dq_m, dq_n, dq_w, dq_s = planner_core.dq_tile(config)
        # (the `tl` family's form; the Gluon backward's also zeroes its fp32 dQ sum)
        return [("preprocess", dict(BLOCK_M=64, ROW64=row64, ZERO_DQ=False,
                                    ZERO_DIM=1, ZERO_COLS=1), 4, 1),
                ("dkdv_kernel", dict(BLOCK_M=bm, BLOCK_N=bn, FUSED_DQ=0, USE_TMA=False, **dense),
                 w, s),
                ("dq_kernel", dict(BLOCK_M=dq_m, BLOCK_N=dq_n, USE_TMA=False, **dense), dq_w,
                 dq_s)]
    if kind == "decode":
        # a server's call: paged (pages of whole key blocks), a length per sequence, split
        # KV with the in-launch reduction (the costliest form: the reduction's registers
        # come on top of the key loop's), the LSE stored; and where V may be read as a view
        # of K (a latent cache: V_IS_K), that form too. The append: the runtime's default
        # 4 warps, 8 KV heads at once.
        d, dv = dims
        # (without rotary, cache_batch_idx and cache_leftpad: their code is compiled out)
        plain = dict(ROTARY_DIM=0, ROTARY_INTERLEAVED=False, BATCH_IDX=False)
        form = dict(PAGED=True, PAGE_BLOCKS=True, PER_ROW_LENS=True, SPLIT=True,
                    STORE_LSE=True, V_IS_K=False, LEFT_PAD=False, FUSED_APPEND=False,
                    BLOCK_M=bm, BLOCK_N=bn, **plain)
        out = [("kernel", form, w, s)]
        if dv <= d:
            out.append(("kernel", dict(form, V_IS_K=True), w, s))
        # a decode step that appends its token in the same launch, rotated (GPT-NeoX over all
        # of d, Llama's): the new keys' tile and the write come on top of the key loop's
        # (not a latent cache's: rotary is refused there, and its V_IS_K keeps the append kernel)
        if dv == d:
            out.append(("kernel", dict(form, FUSED_APPEND=True, ROTARY_DIM=d - d % 2), w, s))
        next_pow2 = lambda n: 1 << max(n - 1, 0).bit_length()  # noqa: E731
        out.append(("append", dict(PAGED=True, PER_ROW_LENS=True, BLOCK_H=8,
                                   BLOCK_D=next_pow2(d), BLOCK_DV=next_pow2(dv), **plain), 4, 3))
        return out
    raise ValueError(f"offline compilation covers fwd, bwd and decode kernels, not {kind}")


# decode: the stacked query rows (KV_GROUP x N_q) whose launches are compiled -- the tile
# grows with them (planner_core.stacked_decode_tile), so each is a kernel of its own
DECODE_STACKED_ROWS = (16, 32, 64)


def decode_tiles(spec, variant, plan) -> list:
    """The distinct launch configs a decode variant runs at DECODE_STACKED_ROWS stacked
    rows, from the planner's config for the spec's budget and architecture."""
    from . import planner_core

    tiles = []
    for rows in DECODE_STACKED_ROWS:
        cfg = planner_core.stacked_decode_tile(plan.chosen.as_dict(), rows, variant.plan_dim,
                                               variant.dtype_bytes, spec.gpu.sram_bytes,
                                               spec.gpu.capability, plan.score_bytes)
        if cfg not in tiles:
            tiles.append(cfg)
    return tiles


def _variant_launches(spec, variant, plan, row64: bool = False):
    """_launches of every config a variant runs: the planned one, and for a decode variant
    each stacked tile (decode_tiles; the append kernels once)."""
    from .variants import reads_quantized_kv

    dims = (variant.head_dim, variant.v_dim)
    kv_quant = reads_quantized_kv(spec, variant)
    if variant.kind != "decode":
        return _launches(variant.kind, plan.chosen.as_dict(), (), row64, dims, kv_quant)
    out = []
    for cfg in decode_tiles(spec, variant, plan):
        appended = any(o[0] == "append" for o in out)
        out += [launch for launch in _launches("decode", cfg, (), row64, dims, kv_quant)
                if launch[0] != "append" or not appended]
    return out + invariant_launches(spec, variant, plan, kv_quant)


def invariant_launches(spec, variant, plan, kv_quant: bool = False) -> list:
    """The batch-invariant kernel's forms (templates/decode_invariant.py.j2, which
    decode.py.j2 includes) at its pinned tile (planner_core.invariant_decode_tile): a
    decode step (paged, the splits shared by several programs and folded from the workspace) and a packed training forward (one
    program a tile folding in registers); compiled with fp fusion off, as the package
    launches it (compile_kernel's options)."""
    from . import planner_core

    cfg = planner_core.invariant_decode_tile(plan.chosen.as_dict(), variant.head_dim,
                                             variant.v_dim, variant.dtype_bytes,
                                             spec.gpu.sram_bytes, spec.gpu.capability,
                                             plan.score_bytes)
    bm, bn, w, st = cfg["block_m"], cfg["block_n"], cfg["num_warps"], cfg["num_stages"]
    common = dict(STORE_LSE=True, V_IS_K=False, ROTARY_DIM=0, ROTARY_INTERLEAVED=False,
                  BATCH_IDX=False, LEFT_PAD=False, USED_Q=False, SPLIT_KEYS=1024,
                  BLOCK_M=bm, BLOCK_N=bn, **(_KV_PLAIN if kv_quant else {}))
    decode = dict(common, PAGED=True, PAGE_BLOCKS=True, PER_ROW_LENS=True, Q_OFFSETS=False,
                  K_OFFSETS=False, FOLD=False, FOLD_ROWS=min(bm, 16))
    packed = dict(common, PAGED=False, PAGE_BLOCKS=False, PER_ROW_LENS=False, Q_OFFSETS=True,
                  K_OFFSETS=True, FOLD=True, FOLD_ROWS=bm)
    out = [("invariant", decode, w, st, {}),
           ("invariant", packed, w, st, {"CU_Q": "*i32", "CU_K": "*i32"})]
    if kv_quant:  # an int8 cache with per-token scales: the quantized tile (_invariant.config)
        q = planner_core.invariant_decode_tile(
            plan.chosen.as_dict(), variant.head_dim, variant.v_dim, variant.dtype_bytes,
            spec.gpu.sram_bytes, spec.gpu.capability, plan.score_bytes,
            planner_core.KV_QUANT_MAX_STACKED_ROWS, token_scales=True)
        out.append(("invariant", {**{k: v for k, v in decode.items() if k not in ("KS", "VS")},
                                  "KV_QUANT": 2, "KV_SCALE_TOKEN": True,
                                  "BLOCK_M": q["block_m"], "BLOCK_N": q["block_n"]},
                    q["num_warps"], q["num_stages"], _KV_INT8))
    return out


def _ptxas_numbers(log: str) -> tuple[int, int, int]:
    regs = re.search(r"Used (\d+) registers", log)
    stores = re.search(r"(\d+) bytes spill stores", log)
    loads = re.search(r"(\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else -1, int(stores.group(1)) if stores else 0,
            int(loads.group(1)) if loads else 0)


def compile_kernel(fn, dtype: str, constexprs: dict, warps: int, stages: int,
                   capability: int, extra: dict | None = None,
                   decode: bool = False, no_fusion: bool = False) -> tuple[int, int, int, int]:
    """(shared bytes, registers, spill store bytes, spill load bytes) of one @triton.jit
    function compiled for sm_<capability> (no_fusion: fp fusion off, the batch-invariant
    kernel's option)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True  # a cached binary would skip ptxas and its log
    sig, attrs = _signature(fn, dtype, extra, decode)
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        compiled = triton.compile(ASTSource(fn, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", capability, 32),
                                  options=dict(num_warps=warps, num_stages=stages,
                                               **({"enable_fp_fusion": False} if no_fusion
                                                  else {})))
    return (compiled.metadata.shared, *_ptxas_numbers(buf.getvalue()))


def compile_spec(spec_path, capability: int | None = None, variants=None, log=None,
                 row64: bool = False):
    """KernelResources for every fwd/bwd/decode kernel of the spec's package, with the tiles the
    planner chose for the spec's GPU, compiled for sm_<capability> (default: the spec's
    gpu.arch, else sm_90). `variants`: names to restrict to; row64: compile the kernels'
    64-bit row offset form (ROW64) instead of the usual one."""
    from . import planner_core
    from .build import build_spec
    from .plan import plan_spec
    from .spec import load_spec

    spec = load_spec(spec_path)
    if capability is None:
        capability = spec.gpu.capability
    plans = plan_spec(spec)
    out = Path(tempfile.mkdtemp(prefix="flashgen-offline-"))
    build_spec(spec, out)
    sys.path.insert(0, str(out))
    registry = importlib.import_module(f"{spec.package}._registry")
    results = []
    for variant, plan in plans.items():
        if variants and variant.name not in variants:
            continue
        module = importlib.import_module(f"{spec.package}.kernels.{variant.name}")
        types, flags = mod_arg_types(registry, variant.name)
        for function, constexprs, warps, stages, *form in _variant_launches(spec, variant, plan,
                                                                             row64):
            fn = getattr(module, f"{variant.name}_{function}")
            if function == "dkdv_kernel":  # a tensor's gradient stored: the costlier build
                constexprs = {**constexprs, **flags}
            shared, regs, stores, loads = compile_kernel(fn, variant.dtype, constexprs, warps,
                                                         stages, capability,
                                                         {**types, **(form[0] if form else {})},
                                                         variant.kind == "decode",
                                                         function == "invariant")
            tile = "x".join(str(constexprs[k]) for k in ("BLOCK_M", "BLOCK_N") if k in constexprs)
            cfg = f"{tile}w{warps}s{stages}" + (" V_IS_K" if constexprs.get("V_IS_K") else "")
            if constexprs.get("FUSED_APPEND"):
                cfg += " rotary append"
            if function == "invariant":
                cfg += " fold" if constexprs["FOLD"] else " workspace"
            if constexprs.get("KV_QUANT"):  # a quantized cache's form
                cfg += " " + ("fp8" if constexprs["KV_QUANT"] == 1 else "int8") + " cache"
            warning = ("" if function in ("preprocess", "append")
                       else planner_core.spill_warning(plan) or "")
            r = KernelResources(variant.name, function, cfg, shared, regs,
                                stores, loads, spec.gpu.sram_bytes, warning)
            results.append(r)
            if log:
                log(r.row())
    return results


HEADER = ("| kernel | config | smem (compiler) | budget | regs | spill stores B | "
          "spill loads B |\n|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Compile a spec's fwd/bwd/decode kernels offline for "
                                 "an sm_XY target and print their resources.")
    ap.add_argument("spec")
    ap.add_argument("--arch", type=int, help="compute capability, e.g. 80, 89, 90 (default: "
                    "the spec's gpu.arch, whose tiles the planner chose; else 90)")
    ap.add_argument("--variants", nargs="+")
    ap.add_argument("--json", help="also write the results as JSON to this file")
    ap.add_argument("--row64", action="store_true", help="the kernels' ROW64 form: what a "
                    "call whose (batch, head) slices span 2**31 elements or more runs")
    args = ap.parse_args(argv)
    from .spec import load_spec

    planned = load_spec(args.spec).gpu.capability
    if args.arch is None:
        args.arch = planned
    note = "" if args.arch == planned else f" (tiles planned for sm_{planned})"
    note += ", ROW64 (64-bit row offsets)" if args.row64 else ""
    print(f"{args.spec} for sm_{args.arch}{note}\n\n{HEADER}", flush=True)
    results = compile_spec(args.spec, args.arch, args.variants,
                           log=lambda s: print(s, flush=True), row64=args.row64)
    if args.json:
        import json
        from dataclasses import asdict
        Path(args.json).write_text(json.dumps([asdict(r) for r in results], indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
