"""What the first-click tests share: a failing cell's report widget and its first fix (``failed_and_first``),
and the work a cell did, counted as a person would: optimizer steps (torch's global step hook) and the rows of
the model's forwards (``counted``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

import oommagic
from oommagic.run.session import session_for
from oommagic.view.widget import ReportWidget


def failed_and_first(shell, run_cell, cell: str, limit_mib: float, budget: int = 60):
    """``cell`` run under ``--limit`` (it must fail), the report widget a person sees (``--quiet`` only keeps
    it off the screen) and the widget's first fix: (the failed run, the widget, the fix)."""
    run_cell(f"%%gpumem --limit {limit_mib:.3f}MiB --quiet --no-raise --plan-budget {budget}\n{cell}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    widget = ReportWidget(failed, session_for(shell))
    lines = [e.line() for e in failed.plan.entries] if failed.plan else []
    assert widget.fixes, [(f.title, f.evidence) for f in failed.findings] + lines
    return failed, widget, widget.fixes[0]


@contextlib.contextmanager
def counted(model: torch.nn.Module, training: bool = True) -> Iterator[dict]:
    """Optimizer steps and the rows of training forwards of ``model`` while the block runs (a forward run
    again in the backward pass, activation checkpointing's, is the same samples); with ``training=False``
    the rows of every forward (an evaluation's)."""
    work = {"steps": 0, "samples": 0}

    def forward(module, args, kwargs):
        trains = module.training and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1
        if trains or not training:
            first = next(v for v in [*args, *kwargs.values()] if torch.is_tensor(v))
            work["samples"] += int(first.shape[0])

    def step(*_):
        work["steps"] += 1

    hooks = [
        model.register_forward_pre_hook(forward, with_kwargs=True),
        register_optimizer_step_post_hook(step),
    ]
    try:
        yield work
    finally:
        for hook in hooks:
            hook.remove()
