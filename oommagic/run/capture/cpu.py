"""CPU mode: every tensor storage a cell creates, counted exactly through a dispatch mode; ``--limit``
emulates a card by raising ``torch.OutOfMemoryError`` in PyTorch's own message format."""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from dataclasses import replace
from typing import Any

from ...categories import Block, Breakdown, breakdown, live_at, peak_index
from ...oom import format_emulated_oom
from ...timeline import Timeline
from .record import Recording, StepMarks
from .roles import StepRoles, cpu_key, observe


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

    def add(self, storage: Any, op: Any = None, line: str | None = None) -> int:
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
        self._notify(key, nbytes, op, line)
        return nbytes - (old or 0)

    def _release(self, key: int) -> None:
        with self._lock:
            nbytes = self.live.pop(key, 0)
            self.allocated -= nbytes
        if nbytes:
            self._notify(key, 0, None, None)

    def _notify(self, key: int, nbytes: int, op: Any, line: str | None) -> None:
        listener = self.listener
        if listener is not None:
            listener.sample(self.allocated, key, nbytes, op, line)


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
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass as is_wrapper
    from torch.utils._pytree import tree_flatten

    Parameter = torch.nn.Parameter

    class TensorBytesTracker(TorchDispatchMode):
        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            # torch wraps a mode's __torch_dispatch__ in torch._dynamo.disable, which imports torch._dynamo
            # at the first op of the first %%gpumem cell: 3-8 s on CPU, more than the cell. Without
            # torch._dynamo imported nothing can compile this frame; once it is (a cell compiled), the
            # next cell's tracker is wrapped as torch wraps it.
            return "torch._dynamo" in sys.modules

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if recorder.limit is not None:
                planned = _factory_bytes(func, args, kwargs)
                if planned is not None:
                    recorder.check(planned)
            # Weights a setup cell built, or a checkpoint loader mapped from its file without an op, are
            # on the card once the cell computes with them.
            weights = [a.untyped_storage() for a in args if type(a) is Parameter and a.device.type == "cpu"]
            weights = [st for st in weights if st._cdata not in LEDGER.live]
            if weights:
                if recorder.limit is not None:
                    recorder.check(sum(st.nbytes() for st in weights))
                for st in weights:
                    LEDGER.add(st, func, python_line() if recorder.stacks else None)
            out = func(*args, **kwargs)
            view = getattr(func, "is_view", False)
            fresh = []
            for t in _plain_tensors(tree_flatten(out)[0], is_wrapper):
                if t.device.type == "cpu" and not t.is_meta:
                    st = t.untyped_storage()
                    known = LEDGER.live.get(st._cdata)
                    # A view of a tensor made outside %%gpumem allocates nothing: a batch indexed out of
                    # a dataset on the host is not the dataset on the card. (An in-place op on one takes
                    # it on: an optimizer's step writes the weights a setup cell made.)
                    if (known is None and not view) or (known is not None and known != st.nbytes()):
                        fresh.append(st)
            if fresh and recorder.limit is not None:
                recorder.check(sum(st.nbytes() - LEDGER.live.get(st._cdata, 0) for st in fresh))
            line = python_line() if fresh and recorder.stacks else None
            for st in fresh:
                LEDGER.add(st, func, line)
            return out

    return TensorBytesTracker()


def _plain_tensors(values: list, is_wrapper: Any) -> Any:
    """The tensors among ``values`` that hold memory: a wrapper subclass (FSDP2's ``DTensor``) stands for its
    inner tensors, made inside its own dispatch where this mode does not see them; its wrapper's storage is
    the whole logical size, which no rank holds."""
    import torch

    for t in values:
        if not isinstance(t, torch.Tensor):
            continue
        if type(t) is torch.Tensor or not is_wrapper(t):
            yield t
        else:
            names, _ = t.__tensor_flatten__()
            yield from _plain_tensors([getattr(t, name) for name in names], is_wrapper)


def _track_resizes(recorder: CpuRecorder) -> Any:
    """Count storage resizes while ``recorder`` runs: they go through no dispatcher op, and FSDP2 frees a
    gathered weight with ``untyped_storage().resize_(0)`` and gathers into it again with ``resize_(n)`` (on a
    card the allocator sees both). A growth is checked against the limit first. Returns the undo."""
    import torch

    cls = torch.UntypedStorage
    own = cls.__dict__.get("resize_")
    original = cls.resize_
    thread = threading.get_ident()  # the cell's, as the dispatch mode (a thread's own) sees it

    def resize_(storage: Any, size: int) -> Any:
        if storage.device.type != "cpu" or LEDGER.listener is not recorder or threading.get_ident() != thread:
            return original(storage, size)
        grows = int(size) - LEDGER.live.get(storage._cdata, 0)
        if recorder.limit is not None and grows > 0:
            recorder.check(grows)
        out = original(storage, size)
        LEDGER.add(storage, "resize_", python_line() if recorder.stacks else None)
        return out

    cls.resize_ = resize_

    def undo() -> None:
        if own is None:
            del cls.resize_
        else:
            cls.resize_ = own

    return undo


