"""Read and rewrite a cell's source: find its batch size, change a literal, set a call's keyword.

Pure (``ast`` and ``re`` only). A rewrite replaces just the span of one literal or inserts just one keyword,
so every other byte of the cell stays as the person wrote it. IPython lines that are not Python
(``%time``, ``!pip install``, ``x = !ls``, ``obj?``) are masked while parsing and come back untouched.
"""

from __future__ import annotations

import ast
import difflib
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
    "bs",
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
    reads a variable that holds it) or ``"option"`` (the name came from ``--batch NAME``, the value from the
    namespace).
    """

    name: str
    value: int
    where: str = "source"


@dataclass(frozen=True)
class _Site:
    """One place where the source binds ``name`` to the expression ``value``."""

    name: str
    value: ast.expr
    call: ast.Call | None = None
    keyword: ast.keyword | None = None


class _Source:
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


def _parse(source: str) -> ast.Module | None:
    """Parse a cell, masking IPython-only lines where the parser trips on them; None if it still fails."""
    return _parse_masked(source)[0]


def _parse_masked(source: str) -> tuple[ast.Module | None, list[str]]:
    """The parsed cell and the lines that had to be masked (IPython syntax) to parse it."""
    lines = source.split("\n")
    masked: dict[int, str] = {}
    for _ in range(len(lines) + 1):
        try:
            return ast.parse("\n".join(lines)), list(masked.values())
        except (SyntaxError, ValueError) as err:
            i = (getattr(err, "lineno", None) or 0) - 1
            if not (0 <= i < len(lines)) or i in masked or not _MAGIC_LINE.search(lines[i]):
                break
            masked[i] = lines[i]
            lines[i] = _masked(lines[i])
    # The parser may report an error below the magic line that caused it: mask every candidate at once.
    original = source.split("\n")
    candidates = [line for line in original if _MAGIC_LINE.search(line)]
    lines = [_masked(line) if _MAGIC_LINE.search(line) else line for line in original]
    try:
        return ast.parse("\n".join(lines)), candidates
    except (SyntaxError, ValueError):
        return None, []


def _masked(line: str) -> str:
    # Same indentation keeps an indented block valid; nothing on a masked line is ever edited.
    return line[: len(line) - len(line.lstrip())] + "pass"


def _dotted(node: ast.expr) -> str:
    """``model.generate`` for ``model.generate``; ``?.generate`` where the object is not a plain name."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def _matches(func: ast.expr, name: str) -> bool:
    dotted = _dotted(func)
    return dotted == name or dotted.endswith("." + name)


def _target_names(target: ast.expr) -> Iterator[str]:
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


def _sites(tree: ast.Module) -> list[_Site]:
    """Every assignment, keyword argument and dict entry that binds a name, in source order."""
    found: list[_Site] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                    for t, v in zip(target.elts, node.value.elts, strict=False):
                        found.extend(_Site(n, v) for n in _target_names(t))
                else:
                    found.extend(_Site(n, node.value) for n in _target_names(target))
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            found.extend(_Site(n, node.value) for n in _target_names(node.target))
        elif isinstance(node, ast.Call):
            found.extend(_Site(kw.arg, kw.value, node, kw) for kw in node.keywords if kw.arg)
        elif isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values, strict=False):
                if isinstance(key, ast.Constant) and isinstance(key.value, str):
                    found.append(_Site(key.value, value))
    return sorted(found, key=lambda s: (s.value.lineno, s.value.col_offset))


def _int_literal(node: ast.expr) -> int | None:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    return None


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
    tree = _parse(source)
    sites = _sites(tree) if tree is not None else []
    for wanted in (name,) if name else BATCH_NAMES:
        for site in sites:
            value = _int_literal(site.value)
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


def _is_count(value: object) -> bool:
    return type(value) is int and value >= 1


def rewrite_batch(source: str, guess: BatchGuess, new_value: int, accumulate: int = 1) -> str | None:
    """Return the cell with its batch literal set to ``new_value``; with ``accumulate > 1`` also multiply a
    literal gradient-accumulation setting by it, or add ``gradient_accumulation_steps`` to a
    TrainingArguments call. A plain training loop gets no invented accumulation code. None when the batch
    is not a literal in the cell (the retry then rebinds the variable instead)."""
    tree = _parse(source)
    if tree is None:
        return None
    src = _Source(source)
    sites = _sites(tree)
    batch = [s for s in sites if s.name == guess.name and _int_literal(s.value) is not None]
    batch = [s for s in batch if _int_literal(s.value) == guess.value] or batch
    if not batch:
        return None
    edits = [(*src.span(s.value), str(new_value)) for s in batch]
    if accumulate > 1:
        edits.extend(_accumulation_edits(src, tree, sites, batch, accumulate))
    return _checked(_apply(source, edits))


def accumulates(source: str) -> bool:
    """Whether ``rewrite_batch`` with ``accumulate > 1`` keeps the effective batch inside this cell: it has
    a literal accumulation setting to multiply or a TrainingArguments call to add one to."""
    tree = _parse(source)
    if tree is None:
        return False
    sites = _sites(tree)
    return bool(_accumulation_literals(sites)) or bool(_training_args_calls(tree))


