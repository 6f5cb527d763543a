"""Recorders: what a cell did to memory, from the CUDA allocator's own trace or, on CPU, from tensor
storages tracked through a dispatch mode. Both give a ``Recording``; both restore what they changed.

torch is imported inside functions so that ``import oommagic`` stays light.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from .oom import format_emulated_oom
from .timeline import Timeline

# 500k trace entries is a few hundred MB at most and covers minutes of training; a longer cell loses its
# earliest events (the peak figures come from memory_stats and stay exact).
CUDA_TRACE_ENTRIES = 500_000


@dataclass
class Recording:
    """The figures a recorder measured over one cell; bytes are ``int``."""

    device: str
    before_allocated: int = 0
    before_reserved: int = 0
    after_allocated: int = 0
    after_reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    capacity: int | None = None
    limit: int | None = None
    timeline: Timeline = field(default_factory=Timeline)


class _StepMarks:
    """Times of optimizer steps, from torch's global optimizer step hook."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._handle: Any = None

    def install(self) -> None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self._handle = register_optimizer_step_post_hook(lambda *_: self.times.append(time.time()))

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


# --------------------------------------------------------------------------------------------- CPU mode


class CpuLedger:
    """Live bytes of every CPU tensor storage created under ``%%gpumem``, across cells.

    A storage is counted once (views share it) and uncounted when torch frees it: the finalizer sits on
    the storage's Python object, which torch keeps alive exactly as long as the storage itself.
    """

    def __init__(self) -> None:
        self.live: dict[int, int] = {}
        self.allocated = 0
        self.listener: CpuRecorder | None = None
        self._lock = threading.Lock()

    def add(self, storage: Any) -> int:
        key = storage._cdata
        nbytes = storage.nbytes()
        with self._lock:
            old = self.live.get(key)
            if old == nbytes:
                return 0
            self.live[key] = nbytes
            self.allocated += nbytes - (old or 0)
        if old is None:
            weakref.finalize(storage, self._release, key)
        self._notify()
        return nbytes - (old or 0)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self.live.pop(key, 0)
            self.allocated -= nbytes
        if nbytes:
            self._notify()

    def _notify(self) -> None:
        listener = self.listener
        if listener is not None:
            listener.sample(self.allocated)


LEDGER = CpuLedger()


