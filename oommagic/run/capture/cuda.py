"""CUDA mode: the caching allocator's own history replayed into a timeline, ``memory_stats`` for the
exact peaks, the out-of-memory observer for the exact request."""

from __future__ import annotations

import time
from typing import Any

from ...categories import Block, Breakdown, breakdown, live_at, peak_index
from ...timeline import Timeline
from .nvml import BusySampler, device_memory, handle_for
from .record import Recording, StepMarks
from .roles import StepRoles, cuda_key, now_us, observe

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

    def __init__(
        self, index: int, limit: int | None = None, timeline: bool = True, stacks: bool = False
    ) -> None:
        import torch

        self.timeline = timeline
        self.stacks = stacks
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
        self._steps = StepRoles(cuda_key(index), now_us)
        self._nvml = handle_for(index)
        self._busy = BusySampler(self._nvml)
        self.at_failure: Breakdown | None = None
        self.snapshot_ms: float | None = None
        # The trace's allocs and frees as ``categories`` events, gathered by the timeline's own replay.
        self._events = TraceEvents()

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
                # Python stacks only with --stacks: C++ stacks cost ~1.4 s per snapshot (DESIGN.md).
                torch.cuda.memory._record_memory_history(
                    enabled="all",
                    context="alloc" if self.stacks else None,
                    stacks="python",
                    max_entries=CUDA_TRACE_ENTRIES,
                )
                self._owns_history = True
            self._marks.install(self._steps)
        except BaseException:
            self._restore()
            raise
        torch.cuda.reset_peak_memory_stats(self.index)
        self._before = (torch.cuda.memory_allocated(self.index), torch.cuda.memory_reserved(self.index))
        self._start = time.time()
        self._busy.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        torch = self._torch
        self._busy.stop()
        try:
            stats = torch.cuda.memory_stats(self.index)
            self._peak = (stats.get("allocated_bytes.all.peak", 0), stats.get("reserved_bytes.all.peak", 0))
            self._after = (
                stats.get("allocated_bytes.all.current", 0),
                stats.get("reserved_bytes.all.current", 0),
            )
            # Turning recording off clears the history: take the snapshot first.
            if self._snapshot is None:
                self._snapshot = torch.cuda.memory._snapshot()
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
    def busy(self) -> float | None:
        """Mean GPU busy percentage NVML reported while the cell ran (None without NVML)."""
        return self._busy.mean

    def capture_failure(self, spaces: list) -> Breakdown:
        """The breakdown now, at an out-of-memory error, before anything is given back: the allocator's
        snapshot (kept: it is the one ``%gpumem --snapshot`` writes, and the timeline's trace) for the live
        blocks and the cache, the roles from the namespace and the failed frames (``spaces``), NVML for the
        memory outside PyTorch and the other processes. Sums to NVML's used memory of the device."""
        t0 = time.perf_counter()
        self._snapshot = self._torch.cuda.memory._snapshot()
        self.snapshot_ms = (time.perf_counter() - t0) * 1e3
        blocks, reserved = snapshot_blocks(self._snapshot, self.index)
        self.at_failure = self._breakdown(
            blocks, observe(spaces, cuda_key(self.index), now_us()), reserved, "failure"
        )
        return self.at_failure

    def snapshot(self) -> dict | None:
        """The allocator snapshot this cell took (at the failure, else at the end; None with
        ``--no-timeline`` on a run that did not fail): what ``torch.cuda.memory._snapshot()`` returns."""
        return self._snapshot

    def categories(self, spaces: list, timeline: Timeline) -> Breakdown:
        """After the cell: at the failure if there was one; else at the peak replayed from the trace (the
        roles from the namespace now and the optimizer steps around the peak; memory outside PyTorch read
        at the end); without a timeline, at the end."""
        if self.at_failure is not None:
            return self.at_failure
        seen = observe(spaces, cuda_key(self.index), now_us())
        snap = self._snapshot if self._snapshot is not None else self._torch.cuda.memory._snapshot()
        blocks, reserved = snapshot_blocks(snap, self.index)
        if not self.timeline:
            self._snapshot = None  # segments only: nothing a viewer's timeline could show
            return self._breakdown(blocks, seen + self._steps.first, reserved, "end")
        if self._events:
            start, events, index = start_blocks(self._events, blocks), self._events, self._events.peak
        else:
            start, events = trace_events(
                snap, self.index, self._start * 1e6 if not self._owned_history else 0.0, blocks
            )
            before = sum(b.nbytes for b in start.values())
            index = peak_index(before, events, {k: b.nbytes for k, b in start.items()})
        at_peak = live_at(start, events, index)
        tl = timeline
        peak_reserved = (
            tl.reserved[max(range(len(tl.allocated)), key=tl.allocated.__getitem__)] if tl.t else reserved
        )
        clock = events[index][0] if index >= 0 else self._start * 1e6
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
                events=self._events,
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
    events: TraceEvents | None = None,
) -> Timeline:
    """Replay the allocator trace of device ``index`` from ``start_us`` on, starting from ``before``
    (allocated, reserved); times are seconds from ``origin_us`` (default ``start_us``).
    ``memory_allocated`` counts a block when it is handed out and uncounts it at ``free_requested``, so
    the replay's maximum equals ``max_memory_allocated``. ``events``, when given, receives every alloc and
    free as a ``categories`` event (µs, address, bytes or -bytes freed, None, Python line) and the index
    of the one after which allocated memory peaked, in the same pass."""
    origin = start_us if origin_us is None else origin_us
    traces = snapshot.get("device_traces") or []
    entries = traces[index] if index < len(traces) else []
    allocated, reserved = before
    gather = events is not None
    append = events.append if events is not None else None
    top, peak = allocated, -1
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
            if gather:
                if action == "alloc":
                    frames = e.get("frames")
                    append((when, e["addr"], size, None, user_line(frames) if frames else None))
                    if allocated > top:
                        top, peak = allocated, len(events) - 1
                else:
                    append((when, e["addr"], -size, None, None))
        elif action in _RESERVE_DELTA:
            reserved += _RESERVE_DELTA[action] * size
        elif action == "oom":
            oom_at = (when - origin) / 1e6
        else:
            continue
        t.append(max((when - origin) / 1e6, 0.0))
        a.append(allocated)
        r.append(reserved)
    if events is not None:
        events.top, events.peak = top, peak
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


