"""Turn a remedy into a retry: the source to run and the settings to hold while it runs.

Every setting a retry changes (autocast, allocator settings, gradient checkpointing) is held by a
context manager and restored when the retry ends, also on KeyboardInterrupt; the change to keep is
shown as source (``Remedy.code``/``new_source``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from .cellrun import CellRun
from .release import collect
from .runner import RunSpec


def spec_for(run: CellRun, remedy: Any, shell: Any) -> RunSpec:
    """The RunSpec that retries ``run`` with ``remedy`` applied. Raises ``ValueError`` for a remedy that
    cannot be applied automatically."""
    opts = run.options
    base = dict(
        source=remedy.new_source or run.source,
        device=opts.get("device") or run.device,
        limit=run.limit,  # the retry faces the same (emulated) card as the failed run
        options=dict(opts),
        parent=run.id,
        change=remedy.title,
        drop_bound=not opts.get("keep"),
        batch_name=opts.get("batch"),
    )
    kind = remedy.kind
    collect(run.device)
    if remedy.new_source and kind in ("batch", "max_new_tokens", "num_beams", "truncate"):
        return RunSpec(**base)
    if kind == "batch":
        name, new = remedy.params["name"], remedy.params["new"]
        return RunSpec(**base, around=lambda: _rebound(shell.user_ns, name, new))
    if kind == "autocast":
        return RunSpec(**base, around=lambda: _autocast(run.device, remedy.params.get("dtype", "bfloat16")))
    if kind == "expandable_segments":
        return RunSpec(**base, around=_expandable_segments)
    if kind == "empty_cache":
        return RunSpec(**base, around=_empty_cache_every_step)
    if kind == "checkpointing":
        names = remedy.params.get("models") or []
        return RunSpec(**base, around=lambda: _checkpointing(shell.user_ns, names))
    if kind == "free_leftovers":
        from .context import free_names

        free_names(shell.user_ns, remedy.params.get("names", []), measure=lambda: 0)
        return RunSpec(**base)
    raise ValueError(f"{remedy.title}: not something a retry can apply; the snippet shows how to do it")


@contextlib.contextmanager
def _rebound(ns: dict, name: str, value: Any) -> Iterator[None]:
    # The new value stays bound after a successful retry: it is the batch that fits.
    ns[name] = value
    yield


@contextlib.contextmanager
def _autocast(device: str, dtype_name: str) -> Iterator[None]:
    import torch

    with torch.autocast(device_type=device.split(":")[0], dtype=getattr(torch, dtype_name)):
        yield


def _allocator_settings(text: str) -> None:
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(text)
    else:
        torch.cuda.memory._set_allocator_settings(text)


@contextlib.contextmanager
def _expandable_segments() -> Iterator[None]:
    # Switchable live (measured on an H200): segments created from now on are expandable.
    _allocator_settings("expandable_segments:True")
    try:
        yield
    finally:
        _allocator_settings("expandable_segments:False")


@contextlib.contextmanager
def _empty_cache_every_step() -> Iterator[None]:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    def clear(*_: Any) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.empty_cache()

    handle = register_optimizer_step_post_hook(clear)
    try:
        yield
    finally:
        handle.remove()


@contextlib.contextmanager
def _checkpointing(ns: dict, names: list[str]) -> Iterator[None]:
    from .context import checkpointing_enabled

    switched = []
    try:
        for name in names:
            model = ns.get(name)
            able = model is not None and hasattr(model, "gradient_checkpointing_enable")
            if able and not checkpointing_enabled(model):
                model.gradient_checkpointing_enable()
                switched.append(model)
        yield
    finally:
        for model in switched:
            model.gradient_checkpointing_disable()
