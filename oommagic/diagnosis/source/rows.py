"""Expressions computed row by row from a whole tensor (a model called without autograd, a product or a
distance and the reductions after it), which can run on chunks of their rows.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from .parse import MODEL_INPUTS, SourceText, dotted_name, int_literal, signed_int_literal, tree_of

# Calls autocast runs in a lower precision: matrix products and convolutions (torch's autocast op lists).
_PRODUCTS = frozenset({"matmul", "mm", "bmm", "addmm", "baddbmm", "einsum", "linear", "conv1d", "conv2d"})
_PRODUCTS |= {"conv3d", "tensordot", "inner", "outer", "mv", "addbmm"}


def products_at(source: str, line: int | None) -> bool:
    """Whether the statement on ``line`` computes a matrix product or a convolution itself: ``a @ b``,
    ``torch.matmul(a, b)``, ``F.linear(x, w)``, ``torch.einsum(...)``."""
    tree = tree_of(source)
    if tree is None or not line:
        return False
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt) or not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.While)):
            continue  # the statement inside it is the one that failed
        for sub in ast.walk(node):
            if isinstance(sub, ast.BinOp) and isinstance(sub.op, ast.MatMult):
                return True
            if isinstance(sub, ast.Call) and dotted_name(sub.func).rsplit(".", 1)[-1] in _PRODUCTS:
                return True
    return False


# Reductions and maps that keep rows apart when they run along another dimension (``dim=1``); those
# returning (values, indices) are read through ``.values`` / ``.indices`` / ``[0]`` / ``[1]``.
_ROW_REDUCTIONS = frozenset(
    {"argmin", "argmax", "sum", "mean", "amax", "amin", "logsumexp", "norm", "std", "var", "softmax"}
    | {"log_softmax", "normalize", "cumsum", "argsort", "all", "any", "topk", "max", "min", "sort"}
    | {"kthvalue"}
)


_PAIRS = frozenset({"topk", "max", "min", "sort", "kthvalue"})


_OUTPUT_FIELDS = ("last_hidden_state", "logits", "pooler_output", "image_embeds", "text_embeds")


_ROW_MAPS = frozenset({"float", "half", "bfloat16", "double", "exp", "log", "sigmoid", "relu", "abs"})
_ROW_MAPS |= {"sqrt", "cpu", "detach", "clone", "neg", "tanh", "to", "int", "long"}


# Functions whose first argument's rows make the output's rows: products with a second operand.
ROW_PRODUCTS = frozenset({"cdist", "matmul", "mm", "linear"})


@dataclass(frozen=True)
class RowWise:
    """An expression computed row by row from the rows of one name (``arg``): ``spine`` is that name's
    node in it, ``product`` whether it multiplies by something (a matrix, a model's layers: what makes the
    memory), ``fields`` what it is read through where it is no tensor yet (a (values, indices) pair, a
    transformers model's output), ``module`` the callee where a model is called on it."""

    spine: ast.Name
    product: bool
    fields: tuple[str, ...] = ()
    module: str | None = None
    # The name is a dict of tensors splatted into the model (``bert(**enc)``): its every value is cut.
    splat: bool = False

    @property
    def pair(self) -> bool:
        """Whether it is no tensor yet: a (values, indices) pair, a model's output object, read through
        one of ``fields`` (or ``[0]``)."""
        return bool(self.fields)


# Reductions whose ``dim`` defaults to the last one (``dist.topk(5)``): along the rows' other dimension.
_LAST_DIM = frozenset({"topk", "kthvalue", "sort", "argsort"})


def _dim_of(call: ast.Call, position: int) -> int | None:
    """The int ``dim`` a call passes, by keyword or at ``position``; -1 where it passes none and the
    function's default is the last dimension; None otherwise."""
    for k in call.keywords:
        if k.arg == "dim":
            return signed_int_literal(k.value)
    if len(call.args) > position:
        return signed_int_literal(call.args[position])
    name = dotted_name(call.func).rsplit(".", 1)[-1]
    return -1 if name in _LAST_DIM else None


def row_wise(node: ast.expr, modules: frozenset[str] = frozenset()) -> RowWise | None:
    """Whether ``node`` computes its rows from the rows of one name alone, following its first operand:
    ``X @ W``, ``torch.cdist(X, Y)``, ``model(X)`` (``model`` in ``modules``), then maps and reductions
    along another dimension (``.argmin(dim=1)``, ``.topk(5, dim=1).indices``, ``.softmax(-1)``). Rows of
    a chunk then are rows of the whole; the other operands are used whole."""
    if isinstance(node, ast.Name):
        return RowWise(node, product=False)
    if isinstance(node, ast.BinOp):
        inner = row_wise(node.left, modules)
        if inner is None or inner.pair:
            return None
        if isinstance(node.op, ast.MatMult):
            return RowWise(inner.spine, True, module=inner.module)
        scalar = isinstance(node.right, ast.Constant) and isinstance(node.right.value, (int, float))
        arithmetic = isinstance(node.op, (ast.Mult, ast.Div, ast.Add, ast.Sub, ast.Pow))
        return inner if scalar and arithmetic else None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return row_wise(node.operand, modules)
    if isinstance(node, ast.Attribute):
        inner = row_wise(node.value, modules)
        read = inner is not None and node.attr in inner.fields
        return RowWise(inner.spine, inner.product, module=inner.module, splat=inner.splat) if read else None
    if isinstance(node, ast.Subscript):
        inner = row_wise(node.value, modules)
        at = int_literal(node.slice)
        read = (
            inner is not None
            and inner.pair
            and at is not None
            and at < (2 if "indices" in inner.fields else 1)
        )
        return RowWise(inner.spine, inner.product, module=inner.module, splat=inner.splat) if read else None
    if not isinstance(node, ast.Call):
        return None
    name = dotted_name(node.func)
    last = name.rsplit(".", 1)[-1]
    if name in modules and len(node.args) == 1 and all(k.arg is not None for k in node.keywords):
        inner = row_wise(node.args[0], modules)
        return RowWise(inner.spine, True, module=name) if inner and not inner.pair else None
    if (
        name in modules
        and not node.args
        and len(node.keywords) == 1
        and node.keywords[0].arg is None
        and isinstance(node.keywords[0].value, ast.Name)
    ):
        # A model called on a dict of tensors (a tokenizer's output, `bert(**enc)`): rows of each value.
        return RowWise(node.keywords[0].value, True, fields=_OUTPUT_FIELDS, module=name, splat=True)
    if name in modules and not node.args and len(node.keywords) == 1 and node.keywords[0].arg in MODEL_INPUTS:
        # A transformers model called on its one input by keyword (`enc(input_ids=ids)`); its output is
        # read through a tensor field (`.last_hidden_state`), which ``_OUTPUT_FIELDS`` lets through.
        inner = row_wise(node.keywords[0].value, modules)
        found = inner is not None and not inner.pair
        return RowWise(inner.spine, True, fields=_OUTPUT_FIELDS, module=name) if found else None
    if isinstance(node.func, ast.Attribute) and not isinstance(node.func.value, ast.Name | ast.Attribute):
        method_of = node.func.value  # `(X @ W).argmin(dim=1)`: a method of an expression
    elif isinstance(node.func, ast.Attribute) and name.split(".", 1)[0] not in ("torch", "F", "nn"):
        method_of = node.func.value  # `X.softmax(dim=1)`
    else:
        method_of = None
    if method_of is not None:
        inner = row_wise(method_of, modules)
        if inner is None or inner.pair:
            return None
        if last in _ROW_MAPS:
            return inner
        if last in _ROW_REDUCTIONS:
            dim = _dim_of(node, 1 if last in ("topk", "kthvalue") else 0)
            if dim is not None and dim != 0:
                fields = ("values", "indices") if last in _PAIRS else ()
                return RowWise(
                    inner.spine, inner.product, fields=fields, module=inner.module, splat=inner.splat
                )
        return None
    if not node.args:
        return None
    inner = row_wise(node.args[0], modules)
    if inner is None or inner.pair:
        return None
    if last in ROW_PRODUCTS:
        return RowWise(inner.spine, True, module=inner.module)
    if last in ("softmax", "log_softmax", "normalize"):
        dim = _dim_of(node, 1)
        return inner if dim is not None and dim != 0 else None
    return None


def calls_only(expression: str, func: str) -> bool:
    """Whether ``expression`` is one call of ``func`` (``model(X, return_dict=False)``), nothing after."""
    tree = tree_of(expression)
    if tree is None or len(tree.body) != 1 or not isinstance(tree.body[0], ast.Expr):
        return False
    node = tree.body[0].value
    return isinstance(node, ast.Call) and dotted_name(node.func) == func


def rows_expression(source: str, line: int, modules: frozenset[str] = frozenset()) -> ast.expr | None:
    """The outermost expression on ``line`` computed row by row from one name's rows with a product in
    it (``row_wise``): what can run a chunk of rows at a time and be joined."""
    tree = tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.expr) and node.lineno <= line <= (node.end_lineno or node.lineno)):
            continue
        found = row_wise(node, modules)
        if found is not None and found.product and not found.pair and node is not found.spine:
            return node
    return None


