"""Where a step reaches Python objects from: its roots (the globals its bytecode loads, closure
cells, defaults, a partial's arguments, a callable object or a method's ``self``) and, below them,
the places (attribute and item steps) holding each object. ``constants.py`` uses it to check that
what a compiled step closed over is still there, and to find the modules behind the train/eval key.

Objects are expanded through the methods and attributes the code's names pick out, again whenever
the set of names grows; below a root the walk takes the attributes the code names, ``nn.Module``
parameters and buffers at any depth, submodules, and dict and list items, within a budget per root
(a huge unrelated global cannot starve the others)."""

from __future__ import annotations

import dis
import functools
import itertools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

_DEPTH = 6  # attribute / item steps below a root (module parameters: any depth)
_BUDGET = 5_000  # objects visited per root
_ITEMS = 256  # items of a dict or list looked at
_PER_TENSOR = 16  # places recorded per constant (tied weights are reached several ways)
_SKIPPED = ("torch", "shardspec", "compiler", "collectives", "optree", "einops", "numpy", "builtins")
_KEYS = (str, int, float, bool, tuple, type(None))


@dataclass(frozen=True)
class Place:
    """Where the step reads a constant: a root (a global, a closure cell, ``self``) and the attribute
    (``str``) or item (``("item", key)``) steps below it."""

    label: str
    root: Callable[[], Any]
    steps: tuple[Any, ...]
    origin: int = 0  # id of the root's object when walked: two roots both labelled "self" differ

    @property
    def key(self) -> tuple[Any, ...]:
        return (self.origin, self.label, self.steps)

    def parent(self) -> Place:
        return Place(self.label, self.root, self.steps[:-1], self.origin)

    def resolve(self) -> Any:
        x = self.root()
        for s in self.steps:
            x = x[s[1]] if isinstance(s, tuple) else getattr(x, s)
        return x

    def assign(self, value: Any) -> None:
        parent = self.parent().resolve()
        last = self.steps[-1]
        if isinstance(last, tuple):
            parent[last[1]] = value
        else:
            setattr(parent, last, value)

    def remove(self) -> None:
        parent = self.parent().resolve()
        last = self.steps[-1]
        if isinstance(last, tuple):
            del parent[last[1]]
        else:
            delattr(parent, last)

    def __str__(self) -> str:
        return self.label + "".join(f"[{s[1]!r}]" if isinstance(s, tuple) else f".{s}" for s in self.steps)


