"""Where the cell's batch size lives: a literal bound to a batch-size name, a setting read from an object,
a loop's literal step, the first dimension of data made in the loop; and its accumulation setting.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass

from .parse import IDENTIFIER, binding_sites, dotted_name, int_literal, tree_of

# Most specific first: a TrainingArguments keyword beats a loose `bs`; `batch` is usually the batch itself
# (`for batch in loader`), so it only counts when nothing else is found.
BATCH_NAMES = (
    "per_device_train_batch_size",
    "train_batch_size",
    "micro_batch_size",
    "batch_size",
    "BATCH_SIZE",
    "bsz",
    "bs",
    "BS",
    "BATCH",
    "batch",
)


ACCUMULATION_NAMES = (
    "gradient_accumulation_steps",
    "grad_accum_steps",
    "accumulation_steps",
    "accum_steps",
    "grad_accum",
)


_TOKENIZER = re.compile(r"(\w*_)?(tokenizer|tok|processor)", re.IGNORECASE)


@dataclass(frozen=True)
class BatchGuess:
    """Where the cell's batch size lives.

    ``where`` is ``"source"`` (an int literal in the cell: a rewrite can change it), ``"namespace"`` (the cell
    reads a variable that holds it), ``"option"`` (the name came from ``--batch NAME``, the value from the
    namespace) or ``"attribute"`` (a setting of an object the cell uses, ``trainer.args.
    per_device_train_batch_size``: ``name`` is that dotted path, ``accumulation`` the path and value of the
    object's accumulation setting, ``mirrors`` other settings that copy the batch (path, value), e.g. the
    Trainer's ``_train_batch_size``, fixed when it was made), ``"expression"`` (the cell reads it from an
    object, ``cfg.batch_size`` or ``S["batch"]``: ``path`` is its chain, a rewrite writes the number in its
    place), ``"step"`` (a loop over slices with a literal step, ``range(0, n, 128)`` and ``x[i:i + 128]``) or
    ``"shape"`` (the first dimension of the data a loop makes, ``torch.randn(64, 3, 224, 224)``) or
    ``"loader"`` (the ``batch_size`` of a DataLoader made earlier that the loop iterates: ``path`` names it)
    or ``"object"`` (an int setting named like a batch of an object of the namespace the cell hands to a
    call, ``dm.batch_size`` of ``trainer.fit(model, datamodule=dm)``: ``path`` is (object, attribute), a
    rewrite sets it at the top of the cell) or ``"call"`` (the default of a parameter of a notebook
    function the cell calls without it, ``def train(model, bs=128)`` and ``train(enc)``: ``path`` is
    (function, parameter), a rewrite passes the new number to the call).
    """

    name: str
    value: int
    where: str = "source"
    accumulation: tuple[str, int] | None = None
    mirrors: tuple[tuple[str, int], ...] = ()
    path: tuple[str, ...] = ()


def _loads(tree: ast.Module | None, source: str) -> list[str]:
    """Names the cell reads, in source order (every identifier when the cell does not parse)."""
    if tree is None:
        return IDENTIFIER.findall(source)
    loads = [n for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
    return [n.id for n in sorted(loads, key=lambda n: (n.lineno, n.col_offset))]


def find_batch(
    source: str, namespace_names: dict[str, int] | None = None, name: str | None = None
) -> BatchGuess | None:
    """Find the cell's batch size: an int literal bound to a batch-size name (or to ``name``) by an
    assignment, a keyword argument or a dict entry; else such a name the cell reads whose value in
    ``namespace_names`` is an int. None when neither is there."""
    namespace_names = namespace_names or {}
    tree = tree_of(source)
    sites = binding_sites(tree) if tree is not None else []
    for wanted in (name,) if name else BATCH_NAMES:
        for site in sites:
            value = int_literal(site.value)
            if site.name == wanted and value is not None and value >= 1:
                return BatchGuess(site.name, value, "source")
    if name:
        value = namespace_names.get(name)
        return BatchGuess(name, value, "option") if _is_count(value) else None
    # `for i in range(0, len(docs), B)` slicing `docs[i:i + B]`: the loop's step is the batch whatever its
    # name, bound in the cell or read from the namespace.
    stepping = _stepping_names(tree) if tree is not None else set()
    for site in sites:
        value = int_literal(site.value)
        if site.name in stepping and value is not None and value >= 2:
            return BatchGuess(site.name, value, "source")
    # `DataLoader(ds, batch_size=n)`: the variable behind a batch keyword counts whatever its name.
    behind = {s.value.id for s in sites if s.name in BATCH_NAMES and isinstance(s.value, ast.Name)}
    behind |= stepping
    for names in ({*BATCH_NAMES[:-1], *behind}, set(BATCH_NAMES[-1:])):
        for ref in _loads(tree, source):
            if ref in names and _is_count(namespace_names.get(ref)):
                return BatchGuess(ref, namespace_names[ref], "namespace")
    return None


def batch_expressions(source: str) -> tuple[tuple[str, ...], ...]:
    """The batch settings the cell reads from an object: ``cfg.batch_size``, ``S["batch"]``,
    ``config.train.bs`` — an attribute or string key named like a batch size, on a chain rooted at a name.
    Each as its path (``("S", "batch")``), in source order."""
    tree = tree_of(source)
    if tree is None:
        return ()
    found: list[tuple[str, ...]] = []
    for node in sorted(
        (n for n in ast.walk(tree) if isinstance(n, (ast.Attribute, ast.Subscript))),
        key=lambda n: (n.lineno, n.col_offset),
    ):
        if not isinstance(getattr(node, "ctx", None), ast.Load):
            continue
        path = _path_of(node)
        if path and len(path) >= 2 and path[-1] in BATCH_NAMES and path not in found:
            found.append(path)
    return tuple(found)


def _path_of(node: ast.expr) -> tuple[str, ...] | None:
    """``("cfg", "train", "batch_size")`` for ``cfg.train["batch_size"]``; None for anything else."""
    parts: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Subscript):
            key = node.slice
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                return None
            parts.append(key.value)
            node = node.value
        elif isinstance(node, ast.Name):
            parts.append(node.id)
            return tuple(reversed(parts))
        else:
            return None


def expression_nodes(tree: ast.Module, path: tuple[str, ...]) -> list[ast.expr]:
    """The loads of ``path`` (see ``batch_expressions``) in ``tree``."""
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.Attribute, ast.Subscript))
        and isinstance(getattr(n, "ctx", None), ast.Load)
        and _path_of(n) == path
    ]


def _range_loops(tree: ast.Module) -> Iterator[tuple[ast.For | ast.AsyncFor, str, ast.expr]]:
    """The loops ``for i in range(start, stop, step)``: each with its index's name and its step."""
    for loop in ast.walk(tree):
        if not (isinstance(loop, (ast.For, ast.AsyncFor)) and isinstance(loop.target, ast.Name)):
            continue
        it = loop.iter
        if isinstance(it, ast.Call) and dotted_name(it.func) == "range" and len(it.args) == 3:
            yield loop, loop.target.id, it.args[2]


