"""CPU mode: every tensor storage a cell creates, counted exactly through a dispatch mode; ``--limit``
emulates a card by raising ``torch.OutOfMemoryError`` in PyTorch's own message format."""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any

from ...oom import format_emulated_oom
from ...timeline import Timeline
from .record import Recording, StepMarks


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
        self._marks = StepMarks()
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
