"""The optimizer-step marks both recorders share (and ``Recording``, what they hand back), and the pause of
the garbage collector around the work a recorder does after a cell."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from typing import Any

from ...timeline import Recording

__all__ = ["Recording", "StepMarks", "collector_paused"]


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """The cyclic garbage collector off while the block runs, as it was after. An allocator snapshot of
    20,000 trace entries with frame lists is 40,000 new containers (without frames, torch 2.11's dicts
    are not tracked, but the replay's lists and the breakdown's records are): the collections they set
    off walked every object of a process that imported torch (a full one took ~90 ms), and none of them
    frees anything (the entries hold no cycles; they are gone by refcount once replayed)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


class StepMarks:
    """Times of optimizer steps, from torch's global optimizer step hook."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._handle: Any = None

    def install(self, also: Any = None) -> None:
        """Start marking; ``also(optimizer, args, kwargs)`` runs after each mark (the roles of the step)."""
        from torch.optim.optimizer import register_optimizer_step_post_hook

        def mark(*args: Any) -> None:
            self.times.append(time.time())
            if also is not None:
                also(*args)

        self._handle = register_optimizer_step_post_hook(mark)

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
