"""Bytes each rank sends, by the ring formulas of the reference (phi = (n - 1) / n).

| collective              | bytes sent per rank          |
| all_reduce of S bytes   | 2 * phi * S                  |
| all_gather to S total   | phi * S   (S = n * largest shard: uneven shards travel padded) |
| reduce_scatter of S     | phi * S   (S = n * largest block)                              |
| all_to_all of S / rank  | the bytes of the blocks bound for other ranks (phi * S when even) |
| send / ppermute         | S for a sender, 0 otherwise                                    |
| broadcast               | S for every rank of the pipelined chain but the last           |

Every collective call reports here; ``count_bytes()`` opens a counter that sees every call made while
it is open (counters nest). In a real run a process sees only its own rank; a simulated run sees every
virtual rank, and ``total_bytes_per_rank`` is the largest of them (for the symmetric collectives every
rank sends the same). Size exchanges that uneven collectives need when the caller gives no global size
are metadata, counted apart in ``metadata_bytes_per_rank``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class CollectiveRecord:
    """One collective over one group: what ran and what each of its ranks sent."""

    kind: str
    axes: tuple[str, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: tuple[int, ...]
    bytes_by_rank: Mapping[int, float]

    @property
    def bytes_per_rank(self) -> float:
        return max(self.bytes_by_rank.values(), default=0)


@dataclass(eq=False)
class ByteCounter:
    """What the collectives sent while the counter was open."""

    records: list[CollectiveRecord] = field(default_factory=list)
    _by_rank_kind: dict[tuple[int, str], float] = field(default_factory=dict)
    _metadata: dict[int, int] = field(default_factory=dict)

    def _add(self, record: CollectiveRecord) -> None:
        self.records.append(record)
        for rank, n in record.bytes_by_rank.items():
            key = (rank, record.kind)
            self._by_rank_kind[key] = self._by_rank_kind.get(key, 0) + n

    @property
    def bytes_by_rank(self) -> dict[int, float]:
        out: dict[int, float] = {}
        for (rank, _), n in self._by_rank_kind.items():
            out[rank] = out.get(rank, 0) + n
        return out

    @property
    def total_bytes_per_rank(self) -> float:
        """Payload bytes sent by the busiest rank (every rank, for symmetric collectives)."""
        return max(self.bytes_by_rank.values(), default=0)

    @property
    def by_kind(self) -> dict[str, float]:
        """Kind -> payload bytes sent by the busiest rank for that kind."""
        out: dict[str, float] = {}
        for (_, kind), n in self._by_rank_kind.items():
            out[kind] = max(out.get(kind, 0), n)
        return out

    @property
    def count(self) -> int:
        return len(self.records)

    @property
    def metadata_bytes_per_rank(self) -> int:
        return max(self._metadata.values(), default=0)


_lock = threading.Lock()
_active: list[ByteCounter] = []


@contextmanager
def count_bytes() -> Iterator[ByteCounter]:
    """Count the bytes every collective sends while the block runs."""
    counter = ByteCounter()
    with _lock:
        _active.append(counter)
    try:
        yield counter
    finally:
        with _lock:
            _active.remove(counter)


def record(
    kind: str,
    axes: tuple[str, ...],
    x: torch.Tensor,
    group: tuple[int, ...],
    bytes_by_rank: Mapping[int, float],
) -> None:
    """Report one collective to every open counter."""
    rec = CollectiveRecord(kind, axes, tuple(x.shape), x.dtype, group, dict(bytes_by_rank))
    with _lock:
        for counter in _active:
            counter._add(rec)


def record_metadata(bytes_by_rank: Mapping[int, int]) -> None:
    with _lock:
        for counter in _active:
            for rank, n in bytes_by_rank.items():
                counter._metadata[rank] = counter._metadata.get(rank, 0) + n


def _numel_bytes(shape: tuple[int, ...] | torch.Size, x: torch.Tensor) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * x.element_size()


def all_reduce_bytes(x: torch.Tensor, n: int) -> float:
    """2 * phi * S (a float: the lower bound need not be whole bytes)."""
    return 2 * (n - 1) * _numel_bytes(x.shape, x) / n


def all_gather_bytes(x: torch.Tensor, dim: int, max_len: int, n: int) -> int:
    """phi * S with S = n * the largest shard (shards travel padded to it)."""
    shape = list(x.shape)
    shape[dim] = max_len
    return (n - 1) * _numel_bytes(tuple(shape), x)


def reduce_scatter_bytes(x: torch.Tensor, dim: int, n: int) -> int:
    """phi * S with S = n * the largest block of the input."""
    shape = list(x.shape)
    shape[dim] = -(-shape[dim] // n)
    return (n - 1) * _numel_bytes(tuple(shape), x)


def all_to_all_bytes(x: torch.Tensor, split_dim: int, n: int, pos: int) -> int:
    """Everything but the block a rank keeps for itself (phi * S when even)."""
    from shardspec.layout import chunk_bounds

    start, stop = chunk_bounds(x.shape[split_dim], n, pos)
    shape = list(x.shape)
    shape[split_dim] = stop - start
    return _numel_bytes(x.shape, x) - _numel_bytes(tuple(shape), x)


def broadcast_bytes(x: torch.Tensor, n: int, pos: int, src: int) -> int:
    """A pipelined chain from ``src``: every member forwards S once, except the last of the chain."""
    return 0 if n == 1 or pos == (src - 1) % n else _numel_bytes(x.shape, x)


def p2p_bytes(x: torch.Tensor, sends: bool) -> int:
    return _numel_bytes(x.shape, x) if sends else 0
