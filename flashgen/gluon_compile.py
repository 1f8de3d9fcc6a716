"""Compile a package's Gluon kernels for sm_90 on any machine, no GPU needed.

Gluon does not run in Triton's interpreter, so the CPU test suite cannot execute these
kernels; it can still prove that every rendered Gluon kernel compiles for Hopper with the
Triton the package is verified on, through ptxas, and that what comes out is the design:
wgmma instructions, the producer/consumer register split (setmaxnreg), shared memory
within the GPU's budget. `python -m flashgen.gluon_compile SPEC` prints the table; the
test (tests/test_gluon.py) runs it in a subprocess because the kernels must be imported
with TRITON_INTERPRET unset.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from . import families
from .offline import _ptxas_numbers, mod_arg_types

H100_SMEM = 232448  # bytes one block may use on sm_90 (227 KiB)


@dataclass
class GluonResources:
    variant: str
    config: str
    shared: int
    registers: int      # at kernel entry (.maxnreg); the partitions re-split them with setmaxnreg
    spill_bytes: int    # ptxas stack frame
    wgmma: int          # wgmma.mma_async instructions in the PTX
    setmaxnreg: tuple   # the register counts the partitions ask for
    # ptxas's notes that it serialised wgmma or waited for one early (C75xx: e.g. a register
    # a wgmma writes read or moved while it may be in flight), which undo the overlap the
    # kernel was written for
    wgmma_notes: tuple = ()
    # local-memory accesses (spills) in one iteration of the worst key loop (None: the
    # SASS could not be read); the stack frame alone does not say where they are
    loop_spills: int | None = None
    # the SASS tensor-core forms, e.g. "QGMMA.64x128x32.F32.E4M3.E4M3 RS" (A from registers)
    # or "... SS" (A from shared memory); () where nvdisasm could not read the cubin
    gmma_forms: tuple = ()
    # TMA loads (cp.async.bulk.tensor, global to shared) in the PTX: a paged forward's
    # producer issues a box a page (and Triton splits a box wider than the swizzle's 128
    # bytes into one message per 64 columns)
    tma_loads: int = 0

    def row(self) -> str:
        return (f"| {self.variant} | {self.config} | {self.shared} | {self.registers} | "
                f"{self.spill_bytes} | {self.loop_spills} | {self.wgmma} | "
                f"{', '.join(map(str, self.setmaxnreg))} |"
                + (f" {'; '.join(self.wgmma_notes)} |" if self.wgmma_notes else ""))


HEADER = ("| variant | tile | shared bytes | regs at entry | stack bytes | key-loop LDL/STL | "
          "wgmma | setmaxnreg |\n|---|---|---|---|---|---|---|---|")


def _ptxas_report(log: str) -> tuple[int, int]:
    """(registers at entry, stack frame bytes) from ptxas's -v log."""
    regs, _, _ = _ptxas_numbers(log)
    stack = re.search(r"(\d+) bytes stack frame", log)
    return regs, int(stack.group(1)) if stack else 0


def _wgmma_notes(log: str) -> tuple:
    """ptxas's wgmma notes (code C75xx, e.g. "C7517 warpgroup.wait is injected ...")
    from its -v log, one short line each."""
    return tuple(sorted({f"C{m.group(1)} {m.group(2).strip()[:60]}"
                         for m in re.finditer(r"\(C(75\d\d)\)\s*([^\n]*)", log)}))


def _sass(cubin: bytes) -> str | None:
    """nvdisasm's listing of a cubin (None where nvdisasm is missing or fails)."""
    import subprocess

    from triton import knobs

    try:
        tool = knobs.nvidia.nvdisasm.path
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            return subprocess.run([tool, "-c", f.name], capture_output=True, text=True,
                                  check=True).stdout
    except (OSError, subprocess.CalledProcessError, AttributeError, RuntimeError):
        return None


