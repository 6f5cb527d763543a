"""A rank's CUDA device: which device is its own, the ``--limit`` on it, and its figures there, read
without opening a CUDA context on any other device (a context the tool opened would be reported as the
user's stray one, and costs ~0.5 GiB of that GPU).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

from .rank_files import limit_bytes


def start_device(index: int, count: int) -> int | None:
    """The device a rank that has not chosen one works on by convention when its CUDA starts: its local
    rank ``index``; device 0 where it sees one device (``CUDA_VISIBLE_DEVICES`` set per rank); None where
    ``index`` is not a device it sees (then nothing is set for it)."""
    if index < count:
        return index
    return 0 if count == 1 else None


def own_device(peaks: dict[int, int], current: int, index: int, count: int) -> int:
    """The device a rank worked on: the one where its allocator reserved the most (the current device
    on a tie), else the current device where the rank set one, else by convention ``start_device``.
    ``peaks`` maps each device the process sees to its peak reserved bytes."""
    used = {d: n for d, n in peaks.items() if n > 0}
    if used:
        return max(used, key=lambda d: (used[d], d == current, -d))
    if current != 0:
        return current
    found = start_device(index, count)
    return found if found is not None else current


class RankLimit:
    """``--limit`` in a rank on CUDA, set on the rank's own device and nowhere else (setting it opens a
    context on that device). A rank that calls ``torch.cuda.set_device`` gets it on that device, after
    its call; one that never does gets it on ``start_device`` when its code starts CUDA (torch's queue of
    calls run at lazy initialisation). A ``set_device`` that itself starts CUDA runs the queue before the
    device is set: the queued call leaves it to the ``set_device`` that is under way."""

    def __init__(self, limit: str, index: int) -> None:
        self.limit = limit
        self.index = index
        self.applied: set[int] = set()
        self._choosing = False
        self._original: Any = None
        self._torch: Any = None

    def install(self) -> None:
        import torch

        self._torch = torch
        self._original = torch.cuda.set_device
        torch.cuda.set_device = self._set_device
        torch.cuda._lazy_call(self._on_start)

    def remove(self) -> None:
        if self._torch is not None and self._torch.cuda.set_device is self._set_device:
            self._torch.cuda.set_device = self._original

    def _set_device(self, device: Any) -> None:
        self._choosing = True
        try:
            self._original(device)
        finally:
            self._choosing = False
        with contextlib.suppress(Exception):
            self._apply(self._torch.cuda.current_device())

    def _on_start(self) -> None:
        if self._choosing:
            return
        # Queued calls run inside torch's lazy initialisation: an error here would reach the rank's code.
        with contextlib.suppress(Exception):
            device = start_device(self.index, self._torch.cuda.device_count())
            if device is not None:
                self._apply(device)

    def _apply(self, device: int) -> None:
        if device in self.applied:
            return
        torch = self._torch
        _, total = torch.cuda.mem_get_info(device)
        nbytes = limit_bytes(self.limit, total) or total
        torch.cuda.set_per_process_memory_fraction(min(nbytes / total, 1.0), device)
        self.applied.add(device)


def cuda_figures(index: int, limit: str | None) -> dict:
    """The rank's figures on its own device, read from the allocator's statistics, the device's
    properties and NVML: none of them opens a CUDA context (``mem_get_info`` would, on a device the rank
    may never have used)."""
    import torch

    if not torch.cuda.is_initialized():
        return {"device": "cpu"}
    count = torch.cuda.device_count()
    peaks = {d: torch.cuda.memory_stats(d).get("reserved_bytes.all.peak", 0) for d in range(count)}
    device = own_device(peaks, torch.cuda.current_device(), index, count)
    stats = torch.cuda.memory_stats(device)
    reserved_now = stats.get("reserved_bytes.all.current", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    contexts = _nvml_contexts(os.getpid())
    used_here = dict(contexts).get(device)
    return {
        "device": f"cuda:{device}",
        "peak_allocated": stats.get("allocated_bytes.all.peak", 0),
        "peak_reserved": stats.get("reserved_bytes.all.peak", 0),
        "outside": max(used_here - reserved_now, 0) if used_here is not None else None,
        "capacity": total,
        "limit": limit_bytes(limit, total) if limit is not None else None,
        "contexts": [list(c) for c in contexts],
    }


def _nvml_contexts(pid: int) -> list[tuple[int, int]]:
    """``(cuda index, bytes)`` for every GPU where NVML lists ``pid`` (empty where NVML shows host PIDs
    that differ from ours, in containers)."""
    from ..devices import read_devices

    report = read_devices()
    found = []
    for gpu in report.devices:
        for proc in gpu.processes:
            if proc.pid == pid and gpu.cuda_index is not None:
                found.append((gpu.cuda_index, proc.used or 0))
    return found
