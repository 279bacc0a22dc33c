"""``P``: the immutable partition spec, one entry per tensor dimension.

An entry is ``None`` (the dim is replicated), a mesh axis name (the dim is split over that axis), or a
tuple of names (split over the product of those axes, the first one major). Trailing ``None`` entries
are dropped and one-name tuples become the name, so equal shardings compare and hash equal.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from shardspec.errors import fail, shown

if TYPE_CHECKING:
    from shardspec.mesh import Mesh

Entry = None | str | tuple[str, ...]


def _normalize_entry(entry: object, position: int, raw: tuple[object, ...]) -> Entry:
    if entry is None or isinstance(entry, str):
        if isinstance(entry, str) and not entry:
            raise fail(
                f"P{_raw_repr(raw)}: entry {position} is an empty string.",
                "use None for a replicated dim, or a mesh axis name.",
            )
        return entry
    if isinstance(entry, (tuple, list)):
        names = tuple(entry)
        for name in names:
            if not isinstance(name, str) or not name:
                raise fail(
                    f"P{_raw_repr(raw)}: entry {position} is {shown(entry)}, whose item {name!r} is not a "
                    "mesh axis name.",
                    "a tuple entry holds mesh axis names only, e.g. P(('dp', 'tp'), None).",
                )
        if not names:
            return None
        return names[0] if len(names) == 1 else names
    raise fail(
        f"P{_raw_repr(raw)}: entry {position} is {shown(entry)} of type {type(entry).__name__}; an entry "
        "must be None, a mesh axis name (str) or a tuple of axis names.",
        "write e.g. P('dp', None) or P(('dp', 'tp'),); dimension sizes belong to the tensor, not the spec.",
    )


def _raw_repr(raw: tuple[object, ...]) -> str:
    return "(" + ", ".join(shown(e) for e in raw) + ")"


class P:
    """A partition spec: one entry per tensor dim, ``None`` (whole on every device), a mesh axis
    name (split over it) or a tuple of names (split over their product, first major). Trailing
    ``None``s are dropped, so equal layouts are equal values. Immutable and hashable. Example::

        >>> P("dp", None) == P("dp")
        True
        >>> P(None, ("dp", "tp")).axes_of(1)
        ('dp', 'tp')
    """

    __slots__ = ("_entries", "_written")
    _entries: tuple[Entry, ...]
    _written: int  # entries as written, trailing Nones included: a spec may not outrank its value

    def __init__(self, *entries: Entry) -> None:
        normalized = [_normalize_entry(e, i, entries) for i, e in enumerate(entries)]
        while normalized and normalized[-1] is None:
            normalized.pop()
        seen: dict[str, int] = {}
        for dim, entry in enumerate(normalized):
            for name in _names(entry):
                if name in seen:
                    raise fail(
                        f"P{_raw_repr(entries)} uses mesh axis {name!r} twice "
                        + (f"in dim {dim}" if seen[name] == dim else f"(dims {seen[name]} and {dim})")
                        + "; a device can hold only one slice of each dim per axis.",
                        f"name {name!r} in one entry only; to split one dim over several axes use a "
                        "tuple, e.g. P(('dp', 'tp')).",
                    )
                seen[name] = dim
        object.__setattr__(self, "_entries", tuple(normalized))
        object.__setattr__(self, "_written", len(entries))

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("P is immutable")

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The normalized entries (no trailing None)."""
        return self._entries

    def axes_of(self, dim: int) -> tuple[str, ...]:
        """Mesh axes that split ``dim`` (major first); empty when replicated or past the end."""
        return _names(self._entries[dim]) if dim < len(self._entries) else ()

    @property
    def axes(self) -> tuple[str, ...]:
        """Every mesh axis this spec names, in dim order."""
        return tuple(name for entry in self._entries for name in _names(entry))

    def padded(self, ndim: int) -> tuple[Entry, ...]:
        """Entries extended with None to ``ndim`` dims."""
        return self._entries + (None,) * max(0, ndim - len(self._entries))

    def validate(
        self,
        mesh: Mesh,
        ndim: int | None = None,
        *,
        name: str = "x",
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """Check the spec fits ``mesh`` and a tensor of rank ``ndim``; ``name`` is the argument path."""
        for axis in self.axes:
            if axis not in mesh.shape:
                raise fail(
                    f"{name}: spec {self} names mesh axis {axis!r}, but the mesh has axes "
                    f"{list(mesh.axis_names)} ({mesh.describe()}).",
                    f"use one of {list(mesh.axis_names)} or add {axis!r} to the Mesh.",
                )
        if ndim is not None:
            self.check_rank(ndim, name=name, shape=shape)

    def check_rank(self, ndim: int, *, name: str = "x", shape: tuple[int, ...] | None = None) -> None:
        """A spec names at most one entry per dim of its value, trailing Nones included (as JAX's
        ``PartitionSpec``): ``P(None, None)`` for a vector is a mistake, not a replicated vector."""
        if self._written <= ndim:
            return
        written = self.padded(self._written)
        shape_txt = f"shape {tuple(shape)}" if shape is not None else f"rank {ndim}"
        raise fail(
            f"{name}: spec P({', '.join(map(repr, written))}) has {len(written)} entries but "
            f"the value has {shape_txt} ({ndim} dim{'s' if ndim != 1 else ''}).",
            f"give at most {ndim} entr{'ies' if ndim != 1 else 'y'}"
            + (" (use P() for a scalar)" if ndim == 0 else "")
            + "; trailing dims not named are replicated.",
        )

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[Entry]:
        return iter(self._entries)

    def __getitem__(self, dim: int) -> Entry:
        return self._entries[dim]

    def __eq__(self, other: object) -> bool:
        return isinstance(other, P) and self._entries == other._entries

    def __hash__(self) -> int:
        return hash(("P", self._entries))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self._entries) + ")"

    def __reduce__(self) -> tuple[type[P], tuple[Entry, ...]]:
        return (P, self._entries)


def _names(entry: Entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    return entry