class Code:
    """The roots of a step, and the attribute names its code (and the code it reaches) uses.

    Expanding a callable adds its roots and the attribute names its code uses, and queues what it
    reaches; an object is expanded through the methods and attributes those names pick out, so
    objects are expanded again whenever the set of names grows (``scaler.apply`` names ``table``)."""

    def __init__(self, fn: Any, owner: Any) -> None:
        self.roots: list[tuple[str, Callable[[], Any]]] = []
        self.attrs: set[str] = set()
        self._order: list[str] = []  # attrs in the order found: an object expanded again sees only new ones
        self._new: list[str] = []  # the names the current expansion looks at
        self._keys: set[tuple[Any, ...]] = set()  # roots already added
        self._seen: dict[int, int] = {}  # object -> how many names there were when last expanded
        self._objects: dict[int, Any] = {}  # the objects (not functions) expanded, by id
        if owner is not None:
            self._root(("self", id(owner)), "self", _fixed(owner))
        if isinstance(fn, torch.nn.Module):  # sharded(model): the module is the step
            self._root(("step", id(fn)), "the step module", _fixed(fn))
        todo = [fn]
        rounds = 0
        while todo and rounds < _ROUNDS:
            rounds += 1
            todo += self._expand(todo.pop())
            if not todo:  # names found later may pick more out of objects expanded earlier
                todo = [x for i, x in self._objects.items() if self._seen[i] != len(self._order)]
        if todo:
            import warnings

            warnings.warn(
                f"shardspec: the step reaches over {_ROUNDS} functions and objects; the search for "
                "the tensors it closes over stopped there, so a later change to some of them may not "
                "be detected. Pass tensors that change as arguments.",
                stacklevel=2,
            )

    def _root(self, key: tuple[Any, ...], label: str, getter: Callable[[], Any]) -> None:
        if key not in self._keys:  # one walk per place, however many functions load it
            self._keys.add(key)
            self.roots.append((label, getter))

    def _expand(self, f: Any) -> list[Any]:
        """Roots and attribute names of one callable or object; what it reaches, to expand next."""
        try:
            if self._seen.get(id(f)) == len(self._order) or isinstance(f, _ATOMS):
                return []
            self._new = self._order[self._seen.get(id(f), 0) :]  # the names this expansion adds
            self._seen[id(f)] = len(self._order)
            if not isinstance(f, (types.FunctionType, types.CodeType)):
                self._objects[id(f)] = f
            return self._reach(f)
        except Exception:  # an object whose lookups raise (a dead weakref.proxy, a dict's __getattr__)
            return []

    def _reach(self, f: Any) -> list[Any]:
        if isinstance(f, torch.nn.Module):  # its forwards and the attributes the code names
            forwards = [type(m).forward for m in f.modules() if not _skipped(type(m))]
            return list(dict.fromkeys(forwards)) + self._named(f)
        if isinstance(f, types.ModuleType):  # pkg.mod.fn(...): what the code names in it
            if _skipped(f):
                return []
            names = sorted(a for a in self._new if not a.startswith("__") and a in vars(f))
            for a in names:
                self._root(("attr", id(f), a), f"{f.__name__}.{a}", _attribute(f, a))
            return [getattr(f, a) for a in names]
        if isinstance(f, functools.partial):
            for i, a in enumerate(f.args):
                self._root(("partial", id(f), i), f"partial argument {i}", _fixed(a))
            for k, a in f.keywords.items():
                self._root(("partial", id(f), k), f"partial argument {k}", _fixed(a))
            return [f.func, *f.args, *f.keywords.values()]
        if isinstance(f, types.MethodType):
            self._root(("self", id(f.__self__)), "self", _fixed(f.__self__))
            return [f.__func__, f.__self__]
        if isinstance(f, (classmethod, staticmethod)):
            return [f.__func__]
        if isinstance(f, dict):  # a dict or list of functions (a registry of lambdas)
            return list(itertools.islice(f.values(), _ITEMS))
        if isinstance(f, (list, tuple)):
            return list(itertools.islice(f, _ITEMS))
        if isinstance(f, property):
            return [f.fget]
        code = f.__code__ if isinstance(f, types.FunctionType) else None  # no user __getattr__ runs
        own = getattr(f, "__dict__", None) if not isinstance(f, type) else None
        wrapped = [own["__wrapped__"]] if isinstance(own, dict) and "__wrapped__" in own else []
        if code is None:
            if _skipped(f):
                return wrapped
            call = _lookup(type(f), "__call__") if callable(f) and not isinstance(f, type) else None
            out = wrapped
            if isinstance(call, types.FunctionType) and not _skipped(call):
                self._root(("object", id(f)), "the step object", _fixed(f))  # a callable object
                out = [*out, call]
            return out + self._named(f)
        if _skipped(f):
            return wrapped  # a torch function; a sharded step's own function is its __wrapped__
        loads, attrs = _names(code)
        self._order += sorted(attrs - self.attrs)
        self.attrs |= attrs
        env: dict[str, Any] = getattr(f, "__globals__", {})
        out = list(wrapped)
        for name in sorted(loads):
            if name not in env:
                continue
            value = env[name]
            self._root(("global", id(env), name), name, _global(env, name))
            out.append(value)
            if isinstance(value, type) and not _skipped(value):
                for a in sorted(attrs):  # class attributes the code names: Cfg.W
                    if not a.startswith("__") and hasattr(value, a):
                        self._root(("attr", id(value), a), f"{name}.{a}", _attribute(value, a))
                        out.append(getattr(value, a))
        for name, cell in zip(code.co_freevars, getattr(f, "__closure__", None) or ()):
            self._root(("cell", id(cell)), name, _cell(cell))
            try:
                out.append(cell.cell_contents)
            except ValueError:  # a cell not yet filled
                continue
        named = getattr(f, "__name__", "the step")
        for i, d in enumerate(f.__defaults__ or ()):
            self._root(("default", id(f), i), f"{named}'s default {i}", _default(f, "__defaults__", i))
            out.append(d)
        for k, d in (f.__kwdefaults__ or {}).items():
            self._root(("default", id(f), k), f"{named}'s default {k}", _default(f, "__kwdefaults__", k))
            out.append(d)
        return out

    def _named(self, obj: Any) -> list[Any]:
        """What the code's attribute names pick out of ``obj``: its methods (functions of its class,
        classmethods, properties) and its own attributes, to expand in turn."""
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)) or _skipped(obj):
            return []
        out: list[Any] = []
        held = getattr(obj, "__dict__", None)
        for a in self._new:
            member = _lookup(type(obj), a)
            if isinstance(member, (types.FunctionType, classmethod, staticmethod, property)):
                out.append(member)
            if isinstance(held, dict) and a in held:
                out.append(held[a])
            elif isinstance(member, types.MemberDescriptorType):  # a __slots__ attribute
                try:
                    out.append(member.__get__(obj, type(obj)))
                except AttributeError:  # an unset slot
                    continue
            elif member is not None and not callable(member) and not isinstance(member, property):
                out.append(member)  # a class attribute read through an instance: cfg.table
        return out


