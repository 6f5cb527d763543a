"""What writing a fixed run into the notebook changes: the failing cell's new body, and each notebook
function the fix redefined at the top of the cell, to be written back where the notebook defines it.

A batch fix whose training loop lives in a function of an earlier cell (``train``) runs that function
redefined at the top of the failing cell. Written into the notebook as it ran, the notebook would hold two
definitions of ``train``; the frontend instead replaces the earlier cell's definition (found by its text,
``was``) and writes the failing cell without it. Pure: text in, text out.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

# The comment a rewrite puts above the functions it redefined ("... written by %%gpumem").
_NOTE = "written by %%gpumem"


@dataclass(frozen=True)
class Redefined:
    """A notebook function the fix rewrote: ``was`` its text as the notebook holds it (None when unknown),
    ``now`` the rewritten definition."""

    name: str
    was: str | None
    now: str

    def to_json(self) -> dict:
        return {"name": self.name, "was": self.was, "now": self.now}


@dataclass(frozen=True)
class CellWrite:
    """The failing cell's body without the redefined functions, and those functions."""

    body: str
    functions: tuple[Redefined, ...] = ()

    def to_json(self) -> dict:
        return {"body": self.body, "functions": [f.to_json() for f in self.functions]}


def cell_write(source: str, original: str, helpers: tuple[tuple[str, str], ...]) -> CellWrite:
    """Split ``source`` (what the fixed run ran) into the cell's body and the definitions of ``helpers``
    (``(name, text)`` of the notebook functions the cell calls, as first read) that it redefined on top.
    A function the cell as written (``original``) defines itself stays in the body."""
    known = dict(helpers)
    try:
        tree = ast.parse(source)
        own = {
            n.name for n in ast.parse(original).body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)
        }
    except SyntaxError:  # an IPython-only line (!cmd, %magic): the cell is written whole
        return CellWrite(source)
    lines = source.splitlines(keepends=True)
    taken: list[tuple[int, int]] = []
    functions: list[Redefined] = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if node.name not in known or node.name in own:
            continue
        first = min([node.lineno, *(d.lineno for d in node.decorator_list)]) - 1
        last = node.end_lineno or node.lineno
        functions.append(Redefined(node.name, known[node.name], "".join(lines[first:last]).rstrip()))
        taken.append((first, last))
    if not functions:
        return CellWrite(source)
    kept = [line for i, line in enumerate(lines) if not any(a <= i < b for a, b in taken)]
    # The rewrite's note about the functions goes with them: the body is the cell as the person wrote it.
    kept = [line for line in kept if not (line.lstrip().startswith("#") and _NOTE in line)]
    body = "".join(kept).strip("\n")
    return CellWrite(body, tuple(functions))
