"""shardspec: declarative sharding for PyTorch.

The vocabulary lives here: ``Mesh`` (named device axes), ``P`` (a partition spec), the layout math
that says which slice each device holds, DTensor placement conversion and a text picture of a
sharding. The compiler's entry points (``sharded``, ``constrain``, ``value_and_grad``,
``Lowered``) are re-exported lazily: the compiler itself imports this vocabulary.
"""

import importlib
from typing import TYPE_CHECKING, Any

from shardspec import optim
from shardspec.errors import ShardingError
from shardspec.layout import (
    chunk_bounds,
    chunk_sizes,
    device_slices,
    is_even,
    local_shape,
    shard,
    unshard,
)
from shardspec.local import from_local, to_global
from shardspec.mesh import Mesh
from shardspec.placements import placements_to_spec, spec_to_placements
from shardspec.spec import P
from shardspec.specs_match import match_specs
from shardspec.visualize import visualize

if TYPE_CHECKING:
    from compiler import Lowered, sharded, value_and_grad
    from compiler.constrain import constrain

_COMPILER = ("Lowered", "constrain", "sharded", "value_and_grad")
# Names whose modules load on first use (module, attribute).
_LAZY = {
    "AUTO": ("compiler.plan.auto", "AUTO"),
    "CostModel": ("compiler.plan.costmodel", "CostModel"),
    "Pipeline": ("shardspec.pipeline", "Pipeline"),
    "pipeline_boundary": ("compiler.pipeline.boundary", "pipeline_boundary"),
    "remat": ("compiler.checkpointing", "remat"),
}


def __getattr__(name: str) -> Any:
    if name == "checkpoint":  # imported on first use: it loads torch.distributed.checkpoint
        return importlib.import_module("shardspec.checkpoint")
    if name == "random":
        return importlib.import_module("shardspec.random")
    if name in _COMPILER:
        import compiler

        return getattr(compiler, name)
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'shardspec' has no attribute {name!r}")


__version__ = "0.1.0"

__all__ = [
    "AUTO",
    "CostModel",
    "Lowered",
    "Mesh",
    "P",
    "Pipeline",
    "ShardingError",
    "chunk_bounds",
    "chunk_sizes",
    "constrain",
    "device_slices",
    "from_local",
    "is_even",
    "local_shape",
    "match_specs",
    "optim",
    "pipeline_boundary",
    "placements_to_spec",
    "remat",
    "shard",
    "sharded",
    "spec_to_placements",
    "to_global",
    "unshard",
    "value_and_grad",
    "visualize",
]
