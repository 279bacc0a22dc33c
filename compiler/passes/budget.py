"""Memory budget: ZeRO-3's re-gather-or-keep choice made per parameter, against a peak the user sets.

Keeping a parameter gathered in forward until backward saves one all-gather of it per step and
holds the unsharded copy across the activation peak; gathering it again for backward
(``passes/regather.py``) frees it after its last forward use. With ``sharded(memory_budget=b)``
(bytes per rank) the schedule re-gathers the fewest parameters whose predicted peak
(``passes/liveness.py`` over the finished program: every pass and donation applied) is at most
``b``: those held longest first, since a forward copy held from early forward to late backward
spans the whole activation peak. Each re-gather only adds bytes, and the peak only falls as more
are re-gathered (up to the interplay with buckets), so the count is found by bisection. When even
re-gathering every parameter does not fit, no schedule does: that is an error naming the budget,
the lowest peak found and what would lower it.
"""

from __future__ import annotations

from collections.abc import Callable

from shardspec.errors import fail, shown


def fewest_regathers(budget: int, candidates: int, peak: Callable[[int], int]) -> int:
    """The least ``k`` in ``0..candidates`` with ``peak(k) <= budget`` (``peak(k)``: the predicted
    peak per rank with the first ``k`` candidates gathered again), else a ``ShardingError``."""
    keep_all = peak(0)
    if keep_all <= budget:
        return 0
    again_all = peak(candidates)
    if again_all > budget:
        lowest = min(keep_all, again_all)
        raise fail(
            f"sharded(memory_budget={budget:,}) bytes per rank ({_mib(budget)}): no schedule of this "
            f"step fits. The lowest predicted peak is {lowest:,} bytes per rank ({_mib(lowest)})"
            + (
                f" (every forward-gathered parameter kept for backward: {_mib(keep_all)}; all "
                f"{candidates} that backward reads gathered again: {_mib(again_all)})."
                if candidates
                else "; no parameter is gathered for both forward and backward, so the schedule "
                "has no re-gather to choose."
            ),
            "use more devices; split parameters and optimizer state over the data-parallel axis "
            "(ZeRO-3: P('dp') specs for both); donate them (donate=(0, 1)); wrap layers in "
            f"shardspec.remat; or raise memory_budget to at least {lowest:,}.",
        )
    lo, hi = 1, candidates  # peak(hi) fits, peak(lo - 1) does not: find the least k that fits
    while lo < hi:
        mid = (lo + hi) // 2
        if peak(mid) <= budget:
            hi = mid
        else:
            lo = mid + 1
    return hi


def check_budget(budget: object) -> int | None:
    """``memory_budget`` as given: None, or a positive whole number of bytes per rank (a float such
    as 8e9 too; 1.5 bytes is a mistake, not 1)."""
    if budget is None:
        return None
    whole = isinstance(budget, int) or (isinstance(budget, float) and budget.is_integer())
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not whole or budget <= 0:
        raise fail(
            f"sharded(memory_budget={shown(budget)}) is not a positive number of bytes per rank.",
            "pass the bytes one rank may hold at its peak, e.g. memory_budget=8 * 2**30 (8 GiB), "
            "or None for the default schedule.",
        )
    return int(budget)


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f} MiB"
