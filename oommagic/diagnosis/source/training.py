"""What the training step of the cell is: whether it trains, its optimizer calls, and a step on whole
tensors (full-batch training) that can run on micro-batches.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .parse import MODEL_INPUTS, called_names, contains, dotted_name, passes_true, tree_of
from .slices import rows_taken


@dataclass(frozen=True)
class WholeStep:
    """A training step of the cell that reads tensors of the namespace whole (``loss_fn(model(X), y)``,
    then ``loss.backward()``): the place a step on micro-batches of their rows is written.

    ``block`` is the statement list holding the backward pass (the innermost loop's body, or the cell's),
    ``last`` the index of the statement with it. ``inputs`` are the names read whole up to there (never
    sliced, called or bound by the cell other than moved: ``X = X.to(device)``), each with the index of
    the first statement reading it, in source order; ``fed`` the (callee, input) pairs where an input is a
    call's first argument or its ``input_ids=`` (or another model input's keyword), in source order: the
    model's input among them. Where the step is in a function the cell defines and calls once (``def
    train(model, X, y): ...`` and ``train(net, X_tr, y_tr)``), ``function`` names it, the inputs are its
    parameters and ``arguments`` maps each parameter to the name the call passes for it. ``sizes``: the
    inputs the step binds itself by slicing rows off a tensor (``chunk = stream[it * mb:(it + 1) * mb]``,
    ``x, y = X[idx], Y[idx]`` with ``idx = torch.randperm(n)[:b]``), each with the expression of its rows
    (``mb``, ``b``): the step's batch comes from slice arithmetic."""

    block: tuple[ast.stmt, ...]
    last: int
    backward: ast.Call
    reads: tuple[tuple[str, int], ...]
    fed: tuple[tuple[str, str], ...]
    function: str = ""
    arguments: tuple[tuple[str, str], ...] = ()
    sizes: tuple[tuple[str, ast.expr], ...] = ()

    def outside(self, name: str) -> str:
        """The name of the cell's namespace an input or a callee stands for: for a training function of the
        cell, the name its call passes for that parameter (``X_train`` for ``X`` of ``train(net, X_train,
        y_train)``); the name itself otherwise."""
        first, dot, rest = name.partition(".")
        return dict(self.arguments).get(first, first) + dot + rest

    @property
    def inputs(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.reads)

    def span(self, names: tuple[str, ...]) -> tuple[int, tuple[ast.stmt, ...], tuple[ast.stmt, ...]] | None:
        """(first, before, after) of the statements a step on micro-batches of ``names`` loops over: from
        the first that reads one of them to the backward pass; ``before`` and ``after`` the optimizer's
        ``zero_grad()`` and ``step()`` among them, which stay outside the loop (once per step). None
        where such a call sits inside a block of those statements (it would run once per micro-batch)."""
        first = min((i for name, i in self.reads if name in names), default=None)
        if first is None:
            return None
        before, after = [], []
        for stmt in self.block[first : self.last + 1]:
            kind = _step_statement(stmt)
            if kind == "zero_grad":
                before.append(stmt)
            elif kind == "step":
                after.append(stmt)
            elif any(step_call(n) for n in ast.walk(stmt)):
                return None
        return first, tuple(before), tuple(after)


_STEP_CALLS = frozenset({"step", "zero_grad"})


_MOVES = frozenset({"to", "cuda", "float", "half", "bfloat16", "contiguous", "pin_memory"})


