"""The fix plan: each candidate fix (or combination) with its measured peak against the budget, its time
per step against the original, and a verdict; ordered so that the first entry is the cheapest fix verified
to fit.

Pure records and ordering; ``run.plan`` measures the entries by bounded trials.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..sizes import format_bytes
from .findings import Remedy
from .kinds import COMPUTED, tier

FITS, LIKELY_FITS, DOES_NOT_FIT, NOT_MEASURED = "fits", "likely fits", "does not fit", "not measured"
# "fits": a trial ran what the click runs through the run's steady state and left at least the margin
# free; "likely fits": it ran within the budget but with less to spare, or not through the steady state.


@dataclass(frozen=True)
class PlanEntry:
    """One candidate: the fixes applied (in order, on top of those already in force), what its trial
    measured (``peak``: the peak reserved bytes, a lower bound where the trial ran out), and a verdict."""

    fixes: tuple[Remedy, ...]
    verdict: str = NOT_MEASURED
    peak: int | None = None
    budget: int | None = None
    seconds_per_step: float | None = None
    time_ratio: float | None = None
    method: str = ""
    note: str = ""
    # A distributed cell's trial: the rank that decided the verdict, in words ("rank 1 (cuda:1) ran out of
    # memory", "tightest: rank 1 (cpu)"); every rank was measured against its own device's budget. Sent
    # within ``line``.
    rank: str = ""

    @property
    def kind(self) -> str:
        """``"batch"``, or ``"checkpointing+batch"`` for a combination."""
        return "+".join(r.kind for r in self.fixes)

    @property
    def title(self) -> str:
        return " + ".join(r.title for r in self.fixes)

    @property
    def tier(self) -> int:
        """What the entry changes beyond memory, its most changing fix's tier (``kinds.SAME``,
        ``NUMERICS``, ``COMPUTED``): a plan prefers the lowest tier that fits, then the fastest."""
        return max((tier(r) for r in self.fixes), default=COMPUTED)

    def line(self) -> str:
        """'fits — peak 201.3 MiB of 256.0 MiB, 1.3× the time per step (trial: 2 optimizer steps)'."""
        parts = [self.verdict]
        if self.peak is not None and self.budget:
            bound = "at least " if self.verdict == DOES_NOT_FIT else ""
            parts.append(f"peak {bound}{format_bytes(self.peak)} of {format_bytes(self.budget)}")
        if self.time_ratio is not None:
            parts.append(f"{self.time_ratio:.1f}× the time per step")
        elif self.seconds_per_step is not None:
            parts.append(f"{self.seconds_per_step:.2f} s per step")
        text = " — ".join(parts[:1]) + (" — " + ", ".join(parts[1:]) if parts[1:] else "")
        if self.method:
            text += f" ({self.method})"
        text += f"; {self.rank}" if self.rank else ""
        return text + (f"; {self.note}" if self.note else "")

    def to_json(self) -> dict:
        return {
            "kind": self.kind,
            "title": self.title,
            "fixes": [r.to_json() for r in self.fixes],
            "verdict": self.verdict,
            "peak": self.peak,
            "budget": self.budget,
            "seconds_per_step": self.seconds_per_step,
            "time_ratio": self.time_ratio,
            "method": self.method,
            "note": self.note,
            "line": self.line(),
        }


@dataclass(frozen=True)
class FixPlan:
    """The entries in the order offered; ``summary`` says what was measured and how (or why nothing
    fits); ``snapshot_bytes`` the host memory the trials' state snapshot took."""

    entries: tuple[PlanEntry, ...] = ()
    summary: str = ""
    budget_s: float = 0.0
    spent_s: float = 0.0
    trials: int = 0
    snapshot_bytes: int = 0
    stopped: bool = False
    cut_short: bool = False  # the time budget ended with candidates left unmeasured
    unfittable: str = ""
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def recommended(self) -> PlanEntry | None:
        """The cheapest entry verified to fit, if any."""
        return next((e for e in self.entries if e.verdict == FITS), None)

    def measured(self, kind: str) -> PlanEntry | None:
        """The measured entry of the single fix ``kind`` (the plan's own size of it, which can differ
        from the finding's first guess), if a trial measured one."""
        return next((e for e in self.entries if e.kind == kind and e.verdict != NOT_MEASURED), None)

    def to_json(self) -> dict:
        return {
            "entries": [e.to_json() for e in self.entries],
            "summary": self.summary,
            "budget_s": self.budget_s,
            "spent_s": self.spent_s,
            "trials": self.trials,
            "snapshot_bytes": self.snapshot_bytes,
            "stopped": self.stopped,
            "cut_short": self.cut_short,
            "unfittable": self.unfittable,
            "notes": list(self.notes),
        }


def ordered(entries: list[PlanEntry]) -> tuple[PlanEntry, ...]:
    """Fitting entries first, cheapest first (fewest changes to what is computed, then fastest, then the
    fewest fixes); then the ones that likely fit, the most room left first; then the ones not measured, in
    the diagnosis's order; then the ones that do not fit."""
    rank = {FITS: 0, LIKELY_FITS: 1, NOT_MEASURED: 2, DOES_NOT_FIT: 3}

    def key(item: tuple[int, PlanEntry]) -> tuple:
        i, e = item
        if e.verdict == FITS:
            return (0, e.tier, e.time_ratio or e.seconds_per_step or 0.0, len(e.fixes), i)
        if e.verdict == LIKELY_FITS:
            return (1, e.tier, float(e.peak or 0), len(e.fixes), i)
        return (rank.get(e.verdict, 2), 0, 0.0, 0, i)

    return tuple(e for _, e in sorted(enumerate(entries), key=key))


def with_time_ratios(entries: list[PlanEntry], reference: float | None) -> list[PlanEntry]:
    """Each entry's time per step against ``reference`` (the original's, else the fastest fitting one)."""
    from dataclasses import replace

    times = [e.seconds_per_step for e in entries if e.verdict == FITS and e.seconds_per_step]
    ref = reference or (min(times) if times else None)
    if not ref:
        return entries
    return [
        replace(e, time_ratio=round(e.seconds_per_step / ref, 2)) if e.seconds_per_step else e
        for e in entries
    ]


def with_measured(findings: tuple, plan: FixPlan | None) -> tuple:
    """``findings`` with each fix the plan measured alone replaced by the plan's size of it (the batch the
    probes found, not the first guess): every view and the sidebar's Apply then offer what was measured."""
    if plan is None or not plan.entries:
        return findings
    out = []
    for f in findings:
        remedies = tuple((e.fixes[0] if (e := plan.measured(r.kind)) is not None else r) for r in f.remedies)
        out.append(replace(f, remedies=remedies) if remedies != f.remedies else f)
    return tuple(out)
