"""Rewrite a cell's source: change a literal, set a call's keyword, insert a statement.

Pure (``ast`` and ``re`` only), on the one parse of ``source``. A rewrite replaces just the span of one
literal or inserts just one statement or keyword, so every other byte of the cell stays as the person wrote
it; masked IPython lines come back untouched.
"""

from __future__ import annotations

import ast
import difflib
import re
from collections.abc import Iterable

from .source import (
    ACCUMULATION_NAMES,
    TRAINING_ARGUMENTS,
    BatchGuess,
    Binding,
    KeptSite,
    SourceText,
    arguments_calls,
    binding_sites,
    call_matches,
    contains,
    dotted_name,
    expression_nodes,
    int_literal,
    kept_sites,
    row_wise,
    shape_literals,
    step_call,
    step_literals,
    target_names,
    tree_of,
    whole_step,
)

# TRL's configs subclass TrainingArguments and take the same keywords.
_TRAINING_ARGS = TRAINING_ARGUMENTS


def rewrite_batch(
    source: str, guess: BatchGuess, new_value: int, accumulate: int = 1, taken: Iterable[str] = frozenset()
) -> str | None:
    """Return the cell with its batch literal set to ``new_value``; with ``accumulate > 1`` also multiply a
    literal gradient-accumulation setting by it, or add ``gradient_accumulation_steps`` to a
    TrainingArguments call. A plain training loop gets no invented accumulation code. None when the batch
    is not a literal in the cell (the retry then rebinds the variable instead). ``taken``: names the
    namespace binds, which the names a rewrite adds avoid (``fresh_name``)."""
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    if guess.where == "rows":
        # A step on whole tensors: it runs on micro-batches of their rows, the accumulation built in.
        return micro_batch_source(source, guess.path, guess.value, new_value, taken)
    if guess.where == "call":
        # `train(enc)` → `train(enc, bs=64)`; a method of the same name (`model.train()`) stays.
        func, keyword = guess.path
        return set_call_keyword(source, func, keyword, new_value, methods=False)
    if guess.where in ("expression", "step", "shape"):
        # `cfg.batch_size` / `S["batch"]` read by the cell, or a loop's literal step and slice ends:
        # each occurrence becomes the new number (a plain loop gets no invented accumulation).
        nodes = (
            expression_nodes(tree, tuple(guess.path))
            if guess.where == "expression"
            else step_literals(source, guess.value)
            if guess.where == "step"
            else shape_literals(source, guess.value)
        )
        if not nodes:
            return None
        edits = [(*src.span(n), str(new_value)) for n in nodes]
        if accumulate > 1:
            # An accumulation the cell writes itself scales with the smaller batch here too.
            edits.extend(_accumulation_edits(src, tree, binding_sites(tree), [], accumulate))
        return _checked(_apply(source, edits))
    sites = binding_sites(tree)
    batch = [s for s in sites if s.name == guess.name and int_literal(s.value) is not None]
    batch = [s for s in batch if int_literal(s.value) == guess.value] or batch
    if not batch:
        return None
    edits = [(*src.span(s.value), str(new_value)) for s in batch]
    edits.extend((*src.span(n), str(guess.value)) for n in _bounds_read_through(tree, guess.name))
    if accumulate > 1:
        edits.extend(_accumulation_edits(src, tree, sites, batch, accumulate))
    return _checked(_apply(source, edits))


def _bounds_read_through(tree: ast.Module, name: str) -> list[ast.Name]:
    """The reads of the batch ``name`` in the start and stop of a ``range`` that steps by it
    (``range(0, 3 * bs, bs)``): they say how many samples the loop sees, which a smaller batch must not
    shrink (the loop then runs more, smaller steps over the same samples)."""
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and dotted_name(node.func) == "range" and len(node.args) == 3):
            continue
        step = node.args[2]
        if not (isinstance(step, ast.Name) and step.id == name):
            continue
        for bound in node.args[:2]:
            found += [n for n in ast.walk(bound) if isinstance(n, ast.Name) and n.id == name]
    return found


def accumulates(source: str) -> bool:
    """Whether ``rewrite_batch`` with ``accumulate > 1`` keeps the effective batch inside this cell: it has
    a literal accumulation setting to multiply or a TrainingArguments call to add one to."""
    tree = tree_of(source)
    if tree is None:
        return False
    sites = binding_sites(tree)
    return bool(
        _accumulation_literals(sites)
        or own_accumulation(tree)
        or _training_args_calls(tree)
        or _lightning_trainer_calls(tree)
    )


def own_accumulation(tree: ast.Module) -> list[tuple[ast.expr, ast.Call]]:
    """The person's own gradient accumulation, whatever its names: in a training loop, an ``if`` whose test
    is ``<count> % N == 0`` and whose body steps an optimizer (``if (i + 1) % accum == 0: opt.step()``).
    Each as (``N``, the loop's backward call)."""
    found = []
    for loop in ast.walk(tree):
        if not isinstance(loop, (ast.For, ast.While)) or not _trains_in(loop):
            continue
        backward = next(
            n
            for stmt in _statements(loop.body)
            for n in ast.walk(stmt)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
        )
        for block in _blocks(loop.body):
            for stmt in block:
                test = stmt.test if isinstance(stmt, ast.If) else None
                every = (
                    test.left.right
                    if isinstance(test, ast.Compare)
                    and len(test.ops) == 1
                    and isinstance(test.ops[0], ast.Eq)
                    and int_literal(test.comparators[0]) == 0
                    and isinstance(test.left, ast.BinOp)
                    and isinstance(test.left.op, ast.Mod)
                    else None
                )
                if every is not None and any(step_call(n) == "step" for s in stmt.body for n in ast.walk(s)):
                    found.append((every, backward))
    return found


