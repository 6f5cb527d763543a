"""An interrupt (the kernel's SIGINT, Ctrl-C) that arrives while a trial's state is taken or put back is held
until that work ends, then honoured: a KeyboardInterrupt in the middle of a restore would leave the
trial's weights, optimizer state or files behind (measured: 4 and 8 runs of 12 in a sweep, issue #23).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any


class HeldInterrupt:
    """``with HeldInterrupt() as hold:`` SIGINT is recorded, not raised, inside the block except within
    ``hold.released()``; one recorded is raised when the block ends. Outside the main thread (where no
    signal handler can be set) it holds nothing."""

    def __init__(self) -> None:
        self.holding = True
        self.pending = False
        # Every interrupt seen, held or not: one raised inside code that swallows it (IPython's event
        # callbacks catch KeyboardInterrupt) still ends the trial (``Session.trial``).
        self.arrived = 0
        self._previous: Any = None
        self._installed = False

    def __enter__(self) -> HeldInterrupt:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_interrupt)
            self._installed = True
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        self.holding = True
        if self._installed:
            signal.signal(signal.SIGINT, self._previous)
            self._installed = False
        if self.pending and not (kind is not None and issubclass(kind, KeyboardInterrupt)):
            self.pending = False
            self._honour(signal.SIGINT, None)
        return False

    @contextlib.contextmanager
    def released(self) -> Iterator[None]:
        """Interrupts act at once inside this block (one held before it is raised on entry)."""
        self.holding = False
        try:
            if self.pending:
                self.pending = False
                self._honour(signal.SIGINT, None)
            yield
        finally:
            self.holding = True

    def _on_interrupt(self, signum: int, frame: FrameType | None) -> None:
        self.arrived += 1
        if self.holding:
            self.pending = True
        else:
            self._honour(signum, frame)

    def _honour(self, signum: int, frame: FrameType | None) -> None:
        previous = self._previous
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:
            raise KeyboardInterrupt
