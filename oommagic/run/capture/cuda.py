"""CUDA mode: the caching allocator's own history replayed into a timeline, ``memory_stats`` for the
exact peaks, the out-of-memory observer for the exact request."""

from __future__ import annotations

import time
from typing import Any

from ...timeline import Timeline
from .record import Recording, StepMarks

# 500k trace entries is a few hundred MB at most and covers minutes of training; a longer cell loses its
# earliest events (the peak figures come from memory_stats and stay exact).
CUDA_TRACE_ENTRIES = 500_000



_oom_events: list[tuple[int, int, int, int]] = []
_observer_attached = False


def _attach_oom_observer() -> None:
    # The observer cannot be detached, so one per process, feeding a list the active recorder reads.
    global _observer_attached
    if _observer_attached:
        return
    import torch

    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        try:
            attach(
                lambda device, requested, allowed, free: _oom_events.append(
                    (device, requested, allowed, free)
                )
            )
        except RuntimeError:
            # cudaMallocAsync has no observer; the message still carries the figures.
            return
    _observer_attached = True


class CudaRecorder:
    """Records a CUDA device through the caching allocator's own history and ``memory_stats``.

    Initialises CUDA. Turns history recording on for the cell (``context=None``: no stack capture) unless
    the user was already recording, in which case their recording is left exactly as it was. With
    ``limit`` it sets ``set_per_process_memory_fraction`` and restores the previous fraction after.
    ``timeline=False`` leaves the history alone and takes no snapshot: no cost per allocation, the peak
    still exact, the timeline only the start and the end.
    """

    def __init__(self, index: int, limit: int | None = None, timeline: bool = True) -> None:
        import torch

        self.timeline = timeline
        self.index = index
        self.device = f"cuda:{index}"
        _, total = torch.cuda.mem_get_info(index)
        self.capacity = total
        self.limit = limit
        self._torch = torch
        self._owns_history = False
        self._owned_history = False
        self._old_fraction: float | None = None
        self._marks = StepMarks()
        self._start = 0.0
        self._before = (0, 0)
        self._snapshot: dict | None = None
        self._end = 0.0
        self._after = (0, 0)
        self._peak = (0, 0)
        self._oom_from = 0

    def allocated(self) -> int:
        return self._torch.cuda.memory_allocated(self.index)

    def __enter__(self) -> CudaRecorder:
        torch = self._torch
        _attach_oom_observer()
        self._oom_from = len(_oom_events)
        try:
            if self.limit is not None:
                getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
                self._old_fraction = getter(self.index) if getter else 1.0
                torch.cuda.set_per_process_memory_fraction(self.limit / self.capacity, self.index)
            if self.timeline and not torch._C._cuda_isHistoryEnabled():
                torch.cuda.memory._record_memory_history(
                    enabled="all", context=None, stacks="python", max_entries=CUDA_TRACE_ENTRIES
                )
                self._owns_history = True
            self._marks.install()
        except BaseException:
            self._restore()
            raise
        torch.cuda.reset_peak_memory_stats(self.index)
        self._before = (torch.cuda.memory_allocated(self.index), torch.cuda.memory_reserved(self.index))
        self._start = time.time()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch = self._torch
        try:
            stats = torch.cuda.memory_stats(self.index)
            self._peak = (stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0))
            self._after = (
                stats.get("allocated_bytes.all.current", 0),
                stats.get("reserved_bytes.all.current", 0),
            )
            # Turning recording off clears the history: take the snapshot first.
            self._snapshot = torch.cuda.memory._snapshot() if self.timeline else None
            self._end = time.time()
        finally:
            self._restore()

    def _restore(self) -> None:
        torch = self._torch
        self._marks.remove()
        if self._owns_history:
            self._owns_history = False
            self._owned_history = True
            torch.cuda.memory._record_memory_history(enabled=None)
        if self._old_fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self._old_fraction, self.index)
            self._old_fraction = None

    @property
    def exact(self) -> dict[str, int]:
        """Exact figures of this cell's last allocator OOM, from the OOM observer (the message rounds)."""
        mine = [e for e in _oom_events[self._oom_from :] if e[0] == self.index]
        if not mine:
            return {}
        _, requested, _allowed, free = mine[-1]
        return {"requested": requested, "free": free}

    def recording(self) -> Recording:
        # History switched on for this cell holds only this cell's events: replay all of them, so no
        # event is lost to a difference between the allocator's clock and time.time().
        steps = [x - self._start for x in self._marks.times]
        if self.timeline:
            timeline = cuda_timeline(
                self._snapshot or {},
                self.index,
                start_us=0.0 if self._owned_history else self._start * 1e6,
                origin_us=self._start * 1e6,
                before=self._before,
                steps=steps,
            )
        else:
            timeline = Timeline(
                t=(0.0, max(self._end - self._start, 0.0)),
                allocated=(self._before[0], self._after[0]),
                reserved=(self._before[1], self._after[1]),
                steps=tuple(steps),
            )
        return Recording(
            device=self.device,
            before_allocated=self._before[0],
            before_reserved=self._before[1],
            after_allocated=self._after[0],
            after_reserved=self._after[1],
            peak_allocated=self._peak[0],
            peak_reserved=self._peak[1],
            capacity=self.capacity,
            limit=self.limit,
            timeline=timeline,
        )


_ALLOC_DELTA = {"alloc": 1, "free_requested": -1}
_RESERVE_DELTA = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}


def cuda_timeline(
    snapshot: dict,
    index: int,
    start_us: float,
    before: tuple[int, int],
    steps: list[float],
    origin_us: float | None = None,
) -> Timeline:
    """Replay the allocator trace of device ``index`` from ``start_us`` on, starting from ``before``
    (allocated, reserved); times are seconds from ``origin_us`` (default ``start_us``).
    ``memory_allocated`` counts a block when it is handed out and uncounts it at ``free_requested``, so
    the replay's maximum equals ``max_memory_allocated``."""
    origin = start_us if origin_us is None else origin_us
    traces = snapshot.get("device_traces") or []
    entries = traces[index] if index < len(traces) else []
    allocated, reserved = before
    t: list[float] = [0.0]
    a: list[int] = [allocated]
    r: list[int] = [reserved]
    oom_at = None
    for e in entries:
        when = e.get("time_us", 0)
        if when < start_us:
            continue
        action = e.get("action")
        # The allocator counts whole blocks, multiples of 512 bytes; round a trace size up to one.
        size = -(-e.get("size", 0) // 512) * 512
        if action in _ALLOC_DELTA:
            allocated += _ALLOC_DELTA[action] * size
        elif action in _RESERVE_DELTA:
            reserved += _RESERVE_DELTA[action] * size
        elif action == "oom":
            oom_at = (when - origin) / 1e6
        else:
            continue
        t.append(max((when - origin) / 1e6, 0.0))
        a.append(allocated)
        r.append(reserved)
    truncated = (
        len(entries) >= CUDA_TRACE_ENTRIES and bool(entries) and entries[0].get("time_us", 0) > start_us
    )
    return Timeline(
        t=tuple(t),
        allocated=tuple(a),
        reserved=tuple(r),
        steps=tuple(steps),
        oom_at=oom_at,
        truncated=truncated,
        events=len(t) - 1,
    )