def _own_accumulation_edits(
    src: SourceText, tree: ast.Module, sites: list[Binding], accumulate: int
) -> list[tuple[int, int, str]]:
    """Scale the person's own accumulation (``own_accumulation``) by ``accumulate``: a name bound once to a
    literal in the cell has that literal multiplied (its every use scales: the test and the loss's
    divisor); otherwise the test's ``N`` becomes ``N * accumulate`` and the loss is divided by
    ``accumulate`` as well. Either way each optimizer step sums as many samples as before, once each."""
    edits: list[tuple[int, int, str]] = []
    done: set[int] = set()
    for every, backward in own_accumulation(tree):
        bound = [s for s in sites if isinstance(every, ast.Name) and s.name == every.id]
        if len(bound) == 1 and int_literal(bound[0].value) is not None:
            if id(bound[0].value) not in done:
                done.add(id(bound[0].value))
                edits.append((*src.span(bound[0].value), str(int_literal(bound[0].value) * accumulate)))
            continue
        value = int_literal(every)
        # `% accum` → `% (accum * 4)`: `%` and `*` bind alike, left to right.
        scaled = str(value * accumulate) if value is not None else f"({src.segment(every)} * {accumulate})"
        edits.append((*src.span(every), scaled))
        if id(backward) not in done:
            done.add(id(backward))
            loss = _loss_of(backward)
            bare = isinstance(loss, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
            product = isinstance(loss, ast.BinOp) and isinstance(loss.op, (ast.Mult, ast.Div))
            text = src.segment(loss) if bare or product else f"({src.segment(loss)})"
            loss_text = f"{text} / {accumulate}"
            # `loss.backward()` needs parentheses around the division; `(a / 2).backward()` has them.
            wrap = loss is backward.func.value and bare
            edits.append((*src.span(loss), f"({loss_text})" if wrap else loss_text))
    return edits


def scale_accumulation(source: str, accumulate: int) -> str | None:
    """The cell with its own accumulation setting multiplied by ``accumulate`` (or one added to its
    TrainingArguments / Lightning Trainer), its batch left as it is; None where it has none."""
    tree = tree_of(source)
    if tree is None:
        return None
    edits = _accumulation_edits(SourceText(source), tree, binding_sites(tree), [], accumulate)
    return _checked(_apply(source, edits)) if edits else None


def _accumulation_literals(sites: list[Binding]) -> list[Binding]:
    literal = [s for s in sites if s.name in ACCUMULATION_NAMES and int_literal(s.value) is not None]
    # `gradient_accumulation_steps=ga` with `ga = 2` above: multiply the 2.
    behind = {s.value.id for s in sites if s.name in ACCUMULATION_NAMES and isinstance(s.value, ast.Name)}
    literal += [s for s in sites if s.name in behind and s.call is None and int_literal(s.value) is not None]
    return literal


def _training_args_calls(tree: ast.Module) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _TRAINING_ARGS.fullmatch(dotted_name(n.func).rsplit(".", 1)[-1])
    ]


def _accumulation_edits(
    src: SourceText, tree: ast.Module, sites: list[Binding], batch: list[Binding], accumulate: int
) -> list[tuple[int, int, str]]:
    literal = _accumulation_literals(sites)
    if literal:
        return [(*src.span(s.value), str(int_literal(s.value) * accumulate)) for s in literal]
    if own_accumulation(tree):
        return _own_accumulation_edits(src, tree, sites, accumulate)
    if any(s.name in ACCUMULATION_NAMES for s in sites):
        return []  # set from a variable we cannot see into: leave it, the explanation says so
    edits = []
    for call in _training_args_calls(tree):
        anchor = next((s.keyword for s in batch if s.call is call), None)
        edits.append(_insert_keyword(src, call, f"gradient_accumulation_steps={accumulate}", anchor))
    if not edits:
        # Lightning's Trainer accumulates with its own keyword (HF's Trainer takes TrainingArguments).
        for call in _lightning_trainer_calls(tree):
            edits.append(_insert_keyword(src, call, f"accumulate_grad_batches={accumulate}"))
    return edits


def _lightning_trainer_calls(tree: ast.Module) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and dotted_name(n.func).rsplit(".", 1)[-1] == "Trainer"
        and not any(k.arg == "args" for k in n.keywords)
        and not any(k.arg == "accumulate_grad_batches" for k in n.keywords)
        and any(
            k.arg in ("max_epochs", "max_steps", "accelerator", "devices", "precision") for k in n.keywords
        )
    ]


def _insert_keyword(
    src: SourceText, call: ast.Call, text: str, anchor: ast.AST | None = None
) -> tuple[int, int, str]:
    """An edit adding ``text`` to ``call`` after ``anchor`` (default: its last argument), on its own line
    where the call puts one argument per line."""
    args: list[ast.AST] = [*call.args, *call.keywords]
    if not args:
        close = src.offset(call.end_lineno, call.end_col_offset) - 1
        return (close, close, text)
    anchor = anchor or max(args, key=lambda a: (a.end_lineno, a.end_col_offset))
    start, end = src.span(anchor)
    line_start = src.starts[anchor.lineno - 1]
    own_line = re.match(r"[ \t]*,[ \t]*(#[^\r\n]*)?\r?\n", src.text[end:])
    if own_line and not src.text[line_start:start].strip():
        indent = src.text[line_start:start]
        eol = "\r\n" if own_line.group(0).endswith("\r\n") else "\n"
        at = end + own_line.end()
        return (at, at, f"{indent}{text},{eol}")
    return (end, end, f", {text}")


def _names_torch(tree: ast.Module | None) -> bool:
    """Whether the cell names ``torch`` anywhere (a rewrite that uses it imports it first where not)."""
    return tree is not None and any(isinstance(n, ast.Name) and n.id == "torch" for n in ast.walk(tree))


