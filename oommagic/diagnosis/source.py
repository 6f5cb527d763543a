"""The cell, parsed once: IPython syntax masked, and every reader of the source built on that one parse.

Pure (``ast`` and ``re`` only). ``parse_cell`` masks IPython lines (``%time``, ``!pip``, ``x = !ls``,
``obj?``) so that a cell with them reads like the same cell without them: ``%time expr`` keeps ``expr`` (as
``pass; expr``, same columns), other IPython lines become ``pass``. Parses are cached by text, so the
diagnosis, the remedies and the rewrites of one cell share one tree. What the cell *says* (its batch, the
names it reads, whether it trains or generates, what it keeps across steps) is read here; ``rewrite``
writes new versions of it.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

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
# TRL's configs subclass TrainingArguments and take the same keywords.
_TRAINING_ARGS = re.compile(r"(\w*TrainingArguments|SFTConfig|DPOConfig|ORPOConfig|KTOConfig|GRPOConfig)")
_MAGIC_LINE = re.compile(r"^\s*[%!?]|^\s*[\w.]+(?:\s*,\s*[\w.]+)*\s*=\s*[%!]|^\s*[\w.\[\]()]+\?\??\s*$")
_IDENTIFIER = re.compile(r"[A-Za-z_]\w*")
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
    or ``"call"`` (the default of a parameter of a notebook function the cell calls without it,
    ``def train(model, bs=128)`` and ``train(enc)``: ``path`` is (function, parameter), a rewrite passes
    the new number to the call).
    """

    name: str
    value: int
    where: str = "source"
    accumulation: tuple[str, int] | None = None
    mirrors: tuple[tuple[str, int], ...] = ()
    path: tuple[str, ...] = ()


@dataclass(frozen=True)
class Binding:
    """One place where the source binds ``name`` to the expression ``value``."""

    name: str
    value: ast.expr
    call: ast.Call | None = None
    keyword: ast.keyword | None = None


class SourceText:
    """Source text with ``ast`` positions (1-based lines, UTF-8 byte columns) turned into string offsets."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.lines = text.split("\n")
        self.starts = [0]
        for line in self.lines[:-1]:
            self.starts.append(self.starts[-1] + len(line) + 1)

    def offset(self, lineno: int, col: int) -> int:
        line = self.lines[lineno - 1]
        if not line.isascii():
            col = len(line.encode("utf-8")[:col].decode("utf-8", errors="ignore"))
        return self.starts[lineno - 1] + col

    def span(self, node: ast.AST) -> tuple[int, int]:
        return (
            self.offset(node.lineno, node.col_offset),
            self.offset(node.end_lineno, node.end_col_offset),
        )

    def segment(self, node: ast.AST) -> str:
        start, end = self.span(node)
        return self.text[start:end]


_TIMED = re.compile(r"^(\s*)(%(?:time|timeit|prun)\s+)(?=[^\s-])")


@dataclass(frozen=True)
class ParsedCell:
    """A cell's ``ast`` (None when it does not parse even masked) and the lines masked to ``pass``."""

    text: str
    tree: ast.Module | None
    masked: tuple[str, ...] = ()


@functools.lru_cache(maxsize=256)
def parse_cell(source: str) -> ParsedCell:
    """Parse a cell once, masking IPython-only lines where the parser trips on them. Callers must not
    change the tree: it is shared."""
    lines = source.split("\n")
    level: dict[int, int] = {}
    for _ in range(2 * len(lines) + 1):
        try:
            tree = ast.parse("\n".join(lines))
        except (SyntaxError, ValueError) as err:
            i = (getattr(err, "lineno", None) or 0) - 1
            original = source.split("\n")
            if not (0 <= i < len(lines)) or level.get(i, 0) >= 2 or not _MAGIC_LINE.search(original[i]):
                break
            level[i] = level.get(i, 0) + 1
            lines[i] = _masked(original[i], keep_code=level[i] == 1)
            continue
        return ParsedCell(source, tree, tuple(source.split("\n")[i] for i, lv in level.items() if lv == 2))
    # The parser may report an error below the magic line that caused it: mask every candidate at once.
    original = source.split("\n")
    candidates = tuple(line for line in original if _MAGIC_LINE.search(line))
    lines = [_masked(line, keep_code=False) if _MAGIC_LINE.search(line) else line for line in original]
    try:
        return ParsedCell(source, ast.parse("\n".join(lines)), candidates)
    except (SyntaxError, ValueError):
        return ParsedCell(source, None, ())


