"""The optimizer-step marks both recorders share (and ``Recording``, what they hand back)."""

from __future__ import annotations

import time
from typing import Any

from ...timeline import Recording

__all__ = ["Recording", "StepMarks"]


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
