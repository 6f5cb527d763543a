"""Find the largest batch size that fits: two probes, an affine fit of peak allocated memory against
batch size, a check of the prediction, a refinement when the check fails.

Peak *allocated* memory of a training step is affine in batch size, gradient checkpointing included
(GPT-2 124M, seq 512, AdamW on an H200, in benchmarks/RESULTS.md: fp32 1.49 GiB + 0.790 GiB per sample,
checkpointing 1.45 GiB + 0.309 GiB per sample, within 0.3%). Peak *reserved* memory, what the limit
weighs, is not: what the allocator keeps cached but unused came to 3.2 GiB at checkpointing's batch 32
and 1.0 GiB at 64. So the line is fitted on allocated, and the budget it is held to is the limit less
the unused reserve of the largest batch that fit (the nearest to the answer), less a small margin.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..diagnosis.findings import Remedy
from ..sizes import format_bytes

MARGIN = 0.02
# Stop once the best fitting batch is within 5% of the largest one the figures still allow: a trial more
# would cost as much as the whole search so far for a few samples.
TOLERANCE = 0.05


@dataclass(frozen=True)
class Trial:
    batch: int
    fits: bool
    peak_reserved: int
    wall_s: float = 0.0
    role: str = "probe"
    peak_allocated: int | None = None  # None: as much as reserved (the CPU mode counts no cache)

    @property
    def allocated(self) -> int:
        return self.peak_reserved if self.peak_allocated is None else self.peak_allocated

    @property
    def unused(self) -> int:
        """Reserved but not allocated at the peaks: the allocator's cache and fragments."""
        return max(0, self.peak_reserved - self.allocated)


@dataclass
class BatchSearch:
    """The trials of one search and what they found."""

    name: str
    budget: int
    trials: list[Trial] = field(default_factory=list)
    best: int | None = None
    source: str | None = None

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.summary())

    def summary(self) -> str:
        lines = [
            f"largest {self.name} that fits {format_bytes(self.budget)}: {self.best} "
            f"({len(self.trials)} trials)"
        ]
        for i, t in enumerate(self.trials, 1):
            status = _status(t)
            lines.append(f"  {i}. {t.role:<7} {self.name}={t.batch:<6} {status}")
        if self.source:
            lines.append("the cell with that batch:\n" + self.source)
        return "\n".join(lines)


def _status(t: Trial) -> str:
    if not t.fits:
        return "out of memory"
    if t.unused == 0:
        return f"peak reserved {format_bytes(t.peak_reserved)}"
    return f"peak {format_bytes(t.allocated)} allocated, {format_bytes(t.peak_reserved)} reserved"


def fit_line(trials: list[Trial]) -> tuple[float, float] | None:
    """(intercept, slope) of peak allocated against batch through the two largest fitting batches."""
    fitting = sorted({t.batch: t for t in trials if t.fits}.values(), key=lambda t: t.batch)
    if len(fitting) < 2:
        return None
    a, b = fitting[-2], fitting[-1]
    slope = (b.allocated - a.allocated) / (b.batch - a.batch)
    return a.allocated - slope * a.batch, slope