def _slice_ends(loop: ast.AST, index: str) -> Iterator[ast.expr]:
    """The terms added to ``index`` at the end of the slices ``x[index:index + n]`` inside ``loop``."""
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Slice) and isinstance(node.lower, ast.Name) and node.lower.id == index):
            continue
        upper = node.upper
        if isinstance(upper, ast.BinOp) and isinstance(upper.op, ast.Add):
            yield from (upper.left, upper.right)


def step_batch(source: str) -> BatchGuess | None:
    """The batch of a loop over slices written with a literal: ``for i in range(0, len(X), 128)`` whose
    body slices ``X[i:i + 128]``. Named by the loop's ``range(...)``."""
    tree = tree_of(source)
    if tree is None:
        return None
    for loop, index, end in _range_loops(tree):
        step = int_literal(end)
        if step is not None and step >= 2 and _step_slices(loop, index, step):
            return BatchGuess(f"range(…, {step})", step, "step")
    return None


def _stepping_names(tree: ast.Module) -> set[str]:
    """The names that step a ``range`` loop over slices: ``B`` of ``for i in range(0, n, B)`` whose body
    slices ``x[i:i + B]``."""
    return {
        end.id
        for loop, index, end in _range_loops(tree)
        if isinstance(end, ast.Name)
        and any(isinstance(e, ast.Name) and e.id == end.id for e in _slice_ends(loop, index))
    }


def _step_slices(loop: ast.AST, index: str, step: int) -> list[ast.expr]:
    """The literals ``step`` in the slices ``x[index:index + step]`` inside ``loop``."""
    return [e for e in _slice_ends(loop, index) if int_literal(e) == step]


def step_literals(source: str, step: int) -> list[ast.expr]:
    """Every literal of the batch ``step_batch`` found: the ``range`` step, the slices' ends and the first
    dimension of the data the loop makes beside them (a GAN's ``torch.randn(1024, 128)`` noise and
    ``torch.ones(1024, 1)`` labels for a ``real_data[i:i + 1024]`` batch)."""
    tree = tree_of(source)
    if tree is None:
        return []
    out: list[ast.expr] = []
    for loop, index, end in _range_loops(tree):
        slices = _step_slices(loop, index, step) if int_literal(end) == step else []
        if slices:
            sizes = [_leading_size(n) for n in ast.walk(loop) if isinstance(n, ast.Call)]
            out += [end, *slices, *(n for n in sizes if n is not None and int_literal(n) == step)]
    return out


_FACTORIES = frozenset({"randn", "rand", "randint", "zeros", "ones", "empty", "full", "normal", "randperm"})


