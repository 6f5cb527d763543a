"""A script the cell launches on ranks through a shell line (``!torchrun --nproc_per_node 2 train.py
--batch-size 64``): which script, and the batch and accumulation settings it takes on its command line.

A script's own text is the person's file: a fix does not rewrite it. Where the script reads its batch (and
its gradient accumulation) from its command line, through ``argparse``, the fix changes the cell's command
line instead; trials, the button and "Apply to cell" then all run the same cell, and the script is left as
it is. Pure (``ast``, ``re``, ``shlex``): the caller reads the script's text.
"""

from __future__ import annotations

import ast
import re
import shlex
from dataclasses import dataclass

from .batch import ACCUMULATION_NAMES, BATCH_NAMES, BatchGuess

# Launchers that run a Python script on several ranks; the script is the first argument ending in ``.py``.
_LAUNCHERS = ("torchrun", "torch.distributed.run", "torch.distributed.launch", "accelerate", "deepspeed")
_SHELL_LINE = re.compile(r"^(\s*)!(?!!)(.*)$")
# `{expr}` and `$name`: IPython's expansions of a shell line.
_EXPANSION = re.compile(r"\{([^{}]*)\}|\$(\w+)")


@dataclass(frozen=True)
class Flag:
    """One option of the script's ``argparse`` parser: its option strings, its destination and default."""

    options: tuple[str, ...]
    dest: str
    default: int | None

    @property
    def written(self) -> str:
        """The spelling a rewrite adds: the longest option string (``--batch-size`` over ``-b``)."""
        return max(self.options, key=len)


@dataclass(frozen=True)
class Launch:
    """A shell line of the cell that launches ``script`` (as written, after expansion) on ranks: the line's
    index in the cell, and the arguments after the script (expanded)."""

    line: int
    script: str
    arguments: tuple[str, ...]


def launch(source: str, expand: dict[str, str] | None = None) -> Launch | None:
    """The first shell line of ``source`` that runs a script through a distributed launcher. ``expand``:
    values of the names the line expands (``{name}`` or ``$name``); an expansion of anything else leaves
    its token unread."""
    for index, text in enumerate(source.splitlines()):
        shell = _SHELL_LINE.match(text)
        if shell is None or not any(name in shell.group(2) for name in _LAUNCHERS):
            continue
        line = _EXPANSION.sub(
            lambda m, known=expand or {}: known.get(m.group(1) or m.group(2), m.group(0)), shell.group(2)
        )
        try:
            tokens = shlex.split(line, comments=True)
        except ValueError:
            continue
        for i, token in enumerate(tokens):
            if token.endswith(".py") and "{" not in token and "$" not in token:
                return Launch(index, token, tuple(tokens[i + 1 :]))
    return None


def parser_flags(script: str) -> tuple[Flag, ...]:
    """The options of the ``argparse`` parsers in ``script`` that hold a number: ``add_argument("--batch-
    size", type=int, default=64)`` and the like (a default that is not an int literal reads as None)."""
    try:
        tree = ast.parse(script)
    except (SyntaxError, ValueError):
        return ()
    flags = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "add_argument":
            continue
        options = tuple(
            a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)
        )
        if not options or not all(o.startswith("-") for o in options):
            continue
        keywords = {k.arg: k.value for k in node.keywords if k.arg}
        dest = keywords.get("dest")
        if isinstance(dest, ast.Constant) and isinstance(dest.value, str):
            name = dest.value
        else:
            longest = max(options, key=len)
            name = longest.lstrip("-").replace("-", "_")
        default = keywords.get("default")
        value = default.value if isinstance(default, ast.Constant) else None
        flags.append(Flag(options, name, value if type(value) is int else None))
    return tuple(flags)


def _given(flag: Flag, arguments: tuple[str, ...]) -> int | None:
    """The value ``arguments`` give ``flag`` (its last mention wins, as argparse reads it)."""
    found = None
    for i, token in enumerate(arguments):
        for option in flag.options:
            if token == option and i + 1 < len(arguments):
                found = arguments[i + 1]
            elif token.startswith(option + "="):
                found = token[len(option) + 1 :]
    if found is None:
        return None
    try:
        return int(found)
    except ValueError:
        return None


def command_batch(source: str, script: str, expand: dict[str, str] | None = None) -> BatchGuess | None:
    """The batch a launched script takes on the cell's command line, ``where="command"``: ``name`` is its
    option as a rewrite writes it, ``path`` (the option strings), ``accumulation`` the accumulation option
    and its value (1 where the script's default is not a number) where the script has one."""
    found = launch(source, expand)
    if found is None:
        return None
    flags = {f.dest: f for f in parser_flags(script)}
    batch = next((flags[n] for n in BATCH_NAMES if n in flags), None)
    if batch is None:
        return None
    value = _given(batch, found.arguments) or batch.default
    if value is None or value < 1:
        return None
    acc = next((flags[n] for n in ACCUMULATION_NAMES if n in flags), None)
    accumulation = None
    if acc is not None:
        accumulation = (acc.written, _given(acc, found.arguments) or acc.default or 1)
    return BatchGuess(batch.written, value, "command", accumulation, path=(str(found.line), *batch.options))


def command_source(source: str, guess: BatchGuess, new: int, acc: int) -> tuple[str | None, bool]:
    """(the cell with the launch line passing ``new`` for the batch and the accumulation scaled by ``acc``,
    whether the accumulation was written). A value the line already passes is replaced where it stands;
    one it does not is added at the line's end, where argparse reads it last."""
    lines = source.splitlines(keepends=True)
    index = int(guess.path[0])
    if index >= len(lines):
        return None, False
    line = _set_option(lines[index], guess.path[1:], guess.name, new)
    keeps = acc <= 1
    if acc > 1 and guess.accumulation is not None:
        option, steps = guess.accumulation
        line = _set_option(line, (option,), option, steps * acc)
        keeps = True
    lines[index] = line
    return "".join(lines), keeps


def _set_option(line: str, options: tuple[str, ...], written: str, value: int) -> str:
    body, end = (line[:-1], "\n") if line.endswith("\n") else (line, "")
    cut = _comment_at(body)
    body, comment = body[:cut], body[cut:]
    alternatives = "|".join(re.escape(o) for o in sorted(options, key=len, reverse=True))
    given = re.compile(rf"(?<![\w-])({alternatives})(=|\s+)(\d+)\b")
    if given.search(body):
        return given.sub(lambda m: f"{m.group(1)}{m.group(2)}{value}", body) + comment + end
    spaced = f" {comment.lstrip()}" if comment else ""
    return f"{body.rstrip()} {written} {value}{spaced}{end}"


def _comment_at(body: str) -> int:
    """Where a shell comment starts in ``body`` (a ``#`` after a space, outside quotes), else its length."""
    quote = ""
    for i, char in enumerate(body):
        if quote:
            quote = "" if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or body[i - 1].isspace()):
            return i
    return len(body)
