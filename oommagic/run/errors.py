"""The exception a failed ``%%gpumem`` cell ends with, and how IPython shows it.

An out-of-memory cell ends with a ``torch.OutOfMemoryError`` (a subclass, made on first use so that
``import oommagic`` does not import torch): ``except torch.OutOfMemoryError`` around ``run_cell`` catches it,
``oommagic.is_oom`` knows it, and ``str(err)`` is the runtime's own message, which ``oommagic.parse_oom``
reads. Where the runtime raised a type of its own (``torch.AcceleratorError`` for ``CUDA error: out of
memory``, a ``RuntimeError`` from MPS), the error is an instance of that type too, so an ``except`` written
for it still catches it. It is raised fresh by the magic, with no traceback of the failed cell, so it pins
none of that cell's memory. IPython shows its one-line summary (``_render_traceback_``) instead of a
traceback: the report above says the rest.

Any other exception ends the cell unchanged, and ``show_as_without_the_magic`` makes IPython show it as it
does in a cell without the magic: the cell's own frames, not the magic's.
"""

from __future__ import annotations

import sys
from typing import Any

_CLASS: Any = None
# The runtime's own class -> the tool's error that is also one of it (made once per class).
_ALSO: dict[type, type] = {}


def out_of_memory_error(message: str, summary: str = "", like: type | None = None) -> BaseException:
    """A ``torch.OutOfMemoryError`` whose text is ``message`` and whose display is ``summary``; an instance of
    ``like`` (the class the runtime raised) too, where the two classes can be combined."""
    cls = _also(_tool_class(), like) if like is not None else _tool_class()
    try:
        # __new__ only: the runtime's class may want other arguments in its __init__ (CuPy's wants sizes).
        err = cls.__new__(cls, message)
    except TypeError:
        cls = _tool_class()
        err = cls.__new__(cls, message)
    err.summary = summary
    return err


def _tool_class() -> type:
    global _CLASS
    if _CLASS is None:
        import torch

        class OutOfMemoryError(torch.OutOfMemoryError):
            """The cell ran out of memory; its memory was given back and the report is shown above."""

            summary = ""
            # The runtime's class may format itself from fields this error does not have.
            __str__ = BaseException.__str__
            __repr__ = BaseException.__repr__

            def _render_traceback_(self) -> list[str]:
                return [f"\x1b[0;31mOutOfMemoryError\x1b[0m: {self.summary}"]

        OutOfMemoryError.__module__ = __name__
        OutOfMemoryError.__qualname__ = "OutOfMemoryError"
        _CLASS = OutOfMemoryError
    return _CLASS


def _also(tool: type, like: type) -> type:
    if issubclass(tool, like):
        return tool
    cls = _ALSO.get(like)
    if cls is None:
        try:
            cls = type(tool.__name__, (tool, like), {"__module__": __name__, "__doc__": tool.__doc__})
            cls.__qualname__ = tool.__qualname__
        except TypeError:  # layouts that cannot be combined (a class with slots or C fields of its own)
            cls = tool
        _ALSO[like] = cls
    return cls


def show_as_without_the_magic(shell: Any, error: BaseException) -> None:
    """Make ``shell`` show ``error``, which the magic is about to raise, as IPython shows it in a cell without
    the magic: a cell that does not compile as IPython's own syntax error (no frames; the runner gives such
    an error no traceback), any other error with the cell's own frames, not the magic's. Holds for the
    next error ``shell`` shows, whichever it is: a caller that catches ``error`` itself leaves nothing
    behind but a hook that steps aside at the next error."""
    cell_frames = error.__traceback__
    before = vars(shell).get("showtraceback")
    if getattr(before, "shows_once", False):
        before = before.before
    plain = type(shell).showtraceback.__get__(shell) if before is None else before

    def showtraceback(exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        if before is None:
            vars(shell).pop("showtraceback", None)
        else:
            shell.showtraceback = before
        shown = exc_tuple[1] if exc_tuple is not None else sys.exc_info()[1]
        if shown is not error or isinstance(error, SystemExit):
            return plain(exc_tuple, *args, **kwargs)
        if isinstance(error, SyntaxError) and cell_frames is None:
            if isinstance(error, IndentationError):
                return shell.showindentationerror()
            return shell.showsyntaxerror()
        return plain((type(error), error, cell_frames), *args, **kwargs)

    showtraceback.shows_once = True
    showtraceback.before = before
    shell.showtraceback = showtraceback
