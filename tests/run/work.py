"""The work a cell did, counted as a person would: optimizer steps (torch's global step hook) and the rows of
the model's forwards. Shared by the tests that check an accepted fix keeps the cell's work."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook


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
