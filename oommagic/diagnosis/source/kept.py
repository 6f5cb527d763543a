"""What a loop keeps across its steps: lists appended to and running totals, with or without their
autograd graphs.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .parse import SourceText, dotted_name, int_literal, parents_of, signed_int_literal, tree_of

# A value kept in these forms holds no device memory and no graph.
_DETACHED = (".item()", ".tolist()", ".numpy()")


_NUMBER_CALLS = frozenset({"float", "int", "round", "len", "str", "bool"})


@dataclass(frozen=True)
class KeptSite:
    """A statement in a loop that keeps a value across iterations: ``line`` (1-based), the statement as
    written and as it could be (keeping a number or a detached CPU copy), the span of the value, and
    ``holder``: the name of the list or total that keeps it (``outs`` in ``outs.append(v)``), if a name."""

    line: int
    was: str
    now: str
    start: int
    end: int
    replacement: str
    holder: str | None = None
    later: tuple[tuple[int, int, str], ...] = ()  # edits after the loop: a reduction moved into it


def kept_sites(source: str, most: int = 3, ndims: dict[str, int] | None = None) -> list[KeptSite]:
    """Each ``xs.append(v)`` in a loop of the cell, and each ``total += v`` with a loss, where ``v`` may
    be a tensor: not already a number or a detached CPU copy. Where the cell only ever reads ``xs`` after
    the loop as ``torch.cat(xs)…argmax(-1)`` (``ndims``: the kept tensors' dimensions, by holder, for
    the indexing in between), each step keeps ``v.argmax(-1)`` and the reduction after the loop goes."""
    tree = tree_of(source)
    if tree is None:
        return []
    src = SourceText(source)
    parents = parents_of(tree)
    lines = source.split("\n")
    found: dict[tuple[int, int], KeptSite] = {}
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.AsyncFor, ast.While)):
            continue
        for node in ast.walk(loop):
            holder = None
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                one = node.func.attr == "append" and len(node.args) == 1 and not node.keywords
                value = node.args[0] if one else None
                holder = node.func.value.id if isinstance(node.func.value, ast.Name) else None
            elif isinstance(node, ast.AugAssign) and isinstance(node.op, ast.Add):
                value = node.value
                holder = node.target.id if isinstance(node.target, ast.Name) else None
                if "loss" not in (src.segment(node) or ""):
                    value = None
            else:
                value = None
            if value is None or value.lineno != value.end_lineno or not _may_be_tensor(src, value):
                continue
            start, end = src.span(value)
            text = source[start:end]
            new, later = _detached(text), ()
            if holder is not None and isinstance(node, ast.Call) and "loss" not in text.lower():
                reduced = _reduced_after(tree, src, parents, loop, holder, (ndims or {}).get(holder))
                if reduced is not None:
                    new, later = text.removesuffix(".detach()") + reduced[0], reduced[1]
            line = lines[value.lineno - 1]
            line_start = src.starts[value.lineno - 1]
            now = line[: start - line_start] + new + line[end - line_start :]
            found.setdefault(
                (value.lineno, value.col_offset),
                KeptSite(value.lineno, line.strip(), now.strip(), start, end, new, holder, later),
            )
    return [found[k] for k in sorted(found)][:most]


_LAST_DIM_REDUCTIONS = frozenset({"argmax", "argmin"})


def _reduced_after(
    tree: ast.Module,
    src: SourceText,
    parents: dict[ast.AST, ast.AST],
    loop: ast.stmt,
    holder: str,
    ndim: int | None,
) -> tuple[str, tuple[tuple[int, int, str], ...]] | None:
    """``(".argmax(-1)", edits)`` where every read of ``holder`` outside ``loop`` comes after it and is
    ``torch.cat(holder)`` (or ``stack``, along dim 0), indexed only in dimensions before the last, then
    reduced along the last one (``-1``, or its index) by one same ``argmax``/``argmin``, which is not the
    dimension they are joined along: the reduction commutes with all of that, so each step can keep the
    reduced tensor. ``ndim``: the kept tensors' dimensions (None: not known, and nothing moves).
    ``edits`` take the reduction out of those reads."""
    end = loop.end_lineno or loop.lineno
    inside = {id(n) for n in ast.walk(loop)}
    reads = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Name) and n.id == holder and isinstance(n.ctx, ast.Load) and id(n) not in inside
    ]
    if not reads or any(n.lineno <= end for n in reads):
        return None
    method, edits = None, []
    for name in reads:
        call = parents.get(name)
        if not (
            isinstance(call, ast.Call)
            and dotted_name(call.func).rsplit(".", 1)[-1] in ("cat", "concat", "concatenate", "stack")
            and call.args
            and call.args[0] is name
            and all(int_literal(a) == 0 for a in call.args[1:])
            and all(k.arg in ("dim", "axis") and int_literal(k.value) == 0 for k in call.keywords)
        ):
            return None
        stacked = dotted_name(call.func).endswith("stack")
        if ndim is None or ndim < (1 if stacked else 2):
            return None  # 1-D pieces joined by `cat`: their last dimension is the one joined
        dims = ndim + stacked
        cur = call
        while isinstance(parents.get(cur), ast.Subscript) and parents[cur].value is cur:
            index = parents[cur].slice
            elts = index.elts if isinstance(index, ast.Tuple) else [index]
            # Slices keep a dimension, an integer index drops one; anything else (`...`, `None`, a tensor)
            # may reach or move the last dimension.
            plain = all(isinstance(e, ast.Slice) or signed_int_literal(e) is not None for e in elts)
            if not plain or len(elts) >= dims:
                return None
            dims -= sum(1 for e in elts if not isinstance(e, ast.Slice))
            cur = parents[cur]
        attr, outer = parents.get(cur), None
        if isinstance(attr, ast.Attribute) and attr.value is cur and attr.attr in _LAST_DIM_REDUCTIONS:
            outer, reduction = parents.get(attr), attr.attr
            ok = isinstance(outer, ast.Call) and outer.func is attr
            ok = ok and _last_dim_only(outer.args, outer.keywords, dims)
        elif isinstance(attr, ast.Call) and attr.args and attr.args[0] is cur:
            outer, reduction = attr, dotted_name(attr.func).rsplit(".", 1)[-1]
            ok = reduction in _LAST_DIM_REDUCTIONS and dotted_name(attr.func).startswith("torch.")
            ok = ok and _last_dim_only(attr.args[1:], attr.keywords, dims)
        else:
            ok = False
        if not ok or method not in (None, reduction):
            return None
        method = reduction
        start, stop = src.span(outer)
        edits.append((start, stop, src.segment(cur)))
    return f".{method}(-1)", tuple(edits)


def _last_dim_only(args: list[ast.expr], keywords: list[ast.keyword], dims: int) -> bool:
    """The arguments of a reduction are just the last of ``dims`` dimensions: ``(-1)``, ``(dim=-1)``, or
    ``(1)`` / ``(dim=1)`` of a 2-D tensor."""
    given = [*args, *(k.value for k in keywords if k.arg == "dim")]
    if len(given) != 1 or len(args) + len(keywords) != 1:
        return False
    dim = signed_int_literal(given[0])
    return dim in (-1, dims - 1)


def _may_be_tensor(src: SourceText, value: ast.expr) -> bool:
    if not isinstance(value, (ast.Name, ast.Attribute, ast.Subscript, ast.Call)):
        return False
    if isinstance(value, ast.Call) and isinstance(value.func, ast.Name) and value.func.id in _NUMBER_CALLS:
        return False
    text = src.segment(value) or ""
    return not (any(d in text for d in _DETACHED) or (".detach()" in text and ".cpu()" in text))


def _detached(text: str) -> str:
    """`loss` → `loss.item()`; `logits` → `logits.detach().cpu()`."""
    for tail in (".detach()", ".cpu()"):
        text = text.removesuffix(tail)
    return text + (".item()" if "loss" in text.lower() else ".detach().cpu()")