def whole_step(source: str) -> WholeStep | None:
    """The cell's one training step on whole tensors (``WholeStep``), or None: no backward pass, more than
    one, one inside a function other than a training function the cell defines and calls once, or no
    input read whole."""
    tree = tree_of(source)
    if tree is None:
        return None
    backs = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
    ]
    if len(backs) != 1:
        return None
    (back,) = backs
    block: list[ast.stmt] = tree.body
    function: ast.FunctionDef | None = None
    while True:
        holder = next(s for s in block if contains(s, back))
        call = _single_call(tree, holder.name) if isinstance(holder, ast.FunctionDef) else None
        if call is not None and block is tree.body:
            # A training function the cell defines and calls: its parameters are the step's inputs.
            function, block = holder, holder.body
            continue
        if isinstance(holder, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return None
        inner = _loop_holding(holder, back)
        if inner is None:
            break
        block = inner.body
    last = next(i for i, s in enumerate(block) if contains(s, back))
    bound = _bound_other_than_moved(tree, function)
    sizes, slicing = _sliced_rows(tree, block[:last])
    fed: list[tuple[int, int, str, str]] = []
    sliced: set[str] = set()
    called: set[str] = set()
    firsts: dict[str, tuple[int, int, int]] = {}
    for i, stmt in enumerate(block[: last + 1]):
        if _step_statement(stmt):
            continue  # what an optimizer's zero_grad() or step() reads is no input of the step
        for node in ast.walk(stmt):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                if node.value.id not in sizes or _takes_rows(node):
                    sliced.add(node.value.id)
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    called.add(node.func.id)
                moves = isinstance(node.func, ast.Attribute) and node.func.attr in _MOVES
                given = (
                    [] if moves else node.args[:1] + [k.value for k in node.keywords if k.arg in MODEL_INPUTS]
                )
                given = [_unmoved(a) for a in given]
                fed.extend(
                    (a.lineno, a.col_offset, dotted_name(node.func), a.id)
                    for a in given
                    if isinstance(a, ast.Name)
                )
            elif (
                isinstance(node, ast.Name)
                and isinstance(node.ctx, ast.Load)
                and (node.id not in bound or (node.id in sizes and i not in slicing))
            ):
                at = (i, node.lineno, node.col_offset)
                firsts[node.id] = min(firsts.get(node.id, at), at)
    # In the order the source reads them (a walk visits an outer call's arguments before inner ones).
    order = sorted(firsts, key=firsts.__getitem__)
    reads = tuple((n, firsts[n][0]) for n in order if n not in sliced and n not in called)
    if not reads:
        return None
    inputs = {n for n, _ in reads}
    feeds = tuple((func, name) for _, _, func, name in sorted(fed) if name in inputs and func)
    if function is not None:
        params = [a.arg for a in function.args.posonlyargs + function.args.args + function.args.kwonlyargs]
        reads = tuple((n, i) for n, i in reads if n in params)
        call = _single_call(tree, function.name)
        args = dict(zip(params, call.args, strict=False))
        args.update((k.arg, k.value) for k in call.keywords if k.arg)
        passed = {p: _unmoved(v).id for p, v in args.items() if isinstance(_unmoved(v), ast.Name)}
        if not reads:
            return None
        sized = tuple((n, sizes[n]) for n, _ in reads if n in sizes)
        return WholeStep(tuple(block), last, back, reads, feeds, function.name, tuple(passed.items()), sized)
    sized = tuple((n, sizes[n]) for n, _ in reads if n in sizes)
    return WholeStep(tuple(block), last, back, reads, feeds, sizes=sized)


def _sliced_rows(tree: ast.Module, block: list[ast.stmt]) -> tuple[dict[str, ast.expr], set[int]]:
    """The names ``block`` binds (once in the cell) to rows sliced off a tensor, each with the expression
    of its rows (``slices.rows_taken``), and the indexes of the statements that bind them."""
    stored: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            stored[node.id] = stored.get(node.id, 0) + 1
    sizes: dict[str, ast.expr] = {}
    binding: set[int] = set()
    for i, stmt in enumerate(block):
        if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1):
            continue
        target, value = stmt.targets[0], stmt.value
        pairs = (
            list(zip(target.elts, value.elts, strict=False))
            if isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple)
            else [(target, value)]
        )
        for t, v in pairs:
            size = rows_taken(v, sizes) if isinstance(t, ast.Name) else None
            if size is not None and stored.get(t.id) == 1:
                sizes[t.id] = size
                binding.add(i)
    return sizes, binding


def _takes_rows(node: ast.Subscript) -> bool:
    """Whether a subscript picks rows (``x[0]``, ``x[:8]``), not only later dimensions (``x[:, :-1]``)."""
    key = node.slice.elts[0] if isinstance(node.slice, ast.Tuple) and node.slice.elts else node.slice
    whole = isinstance(key, ast.Slice) and key.lower is None and key.upper is None and key.step is None
    return not whole


def _single_call(tree: ast.Module, name: str) -> ast.Call | None:
    """The cell's one call of ``name``, at its top level (``train(model, X, y)``), with no ``*`` or
    ``**``; None where it calls it otherwise or more than once."""
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == name
    ]
    if len(calls) != 1:
        return None
    (call,) = calls
    top = any(contains(s, call) and not isinstance(s, ast.FunctionDef) for s in tree.body)
    plain = not any(isinstance(a, ast.Starred) for a in call.args) and all(k.arg for k in call.keywords)
    return call if top and plain else None


def _loop_holding(stmt: ast.stmt, node: ast.AST) -> ast.For | ast.While | None:
    """The outermost loop within ``stmt`` (``stmt`` itself included, through ``if``/``with``/``try``
    blocks) whose body holds ``node``."""
    if isinstance(stmt, (ast.For, ast.AsyncFor, ast.While)):
        return stmt if any(contains(s, node) for s in stmt.body) else None
    if isinstance(stmt, (ast.If, ast.With, ast.AsyncWith, ast.Try)):
        for inner in (stmt.body, getattr(stmt, "orelse", []), getattr(stmt, "finalbody", [])):
            for s in inner:
                if contains(s, node):
                    return _loop_holding(s, node)
    return None


