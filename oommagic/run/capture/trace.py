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
from itertools import chain, compress, repeat
from operator import gt, itemgetter, sub
from typing import Any

from ...categories import Block
from ...timeline import Timeline

# 500k trace entries is a few hundred MB at most and covers minutes of training; a longer cell loses its
# earliest events (the peak figures come from memory_stats and stay exact).
CUDA_TRACE_ENTRIES = 500_000

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
    Python line), kept as columns (``clocks``, ``addrs``, ``sizes``, ``lines``): an event's tuple is made
    when it is read. ``peak`` is the index of the event after which allocated memory was highest (-1: at
    the start), ``top`` that level."""

    def __init__(self) -> None:
        self.clocks: list = []
        self.addrs: list[int] = []
        self.sizes: list[int] = []
        self.lines: list[str | None] = []
        self.peak = -1
        self.top = 0

    def __len__(self) -> int:
        return len(self.clocks)

    def __getitem__(self, i: int) -> tuple:  # type: ignore[override]
        return (self.clocks[i], self.addrs[i], self.sizes[i], None, self.lines[i])

    def __iter__(self) -> Iterator[tuple]:
        return zip(self.clocks, self.addrs, self.sizes, repeat(None, len(self)), self.lines, strict=True)


def cuda_timeline(
    snapshot: dict,
    index: int,
    start_us: float,
    before: tuple[int, int],
    steps: list[float],
    origin_us: float | None = None,
    events: TraceEvents | None = None,
    lines: bool = True,
) -> Timeline:
    """Replay the allocator trace of device ``index`` from ``start_us`` on, starting from ``before``
    (allocated, reserved); times are seconds from ``origin_us`` (default ``start_us``).
    ``memory_allocated`` counts a block when it is handed out and uncounts it at ``free_requested``, so
    the replay's maximum equals ``max_memory_allocated``. ``events``, when given, receives every alloc and
    free as a ``categories`` event (µs, address, bytes or -bytes freed, None, Python line: read from the
    alloc's frames unless ``lines`` is False, for a history recorded without stacks) and the index of the
    one after which allocated memory peaked, in the same pass."""
    import numpy as np

    origin = start_us if origin_us is None else origin_us
    traces = snapshot.get("device_traces") or []
    entries = traces[index] if index < len(traces) else []
    if isinstance(entries, PackedTrace):
        actions, times, raw_sizes, addrs = entries.fields(_FIELD_NAMES, _FIELD_DEFAULTS)
        lines = False  # packed: no entry had frames
    else:
        actions, times, raw_sizes, addrs = _fields(entries)
    truncated = len(entries) >= CUDA_TRACE_ENTRIES and bool(entries) and times[0] > start_us
    kinds = np.array(list(map(_KINDS.get, actions, repeat(0))), dtype=np.int8)
    when = np.fromiter(times, np.int64, len(times))
    replayed = np.flatnonzero((kinds > 0) & (when >= start_us))
    kinds, when = kinds[replayed], when[replayed]
    # The allocator counts whole blocks, multiples of 512 bytes; round a trace size up to one.
    sizes = -(-np.fromiter(raw_sizes, np.int64, len(raw_sizes))[replayed] // 512) * 512
    da = np.where(kinds == _ALLOC, sizes, np.where(kinds == _FREE, -sizes, 0))
    dr = np.where(kinds == _RESERVE, sizes, np.where(kinds == _RELEASE, -sizes, 0))
    allocated = before[0] + np.cumsum(da)
    reserved = before[1] + np.cumsum(dr)
    seconds = (when - origin) / 1e6
    ooms = np.flatnonzero(kinds == _OOM)
    if events is not None:
        moving = (kinds == _ALLOC) | (kinds == _FREE)
        # The clocks and addresses are the entries' own int objects: nothing new for the collector.
        picked = np.zeros(len(entries), dtype=bool)
        picked[replayed[moving]] = True
        picked_list = picked.tolist()
        offset = len(events)
        events.clocks.extend(compress(times, picked_list))
        events.addrs.extend(compress(addrs, picked_list))
        events.sizes.extend(da[moving].tolist())
        allocs = kinds[moving] == _ALLOC
        events.lines.extend(_lines(entries, replayed[moving], allocs) if lines else repeat(None, len(allocs)))
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


_FIELD_NAMES = ("action", "time_us", "size", "addr")
_FIELD_DEFAULTS = (None, 0, 0, 0)
_FIELDS = itemgetter(*_FIELD_NAMES)


class PackedTrace:
    """One device's trace entries kept as a column per key (``pack``), what the entries' dicts were for a
    run's whole life: a fifth of their memory, and where the entries carry frame lists (torch versions
    that give each entry one, empty without stacks) no container per entry for the garbage collector to
    walk at each full collection. Keeping the dicts instead, where torch 2.11 gives dicts the collector
    does not track, measured no faster per cell on an H100 host. ``entries()`` gives the dicts back, equal
    to the allocator's, for the viewer. Entries whose keys differ from the first's (an oom's
    ``device_free``) are kept whole."""

    __slots__ = ("columns", "empty_frames", "keys", "length", "whole")

    def __init__(self, keys: tuple, columns: list, empty_frames: bool, whole: dict[int, dict], n: int):
        self.keys, self.columns, self.empty_frames, self.whole, self.length = (
            keys,
            columns,
            empty_frames,
            whole,
            n,
        )

    @classmethod
    def pack(cls, entries: list[dict]) -> PackedTrace | None:
        """``entries`` as columns; None where they are better kept as they are: frames recorded
        (``--stacks``), or fewer than two keys."""
        if not entries or len(entries[0]) < 2:
            return None
        keys = tuple(entries[0])
        n = len(keys)
        lengths = list(map(len, entries))
        odd = set() if lengths.count(n) == len(lengths) else {i for i, m in enumerate(lengths) if m != n}
        # One pass: every value in a flat list (each entry's tuple is let go as soon as it is read), then
        # a column per key sliced from it.
        plain = [e for i, e in enumerate(entries) if i not in odd] if odd else entries
        getter = itemgetter(*keys)
        try:
            flat = list(chain.from_iterable(map(getter, plain)))
        except KeyError:  # as many keys, other ones (an oom has device_free, no addr)
            odd |= {i for i, e in enumerate(entries) if i not in odd and not all(k in e for k in keys)}
            plain = [e for i, e in enumerate(entries) if i not in odd]
            flat = list(chain.from_iterable(map(getter, plain)))
        columns: list = [flat[k::n] for k in range(n)]
        del flat
        empty_frames = "frames" in keys
        if empty_frames:
            at = keys.index("frames")
            if any(columns[at]):
                return None
            columns[at] = None
        if odd:
            # Each column as long as the trace: a hole where an entry is kept whole.
            at_plain = [i for i in range(len(entries)) if i not in odd]
            for c, column in enumerate(columns):
                if column is not None:
                    full: list = [None] * len(entries)
                    for i, v in zip(at_plain, column, strict=True):
                        full[i] = v
                    columns[c] = full
        return cls(keys, columns, empty_frames, {i: entries[i] for i in sorted(odd)}, len(entries))

    def __len__(self) -> int:
        return self.length

    def fields(self, names: tuple[str, ...], defaults: tuple) -> list:
        """The columns of ``names`` (a column of its default where no entry has the key); an entry kept
        whole gives its own value. The kept columns themselves where no entry is whole: read, never
        change them."""
        out = []
        for name, default in zip(names, defaults, strict=True):
            column = self.columns[self.keys.index(name)] if name in self.keys else None
            if column is None:
                column = [default] * self.length
            elif self.whole:
                column = list(column)
            for i, e in self.whole.items():
                column[i] = e.get(name, default)
            out.append(column)
        return out

    def entries(self) -> list[dict]:
        """The entries as the allocator's dicts (a new list; frames a new empty list each)."""
        columns = [c if c is not None else repeat(None, self.length) for c in self.columns]
        out = []
        for i, row in enumerate(zip(*columns, strict=True)):
            if i in self.whole:
                out.append(self.whole[i])
                continue
            entry = dict(zip(self.keys, row, strict=True))
            if self.empty_frames:
                entry["frames"] = []
            out.append(entry)
        return out


