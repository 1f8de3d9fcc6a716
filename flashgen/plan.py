"""Stage 2, plan: tile sizes for every kernel variant of a spec, from the target GPU's
shared-memory budget.

The arithmetic lives in `planner_core` (standard library only, because the generated
package ships a copy of it to plan for an untuned GPU at run time); this module applies it
to a parsed spec and turns an infeasible explicit tile into a spec error at its file:line.
"""
from __future__ import annotations

from . import invariant, mods, planner_core
from .spec import Spec
from .variants import Variant, variants_for

# spec `blocks` entry that governs each kernel kind
_BLOCK_KEYS = {"fwd": "forward", "bwd": "backward", "decode": "decode"}


def variant_score_bytes(spec: Spec, variant: Variant) -> int:
    """Bytes per score element the variant's mods read as [BLOCK_M, BLOCK_N] tiles."""
    by_name = {m.name: m for m in spec.mods}
    return mods.score_bytes([by_name[n] for n in variant.mods])


def plan_variant(spec: Spec, variant: Variant) -> planner_core.Plan:
    key = _BLOCK_KEYS[variant.kind]
    explicit = getattr(spec.blocks, key)
    arch = spec.gpu.capability
    tile = None
    if explicit is not None:
        tile = planner_core.TileConfig(explicit.block_m, explicit.block_n,
                                       explicit.num_warps, explicit.num_stages)
    try:
        return planner_core.plan(variant.kind, variant.plan_dim, variant.dtype_bytes,
                                 spec.gpu.sram_bytes, spec.gpu.sm_count, explicit=tile,
                                 arch=arch, score_bytes=variant_score_bytes(spec, variant))
    except ValueError as e:
        sb = variant_score_bytes(spec, variant)
        need = min_sram_bytes(variant.kind, variant.plan_dim, variant.dtype_bytes, arch, sb)
        if tile is None or (need is not None and need > spec.gpu.sram_bytes):
            # nothing fits the budget at all: the budget is what to change, not the tile
            needs = {v.name: min_sram_bytes(v.kind, v.plan_dim, v.dtype_bytes, arch,
                                            variant_score_bytes(spec, v))
                     for v in variants_for(spec)}
            worst = max(needs, key=lambda n: needs[n] or 0)
            raise spec.error(
                "gpu.sram_bytes",
                f"{spec.gpu.sram_bytes} B of shared memory per block fits no tile of "
                f"{variant.name} (its smallest feasible tile, {smallest_tile(variant, arch, sb)})",
                f"at least {needs[worst]} B, what the most demanding kernel of this spec "
                f"({worst}) needs for its smallest feasible tile; the planner picks larger, "
                "faster tiles the more there is",
                f"set gpu.sram_bytes to your GPU's per-block opt-in shared memory (>= "
                f"{needs[worst]}; A100 166912, RTX 4090 101376, H100 232448), or drop the "
                "head dims or dtypes that need more") from None
        raise spec.error(
            f"blocks.{key}",
            f"{variant.name}: {e}",
            "a tile the planner accepts for this GPU: shared memory within gpu.sram_bytes "
            f"({spec.gpu.sram_bytes} B), accumulators that fit in registers, and warps "
            "matched to the tile",
            f"run `flashgen plan {spec.path}` to list the feasible tiles and pick one, or "
            f"write `{key}: auto`") from None


def plan_spec(spec: Spec) -> dict[Variant, planner_core.Plan]:
    invariant.check(spec)
    return {v: plan_variant(spec, v) for v in variants_for(spec)}


def _feasible_anywhere(kind: str, head_dim: int, dtype_bytes: int,
                      arch: int = planner_core.DEFAULT_ARCH, score_bytes: int = 0):
    """Every candidate tile that only a shared-memory budget could rule out."""
    d = planner_core.padded_head_dim(head_dim)
    big = 1 << 30
    for bm in planner_core.BLOCK_SIZES:
        for bn in planner_core.BLOCK_SIZES:
            for nw in planner_core.WARP_COUNTS:
                for ns in planner_core.STAGE_COUNTS:
                    cand = planner_core.evaluate(kind, planner_core.TileConfig(bm, bn, nw, ns),
                                                 d, dtype_bytes, big, arch, score_bytes)
                    if cand.rejected is None:
                        yield cand


def min_sram_bytes(kind: str, head_dim: int, dtype_bytes: int,
                   arch: int = planner_core.DEFAULT_ARCH, score_bytes: int = 0) -> int | None:
    """The smallest shared-memory budget under which the planner finds a tile (None: no
    tile of this kind fits in registers at any budget)."""
    return min((c.smem_bytes for c in _feasible_anywhere(kind, head_dim, dtype_bytes, arch,
                                                         score_bytes)),
               default=None)


