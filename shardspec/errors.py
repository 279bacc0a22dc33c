"""The one exception type for user mistakes.

Every message follows the same shape so a user can act on it without reading our code: what was
wrong (the argument path, the spec, the sizes) and a ``Fix:`` line that says what to change.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class ShardingError(ValueError):
    """A sharding, mesh or spec the user supplied cannot be used as given. The message names the
    argument path, the spec and the sizes, and ends with a ``Fix:`` line. Example::

        try:
            step(params, state, x, y)
        except shardspec.ShardingError as err:
            print(err)  # what was wrong, then a "Fix:" line
    """


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``; on Python 3.10, which has no ``add_note``, the note is appended to
    ``__notes__`` (kept for tools that read it; 3.10's traceback does not print it)."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
    else:
        notes = getattr(exc, "__notes__", None) or []
        exc.__notes__ = [*notes, note]


def fail(what: str, fix: str) -> ShardingError:
    """Build a ShardingError whose message ends with a fix-it line."""
    return ShardingError(f"{what}\nFix: {fix}")


class _Tensor:
    def __init__(self, t: Any) -> None:
        self.text = f"<tensor of shape {tuple(t.shape)}, {t.dtype}>"

    def __repr__(self) -> str:
        return self.text


def shown(x: Any) -> str:
    """``repr(x)`` for echoing what a user passed, with each tensor in it named by its shape and
    dtype: a message never prints tensor values (a parameter tree given where its specs belong)."""
    import optree
    import torch

    if isinstance(x, torch.Tensor):
        return repr(_Tensor(x))
    try:
        return repr(optree.tree_map(lambda v: _Tensor(v) if isinstance(v, torch.Tensor) else v, x))
    except Exception:  # a tree whose nodes cannot be rebuilt: no tensors shown either way
        return (
            repr(x)
            if not any(isinstance(v, torch.Tensor) for v in optree.tree_leaves(x))
            else type(x).__name__
        )


def user_facing(fn: F) -> F:
    """A ShardingError leaves ``fn`` without the library's own frames in its traceback (as JAX
    filters its frames): the user's call line, then the message, which says all there is to act
    on. ``SHARDSPEC_TRACEBACK=full`` keeps every frame (for reporting a bug in the library)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except ShardingError as err:
            if os.environ.get("SHARDSPEC_TRACEBACK") == "full":
                raise
            raise err.with_traceback(None) from err.__cause__

    return run  # type: ignore[return-value]
