"""``compiler.debug.first_divergence`` compares each sharded value with the global run's: it must
compare the values as computed, not after a later in-place collective reduced them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compiler.debug import first_divergence
from shardspec import Mesh, P, sharded


def test_no_divergence_is_reported_where_the_in_place_all_reduce_overwrote_a_partial_sum():
    def fn(x, w1, w2):
        return F.gelu(F.linear(x, w1)) @ w2  # a row-parallel partial sum, all-reduced in place

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 64, generator=g, dtype=torch.float64)
    w1 = torch.randn(64, 64, generator=g, dtype=torch.float64)
    w2 = torch.randn(64, 3, generator=g, dtype=torch.float64)
    mesh = Mesh({"tp": 2}, simulate=True)
    f = sharded(fn, mesh=mesh, in_specs=(P(None, "tp"), P(None, "tp"), P()), out_specs=P())
    low = f.lower(x, w1, w2)
    assert any(c.kind == "all_reduce" for c in low.collectives())
    assert first_divergence(low.program, (x, w1, w2), rtol=1e-12, atol=1e-12) is None
