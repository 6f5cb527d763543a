"""CUDA mode: the caching allocator's own history replayed into a timeline, ``memory_stats`` for the
exact peaks, the out-of-memory observer for the exact request.

Nothing here starts CUDA on the cell's behalf. Where the kernel has not started it when the cell begins
(a notebook about to fork its ranks with ``notebook_launcher`` must not have), the recording starts when
the cell's own code starts CUDA, from torch's queue of calls run at its lazy initialisation; until then
the figures come from NVML, and a cell that never starts CUDA leaves it unstarted.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any

from ...categories import Breakdown, breakdown
from ...timeline import Timeline
from .nvml import BusySampler, device_memory, handle_for, total_memory
from .record import Recording, StepMarks, collector_paused
from .roles import StepRoles, cuda_key, now_us, observe
from .trace import (
    CUDA_TRACE_ENTRIES,
    TraceEvents,
    cuda_timeline,
    live_at_event,
    packed,
    snapshot_blocks,
    start_blocks,
    unpacked,
)

# The replay reads alloc and free_requested (the moments memory_allocated counts) and the segments; a
# free_completed follows each free_requested at once unless another stream still uses the block. Left
# out of the history it takes a third of the trace, and of the snapshot's time (19 ms for the 30,003
# entries of 10,000 small ops on an H100), away. ``snapshot_file`` puts them back for PyTorch's viewer.
SKIPPED_ACTIONS = ("free_completed",)


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


def start_when(initialised: bool, own_process: bool = True) -> str:
    """When a recorder starts the allocator's recording: ``"now"`` where CUDA runs in this process;
    ``"with the cell's CUDA"`` where it does not yet (queued for torch's lazy initialisation, so the cell,
    not the tool, starts CUDA); ``"never"`` in another process that inherited the queue by a fork (a rank
    records itself, on its own device)."""
    if not own_process:
        return "never"
    return "now" if initialised else "with the cell's CUDA"


class CudaRecorder:
    """Records a CUDA device through the caching allocator's own history and ``memory_stats``.

    Starts no CUDA itself (``start_when``): constructing, entering and leaving it with CUDA unstarted
    calls nothing that initialises it. Once CUDA runs it turns history recording on for the cell
    (``context=None``: no stack capture) unless the user was already recording, in which case their
    recording is left exactly as it was. With ``limit`` it sets ``set_per_process_memory_fraction`` and
    restores the previous fraction after. ``timeline=False`` leaves the history alone and takes no
    snapshot: no cost per allocation, the peak still exact, the timeline only the start and the end.
    """

    def __init__(
        self,
        index: int,
        limit: int | None = None,
        timeline: bool = True,
        stacks: bool = False,
        trace_entries: int = CUDA_TRACE_ENTRIES,
    ) -> None:
        import torch

        self.timeline = timeline
        self.stacks = stacks
        self.trace_entries = trace_entries
        self.index = index
        self.device = f"cuda:{index}"
        self._nvml = handle_for(index)
        self.capacity = _capacity(torch, index, self._nvml)
        # NVML's total counts memory the driver keeps (~0.5 GiB on an H100): where CUDA has not started,
        # the capacity and a fractional limit are read again from the driver when the cell starts it.
        self._capacity_read = torch.cuda.is_initialized()
        self.limit = limit
        self.limit_fraction: float | None = None  # a fractional --limit, resolved against the capacity
        self._torch = torch
        self._pid = os.getpid()
        self._started = False  # the allocator's recording is on for this cell
        self._queued: Any = None  # the start put in torch's lazy-initialisation queue
        self._waiting = False  # it has not run yet
        self._owns_history = False
        self._owned_history = False
        self._old_fraction: float | None = None
        self._marks = StepMarks()
        self._start = 0.0
        self._before = (0, 0)
        self._snapshot: dict | None = None
        self._timeline: Timeline | None = None
        self._skipped: tuple[str, ...] = ()
        self._end = 0.0
        self._after = (0, 0)
        self._peak = (0, 0)
        self._oom_from = 0
        self._steps = StepRoles(cuda_key(index), now_us)
        self._busy = BusySampler(self._nvml)
        self.at_failure: Breakdown | None = None
        self.snapshot_ms: float | None = None
        # The trace's allocs and frees as ``categories`` events, gathered by the timeline's own replay.
        self._events = TraceEvents()

    def allocated(self) -> int:
        return counters(self._torch, self.index)[0]

    def __enter__(self) -> CudaRecorder:
        self._start = time.time()
        when = start_when(self._torch.cuda.is_initialized())
        try:
            self._marks.install(self._steps)
            if when == "now":
                self._begin()
            else:
                self._queued, self._waiting = self._begin_with_the_cell, True
                self._torch.cuda._lazy_call(self._queued)
        except BaseException:
            self._restore()
            raise
        self._busy.start()
        return self

    def _begin(self) -> None:
        """Start recording: the OOM observer, the limit, the allocator's history, the peaks from here.
        Run with CUDA started, or from torch's lazy initialisation (where ``memory_stats`` still reads
        ``{}`` and the cell has allocated nothing yet)."""
        torch = self._torch
        _attach_oom_observer()
        self._oom_from = len(_oom_events)
        if not self._capacity_read:
            self.capacity = torch.cuda.mem_get_info(self.index)[1]
            self._capacity_read = True
            if self.limit_fraction is not None:
                self.limit = int(self.limit_fraction * self.capacity)
        if self.limit is not None:
            getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
            self._old_fraction = getter(self.index) if getter else 1.0
            torch.cuda.set_per_process_memory_fraction(self.limit / self.capacity, self.index)
            if counters(torch, self.index)[1] > self.limit:
                # The fraction is checked when a segment is reserved: cached segments beyond the
                # limit would let the cell run past a card that could never have held them.
                torch.cuda.empty_cache()
        if self.timeline and not torch._C._cuda_isHistoryEnabled():
            self._skipped = record_history(torch, self.stacks, self.trace_entries)
            self._owns_history = True
        torch.cuda.reset_peak_memory_stats(self.index)
        self._before = counters(torch, self.index)[:2]
        self._started = True

    def _begin_with_the_cell(self) -> None:
        """The start queued for torch's lazy initialisation. A rank forked from the kernel inherits the
        queue: there it does nothing (the rank records itself, on its own device). An error here would
        reach the cell as torch's DeferredCudaCallError: the figures are lost instead, not the cell."""
        if start_when(False, os.getpid() == self._pid) == "never" or not self._waiting:
            return
        self._waiting = False
        try:
            self._begin()
        except Exception:
            with contextlib.suppress(Exception):
                self._restore()

    def _unqueue(self) -> None:
        """The queued start taken back out of torch's queue, run or not: one that never ran would start a
        recording in a later cell's initialisation, and torch keeps the queue (and this recorder, its
        snapshot and timeline with it) for the life of the process."""
        queued, self._queued, self._waiting = self._queued, None, False
        if queued is None:
            return
        calls = getattr(self._torch.cuda, "_queued_calls", None)
        with contextlib.suppress(Exception), self._torch.cuda._initialization_lock:
            calls[:] = [entry for entry in calls if entry[0] is not queued]

    @property
    def started(self) -> bool:
        """Whether CUDA ran for this cell: started before it, or by its code."""
        return self._started

    def __exit__(self, *exc: Any) -> None:
        torch = self._torch
        self._busy.stop()
        self._unqueue()
        if not self._started:
            # The cell never started CUDA: nothing to read, and reading would start it.
            self._end = time.time()
            self._restore()
            return
        # The snapshot's entries are replayed and packed before the collector runs again: they are gone
        # (their columns stay) before it could walk them.
        with collector_paused():
            try:
                allocated, reserved, peak_allocated, peak_reserved = counters(torch, self.index)
                self._peak = (peak_allocated, peak_reserved)
                self._after = (allocated, reserved)
                # Turning recording off clears the history: take the snapshot first.
                if self._snapshot is None:
                    self._snapshot = self._take_snapshot()
                self._end = time.time()
            finally:
                self._restore()
            if self.timeline:
                self._snapshot = packed(self._snapshot)
                self._timeline = self._replay()

    def _take_snapshot(self) -> dict:
        snapshot = self._torch.cuda.memory._snapshot()
        if self._skipped:
            snapshot.setdefault("oommagic", {})["skipped_actions"] = list(self._skipped)
        return snapshot

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
    def busy(self) -> float | None:
        """Mean GPU busy percentage NVML reported while the cell ran (None without NVML)."""
        return self._busy.mean

    def capture_failure(self, spaces: list) -> Breakdown | None:
        """The breakdown now, at an out-of-memory error, before anything is given back: the allocator's
        snapshot (kept: it is the one ``%gpumem --snapshot`` writes, and the timeline's trace) for the live
        blocks and the cache, the roles from the namespace and the failed frames (``spaces``), NVML for the
        memory outside PyTorch and the other processes. Sums to NVML's used memory of the device. None
        where the cell never started CUDA (the failure was not on this device)."""
        if not self._started:
            return None
        t0 = time.perf_counter()
        self._snapshot = self._take_snapshot()
        self.snapshot_ms = (time.perf_counter() - t0) * 1e3
        blocks, reserved = snapshot_blocks(self._snapshot, self.index)
        self.at_failure = self._breakdown(
            blocks, observe(spaces, cuda_key(self.index), now_us()), reserved, "failure"
        )
        return self.at_failure

    def snapshot(self) -> dict | None:
        """The allocator snapshot this cell took (at the failure, else at the end; None with
        ``--no-timeline`` on a run that did not fail): what ``torch.cuda.memory._snapshot()`` returns."""
        return None if self._snapshot is None else unpacked(self._snapshot)

    def categories(self, spaces: list, timeline: Timeline) -> Breakdown | None:
        """After the cell: at the failure if there was one; else at the peak replayed from the trace (the
        roles from the namespace now and the optimizer steps around the peak; memory outside PyTorch read
        at the end); without a timeline, at the end. None where the cell never started CUDA."""
        if self.at_failure is not None:
            return self.at_failure
        if not self._started:
            return None
        with collector_paused():
            return self._at_peak(spaces, timeline)

    def _at_peak(self, spaces: list, timeline: Timeline) -> Breakdown:
        seen = observe(spaces, cuda_key(self.index), now_us())
        snap = self._snapshot if self._snapshot is not None else self._torch.cuda.memory._snapshot()
        blocks, reserved = snapshot_blocks(snap, self.index)
        if not self.timeline:
            self._snapshot = None  # segments only: nothing a viewer's timeline could show
            return self._breakdown(blocks, seen + self._steps.first, reserved, "end")
        events = self._events
        at_peak = live_at_event(start_blocks(events, blocks), events, events.peak)
        tl = timeline
        peak_reserved = tl.reserved[tl.allocated.index(tl.peak_allocated)] if tl.t else reserved
        clock = events[events.peak][0] if events.peak >= 0 else self._start * 1e6
        observed = seen + self._steps.around(clock, seen)
        return self._breakdown(at_peak.values(), observed, peak_reserved, "peak", end_reserved=reserved)

    def _breakdown(
        self, blocks: Any, seen: list, reserved: int, at: str, end_reserved: int | None = None
    ) -> Breakdown:
        mem = device_memory(self._nvml)
        budget = self.limit or self.capacity
        if mem is None:
            # No NVML: the device's used memory from the driver; the rest of this process's memory outside
            # PyTorch cannot be told from other processes.
            free, total = self._torch.cuda.mem_get_info(self.index)
            measured = "allocator" if at == "peak" else "residual"
            return breakdown(blocks, seen, at, measured, budget, reserved, device_used=total - free)
        process = mem.process
        if process is not None and end_reserved is not None:
            process = process - end_reserved + reserved  # outside PyTorch read at the end, moved to the peak
        used = mem.used if end_reserved is None else None
        return breakdown(
            blocks,
            seen,
            at,
            # "residual": NVML lists no figure for this process (containers show host PIDs), so memory
            # outside PyTorch is what the device's used memory leaves over: a sum true by construction.
            "allocator" if at == "peak" else "device" if mem.process is not None else "residual",
            budget,
            reserved,
            device_used=used,
            process_used=process,
            others=mem.others,
        )

    @property
    def exact(self) -> dict[str, int]:
        """Exact figures of this cell's last allocator OOM, from the OOM observer (the message rounds)."""
        mine = [e for e in _oom_events[self._oom_from :] if e[0] == self.index]
        if not mine:
            return {}
        _, requested, _allowed, free = mine[-1]
        return {"requested": requested, "free": free}

    def _replay(self) -> Timeline:
        # History switched on for this cell holds only this cell's events: replay all of them, so no
        # event is lost to a difference between the allocator's clock and time.time().
        return cuda_timeline(
            self._snapshot or {},
            self.index,
            start_us=0.0 if self._owned_history else self._start * 1e6,
            origin_us=self._start * 1e6,
            before=self._before,
            steps=[x - self._start for x in self._marks.times],
            events=self._events,
            # A history this recorder turned on without --stacks has no frames to read.
            lines=self.stacks or not self._owned_history,
            entries=self.trace_entries,
        )

    def recording(self) -> Recording:
        """The figures and the timeline (replayed from the trace at the cell's end; with ``--no-timeline``
        only the start and the end)."""
        timeline = self._timeline
        if timeline is None:
            timeline = Timeline(
                t=(0.0, max(self._end - self._start, 0.0)),
                allocated=(self._before[0], self._after[0]),
                reserved=(self._before[1], self._after[1]),
                steps=tuple(x - self._start for x in self._marks.times),
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


def _capacity(torch: Any, index: int, handle: Any) -> int | None:
    """The device's capacity: from the driver where CUDA runs, else from NVML (None without NVML: read
    when the cell starts CUDA)."""
    if torch.cuda.is_initialized():
        return torch.cuda.mem_get_info(index)[1]
    return total_memory(handle)


def counters(torch: Any, index: int) -> tuple[int, int, int, int]:
    """Allocated and reserved bytes of device ``index`` now, then their peaks, from the allocator's nested
    statistics: ``torch.cuda.memory_allocated`` and its kin flatten all of them into one dict first (0.8
    ms a call on an H100 host, four calls a cell)."""
    stats = torch.cuda.memory_stats_as_nested_dict(index)
    allocated = stats.get("allocated_bytes", {}).get("all", {})
    reserved = stats.get("reserved_bytes", {}).get("all", {})
    return (
        allocated.get("current", 0),
        reserved.get("current", 0),
        allocated.get("peak", 0),
        reserved.get("peak", 0),
    )


def record_history(torch: Any, stacks: bool, entries: int = CUDA_TRACE_ENTRIES) -> tuple[str, ...]:
    """Turn the CUDA allocator's history on (``context=None``: no stack capture; Python stacks of each
    alloc with ``stacks``), keeping the last ``entries`` events, without the actions the replay never
    reads where this torch can leave them out (``skip_actions``); returns the actions left out."""
    # Python stacks only with --stacks: C++ stacks cost ~1.4 s per snapshot (DESIGN.md).
    settings = {
        "enabled": "all",
        "context": "alloc" if stacks else None,
        "stacks": "python",
        "max_entries": entries,
    }
    try:
        torch.cuda.memory._record_memory_history(**settings, skip_actions=list(SKIPPED_ACTIONS))
    except (TypeError, ValueError, RuntimeError):
        # A torch from before skip_actions, or one that names the actions otherwise: record them all (an
        # error of its own comes again from this call).
        torch.cuda.memory._record_memory_history(**settings)
        return ()
    return SKIPPED_ACTIONS
