"""Hold the settings of the fixes in force while a run executes, and restore them when it ends.

A fix is a ``Remedy`` (kind + params). Its change to the cell's source travels in the ``RunSpec``'s source;
what it changes in the process (autocast, allocator settings, a hook, checkpointing switched on, a batch
variable rebound) is held here by a context manager for exactly the length of the run and restored after
it, also on KeyboardInterrupt. Fixes stack: every fix of ``applied`` is in force, in order.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

from ..cellrun import CellRun
from ..diagnosis.findings import Remedy
from ..diagnosis.kinds import kind_of, rewrite_again
from .spec import RunSpec


def spec_of(run: CellRun) -> RunSpec:
    """The spec that runs ``run``'s cell again as it ran (same source, options and fixes)."""
    return RunSpec(
        source=run.source,
        options=run.options,
        applied=run.applied,
        cell_id=run.cell_id,
        execution_count=run.execution_count,
        parent=run.id,
        original=run.original or run.source,
    )


def spec_with(run: CellRun, fixes: tuple[Remedy, ...]) -> RunSpec:
    """The spec that runs ``run``'s cell with ``fixes`` added to those already in force: each rewrite made
    on the source as the ones before it left it, each setting held during the run."""
    source = run.source
    helpers = run.context.helpers if run.context is not None else ()
    for i, remedy in enumerate(fixes):
        kind_of(remedy)  # an unknown kind stops here, before anything runs
        source = remedy.new_source if i == 0 and remedy.new_source else rewrite_again(source, remedy, helpers)
    return replace(spec_of(run), source=source, applied=(*run.applied, *fixes))


@contextlib.contextmanager
def in_force(applied: tuple[Remedy, ...], shell: Any, device: str) -> Iterator[None]:
    """Every setting of ``applied`` held for the run, restored in reverse order after it."""
    with contextlib.ExitStack() as stack:
        for remedy in applied:
            stack.enter_context(holding(remedy, shell, device))
        yield


def holding(remedy: Remedy, shell: Any, device: str) -> contextlib.AbstractContextManager:
    """The context manager that holds ``remedy``'s setting: its kind's ``hold`` (a null one where its
    change is in the source or was done once, like freeing leftovers)."""
    name = kind_of(remedy).hold
    return HOLDS[name].hold(remedy, shell, device) if name else contextlib.nullcontext()


def undo(remedy: Remedy, ns: dict) -> None:
    """Put back what ``remedy``'s setting left in the namespace after its runs (a rebound batch
    variable, an object's batch setting): the fix is removed from the stack."""
    name = kind_of(remedy).hold
    if name and HOLDS[name].undo is not None:
        HOLDS[name].undo(remedy, ns)


def _batch_setting(remedy: Remedy, shell: Any, device: str) -> contextlib.AbstractContextManager:
    params = remedy.params
    if params.get("where") in ("namespace", "option"):
        return _rebound(shell.user_ns, params["name"], params["new"])
    if params.get("where") == "attribute":
        values = {params["name"]: params["new"]}
        if params.get("accumulation"):
            path, _, new_steps = params["accumulation"]
            values[path] = new_steps
        values.update({path: new for path, _, new in params.get("mirrors", [])})
        return _set_attributes(shell.user_ns, values)
    return contextlib.nullcontext()


def _batch_undo(remedy: Remedy, ns: dict) -> None:
    params = remedy.params
    if params.get("where") in ("namespace", "option"):
        ns[params["name"]] = params["old"]
    if params.get("where") == "attribute":
        set_attribute(ns, params["name"], params["old"])
        if params.get("accumulation"):
            path, old_steps, _ = params["accumulation"]
            set_attribute(ns, path, old_steps)
        for path, old, _ in params.get("mirrors", []):
            set_attribute(ns, path, old)


@contextlib.contextmanager
def _rebound(ns: dict, name: str, value: Any) -> Iterator[None]:
    # The new value stays bound after the run: it is the batch in force until the fix is removed.
    ns[name] = value
    yield


def rebatched(loader: Any, batch_size: int) -> Any:
    """A copy of ``loader`` whose batches hold ``batch_size`` samples: the same dataset, sampler and
    order, collation, workers and wrapper (a DataLoader, one wrapped by accelerate's ``prepare``, a batch
    sampler); ``loader`` itself is left as it is. A loader's batch cannot be changed once it is made, so
    the copy and the batch samplers it holds are copied and given the new count."""
    import copy

    from ..diagnosis.context import LOADER_LINKS

    new = copy.copy(loader)
    attrs = vars(new) if hasattr(new, "__dict__") else {}
    # DataLoader refuses these once made (its __setattr__): the copy is new, so they are set under it.
    if attrs.get("_iterator") is not None:
        object.__setattr__(new, "_iterator", None)  # a persistent workers' iterator is the original's
    for key in LOADER_LINKS:
        inner = attrs.get(key)
        if inner is not None and hasattr(inner, "__dict__"):
            object.__setattr__(new, key, rebatched(inner, batch_size))
    if type(attrs.get("batch_size")) is int:
        object.__setattr__(new, "batch_size", batch_size)
    return new