def _apply(source: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        source = source[:start] + text + source[end:]
    return source


def _checked(source: str) -> str | None:
    return source if tree_of(source) is not None else None


def set_call_keyword(
    source: str, func_attr: str, keyword: str, value: object, replace: bool = True, methods: bool = True
) -> str | None:
    """Return the cell with ``keyword=value`` in every call to ``func_attr`` (``generate`` matches
    ``model.generate(...)``; ``tokenizer`` matches ``tokenizer(...)``; with ``methods=False`` only a call
    by that plain name), replacing the keyword's value where it is already passed (left as it is with
    ``replace=False``). None when the cell makes no such call."""
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    calls = [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call)
        and (call_matches(n.func, func_attr) if methods else dotted_name(n.func) == func_attr)
    ]
    if not calls:
        return None
    edits = []
    for call in calls:
        existing = next((kw for kw in call.keywords if kw.arg == keyword), None)
        if existing is not None:
            if replace:
                edits.append((*src.span(existing.value), repr(value)))
        else:
            edits.append(_insert_keyword(src, call, f"{keyword}={value!r}"))
    return _checked(_apply(source, edits))


def keep_last_logits_source(source: str, calls: tuple[str, ...], keyword: str) -> str | None:
    """The cell with ``keyword=1`` (``logits_to_keep``) in every call to ``calls``: the model computes the
    logits of the last position only. None where nothing changes."""
    new = source
    for func in calls:
        new = set_call_keyword(new, func, keyword, 1) or new
    return new if new != source else None


def eval_accumulation_source(source: str, steps: int, target: str) -> str | None:
    """The cell with a Trainer's ``eval_accumulation_steps`` set to ``steps``: ``target`` ``"call"`` writes
    the keyword into every Trainer-arguments call of the cell (``TrainingArguments(...)``, where the cell
    makes its Trainer); a dotted name (``trainer.args``, ``args``: settings made in an earlier cell) gets a
    line at the top of the cell. None where nothing changes."""
    if target == "call":
        new = source
        for func in arguments_calls(source):
            new = set_call_keyword(new, func, "eval_accumulation_steps", steps) or new
        return new if new != source else None
    note = "# oommagic: predictions to the host " + (
        "after every batch" if steps == 1 else f"every {steps} batches"
    )
    return _checked(f"{target}.eval_accumulation_steps = {steps}  {note}\n{source}")


def insert_after_assignment(source: str, name: str, statement: str) -> str | None:
    """Return the cell with ``statement`` on its own line after the last top-level assignment to
    ``name`` (``model = AutoModel...`` → ``model.gradient_checkpointing_enable()`` below it); None when
    the cell does not assign ``name`` at top level. A retry re-creates such objects, so a setting made
    on the old one in the namespace would not reach the new one."""
    tree = tree_of(source)
    if tree is None:
        return None
    assigned = [
        node
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and name
        in {n for t in getattr(node, "targets", [getattr(node, "target", None)]) for n in target_names(t)}
    ]
    if not assigned:
        return None
    end = assigned[-1].end_lineno
    lines = source.split("\n")
    indent = lines[assigned[-1].lineno - 1][
        : len(lines[assigned[-1].lineno - 1]) - len(lines[assigned[-1].lineno - 1].lstrip())
    ]
    return _checked("\n".join([*lines[:end], indent + statement, *lines[end:]]))


def unified_diff(old: str, new: str, name: str = "cell") -> str:
    """A unified diff of two cell sources, for showing a rewrite before it is applied."""

    def lines(text: str) -> list[str]:
        out = text.splitlines(keepends=True)
        if out and not out[-1].endswith("\n"):
            out[-1] += "\n"
        return out

    return "".join(difflib.unified_diff(lines(old), lines(new), f"{name} (before)", f"{name} (after)"))


def changed_lines(old: str, new: str) -> str:
    """The lines of ``new`` that differ from ``old``, dedented: the part of a rewrite to copy by hand."""
    added = [
        line[1:]
        for line in difflib.unified_diff(old.splitlines(), new.splitlines(), lineterm="", n=0)
        if line.startswith("+") and not line.startswith("+++")
    ]
    indent = min((len(a) - len(a.lstrip()) for a in added if a.strip()), default=0)
    return "\n".join(a[indent:] for a in added)


def fresh_words(text: str) -> list[str]:
    """Every word of ``text`` (identifiers, also inside strings and comments: a name found there is
    avoided too, which costs nothing)."""
    return re.findall(r"\w+", text)


def fresh_name(wanted: str, *sources: str, taken: Iterable[str] = frozenset()) -> str:
    """``wanted``, or ``wanted`` with ``_`` added until it is no word of ``sources`` (the cell, the
    notebook functions a rewrite puts beside it) and none of ``taken`` (the names the namespace binds): a
    name a rewrite adds must neither read nor overwrite one of the person's."""
    used = set(taken)
    for text in sources:
        used.update(fresh_words(text))
    name = wanted
    while name in used:
        name += "_"
    return name