def python_line() -> str | None:
    """'cell:5 y = model(x)': the innermost Python line outside torch and oommagic that is running (the
    line that made an allocation, with ``--stacks``); None where there is none."""
    import linecache
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        filename = frame.f_code.co_filename
        if not filename.startswith(_SKIPPED_DIRS):
            where = (filename, frame.f_lineno)
            line = _LINES.get(where)
            if line is None:
                code = linecache.getline(filename, frame.f_lineno).strip()
                line = _LINES[where] = f"{_short_file(filename)}:{frame.f_lineno} {code}".rstrip()
            return line
        frame = frame.f_back
    return None


# (file, line) -> its text: a loop makes the same lines thousands of times.
_LINES: dict[tuple[str, int], str] = {}


def _skipped_dirs() -> tuple[str, ...]:
    import torch

    return (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(os.path.dirname(__file__))))


def _short_file(filename: str) -> str:
    # IPython names a cell's code <ipython-input-N-...>; ipykernel writes it to /tmp/ipykernel_PID/N.py.
    if filename.startswith("<ipython-input") or "/ipykernel_" in filename:
        return "cell"
    return os.path.basename(filename)


_SKIPPED_DIRS: tuple[str, ...] = ()


def op_name(op: Any) -> str | None:
    """'aten.addmm' for a dispatcher op (None stays None)."""
    if op is None:
        return None
    packet = getattr(op, "overloadpacket", None)
    return str(packet) if packet is not None else str(op)


