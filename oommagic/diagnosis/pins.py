"""Find device memory pinned outside the namespace's variables: an earlier error's traceback
(``sys.last_value``, exceptions kept in variables), IPython's output history (``Out``, ``_``, ``__``,
``___``, ``_N``), suspended generators and closures.

Read-only and silent like ``context``: frames' locals, instance dicts and closure cells are read, nothing
is called on user objects, nothing is freed (``run.release.free_pinned`` does that). The common case it
serves: a cell ran out of memory *without* ``%%gpumem``, and its traceback keeps the failed frames' tensors.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import types
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

from .findings import Pin
from .holdings import SKIPPED_TYPES, Reader, Storages, held_by, ipython_name

# IPython's output history: `_`, `__`, `___` and `_N`.
_OUTPUT_NAME = ("_", "__", "___")


def find_pins(shell: Any, device: str, exclude: BaseException | None = None) -> tuple[Pin, ...]:
    """What pins memory on ``device`` outside the namespace's own variables, largest first; a storage
    counted once, and not at all where a variable of the namespace holds it too (freeing the pin would
    not give it back). ``exclude``: an exception being handled now (not a pin of an earlier cell)."""
    import torch

    where = torch.device(device)
    ns = shell.user_ns
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        found = [h for h in _holders(shell, where, exclude) if h[2]]
        if not found:
            return ()
        claimed: set[int] = set()
        reader = Reader(where)
        for name, value in list(ns.items()):
            if reader.skipped(value) or isinstance(value, _PIN_TYPES) or ipython_name(name):
                continue
            with contextlib.suppress(Exception):
                claimed.update(reader.held_by(name, value)[1])
        pins = []
        for holder, chain, storages in found:
            mine = {p: n for p, n in storages.items() if p not in claimed}
            claimed.update(mine)
            if mine:
                pins.append(Pin(holder, chain, sum(mine.values())))
    return tuple(sorted(pins, key=lambda p: -p.bytes))


_PIN_TYPES = (BaseException, types.TracebackType, types.FrameType, types.GeneratorType, types.CoroutineType)


def _holders(shell: Any, where: Any, exclude: BaseException | None) -> Iterator[tuple[str, str, Storages]]:
    ns = shell.user_ns
    seen: set[int] = set() if exclude is None else {id(exclude)}
    for attr in ("last_exc", "last_value"):
        exc = getattr(sys, attr, None)
        if isinstance(exc, BaseException) and id(exc) not in seen:
            seen.add(id(exc))
            yield from _exception(f"sys.{attr}", exc, where)
    tb = getattr(sys, "last_traceback", None)
    if isinstance(tb, types.TracebackType) and not _belongs(tb, exclude):
        yield from _traceback("sys.last_traceback", tb, where)
    result = getattr(shell, "last_execution_result", None)
    exc = getattr(result, "error_in_exec", None)
    if isinstance(exc, BaseException) and id(exc) not in seen:
        seen.add(id(exc))
        yield from _exception("the last execution result", exc, where)
    out = ns.get("Out")
    if isinstance(out, dict):
        for key, value in list(out.items()):
            yield f"Out[{key}]", f"Out[{key}] (IPython's output history)", _storages(value, where)
    for name in _OUTPUT_NAME:
        if name in ns:
            yield name, f"{name} (IPython's last outputs)", _storages(ns[name], where)
    for name, value in list(ns.items()):
        # Most values are none of the kinds below: one lookup per type (benchmarks/scan_cost.py).
        if not _may_pin(type(value)) or ipython_name(name):
            continue
        if isinstance(value, BaseException) and id(value) not in seen:
            seen.add(id(value))
            yield from _exception(name, value, where)
        elif isinstance(value, types.TracebackType):
            yield from _traceback(name, value, where)
        elif isinstance(value, (types.GeneratorType, types.CoroutineType)):
            frame = getattr(value, "gi_frame", None) or getattr(value, "cr_frame", None)
            if frame is not None:
                label = f"{name} (a suspended generator, in {frame.f_code.co_name}())"
                yield from _frame_locals(name, label, frame, where)
        elif isinstance(value, types.FunctionType) and value.__closure__:
            for var, cell_ in zip(value.__code__.co_freevars, value.__closure__, strict=False):
                with contextlib.suppress(ValueError):  # an empty cell
                    inner = cell_.cell_contents
                    yield name, f"{name} (a closure) → free variable '{var}'", _storages(inner, where)


@functools.lru_cache(maxsize=1024)
def _may_pin(tp: type) -> bool:
    """Whether values of ``tp`` can pin memory out of sight: exceptions, tracebacks, generators and
    coroutines, functions (their closures)."""
    return issubclass(tp, (*_PIN_TYPES, types.FunctionType))


def _belongs(tb: types.TracebackType, exc: BaseException | None) -> bool:
    return exc is not None and exc.__traceback__ is tb


def _exception(holder: str, exc: BaseException, where: Any) -> Iterator[tuple[str, str, Storages]]:
    """Every frame of ``exc``'s traceback and of its chained causes and contexts."""
    seen: set[int] = set()
    label = f"{holder} ({type(exc).__name__})"
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield from _traceback(holder, exc.__traceback__, where, label)
        exc = exc.__cause__ or exc.__context__
        label = f"{holder} → chained {type(exc).__name__}" if exc is not None else label


def _traceback(
    holder: str, tb: types.TracebackType | None, where: Any, label: str | None = None
) -> Iterator[tuple[str, str, Storages]]:
    while tb is not None:
        frame = tb.tb_frame
        yield from _frame_locals(holder, f"{label or holder} → traceback", frame, where)
        tb = tb.tb_next


def _frame_locals(
    holder: str, label: str, frame: types.FrameType, where: Any
) -> Iterator[tuple[str, str, Storages]]:
    # Module-level frames are the namespace itself: its variables are leftovers, not pins.
    if not frame.f_code.co_flags & 0x0002:  # CO_NEWLOCALS
        return
    # IPython's and this package's own frames (run_code, the magic) hold the shell, not the user's tensors.
    if str(frame.f_globals.get("__name__", "")).startswith(("IPython.", "ipykernel.", "oommagic.")):
        return
    func = frame.f_code.co_name
    for var, value in list(frame.f_locals.items()):
        storages = _storages(value, where)
        if storages:
            yield holder, f"{label} → {func}() → local '{var}'", storages


def _storages(value: Any, where: Any) -> Storages:
    if isinstance(value, SKIPPED_TYPES):
        return {}
    try:
        return held_by("", value, where)[1]
    except Exception:
        return {}


def pinned_bytes(pins: tuple[Pin, ...]) -> int:
    return sum(p.bytes for p in pins)


def describe(pins: tuple[Pin, ...], most: int = 8) -> list[str]:
    """One line per pin: '38.15 MiB  sys.last_value (ValueError) → traceback → f() → local 'x''."""
    from ..sizes import format_bytes

    return [f"{format_bytes(p.bytes):>11}  {p.chain}" for p in pins[:most]]


def namespace_pins(namespace: Mapping) -> list[str]:
    """Names in ``namespace`` whose value can pin memory out of sight (exceptions, tracebacks, generators)."""
    return [k for k, v in namespace.items() if isinstance(v, _PIN_TYPES)]
