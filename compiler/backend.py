"""Per-call work a compiled step does once: the DTensor metadata of its results.

``DTensor.from_local`` builds and validates a ``DTensorSpec`` (placements, shard order, global shape
and stride) for every result of every call, through an autograd Function; for a training step that
is one per parameter and optimizer moment, every step. The spec of a result depends only on the
compiled program, so it is built once and each call wraps the local tensor with it directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_SPECS: dict[tuple[Any, ...], Any] = {}


def wrap_results(
    outs: Sequence[torch.Tensor],
    device_mesh: Any,
    placements: Sequence[Sequence[Any]],
    shapes: Sequence[torch.Size],
    strides: Sequence[tuple[int, ...]],
) -> list[Any]:
    """``DTensor.from_local(out, mesh, placements, run_check=False, shape=, stride=)`` for each
    result, with each result's spec built on first use and reused by every later call."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    wrapped = []
    for out, place, shape, stride in zip(outs, placements, shapes, strides, strict=True):
        key = (id(device_mesh), tuple(place), tuple(shape), tuple(stride), out.dtype)
        spec = _SPECS.get(key)
        if spec is None or spec.mesh is not device_mesh:
            spec = _SPECS[key] = DTensorSpec(
                device_mesh, tuple(place), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), out.dtype)
            )
        wrapped.append(DTensor(out, spec, requires_grad=out.requires_grad))  # type: ignore[no-untyped-call]
    return wrapped