def checkpointed(model: Any) -> Any:
    """``model`` itself, with the activations of each of its blocks recomputed in the backward pass instead
    of kept: a transformers model through its own ``gradient_checkpointing_enable``; else each element of
    its outermost ``ModuleList`` or ``Sequential`` that is itself made of layers (a transformer block, a
    residual stage) runs under ``torch.utils.checkpoint`` (non-reentrant) while gradients are on. A model
    with no such blocks is returned as it is (checkpointing one layer at a time keeps as much as it
    saves). Blocks already checkpointed here are left alone."""
    import torch

    if getattr(model, "supports_gradient_checkpointing", False) and hasattr(
        model, "gradient_checkpointing_enable"
    ):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return model
    for holder in model.modules():
        if not isinstance(holder, (torch.nn.ModuleList, torch.nn.Sequential)):
            continue
        blocks = [
            b
            for b in holder
            if next(b.children(), None) is not None and next(b.parameters(), None) is not None
        ]
        if len(blocks) >= 2:
            for block in blocks:
                _checkpoint_forward(block)
            break
    return model


def _checkpoint_forward(block: Any) -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

    if getattr(block.forward, "_oommagic_checkpointed", False):
        return
    forward = block.forward

    def recomputed(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    recomputed._oommagic_checkpointed = True  # type: ignore[attr-defined]
    block.forward = recomputed


def set_attribute(ns: dict, path: str, value: Any) -> None:
    """``trainer.args.per_device_train_batch_size = value`` for the dotted ``path`` from the namespace."""
    owner, *middle, last = path.split(".")
    obj = ns[owner]
    for part in middle:
        obj = getattr(obj, part)
    object.__setattr__(obj, last, value) if _frozen(obj) else setattr(obj, last, value)


def _frozen(obj: Any) -> bool:
    params = getattr(type(obj), "__dataclass_params__", None)
    return bool(params is not None and params.frozen)


@contextlib.contextmanager
def _set_attributes(ns: dict, values: dict[str, Any]) -> Iterator[None]:
    # Like a rebound name, the new settings stay after the run: they are the fix in force until removed
    # (a trial's snapshot puts them back).
    for path, value in values.items():
        set_attribute(ns, path, value)
    yield


@contextlib.contextmanager
def _autocast(device: str, dtype_name: str) -> Iterator[None]:
    import torch

    with torch.autocast(device_type=device.split(":")[0], dtype=getattr(torch, dtype_name)):
        yield


def allocator_settings(text: str) -> None:
    """Change the caching allocator's settings in this live process (new segments follow them)."""
    import torch

    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(text)
    else:
        torch.cuda.memory._set_allocator_settings(text)


@contextlib.contextmanager
def _expandable_segments(device: str) -> Iterator[None]:
    # Switchable live (measured on an H200): segments created from now on are expandable.
    if not device.startswith("cuda"):
        yield
        return
    allocator_settings("expandable_segments:True")
    try:
        yield
    finally:
        allocator_settings("expandable_segments:False")


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
    from ..diagnosis.context import checkpointing_enabled

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


@dataclass(frozen=True)
class Hold:
    """A setting a fix holds while a run executes (``hold``: remedy, shell, device -> context manager) and,
    where it outlives the run, how removing the fix puts it back (``undo``: remedy, namespace)."""

    hold: Callable[[Remedy, Any, str], contextlib.AbstractContextManager]
    undo: Callable[[Remedy, dict], None] | None = None


def _autocast_setting(remedy: Remedy, shell: Any, device: str) -> contextlib.AbstractContextManager:
    # quantize holds autocast only where its params ask for it (bf16 compute over quantized weights).
    if remedy.kind != "autocast" and not remedy.params.get("autocast"):
        return contextlib.nullcontext()
    return _autocast(device, remedy.params.get("autocast") or remedy.params.get("dtype", "bfloat16"))


def _checkpointing_setting(remedy: Remedy, shell: Any, device: str) -> contextlib.AbstractContextManager:
    # A rewrite that switches it on in the source (TrainingArguments) needs nothing held.
    if remedy.new_source is not None:
        return contextlib.nullcontext()
    return _checkpointing(shell.user_ns, remedy.params.get("models") or [])


# The settings named by the kinds' rows (``diagnosis.kinds.FixKind.hold``).
HOLDS: dict[str, Hold] = {
    "batch": Hold(_batch_setting, _batch_undo),
    "autocast": Hold(_autocast_setting),
    "expandable_segments": Hold(lambda remedy, shell, device: _expandable_segments(device)),
    "empty_cache": Hold(lambda remedy, shell, device: _empty_cache_every_step()),
    "checkpointing": Hold(_checkpointing_setting),
}
