"""batch_invariant (issue 49): the spec key's build-time check. The mode itself is the
generated package's `_invariant.py` (templates/package/invariant.py.j2) and the decode
template's `_invariant` kernel; docs/DECODING.md says why its bits do not depend on the
batch."""
from __future__ import annotations

from .spec import Spec


def check(spec: Spec) -> None:
    """`batch_invariant: true` makes every call run the decode kernel's batch-invariant
    form, so the spec must build decode kernels."""
    if spec.batch_invariant and not spec.decode:
        raise spec.error(
            "batch_invariant", "batch_invariant: true, but the spec builds no decode kernels, "
            "which the batch-invariant mode runs every call through",
            "batch_invariant: true together with decode: true",
            "add decode: true, or drop batch_invariant")
