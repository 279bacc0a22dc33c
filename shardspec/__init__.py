"""shardspec: declarative sharding for PyTorch.

The vocabulary lives here: ``Mesh`` (named device axes), ``P`` (a partition spec), the layout math
that says which slice each device holds, DTensor placement conversion and a text picture of a
sharding.
"""

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
from shardspec.mesh import Mesh
from shardspec.placements import placements_to_spec, spec_to_placements
from shardspec.spec import P
from shardspec.visualize import visualize

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "P",
    "ShardingError",
    "chunk_bounds",
    "chunk_sizes",
    "device_slices",
    "is_even",
    "local_shape",
    "placements_to_spec",
    "shard",
    "spec_to_placements",
    "unshard",
    "visualize",
]