def tree_of(source: str) -> ast.Module | None:
    return parse_cell(source).tree


def _masked(line: str, keep_code: bool) -> str:
    # Same indentation keeps an indented block valid; `%time x = f()` becomes `pass; x = f()` with the
    # columns of `x = f()` unchanged, so its names are read and its literals can still be rewritten.
    timed = _TIMED.match(line)
    if keep_code and timed:
        indent, prefix = timed.group(1), timed.group(2)
        return indent + "pass;" + " " * (len(prefix) - 5) + line[timed.end() :]
    return line[: len(line) - len(line.lstrip())] + "pass"


def dotted_name(node: ast.expr) -> str:
    """``model.generate`` for ``model.generate``; ``?.generate`` where the object is not a plain name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{dotted_name(node.value)}.{node.attr}"
    return "?"


def call_matches(func: ast.expr, name: str) -> bool:
    dotted = dotted_name(func)
    return dotted == name or dotted.endswith("." + name)


def target_names(target: ast.expr) -> Iterator[str]:
    if isinstance(target, ast.Name):
        yield target.id
    elif isinstance(target, ast.Attribute):
        yield target.attr
    elif (
        isinstance(target, ast.Subscript)
        and isinstance(target.slice, ast.Constant)
        and isinstance(target.slice.value, str)
    ):
        yield target.slice.value


def binding_sites(tree: ast.Module) -> list[Binding]:
    """Every assignment, keyword argument and dict entry that binds a name, in source order."""
    found: list[Binding] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts, strict=False):
                        found.extend(Binding(n, v) for n in target_names(t))
                else:
                    found.extend(Binding(n, node.value) for n in target_names(target))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            found.extend(Binding(n, node.value) for n in target_names(node.target))
        elif isinstance(node, ast.Call):
            found.extend(Binding(kw.arg, kw.value, node, kw) for kw in node.keywords if kw.arg)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=False):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    found.append(Binding(key.value, value))
    return sorted(found, key=lambda s: (s.value.lineno, s.value.col_offset))


def int_literal(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


def signed_int_literal(node: ast.expr | None) -> int | None:
    """``int_literal`` that also reads a negative one (``-1`` parses as a minus applied to ``1``)."""
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = int_literal(node.operand)
        return -value if value is not None else None
    return int_literal(node) if node is not None else None


def parents_of(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    """Each node of ``tree`` to the node that holds it."""
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _loads(tree: ast.Module | None, source: str) -> list[str]:
    """Names the cell reads, in source order (every identifier when the cell does not parse)."""
    if tree is None:
        return _IDENTIFIER.findall(source)
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
    # `DataLoader(ds, batch_size=n)`: the variable behind a batch keyword counts whatever its name.
    behind = {s.value.id for s in sites if s.name in BATCH_NAMES and isinstance(s.value, ast.Name)}
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


def step_batch(source: str) -> BatchGuess | None:
    """The batch of a loop over slices written with a literal: ``for i in range(0, len(X), 128)`` whose
    body slices ``X[i:i + 128]``. Named by the loop's ``range(...)``."""
    tree = tree_of(source)
    if tree is None:
        return None
    for loop in ast.walk(tree):
        if not (isinstance(loop, (ast.For, ast.AsyncFor)) and isinstance(loop.target, ast.Name)):
            continue
        it = loop.iter
        if not (isinstance(it, ast.Call) and dotted_name(it.func) == "range" and len(it.args) == 3):
            continue
        step = int_literal(it.args[2])
        if step is None or step < 2 or not _step_slices(loop, loop.target.id, step):
            continue
        return BatchGuess(f"range(…, {step})", step, "step")
    return None


