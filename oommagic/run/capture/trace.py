"""The CUDA allocator's trace replayed: the timeline of allocated and reserved bytes, the allocs and frees
as ``categories`` events, the live blocks of a snapshot. Reads the dict ``torch.cuda.memory._snapshot()``
returns; imports no torch.

A ``%%gpumem`` cell of 10,000 small ops leaves 20,000 trace entries, replayed after every such cell: the
replay reads each entry once, does the sums in numpy (which comes with matplotlib, a dependency; imported
lazily so that ``%load_ext oommagic`` stays light) and keeps the events as columns. A loop over the
entries that built a tuple per event took 22 ms per cell on an H100 host, and its tuples woke the garbage
collector some 25 times per cell.
"""

from __future__ import annotations

import linecache
import os
from collections.abc import Iterator, Sequence
from itertools import chain, repeat
from operator import itemgetter, methodcaller, sub
from typing import Any

from ...categories import Block
from ...options import Settings
from ...timeline import Timeline

# 500k trace entries is a few hundred MB at most and covers minutes of training; a longer cell loses its
# earliest events (the peak figures come from memory_stats and stay exact).
CUDA_TRACE_ENTRIES = Settings.trace_entries  # the default of GpuMemMagics.trace_entries

# What the replay does with each action: 1 alloc, 2 free_requested (``memory_allocated`` counts a block
# from its alloc to its free_requested), 3 and 4 a segment reserved and given back, 5 an out-of-memory
# error. The rest (free_completed, snapshot, user annotations) is no moment of the timeline.
_ALLOC, _FREE, _RESERVE, _RELEASE, _OOM = 1, 2, 3, 4, 5
_KINDS = {
    "alloc": _ALLOC,
    "free_requested": _FREE,
    "segment_alloc": _RESERVE,
    "segment_map": _RESERVE,
    "segment_free": _RELEASE,
    "segment_unmap": _RELEASE,
    "oom": _OOM,
}


class TraceEvents(Sequence):
    """``categories`` events replayed from the allocator trace, (µs, address, bytes or -bytes freed, None,
    Python line), kept as numpy columns (``clocks``, ``addrs``, ``sizes``; ``lines`` a list, or None where
    no event has one): an event's tuple is made when it is read. ``peak`` is the index of the event after
    which allocated memory was highest (-1: at the start), ``top`` that level."""

    def __init__(self) -> None:
        import numpy as np

        self.clocks = np.zeros(0, np.int64)
        self.addrs = np.zeros(0, np.int64)
        self.sizes = np.zeros(0, np.int64)
        self.lines: list[str | None] | None = None
        self.peak = -1
        self.top = 0

    def add(self, clocks: Any, addrs: Any, sizes: Any, lines: list[str | None] | None) -> None:
        """Append events (numpy columns; ``lines`` None where none has a line)."""
        import numpy as np

        if lines is not None or self.lines is not None:
            self.lines = [*(self.lines or repeat(None, len(self))), *(lines or repeat(None, len(clocks)))]
        self.clocks, self.addrs, self.sizes = (
            np.concatenate([old, new])
            for old, new in ((self.clocks, clocks), (self.addrs, addrs), (self.sizes, sizes))
        )

    def __len__(self) -> int:
        return len(self.clocks)

    def __getitem__(self, i: int) -> tuple:  # type: ignore[override]
        line = self.lines[i] if self.lines is not None else None
        return (int(self.clocks[i]), int(self.addrs[i]), int(self.sizes[i]), None, line)

    def __iter__(self) -> Iterator[tuple]:
        lines = self.lines if self.lines is not None else repeat(None, len(self))
        n = len(self)
        return zip(
            self.clocks.tolist(),
            self.addrs.tolist(),
            self.sizes.tolist(),
            repeat(None, n),
            lines,
            strict=False,
        )


