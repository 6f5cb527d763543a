"""Model loading calls (``from_pretrained``, ``load_state_dict``) and the strings they are given.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .parse import SourceText, dotted_name, tree_of

_LOADERS = frozenset({"from_pretrained", "load_state_dict", "load", "cuda", "to"})


@dataclass(frozen=True)
class LoadCall:
    """A call in the cell that loads weights: ``func`` as written (``AutoModel.from_pretrained``), its
    first argument's text (the model id or path, or a name holding it), and its line."""

    func: str
    what: str
    line: int


def load_calls(source: str) -> list[LoadCall]:
    """The ``from_pretrained(...)`` calls of the cell, in source order."""
    tree = tree_of(source)
    if tree is None:
        return []
    src = SourceText(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and dotted_name(node.func).rsplit(".", 1)[-1] == "from_pretrained":
            what = src.segment(node.args[0]) if node.args else ""
            found.append(LoadCall(dotted_name(node.func), what, node.lineno))
    return sorted(found, key=lambda c: c.line)


def string_value(text: str, namespace_strings: dict[str, str]) -> str | None:
    """The string a call argument's text stands for: a literal, or a name holding a str."""
    try:
        node = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return namespace_strings.get(node.id)
    return None
