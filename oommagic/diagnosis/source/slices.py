"""How many rows a slice of a tensor takes: the batch of a step written as slice arithmetic
(``stream[it * mb:(it + 1) * mb]``, ``X[i:i + b]``, ``corpus[pos:pos + window]``, ``randperm(n)[:b]``).

Pure (``ast`` only).
"""

from __future__ import annotations

import ast

from .parse import int_literal

_MOVES = frozenset({"to", "cuda", "float", "half", "bfloat16", "contiguous", "pin_memory", "long"})


def rows_taken(value: ast.expr, indexes: dict[str, ast.expr]) -> ast.expr | None:
    """The expression that says how many rows ``value`` takes from a tensor by slicing its first dimension:
    ``mb`` of ``stream[it * mb:(it + 1) * mb].to(device)``, ``b`` of ``X[i:i + b]`` and of
    ``torch.randperm(n)[:b]``; through an index tensor (``X[idx]``) whose own size ``indexes`` holds (the
    names bound in the step to such slices, each with its size). None for anything else (a column slice
    ``x[:, :-1]``, a negative or open end, a row picked by a number)."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _MOVES:
        value = value.func.value
    if not isinstance(value, ast.Subscript):
        return None
    key = value.slice
    if isinstance(key, ast.Tuple):
        if not key.elts:
            return None
        key = key.elts[0]
    if isinstance(key, ast.Name):
        return indexes.get(key.id)
    if isinstance(key, ast.Subscript):
        return rows_taken(key, indexes)
    if not isinstance(key, ast.Slice) or key.step is not None or key.upper is None:
        return None
    return _width(key.lower, key.upper)


def _width(lower: ast.expr | None, upper: ast.expr) -> ast.expr | None:
    """``upper - lower`` where it is a term of the source: ``b`` for ``:b``, ``i:i + b``, ``i:b + i``,
    ``i * b:(i + 1) * b``; a positive literal or a name or attribute/key chain only."""
    if lower is None or int_literal(lower) == 0:
        return upper if _size_like(upper) else None
    if isinstance(upper, ast.BinOp) and isinstance(upper.op, ast.Add):
        for term, other in ((upper.right, upper.left), (upper.left, upper.right)):
            if _same(other, lower) and _size_like(term):
                return term
    # `i * b:(i + 1) * b` (either factor order)
    for index, size in _factors(lower):
        for step, same in _factors(upper):
            nxt = (
                isinstance(step, ast.BinOp) and isinstance(step.op, ast.Add) and int_literal(step.right) == 1
            )
            if nxt and _same(same, size) and _same(step.left, index) and _size_like(size):
                return size
    return None


def _factors(node: ast.expr) -> list[tuple[ast.expr, ast.expr]]:
    """Both readings (index, size) of a product ``a * b``; none for anything else."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult)):
        return []
    return [(node.left, node.right), (node.right, node.left)]


def _same(a: ast.expr, b: ast.expr) -> bool:
    return ast.dump(a) == ast.dump(b)


def _size_like(node: ast.expr) -> bool:
    value = int_literal(node)
    if value is not None:
        return value >= 1
    while isinstance(node, (ast.Attribute, ast.Subscript)):
        if isinstance(node, ast.Subscript) and not isinstance(node.slice, ast.Constant):
            return False
        node = node.value
    return isinstance(node, ast.Name)