def cuda_timeline(
    snapshot: dict,
    index: int,
    start_us: float,
    before: tuple[int, int],
    steps: list[float],
    origin_us: float | None = None,
    events: TraceEvents | None = None,
    lines: bool = True,
    entries: int = CUDA_TRACE_ENTRIES,
) -> Timeline:
    """Replay the allocator trace of device ``index`` from ``start_us`` on, starting from ``before``
    (allocated, reserved); times are seconds from ``origin_us`` (default ``start_us``).
    ``memory_allocated`` counts a block when it is handed out and uncounts it at ``free_requested``, so
    the replay's maximum equals ``max_memory_allocated``. ``events``, when given, receives every alloc and
    free as a ``categories`` event (µs, address, bytes or -bytes freed, None, Python line: read from the
    alloc's frames unless ``lines`` is False) and the index of the one after which allocated memory
    peaked, in the same pass. ``entries`` is the ring's length the history was recorded with (a full ring
    lost its earliest events). The trace is a list of the allocator's dicts or a ``TraceColumns``."""
    import numpy as np

    origin = start_us if origin_us is None else origin_us
    traces = snapshot.get("device_traces") or []
    raw = traces[index] if index < len(traces) else []
    codes, times, raw_sizes, addrs, frames = _replayed_fields(raw)
    truncated = len(raw) >= entries and len(raw) > 0 and bool(times[0] > start_us)
    kinds = np.asarray(_REPLAY_TABLE, np.int8)[codes]
    replayed = np.flatnonzero((kinds > 0) & (times >= start_us))
    kinds, when = kinds[replayed], times[replayed]
    # The allocator counts whole blocks, multiples of 512 bytes; round a trace size up to one.
    sizes = -(-raw_sizes[replayed] // 512) * 512
    da = np.where(kinds == _ALLOC, sizes, np.where(kinds == _FREE, -sizes, 0))
    dr = np.where(kinds == _RESERVE, sizes, np.where(kinds == _RELEASE, -sizes, 0))
    allocated = before[0] + np.cumsum(da)
    reserved = before[1] + np.cumsum(dr)
    seconds = (when - origin) / 1e6
    ooms = np.flatnonzero(kinds == _OOM)
    if events is not None:
        moving = (kinds == _ALLOC) | (kinds == _FREE)
        at = replayed[moving]
        offset = len(events)
        found = _lines(frames, at, kinds[moving] == _ALLOC) if lines else None
        events.add(when[moving], addrs[at], da[moving], found)
        levels = allocated[moving]
        top = int(levels.max()) if len(levels) else before[0]
        if top > before[0]:
            events.top, events.peak = top, offset + int(np.argmax(levels))
        else:
            events.top, events.peak = before[0], -1
    return Timeline(
        t=(0.0, *np.maximum(seconds, 0.0).tolist()),
        allocated=(before[0], *allocated.tolist()),
        reserved=_levels(before[1], reserved),
        steps=tuple(steps),
        oom_at=float(seconds[ooms[-1]]) if len(ooms) else None,
        truncated=truncated,
        events=len(replayed),
    )


def _replayed_fields(trace: Any) -> tuple[Any, Any, Any, Any, list | None]:
    """What the replay reads of each entry: its action's code, µs, bytes and address (int64 arrays), and
    its frames (None where no entry has any), from columns or from the allocator's dicts."""
    import numpy as np

    if isinstance(trace, TraceColumns):
        return trace.codes, trace.ints("time_us"), trace.ints("size"), trace.ints("addr"), trace.frames()
    n = len(trace)
    try:
        flat = list(chain.from_iterable(map(_FIELDS, trace)))
    except KeyError:  # an oom has no addr; a hand-written entry may lack more
        flat = [
            x
            for e in trace
            for x in (e.get("action"), e.get("time_us", 0), e.get("size", 0), e.get("addr", 0))
        ]
    codes = np.fromiter(map(_CODES.get, flat[0::4], repeat(0)), np.int8, n)
    ints = [_int64(flat[k::4]) for k in (1, 2, 3)]
    frames = list(map(methodcaller("get", "frames"), trace))
    return codes, *ints, frames if any(frames) else None


_FIELDS = itemgetter("action", "time_us", "size", "addr")


def _int64(values: list) -> Any:
    """``values`` as an int64 array, 0 for what is no int (a hand-written entry's gap)."""
    import numpy as np

    try:
        return np.fromiter(values, np.int64, len(values))
    except (TypeError, ValueError, OverflowError):
        return np.fromiter((v if type(v) is int else 0 for v in values), np.int64, len(values))


def _levels(before: int, levels: Any) -> tuple[int, ...]:
    """``before``, then ``levels``, as ints; one int object for each run of equal levels where there are
    few runs (the reserved bytes change at segments only: 20,000 equal levels made 20,000 objects)."""
    import numpy as np

    starts = np.flatnonzero(np.diff(levels, prepend=before))
    if len(starts) > len(levels) // 16:
        return (before, *levels.tolist())
    bounds = [0, *(starts + 1).tolist(), len(levels) + 1]
    values = [before, *levels[starts].tolist()]
    return tuple(chain.from_iterable(map(repeat, values, map(sub, bounds[1:], bounds))))


# Every action the allocator's history names, coded in one byte (0: one this list does not know).
_ACTIONS = (
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "user_defined",
)
_CODES = {a: i + 1 for i, a in enumerate(_ACTIONS)}
_OOM_CODE = _CODES["oom"]
_REPLAY_TABLE = (0, *(_KINDS.get(a, 0) for a in _ACTIONS))
# The fields the replay reads, and what a hand-written entry without one counts as.
_INT_DEFAULTS = {"time_us": 0, "size": 0, "addr": 0}


class _Hole:
    """Where an entry of an uneven trace has no such key: false, as an empty frames list is."""

    def __bool__(self) -> bool:
        return False

    def __repr__(self) -> str:
        return "<no value>"


_HOLE = _Hole()


class _Same:
    """A column whose every entry holds one value (the allocator's ``stream`` 0, ``compile_context``
    'N/A', ``user_metadata`` '')."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


class TraceColumns:
    """One device's trace entries as columns, read in one pass over the allocator's dicts: the actions
    coded in a byte each, whole-number fields (address, size, stream, µs) as int64 arrays, a field with
    one value in every entry as that value, any other field (frames recorded with ``--stacks``) as a
    list. A twenty-fifth of the dicts' memory (0.34 MB for the 20,000 entries of 10,000 small ops, 8.6
    MB as dicts), nothing for the garbage collector to walk, and what the replay reads without touching a
    dict again. ``entries()`` gives the dicts back, equal to the allocator's, for the viewer. An entry
    unlike the rest (an oom's ``device_free``, an action this module does not know) is also kept whole,
    and gives its own values.

    One pass reads every entry with the first's keys (the allocator builds each with the same ones); a
    trace whose entries differ in their keys (frames on allocs only, an oom's ``device_free``, one written
    by hand) is read entry by entry."""

    __slots__ = ("codes", "keys", "length", "values", "whole")

    def __init__(self, keys: tuple, codes: Any, values: dict[str, Any], whole: dict[int, dict], n: int):
        self.keys, self.codes, self.values, self.whole, self.length = keys, codes, values, whole, n

    @classmethod
    def read(cls, entries: list[dict]) -> TraceColumns:
        """Any trace as columns: an uneven one read entry by entry."""
        found = cls._read(entries, uneven=True)
        assert found is not None
        return found

    @classmethod
    def pack(cls, entries: list[dict]) -> TraceColumns | None:
        """The trace as columns where one pass reads it (None for an uneven one: with ``--stacks`` only
        allocs carry frames, and those dicts are kept as they are)."""
        return cls._read(entries, uneven=False)

    @classmethod
    def _read(cls, entries: list[dict], uneven: bool) -> TraceColumns | None:
        import numpy as np

        m = len(entries)
        if not m:
            return cls((), np.zeros(0, np.int8), {}, {}, 0)
        keys = tuple(entries[0])
        if "action" not in keys or sum(map(len, entries)) != len(keys) * m:
            # Frames on allocs only (--stacks), a hand-written trace.
            return cls._read_each(entries) if uneven else None
        try:
            flat = list(chain.from_iterable(map(itemgetter(*keys), entries)))
        except KeyError:
            return cls._read_mixed(entries, keys, uneven)
        n = len(keys)
        columns = {k: flat[i::n] for i, k in enumerate(keys)}
        del flat
        codes = np.fromiter(map(_CODES.get, columns["action"], repeat(0)), np.int8, m)
        whole_at = np.flatnonzero((codes == 0) | (codes == _OOM_CODE)).tolist()
        return cls._build(keys, codes, columns, {i: entries[i] for i in whole_at})

    @classmethod
    def _read_mixed(cls, entries: list[dict], keys: tuple, uneven: bool) -> TraceColumns | None:
        """A trace with entries of as many keys, other ones (an oom's ``device_free`` for ``addr``): those
        kept whole, the rest read in one pass."""
        import numpy as np

        m = len(entries)
        try:
            actions = list(map(itemgetter("action"), entries))
        except KeyError:
            return cls._read_each(entries) if uneven else None
        codes = np.fromiter(map(_CODES.get, actions, repeat(0)), np.int8, m)
        whole_at = np.flatnonzero((codes == 0) | (codes == _OOM_CODE)).tolist()
        whole = {i: entries[i] for i in whole_at}
        plain = [e for i, e in enumerate(entries) if i not in whole]
        rest = tuple(k for k in keys if k != "action")
        if rest:
            try:
                flat = list(chain.from_iterable(map(itemgetter(*rest), plain)))
            except KeyError:
                flat = None
            if flat is not None:
                n = len(rest)
                columns = {k: flat[i::n] for i, k in enumerate(rest)}
                del flat
                for i in whole_at:  # a place for each entry kept whole, filled by _build
                    for col in columns.values():
                        col.insert(i, _HOLE)
                columns["action"] = actions
                return cls._build(keys, codes, columns, whole)
        return cls._read_each(entries) if uneven else None

    @classmethod
    def _read_each(cls, entries: list[dict]) -> TraceColumns:
        """An uneven trace (frames on some entries only, a hand-written one, a torch of another layout):
        every key any entry has, each entry's value or a hole where it has none."""
        import numpy as np

        keys = tuple(dict.fromkeys(chain(("action",), chain.from_iterable(entries))))
        columns = {k: [e.get(k, _HOLE) for e in entries] for k in keys}
        codes = np.fromiter(map(_CODES.get, columns["action"], repeat(0)), np.int8, len(entries))
        whole_at = np.flatnonzero((codes == 0) | (codes == _OOM_CODE)).tolist()
        return cls._build(keys, codes, columns, {i: entries[i] for i in whole_at})

    @classmethod
    def _build(
        cls, keys: tuple, codes: Any, columns: dict[str, list], whole: dict[int, dict]
    ) -> TraceColumns:
        import numpy as np

        m = len(codes)
        for i, e in whole.items():
            # A whole entry's own value where it has the field (an oom's µs), else a placeholder: the
            # entry itself is what ``entries()`` gives back.
            for k in keys:
                if k != "action":
                    columns[k][i] = e.get(k, _INT_DEFAULTS.get(k, columns[k][i - 1] if i else _HOLE))
        values: dict[str, Any] = {}
        for k in keys:
            if k == "action":
                continue
            col = columns[k]
            first, last = col[0], col[-1]
            if k == "frames":
                # Left empty without --stacks (some torch versions give each entry an empty list).
                values[k] = _Same([]) if not any(col) and col.count(_HOLE) == 0 else col
            elif first == last == col[m // 2] and type(first) is type(last) and col.count(first) == m:
                values[k] = _Same(first)
            elif type(first) is int and type(last) is int:
                try:
                    values[k] = np.fromiter(col, np.int64, m)
                except (TypeError, ValueError, OverflowError):
                    values[k] = col
            else:
                values[k] = col
        return cls(keys, codes, values, whole, m)

    def __len__(self) -> int:
        return self.length

    def ints(self, name: str) -> Any:
        """The field ``name`` of every entry as an int64 array (0 where an entry has none): read it,
        never change it."""
        import numpy as np

        col = self.values.get(name)
        if isinstance(col, np.ndarray):
            return col
        if isinstance(col, _Same):
            value = col.value if type(col.value) is int else 0
            return np.full(self.length, value, np.int64)
        if col is None:
            return np.zeros(self.length, np.int64)
        return np.fromiter((v if type(v) is int else 0 for v in col), np.int64, self.length)

    def frames(self) -> list | None:
        """Each entry's frames where any entry has some (``--stacks``), else None."""
        col = self.values.get("frames")
        return col if isinstance(col, list) else None

    def entries(self) -> list[dict]:
        """The entries as the allocator's dicts (a new list; an empty frames list a new one each)."""
        columns: list[Any] = []
        for k in self.keys:
            col = self.values.get(k)
            if k == "action":
                names = (None, *_ACTIONS)
                columns.append(map(names.__getitem__, self.codes.tolist()))
            elif isinstance(col, _Same):
                columns.append(repeat(col.value, self.length) if col.value != [] else iter(list, None))
            elif col is None:
                columns.append(repeat(None, self.length))
            else:
                columns.append(col.tolist() if hasattr(col, "tolist") else col)
        out = (
            [dict(zip(self.keys, row, strict=True)) for row in zip(*columns, strict=False)] if columns else []
        )
        if any(isinstance(c, list) and _HOLE in c for c in self.values.values()):
            out = [{k: v for k, v in e.items() if v is not _HOLE} for e in out]
        for i, e in self.whole.items():
            out[i] = e
        return out


def packed(snapshot: dict) -> dict:
    """``snapshot`` with each device's trace kept as ``TraceColumns`` where one pass reads it (the dicts
    where some carry frames): a new dict."""
    traces = [
        t if isinstance(t, TraceColumns) else TraceColumns.pack(t) or t
        for t in snapshot.get("device_traces") or ()
    ]
    return {**snapshot, "device_traces": traces} if traces else snapshot


def unpacked(snapshot: dict) -> dict:
    """``snapshot`` as ``torch.cuda.memory._snapshot()`` returned it, traces kept by ``packed`` made
    dicts again: a new dict where any was packed."""
    traces = snapshot.get("device_traces") or ()
    if not any(isinstance(t, TraceColumns) for t in traces):
        return snapshot
    return {
        **snapshot,
        "device_traces": [t.entries() if isinstance(t, TraceColumns) else t for t in traces],
    }


def _lines(frames: list | None, at: Any, allocs: Any) -> list[str | None] | None:
    """The Python line of each event (entries ``at``; None for a free, or an alloc without frames); None
    where no entry has frames."""
    if frames is None:
        return None
    found = [user_line(frames[i]) if frames[i] else None for i in at[allocs].tolist()]
    if not any(found):
        return None
    lines = iter(found)
    return [next(lines) if alloc else None for alloc in allocs.tolist()]


def snapshot_blocks(snapshot: dict, index: int) -> tuple[list[Block], int]:
    """The live blocks of device ``index`` in an allocator snapshot (with the Python line that made each
    where frames were recorded), each the size its tensor requested rounded up to 512 bytes, and the bytes
    its segments reserve."""
    blocks, reserved = [], 0
    for seg in snapshot.get("segments", ()):
        if seg.get("device", index) != index:
            continue
        reserved += seg.get("total_size", 0)
        for b in seg.get("blocks", ()):
            if b.get("state") == "active_allocated":
                # What the tensor asked for, in the 512-byte units the trace counts: a large block keeps
                # up to 1 MiB it did not split off, which is the allocator's (the cache), not the tensor's.
                asked = b.get("requested_size") or b["size"]
                size = min(-(-asked // 512) * 512, b["size"])
                blocks.append(Block(b["address"], size, line=user_line(b.get("frames") or ())))
    return blocks, reserved


def start_blocks(events: TraceEvents, end_blocks: list[Block]) -> dict[int, Block]:
    """The blocks alive before the first of ``events``: freed without being allocated in them (a free
    carries its size, negated), or alive at the end without an alloc among them."""
    import numpy as np

    addrs, sizes = events.addrs, events.sizes
    born = set(np.unique(addrs[sizes > 0]).tolist())
    first = np.unique(addrs, return_index=True)[1]
    first = np.sort(first[sizes[first] <= 0])  # each address's first event, where it is a free
    start = {a: Block(a, -n) for a, n in zip(addrs[first].tolist(), sizes[first].tolist(), strict=True)}
    for b in end_blocks:
        if b.key not in born:
            start.setdefault(b.key, b)
    return start


def live_at_event(start: dict[int, Block], events: TraceEvents, index: int) -> dict[int, Block]:
    """``categories.live_at`` for the trace's events, in numpy: the blocks alive just after event
    ``index`` (-1: at the start), each with the clock it died at. A peak late in a long trace took a
    Python step per event."""
    import numpy as np

    from ...categories import live_at

    addrs, sizes, clocks = events.addrs, events.sizes, events.clocks
    head_a, head_s = addrs[: index + 1], sizes[: index + 1]
    order = np.argsort(head_a, kind="stable")
    ka, ks = head_a[order], head_s[order]
    opens = np.r_[True, ka[1:] != ka[:-1]] if len(ka) else np.zeros(0, bool)  # each address's first
    same, firsts = ~opens[1:], np.flatnonzero(opens)
    was_alive = np.fromiter((k in start for k in ka[firsts].tolist()), bool, len(firsts))
    if np.any(same & (ks[1:] > 0) & (ks[:-1] > 0)) or np.any(was_alive & (ks[firsts] > 0)):
        # An alloc on an address already alive (a storage grown in place, a trace cut at its start): the
        # step-by-step replay keeps the first birth.
        return live_at(start, events, index)
    ends = np.r_[firsts[1:] - 1, len(ka) - 1] if len(ka) else firsts
    last = order[ends]
    standing = np.sort(last[head_s[last] > 0])
    touched = set(ka[firsts].tolist())
    keys = [k for k in start if k not in touched] + addrs[standing].tolist()
    tail = addrs[index + 1 :]
    died: dict[int, int] = {}
    if len(tail) and keys:
        tail_keys, tail_first = np.unique(tail, return_index=True)
        wanted = np.asarray(keys, np.int64)
        at = np.minimum(np.searchsorted(tail_keys, wanted), len(tail_keys) - 1)
        hit = tail_keys[at] == wanted
        when = clocks[index + 1 + tail_first[at]]
        died = dict(zip(wanted[hit].tolist(), when[hit].tolist(), strict=True))
    out = {}
    for k in keys[: len(keys) - len(standing)]:
        b = start[k]
        out[k] = Block(k, b.nbytes, b.born, died.get(k), b.op, b.line)
    lines = events.lines
    for i, k, n, t in zip(
        standing.tolist(),
        addrs[standing].tolist(),
        sizes[standing].tolist(),
        clocks[standing].tolist(),
        strict=True,
    ):
        out[k] = Block(k, n, t, died.get(k), None, lines[i] if lines is not None else None)
    return out


def user_line(frames: Any) -> str | None:
    """'cell:5 y = model(x)' from an allocator record's Python frames: the innermost outside torch."""
    for f in frames:
        filename = f.get("filename", "")
        if filename and "/torch/" not in filename and not filename.startswith("??"):
            cell = filename.startswith("<ipython-input") or "/ipykernel_" in filename
            code = linecache.getline(filename, f.get("line", 0)).strip() or f"in {f.get('name', '')}"
            return f"{'cell' if cell else os.path.basename(filename)}:{f.get('line', 0)} {code}"
    return None
