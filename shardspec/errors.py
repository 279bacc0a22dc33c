"""The one exception type for user mistakes.

Every message follows the same shape so a user can act on it without reading our code: what was
wrong (the argument path, the spec, the sizes) and a ``Fix:`` line that says what to change.
"""

from __future__ import annotations


class ShardingError(ValueError):
    """A sharding, mesh or spec the user supplied cannot be used as given. The message names the
    argument path, the spec and the sizes, and ends with a ``Fix:`` line. Example::

        try:
            step(params, state, x, y)
        except shardspec.ShardingError as err:
            print(err)  # what was wrong, then a "Fix:" line
    """


def fail(what: str, fix: str) -> ShardingError:
    """Build a ShardingError whose message ends with a fix-it line."""
    return ShardingError(f"{what}\nFix: {fix}")