def gmma_forms(cubin: bytes) -> tuple:
    """The distinct tensor-core instructions of a cubin's SASS (HGMMA: 16-bit operands,
    QGMMA: 8-bit), each with RS (its A operand from registers) or SS (from shared memory)."""
    listing = _sass(cubin) or ""
    return tuple(sorted({f"{m.group(1)} {'RS' if m.group(2) == 'R' else 'SS'}"
                         for m in re.finditer(r"\b([HQ]GMMA\.\S+) R\d+, (R|gdesc)", listing)}))


def _key_loop_spills(cubin: bytes, any_wgmma: bool = False) -> int | None:
    """LDL/STL instructions in one iteration of the kernel's worst key loop, from
    nvdisasm's listing of the cubin: the innermost loops (a backward branch before the
    kernel's last EXIT, past which ptxas puts the barrier waits' retry stubs) that hold both
    a wgmma with its A operand in registers (P V, or the backward's P^T dO) and one reading A
    from shared memory (S = Q K^T). With any_wgmma, every innermost loop that holds a wgmma
    (the latent decode's partitions read both operands from shared memory, S = Q K^T in one
    loop and P V in another). None when nvdisasm is missing or finds no such loop."""
    listing = _sass(cubin)
    if listing is None:
        return None
    labels, code = {}, []
    for line in listing.splitlines():
        label = re.match(r"\s*\.(L_x_\d+):", line)
        if label:
            labels[label.group(1)] = len(code)
            continue
        ins = re.search(r"/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;", line)
        if ins:
            code.append(ins.group(1))
    last_exit = max((i for i, c in enumerate(code) if c.endswith("EXIT")), default=len(code))
    loops = []
    for i, c in enumerate(code[:last_exit]):
        target = re.search(r"BRA\s+`?\(?\.(L_x_\d+)", c)
        if target and labels.get(target.group(1), i + 1) <= i:
            body = code[labels[target.group(1)]:i + 1]
            # (QGMMA: the 8-bit form, fp8)
            products = [b for b in body if b.startswith(("HGMMA", "QGMMA"))]
            if (any_wgmma and products) or (
                    any(re.match(r"[HQ]GMMA\S* R\d+, R\d+,", b) for b in products)
                    and any(re.match(r"[HQ]GMMA\S* R\d+, gdesc", b) for b in products)):
                loops.append((labels[target.group(1)], i))
    inner = [(s, e) for s, e in loops
             if not any(s <= s2 and e2 <= e and (s2, e2) != (s, e) for s2, e2 in loops)]
    if not inner:
        return None
    return max(sum(c.startswith(("LDL", "STL")) for c in code[s:e + 1]) for s, e in inner)


# scalar arguments compiled as fp32 (the softmax and dropout scales); any other scalar
# that is not a mod argument is an i32
_FP32_ARGS = ("qk_scale", "QK_SCALE_LOG2", "SCALE", "DROP_SCALE")