def _accumulation_literals(sites: list[_Site]) -> list[_Site]:
    literal = [s for s in sites if s.name in ACCUMULATION_NAMES and _int_literal(s.value) is not None]
    # `gradient_accumulation_steps=ga` with `ga = 2` above: multiply the 2.
    behind = {s.value.id for s in sites if s.name in ACCUMULATION_NAMES and isinstance(s.value, ast.Name)}
    literal += [s for s in sites if s.name in behind and s.call is None and _int_literal(s.value) is not None]
    return literal


def _training_args_calls(tree: ast.Module) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.Call) and _TRAINING_ARGS.fullmatch(_dotted(n.func).rsplit(".", 1)[-1])
    ]


def _accumulation_edits(
    src: _Source, tree: ast.Module, sites: list[_Site], batch: list[_Site], accumulate: int
) -> list[tuple[int, int, str]]:
    literal = _accumulation_literals(sites)
    if literal:
        return [(*src.span(s.value), str(_int_literal(s.value) * accumulate)) for s in literal]
    if any(s.name in ACCUMULATION_NAMES for s in sites):
        return []  # set from a variable we cannot see into: leave it, the explanation says so
    edits = []
    for call in _training_args_calls(tree):
        anchor = next((s.keyword for s in batch if s.call is call), None)
        edits.append(_insert_keyword(src, call, f"gradient_accumulation_steps={accumulate}", anchor))
    return edits


def _insert_keyword(
    src: _Source, call: ast.Call, text: str, anchor: ast.AST | None = None
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


def _apply(source: str, edits: list[tuple[int, int, str]]) -> str:
    for start, end, text in sorted(edits, key=lambda e: (e[0], e[1]), reverse=True):
        source = source[:start] + text + source[end:]
    return source


def _checked(source: str) -> str | None:
    return source if _parse(source) is not None else None


def set_call_keyword(
    source: str, func_attr: str, keyword: str, value: object, replace: bool = True
) -> str | None:
    """Return the cell with ``keyword=value`` in every call to ``func_attr`` (``generate`` matches
    ``model.generate(...)``; ``tokenizer`` matches ``tokenizer(...)``), replacing the keyword's value
    where it is already passed (left as it is with ``replace=False``). None when the cell makes no such
    call."""
    tree = _parse(source)
    if tree is None:
        return None
    src = _Source(source)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _matches(n.func, func_attr)]
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


def insert_after_assignment(source: str, name: str, statement: str) -> str | None:
    """Return the cell with ``statement`` on its own line after the last top-level assignment to
    ``name`` (``model = AutoModel...`` → ``model.gradient_checkpointing_enable()`` below it); None when
    the cell does not assign ``name`` at top level. A retry re-creates such objects, so a setting made
    on the old one in the namespace would not reach the new one."""
    tree = _parse(source)
    if tree is None:
        return None
    assigned = [
        node
        for node in tree.body
        if isinstance(node, (ast.Assign, ast.AnnAssign))
        and name
        in {n for t in getattr(node, "targets", [getattr(node, "target", None)]) for n in _target_names(t)}
    ]
    if not assigned:
        return None
    end = assigned[-1].end_lineno
    lines = source.split("\n")
    indent = lines[assigned[-1].lineno - 1][
        : len(lines[assigned[-1].lineno - 1]) - len(lines[assigned[-1].lineno - 1].lstrip())
    ]
    return _checked("\n".join([*lines[:end], indent + statement, *lines[end:]]))


def calls_with_keyword(source: str, keyword: str) -> tuple[str, ...]:
    """The called names (``pipe``, ``model.generate``) of the calls that pass ``keyword``, in source order."""
    tree = _parse(source)
    if tree is None:
        return ()
    found = [s.call for s in _sites(tree) if s.call is not None and s.name == keyword]
    return tuple(dict.fromkeys(_dotted(c.func) for c in found))


def tokenizer_calls(source: str) -> tuple[str, ...]:
    """The called names in the cell that look like tokenizer calls (``tokenizer(...)``,
    ``tok.batch_encode_plus(...)``, ``processor(...)``): where ``truncation=True`` belongs."""
    tree = _parse(source)
    if tree is None:
        return ()
    names = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        dotted = _dotted(node.func)
        last = dotted.rsplit(".", 1)[-1]
        if _TOKENIZER.fullmatch(last) or (
            last in ("encode", "encode_plus", "batch_encode_plus", "apply_chat_template")
            and "." in dotted
            and _TOKENIZER.fullmatch(dotted.rsplit(".", 2)[-2])
        ):
            names.append(dotted)
    return tuple(dict.fromkeys(names))


def names_read(source: str) -> set[str]:
    """Names whose value from before the cell the cell reads: read on or before the line that first
    assigns them (a name the cell builds afresh is not among them). Every identifier if the cell does not
    parse, and every identifier on an IPython line (``%time trainer.train()``), to stay on the safe side."""
    tree, masked = _parse_masked(source)
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
    return read.union(*(_IDENTIFIER.findall(line) for line in masked))


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
