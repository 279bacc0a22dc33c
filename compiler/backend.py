"""Per-call work a compiled step does once: the DTensor metadata of its results.

``DTensor.from_local`` builds and validates a ``DTensorSpec`` (placements, shard order, global shape
and stride) for every result of every call, through an autograd Function; for a training step that
is one per parameter and optimizer moment, every step. The spec of a result depends only on the
compiled program, so it is built once and each call wraps the local tensor with it directly
(``DTensor.__new__``: the constructor's ``__init__`` only adds a dynamo-disabling wrapper, about a
third of the cost of each of the ~160 wraps of a GPT step).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

_SPECS: dict[tuple[Any, ...], Any] = {}
_DTENSOR: list[Any] = []


def dtensor_type() -> Any:
    """``DTensor``, imported on first use (importing torch.distributed.tensor takes a while, and a
    simulated mesh never needs it) and then held, not imported again per tensor of every call."""
    if not _DTENSOR:
        from torch.distributed.tensor import DTensor

        _DTENSOR.append(DTensor)
    return _DTENSOR[0]


def _spec(
    device_mesh: Any, place: Sequence[Any], shape: torch.Size, stride: tuple[int, ...], dtype: Any
) -> Any:
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    key = (id(device_mesh), tuple(place), tuple(shape), tuple(stride), dtype)
    spec = _SPECS.get(key)
    if spec is None or spec.mesh is not device_mesh:
        spec = _SPECS[key] = DTensorSpec(
            device_mesh, tuple(place), tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), dtype)
        )
    return spec


def _wrap(out: torch.Tensor, spec: Any) -> Any:
    cls = dtensor_type()
    return cls.__new__(cls, out, spec, requires_grad=out.requires_grad)


def wrap_results(
    outs: Sequence[torch.Tensor],
    device_mesh: Any,
    placements: Sequence[Sequence[Any]],
    shapes: Sequence[torch.Size],
    strides: Sequence[tuple[int, ...]],
) -> list[Any]:
    """``DTensor.from_local(out, mesh, placements, run_check=False, shape=, stride=)`` for each
    result, with each result's spec built on first use and reused by every later call."""
    return [
        _wrap(out, _spec(device_mesh, place, shape, stride, out.dtype))
        for out, place, shape, stride in zip(outs, placements, shapes, strides, strict=True)
    ]


class ResultWrapper:
    """``wrap_results`` for one program's results, the specs looked up once (on the first call)
    instead of once per result per call; a result of another dtype than before gets its own."""

    def __init__(
        self,
        device_mesh: Any,
        placements: Sequence[Sequence[Any]],
        shapes: Sequence[torch.Size],
        strides: Sequence[tuple[int, ...]],
    ) -> None:
        self.device_mesh, self.placements, self.shapes, self.strides = (
            device_mesh,
            placements,
            shapes,
            strides,
        )
        self.specs: list[Any] = []

    def __call__(self, outs: Sequence[torch.Tensor]) -> list[Any]:
        specs = self.specs
        if len(specs) != len(outs) or any(o.dtype != s.tensor_meta.dtype for o, s in zip(outs, specs)):
            specs = self.specs = [
                _spec(self.device_mesh, place, shape, stride, out.dtype)
                for out, place, shape, stride in zip(
                    outs, self.placements, self.shapes, self.strides, strict=True
                )
            ]
        cls = dtensor_type()
        new = cls.__new__
        return [new(cls, out, spec, requires_grad=out.requires_grad) for out, spec in zip(outs, specs)]