def host_memory() -> int:
    """Physical memory of this machine in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _factory_bytes(func: Any, args: tuple, kwargs: dict) -> int | None:
    """Bytes a factory op (empty, zeros, full, randn, ...) is about to allocate on CPU, from its size
    argument; None for other ops. Lets an emulated limit refuse a 40 GiB request before it exists."""
    import torch

    schema = func._schema
    if not schema.arguments or schema.arguments[0].name != "size" or not args:
        return None
    device = kwargs.get("device")
    if device is not None and torch.device(device).type != "cpu":
        return None
    dtype = kwargs.get("dtype") or torch.get_default_dtype()
    n = 1
    for dim in args[0]:
        n *= int(dim)
    return n * torch.empty((), dtype=dtype).element_size()


def _make_tracker(recorder: CpuRecorder) -> Any:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class TensorBytesTracker(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if recorder.limit is not None:
                planned = _factory_bytes(func, args, kwargs)
                if planned is not None:
                    recorder.check(planned)
            out = func(*args, **kwargs)
            fresh = []
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
                    st = t.untyped_storage()
                    if st._cdata not in LEDGER.live or LEDGER.live[st._cdata] != st.nbytes():
                        fresh.append(st)
            if fresh and recorder.limit is not None:
                recorder.check(sum(st.nbytes() - LEDGER.live.get(st._cdata, 0) for st in fresh))
            for st in fresh:
                LEDGER.add(st)
            return out

    return TensorBytesTracker()


class CpuRecorder:
    """Tracks CPU tensor storages while a cell runs; with ``limit`` it emulates a card of that size by
    raising ``torch.OutOfMemoryError`` in PyTorch's own message format. ``timeline=False`` keeps the
    start and the end only (the peak stays exact)."""

    def __init__(self, limit: int | None = None, timeline: bool = True) -> None:
        self.device = "cpu"
        self.limit = limit
        self.timeline = timeline
        self.capacity = limit if limit is not None else host_memory()
        self._t: list[float] = []
        self._a: list[int] = []
        self._oom_at: float | None = None
        self._marks = _StepMarks()
        self._mode: Any = None
        self._start = 0.0
        self._peak = 0
        self._before = 0
        self.exact: dict[str, int] = {}

    def allocated(self) -> int:
        return LEDGER.allocated

    def sample(self, allocated: int) -> None:
        self._peak = max(self._peak, allocated)
        if self.timeline:
            self._point(allocated)

    def _point(self, allocated: int) -> None:
        self._t.append(time.time())
        self._a.append(allocated)

    def check(self, requested: int) -> None:
        """Raise the emulated out-of-memory error if ``requested`` more bytes would pass the limit."""
        import torch

        held = LEDGER.allocated
        if requested <= 0 or self.limit is None or held + requested <= self.limit:
            return
        self._oom_at = time.time()
        self.exact = {
            "requested": requested,
            "capacity": self.capacity,
            "free": max(self.limit - held, 0),
            "process_used": held,
            "allocated": held,
            "limit": self.limit,
        }
        raise torch.OutOfMemoryError(format_emulated_oom(**self.exact))

    def __enter__(self) -> CpuRecorder:
        self._start = time.time()
        self._before = LEDGER.allocated
        self._peak = self._before
        self._point(self._before)
        self._mode = _make_tracker(self)
        LEDGER.listener = self
        try:
            self._marks.install()
            self._mode.__enter__()
        except BaseException:
            LEDGER.listener = None
            self._marks.remove()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            self._marks.remove()
            LEDGER.listener = None
        self._point(LEDGER.allocated)

    def recording(self) -> Recording:
        start = self._start
        timeline = Timeline(
            t=tuple(x - start for x in self._t),
            allocated=tuple(self._a),
            reserved=tuple(self._a),
            steps=tuple(x - start for x in self._marks.times),
            oom_at=None if self._oom_at is None else self._oom_at - start,
            events=len(self._t),
        )
        return Recording(
            device="cpu",
            before_allocated=self._before,
            before_reserved=self._before,
            after_allocated=LEDGER.allocated,
            after_reserved=LEDGER.allocated,
            peak_allocated=self._peak,
            peak_reserved=self._peak,
            capacity=self.capacity,
            limit=self.limit,
            timeline=timeline,
        )


# -------------------------------------------------------------------------------------------- CUDA mode

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
        self._marks = _StepMarks()
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


def open_recorder(
    device: str | None, limit: float | int | None, timeline: bool = True
) -> CpuRecorder | CudaRecorder:
    """A recorder for ``device`` ("cpu", "cuda", "cuda:N", "N" or None = CUDA if available, else CPU);
    ``timeline=False`` records the peak and the steps but no timeline between the start and the end.

    ``limit`` is bytes (int) or a fraction of the capacity (float in (0, 1]). A byte limit at or above the
    card's capacity is dropped with a warning. Raises ``ValueError`` for a device that does not exist.
    """
    import warnings

    import torch

    kind, index = _resolve_device(device, torch)
    if kind == "cpu":
        capacity = host_memory()
        return CpuRecorder(_resolve_limit(limit, capacity, warnings, "this machine's memory"), timeline)
    recorder = CudaRecorder(index, timeline=timeline)
    recorder.limit = _resolve_limit(limit, recorder.capacity, warnings, f"cuda:{index}'s capacity")
    return recorder


def _resolve_device(device: str | None, torch: Any) -> tuple[str, int]:
    spec = (device or "").strip().lower()
    if spec == "cpu":
        return "cpu", 0
    if not spec:
        if torch.cuda.is_available():
            return "cuda", torch.cuda.current_device()
        return "cpu", 0
    index_text = spec.removeprefix("cuda").lstrip(":") or "0"
    if not index_text.isdigit():
        raise ValueError(f"--device expects cpu, cuda, cuda:N or N, got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"--device {device}: CUDA is not available here (use --device cpu for CPU mode)")
    index = int(index_text)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"--device {device}: this process sees {count} CUDA device(s), 0..{count - 1}")
    return "cuda", index


def _resolve_limit(limit: float | int | None, capacity: int, warnings: Any, what: str) -> int | None:
    from .sizes import format_bytes

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
