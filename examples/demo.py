"""A first look at shardspec: a mesh, a few specs, and where each device's block of a tensor lives."""

import torch

from shardspec import Mesh, P, local_shape, shard, unshard, visualize

mesh = Mesh({"dp": 2, "tp": 4}, simulate=True)
print(mesh)
print()

# A (8, 6) weight split over dp on rows and tp on columns: 6 columns over 4 devices is uneven, so
# blocks follow torch.chunk (2, 2, 2, 0).
print(visualize((8, 6), mesh, P("dp", "tp")))
print()

# Rows split over both axes (dp major), columns replicated.
print(visualize((8, 6), mesh, P(("dp", "tp"))))
print()

x = torch.arange(48.0).reshape(8, 6)
pieces = shard(x, mesh, P("dp", "tp"))
print("local shapes by rank:", [local_shape(x.shape, mesh, P("dp", "tp"), r) for r in range(mesh.size)])
assert torch.equal(unshard(pieces, mesh, P("dp", "tp")), x)
print("unshard(shard(x)) == x")

# Collectives over named axes: gather the tp-split columns back, counting the bytes each rank sends.
import collectives  # noqa: E402

pieces = shard(x, mesh, P(None, "tp"))
with collectives.count_bytes() as counter:
    gathered = collectives.all_gather(pieces, dim=1, axis="tp", mesh=mesh, size=6)
assert all(torch.equal(g, x) for g in gathered)
print(f"all_gather over tp: {counter.total_bytes_per_rank:.0f} bytes sent per rank (ring: phi * S)")
