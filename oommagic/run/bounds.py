"""How far a trial runs, and the stop that ends it there: in the kernel around the cell, and in each rank
process the cell starts (a trial of a distributed cell relaunches its ranks, each bounded the same way).

A trial stops at the first backward pass after its optimizer steps (the steady state), after a number of
backward passes, or when its time is up. Ranks read their bounds from the environment the kernel sets
(``ENV_BOUNDS``), with the time as an absolute deadline: a rank starts later than the cell did.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

ENV_BOUNDS = "OOMMAGIC_TRIAL_BOUNDS"


class TrialStop(Exception):
    """Ends a bounded trial early on purpose: its steady-state peak was reached, or (``timed_out``) its
    time ran out."""

    def __init__(self, message: str = "", timed_out: bool = False) -> None:
        super().__init__(message)
        self.timed_out = timed_out


@dataclass(frozen=True)
class Bounds:
    """How far a trial runs: until the first backward pass after ``steps`` optimizer steps (the
    optimizer's state exists by then, so the step's peak is the steady one; None: the whole cell), or
    until ``seconds`` have passed. ``limit`` overrides the options' limit (bytes)."""

    steps: int | None = 1
    seconds: float | None = None
    limit: int | None = None
    backwards: int | None = None  # or stop after this many backward passes, whatever the steps

    def for_ranks(self) -> str:
        """These bounds for the environment of the ranks the trial starts: the time as an epoch deadline."""
        deadline = time.time() + self.seconds if self.seconds else None
        return json.dumps({"steps": self.steps, "backwards": self.backwards, "deadline": deadline})


def rank_bounds(text: str | None) -> tuple[Bounds, float | None] | None:
    """``Bounds.for_ranks``'s text read back in a rank: (the bounds, the epoch deadline); None for none."""
    if not text:
        return None
    data = json.loads(text)
    return Bounds(steps=data.get("steps"), backwards=data.get("backwards")), data.get("deadline")


class StepCounter:
    """The optimizer steps a run took (every optimizer's ``step``, through torch's global hook)."""

    def __init__(self) -> None:
        self.steps = 0
        self.running = True


@contextlib.contextmanager
def bounded(
    bounds: Bounds | None, deadline: float | None = None, count: bool = False
) -> Iterator[StepCounter]:
    """Count optimizer steps (with ``bounds``, or with ``count``); with ``bounds``, end the run by
    ``TrialStop`` at the first backward pass after that many steps (raised once the backward pass
    completed, so its peak is recorded) or once its time is up (at the next torch operation on tensors).
    ``deadline``: the time as an epoch (a rank's), else ``bounds.seconds`` from now."""
    counter = StepCounter()
    if bounds is None and not count:
        yield counter
        return
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.overrides import TorchFunctionMode

    if deadline is None and bounds is not None and bounds.seconds:
        deadline = time.time() + bounds.seconds

    def after_step(*_: Any) -> None:
        counter.steps += 1

    backwards = 0

    class Bounded(TorchFunctionMode):
        oommagic_trial = True  # a forked rank drops the kernel's, which it inherits (``rank_process``)

        def __torch_function__(self, func, types, args=(), kwargs=None):
            if not counter.running:
                return func(*args, **(kwargs or {}))
            # Only at an operation on tensors: a mode's switch (no_grad's `_set_grad_enabled` on its way
            # out) stopped here would leave the mode on for the rest of the session.
            computes = any(isinstance(a, torch.Tensor) for a in args)
            if deadline is not None and computes and time.time() > deadline:
                raise TrialStop(f"time budget of {bounds.seconds or 0:.0f} s reached", timed_out=True)
            nonlocal backwards
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.backward:
                backwards += 1
                if bounds.steps is not None and counter.steps >= bounds.steps:
                    raise TrialStop(f"steady state: a backward pass after {counter.steps} optimizer steps")
                if bounds.backwards is not None and backwards >= bounds.backwards:
                    raise TrialStop(f"ran {backwards} backward passes")
            return out

    # A stop raised before a torch call can land in a context manager's exit (no_grad's, a dtype
    # switch's), which then never puts its mode back: the trial does.
    grad, dtype = torch.is_grad_enabled(), torch.get_default_dtype()
    handle = register_optimizer_step_post_hook(after_step)
    try:
        with Bounded() if bounds is not None else contextlib.nullcontext():
            yield counter
    finally:
        handle.remove()
        torch.set_grad_enabled(grad)
        torch.set_default_dtype(dtype)