class TraceEvents(list):
    """``categories`` events replayed from the allocator trace; ``peak`` the index of the event after
    which allocated memory was highest (-1: at the start), ``top`` that level."""

    peak: int = -1
    top: int = 0


def snapshot_blocks(snapshot: dict, index: int) -> tuple[list[Block], int]:
    """The live blocks of device ``index`` in an allocator snapshot (with the Python line that made each
    where frames were recorded) and the bytes its segments reserve."""
    blocks, reserved = [], 0
    for seg in snapshot.get("segments", ()):
        if seg.get("device", index) != index:
            continue
        reserved += seg.get("total_size", 0)
        for b in seg.get("blocks", ()):
            if b.get("state") == "active_allocated":
                blocks.append(Block(b["address"], b["size"], line=user_line(b.get("frames") or ())))
    return blocks, reserved


def trace_events(
    snapshot: dict, index: int, start_us: float, end_blocks: list[Block]
) -> tuple[dict[int, Block], list]:
    """The allocator trace from ``start_us`` on as events for ``categories.live_at`` (clock: µs), and the
    blocks alive at its start: those freed in the trace without being allocated in it, and those alive at
    the end that the trace never allocated."""
    traces = snapshot.get("device_traces") or []
    entries = [e for e in (traces[index] if index < len(traces) else []) if e.get("time_us", 0) >= start_us]
    events, born = [], set()
    start: dict[int, Block] = {}
    for e in entries:
        action, addr = e.get("action"), e.get("addr", 0)
        size = -(-e.get("size", 0) // 512) * 512
        if action == "alloc":
            born.add(addr)
            events.append((e.get("time_us", 0), addr, size, None, user_line(e.get("frames") or ())))
        elif action == "free_requested":
            if addr not in born:
                start.setdefault(addr, Block(addr, size))
            events.append((e.get("time_us", 0), addr, -size, None, None))
    for b in end_blocks:
        if b.key not in born:
            start.setdefault(b.key, Block(b.key, b.nbytes, line=b.line))
    return start, events


def start_blocks(events: list, end_blocks: list[Block]) -> dict[int, Block]:
    """The blocks alive before the first of ``events``: freed without being allocated in them (a free
    carries its size, negated), or alive at the end without an alloc among them."""
    born: set[int] = set()
    start: dict[int, Block] = {}
    for _, addr, size, _op, _line in events:
        if size > 0:
            born.add(addr)
        elif addr not in born and addr not in start:
            start[addr] = Block(addr, -size)
    for b in end_blocks:
        if b.key not in born:
            start.setdefault(b.key, b)
    return start


def user_line(frames: Any) -> str | None:
    """'cell:5 y = model(x)' from an allocator record's Python frames: the innermost outside torch."""
    import linecache
    import os

    for f in frames:
        filename = f.get("filename", "")
        if filename and "/torch/" not in filename and not filename.startswith("??"):
            cell = filename.startswith("<ipython-input") or "/ipykernel_" in filename
            code = linecache.getline(filename, f.get("line", 0)).strip() or f"in {f.get('name', '')}"
            return f"{'cell' if cell else os.path.basename(filename)}:{f.get('line', 0)} {code}"
    return None