_ATOMS = (type(None), bool, int, float, str, bytes, torch.Tensor)
_ROUNDS = 200_000  # expansions at most (each looks only at names new to its object)


def _lookup(cls: type, name: str) -> Any:
    """``name`` as defined on ``cls`` or a base, without running descriptors."""
    for c in cls.__mro__:
        if name in c.__dict__:
            return c.__dict__[name]
    return None


def _fixed(x: Any) -> Callable[[], Any]:
    return lambda: x


def _default(f: Any, where: str, key: Any) -> Callable[[], Any]:
    return lambda: getattr(f, where)[key]


def _global(env: dict[str, Any], name: str) -> Callable[[], Any]:
    return lambda: env.get(name)


def _attribute(obj: Any, name: str) -> Callable[[], Any]:
    return lambda: getattr(obj, name)


def _cell(cell: Any) -> Callable[[], Any]:
    return lambda: cell.cell_contents


def _names(code: types.CodeType) -> tuple[set[str], set[str]]:
    """The global names ``code`` loads and the attribute names it uses (nested code included)."""
    loads: set[str] = set()
    attrs: set[str] = set()
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME") and isinstance(ins.argval, str):
            loads.add(ins.argval)
        elif ins.opname in ("LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR") and isinstance(ins.argval, str):
            attrs.add(ins.argval)
        elif ins.opname == "LOAD_CONST" and isinstance(ins.argval, str) and ins.argval.isidentifier():
            attrs.add(ins.argval)  # getattr(box, "w"), setattr(obj, "cache", ...)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):  # nested functions and comprehensions
            inner = _names(c)
            loads |= inner[0]
            attrs |= inner[1]
    return loads, attrs


def _skipped(x: Any) -> bool:
    """Code of torch, this package or an installed library (site-packages): not searched. A
    library's globals rarely hold a step's tensors, and following them (transformers' modules
    reach most of transformers) cost seconds per compile; a model's parameters and buffers are
    still found through the model object itself."""
    try:
        module = (x.__name__ if isinstance(x, types.ModuleType) else getattr(x, "__module__", None)) or ""
    except Exception:  # a __getattr__ that raises something else
        return True
    return isinstance(module, str) and _library(module.split(".")[0])


@functools.cache
def _library(top: str) -> bool:
    if top in _SKIPPED:
        return True
    import sys

    file = getattr(sys.modules.get(top), "__file__", None) or ""
    return "site-packages" in file or "dist-packages" in file


