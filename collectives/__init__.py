"""Functional collectives over named mesh axes, traceable as torch custom ops.

Two backends behind one API: torch.distributed (NCCL for CUDA tensors, gloo for CPU) for a real Mesh,
and an exact in-process simulation for a simulated one. Every call reports the bytes each rank sends
to ``count_bytes()`` counters.
"""

from collectives.accounting import ByteCounter, CollectiveRecord, count_bytes
from collectives.api import (
    SUPPORTED_DTYPES,
    all_gather,
    all_reduce,
    all_to_all,
    broadcast,
    ppermute,
    recv,
    reduce_scatter,
    send,
    wait,
)
from collectives.simulated import run_simulated

__all__ = [
    "SUPPORTED_DTYPES",
    "ByteCounter",
    "CollectiveRecord",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "broadcast",
    "count_bytes",
    "ppermute",
    "recv",
    "reduce_scatter",
    "run_simulated",
    "send",
    "wait",
]