def next_batch(
    trials: list[Trial], budget: int, margin: float = MARGIN, tolerance: float = TOLERANCE
) -> int | None:
    """The batch to try next, or None when the search is done. Pure: decided from the trials alone.

    Allocated memory may use the budget less what the largest fitting trial held reserved but unused,
    less ``margin``. With one fitting trial (b, peak) the next is ``b × room / peak``: peak memory is
    affine in the batch with a non-negative fixed part, so that batch fits too and lands near the
    maximum (where it failed already, the curve bends upwards and the search bisects). With two, the
    line through them predicts the largest batch. The search stops when the best fitting batch is within
    ``tolerance`` of the largest one the line allows at the full budget (or below the smallest failure);
    until then, where the margin leaves nothing to try, it tries halfway to that largest batch.
    """
    fits = [t for t in trials if t.fits]
    fails = [t.batch for t in trials if not t.fits]
    lo = max((t.batch for t in fits), default=0)
    hi = min(fails, default=None)
    if hi is not None and hi - lo <= 1:
        return None
    if lo == 0:
        return None if hi is None or hi <= 1 else max(1, hi // 2)
    best = max(fits, key=lambda t: t.batch)
    room = budget - best.unused
    target = room - budget * margin
    line = fit_line(trials)
    if line is None or line[1] <= 0:
        guess = math.floor(best.batch * target / max(best.allocated, 1))
        if hi is not None and guess >= hi:
            # That batch already failed: the curve bends upwards; bisect.
            guess = lo + max(1, (hi - lo) // 2)
        guess = max(guess, lo + 1)
        ceiling = hi - 1 if hi is not None else guess
    else:
        intercept, slope = line
        guess = math.floor((target - intercept) / slope)
        # What the line says fits the whole budget: the most the next trial could win.
        ceiling = math.floor((room - intercept) / slope)
        if hi is not None and any(t.role == "check" and not t.fits for t in trials):
            # The line over-promised once: never aim past the midpoint.
            guess = min(guess, lo + max(1, (hi - lo) // 2))
    if hi is not None:
        guess, ceiling = min(guess, hi - 1), min(ceiling, hi - 1)
    if lo >= (1 - tolerance) * ceiling:
        return None
    # The margin leaves nothing to try, the full budget more than ``tolerance``: try halfway there.
    return guess if guess > lo else lo + max(1, (ceiling - lo) // 2)


def first_probe(start: int) -> int:
    """The first probe: a quarter of the user's value, small enough to fit in most cases; the second
    (``next_batch`` with one point) doubles it, far enough apart for a good slope."""
    return max(1, start // 4)


def find_batch(session: Any, spec: Any, name: str) -> BatchSearch:
    """Search the largest ``name`` that fits for ``spec`` (``%%gpumem --find-batch NAME`` and the report's
    search button): every probe is a trial of ``session`` that leaves the model, optimizer, RNG and
    namespace as they were; afterwards ``name`` is bound to the answer. Prints progress."""
    from dataclasses import replace

    from IPython.core.error import UsageError

    from ..diagnosis.rewrite import rewrite_batch
    from ..diagnosis.source import find_batch as find_in_cell

    shell = session.shell
    guess = find_in_cell(spec.source, _int_names(shell.user_ns), name=name)
    if guess is None:
        raise UsageError(f"--find-batch {name}: no integer {name} in the cell or the namespace")
    start = int(guess.value)
    search = BatchSearch(name=name, budget=0)

    def trial(batch: int, role: str) -> Trial:
        source = rewrite_batch(spec.source, guess, batch, accumulate=1) or spec.source
        probe = Remedy(
            "batch",
            f"{name}={batch}",
            automatic=True,
            params={"name": name, "new": batch, "old": start, "where": "option"},
        )
        applied = spec.applied if guess.where == "source" else (*spec.applied, probe)
        attempt = session.trial(replace(spec, source=source, applied=applied), bounds=None)
        if attempt.outcome == "error":
            raise UsageError(f"--find-batch: the cell failed with {name}={batch}: {attempt.error_text}")
        rec = attempt.recording
        result = Trial(
            batch, attempt.outcome == "ok", rec.peak_reserved, attempt.wall_s, role, rec.peak_allocated
        )
        search.budget = rec.limit if rec.limit is not None else (rec.capacity or search.budget)
        print(f"  trial {len(search.trials) + 1}: {role} {name}={batch}: {_status(result)}", flush=True)
        return result

    print(f"%%gpumem --find-batch {name} (starting from {start})", flush=True)
    from .release import frozen_heap

    with frozen_heap():
        _search(search, trial, start, session.settings.search_margin)
    search.best = max((t.batch for t in search.trials if t.fits), default=None)
    if search.best is not None:
        # The answer the person asked for: the one binding a search leaves.
        shell.user_ns[name] = search.best
        search.source = rewrite_batch(spec.source, guess, search.best, accumulate=1)
    return search


def _search(search: BatchSearch, trial: Any, start: int, margin: float) -> None:
    batch = first_probe(start)
    while True:
        search.trials.append(trial(batch, "probe"))
        if search.trials[-1].fits or batch == 1:
            break
        batch = max(1, batch // 2)
    while len(search.trials) < 12:
        batch = next_batch(search.trials, search.budget, margin=margin)
        if batch is None:
            break
        search.trials.append(trial(batch, "probe" if len(search.trials) < 2 else "check"))


def _int_names(ns: dict) -> dict[str, int]:
    return {
        k: v
        for k, v in ns.items()
        if isinstance(v, int) and not isinstance(v, bool) and not k.startswith("_")
    }
