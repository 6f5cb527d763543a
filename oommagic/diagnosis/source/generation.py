"""Generation: whether the cell generates, the inputs ``generate`` gets, and the logits a loss or a
sampler reads only at the last position.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast

from .parse import called_names, dotted_name, parents_of, signed_int_literal, tree_of


def generates(source: str) -> bool:
    """Whether the cell calls ``.generate(...)`` or builds a ``pipeline(...)``."""
    return any(d.rsplit(".", 1)[-1] in ("generate", "pipeline") for d in called_names(source))


def generate_inputs(source: str) -> list[tuple[str, str | None]]:
    """(name, key) of the inputs of the cell's first ``.generate(...)``: its first argument or its
    ``input_ids=``/``inputs=`` (key None), or ``**encoding`` (key ``"input_ids"``). Names only: the caller
    looks them up."""
    tree = tree_of(source)
    if tree is None:
        return []
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "generate"
    ]
    if not calls:
        return []
    node = min(calls, key=lambda c: (c.lineno, c.col_offset))
    given = [*node.args[:1], *(k.value for k in node.keywords if k.arg in ("input_ids", "inputs"))]
    spread = [k.value for k in node.keywords if k.arg is None]
    pairs = [(e, None) for e in given] + [(e, "input_ids") for e in spread]
    return [(e.id, key) for e, key in pairs if isinstance(e, ast.Name)]


def last_logits_calls(source: str) -> tuple[str, ...]:
    """The called names (``model``) of the calls whose logits the cell reads only at the last position:
    ``model(ids).logits[:, -1]``, ``out = model(ids)`` with every ``out.logits`` read as
    ``out.logits[:, -1]``, or ``logits = model(ids).logits`` with every ``logits`` read as ``logits[:, -1]``.
    A name also called where all its logits are read is left out."""
    tree = tree_of(source)
    if tree is None:
        return ()
    parents = parents_of(tree)
    assigned: dict[str, list[ast.Call]] = {}
    for node in ast.walk(tree):
        one = isinstance(node, ast.Assign) and len(node.targets) == 1
        if one and isinstance(node.value, ast.Call) and isinstance(node.targets[0], ast.Name):
            assigned.setdefault(node.targets[0].id, []).append(node.value)
    reads: dict[int, list[ast.expr]] = {}  # id(call) -> the expressions that read its result
    for name, calls in assigned.items():
        loads = [
            n
            for n in ast.walk(tree)
            if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
        ]
        for call in calls:
            reads[id(call)] = loads
    good: dict[str, bool] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = dotted_name(node.func)
        uses = reads.get(id(node), [node])
        logits = [parents.get(u) for u in uses]
        if not any(isinstance(p, ast.Attribute) and p.attr == "logits" for p in logits):
            continue  # its logits are not read here (or not through `.logits`)
        last = all(
            isinstance(p, ast.Attribute) and p.attr == "logits" and _read_last(p, parents, tree)
            for p in logits
        )
        good[dotted] = good.get(dotted, True) and last and "?" not in dotted
    return tuple(name for name, ok in good.items() if ok)


def _read_last(logits: ast.Attribute, parents: dict, tree: ast.Module) -> bool:
    """Whether ``….logits`` is read only at the last position: subscripted so where it stands, or bound
    by ``logits = model(ids).logits`` to a name that every later read subscripts so."""
    if _last_position(parents.get(logits), logits):
        return True
    bind = parents.get(logits)
    if not (
        isinstance(bind, ast.Assign) and len(bind.targets) == 1 and isinstance(bind.targets[0], ast.Name)
    ):
        return False
    name = bind.targets[0].id
    loads = [
        n for n in ast.walk(tree) if isinstance(n, ast.Name) and n.id == name and isinstance(n.ctx, ast.Load)
    ]
    return bool(loads) and all(_last_position(parents.get(n), n) for n in loads)


def _last_position(node: ast.AST | None, value: ast.AST) -> bool:
    """Whether ``node`` subscripts ``value`` at the last position of its second dimension:
    ``[:, -1]``, ``[:, -1, :]``, ``[:, -1:]``, ``[0, -1]``."""
    if (
        not isinstance(node, ast.Subscript)
        or node.value is not value
        or not isinstance(node.slice, ast.Tuple)
    ):
        return False
    elts = node.slice.elts
    if len(elts) < 2:
        return False
    second = elts[1]
    if isinstance(second, ast.Slice):
        return second.upper is None and second.step is None and signed_int_literal(second.lower) == -1
    return signed_int_literal(second) == -1
