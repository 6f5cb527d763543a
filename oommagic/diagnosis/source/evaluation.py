"""Evaluation: where gradients are off, the evaluation's own batch (a Trainer's eval batch, a Lightning
loader), and the span of the cell's work.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass

from .parse import binding_sites, called_names, dotted_name, int_literal, tree_of

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


# Where each trainer method takes those loaders by position (`trainer.validate(model, val_loader)`).
_POSITIONS = {"validate": 1, "test": 1, "predict": 1, "fit": 2}


def _loader_passed(node: ast.Call, method: str, keyword: str) -> ast.expr | None:
    """What the call ``node`` of ``method`` passes for ``keyword``: by that keyword, or by its position."""
    if node.func.attr != method:
        return None
    passed = next((k.value for k in node.keywords if k.arg == keyword), None)
    at = _POSITIONS.get(method)
    if passed is None and at is not None and len(node.args) > at:
        passed = node.args[at]
    return None if isinstance(passed, ast.Starred) else passed


def passed_loader(source: str, hook: str) -> tuple[str, str | None] | None:
    """(keyword, the name passed, or None for an expression) where the cell hands the trainer the loaders
    ``hook`` would make (``trainer.validate(model, dataloaders=val_loader)``, or by position:
    ``trainer.validate(model, val_loader)``); None where it passes none."""
    tree = tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            for method, keyword in _LIGHTNING_STAGES.get(hook, ()):
                passed = _loader_passed(node, method, keyword)
                if passed is not None:
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
            passed = _loader_passed(node, method, keyword)
            if passed is not None:
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


# The classes a Hugging Face Trainer takes its settings from: TrainingArguments and its subclasses
# (Seq2SeqTrainingArguments, TRL's configs).
TRAINING_ARGUMENTS = re.compile(r"(\w*TrainingArguments|SFTConfig|DPOConfig|ORPOConfig|KTOConfig|GRPOConfig)")


def arguments_calls(source: str) -> tuple[str, ...]:
    """The names of the Trainer-argument classes the cell calls (``TrainingArguments``,
    ``Seq2SeqTrainingArguments``, ``SFTConfig``), in source order, each once."""
    tree = tree_of(source)
    if tree is None:
        return ()
    found: dict[str, None] = {}
    for node in sorted(
        (n for n in ast.walk(tree) if isinstance(n, ast.Call)), key=lambda n: (n.lineno, n.col_offset)
    ):
        last = dotted_name(node.func).rsplit(".", 1)[-1]
        if TRAINING_ARGUMENTS.fullmatch(last):
            found[last] = None
    return tuple(found)


def assigned_names(source: str) -> frozenset[str]:
    """The plain names the cell binds (``trainer = Trainer(...)``, loop targets, ``with ... as``): objects
    every run of it makes anew."""
    tree = tree_of(source)
    if tree is None:
        return frozenset()
    return frozenset(n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store))