def accumulate_loops(
    source: str, steps: int, counter: str | None = None, taken: Iterable[str] = frozenset()
) -> str | None:
    """Return the cell with gradient accumulation over ``steps`` micro-batches written into each training
    loop (a ``for``/``while`` whose body calls ``.backward()``): the loss divided by ``steps``, a counter
    after the backward pass, every optimizer/scheduler ``.step()`` and ``.zero_grad()`` of the loop run
    only when the counter reaches a multiple of ``steps``, and ``range(n)`` loops run ``n * steps`` times so
    the number of optimizer steps stays, and a stop on the loop's count (``if i == 2: break``, ``if step + 1
    == max_steps: return``) counts whole steps of ``steps`` micro-batches (``_stop_edits``). The counter is
    ``counter``, else ``micro_step`` made fresh against the cell and ``taken``. None when the cell has no such
    loop."""
    counter = counter or fresh_name("micro_step", source, taken=taken)
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    edits: list[tuple[int, int, str]] = []
    loops = [n for n in ast.walk(tree) if isinstance(n, (ast.For, ast.While)) and _trains_in(n)]
    # The innermost training loops only: an epoch loop around a batch loop keeps its own count.
    loops = [n for n in loops if not any(m is not n and contains(n, m) for m in loops)]
    if not loops:
        return None
    for loop in loops:
        loop_indent = src.lines[loop.lineno - 1][: loop.col_offset]
        edits.append(
            (src.starts[loop.lineno - 1], src.starts[loop.lineno - 1], f"{loop_indent}{counter} = 0\n")
        )
        if isinstance(loop, ast.For) and _is_range_call(loop.iter):
            arg = loop.iter.args[-1] if len(loop.iter.args) == 1 else None
            if arg is not None:
                atomic = isinstance(arg, (ast.Name, ast.Constant, ast.Attribute, ast.Call))
                text = src.segment(arg) if atomic else f"({src.segment(arg)})"
                edits.append((*src.span(arg), f"{text} * {steps}"))
        edits += _stop_edits(src, loop, steps)
        for block in _blocks(loop.body):
            guarded_before = False
            for stmt in block:
                call = stmt.value if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call) else None
                name = call.func.attr if call is not None and isinstance(call.func, ast.Attribute) else None
                indent = src.lines[stmt.lineno - 1][: stmt.col_offset]
                start, end = src.starts[stmt.lineno - 1], src.offset(stmt.end_lineno, stmt.end_col_offset)
                guarded = step_call(call) is not None
                if name == "backward":
                    loss = _loss_of(call)
                    text = f"{src.segment(loss)} / {steps}"
                    edits.append((*src.span(loss), f"({text})" if loss is call.func.value else text))
                    edits.append((end, end, f"\n{indent}{counter} += 1"))
                elif guarded:
                    body = src.text[start + len(indent) : end].replace("\n", "\n    ")
                    head = "" if guarded_before else f"{indent}if {counter} % {steps} == 0:\n"
                    edits.append((start, end, f"{head}{indent}    {body}"))
                guarded_before = guarded
    return _checked(_apply(source, edits))


def _loop_count(loop: ast.AST) -> str | None:
    """The name counting a ``for`` loop's iterations from 0: ``i`` of ``for i, b in enumerate(loader)`` and
    of ``for i in range(n)``; None for any other loop (a start or a step of its own)."""
    if not isinstance(loop, ast.For) or not isinstance(loop.iter, ast.Call):
        return None
    it, target = loop.iter, loop.target
    if dotted_name(it.func) == "enumerate" and len(it.args) == 1 and not it.keywords:
        first = target.elts[0] if isinstance(target, ast.Tuple) and target.elts else None
        return first.id if isinstance(first, ast.Name) else None
    if _is_range_call(it) and len(it.args) == 1 and isinstance(target, ast.Name):
        return target.id
    return None


def _stop_edits(src: SourceText, loop: ast.AST, steps: int) -> list[tuple[int, int, str]]:
    """A loop that stops on its count (``if i == 2: break``, ``if step + 1 == max_steps: return loss``)
    would stop after as many micro-batches as it took steps: its test then reads whole steps, ``i // steps``,
    and is asked once per step, at the first micro-batch of a step where it comes before the backward pass
    (the step not begun), at the last one where it comes after (the step taken)."""
    count = _loop_count(loop)
    if count is None:
        return []
    backward = min(
        (
            n.lineno
            for stmt in _statements(loop.body)
            for n in ast.walk(stmt)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
        ),
        default=None,
    )
    edits = []
    for block in _blocks(loop.body):
        for stmt in block:
            stops = isinstance(stmt, ast.If) and any(isinstance(s, ast.Break | ast.Return) for s in stmt.body)
            if not stops:
                continue
            reads = [n for n in ast.walk(stmt.test) if isinstance(n, ast.Name) and n.id == count]
            if not reads or any(isinstance(n, ast.Call) for n in ast.walk(stmt.test)):
                continue
            at = 0 if backward is not None and stmt.lineno < backward else steps - 1
            start, end = src.span(stmt.test)
            test = src.text[start:end]
            for name in sorted(reads, key=lambda n: src.span(n), reverse=True):
                a, b = src.span(name)
                test = test[: a - start] + f"{count} // {steps}" + test[b - start :]
            edits.append((start, end, f"{count} % {steps} == {at} and ({test})"))
    return edits


def _trains_in(loop: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "backward"
        for stmt in _statements(loop.body)
        for n in ast.walk(stmt)
    )


def _blocks(body: list[ast.stmt]) -> list[list[ast.stmt]]:
    """The statement lists of a loop body and of its ``if``/``with``/``try`` blocks (not of nested loops
    or functions)."""
    out = [body]
    for stmt in body:
        if isinstance(stmt, (ast.If, ast.With, ast.AsyncWith, ast.Try)):
            for inner in (stmt.body, getattr(stmt, "orelse", [])):
                if inner:
                    out.extend(_blocks(inner))
    return out


