"""Give the memory of a failed cell back without a kernel restart.

After an out-of-memory error the traceback keeps every frame of the failed cell alive, and with them
its tensors: ``sys.last_*`` and ``shell.last_execution_result.error_in_exec`` hold exception →
traceback → frames. ``gc.collect(); empty_cache()`` alone frees nothing (measured on an H200: a 40 GiB
tensor local to the failing function stayed allocated).
"""

from __future__ import annotations

import gc
import sys
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


def free_failed_cell(shell: Any, exc: BaseException, device: str) -> None:
    """Release everything the failed cell's exception keeps alive, then collect."""
    unpin_shell(shell, exc)
    clear_exception(exc)
    collect(device)
