"""Stage 2, plan: tile sizes for every kernel variant of a spec, from the target GPU's
shared-memory budget.

The arithmetic lives in `planner_core` (standard library only, because the generated
package ships a copy of it to plan for an untuned GPU at run time); this module applies it
to a parsed spec and turns an infeasible explicit tile into a spec error at its file:line.
"""
from __future__ import annotations

from . import planner_core
from .spec import Spec
from .variants import Variant, variants_for

# spec `blocks` entry that governs each kernel kind
_BLOCK_KEYS = {"fwd": "forward", "bwd": "backward", "decode": "decode"}


def plan_variant(spec: Spec, variant: Variant) -> planner_core.Plan:
    key = _BLOCK_KEYS[variant.kind]
    explicit = getattr(spec.blocks, key)
    tile = None
    if explicit is not None:
        tile = planner_core.TileConfig(explicit.block_m, explicit.block_n,
                                       explicit.num_warps, explicit.num_stages)
    try:
        return planner_core.plan(variant.kind, variant.head_dim, variant.dtype_bytes,
                                 spec.gpu.sram_bytes, spec.gpu.sm_count, explicit=tile)
    except ValueError as e:
        raise spec.error(
            f"blocks.{key}",
            f"{variant.name}: {e}",
            "a tile the planner accepts for this GPU: shared memory within gpu.sram_bytes "
            f"({spec.gpu.sram_bytes} B), accumulators that fit in registers, and warps "
            "matched to the tile",
            f"run `flashgen plan {spec.path}` to list the feasible tiles and pick one, or "
            f"write `{key}: auto`") from None


def plan_spec(spec: Spec) -> dict[Variant, planner_core.Plan]:
    return {v: plan_variant(spec, v) for v in variants_for(spec)}
