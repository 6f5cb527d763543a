"""What the memory was: a run's bytes by category (parameters, gradients, optimizer state, activations,
KV cache, the allocator's cache, memory outside PyTorch, other processes) and its largest allocations.

Pure: the recorders in ``run.capture`` say which allocations were live and which roles the tensors had
(``Block``, ``Observation``); this module replays, assigns and sums. Imports neither torch nor IPython.

How a live allocation gets its category: a tensor seen as a module's parameter or buffer, a parameter's
``.grad``, an optimizer's state or a KV cache (``Observation``) while that allocation was alive gets that
role; every other allocation the tracker or the allocator knows is an activation or a temporary of the
step (inputs included). PyTorch's memory profiler (``torch.profiler._memory_profiler``) tells inputs,
activations, temporaries and autograd details apart by walking the op graph of a profiled run; this
module works from the roles alone, so it runs at the moment of a failure, with no profiler, and adds what
the profiler cannot see: the KV cache, the allocator's cache, memory outside PyTorch and other processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice

# (key, label): the order of the stacked bar and of every table.
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("parameters", "parameters"),
    ("gradients", "gradients"),
    ("optimizer", "optimizer state"),
    ("activations", "activations & temporaries"),
    ("kv_cache", "KV cache"),
    ("cache", "allocator cache"),
    ("outside", "outside PyTorch"),
    ("others", "other processes"),
)
LABELS = dict(CATEGORIES)
KEYS = tuple(k for k, _ in CATEGORIES)
# Where one tensor has two roles (a parameter kept in a cache), the first of these wins.
_PRIORITY = ("parameters", "gradients", "optimizer", "kv_cache")
TOP = 10


@dataclass(frozen=True)
class Block:
    """One live allocation: ``key`` is the tracker's storage key (CPU) or the block address (CUDA);
    ``born``/``died`` are clocks of the recorder (event index or µs), ``died`` None while alive."""

    key: int
    nbytes: int
    born: float = -math.inf
    died: float | None = None
    op: str | None = None
    line: str | None = None


@dataclass(frozen=True)
class Observation:
    """A tensor seen in a role at ``clock``: the allocation ``key`` alive then had ``category``."""

    clock: float
    key: int
    category: str
    name: str | None = None


@dataclass(frozen=True)
class Allocation:
    """One of the largest live allocations: bytes, category, and what made it where that is known (the
    tensor's name, the operator, the Python line with ``--stacks``)."""

    nbytes: int
    category: str
    name: str | None = None
    op: str | None = None
    line: str | None = None

    @property
    def what(self) -> str:
        """'model.0.weight', 'aten.addmm at <cell>:5', or the category where nothing else is known."""
        head = self.name or self.op or LABELS.get(self.category, self.category)
        return f"{head} at {self.line}" if self.line else head

    def to_json(self) -> dict:
        return {
            "bytes": self.nbytes,
            "category": self.category,
            "name": self.name,
            "op": self.op,
            "line": self.line,
            "what": self.what,
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Allocation:
        return cls(data["bytes"], data["category"], data.get("name"), data.get("op"), data.get("line"))


@dataclass(frozen=True)
class Breakdown:
    """A run's memory by category at one moment (``at``: "failure", "peak" or "end"); bytes are ``int``.

    ``parts`` holds every category of ``CATEGORIES`` in order; they sum to ``total``, which is what
    ``measured`` names: "tracker" (CPU: every live tensor storage, exact), "device" (CUDA: the device's
    used memory as NVML or ``mem_get_info`` reports it), "allocator" (CUDA at the peak: reserved bytes, no
    NVML figure for that moment). ``budget`` is the limit or the capacity; ``top`` the largest
    allocations, largest first. ``device_used`` is NVML's used memory of the device read at the same
    moment, where there is one: the figure the parts are checked against (they are built from this
    process's NVML figure and the other processes', not from it)."""

    at: str
    parts: tuple[tuple[str, int], ...]
    measured: str
    budget: int | None = None
    top: tuple[Allocation, ...] = ()
    device_used: int | None = None

    @property
    def total(self) -> int:
        return sum(n for _, n in self.parts)

    def __getitem__(self, key: str) -> int:
        return dict(self.parts).get(key, 0)

    def nonzero(self) -> list[tuple[str, int]]:
        return [(k, n) for k, n in self.parts if n]

    def largest(self) -> tuple[str, int] | None:
        """The category with the most bytes (None when all are empty)."""
        return max(self.nonzero(), key=lambda kn: kn[1], default=None)

    def to_json(self) -> dict:
        return {
            "at": self.at,
            "measured": self.measured,
            "total": self.total,
            "budget": self.budget,
            "device_used": self.device_used,
            "bytes": dict(self.parts),
            "labels": LABELS,
            "order": list(KEYS),
            "top": [a.to_json() for a in self.top],
        }

    @classmethod
    def from_json(cls, data: Mapping) -> Breakdown:
        return cls(
            at=data["at"],
            parts=tuple((k, int(data["bytes"].get(k, 0))) for k in KEYS),
            measured=data["measured"],
            budget=data.get("budget"),
            top=tuple(Allocation.from_json(a) for a in data.get("top", ())),
            device_used=data.get("device_used"),
        )


# --- building a breakdown -----------------------------------------------------------------------------


def roles(blocks: Iterable[Block], observations: Iterable[Observation]) -> dict[int, tuple[str, str | None]]:
    """key → (category, name) for each block that an observation saw while it was alive
    (``born <= clock < died``); an address reused by a later tensor does not inherit the earlier role."""
    by_key: dict[int, list[Observation]] = {}
    for o in observations:
        by_key.setdefault(o.key, []).append(o)
    found: dict[int, tuple[str, str | None]] = {}
    for b in blocks:
        seen = [
            o for o in by_key.get(b.key, ()) if b.born <= o.clock and (b.died is None or o.clock < b.died)
        ]
        if seen:
            best = min(seen, key=lambda o: _PRIORITY.index(o.category) if o.category in _PRIORITY else 99)
            name = next((o.name for o in seen if o.category == best.category and o.name), None)
            found[b.key] = (best.category, name)
    return found


def breakdown(
    blocks: Iterable[Block],
    observations: Iterable[Observation],
    at: str,
    measured: str = "tracker",
    budget: int | None = None,
    reserved: int | None = None,
    device_used: int | None = None,
    process_used: int | None = None,
    others: int = 0,
    top: int = TOP,
) -> Breakdown:
    """Sum ``blocks`` (the live allocations) by role, then add what lies outside the tensors.

    ``reserved`` (CUDA): the allocator's segments; the cache is reserved − allocated. ``process_used``
    (NVML's figure for this process) gives memory outside PyTorch as process_used − reserved; without it,
    ``device_used`` − reserved − ``others`` does. Without ``reserved`` (CPU) the parts sum to the blocks."""
    blocks = list(blocks)
    known = roles(blocks, observations)
    sums = dict.fromkeys(KEYS, 0)
    allocations = []
    for b in blocks:
        category, name = known.get(b.key, ("activations", None))
        sums[category] += b.nbytes
        allocations.append(Allocation(b.nbytes, category, name, b.op, b.line))
    allocated = sum(b.nbytes for b in blocks)
    if reserved is not None:
        sums["cache"] = max(reserved - allocated, 0)
        if process_used is not None:
            sums["outside"] = max(process_used - reserved, 0)
        elif device_used is not None:
            sums["outside"] = max(device_used - reserved - others, 0)
        sums["others"] = others
    allocations.sort(key=lambda a: -a.nbytes)
    return Breakdown(
        at=at,
        parts=tuple((k, sums[k]) for k in KEYS),
        measured=measured,
        budget=budget,
        top=tuple(allocations[:top]),
        device_used=device_used,
    )


# --- replaying a recorder's events --------------------------------------------------------------------

# (clock, key, bytes after the event (0 or -bytes: freed), op, line)
Event = tuple[float, int, int, "str | None", "str | None"]


def peak_index(before: int, events: Sequence[Event], start: Mapping[int, int] | None = None) -> int:
    """Index of the event after which the live total was highest (-1: at the start, ``before`` bytes);
    the first such event where the peak was reached more than once."""
    sizes = dict(start or {})
    total = best = before
    at = -1
    for i, (_, key, nbytes, _op, _line) in enumerate(events):
        if nbytes > 0:
            total += nbytes - sizes.get(key, 0)
            sizes[key] = nbytes
        else:
            total -= sizes.pop(key, 0)
        if total > best:
            best, at = total, i
    return at


def live_at(start: Mapping[int, Block], events: Sequence[Event], index: int) -> dict[int, Block]:
    """The blocks alive just after event ``index`` (-1: at the start), each with the clock it died at
    (the next event on its key after ``index``; None if it outlived the events)."""
    live = {k: (b.born, b.nbytes, b.op, b.line) for k, b in start.items()}
    for clock, key, nbytes, op, line in islice(events, index + 1):
        if nbytes > 0:
            old = live.get(key)
            # An event on a live key is a storage that grew in place (resize_): it keeps its birth.
            live[key] = (old[0], nbytes, old[2], old[3]) if old is not None else (clock, nbytes, op, line)
        else:
            live.pop(key, None)
    died: dict[int, float] = {}
    pending = len(live)
    for clock, key, *_ in islice(events, index + 1, None) if pending else ():
        if key in live and key not in died:
            died[key] = clock
            pending -= 1
            if not pending:
                break
    return {k: Block(k, n, born, died.get(k), op, line) for k, (born, n, op, line) in live.items()}


# --- reading a breakdown ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    """One line of a side-by-side: a category (or an allocation) in run ``a`` and in run ``b``."""

    label: str
    a: int
    b: int

    @property
    def delta(self) -> int:
        return self.b - self.a

    def to_json(self) -> dict:
        return {"label": self.label, "a": self.a, "b": self.b, "delta": self.delta}


def compare(a: Breakdown, b: Breakdown) -> list[Row]:
    """Category by category, ``a`` against ``b`` (categories empty in both left out), then the total."""
    rows = [Row(LABELS[k], a[k], b[k]) for k in KEYS if a[k] or b[k]]
    return [*rows, Row("total", a.total, b.total)]


def compare_top(a: Breakdown, b: Breakdown, n: int = 8) -> list[Row]:
    """The largest allocations of both runs matched by what made them (name, operator, line): the same
    tensor in both runs on one row, one only in ``a`` with 0 for ``b``."""
    sums: dict[str, list[int]] = {}
    for side, bd in ((0, a), (1, b)):
        for alloc in bd.top:
            label = f"{alloc.what} ({LABELS.get(alloc.category, alloc.category)})"
            sums.setdefault(label, [0, 0])[side] += alloc.nbytes
    rows = [Row(label, x, y) for label, (x, y) in sums.items()]
    rows.sort(key=lambda r: -max(r.a, r.b))
    return rows[:n]


def largest_batch(bd: Breakdown, batch: int, budget: int) -> int | None:
    """The largest batch the budget would hold if the activations grow in proportion to the batch and the
    rest stays (a line through the origin of the activations: the estimate a trial should verify).
    None when the breakdown has no activations to scale."""
    per_sample = bd["activations"] / batch if batch > 0 else 0
    if per_sample <= 0:
        return None
    fixed = bd.total - bd["activations"]
    return max(int((budget - fixed) // per_sample), 0)


def under_use(bd: Breakdown, batch: int, budget: int, factor: float = 1.25) -> str | None:
    """A sentence when the budget holds ``factor``× the batch or more (a fix that cut too deep)."""
    best = largest_batch(bd, batch, budget)
    if best is None or best < batch * factor:
        return None
    return (
        f"batch {batch} uses {bd.total / budget:.0%} of the budget; by its activations about {best} "
        "would still fit (an estimate: verify with --find-batch)"
    )