def _statements(body: list[ast.stmt]) -> list[ast.stmt]:
    """The simple statements of a loop body, into its ``if``/``with``/``try`` blocks but not into nested
    loops or functions."""
    out: list[ast.stmt] = []
    for stmt in body:
        if isinstance(stmt, (ast.If, ast.With, ast.AsyncWith)):
            out.extend(_statements(stmt.body) + _statements(getattr(stmt, "orelse", [])))
        elif isinstance(stmt, ast.Try):
            out.extend(_statements(stmt.body))
        elif not isinstance(stmt, (ast.For, ast.While, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(stmt)
    return out


def _is_range_call(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and dotted_name(node.func) == "range" and not node.keywords


def _loss_of(backward: ast.Call) -> ast.expr:
    """The loss a ``.backward()`` call differentiates: ``loss`` in ``loss.backward()`` and in
    ``scaler.scale(loss).backward()``; the argument of ``accelerator.backward(loss)``."""
    target = backward.func.value
    if isinstance(target, ast.Call) and dotted_name(target.func).endswith("scale") and target.args:
        return target.args[0]
    if _owner(backward) in ("accelerator", "fabric") and backward.args:
        return backward.args[0]
    return target


def _owner(call: ast.Call) -> str:
    """The last name of what a method is called on (``scaler`` in ``self.scaler.step(opt)``)."""
    return (
        dotted_name(call.func.value).rsplit(".", 1)[-1].lower()
        if isinstance(call.func, ast.Attribute)
        else ""
    )


def keep_numbers_source(source: str, ndims: dict[str, int] | None = None) -> str | None:
    """The cell with each value kept across loop iterations (``losses.append(loss)``, ``total += loss``)
    kept as a number, a detached CPU copy, or reduced the way the cell reads it after the loop
    (``kept_sites``) instead; None when there is no such statement."""
    return kept_source(source, kept_sites(source, most=100, ndims=ndims))


def kept_source(source: str, sites: list[KeptSite]) -> str | None:
    """``source`` with ``sites`` (``kept_sites`` of it) rewritten; None without any."""
    if not sites:
        return None
    edits = {(s.start, s.end, s.replacement) for s in sites}
    edits |= {edit for s in sites for edit in s.later}
    return _checked(_apply(source, sorted(edits)))


def wrap_lines(source: str, first: int, last: int, header: str, before: tuple[str, ...] = ()) -> str | None:
    """Return the cell with lines ``first``..``last`` (1-based, whole statements at one indentation) put
    in a block under ``header`` (``with torch.inference_mode():``), and ``before`` on their own lines
    above it. None where the result does not parse."""
    lines = source.split("\n")
    block = lines[first - 1 : last]
    indent = block[0][: len(block[0]) - len(block[0].lstrip())]
    body = [("    " + line) if line.strip() else line for line in block]
    head = [indent + b for b in before] + [indent + header]
    return _checked("\n".join([*lines[: first - 1], *head, *body, *lines[last:]]))


def default_dtype_source(
    source: str,
    line: int | None = None,
    statement: str | None = None,
    dtype: str = "bfloat16",
    restore: str = "float32",
) -> str | None:
    """The cell with the one statement that builds a model (the simple statement on ``line``, or the one
    whose first line reads ``statement``) run with torch's default dtype set to ``dtype``, put back to
    ``restore`` after it even when it fails: every parameter it makes is created in ``dtype``, however the
    model is built (``from_config``, a module's constructor, ``.to(device)`` after). None where no such
    statement is found or the result does not parse."""
    tree = tree_of(source)
    if tree is None:
        return None
    lines = source.split("\n")
    simple = [n for n in ast.walk(tree) if isinstance(n, ast.stmt) and not hasattr(n, "body")]
    if statement is not None:
        found = [n for n in simple if lines[n.lineno - 1].strip() == statement]
    else:
        found = [n for n in simple if line is not None and n.lineno <= line <= (n.end_lineno or n.lineno)]
    if not found:
        return None
    node = found[0]
    first, last = node.lineno, node.end_lineno or node.lineno
    indent = lines[first - 1][: node.col_offset]
    body = [("    " + text) if text.strip() else text for text in lines[first - 1 : last]]
    block = [
        f"{indent}torch.set_default_dtype(torch.{dtype})",
        f"{indent}try:",
        *body,
        f"{indent}finally:",
        f"{indent}    torch.set_default_dtype(torch.{restore})",
    ]
    head = [] if _names_torch(tree) else ["import torch"]
    return _checked("\n".join([*head, *lines[: first - 1], *block, *lines[last:]]))


def no_grad_source(
    source: str, names: frozenset[str] | set[str] = frozenset(), eval_models: tuple[str, ...] = ()
) -> str | None:
    """The cell with its work (the top-level statements that use ``names``, else all of them but imports,
    definitions and literal assignments) run under ``torch.inference_mode()``, with ``model.eval()`` for
    each of ``eval_models`` above it; ``import torch`` added where the cell does not name torch. None where
    there is nothing to wrap."""
    from .source import work_span

    span = work_span(source, names)
    if span is None:
        return None
    named = _names_torch(tree_of(source))
    before = tuple(f"{m}.eval()" for m in eval_models)
    wrapped = wrap_lines(source, *span, "with torch.inference_mode():", before)
    if wrapped is None or named:
        return wrapped
    return _checked("import torch\n" + wrapped)


def set_literal(source: str, node: ast.expr, value: object) -> str | None:
    """The cell with the literal ``node`` (from this source's parse) replaced by ``repr(value)``."""
    src = SourceText(source)
    return _checked(_apply(source, [(*src.span(node), repr(value))]))


class Code(str):
    """Source text passed as a keyword's value: written as it is, not as a string literal."""

    def __repr__(self) -> str:
        return str(self)


def load_source(source: str, keywords: dict[str, str], imports: tuple[str, ...] = ()) -> str | None:
    """The cell with ``keywords`` (name → source text) set in every ``from_pretrained(...)`` call, an
    existing ``torch_dtype=`` replaced where ``dtype`` is set, and ``imports`` above the cell where it does
    not have them. None where the cell makes no such call."""
    new = source
    if "dtype" in keywords and "torch_dtype=" in source:
        keywords = {("torch_dtype" if k == "dtype" else k): v for k, v in keywords.items()}
    for keyword, text in keywords.items():
        new = set_call_keyword(new, "from_pretrained", keyword, Code(text))
        if new is None:
            return None
    missing = [line for line in imports if line not in new]
    return _checked("\n".join([*missing, new])) if missing else new


def quantized_cache_source(source: str, config: str) -> str | None:
    """The cell's ``generate`` calls with transformers' quantized KV cache: ``cache_implementation=
    "quantized"`` and ``cache_config`` (source text, ``{"backend": "fp8"}``). None where the cell makes no
    such call."""
    new = set_call_keyword(source, "generate", "cache_implementation", "quantized")
    return set_call_keyword(new, "generate", "cache_config", Code(config)) if new else None


def split_rows_source(source: str, expr: str, arg: str, chunk: int, module: str = "") -> str | None:
    """The cell with each expression ``expr`` (computed row by row from ``arg``: ``row_wise``) run over
    ``chunk`` rows of ``arg`` at a time and the results joined: ``model(X)`` → ``torch.cat([model(rows)
    for rows in X.split(1024)])``, ``torch.cdist(Xq, Xdb).argmin(dim=1)`` → ``torch.cat([torch.cdist(
    rows, Xdb).argmin(dim=1) for rows in Xq.split(512)])``; ``module`` is the model it calls, if any.
    None where the cell has no such expression."""
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    modules = frozenset({module} - {""})
    # A model called on the tensor alone: every such call, whatever keywords it passes.
    plain = tree_of(expr)
    plain_call = plain is not None and isinstance(plain.body[0], ast.Expr) and len(plain.body) == 1
    plain_call = plain_call and _calls_on(plain.body[0].value, module, arg)
    # The comprehension's variable lives in its own scope: fresh against what the cell names is enough.
    rows = fresh_name("rows", source)
    edits = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.expr):
            continue
        if not (_calls_on(node, module, arg) if plain_call else src.segment(node) == expr):
            continue
        found = row_wise(node, modules)
        if found is None or found.spine.id != arg:
            continue
        start, end = src.span(node)
        at, to = src.span(found.spine)
        if found.splat:
            # A dict of tensors splatted into the model: each chunk is the dict of its rows.
            key, value = fresh_name("key", source), fresh_name("value", source)
            part = f"{{{key}: {value}[{rows}:{rows} + {chunk}] for {key}, {value} in {arg}.items()}}"
            per_chunk = source[start:at] + part + source[to:end]
            starts = f"range(0, len(next(iter({arg}.values()))), {chunk})"
            edits.append((start, end, f"torch.cat([{per_chunk} for {rows} in {starts}])"))
            continue
        per_chunk = source[start:at] + rows + source[to:end]
        edits.append((start, end, f"torch.cat([{per_chunk} for {rows} in {arg}.split({chunk})])"))
    if not edits:
        return None
    return _checked(("" if _names_torch(tree) else "import torch\n") + _apply(source, edits))


def micro_batch_source(
    source: str, names: tuple[str, ...], rows: int, most: int, taken: Iterable[str] = frozenset()
) -> str | None:
    """The cell with its training step on whole tensors (``whole_step``) run on micro-batches of at most
    ``most`` of their ``rows``: the statements from the forward pass to the backward pass loop over
    ``zip(X.tensor_split(k), y.tensor_split(k))`` (rows the step slices itself: ``chunk.split(most)``)
    with ``names`` read through their micro-batch, each
    micro-batch's loss weighted by its share of the rows (its mean over all of them, as before), the
    gradients summed by the backward passes; ``zero_grad()`` before the micro-batches and the optimizer's
    ``step()`` after them run once per step, as before. Lines after the backward pass that read both what
    the step computed and an input read the last micro-batch of that input. The micro-batches' names
    (``X_rows``) are fresh against the cell and ``taken``. None where the cell has no such step."""
    step = whole_step(source)
    if step is None or not names or not set(names) <= set(step.inputs) or most >= rows:
        return None
    found = step.span(names)
    if found is None:
        return None
    first, before, after = found
    parts = -(-rows // max(1, most))
    src = SourceText(source)
    span = step.block[first : step.last + 1]
    moved = [*before, *after]
    inner = [stmt for stmt in span if not any(stmt is m for m in moved)]
    chunk: dict[str, str] = {}
    for name in names:
        chunk[name] = fresh_name(f"{name}_rows", source, *chunk.values(), taken=taken)
    edits = [
        (*src.span(n), chunk[n.id])
        for stmt in inner
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name) and n.id in chunk and isinstance(n.ctx, ast.Load)
    ]
    computed = {
        n.id
        for stmt in inner
        for n in ast.walk(stmt)
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)
    }
    for stmt in step.block[step.last + 1 :]:
        read = [n for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)]
        if any(n.id in computed for n in read):
            edits.extend((*src.span(n), chunk[n.id]) for n in read if n.id in chunk)
    loss = _loss_of(step.backward)
    if not re.search(r"""reduction\s*=\s*["']sum["']""", source):
        text = src.segment(loss)
        atomic = isinstance(loss, (ast.Name, ast.Attribute, ast.Call, ast.Subscript))
        # `(a + b).backward()`: the weight multiplies the whole loss, inside the parentheses it had.
        text = text if atomic else f"({text})"
        lead = names[0]
        text = f"{text} * len({chunk[lead]}) / len({lead})"
        outer = atomic and loss is step.backward.func.value
        edits.append((*src.span(loss), f"({text})" if outer else text))
    edited = _apply(source, edits).split("\n")
    indent = src.lines[span[0].lineno - 1][: span[0].col_offset]
    top, bottom = span[0].lineno - 1, span[-1].end_lineno
    taken_lines = {i for m in moved for i in range(m.lineno - 1, m.end_lineno)}
    targets = ", ".join(chunk[n] for n in names)
    # Rows a step slices itself can come short (the last slice of the data): `split` by the most rows
    # never makes an empty micro-batch, whose mean loss would be NaN; whole tensors split evenly.
    sliced = set(names) <= {n for n, _ in step.sizes}
    splits = [f"{n}.split({most})" if sliced else f"{n}.tensor_split({parts})" for n in names]
    over = splits[0] if len(names) == 1 else f"zip({', '.join(splits)})"
    body = [
        f"    {line}" if line.strip() else line
        for i, line in enumerate(edited[top:bottom], top)
        if i not in taken_lines
    ]
    region = [
        *(edited[i] for m in before for i in range(m.lineno - 1, m.end_lineno)),
        f"{indent}for {targets} in {over}:",
        *body,
        *(edited[i] for m in after for i in range(m.lineno - 1, m.end_lineno)),
    ]
    return _checked("\n".join([*edited[:top], *region, *edited[bottom:]]))


