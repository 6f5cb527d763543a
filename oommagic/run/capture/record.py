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

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(lambda *_: self.times.append(time.time()))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
