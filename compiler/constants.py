"""Tensors a step closes over are constants of its compiled program: their values are read when it
is traced. A later change would not be seen: in place (``w.mul_(2)``, ``w.data = ...``), or by
rebinding what the step reads (``W = ...`` for a global, ``self.w = ...``, ``model.weight =
nn.Parameter(...)``, ``cfg["scale"] = ...``). So after compiling, the places the step reaches each
constant from are found (its globals and closure cells, the helpers it calls, a method's ``self``,
and objects, modules, dicts and lists under them), and every call checks that each place still holds
that tensor, with the same storage and version counter, and refuses a call where one changed."""

from __future__ import annotations

import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from shardspec.errors import fail

_DEPTH = 5  # attribute / item steps below a root
_BUDGET = 20_000  # objects visited per compile: a huge global structure is not walked whole
_PER_TENSOR = 4  # places recorded per constant (tied weights are reached several ways)
_SKIPPED = ("torch", "shardspec", "compiler", "collectives", "optree", "einops", "numpy", "builtins")


@dataclass(frozen=True)
class _Place:
    """Where the step reads a constant: a root (a global, a closure cell, ``self``) and the attribute
    (``str``) or item (``("item", key)``) steps below it."""

    label: str
    root: Callable[[], Any]
    steps: tuple[Any, ...]

    def resolve(self) -> Any:
        x = self.root()
        for s in self.steps:
            x = x[s[1]] if isinstance(s, tuple) else getattr(x, s)
        return x

    def __str__(self) -> str:
        return self.label + "".join(f"[{s[1]!r}]" if isinstance(s, tuple) else f".{s}" for s in self.steps)


@dataclass(frozen=True)
class Snapshot:
    tensors: tuple[tuple[str, torch.Tensor, int | None, int], ...]  # what, tensor, version, data_ptr
    places: tuple[tuple[_Place, torch.Tensor], ...]


def snapshot(constants: list[tuple[str, torch.Tensor]], fn: Any, owner: Any = None) -> Snapshot:
    """Each constant with its version counter and storage now, and the places ``fn`` (or a method's
    ``self``) reaches it from."""
    tensors = []
    for what, t in constants:
        try:
            version: int | None = t._version
        except RuntimeError:  # an inference tensor keeps no version counter
            version = None
        tensors.append((what, t, version, t.data_ptr()))
    held = {id(t): t for _, t in constants}
    return Snapshot(tuple(tensors), tuple(_places(held, _roots(fn, owner))) if held else ())


def check_unchanged(snap: Snapshot, name: Any) -> None:
    for place, t in snap.places:
        try:
            now = place.resolve()
        except (AttributeError, LookupError, TypeError):
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


def _roots(fn: Any, owner: Any) -> list[tuple[str, Callable[[], Any]]]:
    """``self``, then the globals and closure cells of ``fn`` and of the functions they hold."""
    roots: list[tuple[str, Callable[[], Any]]] = []
    if owner is not None:
        roots.append(("self", lambda: owner))
    seen: set[int] = set()
    todo = [getattr(fn, "__func__", fn)]
    while todo and len(seen) < 64:
        f = todo.pop()
        code = getattr(f, "__code__", None)
        if code is None or id(f) in seen or _skipped(f):
            continue
        seen.add(id(f))
        env: dict[str, Any] = getattr(f, "__globals__", {})
        names = _names(code)
        for name in sorted(names):
            if name in env:
                roots.append((name, _getter(env, name)))
                todo.append(env[name])
                if isinstance(env[name], types.ModuleType) and not _skipped(env[name]):
                    todo += [getattr(env[name], n) for n in names if hasattr(env[name], n)]
        for name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            roots.append((name, _cell(cell)))
            try:
                todo.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
    return roots


def _getter(env: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: env.get(name)


def _cell(cell: Any) -> Callable[[], Any]:
    return lambda: cell.cell_contents


def _names(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):  # nested functions and comprehensions
            names |= _names(c)
    return names


def _skipped(x: Any) -> bool:
    module = (x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", None)) or ""
    return isinstance(module, str) and module.split(".")[0] in _SKIPPED


def _walk(roots: list[tuple[str, Callable[[], Any]]]) -> Iterator[tuple[_Place, Any]]:
    """Breadth first from the roots, each object once (tensors at every place they are found),
    a few levels deep and within a budget."""
    visited: set[int] = set()
    budget = _BUDGET
    for label, root in roots:
        try:
            frontier: list[tuple[Any, tuple[Any, ...]]] = [(root(), ())]
        except ValueError:
            continue
        for _ in range(_DEPTH + 1):
            nxt = []
            for x, steps in frontier:
                if isinstance(x, torch.Tensor):
                    yield _Place(label, root, steps), x
                    continue
                if id(x) in visited or budget <= 0:
                    continue
                visited.add(id(x))
                budget -= 1
                yield _Place(label, root, steps), x
                nxt += [(child, (*steps, s)) for s, child in _children(x)]
            frontier = nxt


def _places(held: dict[int, torch.Tensor], roots: list[tuple[str, Callable[[], Any]]]) -> list[Any]:
    """The places holding each constant (at most a few per tensor)."""
    found: dict[int, int] = {}
    out: list[tuple[_Place, torch.Tensor]] = []
    for place, x in _walk(roots):
        if isinstance(x, torch.Tensor) and id(x) in held and found.get(id(x), 0) < _PER_TENSOR:
            found[id(x)] = found.get(id(x), 0) + 1
            out.append((place, x))
    return out


def modules(fn: Any, owner: Any = None) -> tuple[torch.nn.Module, ...]:
    """The ``nn.Module``s the step can reach (with all their submodules): their ``training`` flags
    choose what is traced (dropout, batch norm's statistics), so they are part of the cache key and
    ``model.eval()`` after compiling gets a program of its own instead of the train-mode one."""
    found: dict[int, torch.nn.Module] = {}
    for _, x in _walk(_roots(fn, owner)):
        if isinstance(x, torch.nn.Module) and id(x) not in found:
            for m in x.modules():
                found.setdefault(id(m), m)
    return tuple(found.values())


def _children(x: Any) -> list[tuple[Any, Any]]:
    """The (step, value) pairs below ``x`` a step may read a tensor through."""
    if isinstance(x, torch.nn.Module):
        own = {**x._parameters, **x._buffers, **x._modules}
        rest = [(k, v) for k, v in _attributes(x) if k not in ("_parameters", "_buffers", "_modules")]
        return [(k, v) for k, v in own.items() if v is not None] + rest
    if isinstance(x, dict):
        return [(("item", k), v) for k, v in list(x.items())[:256] if isinstance(k, (str, int))]
    if isinstance(x, (list, tuple)):
        return [(("item", i), v) for i, v in enumerate(x[:256])]
    if isinstance(x, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)) or _skipped(x):
        return []
    return _attributes(x)


def _attributes(x: Any) -> list[tuple[Any, Any]]:
    attrs = getattr(x, "__dict__", None)
    if not isinstance(attrs, dict):
        return []
    return [(k, v) for k, v in list(attrs.items())[:256] if isinstance(k, str) and not k.startswith("__")]