def smallest_tile(variant: Variant, arch: int = planner_core.DEFAULT_ARCH,
                  score_bytes: int = 0) -> str:
    best = min(_feasible_anywhere(variant.kind, variant.plan_dim, variant.dtype_bytes, arch,
                                  score_bytes),
               key=lambda c: c.smem_bytes, default=None)
    if best is None:
        return "none: no tile of this kind fits in registers"
    return f"{best.config} needs {best.smem_bytes} B"


def format_summary(plan: planner_core.Plan) -> str:
    """A few lines per plan: the FA-1 rule, how it becomes the planner's target tile, the
    chosen tile and how many candidates were feasible (`flashgen plan`; --all lists them)."""
    m_elems = plan.sram_bytes // plan.dtype_bytes
    target_m, target_n = planner_core._targets(plan.kind, plan.fa1_bc, plan.fa1_br)
    feasible = [c for c in plan.candidates if c.rejected is None]
    chosen = next(c for c in plan.candidates if c.config == plan.chosen)
    role = {
        "fwd": ("block_m (resident Q rows) <- Bc", "block_n (streamed K/V rows) <- Br"),
        "bwd": ("block_n (resident K/V rows) <- Bc", "block_m (streamed Q/dO rows) <- "
                "max(Br / 4, 32): each query row streams Q, dO, P and dP"),
        "decode": ("block_n (K/V rows) <- Bc", "block_m = 16 (one MMA tile of query rows)"),
    }[plan.kind]
    lines = [
        f"FA-1 rule: M = {plan.sram_bytes} B / {plan.dtype_bytes} = {m_elems} elements; "
        f"Bc = ceil(M / 4d) = {plan.fa1_bc}, Br = min(Bc, d) = {plan.fa1_br}",
        f"  as a target tile: {role[0]}, {role[1]}; each floored to a power of two and "
        f"clamped to 16..{planner_core.MAX_TARGET_TILE} (past 128 rows the register-resident "
        f"accumulator spills or halves the CTAs in flight) -> block_m {target_m}, "
        f"block_n {target_n}",
        f"chosen: {plan.chosen} (block_m x block_n, warps, stages): "
        f"{chosen.smem_bytes} B of {plan.sram_bytes} B shared memory, "
        f"~{chosen.regs_per_thread} accumulator regs/thread",
    ]
    warning = planner_core.spill_warning(plan)
    if warning:
        lines.append(f"  MAY SPILL registers: {warning}")
    elif planner_core.mma_sync_model(plan.arch, plan.head_dim_padded):
        lines.append(
            f"  planned for {planner_core.arch_name(plan.arch)}: before Hopper mma.sync keeps its "
            f"operands in registers, so accumulators are capped at "
            f"{planner_core.max_acc_regs(plan.arch, plan.head_dim_padded)} regs/thread (not "
            f"{planner_core.MAX_ACC_REGS})"
            + (", the backward runs 1 stage and may put 2 warps across d > 64"
               if plan.kind == "bwd" else "")
            + "; compiled without spills offline (bf16, d = 64 and 128: docs/OTHER_GPUS.md)")
    if (plan.chosen.block_m, plan.chosen.block_n) == (target_m, target_n):
        lines.append("  = the target tile; warps and stages ranked by the preferred pipeline "
                     f"depth ({planner_core.PREFERRED_STAGES[plan.kind]}) and fewer warps")
    else:
        at_target = [c for c in plan.candidates if (c.config.block_m, c.config.block_n)
                     == (target_m, target_n)]
        why = ("no such candidate" if not at_target else
               next((c.rejected for c in at_target if c.rejected is None), None)
               or min((c.rejected for c in at_target), key=len))
        lines.append(f"  differs from the target tile {target_m}x{target_n}: "
                     + ("it ranked lower" if why is None else f"there, {why}"))
    counts = {}
    for c in plan.candidates:
        if c.rejected:
            for reason in c.rejected.split("; "):
                rule = ("smem" if reason.startswith("smem") else "registers" if "regs" in reason
                        else "warps" if reason.startswith("num_warps")
                        else "stages" if reason.startswith("num_stages ") and " on sm_" in reason
                        else "no pipelining")
                counts[rule] = counts.get(rule, 0) + 1
    lines.append(f"{len(feasible)} of {len(plan.candidates)} candidates feasible; rejections: "
                 + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return "\n".join(lines)