def walk(code: Code) -> Iterator[tuple[Place, Any]]:
    """Breadth first from each root, each object once per root (tensors at every place they are
    found), a few levels deep and within a budget per root."""
    for label, root in code.roots:
        try:
            start = root()
        except Exception:  # an emptied cell, a removed attribute, a dead proxy
            continue
        origin = id(start)
        frontier: list[tuple[Any, tuple[Any, ...]]] = [(start, ())]
        visited: set[int] = set()
        budget = _BUDGET
        for _ in range(_DEPTH + 1):
            nxt = []
            for x, steps in frontier:
                try:
                    leaf = isinstance(x, (torch.Tensor, type(None), bool, int, float, str))
                except ReferenceError:  # a dead weakref.proxy
                    continue
                if leaf:
                    yield Place(label, root, steps, origin), x
                    continue
                if id(x) in visited or budget <= 0:
                    continue
                visited.add(id(x))
                budget -= 1
                yield Place(label, root, steps, origin), x
                if isinstance(x, torch.nn.Module):  # parameters and buffers at any depth
                    named = itertools.chain(x.named_parameters(), x.named_buffers())
                    for dotted, t in itertools.islice(named, 100_000):
                        yield Place(label, root, (*steps, *dotted.split(".")), origin), t
                try:
                    nxt += [(child, (*steps, s)) for s, child in _children(x, code.attrs)]
                except Exception:  # an object whose attribute lookups raise
                    continue
            frontier = nxt


def places(held: dict[int, torch.Tensor], code: Code) -> list[Any]:
    """The places holding each constant (at most a few per tensor)."""
    found: dict[int, int] = {}
    out: list[tuple[Place, torch.Tensor]] = []
    seen: set[tuple[Any, ...]] = set()
    for place, x in walk(code):
        if isinstance(x, torch.Tensor) and id(x) in held and found.get(id(x), 0) < _PER_TENSOR:
            if place.key in seen:
                continue
            seen.add(place.key)
            found[id(x)] = found.get(id(x), 0) + 1
            out.append((place, x))
    return out


def _children(x: Any, attrs: set[str]) -> list[tuple[Any, Any]]:
    """The (step, value) pairs below ``x`` a step may read a tensor through: an object's attributes
    its code names, a module's submodules, dict and list items."""
    if isinstance(x, torch.nn.Module):
        return [(k, v) for k, v in x._modules.items() if v is not None] + _attributes(x, attrs)
    if isinstance(x, dict):
        items = itertools.islice(x.items(), _ITEMS)
        return [(("item", k), v) for k, v in items if isinstance(k, _KEYS)]
    if isinstance(x, (list, tuple)):
        return [(("item", i), v) for i, v in enumerate(itertools.islice(x, _ITEMS))]
    if isinstance(x, type) and not _skipped(x):  # a class: the attributes the code names (cls.W)
        return [
            (k, v) for k, v in vars(x).items() if k in attrs and isinstance(v, (torch.Tensor, dict, list))
        ]
    if isinstance(x, (type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType)) or _skipped(x):
        return []
    return _attributes(x, attrs)


def _attributes(x: Any, attrs: set[str]) -> list[tuple[Any, Any]]:
    """``x``'s attributes that the step's code names (``self.history`` holding the same tensor as
    ``self.table`` is not a place the step reads), from ``__dict__`` and ``__slots__``."""
    out = []
    held = getattr(x, "__dict__", None)
    if isinstance(held, dict):
        out += [(k, v) for k, v in held.items() if isinstance(k, str) and k in attrs]
    for cls in type(x).__mro__:
        for k in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), tuple) else ():
            if k in attrs and hasattr(x, k):
                out.append((k, getattr(x, k)))
        if not _skipped(cls):  # a class attribute read through the instance: cfg.table
            own = {k for k, _ in out}
            out += [
                (k, v)
                for k, v in vars(cls).items()
                if k in attrs and k not in own and isinstance(v, torch.Tensor)
            ]
    return out