def _leading_size(call: ast.Call, names: bool = False) -> ast.expr | None:
    """The node of the first dimension a torch factory call makes: ``64`` in ``torch.randn(64, 3)``,
    ``torch.zeros((64, 3))``, ``torch.randint(0, 10, (64,))`` or ``size=(64, 3)``; a literal only, or
    with ``names`` also a plain name (``torch.randn(N, 3)``)."""
    name = dotted_name(call.func)
    if not (name.startswith("torch.") and name.rsplit(".", 1)[-1] in _FACTORIES) or name == "torch.randperm":
        return None
    size = next((kw.value for kw in call.keywords if kw.arg == "size"), None)
    if size is None and call.args:
        if name.endswith("randint"):
            size = call.args[-1] if isinstance(call.args[-1], (ast.Tuple, ast.List)) else None
        elif name.endswith(("full", "normal")):
            size = call.args[0] if isinstance(call.args[0], (ast.Tuple, ast.List)) else None
        else:
            size = call.args[0]
    if isinstance(size, (ast.Tuple, ast.List)):
        size = size.elts[0] if size.elts else None
    if names and isinstance(size, ast.Name):
        return size
    return size if size is not None and int_literal(size) is not None else None


def shape_batch(source: str, namespace_names: dict[str, int] | None = None) -> BatchGuess | None:
    """The batch of a loop that makes its data in place: the first dimension of a torch factory call
    inside a loop, of 2 or more: a literal (``torch.randint(0, V, (64, 512))``; every such call with that
    first dimension makes the batch, inputs and labels alike), or a name the cell binds to a literal or
    the namespace holds (``torch.randn(N, 128)``: that name is the batch, whatever it is called)."""
    tree = tree_of(source)
    if tree is None:
        return None
    namespace_names = namespace_names or {}
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.AsyncFor, ast.While)):
            continue
        for node in ast.walk(loop):
            if not isinstance(node, ast.Call):
                continue
            size = _leading_size(node, names=True)
            if isinstance(size, ast.Name):
                bound = [int_literal(b.value) for b in binding_sites(tree) if b.name == size.id]
                if len(bound) == 1 and bound[0] is not None and bound[0] >= 2:
                    return BatchGuess(size.id, bound[0], "source")
                value = namespace_names.get(size.id)
                if not bound and _is_count(value) and value >= 2:
                    return BatchGuess(size.id, value, "namespace")
                continue
            value = int_literal(size) if size is not None else None
            if value is not None and value >= 2:
                return BatchGuess(f"the first dimension of {dotted_name(node.func)}(…)", value, "shape")
    return None


def shape_literals(source: str, value: int) -> list[ast.expr]:
    """Every first-dimension literal ``value`` of the cell's torch factory calls (see ``shape_batch``)."""
    tree = tree_of(source)
    if tree is None:
        return []
    sizes = [_leading_size(n) for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return [n for n in sizes if n is not None and int_literal(n) == value]


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 1


def tokenizer_calls(source: str) -> tuple[str, ...]:
    """The called names in the cell that look like tokenizer calls (``tokenizer(...)``,
    ``tok.batch_encode_plus(...)``, ``processor(...)``): where ``truncation=True`` belongs."""
    tree = tree_of(source)
    if tree is None:
        return ()
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = dotted_name(node.func)
        last = dotted.rsplit(".", 1)[-1]
        if _TOKENIZER.fullmatch(last) or (
            last in ("encode", "encode_plus", "batch_encode_plus", "apply_chat_template")
            and "." in dotted
            and _TOKENIZER.fullmatch(dotted.rsplit(".", 2)[-2])
        ):
            names.append(dotted)
    return tuple(dict.fromkeys(names))


def loop_batches(source: str) -> list[str]:
    """The names a training loop of the cell (a ``for`` whose body calls ``.backward()``) binds its batch
    to: those it assigns a tokenizer call's result (``ids = tokenizer(texts)``), then its target (``for
    batch in loader``)."""
    tree = tree_of(source)
    if tree is None:
        return []
    tokenizers = set(tokenizer_calls(source))
    found: list[str] = []
    for loop in ast.walk(tree):
        if not isinstance(loop, ast.For) or not any(
            isinstance(n, ast.Attribute) and n.attr == "backward" for n in ast.walk(loop)
        ):
            continue
        for stmt in loop.body:
            called = (
                dotted_name(stmt.value.func)
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Call)
                else ""
            )
            if called in tokenizers:
                found.extend(t.id for t in stmt.targets if isinstance(t, ast.Name))
        if isinstance(loop.target, ast.Name):
            found.append(loop.target.id)
    return list(dict.fromkeys(found))


def accumulation_name(source: str) -> str | None:
    """The gradient-accumulation setting the cell names, if any."""
    tree = tree_of(source)
    names = {s.name for s in binding_sites(tree)} | set(_loads(tree, source)) if tree is not None else set()
    return next((n for n in ACCUMULATION_NAMES if n in names), None)