def _calls_on(node: ast.expr, module: str, arg: str) -> bool:
    """Whether ``node`` is ``module(arg, ...)``: the model called on the tensor alone, keywords aside."""
    return (
        bool(module)
        and isinstance(node, ast.Call)
        and dotted_name(node.func) == module
        and len(node.args) == 1
        and isinstance(node.args[0], ast.Name)
        and node.args[0].id == arg
    )


def rebuild_loader(source: str, keyword: str, variable: str, batch_size: int) -> str | None:
    """The cell passing, where it passes the loader ``variable`` by ``keyword``, a new one over the same
    data with ``batch_size`` (``dataloaders=val_loader`` → ``dataloaders=torch.utils.data.DataLoader(
    val_loader.dataset, batch_size=128, collate_fn=val_loader.collate_fn, num_workers=val_loader.
    num_workers)``). None where the cell does not pass it so."""
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    new = (
        f"torch.utils.data.DataLoader({variable}.dataset, batch_size={batch_size}, "
        f"collate_fn={variable}.collate_fn, num_workers={variable}.num_workers)"
    )
    edits = [
        (*src.span(k.value), new)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        for k in node.keywords
        if k.arg == keyword and isinstance(k.value, ast.Name) and k.value.id == variable
    ]
    # Passed by position (`trainer.validate(model, val_loader)`): where that method takes ``keyword``.
    at = {"dataloaders": ("validate", "test", "predict"), "val_dataloaders": ("fit",)}.get(keyword, ())
    edits += [
        (*src.span(a), new)
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in at
        for a in node.args[(2 if node.func.attr == "fit" else 1) :][:1]
        if isinstance(a, ast.Name) and a.id == variable
    ]
    if not edits:
        return None
    return _checked(("" if _names_torch(tree) else "import torch\n") + _apply(source, edits))


