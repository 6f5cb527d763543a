"""A trial of the fix plan on a distributed cell: every rank relaunched, each bounded as the trial is; what
their records say, and which rank decides it.

Pure: reads ``Ranks`` (``diagnosis.ranks``); ``run.plan`` runs the trials and turns this into an entry.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..sizes import format_bytes as fmt
from .plan import DOES_NOT_FIT, NOT_MEASURED
from .ranks import RankResult, Ranks


@dataclass(frozen=True)
class RanksTrial:
    """What a trial that relaunched the ranks says: ``verdict`` ``DOES_NOT_FIT`` or ``NOT_MEASURED``
    where a rank decided it (ran out, failed, ran out of time, wrote nothing), None where every rank ran
    to the trial's end and the margin decides; ``rank`` is the rank that decides (the tightest where all
    ran: the largest share of its own budget), ``note`` says why, naming it; ``steps`` the optimizer steps
    every rank took (None: they differ or were not counted)."""

    verdict: str | None
    rank: RankResult | None
    note: str = ""
    steps: int | None = None


def trial_of_ranks(ranks: Ranks | None) -> RanksTrial:
    """Read a trial's ranks: the first that ran out or failed decides; else the tightest rank, against its
    own device's budget."""
    if ranks is None or not ranks.results:
        return RanksTrial(DOES_NOT_FIT, None, "the cell started no rank with it")
    oom = ranks.out_of_memory
    if oom is not None:
        asked = f" asking for {fmt(oom.requested)}" if oom.requested else ""
        under = f" under its {fmt(oom.budget)}" if oom.budget else ""
        return RanksTrial(
            DOES_NOT_FIT, oom, f"rank {oom.rank} ({oom.device}) ran out of memory{asked}{under}"
        )
    failed = ranks.failed_first or next((r for r in ranks.results if r.status == "error"), None)
    if failed is not None:
        last = (failed.message or "").strip().splitlines()[-1:] or [""]
        return RanksTrial(DOES_NOT_FIT, failed, f"rank {failed.rank} failed with it: {last[0][:200]}")
    for status, why in (("timed_out", "ran out of the time budget"), ("lost", "wrote no report")):
        late = next((r for r in ranks.results if r.status == status), None)
        if late is not None:
            return RanksTrial(NOT_MEASURED, late, f"rank {late.rank} {why}")
    counted = {r.steps for r in ranks.results}
    steps = counted.pop() if len(counted) == 1 else None
    if len(counted) > 0:
        taken = ", ".join(f"rank {r.rank} {r.steps}" for r in ranks.results)
        return RanksTrial(
            DOES_NOT_FIT, None, f"the ranks took different numbers of optimizer steps ({taken})"
        )
    tightest = max(ranks.results, key=lambda r: (r.held / r.budget if r.budget else 0.0, r.held, -r.rank))
    where = f"tightest of {len(ranks)} ranks: rank {tightest.rank} ({tightest.device})"
    return RanksTrial(None, tightest, where, steps)