def _compile_sm90(fn, name: str, tile: str, const: dict, pointers: dict, num_warps: int,
                  descriptors: dict | None = None, mod_types: dict | None = None,
                  any_wgmma: bool = False) -> GluonResources:
    """Compile the Gluon kernel `fn` for sm_90 and read what came out: the signature from
    its argument names (const: the constexprs; descriptors: host-made TMA descriptors'
    signature types; pointers: element types, 16-byte aligned; _FP32_ARGS; mod_types: the
    mod arguments' types; else i32), then ptxas's registers, stack frame and wgmma notes,
    the PTX's wgmma count and setmaxnreg values, the shared memory and the key loops'
    LDL/STL (any_wgmma: see _key_loop_spills) as a GluonResources row named name / tile."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    descriptors = descriptors or {}
    sig, constexprs, attrs = {}, {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in const:
            sig[arg] = "constexpr"
            constexprs[(i,)] = const[arg]
        elif arg in descriptors:
            sig[arg] = descriptors[arg]
        elif arg in pointers:
            sig[arg] = "*" + pointers[arg]
            attrs[(i,)] = [["tt.divisibility", 16]]  # TMA bases are 16-byte aligned
        elif arg in _FP32_ARGS:
            sig[arg] = "fp32"
        elif mod_types and arg in mod_types:
            sig[arg] = mod_types[arg]
        else:
            sig[arg] = "i32"
    # Triton's own ptxas run prints its -v log (offline.py reads it the same way); a cached
    # binary would skip ptxas, so compile afresh
    knobs.nvidia.dump_ptxas_log = True
    knobs.compilation.always_compile = True
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        compiled = triton.compile(GluonASTSource(fn, sig, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options=dict(num_warps=num_warps))
    ptx = compiled.asm["ptx"]
    regs, stack = _ptxas_report(buf.getvalue())
    return GluonResources(
        variant=name, config=tile, shared=compiled.metadata.shared, registers=regs,
        spill_bytes=stack, wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
        setmaxnreg=tuple(sorted({int(n) for n in re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx)})),
        wgmma_notes=_wgmma_notes(buf.getvalue()),
        loop_spills=_key_loop_spills(compiled.asm["cubin"], any_wgmma=any_wgmma),
        gmma_forms=gmma_forms(compiled.asm["cubin"]),
        tma_loads=len(re.findall(r"cp\.async\.bulk\.tensor\.\d+d\.shared::cluster\.global", ptx)))


def compile_variant(module, name: str, head_dim: int, dtype: str, config: dict,
                    mod_types: dict | None = None, varlen: bool = False,
                    persistent: bool = False, v_dim: int | None = None,
                    page_size: int = 0, seqused: bool = False) -> GluonResources:
    """Compile `<name>_kernel` of an imported Gluon kernel module for sm_90 (mod_types:
    the signature types of the variant's mod arguments, see mod_arg_types; varlen: the
    packed-batch form, VARLEN=True with int32 cu_seqlens, else the dense one; persistent:
    a block-mask backward's PERSISTENT form, its WORK counter an int32 pointer -- the
    runtime's GLUON_BWD_PERSISTENT_MASKS -- else WORK is None, as the runtime passes it;
    v_dim: V's head dim where it is not Q's; page_size: the forward's paged form, VARLEN
    over a paged KV cache read through an int32 block table, as the runtime launches it for
    chunked prefill -- implies varlen; seqused: the keys' lengths from an int32 seqused_k
    with cu_seqlens_k None, as the prefill bench calls it)."""
    varlen = varlen or page_size > 0
    from triton.experimental.gluon import language as gl

    fn = getattr(module, f"{name}_kernel")
    gdtype = gl.bfloat16 if dtype == "bf16" else gl.float16
    regs = dict(CONSUMER_REGS=families.regs(config)[0], PRODUCER_REGS=families.regs(config)[1])
    if name.startswith("bwd"):
        # (as the runtime's _gluon_backward_launcher: the boxes of families.bwd_boxes)
        box = (families.d512_bwd_boxes(config["block_m"]) if families.is_d512_bwd(head_dim, v_dim)
               else families.bwd_boxes(head_dim, v_dim, config["block_m"]))
        const = dict(BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
                     NUM_BUFFERS=config["num_stages"], **regs,
                     QD_LAYOUT=gl.NVMMASharedLayout.get_default_for(box["Q"], gdtype),
                     KV_LAYOUT=gl.NVMMASharedLayout.get_default_for(box["K"], gdtype),
                     DS_LAYOUT=gl.NVMMASharedLayout.get_default_for(box["DS"], gdtype),
                     DQ_LAYOUT=gl.NVMMASharedLayout.get_default_for(box["DQ_ACC"], gl.float32),
                     VEC_LAYOUT=gl.NVMMASharedLayout.get_default_for([config["block_m"]],
                                                                     gl.float32),
                     HOST_DESC=True, VARLEN=varlen)
        if families.large_bwd(head_dim, v_dim):  # the large head dims' kernel
            const["DQ_SLOTS"] = int(config.get("dq_slots", 2))
            const["DO_BUFFERS"] = int(config.get("do_stages", config["num_stages"]))
        elif families.is_d512_bwd(head_dim, v_dim):  # Q/K 512's (families_large)
            const["DQ_SLOTS"] = int(config.get("dq_slots", 1))
        if varlen and "PROG_ORDER" in fn.arg_names:  # a packed batch's walk is its own
            const["PROG_ORDER"] = None
        if "WORK" in fn.arg_names:  # a block mask's: the persistent form's work counter
            if persistent:
                const["PERSISTENT"] = True
            else:
                const.update(PERSISTENT=False, WORK=None)
        elif persistent:
            raise ValueError(f"{name}: only a block-mask backward has a persistent form")
        if "PHILOX_SPLIT" in fn.arg_names:  # a dropout variant
            const["PHILOX_SPLIT"] = bool(config.get("philox_split", families.GLUON_BWD_PHILOX_SPLIT))
        # what the runtime launches: TMA descriptors made on the host (VARLEN: LSE and D
        # are read by plain loads, from pointers)
        pointers = {"DK": dtype, "DV": dtype}
        boxes = {"Q": (box["Q"], "QD_LAYOUT", gdtype), "DO": (box["DO"], "QD_LAYOUT", gdtype),
                 "K": (box["K"], "KV_LAYOUT", gdtype), "V": (box["V"], "KV_LAYOUT", gdtype),
                 "DQ_ACC": (box["DQ_ACC"], "DQ_LAYOUT", gl.float32)}
        # the runtime stores dK, dV through host-made descriptors (VARLEN: the boxes inside
        # their sequence; a sequence's last partial block from registers)
        boxes.update(DK_DESC=(box["K"], "KV_LAYOUT", gdtype),
                     DV_DESC=(box["V"], "KV_LAYOUT", gdtype))
        if persistent:
            pointers["WORK"] = "i32"
        if varlen:
            pointers.update(LSE="fp32", DELTA="fp32")
        else:
            boxes.update(LSE=(box["LSE"], "VEC_LAYOUT", gl.float32),
                         DELTA=(box["LSE"], "VEC_LAYOUT", gl.float32))
        descriptors = {arg: _descriptor_type(dt, box, const[lay])
                       for arg, (box, lay, dt) in boxes.items()}
    else:
        # (as the runtime's _gluon_forward_launcher: Q and K in qk_boxes, O's and V's
        # boxes take the same layouts)
        q_box = [1, 1, families.QUERY_ROWS_PER_CONSUMER, families.qk_boxes(head_dim)[1]]
        kv_box = [1, 1, config["block_n"], families.qk_boxes(head_dim)[1]]
        const = dict(BLOCK_M=config["block_m"], BLOCK_N=config["block_n"],
                     NUM_BUFFERS=config["num_stages"], PINGPONG=bool(config.get("pingpong", True)),
                     Q_BUFFERS=int(config.get("q_buffers", families.GLUON_DEFAULT["q_buffers"])),
                     OVERLAP=bool(config.get("overlap", families.GLUON_DEFAULT["overlap"])),
                     DIAG_FIRST=bool(config.get("diag_first", families.GLUON_DEFAULT["diag_first"])),
                     POLY_EXP2=int(config.get("poly_exp2", families.GLUON_DEFAULT["poly_exp2"])),
                     **regs,
                     QO_LAYOUT=gl.NVMMASharedLayout.get_default_for(q_box, gdtype),
                     KV_LAYOUT=gl.NVMMASharedLayout.get_default_for(kv_box, gdtype),
                     VARLEN=varlen, O_IN_Q=families.o_in_q(config, head_dim, v_dim))
        pointers = {"Q": dtype, "K": dtype, "V": dtype, "O": dtype, "LSE": "fp32"}
        if dtype == "fp8_e4m3":
            # (as the runtime's launcher: e4m3 Q, K and V's keys-major copy, a bf16 O, each
            # box its own layout; the descales)
            f8, v_pad = gl.float8e4nv, families.head_dim_pad(v_dim or head_dim)
            const.update(QO_LAYOUT=gl.NVMMASharedLayout.get_default_for(q_box, f8),
                         KV_LAYOUT=gl.NVMMASharedLayout.get_default_for(kv_box, f8),
                         O_LAYOUT=gl.NVMMASharedLayout.get_default_for(q_box[:3] + [v_pad],
                                                                        gl.bfloat16),
                         V_LAYOUT=gl.NVMMASharedLayout.get_default_for(
                             [1, 1, v_pad, config["block_n"]], f8))
            pointers.update(Q="fp8e4nv", K="fp8e4nv", V="fp8e4nv", O="bf16", DESCALE="fp32")
        descriptors = {}
        # PAGED: the block table (its used lengths from cu_seqlens_k, as the prefill bench's
        # calls give them); a dense or packed launch passes None and 0
        const.update(PAGE_SIZE=page_size, SEQUSED=seqused)
        if seqused:
            pointers["SEQUSED_K"] = "i32"
        else:
            const["SEQUSED_K"] = None
        if page_size:
            pointers["BT"] = "i32"
        else:
            const["BT"] = None
        # what the runtime launches: a dense band's tiles dealt by the host's table, a
        # block mask's by the table _mods.Call.tile_table makes from it; a packed batch's
        # walk by its own table (the runtime's _varlen_tile_table)
        if not varlen and module.LONGEST_FIRST.value:
            const["TILE_TABLE"] = True
            pointers["TILE_ORDER"] = "i32"
        elif varlen:
            const["TILE_TABLE"] = False
            pointers["TILE_ORDER"] = "i32"
        else:
            const.update(TILE_TABLE=False, TILE_ORDER=None)
        # an even forward (no band, no block mask, dense) deals its last rounds by key
        # block (families.stream_k_start): compile that form where the runtime launches it
        if (not varlen and not const["TILE_TABLE"] and "FULL_CNT" not in fn.arg_names
                and not module.MASK_LEFT.value and not module.MASK_RIGHT.value
                and families.stream_k_config(config)):
            const["STREAM_K"] = True
            pointers.update(SK_WS="fp32", SK_FLAGS="i32")
        else:
            const.update(STREAM_K=False, SK_WS=None, SK_FLAGS=None)
    if varlen and seqused and page_size:
        pointers["CU_Q"] = "i32"
        const["CU_K"] = None  # (the keys' lengths are seqused_k's)
    elif varlen:
        pointers.update(CU_Q="i32", CU_K="i32")
    else:
        const.update(CU_Q=None, CU_K=None)  # a dense launch passes None
    tile = (f"paged{page_size} " if page_size else "") + ("seqused " if seqused else "") + ("varlen " if varlen else "") + f"{config['block_m']}x{config['block_n']} s{config['num_stages']}" + (
        "" if config.get("pingpong", True) else " no-pingpong") + (
        f" q{config['q_buffers']}" if config.get("q_buffers", 1) != 1 else "") + (
        " overlap" if config.get("overlap", families.GLUON_DEFAULT["overlap"]) else "") + (
        " diag-first" if config.get("diag_first", families.GLUON_DEFAULT["diag_first"]) else "") + (
        f" poly-exp2 1/{config['poly_exp2']}" if config.get("poly_exp2") else "") + (
        " stream-k" if const.get("STREAM_K") else "") + (
        " philox-split" if const.get("PHILOX_SPLIT") else "") + (
        " o-in-q" if const.get("O_IN_Q") else "") + (
        f" dq-slots {const['DQ_SLOTS']}" if "DQ_SLOTS" in const else "") + (
        f" do-stages {const['DO_BUFFERS']}" if const.get("DO_BUFFERS", const["NUM_BUFFERS"])
        != const["NUM_BUFFERS"] else "") + (
        " persistent" if const.get("PERSISTENT") else "") + (
        "" if families.regs(config) == (families.CONSUMER_REGS, families.PRODUCER_REGS)
        else f" regs {config['regs']}")
    # (the large head dims' backward reads every wgmma operand from shared memory: its key
    # loop is the innermost loop with a wgmma)
    return _compile_sm90(fn, name, tile, const, pointers, config["num_warps"],
                         descriptors=descriptors, mod_types=mod_types,
                         any_wgmma="DQ_SLOTS" in const)


def compile_mla_decode(module, name: str, dtype: str = "bf16", config: dict | None = None,
                       paged: bool = True, per_row_lens: bool = True) -> GluonResources:
    """Compile the Gluon latent decode `<name>_kernel` (templates/gluon/decode_mla.py.j2)
    for sm_90 as the package's _decode launches it (config: families.MLA_DECODE's keys;
    paged: a block table with pages of whole key blocks; per_row_lens: a cache_seqlens
    tensor). Its key loops are two (S = Q K^T in the softmax warpgroup, P V in the output
    warpgroups), both with operands in shared memory: loop_spills counts the worst."""
    from triton.experimental.gluon import language as gl

    cfg = {**families.MLA_DECODE, **(config or {})}
    fn = getattr(module, f"{name}_kernel")
    gdtype = gl.bfloat16 if dtype == "bf16" else gl.float16
    const = dict(PAGED=paged, PER_ROW_LENS=per_row_lens, BLOCK_N=cfg["block_n"],
                 NUM_BUFFERS=cfg["num_buffers"], O_REGS=cfg["o_regs"],
                 PRODUCER_REGS=cfg["producer_regs"],
                 K_LAYOUT=gl.NVMMASharedLayout.get_default_for([1, 1, cfg["block_n"], 64], gdtype))
    pointers = {"Q": dtype, "K": dtype, "OP": "fp32", "SEQLENS": "i32", "BT": "i32"}
    tile = (f"{cfg['rows']}x{cfg['block_n']} s{cfg['num_buffers']} regs {cfg['o_regs']}/"
            f"{cfg['producer_regs']}" + (" paged" if paged else " contiguous"))
    return _compile_sm90(fn, name, tile, const, pointers, cfg["num_warps"], any_wgmma=True)


def _descriptor_type(dtype, box, layout) -> str:
    """The signature type Triton gives a host-made Gluon TensorDescriptor argument with this
    element type, box and shared-memory layout (what its specialisation of a real one
    says: `tensordesc<bf16[1, 1, 64, 128],NVMMASharedLayout(...)>`)."""
    return f"tensordesc<{dtype.name if hasattr(dtype, 'name') else dtype}{list(box)},{layout!r}>"


def compile_package(package_dir: Path, configs=None, variants=None, log=None,
                    varlen: bool = False) -> list[GluonResources]:
    """Compile every Gluon kernel of a generated package (at each of `configs`, default
    each variant's own untuned Gluon default, families.variant_gluon_default); with varlen,
    the packed-batch (VARLEN) form of each kernel as well."""
    package_dir = Path(package_dir).resolve()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    sys.path.insert(0, str(package_dir.parent))
    registry = importlib.import_module(f"{package_dir.name}._registry")
    out = []
    for name, reason in registry.GLUON.items():
        if reason is not None or (variants and name not in variants):
            continue
        facts = registry.VARIANTS[name]
        module = importlib.import_module(f"{package_dir.name}.kernels.gluon.{name}")
        own = [{**families.variant_gluon_default(facts), "kind": facts["kind"]}]
        for config in configs or own:
            if facts["kind"] != config.get("kind", "fwd"):
                continue
            # (the large head dims' backward serves dense batches only)
            dense_only = facts["kind"] == "bwd" and (
                families.large_bwd(facts["head_dim"], facts.get("v_head_dim"))
                or families.is_d512_bwd(facts["head_dim"], facts.get("v_head_dim")))
            for packed in (False, True) if varlen and not dense_only else (False,):
                res = compile_variant(module, name, facts["head_dim"], facts["dtype"], config,
                                      mod_arg_types(registry, name)[0], varlen=packed,
                                      v_dim=facts.get("v_head_dim"))
                if log:
                    log(res.row())
                out.append(res)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flashgen.gluon_compile",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("spec", help="a spec file; its package is built into a temp folder")
    ap.add_argument("--no-varlen", action="store_true",
                    help="the dense kernels only (by default each kernel is "
                         "compiled in its packed-batch form too, a `varlen` row)")
    args = ap.parse_args(argv)
    from .build import build

    with tempfile.TemporaryDirectory() as tmp:
        build(args.spec, Path(tmp))
        pkg = next(p for p in Path(tmp).iterdir() if (p / "_registry.py").exists())
        print(HEADER)
        compile_package(pkg, log=print, varlen=not args.no_varlen)
    return 0


if __name__ == "__main__":
    sys.exit(main())
