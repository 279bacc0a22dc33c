"""Record the user's source line on every traced node, backward nodes included.

``SourceTracker`` (a TorchFunctionMode) sees each user-level torch call, stores the innermost user
frame as the fx stack trace for the nodes that call creates, and tags the autograd node of the result
with it. ``BackwardSources`` (a TorchDispatchMode) sees the ATen ops of the backward pass and labels
them "backward of <line>" from the autograd node being executed, so a gradient's collectives point at
the forward line that caused them. Both need ``torch.fx.traceback.preserve_node_meta()`` around the
trace.
"""

from __future__ import annotations

import linecache
import os
import sys
import traceback
from types import FrameType
from typing import Any

import optree
import torch
import torch.fx.traceback as fxt
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIBRARY_DIRS = tuple(
    os.path.dirname(os.path.abspath(m.__file__ or "")) + os.sep for m in (torch, optree)
) + tuple(os.path.join(_ROOT, pkg) + os.sep for pkg in ("compiler", "collectives", "shardspec"))


_IS_LIBRARY: dict[str, bool] = {}


def _library(filename: str) -> bool:
    known = _IS_LIBRARY.get(filename)
    if known is None:
        path = os.path.abspath(filename)
        known = _IS_LIBRARY[filename] = path.startswith(LIBRARY_DIRS) or "<frozen" in path
    return known


def user_frame(tb: Any = None) -> str:
    """``file:line: code`` of the innermost frame outside torch, optree and this library."""
    if tb is None:  # walk the live frames: formatting the whole stack per traced call is slow
        live: FrameType | None = sys._getframe(1)
        while live is not None:
            name = live.f_code.co_filename
            if not _library(name):
                text = linecache.getline(name, live.f_lineno, live.f_globals).strip()
                return f"{name}:{live.f_lineno}: {text}"
            live = live.f_back
        return "<unknown line>"
    for frame in reversed(traceback.extract_tb(tb)):
        path = os.path.abspath(frame.filename)
        if not path.startswith(LIBRARY_DIRS) and "<frozen" not in path:
            return f"{frame.filename}:{frame.lineno}: {(frame.line or '').strip()}"
    return "<unknown line>"


class SourceTracker(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        where = user_frame()
        fxt.set_stack_trace([where])
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                meta: dict[str, Any] = t.grad_fn.metadata  # type: ignore[assignment]
                meta.setdefault("shardspec_source", where)
        return out


class BackwardSources(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        node = torch._C._current_autograd_node()
        meta: dict[str, Any] = node.metadata if node is not None else {}  # type: ignore[assignment]
        if "shardspec_source" in meta:
            fxt.set_stack_trace(["backward of " + meta["shardspec_source"]])
        return func(*args, **(kwargs or {}))


def source_of(node: torch.fx.Node) -> str:
    """The recorded user line of a traced node ('' when none was recorded)."""
    text = node.meta.get("stack_trace") or ""
    return text.strip().splitlines()[-1].strip() if text.strip() else ""
