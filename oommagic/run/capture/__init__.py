"""Recorders: what a cell did to memory, from the CUDA allocator's own trace (``cuda``) or, on CPU, from
tensor storages tracked through a dispatch mode (``cpu``). Both give a ``Recording``; both restore what
they changed.

torch is imported inside functions so that ``import oommagic`` stays light.
"""

from __future__ import annotations

from typing import Any

from ...options import OptionError
from .cpu import LEDGER, CpuRecorder, host_memory
from .cuda import CudaRecorder
from .record import Recording, StepMarks
from .trace import CUDA_TRACE_ENTRIES, cuda_timeline

__all__ = [
    "CUDA_TRACE_ENTRIES",
    "LEDGER",
    "CpuRecorder",
    "CudaRecorder",
    "Recording",
    "StepMarks",
    "cuda_timeline",
    "host_memory",
    "open_recorder",
]


def open_recorder(
    device: str | None,
    limit: float | int | None,
    timeline: bool = True,
    stacks: bool = False,
    trace_entries: int = CUDA_TRACE_ENTRIES,
) -> CpuRecorder | CudaRecorder:
    """A recorder for ``device`` ("cpu", "cuda", "cuda:N", "N" or None = CUDA if available, else CPU);
    ``timeline=False`` records the peak and the steps but no timeline between the start and the end;
    ``stacks`` records the Python line of each allocation; ``trace_entries`` is how many allocator events
    the trace keeps (``GpuMemMagics.trace_entries``: the CUDA history's ring, the CPU snapshot's trace).

    ``limit`` is bytes (int) or a fraction of the capacity (float in (0, 1]). A byte limit at or above the
    card's capacity is dropped with a warning. Raises ``ValueError`` for a device that does not exist.
    """
    import warnings

    import torch

    kind, index = _resolve_device(device, torch)
    if kind == "cpu":
        capacity = host_memory()
        limit = _resolve_limit(limit, capacity, warnings, "this machine's memory")
        return CpuRecorder(limit, timeline, stacks, trace_entries=trace_entries)
    recorder = CudaRecorder(index, timeline=timeline, stacks=stacks, trace_entries=trace_entries)
    if recorder.capacity is not None:
        recorder.limit = _resolve_limit(limit, recorder.capacity, warnings, f"cuda:{index}'s capacity")
    elif not isinstance(limit, float):
        recorder.limit = limit
    if isinstance(limit, float) and (recorder.limit is not None or recorder.capacity is None):
        # Resolved again once the cell starts CUDA, against the capacity the driver reports.
        recorder.limit_fraction = limit
    return recorder


def _resolve_device(device: str | None, torch: Any) -> tuple[str, int]:
    """(kind, index). Starts no CUDA: the device count comes from NVML where torch can read it
    (``torch.cuda.is_available`` initialises the driver, which a later fork cannot survive), and the
    current device is 0 until CUDA runs."""
    spec = (device or "").strip().lower()
    if spec == "cpu":
        return "cpu", 0
    started = torch.cuda.is_initialized()
    count = torch.cuda.device_count()
    if not spec:
        if started:
            return "cuda", torch.cuda.current_device()
        return ("cuda", 0) if count > 0 else ("cpu", 0)
    index_text = spec.removeprefix("cuda").lstrip(":") or "0"
    if not index_text.isdigit():
        raise OptionError(f"--device expects cpu, cuda, cuda:N or N, got {device!r}")
    if count == 0:
        raise OptionError(f"--device {device}: CUDA is not available here (use --device cpu for CPU mode)")
    index = int(index_text)
    if index >= count:
        raise OptionError(f"--device {device}: this process sees {count} CUDA device(s), 0..{count - 1}")
    return "cuda", index


def _resolve_limit(limit: float | int | None, capacity: int, warnings: Any, what: str) -> int | None:
    from ...sizes import format_bytes

    if limit is None:
        return None
    nbytes = int(limit * capacity) if isinstance(limit, float) else int(limit)
    if nbytes >= capacity:
        warnings.warn(
            f"--limit {format_bytes(nbytes)} is not below {what} ({format_bytes(capacity)}): no limit set",
            stacklevel=3,
        )
        return None
    return nbytes
