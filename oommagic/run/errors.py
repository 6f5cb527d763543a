"""The exception an out-of-memory ``%%gpumem`` cell ends with.

It is a ``torch.OutOfMemoryError`` (a subclass, made on first use so that ``import oommagic`` does not
import torch): ``except torch.OutOfMemoryError`` around ``run_cell`` catches it, ``oommagic.is_oom`` knows
it, and ``str(err)`` is PyTorch's own message, which ``oommagic.parse_oom`` reads. It is raised fresh by the
magic, with no traceback of the failed cell, so it pins none of that cell's memory. IPython shows its
one-line summary (``_render_traceback_``) instead of a traceback: the report above says the rest.
"""

from __future__ import annotations

from typing import Any

_CLASS: Any = None


def out_of_memory_error(message: str, summary: str) -> BaseException:
    """A ``torch.OutOfMemoryError`` whose text is ``message`` and whose display is ``summary``."""
    global _CLASS
    if _CLASS is None:
        import torch

        class OutOfMemoryError(torch.OutOfMemoryError):
            """The cell ran out of memory; its memory was given back and the report is shown above."""

            summary = ""

            def _render_traceback_(self) -> list[str]:
                return [f"\x1b[0;31mOutOfMemoryError\x1b[0m: {self.summary}"]

        OutOfMemoryError.__module__ = __name__
        _CLASS = OutOfMemoryError
    err = _CLASS(message)
    err.summary = summary
    return err