def inlined_product(
    source: str, line: int | None = None, name: str = "", modules: frozenset[str] = frozenset()
) -> tuple[str, str, int] | None:
    """``(source, name, line)``: the cell with a whole product or a model's output (``modules``) bound to a
    name and read once (``dist = torch.cdist(Q, K)``, then ``nearest = dist.topk(5, largest=False).indices``;
    ``out = bert(**enc)``, then ``vecs = out.last_hidden_state.mean(dim=1)``) written into
    the one expression that reads it, the binding gone: the product then runs on chunks of rows with the
    reduction after it, and only the reduced rows are joined (a product kept whole is as large joined as
    it was). The binding is the statement on ``line``, or the one binding ``name``; the name must be read
    by one later statement of its block, once, and never bound again in the cell; the line returned is
    the read's in the new source. None otherwise."""
    tree = tree_of(source)
    if tree is None:
        return None
    for block in _blocks(tree):
        for i, stmt in enumerate(block):
            if not (
                isinstance(stmt, ast.Assign)
                and len(stmt.targets) == 1
                and isinstance(stmt.targets[0], ast.Name)
                and (name == stmt.targets[0].id if name else stmt.lineno <= (line or 0) <= stmt.end_lineno)
            ):
                continue
            target = stmt.targets[0].id
            found = row_wise(stmt.value, modules)
            if found is None or not found.product or found.spine is stmt.value:
                return None
            reads = [
                (j, n)
                for j, later in enumerate(block[i + 1 :], i + 1)
                for n in ast.walk(later)
                if isinstance(n, ast.Name) and n.id == target
            ]
            stores = [
                n
                for n in ast.walk(tree)
                if isinstance(n, ast.Name) and n.id == target and isinstance(n.ctx, ast.Store)
            ]
            if len(reads) != 1 or len(stores) != 1 or not isinstance(reads[0][1].ctx, ast.Load):
                return None
            src = SourceText(source)
            product = src.segment(stmt.value)
            at, to = src.span(reads[0][1])
            start = src.offset(stmt.lineno, 0)
            end = src.offset(stmt.end_lineno, stmt.end_col_offset)
            end += 1 if source[end : end + 1] == "\n" else 0
            atomic = isinstance(stmt.value, ast.Call | ast.Attribute | ast.Name | ast.Subscript)
            text = source[:at] + (product if atomic else f"({product})") + source[to:]
            read_line = reads[0][1].lineno - (stmt.end_lineno - stmt.lineno + 1)
            return text[:start] + text[end:], target, read_line
    return None


def _blocks(tree: ast.AST):
    """Every statement list of the tree (the module's body, loops', branches', functions')."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.stmt):
                yield block
