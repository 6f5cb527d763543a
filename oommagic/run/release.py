"""Give the memory of a failed cell back without a kernel restart.

After an out-of-memory error the traceback keeps every frame of the failed cell alive, and with them
its tensors: ``sys.last_*`` and ``shell.last_execution_result.error_in_exec`` hold exception →
traceback → frames. ``gc.collect(); empty_cache()`` alone frees nothing (measured on an H200: a 40 GiB
tensor local to the failing function stayed allocated).
"""

from __future__ import annotations

import contextlib
import gc
import sys
import weakref
from collections.abc import Callable, Iterable, Iterator
from types import TracebackType
from typing import Any


def clear_traceback(tb: TracebackType | None) -> None:
    """Drop the locals of every frame in ``tb``.

    On Python ≤ 3.12 ``frame.clear()`` leaves the dict that an earlier read of ``frame.f_locals`` (as
    IPython's traceback printer does) made; reading ``f_locals`` again after clearing refreshes that
    dict from the now empty fast locals and so releases the tensors too.
    """
    while tb is not None:
        frame = tb.tb_frame
        try:
            frame.clear()
        except RuntimeError:
            pass  # a frame that is still executing (the magic's own) keeps its locals
        else:
            if frame.f_code.co_flags & 0x0002:  # CO_NEWLOCALS: a function frame, not module level
                _ = frame.f_locals
        tb = tb.tb_next