def _step_slices(loop: ast.AST, index: str, step: int) -> list[ast.expr]:
    """The literals ``step`` in the slices ``x[index:index + step]`` inside ``loop``."""
    found = []
    for node in ast.walk(loop):
        if not (isinstance(node, ast.Slice) and isinstance(node.lower, ast.Name) and node.lower.id == index):
            continue
        upper = node.upper
        if isinstance(upper, ast.BinOp) and isinstance(upper.op, ast.Add):
            for side in (upper.left, upper.right):
                if int_literal(side) == step:
                    found.append(side)
    return found


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
    parameters and ``arguments`` maps each parameter to the name the call passes for it."""

    block: tuple[ast.stmt, ...]
    last: int
    backward: ast.Call
    reads: tuple[tuple[str, int], ...]
    fed: tuple[tuple[str, str], ...]
    function: str = ""
    arguments: tuple[tuple[str, str], ...] = ()

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
    fed: list[tuple[int, int, str, str]] = []
    sliced: set[str] = set()
    called: set[str] = set()
    firsts: dict[str, tuple[int, int, int]] = {}
    for i, stmt in enumerate(block[: last + 1]):
        if _step_statement(stmt):
            continue  # what an optimizer's zero_grad() or step() reads is no input of the step
        for node in ast.walk(stmt):
            if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
                sliced.add(node.value.id)
            elif isinstance(node, ast.Call):
                if isinstance(node.func, ast.Name):
                    called.add(node.func.id)
                moves = isinstance(node.func, ast.Attribute) and node.func.attr in _MOVES
                given = [] if moves else node.args[:1] + [k.value for k in node.keywords if k.arg in _INPUTS]
                given = [_unmoved(a) for a in given]
                fed.extend(
                    (a.lineno, a.col_offset, dotted_name(node.func), a.id)
                    for a in given
                    if isinstance(a, ast.Name)
                )
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load) and node.id not in bound:
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
        return WholeStep(tuple(block), last, back, reads, feeds, function.name, tuple(passed.items()))
    return WholeStep(tuple(block), last, back, reads, feeds)


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


def contains(outer: ast.AST, node: ast.AST) -> bool:
    """Whether ``node`` is ``outer`` or inside it."""
    return any(n is node for n in ast.walk(outer))


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


def step_literals(source: str, step: int) -> list[ast.expr]:
    """Every literal of the batch ``step_batch`` found: the ``range`` step, the slices' ends and the first
    dimension of the data the loop makes beside them (a GAN's ``torch.randn(1024, 128)`` noise and
    ``torch.ones(1024, 1)`` labels for a ``real_data[i:i + 1024]`` batch)."""
    tree = tree_of(source)
    if tree is None:
        return []
    out: list[ast.expr] = []
    for loop in ast.walk(tree):
        if not (isinstance(loop, (ast.For, ast.AsyncFor)) and isinstance(loop.target, ast.Name)):
            continue
        it = loop.iter
        ranged = isinstance(it, ast.Call) and dotted_name(it.func) == "range" and len(it.args) == 3
        if ranged and int_literal(it.args[2]) == step:
            slices = _step_slices(loop, loop.target.id, step)
            if slices:
                sizes = [_leading_size(n) for n in ast.walk(loop) if isinstance(n, ast.Call)]
                out += [it.args[2], *slices, *(n for n in sizes if n is not None and int_literal(n) == step)]
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


_WRAPPERS = ("enumerate", "tqdm", "iter", "zip", "trange", "islice")


def iterated_names(source: str, line: int | None = None) -> tuple[str, ...]:
    """The names the cell's ``for`` loops iterate over (``for x, y in loader``, through ``enumerate``,
    ``tqdm``, ``zip``...): those of the loops around ``line`` first, innermost first, then the rest."""
    tree = tree_of(source)
    if tree is None:
        return ()
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.AsyncFor))]
    around = sorted(
        (n for n in loops if line is not None and n.lineno <= line <= (n.end_lineno or n.lineno)),
        key=lambda n: -n.lineno,
    )
    names: list[str] = []
    for loop in [*around, *(n for n in loops if n not in around)]:
        stack = [loop.iter]
        while stack:
            it = stack.pop(0)
            if isinstance(it, ast.Name):
                names.append(it.id)
            elif isinstance(it, ast.Call) and dotted_name(it.func).rsplit(".", 1)[-1] in _WRAPPERS:
                stack.extend(it.args)
    return tuple(dict.fromkeys(names))


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 1


def calls_with_keyword(source: str, keyword: str) -> tuple[str, ...]:
    """The called names (``pipe``, ``model.generate``) of the calls that pass ``keyword``, in source order."""
    tree = tree_of(source)
    if tree is None:
        return ()
    found = [s.call for s in binding_sites(tree) if s.call is not None and s.name == keyword]
    return tuple(dict.fromkeys(dotted_name(c.func) for c in found))


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


def names_read(source: str) -> set[str]:
    """Names whose value from before the cell the cell reads: read on or before the line that first
    assigns them (a name the cell builds afresh is not among them). Every identifier if the cell does not
    parse, and every identifier on an IPython line masked away (``!cmd $x``), to stay on the safe side."""
    parsed = parse_cell(source)
    tree = parsed.tree
    if tree is None:
        return set(_IDENTIFIER.findall(source))
    first_store: dict[str, int] = {}
    loads: list[ast.Name] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                loads.append(node)
            else:
                first_store[node.id] = min(first_store.get(node.id, node.lineno), node.lineno)
    # Same line counts as a read: in `model = model.to(dev)` the right side runs first.
    read = {n.id for n in loads if n.lineno <= first_store.get(n.id, n.lineno)}
    return read.union(*(_IDENTIFIER.findall(line) for line in parsed.masked))


def assigned_calls(source: str) -> list[str]:
    """Names bound to the result of a call at the top level (``model`` in ``model = Auto...(c).to(d)``)."""
    tree = tree_of(source)
    if tree is None:
        return []
    return [
        t.id
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
        for t in node.targets
        if isinstance(t, ast.Name)
    ]


def called_names(source: str) -> list[str]:
    """The dotted names of every call in the cell, in source order (``model.generate``, ``Trainer``)."""
    tree = tree_of(source)
    if tree is None:
        return re.findall(r"([\w.]+)\s*\(", source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    return [dotted_name(c.func) for c in sorted(calls, key=lambda c: (c.lineno, c.col_offset))]


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
# The one input a transformers model takes by keyword, and the fields of its output that are one tensor
# with a row per input row (its output object itself is no tensor: read through one of these).
_INPUTS = frozenset({"input_ids", "pixel_values", "inputs_embeds", "input_values", "input_features"})
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

    @property
    def pair(self) -> bool:
        """Whether it is no tensor yet: a (values, indices) pair, a model's output object, read through
        one of ``fields`` (or ``[0]``)."""
        return bool(self.fields)


def _dim_of(call: ast.Call, position: int) -> int | None:
    """The int ``dim`` a call passes, by keyword or at ``position``; None where it passes none."""
    for k in call.keywords:
        if k.arg == "dim":
            return signed_int_literal(k.value)
    if len(call.args) > position:
        return signed_int_literal(call.args[position])
    return None


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
        return RowWise(inner.spine, inner.product, module=inner.module) if read else None
    if isinstance(node, ast.Subscript):
        inner = row_wise(node.value, modules)
        at = int_literal(node.slice)
        read = (
            inner is not None
            and inner.pair
            and at is not None
            and at < (2 if "indices" in inner.fields else 1)
        )
        return RowWise(inner.spine, inner.product, module=inner.module) if read else None
    if not isinstance(node, ast.Call):
        return None
    name = dotted_name(node.func)
    last = name.rsplit(".", 1)[-1]
    if name in modules and len(node.args) == 1 and all(k.arg is not None for k in node.keywords):
        inner = row_wise(node.args[0], modules)
        return RowWise(inner.spine, True, module=name) if inner and not inner.pair else None
    if name in modules and not node.args and len(node.keywords) == 1 and node.keywords[0].arg in _INPUTS:
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
                return RowWise(inner.spine, inner.product, fields=fields, module=inner.module)
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


def generates(source: str) -> bool:
    """Whether the cell calls ``.generate(...)`` or builds a ``pipeline(...)``."""
    return any(d.rsplit(".", 1)[-1] in ("generate", "pipeline") for d in called_names(source))


def keyword_value(source: str, keyword: str, ints: dict[str, int] | None = None) -> int | None:
    """The int passed as ``keyword=`` anywhere in the cell: a literal, or a name holding an int in
    ``ints``. None where not passed or not readable."""
    tree = tree_of(source)
    if tree is None:
        return None
    for site in binding_sites(tree):
        if site.name != keyword or site.call is None:
            continue
        value = int_literal(site.value)
        if value is None and isinstance(site.value, ast.Name):
            value = (ints or {}).get(site.value.id)
        return value
    return None


def keyword_name(source: str, keyword: str) -> str | None:
    """The name passed as ``keyword=`` in a call of the cell (``dm`` of ``datamodule=dm``), if any."""
    tree = tree_of(source)
    for site in binding_sites(tree) if tree is not None else ():
        if site.name == keyword and site.call is not None and isinstance(site.value, ast.Name):
            return site.value.id
    return None


def passes_true(source: str, keyword: str) -> bool:
    """Whether some call in the cell passes ``keyword=`` something other than False/None/0."""
    tree = tree_of(source)
    if tree is None:
        return bool(re.search(rf"\b{keyword}\s*=\s*(?!False\b|None\b|0\b)", source))
    for site in binding_sites(tree):
        if site.name == keyword and site.call is not None:
            value = site.value
            if not (isinstance(value, ast.Constant) and value.value in (False, None, 0)):
                return True
    return False


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


def accumulation_name(source: str) -> str | None:
    """The gradient-accumulation setting the cell names, if any."""
    tree = tree_of(source)
    names = {s.name for s in binding_sites(tree)} | set(_loads(tree, source)) if tree is not None else set()
    return next((n for n in ACCUMULATION_NAMES if n in names), None)


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


# --- autograd, evaluation and loading ------------------------------------------------------------------

_GRAD_OFF = frozenset({"no_grad", "inference_mode"})


def _turns_grad_off(node: ast.expr) -> bool:
    """``torch.no_grad()``, ``torch.inference_mode()``, ``torch.set_grad_enabled(False)`` (also bare)."""
    if isinstance(node, ast.Call):
        last = dotted_name(node.func).rsplit(".", 1)[-1]
        if last in _GRAD_OFF:
            return not (node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value is False)
        if last == "set_grad_enabled":
            return bool(node.args) and isinstance(node.args[0], ast.Constant) and node.args[0].value is False
        return False
    return dotted_name(node).rsplit(".", 1)[-1] in _GRAD_OFF


def grad_off_lines(source: str) -> frozenset[int]:
    """The lines of the cell that run with autograd off: inside ``with torch.no_grad():`` (or
    ``inference_mode``, ``set_grad_enabled(False)``) blocks and functions decorated with them."""
    tree = tree_of(source)
    if tree is None:
        return frozenset()
    lines: set[int] = set()
    for node in ast.walk(tree):
        with_off = isinstance(node, (ast.With, ast.AsyncWith)) and any(
            _turns_grad_off(i.context_expr) for i in node.items
        )
        def_off = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
            _turns_grad_off(d) for d in node.decorator_list
        )
        if not (with_off or def_off):
            continue
        body = node.body
        lines.update(range(body[0].lineno, body[-1].end_lineno + 1))
    return frozenset(lines)


def disables_grad(source: str) -> bool:
    """Whether the cell turns autograd off anywhere itself (``no_grad``, ``inference_mode``, ...)."""
    tree = tree_of(source)
    if tree is None:
        return bool(re.search(r"\b(no_grad|inference_mode)\b|set_grad_enabled\(\s*False", source))
    return bool(grad_off_lines(source)) or any(
        isinstance(n, ast.Call)
        and dotted_name(n.func).rsplit(".", 1)[-1] == "set_grad_enabled"
        and _turns_grad_off(n)
        for n in ast.walk(tree)
    )


def work_span(source: str, names: frozenset[str] | set[str] = frozenset()) -> tuple[int, int] | None:
    """(first, last) line of the top-level statements that do the cell's work: those that read one of
    ``names`` (the models), else every statement that is not an import, a definition or a plain
    assignment of a literal. None when there is none."""
    tree = tree_of(source)
    if tree is None:
        return None

    def reads(stmt: ast.stmt) -> bool:
        return any(isinstance(n, ast.Name) and n.id in names for n in ast.walk(stmt))

    def works(stmt: ast.stmt) -> bool:
        if isinstance(
            stmt, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
        ):
            return False
        if isinstance(stmt, ast.Pass):
            return False
        literal = (
            isinstance(stmt.value, (ast.Constant, ast.List, ast.Dict)) if hasattr(stmt, "value") else False
        )
        return not (isinstance(stmt, (ast.Assign, ast.AnnAssign)) and literal)

    chosen = [s for s in tree.body if reads(s)] if names else []
    chosen = chosen or [s for s in tree.body if works(s)]
    if not chosen:
        return None
    return chosen[0].lineno, chosen[-1].end_lineno


_EVAL_KEYWORDS = ("per_device_eval_batch_size", "eval_batch_size")
_EVAL_CALLS = frozenset({"evaluate", "predict", "validate", "test"})


@dataclass(frozen=True)
class EvalBatch:
    """The batch size an evaluation uses: ``name`` (the keyword or variable), its ``value``, and
    ``owner``: what it belongs to (the loader variable ``eval_loader``, or ``TrainingArguments``)."""

    name: str
    value: int
    owner: str


def evaluates(source: str) -> bool:
    """Whether the cell evaluates without training: calls ``.evaluate()``/``.predict()``/``.validate()``/
    ``.test()`` and no training call."""
    called = [d.rsplit(".", 1)[-1] for d in called_names(source) if "." in d]
    return any(c in _EVAL_CALLS for c in called) and not any(
        c in ("train", "fit", "backward") for c in called
    )


def eval_batch(source: str, line: int | None = None) -> EvalBatch | None:
    """The evaluation batch size the cell sets as a literal: HF's ``per_device_eval_batch_size=`` (or
    ``eval_batch_size``), else the ``batch_size=`` literal of the ``DataLoader`` that the loop around
    ``line`` iterates over. None where the cell does not set one."""
    tree = tree_of(source)
    if tree is None:
        return None
    sites = binding_sites(tree)
    for keyword in _EVAL_KEYWORDS:
        for site in sites:
            value = int_literal(site.value)
            if site.name == keyword and value and site.call is not None:
                return EvalBatch(keyword, value, dotted_name(site.call.func).rsplit(".", 1)[-1])
    if line is None:
        return None
    loops = [
        n
        for n in ast.walk(tree)
        if isinstance(n, (ast.For, ast.AsyncFor)) and n.lineno <= line <= n.end_lineno
    ]
    for loop in sorted(loops, key=lambda n: -n.lineno):  # innermost first
        found = _loader_batch(tree, loop.iter)
        if found is not None:
            return found
    return None


# Lightning's evaluation calls, the keyword each takes its loaders by, and the hook it reads them from
# otherwise (the LightningModule's or the DataModule's method).
_LIGHTNING_STAGES = {
    "val_dataloader": (("validate", "dataloaders"), ("fit", "val_dataloaders")),
    "test_dataloader": (("test", "dataloaders"),),
    "predict_dataloader": (("predict", "dataloaders"),),
}


def passed_loader(source: str, hook: str) -> tuple[str, str | None] | None:
    """(keyword, the name passed, or None for an expression) where the cell hands the trainer the loaders
    ``hook`` would make (``trainer.validate(model, dataloaders=val_loader)``); None where it passes none."""
    tree = tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            for method, keyword in _LIGHTNING_STAGES.get(hook, ()):
                passed = next((k.value for k in node.keywords if k.arg == keyword), None)
                if node.func.attr == method and passed is not None:
                    return keyword, passed.id if isinstance(passed, ast.Name) else None
    return None


def lightning_eval_batch(source: str, hook: str) -> EvalBatch | None:
    """The literal ``batch_size=`` of the loader a Lightning evaluation reads in this cell: passed to the
    trainer's call (``trainer.validate(model, dataloaders=DataLoader(ds, batch_size=256))``, or a loader
    the cell assigns and passes), else returned by the ``hook`` method (``val_dataloader``) of a class the
    cell defines. None where the cell sets neither."""
    tree = tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        for method, keyword in _LIGHTNING_STAGES.get(hook, ()):
            passed = next((k.value for k in node.keywords if k.arg == keyword), None)
            if node.func.attr == method and passed is not None:
                found = _loader_batch(tree, passed)
                if found is None:
                    return None  # passed, but not made here: the hook is not what the trainer reads
                owner = found.owner if found.owner != "DataLoader" else keyword
                return EvalBatch(found.name, found.value, owner)
    return hook_batch(source, hook)


def hook_batch(source: str, hook: str) -> EvalBatch | None:
    """The literal ``batch_size=`` of the ``DataLoader(...)`` that the method ``hook`` in ``source``
    returns (``def val_dataloader(self): return DataLoader(ds, batch_size=256)``)."""
    tree = tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == hook:
            for call in ast.walk(node):
                if isinstance(call, ast.Call) and dotted_name(call.func).rsplit(".", 1)[-1] == "DataLoader":
                    value = next((int_literal(k.value) for k in call.keywords if k.arg == "batch_size"), None)
                    if value:
                        return EvalBatch("batch_size", value, hook)
    return None


def lightning_calls(hook: str) -> tuple[tuple[str, str], ...]:
    """(trainer method, loader keyword) of the calls that read ``hook``'s loaders."""
    return _LIGHTNING_STAGES.get(hook, ())