def pass_hook_loader(source: str, hook: str, hook_source: str, batch_size: int) -> str | None:
    """The cell with the loader that ``hook`` (a LightningModule's ``val_dataloader``, defined in an
    earlier cell: ``hook_source``) returns, its ``batch_size=`` set to ``batch_size``, passed to the
    trainer's call that would read the hook (``trainer.validate(model)`` →
    ``trainer.validate(model, dataloaders=DataLoader(model.ds, batch_size=128))``). ``self`` in the hook
    becomes the model the call is given. None where the hook is more than one ``return`` of an expression,
    or the cell's call passes loaders or a datamodule already."""
    from .source import lightning_calls

    hook_tree = tree_of(hook_source)
    tree = tree_of(source)
    if hook_tree is None or tree is None:
        return None
    func = next(
        (
            n
            for n in ast.walk(hook_tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == hook
        ),
        None,
    )
    if func is None:
        return None
    body = [s for s in func.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], ast.Return) or body[0].value is None:
        return None
    returned = body[0].value
    hook_src = SourceText(hook_source)
    literal = next(
        (
            k.value
            for c in ast.walk(returned)
            if isinstance(c, ast.Call) and dotted_name(c.func).endswith("DataLoader")
            for k in c.keywords
            if k.arg == "batch_size" and int_literal(k.value) is not None
        ),
        None,
    )
    if literal is None:
        return None
    selves = [n for n in ast.walk(returned) if isinstance(n, ast.Name) and n.id == "self"]
    src = SourceText(source)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        keyword = next((kw for method, kw in lightning_calls(hook) if node.func.attr == method), None)
        passed = {k.arg for k in node.keywords}
        model = (
            node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "model"), None)
        )
        if keyword is None or keyword in passed or "datamodule" in passed or len(node.args) > 1:
            continue
        if not isinstance(model, (ast.Name, ast.Attribute)) or "?" in dotted_name(model):
            continue
        start, _ = hook_src.span(returned)
        loader_edits = [(*hook_src.span(literal), str(batch_size))]
        loader_edits += [(*hook_src.span(n), src.segment(model)) for n in selves]
        text = _apply(hook_source, loader_edits)
        shift = len(text) - len(hook_source)
        expr = text[start : hook_src.span(returned)[1] + shift]
        if "\n" in expr:
            expr = " ".join(line.strip() for line in expr.splitlines())
        edits.append(_insert_keyword(src, node, f"{keyword}={expr}"))
    return _checked(_apply(source, edits)) if edits else None


# --- long samples -------------------------------------------------------------------------------------

TRUNCATED_COLLATE = '''\
def truncated(collate, max_length):
    """`collate` with each sample's token lists cut to `max_length` first (a collator pads; it never cuts)."""
    keys = ("input_ids", "attention_mask", "token_type_ids", "labels", "special_tokens_mask")

    def collate_cut(features):
        cut = [{k: v[:max_length] if k in keys else v for k, v in f.items()} if hasattr(f, "items") else f
               for f in features]
        return collate(cut)

    return collate_cut
'''

