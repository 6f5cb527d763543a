"""What a script the cell launches on ranks printed, where its ranks record nothing themselves.

``!torchrun train.py`` runs another program: its ranks report to the cell only through ``with
oommagic.rank_recorder(): main()``. A script without that call still prints its out-of-memory error into
the cell's output, and ``torchrun`` returns: the cell would read "[ok]" while a rank ran out. ``OutputTail``
keeps the last of what the cell prints while it launches such a script (IPython prints a shell line's output
through ``sys.stdout``), and ``rank_oom_in`` finds a rank's out-of-memory error in it.
"""

from __future__ import annotations

import re
import sys
from typing import Any

from ..diagnosis.source import launch
from ..oom import OOMReport, parse_oom

# Enough for a rank's traceback and message (torch's message is under 1 KiB; tracebacks some KiB).
KEEP = 64 * 1024
_RANK = re.compile(r"\[\s*rank\s*(\d{1,6})\s*\]")
# torchrun's summary names the rank whose failure came first.
_ROOT_CAUSE = re.compile(
    r"Root Cause \(first observed failure\):\s*\[\d+\]:(?:\s*\w+\s*:[^\n]*\n){0,4}?\s*rank\s*:\s*(\d{1,6})"
)
_OOM_LINE = re.compile(r"OutOfMemoryError|out of memory", re.IGNORECASE)


class _Kept:
    """The last ``KEEP`` characters or more written, in pieces (joined only when they pass twice that)."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.size = 0

    def add(self, text: str) -> None:
        self.pieces.append(text)
        self.size += len(text)
        if self.size > 2 * KEEP:
            self.pieces = ["".join(self.pieces)[-KEEP:]]
            self.size = KEEP


class _Tee:
    """A stream that writes through to ``stream`` and keeps what it writes in ``into``."""

    def __init__(self, stream: Any, into: _Kept) -> None:
        self._stream, self._into = stream, into

    def write(self, text: str) -> Any:
        if isinstance(text, str):
            self._into.add(text)
        return self._stream.write(text)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


class OutputTail:
    """Around a run: while the cell launches a script on ranks (a shell line of ``torchrun``, ``accelerate
    launch`` …), the last of what it prints to ``sys.stdout`` and ``sys.stderr``; otherwise nothing is
    touched."""

    def __init__(self, source: str) -> None:
        self.watching = launch(source) is not None
        self._kept = _Kept()
        self._saved: tuple[Any, Any] | None = None

    def __enter__(self) -> OutputTail:
        if self.watching:
            self._saved = (sys.stdout, sys.stderr)
            sys.stdout, sys.stderr = _Tee(sys.stdout, self._kept), _Tee(sys.stderr, self._kept)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._saved is not None:
            out, err = self._saved
            # Put back only what is still ours: the cell may have replaced a stream itself.
            if isinstance(sys.stdout, _Tee):
                sys.stdout = out
            if isinstance(sys.stderr, _Tee):
                sys.stderr = err
            self._saved = None

    @property
    def text(self) -> str:
        return "".join(self._kept.pieces)[-KEEP:]


def rank_oom_in(text: str) -> tuple[int | None, OOMReport] | None:
    """(the rank, the parsed error) of the first out-of-memory error in ``text``: the rank from torchrun's
    ``[rankN]:`` prefix on its line, else the rank its summary names as the first failure, else None. None
    where ``text`` holds no such error."""
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if not _OOM_LINE.search(line):
            continue
        # The message and the lines that wrap it: parse_oom re-joins them.
        report = parse_oom("\n".join(lines[i : i + 6]))
        if report is None or report.requested is None:
            continue
        found = _RANK.search(line) or _ROOT_CAUSE.search(text)
        return (int(found.group(1)) if found else None), report
    return None