class CpuRecorder:
    """Tracks CPU tensor storages while a cell runs; with ``limit`` it emulates a card of that size by
    raising ``torch.OutOfMemoryError`` in PyTorch's own message format. ``timeline=False`` keeps the
    start and the end only (the peak stays exact). ``stacks`` records the Python line of each allocation.

    Besides the figures it keeps what the breakdown by category needs: every storage event of the cell
    (with the timeline), the operator (and line) that made each live storage, and the gradients seen at
    each optimizer step."""

    def __init__(
        self,
        limit: int | None = None,
        timeline: bool = True,
        stacks: bool = False,
        trace_entries: int | None = None,
    ) -> None:
        self.device = "cpu"
        self.limit = limit
        self.timeline = timeline
        self.stacks = stacks
        # The snapshot's trace keeps the last this many events, as the CUDA allocator's history ring does.
        self.trace_entries = trace_entries
        self.capacity = limit if limit is not None else host_memory()
        self._t: list[float] = []
        self._a: list[int] = []
        self._events: list[tuple[float, int, int, Any, str | None]] = []
        self._made: dict[int, tuple[Any, str | None]] = {}
        self._start_live: dict[int, int] = {}
        self._oom_at: float | None = None
        self._marks = StepMarks()
        self._steps = StepRoles(cpu_key, lambda: len(self._events) - 0.5)
        self._mode: Any = None
        self._undo_resizes: Any = None
        self._start = 0.0
        self._peak = 0
        self._before = 0
        self.exact: dict[str, int] = {}
        self.at_failure: Breakdown | None = None
        self._frozen: tuple[list[Block], int] | None = None  # the live blocks and events at the failure

    def allocated(self) -> int:
        return LEDGER.allocated

    def sample(
        self, allocated: int, key: int = 0, nbytes: int = 0, op: Any = None, line: str | None = None
    ) -> None:
        self._peak = max(self._peak, allocated)
        if nbytes:
            self._made[key] = (op, line)
        else:
            self._made.pop(key, None)
        if self.timeline:
            self._point(allocated)
            self._events.append((len(self._events), key, nbytes, op, line))

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
        global _SKIPPED_DIRS
        if not _SKIPPED_DIRS:
            _SKIPPED_DIRS = _skipped_dirs()
        self._start = time.time()
        self._before = LEDGER.allocated
        self._start_live = dict(LEDGER.live)
        self._peak = self._before
        self._point(self._before)
        self._mode = _make_tracker(self)
        LEDGER.listener = self
        try:
            self._marks.install(self._steps)
            self._undo_resizes = _track_resizes(self)
            self._mode.__enter__()
        except BaseException:
            LEDGER.listener = None
            self._marks.remove()
            if self._undo_resizes is not None:
                self._undo_resizes()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            if self._mode is not None:
                self._mode.__exit__(None, None, None)
        finally:
            self._mode = None
            self._marks.remove()
            if self._undo_resizes is not None:
                self._undo_resizes()
                self._undo_resizes = None
            LEDGER.listener = None
        self._point(LEDGER.allocated)

    # --- what the memory was ----------------------------------------------------------------------------

    def capture_failure(self, spaces: list) -> Breakdown:
        """The breakdown now, at an out-of-memory error, before anything is given back: every live storage
        of the tracker, each with the role the namespace and the failed frames (``spaces``) give it. Sums
        to the tracker's total exactly."""
        blocks = self._live_now()
        self._frozen = (blocks, len(self._events))
        seen = observe(spaces, cpu_key, 0.0)
        self.at_failure = breakdown(blocks, seen, "failure", budget=self.limit or self.capacity)
        return self.at_failure

    def categories(self, spaces: list, timeline: Timeline | None = None) -> Breakdown:
        """After the cell: the breakdown at the failure if there was one, else at the peak (replayed from
        the cell's storage events, roles from the namespace now and the optimizer steps around the peak),
        else, without a timeline, at the end."""
        if self.at_failure is not None:
            return self.at_failure
        budget = self.limit or self.capacity
        end_clock = len(self._events) - 0.5
        seen = observe(spaces, cpu_key, end_clock)
        if not self.timeline:
            return breakdown(self._live_now(), seen + self._steps.first, "end", budget=budget)
        start = {k: Block(k, n) for k, n in self._start_live.items()}
        index = peak_index(self._before, self._events, self._start_live)
        # The operators named for the blocks alive at the peak only, not for every event of the cell.
        blocks = [replace(b, op=op_name(b.op)) for b in live_at(start, self._events, index).values()]
        return breakdown(blocks, seen + self._steps.around(index, seen), "peak", budget=budget)

    def snapshot(self) -> dict:
        """A snapshot in the format of ``torch.cuda.memory._snapshot()`` (one segment per live storage, the
        cell's storage events as device 0's trace, its last ``trace_entries``) that
        ``torch.cuda._memory_viz`` and pytorch.org/memory_viz
        open; at the failure if there was one (the viewer reads the trace back from the segments' state, so
        both end there). CPU mode has no allocator: addresses are the tracker's storage keys."""
        start = self._t[0] if self._t else self._start
        live, upto = self._frozen if self._frozen is not None else (self._live_now(), len(self._events))
        trace = []
        sizes = dict(self._start_live)
        for (_, key, nbytes, op, line), t in zip(self._events[:upto], self._t[1:], strict=False):
            frames = _frames(op, line)
            when = int(t * 1e6)
            if nbytes:
                trace.append(_entry("alloc", key, nbytes, when, frames))
                sizes[key] = nbytes
            else:
                size = sizes.pop(key, 0)
                trace.append(_entry("free_requested", key, size, when, frames))
                trace.append(_entry("free_completed", key, size, when, frames))
        segments = [
            {
                "device": 0,
                "address": b.key,
                "total_size": b.nbytes,
                "allocated_size": b.nbytes,
                "active_size": b.nbytes,
                "requested_size": b.nbytes,
                "stream": 0,
                "segment_type": "large",
                "segment_pool_id": (0, 0),
                "is_expandable": False,
                "frames": [],
                "blocks": [
                    {
                        "address": b.key,
                        "size": b.nbytes,
                        "requested_size": b.nbytes,
                        "state": "active_allocated",
                        "frames": _frames(b.op, b.line),
                    }
                ],
            }
            for b in sorted(live, key=lambda b: b.key)
        ]
        if self.trace_entries is not None and len(trace) > self.trace_entries:
            trace = trace[len(trace) - self.trace_entries :]
        return {
            "segments": segments,
            "device_traces": [trace],
            "allocator_settings": {},
            "oommagic": {"device": "cpu", "started_us": int(start * 1e6), "note": _CPU_NOTE},
        }

    def _live_now(self) -> list[Block]:
        made = self._made
        return [
            Block(k, n, op=op_name(made.get(k, (None, None))[0]), line=made.get(k, (None, None))[1])
            for k, n in list(LEDGER.live.items())
        ]

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


_CPU_NOTE = (
    "CPU mode of oommagic: no caching allocator; one segment per live tensor storage, addresses are the "
    "tracker's storage keys, frames name the operator (and the Python line with --stacks)."
)


def _frames(op: str | None, line: str | None) -> list[dict]:
    name = op_name(op) if not isinstance(op, str) else op
    if line:
        where, _, code = line.partition(" ")
        filename, _, lineno = where.rpartition(":")
        return [{"filename": filename, "line": int(lineno) if lineno.isdigit() else 0, "name": code or name}]
    return [{"filename": name or "??", "line": 0, "name": name or "??"}]


def _entry(action: str, key: int, size: int, when: int, frames: list) -> dict:
    return {"action": action, "addr": key, "size": size, "stream": 0, "time_us": when, "frames": frames}
