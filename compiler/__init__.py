"""The sharding compiler: trace -> rules -> propagate -> partition -> runtime.

``sharded`` is the entry point; ``Lowered`` reports a compiled step's program, collectives and costs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from compiler.constrain import constrain
from compiler.grad import value_and_grad
from compiler.lowered import CollectiveInfo, Cost, Lowered
from compiler.runtime import ShardedFunction
from shardspec.mesh import Mesh


def sharded(
    fn: Callable[..., Any] | None = None,
    *,
    mesh: Mesh,
    in_specs: Any,
    out_specs: Any,
    unsupported: str = "error",
    strict: bool = False,
) -> Any:
    """Compile ``fn`` for ``mesh``: arguments laid out by ``in_specs``, results by ``out_specs``.

    Use as ``@sharded(mesh=..., in_specs=..., out_specs=...)`` or ``sharded(fn, mesh=..., ...)``.
    ``unsupported="replicate"`` runs ops without a sharding rule on gathered inputs (with a warning)
    instead of raising. ``strict=True`` raises where two layouts send the same bytes with
    different collectives and nothing in the specs decides (otherwise ``explain()`` notes it).
    """

    def wrap(f: Callable[..., Any]) -> ShardedFunction:
        return ShardedFunction(f, mesh, in_specs, out_specs, unsupported, strict)

    return wrap(fn) if fn is not None else wrap


__all__ = ["CollectiveInfo", "Cost", "Lowered", "ShardedFunction", "constrain", "sharded", "value_and_grad"]