def clear_exception(exc: BaseException | None) -> None:
    """Clear the frames of ``exc``, its chained causes and contexts, and cut their tracebacks."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        clear_traceback(exc.__traceback__)
        exc.__traceback__ = None
        nxt = exc.__cause__ or exc.__context__
        exc.__cause__ = exc.__context__ = None
        exc = nxt


def unpin_shell(shell: Any, exc: BaseException) -> None:
    """Make IPython forget ``exc``: ``sys.last_*`` and the last execution result."""
    for name in ("last_value", "last_exc"):
        if getattr(sys, name, None) is exc:
            setattr(sys, name, None)
            sys.last_type = sys.last_traceback = None
    result = getattr(shell, "last_execution_result", None)
    if result is not None and result.error_in_exec is exc:
        result.error_in_exec = None


def collect(device: str | None = None) -> None:
    """``gc.collect()``, then hand cached CUDA blocks back to the driver when CUDA is in use and
    ``device`` is not ``"cpu"`` (None: whichever device a run will pick)."""
    gc.collect()
    torch = sys.modules.get("torch")  # not imported: nothing of CUDA's to give back
    if device != "cpu" and torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def free_failed_cell(shell: Any, exc: BaseException, device: str, then_collect: bool = True) -> None:
    """Release everything the failed cell's exception keeps alive, then collect (unless the caller
    collects once itself, after more is let go)."""
    unpin_shell(shell, exc)
    clear_exception(exc)
    if then_collect:
        collect(device)


def drop_new_blas_workspaces(device: str, before: int) -> None:
    """cuBLAS keeps a workspace (32 MiB by default, plus cuBLASLt's) per handle and stream from the
    allocator, made by the first matrix product: a failed cell, or the trials of its plan, may have made
    it. Where more than that stays allocated than before the cell (``before`` bytes), let the workspaces
    go; the next product makes them again in microseconds. One that was there before the cell stays."""
    torch = sys.modules.get("torch")
    if device == "cpu" or torch is None or not torch.cuda.is_initialized():
        return
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None or torch.cuda.memory_allocated() - before < 16 * 2**20:
        return
    with contextlib.suppress(Exception):
        clear()
        torch.cuda.empty_cache()


def free_names(namespace: dict, names: Iterable[str], measure: Callable[[], int] | None = None) -> int:
    """Delete ``names`` from ``namespace``, collect garbage, empty the CUDA cache (only if CUDA is already
    initialised) and return the bytes given back: ``measure()`` before minus after, never negative.

    ``measure`` defaults to ``torch.cuda.memory_allocated`` when CUDA is initialised, else 0. Memory that
    something else still references (IPython's ``Out``, another name) stays.
    """
    measure = measure or _cuda_allocated
    before = measure()
    for name in names:
        namespace.pop(name, None)
    collect()
    return max(0, before - measure())


def _cuda_allocated() -> int:
    torch = sys.modules.get("torch")
    return torch.cuda.memory_allocated() if torch is not None and torch.cuda.is_initialized() else 0


Identity = tuple[int, "weakref.ref[Any] | None"]


def identities(namespace: dict) -> dict[str, Identity]:
    """What each name is bound to before a cell, without keeping it alive: its ``id`` and, where the
    value takes one, a weak reference. An ``id`` alone is not enough: a name the cell rebinds in a loop
    (``out = model(x)``) can get a new object at the address of the one bound before the cell, which
    the first rebinding let go."""
    found: dict[str, Identity] = {}
    for name, value in namespace.items():
        try:
            ref: weakref.ref[Any] | None = weakref.ref(value)
        except TypeError:
            ref = None
        found[name] = (id(value), ref)
    return found


def same_binding(before: Identity | None, value: Any) -> bool:
    """Whether ``value`` is the object a name was bound to before the cell (``identities``)."""
    if before is None or before[0] != id(value):
        return False
    return before[1] is None or before[1]() is value


def drop_bound_by_cell(namespace: dict, before: dict[str, Identity], device: str) -> list[tuple[str, int]]:
    """Delete the names a failed cell bound (new, or bound to another object than ``before``, from
    ``identities``) to values that hold memory on ``device``; returns (name, bytes) of each. They are the
    failed attempt's memory as much as its frames are, and a retry binds them again."""
    import torch

    from ..diagnosis.context import IPYTHON_NAME, SKIPPED_TYPES, held_by, optimizer_params, tensor_storages

    where = torch.device(device)
    dropped = []
    for name, value in list(namespace.items()):
        if (
            same_binding(before.get(name), value)
            or IPYTHON_NAME.fullmatch(name)
            or isinstance(value, SKIPPED_TYPES)
        ):
            continue
        with contextlib.suppress(Exception):
            _, storages = held_by(name, value, where)
            if isinstance(value, torch.optim.Optimizer):
                # An optimizer without state yet still keeps its model's parameters alive.
                for p in optimizer_params(value):
                    tensor_storages(p, where, storages)
            if storages:
                del namespace[name]
                dropped.append((name, sum(storages.values())))
    return dropped


@contextlib.contextmanager
def frozen_heap() -> Iterator[None]:
    """Trials collect garbage after each run; with everything that existed before them frozen out of the
    collector's reach (it is alive, or was collected already), each collection only walks what the trial
    made: ~0.3 s saved per trial on a heap with torch and transformers loaded."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def free_pinned(shell: Any, device: str, measure: Callable[[], int] | None = None) -> int:
    """Give back what pins memory outside the namespace's variables (``diagnosis.pins``): clear the frames
    of earlier errors (``sys.last_*``, the last execution result, exceptions and tracebacks kept in
    variables: the variables stay, their frames' locals go), drop output-history entries and ``_``,
    ``__``, ``___`` that hold device memory, and close suspended generators that do. Closures are left:
    only the person can drop them. Returns the bytes given back (before minus after, never negative)."""
    import types

    import torch

    from ..diagnosis.context import IPYTHON_NAME, held_by, instance_dict

    where = torch.device(device)
    measure = measure or (lambda: allocated_on(device))
    before = measure()

    def holds(value: Any) -> bool:
        if value is None or isinstance(value, str):
            return False
        try:
            return bool(held_by("", value, where)[1])
        except Exception:
            return False

    for attr in ("last_exc", "last_value"):
        exc = getattr(sys, attr, None)
        if isinstance(exc, BaseException):
            clear_exception(exc)
    clear_traceback(getattr(sys, "last_traceback", None))
    for attr in ("last_exc", "last_value", "last_type", "last_traceback"):
        if getattr(sys, attr, None) is not None:
            setattr(sys, attr, None)
    result = getattr(shell, "last_execution_result", None)
    if result is not None and result.error_in_exec is not None:
        clear_exception(result.error_in_exec)
        result.error_in_exec = None
    ns = shell.user_ns
    out = ns.get("Out")
    if isinstance(out, dict):
        for key in [k for k, v in out.items() if holds(v)]:
            del out[key]
            ns.pop(f"_{key}", None)
    # IPython keeps the last outputs three times: in the namespace, in the hidden namespace (`push` with
    # interactive=False) and as attributes of its display hook.
    hidden = getattr(shell, "user_ns_hidden", {})
    hook = getattr(shell, "displayhook", None)
    for name in ("_", "__", "___"):
        if name in ns and holds(ns[name]):
            ns[name] = ""
        if name in hidden and holds(hidden[name]):
            hidden[name] = ""
        if hook is not None and holds(instance_dict(hook).get(name)):
            setattr(hook, name, "")
    for name in [k for k, v in hidden.items() if IPYTHON_NAME.fullmatch(k) and k[1:].isdigit() and holds(v)]:
        del hidden[name]
    for name, value in list(ns.items()):
        if IPYTHON_NAME.fullmatch(name):
            continue
        if isinstance(value, BaseException):
            clear_exception(value)
        elif isinstance(value, types.TracebackType):
            clear_traceback(value)
        elif (
            isinstance(value, types.GeneratorType)
            and value.gi_frame is not None
            and holds(dict(value.gi_frame.f_locals))
        ):
            value.close()
    collect(device)
    return max(0, before - measure())


def allocated_on(device: str) -> int:
    """Bytes allocated on ``device`` now: CUDA's allocator where CUDA is up, the CPU ledger on "cpu"."""
    torch = sys.modules.get("torch")
    if torch is None:
        return 0
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated(device) if torch.cuda.is_initialized() else 0
    from .capture import LEDGER

    return LEDGER.allocated
