"""The cell, parsed once: IPython syntax masked, and the readers every topic shares (names, calls,
bindings, literals, keywords).

``parse_cell`` masks IPython lines (``%time``, ``!pip``, ``x = !ls``, ``obj?``) so that a cell with them
reads like the same cell without them: ``%time expr`` keeps ``expr`` (as ``pass; expr``, same columns), other
IPython lines become ``pass``. Parses are cached by text, so the diagnosis, the remedies and the rewrites of
one cell share one tree.

Pure (``ast`` and ``re`` only).
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterator
from dataclasses import dataclass

_MAGIC_LINE = re.compile(r"^\s*[%!?]|^\s*[\w.]+(?:\s*,\s*[\w.]+)*\s*=\s*[%!]|^\s*[\w.\[\]()]+\?\??\s*$")


IDENTIFIER = re.compile(r"[A-Za-z_]\w*")


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


def contains(outer: ast.AST, node: ast.AST) -> bool:
    """Whether ``node`` is ``outer`` or inside it."""
    return any(n is node for n in ast.walk(outer))


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


def calls_with_keyword(source: str, keyword: str) -> tuple[str, ...]:
    """The called names (``pipe``, ``model.generate``) of the calls that pass ``keyword``, in source order."""
    tree = tree_of(source)
    if tree is None:
        return ()
    found = [s.call for s in binding_sites(tree) if s.call is not None and s.name == keyword]
    return tuple(dict.fromkeys(dotted_name(c.func) for c in found))


def names_read(source: str) -> set[str]:
    """Names whose value from before the cell the cell reads: read on or before the line that first
    assigns them (a name the cell builds afresh is not among them). Every identifier if the cell does not
    parse, and every identifier on an IPython line masked away (``!cmd $x``), to stay on the safe side."""
    parsed = parse_cell(source)
    tree = parsed.tree
    if tree is None:
        return set(IDENTIFIER.findall(source))
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
    return read.union(*(IDENTIFIER.findall(line) for line in parsed.masked))


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


# The one input a transformers model takes by keyword, and the fields of its output that are one tensor
# with a row per input row (its output object itself is no tensor: read through one of these).
MODEL_INPUTS = frozenset({"input_ids", "pixel_values", "inputs_embeds", "input_values", "input_features"})


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