def step_call(call: ast.AST) -> str | None:
    """``"zero_grad"`` or ``"step"`` for an optimizer's (a scheduler's, a GradScaler's) call of it;
    ``scaler.update()`` counts as a step. None for anything else."""
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return None
    name = call.func.attr
    if name in _STEP_CALLS:
        return name
    owner = dotted_name(call.func.value).rsplit(".", 1)[-1].lower()
    return "step" if name == "update" and owner.endswith("scaler") else None


def _step_statement(stmt: ast.stmt) -> str | None:
    """``step_call`` of a statement that is only that call (``opt.step()``)."""
    return step_call(stmt.value) if isinstance(stmt, ast.Expr) else None


def _bound_other_than_moved(tree: ast.Module, function: ast.FunctionDef | None = None) -> set[str]:
    """Names the cell binds, less those it only rebinds to themselves moved or cast (``X = X.to(dev)``,
    ``X, y = X.cuda(), y.cuda()``): their rows are the rows they had; less the parameters of
    ``function``, which it binds to the call's arguments."""
    moves: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    pairs = list(zip(target.elts, node.value.elts, strict=False))
                else:
                    pairs = [(target, node.value)]
                moves.update(id(t) for t, v in pairs if isinstance(t, ast.Name) and _moved(v, t.id))
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load) and id(node) not in moves:
            bound.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg) and not (function is not None and contains(function.args, node)):
            bound.add(node.arg)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return bound


def _moved(value: ast.expr, name: str) -> bool:
    """Whether ``value`` is ``name`` through calls that keep its rows (``name.to(device).float()``)."""
    value = _unmoved(value)
    return isinstance(value, ast.Name) and value.id == name


def _unmoved(value: ast.expr) -> ast.expr:
    """``value`` without the calls that keep its rows around it: ``X`` of ``X.to(device).float()``."""
    while isinstance(value, ast.Call) and isinstance(value.func, ast.Attribute) and value.func.attr in _MOVES:
        value = value.func.value
    return value


_TRAINING_CALLS = frozenset({"backward", "train", "fit", "step", "training_step"})


_TRAINER_TYPES = re.compile(r"\w*Trainer")


def trains(source: str) -> bool:
    """Whether the cell itself trains: calls ``.backward()``, ``.train()``, ``.fit()``, an optimizer's
    ``.step()``, or builds a ``Trainer``. (A notebook function that trains is found by ``context``.)"""
    for dotted in called_names(source):
        last = dotted.rsplit(".", 1)[-1]
        if ("." in dotted and last in _TRAINING_CALLS) or _TRAINER_TYPES.fullmatch(last) or last == "fit":
            return True
    return False


def steps_optimizer(source: str) -> bool:
    """Whether the source steps an optimizer itself (``opt.step()``, ``scaler.step(opt)``) or hands the
    stepping to a trainer (``trainer.train()``, ``trainer.fit(...)``, ``model.fit(...)``)."""
    tree = tree_of(source)
    if tree is None:
        return False
    for node in ast.walk(tree):
        if step_call(node) == "step":
            return True
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in ("fit", "train")
        ):
            # model.train() only switches the mode: a trainer's train() takes arguments or is a trainer's.
            owner = dotted_name(node.func.value).rsplit(".", 1)[-1].lower()
            if node.func.attr == "fit" or "trainer" in owner:
                return True
    return False


# Optimizers that keep two moments per trainable weight (Adam's first and second).
ADAM_FAMILY = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax"})


def adam_constructions(source: str) -> tuple[str, ...]:
    """The Adam-family optimizers the cell makes itself (``opt = torch.optim.AdamW(model.parameters(),
    lr=2e-5)``), by class name in source order."""
    tree = tree_of(source)
    if tree is None:
        return ()
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and dotted_name(n.func).rsplit(".", 1)[-1] in ADAM_FAMILY and n.args
    ]
    calls.sort(key=lambda n: (n.lineno, n.col_offset))
    return tuple(dotted_name(n.func).rsplit(".", 1)[-1] for n in calls)


def autocasts(source: str) -> bool:
    """Whether the cell runs under autocast itself (``torch.autocast(...)``, ``bf16=True``/``fp16=True``)."""
    if any(d.rsplit(".", 1)[-1] == "autocast" for d in called_names(source)):
        return True
    return passes_true(source, "bf16") or passes_true(source, "fp16")


def checkpoints(source: str) -> bool:
    """Whether the cell switches gradient checkpointing on itself."""
    return passes_true(source, "gradient_checkpointing") or any(
        d.endswith("gradient_checkpointing_enable") for d in called_names(source)
    )
