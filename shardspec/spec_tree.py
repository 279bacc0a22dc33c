"""Matching a tree of specs to a tree of values: mappings by key (whatever kind of mapping each
side is), and the first place where a spec tree is not a prefix of the values, named by path."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

from shardspec.spec import P


def keyed_like(spec: Any, value: Any) -> Any:
    """``spec`` with each mapping rebuilt as its value's kind of mapping in the value's key order:
    optree matches a dict against an OrderedDict (a ``state_dict()``) by flattening order, sorted
    keys against insertion order, which would give one entry's spec to another."""
    if isinstance(spec, Mapping) and isinstance(value, Mapping):
        if type(spec) is type(value) and not isinstance(spec, OrderedDict):
            return {k: keyed_like(v, value[k]) if k in value else v for k, v in spec.items()}
        if set(spec) != set(value):
            return spec  # the mismatch is reported with both key lists
        items = [(k, keyed_like(spec[k], value[k])) for k in value]
        return OrderedDict(items) if isinstance(value, OrderedDict) else dict(items)
    if isinstance(spec, (list, tuple)) and type(spec) is type(value) and len(spec) == len(value):
        aligned = [keyed_like(a, b) for a, b in zip(spec, value, strict=True)]
        return type(spec)(*aligned) if hasattr(spec, "_fields") else type(spec)(aligned)
    return spec


def _describe(x: Any) -> str:
    shape = getattr(x, "shape", None)  # a tensor, or a traced result's shape record
    if isinstance(shape, tuple):
        return f"tensor{tuple(shape)}" if len(shape) else "0-dim tensor"
    return type(x).__name__


def mismatch(spec: Any, value: Any, path: str) -> tuple[str, str] | None:
    """The first place where ``spec`` is not a prefix of ``value``: (path, what differs), no values."""
    if isinstance(spec, P):
        return None
    if spec is None:
        return path, "the spec is None (use P() for a value replicated on every device)"
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return path, f"the spec is a dict, the value a {_describe(value)}"
        missing = [k for k in spec if k not in value]
        extra = [k for k in value if k not in spec]
        if missing or extra:
            return path, f"spec keys not in the value: {missing}; value keys without a spec: {extra}"
        return next((m for k in spec if (m := mismatch(spec[k], value[k], f"{path}[{k!r}]"))), None)
    if isinstance(spec, (list, tuple)):
        if type(spec) is not type(value):
            detail = f"the spec is a {type(spec).__name__}, the value a {_describe(value)}"
            kind = type(value)
            if isinstance(value, tuple) and kind is not tuple and len(spec) == len(value):
                detail += (
                    f" (a named tuple of {len(value)}: give one P for all its fields, a spec of its own "
                    f"type, {kind.__module__}.{kind.__qualname__}(({', '.join(['P(...)'] * len(value))})), "
                    "or return tuple(...) of it)"
                )
            return path, detail
        if len(spec) != len(value):
            return path, f"{len(spec)} specs for {len(value)} values"
        return next(
            (m for i, (a, b) in enumerate(zip(spec, value)) if (m := mismatch(a, b, f"{path}[{i}]"))), None
        )
    return None
