"""Record the user's source line on every traced node, backward nodes included.

``SourceTracker`` (a TorchFunctionMode) sees each user-level torch call, stores the innermost user
frame as the fx stack trace for the nodes that call creates, and tags the autograd node of the result
with it plus a pre-hook: when backward runs that node, the hook labels the ATen ops it records
"backward of <line>", so a gradient's collectives point at the forward line that caused them. (A hook
per autograd node instead of a dispatch mode seeing every ATen op, forward ones included: the mode
cost about a tenth of the whole trace.) Needs ``torch.fx.traceback.preserve_node_meta()`` around the
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
        if torch._C._current_autograd_node() is not None:
            # a torch call inside backward (an autograd.Function's backward): its ops keep the
            # "backward of" label the running node's hook set
            return func(*args, **(kwargs or {}))
        where = user_frame()
        fxt.set_stack_trace([where])
        out = func(*args, **(kwargs or {}))
        for t in optree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                meta: dict[str, Any] = t.grad_fn.metadata  # type: ignore[assignment]
                if "shardspec_source" not in meta:
                    meta["shardspec_source"] = where
                    t.grad_fn.register_prehook(_Label("backward of " + where))
        return out


class _Label:
    """An autograd node's pre-hook: the ops of its backward are recorded under ``text``."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __call__(self, grad_outputs: Any) -> None:
        fxt.set_stack_trace([self.text])


def source_of(node: torch.fx.Node) -> str:
    """The recorded user line of a traced node ('' when none was recorded)."""
    text = node.meta.get("stack_trace") or ""
    return text.strip().splitlines()[-1].strip() if text.strip() else ""