def packed(snapshot: dict) -> dict:
    """``snapshot`` with each device's trace packed (``PackedTrace``) where it can be: a new dict."""
    traces = [PackedTrace.pack(t) or t for t in snapshot.get("device_traces") or ()]
    return {**snapshot, "device_traces": traces} if traces else snapshot


def unpacked(snapshot: dict) -> dict:
    """``snapshot`` as ``torch.cuda.memory._snapshot()`` returned it, traces packed by ``packed`` made
    dicts again: a new dict where any was packed."""
    traces = snapshot.get("device_traces") or ()
    if not any(isinstance(t, PackedTrace) for t in traces):
        return snapshot
    return {
        **snapshot,
        "device_traces": [t.entries() if isinstance(t, PackedTrace) else t for t in traces],
    }


def _fields(entries: list[dict]) -> tuple[list, list, list, list]:
    """The action, µs, bytes and address of every entry, in one pass over the entries (the allocator's
    have every field; a trace written by hand may lack some)."""
    try:
        flat = list(chain.from_iterable(map(_FIELDS, entries)))
    except KeyError:
        flat = [
            x
            for e in entries
            for x in (e.get("action"), e.get("time_us", 0), e.get("size", 0), e.get("addr", 0))
        ]
    return flat[0::4], flat[1::4], flat[2::4], flat[3::4]


def _lines(entries: list[dict], at: Any, allocs: Any) -> list[str | None]:
    """The Python line of each event (entries ``at``; None for a free, or an alloc without frames)."""
    frames = [entries[i].get("frames") for i in at[allocs].tolist()]
    if not any(frames):
        return [None] * len(at)
    found = iter([user_line(f) if f else None for f in frames])
    return [next(found) if alloc else None for alloc in allocs.tolist()]


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
    addrs, sizes = events.addrs, events.sizes
    born = set(compress(addrs, map(gt, sizes, repeat(0))))
    # Each address's first event (a dict keeps the last value written: walk backwards).
    first = dict(zip(reversed(addrs), range(len(addrs) - 1, -1, -1), strict=True))
    start = {addrs[i]: Block(addrs[i], -sizes[i]) for i in sorted(first.values()) if sizes[i] <= 0}
    for b in end_blocks:
        if b.key not in born:
            start.setdefault(b.key, b)
    return start


def user_line(frames: Any) -> str | None:
    """'cell:5 y = model(x)' from an allocator record's Python frames: the innermost outside torch."""
    for f in frames:
        filename = f.get("filename", "")
        if filename and "/torch/" not in filename and not filename.startswith("??"):
            cell = filename.startswith("<ipython-input") or "/ipykernel_" in filename
            code = linecache.getline(filename, f.get("line", 0)).strip() or f"in {f.get('name', '')}"
            return f"{'cell' if cell else os.path.basename(filename)}:{f.get('line', 0)} {code}"
    return None