def _loader_batch(tree: ast.Module, it: ast.expr) -> EvalBatch | None:
    """The literal ``batch_size=`` of the loader ``it`` (a ``DataLoader(...)`` call, or a name assigned
    one; through ``enumerate``/``tqdm`` wrappers)."""
    while isinstance(it, ast.Call) and dotted_name(it.func).rsplit(".", 1)[-1] in (
        "enumerate",
        "tqdm",
        "iter",
    ):
        if not it.args:
            return None
        it = it.args[0]
    owner = "DataLoader"
    if isinstance(it, ast.Name):
        owner = it.id
        bound = [
            n.value
            for n in ast.walk(tree)
            if isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == it.id for t in n.targets)
        ]
        it = bound[-1] if bound else it
    if not isinstance(it, ast.Call):
        return None
    for kw in it.keywords:
        value = int_literal(kw.value) if kw.arg == "batch_size" else None
        if value:
            return EvalBatch("batch_size", value, owner)
    return None


def eval_batch_literal(source: str, batch: EvalBatch) -> ast.expr | None:
    """The literal node of ``batch`` in ``source`` (the same keyword of the same owner, same value)."""
    tree = tree_of(source)
    if tree is None:
        return None
    if batch.name in _EVAL_KEYWORDS:
        for site in binding_sites(tree):
            if site.name == batch.name and site.call is not None and int_literal(site.value) == batch.value:
                return site.value
        return None
    for node in ast.walk(tree):
        calls: list[ast.expr] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == batch.owner:
            # A Lightning hook (`def val_dataloader(self): return DataLoader(...)`).
            calls = [
                c
                for c in ast.walk(node)
                if isinstance(c, ast.Call) and dotted_name(c.func).endswith("DataLoader")
            ]
        elif isinstance(node, ast.Call):
            calls = [k.value for k in node.keywords if k.arg == batch.owner]  # `dataloaders=DataLoader(...)`
        elif isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == batch.owner for t in node.targets
        ):
            calls = [node.value]
        elif isinstance(node, (ast.For, ast.AsyncFor)) and batch.owner == "DataLoader":
            calls = [node.iter]
        for call in calls:
            for kw in call.keywords if isinstance(call, ast.Call) else ():
                if kw.arg == batch.name and int_literal(kw.value) == batch.value:
                    return kw.value
    return None


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
