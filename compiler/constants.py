"""Tensors a step closes over are constants of its compiled program: their values are read when it
is traced. A later change would not be seen: in place (``w.mul_(2)``, ``w.data = ...``), or by
rebinding what the step reads (``W = ...`` for a global, ``self.w = ...``, ``model.weight =
nn.Parameter(...)``, ``cfg["scale"] = ...``). So when a program is compiled, the places the step
reaches each constant from are found, and every call checks that each place still holds that tensor,
with the same storage and version counter, and refuses a call where one changed (``reach.py``
finds the places)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor

from compiler.reach import Code, Place, places, walk
from shardspec.errors import fail


@dataclass(frozen=True)
class Snapshot:
    tensors: tuple[tuple[str, torch.Tensor, int | None, int], ...]  # what, tensor, version, data_ptr
    places: tuple[tuple[Place, torch.Tensor], ...]


def values(fn: Any, owner: Any = None) -> dict[tuple[Any, ...], Any]:
    """What each place the step reaches holds now (taken before tracing, so a cache the trace
    fills with a traced value can be put back)."""
    return {place.key: x for place, x in walk(Code(fn, owner))}


def snapshot(
    constants: list[tuple[str, torch.Tensor]],
    fn: Any,
    owner: Any = None,
    before: dict[tuple[Any, ...], Any] | None = None,
) -> Snapshot:
    """Each constant with its version counter and storage now, and the places ``fn`` (or a method's
    ``self``) reaches it from. A place the trace left holding a traced value (a forward's cache,
    ``self.mask = torch.tril(...)``) gets back what it held ``before``, or is an error."""
    tensors = []
    for what, t in constants:
        try:
            version: int | None = t._version
        except RuntimeError:  # an inference tensor keeps no version counter
            version = None
        tensors.append((what, t, version, t.data_ptr()))
    held = {id(t): t for _, t in constants}
    code = Code(fn, owner)
    for place, x in walk(code):
        if isinstance(x, FakeTensor) and before is not None and _put_back(place, before):
            continue
        if isinstance(x, FakeTensor):
            raise fail(
                f"tracing the step stored one of its traced values in {place} (e.g. a cache such as "
                "`self.mask = torch.tril(...)` or `self.pe = self.pe.to(x.dtype)` inside forward): it "
                "is a placeholder without data, so later eager code reading it would compute garbage.",
                "keep the step from writing to Python objects: build such tensors before compiling "
                "(in __init__), or compute them inside the step without storing them.",
            )
    return Snapshot(tuple(tensors), tuple(places(held, code)) if held else ())


def _put_back(place: Place, before: dict[tuple[Any, ...], Any]) -> bool:
    """Give ``place`` (or, inside a tuple, the nearest place that can be set) what it held before
    tracing, or remove it where the trace added it (a new dict entry or attribute); False where
    neither can be done."""
    while place.steps:
        try:
            if place.key in before and not isinstance(before[place.key], FakeTensor):
                place.assign(before[place.key])
                return True
            if place.key not in before and place.parent().key in before:
                place.remove()
                return True
        except (AttributeError, LookupError, TypeError, ValueError):
            pass
        place = place.parent()
    return False


def check_unchanged(snap: Snapshot, name: Any) -> None:
    for place, t in snap.places:
        try:
            now = place.resolve()
        except (AttributeError, LookupError, TypeError, ValueError):  # ValueError: an emptied cell
            now = None
        if now is not t:
            raise fail(
                f"{place} was set to another tensor (or removed) after {name} compiled: the compiled "
                f"program holds the tensor {place} held then (a constant), so this call would use it.",
                f"pass the tensors that change (parameters being trained) to {name} as arguments; "
                "what the step closes over must stay fixed.",
            )
    for what, t, version, ptr in snap.tensors:
        if (version is not None and t._version != version) or t.data_ptr() != ptr:
            raise fail(
                f"{what}, of shape {tuple(t.shape)}, was modified in place after {name} compiled: the "
                "compiled program holds its value from then, so this call would use the old one.",
                f"pass that tensor to {name} as an argument (a tensor that changes between calls is "
                "an input, not a constant).",
            )


@dataclass(frozen=True)
class Modules:
    """The ``nn.Module``s the step can reach (with all their submodules), and where the outermost
    were found: their ``training`` flags choose what is traced (dropout, batch norm's statistics),
    so they are part of the cache key and ``model.eval()`` after compiling gets a program of its
    own; ``model = build()`` binding another module there makes them be found again."""

    all: tuple[torch.nn.Module, ...]
    places: tuple[tuple[Place, torch.nn.Module], ...]

    def moved(self) -> bool:
        for place, m in self.places:
            try:
                if place.resolve() is not m:
                    return True
            except Exception:
                return True
        return False


def modules(fn: Any, owner: Any = None) -> Modules:
    found: dict[int, torch.nn.Module] = {}
    places = []
    for place, x in walk(Code(fn, owner)):
        if isinstance(x, torch.nn.Module) and id(x) not in found:
            places.append((place, x))
            for m in x.modules():
                found.setdefault(id(m), m)
    return Modules(tuple(found.values()), tuple(places))