TOO_LONG = '''\
def too_long(batch, max_length):
    """Whether a batch of token ids (a tensor, or a mapping with input_ids) is longer than `max_length`."""
    ids = batch["input_ids"] if hasattr(batch, "keys") else batch
    return ids.shape[-1] > max_length
'''

# Where a collator goes: a DataLoader's `collate_fn=`, a transformers Trainer's `data_collator=`.
_COLLATOR_KEYWORDS = ("collate_fn", "data_collator")


def truncate_source(source: str, max_length: int, taken: Iterable[str] = frozenset()) -> str | None:
    """The cell with its inputs cut to ``max_length`` tokens: ``truncation=True, max_length=N`` in its
    tokenizer calls (an existing max_length stays); where it has none, each collator it passes
    (``collate_fn=``, ``data_collator=``) wrapped to cut the samples before padding them (by ``truncated``,
    defined at the top of the cell under a name fresh against the cell and ``taken``). None where the cell
    has neither."""
    from .source import tokenizer_calls

    new = source
    for func in tokenizer_calls(source):
        cut = set_call_keyword(new, func, "truncation", True)
        new = (cut and set_call_keyword(cut, func, "max_length", max_length, replace=False)) or new
    if new != source:
        return new
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    helper = fresh_name("truncated", source, taken=taken)
    edits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            for kw in node.keywords:
                if kw.arg in _COLLATOR_KEYWORDS:
                    edits.append((*src.span(kw.value), f"{helper}({src.segment(kw.value)}, {max_length})"))
    if not edits:
        return None
    return _checked(_renamed(TRUNCATED_COLLATE, "truncated", helper) + "\n\n" + _apply(source, edits))


def _renamed(definition: str, name: str, new: str) -> str:
    """``definition`` (one of the functions above) defining ``new`` instead of ``name``."""
    return definition.replace(f"def {name}(", f"def {new}(", 1)


def skip_long_source(
    source: str, name: str, max_length: int, taken: Iterable[str] = frozenset()
) -> str | None:
    """The cell with each training loop skipping the batches longer than ``max_length`` tokens: ``if
    too_long(name, N): continue`` right after the loop binds ``name`` (its target, or an assignment in its
    body), with ``too_long`` defined at the top of the cell under a name fresh against the cell and
    ``taken``. None where no training loop binds ``name``."""
    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    helper = fresh_name("too_long", source, taken=taken)
    loops = [n for n in ast.walk(tree) if isinstance(n, ast.For) and _trains_in(n)]
    edits = []
    for loop in loops:
        bound = next(
            (
                s
                for s in loop.body
                if isinstance(s, ast.Assign)
                and any(isinstance(t, ast.Name) and t.id == name for t in s.targets)
            ),
            None,
        )
        first = loop.body[0]
        indent = src.lines[first.lineno - 1][: first.col_offset]
        guard = f"{indent}if {helper}({name}, {max_length}):\n{indent}    continue\n"
        if bound is not None:
            at = src.starts[bound.end_lineno] if bound.end_lineno < len(src.lines) else len(source)
            edits.append((at, at, guard))
        elif isinstance(loop.target, ast.Name) and loop.target.id == name:
            at = src.starts[first.lineno - 1]
            edits.append((at, at, guard))
    if not edits:
        return None
    return _checked(_renamed(TOO_LONG, "too_long", helper) + "\n\n" + _apply(source, edits))


# What an Adam-family optimizer's call keeps when it becomes torch's Adafactor: the parameters, and the
# keywords both take with the same meaning; betas, eps and amsgrad have no counterpart.
_FACTORED_KEYWORDS = ("lr", "weight_decay", "foreach", "maximize")


def factored_optimizer_source(source: str) -> str | None:
    """The cell with every Adam-family optimizer it makes replaced by ``torch.optim.Adafactor`` (torch ≥
    2.5): its second moment kept as a row and a column statistic of each matrix, and no first moment. The
    parameters and the learning rate, weight decay, ``foreach`` and ``maximize`` carry over. None when the
    cell makes none."""
    from .source import ADAM_FAMILY

    tree = tree_of(source)
    if tree is None:
        return None
    src = SourceText(source)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.args):
            continue
        if dotted_name(node.func).rsplit(".", 1)[-1] not in ADAM_FAMILY:
            continue
        args = [src.segment(node.args[0])]
        if len(node.args) > 1:
            args.append(f"lr={src.segment(node.args[1])}")
        args += [f"{k.arg}={src.segment(k.value)}" for k in node.keywords if k.arg in _FACTORED_KEYWORDS]
        edits.append((*src.span(node), f"torch.optim.Adafactor({', '.join(args)})"))
    if not edits:
        return None
    return _checked(("" if _names_torch(tree) else "import torch\n") + _apply(source, edits))


def checkpoint_calls_source(source: str, names: list[str] | tuple[str, ...]) -> str | None:
    """The cell with each direct call of the modules ``names`` (``tower(x)``) made through
    ``torch.utils.checkpoint.checkpoint``: the module's inner activations are not kept for the backward
    pass but computed again there. Calls where gradients are off stay as they are. None when the cell
    makes no such call."""
    from .source import grad_off_lines

    tree = tree_of(source)
    if tree is None or not names:
        return None
    src = SourceText(source)
    off = grad_off_lines(source)
    edits = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in names):
            continue
        if node.lineno in off or any(isinstance(a, ast.Starred) for a in node.args):
            continue
        if any(k.arg is None for k in node.keywords):
            continue
        parts = [node.func.id, *(src.segment(a) for a in node.args)]
        parts += [f"{k.arg}={src.segment(k.value)}" for k in node.keywords]
        edits.append(
            (*src.span(node), f"torch.utils.checkpoint.checkpoint({', '.join(parts)}, use_reentrant=False)")
        )
    if not edits:
        return None
    return _checked("import torch.utils.checkpoint\n" + _apply(source, edits))
