"""Specs by parameter-name pattern: one rule list instead of a hand-written spec per leaf.

Real models have hundreds of parameters whose names follow a scheme (``h.3.attn.qkv.weight``); the
sharding strategy is a statement about the scheme ("every attention projection splits its output
rows over tp"), so it is written as ``(regex, spec)`` rules matched against each leaf's dotted path.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import optree

from shardspec.errors import fail, shown
from shardspec.spec import P

_NO_DEFAULT: Any = object()


def leaf_name(path: Sequence[Any]) -> str:
    """A leaf's dotted path: ``("h", 0, "attn.weight")`` -> ``"h.0.attn.weight"``."""
    return ".".join(str(key) for key in path)


def match_specs(tree: Any, rules: Sequence[tuple[str | re.Pattern[str], P]], default: P = _NO_DEFAULT) -> Any:
    """A tree of specs shaped like ``tree``: each leaf gets the spec of the first rule whose regex
    matches (``re.search``) its dotted path, else ``default``.

    Paths join the keys from the root with dots, so a flat ``{"h.0.mlp.fc.weight": t}`` and a nested
    ``{"h": [{"mlp": {"fc": {"weight": t}}}]}`` both give ``"h.0.mlp.fc.weight"``. Without
    ``default`` a leaf no rule matches is an error naming it. Example::

        >>> params = {"h.0.mlp.fc.weight": torch.zeros(64, 16), "h.0.mlp.fc.bias": torch.zeros(64),
        ...           "wte": torch.zeros(32, 16)}
        >>> match_specs(params, [(r"mlp\\.fc\\.weight$", P("tp", None)), (r"mlp\\.fc\\.bias$", P("tp"))],
        ...             default=P())
        {'h.0.mlp.fc.weight': P('tp'), 'h.0.mlp.fc.bias': P('tp'), 'wte': P()}
    """
    compiled = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, tuple) and len(rule) == 2 and isinstance(rule[1], P)):
            raise fail(
                f"match_specs: rule {i} is {shown(rule)}, not a (regex, P) pair.",
                'write each rule as (r"pattern", P(...)), e.g. (r"attn\\.qkv\\.weight$", P("tp")).',
            )
        pattern, spec = rule
        try:
            compiled.append((re.compile(pattern), spec))
        except re.error as exc:
            raise fail(
                f"match_specs: rule {i}'s pattern {pattern!r} is not a valid regular expression ({exc}).",
                "fix the pattern (escape literal dots as \\.).",
            ) from None
    leaves, treedef = optree.tree_flatten(tree, none_is_leaf=False)
    # a namedtuple's or dataclass's entries by field name (paths give their positions)
    paths = [
        tuple(getattr(e, "field", None) or e.entry for e in accessor)
        for accessor in optree.tree_accessors(tree, none_is_leaf=False)
    ]
    specs = []
    for path, leaf in zip(paths, leaves, strict=True):
        name = leaf_name(path)
        spec = next((s for regex, s in compiled if regex.search(name)), default)
        if spec is _NO_DEFAULT:
            shape = tuple(leaf.shape) if hasattr(leaf, "shape") else type(leaf).__name__
            tried = ", ".join(repr(regex.pattern) for regex, _ in compiled) or "none"
            raise fail(
                f"match_specs: no rule matches {name!r} (shape {shape}); patterns tried: {tried}.",
                f"add a rule for {name!r}, or pass default=P() to replicate every leaf no rule matches.",
            )
        specs.append(spec)
    return optree.tree_unflatten(treedef, specs)
