"""``CellRun``: the one record of one execution of a ``%%gpumem`` cell.

Built once, by ``run.session``, after the recording: it holds the ``Recording`` itself (no field-by-field
copy), the ``DiagnosisContext`` made in the same step, the findings and the fix plan. The text view, the
widget, the comm message to the sidebar and ``oommagic.history()`` all read this record.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .categories import Breakdown
from .diagnosis.findings import DiagnosisContext, Finding, Remedy
from .diagnosis.ranks import Ranks
from .oom import OOMReport
from .options import Options
from .sizes import format_bytes
from .timeline import Recording, Timeline

SCHEMA_VERSION = 2


@dataclass(frozen=True)
class CellRun:
    """What one run of a cell did to memory.

    ``outcome`` is ``"ok"``, ``"oom"``, ``"error"`` (another exception) or ``"interrupted"``. Bytes are
    ``int``; ``capacity`` is the card's (or the emulated card's) total, ``limit`` the per-process cap that
    ``--limit`` set, if any. ``applied`` are the fixes in force, in the order they were applied; ``plan``
    the measured fix plan after an out-of-memory error. ``categories`` is the memory by category (at the
    failure, else at the peak, else at the end: ``categories.at`` says which) with the largest live
    allocations; ``gpu_busy`` the mean GPU busy percentage NVML saw during the cell (CUDA only);
    ``snapshot_ms`` how long the allocator snapshot at the failure took.
    """

    source: str
    recording: Recording
    options: Options = field(default_factory=Options)
    applied: tuple[Remedy, ...] = ()
    outcome: str = "ok"
    report: OOMReport | None = None
    error: str | None = None
    freed: int | None = None
    dropped: tuple[tuple[str, int], ...] = ()
    context: DiagnosisContext | None = None
    findings: tuple[Finding, ...] = ()
    plan: Any = None  # run.plan.FixPlan, or None
    execution_count: int | None = None
    cell_id: str | None = None
    started: float = 0.0
    wall_s: float = 0.0
    parent: str | None = None
    original: str | None = None
    categories: Breakdown | None = None
    gpu_busy: float | None = None
    snapshot_ms: float | None = None
    ranks: Ranks | None = None  # per-rank figures when the cell started torch.distributed ranks
    # False where a rank ran out under a launcher that returned (``!torchrun``): the cell does not fail.
    raised: bool = True
    # Who ran out where a launched script's ranks record nothing: read from its output, nothing measured.
    unrecorded: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

    # Thin readers over the recording: one source of truth for every figure.
    @property
    def device(self) -> str:
        return self.recording.device

    @property
    def timeline(self) -> Timeline:
        return self.recording.timeline

    @property
    def peak_allocated(self) -> int:
        return self.recording.peak_allocated

    @property
    def peak_reserved(self) -> int:
        return self.recording.peak_reserved

    @property
    def before_allocated(self) -> int:
        return self.recording.before_allocated

    @property
    def after_allocated(self) -> int:
        return self.recording.after_allocated

    @property
    def capacity(self) -> int | None:
        return self.recording.capacity

    @property
    def limit(self) -> int | None:
        return self.recording.limit

    @property
    def budget(self) -> int | None:
        """The bytes this run could use: the limit if one was set, else the capacity."""
        return self.limit if self.limit is not None else self.capacity

    @property
    def headroom(self) -> int | None:
        return None if self.budget is None else self.budget - self.peak_reserved

    @property
    def held_after(self) -> int:
        """Allocated bytes the cell left behind (negative when it freed earlier memory)."""
        return self.after_allocated - self.before_allocated

    @property
    def change(self) -> str | None:
        """The fixes in force, as a person reads them ("Gradient checkpointing + Batch 64 → 32")."""
        return " + ".join(r.title for r in self.applied) or None

    @property
    def batch(self) -> int | None:
        """The micro-batch this run ran with, where a batch fix set it (None otherwise)."""
        for r in reversed(self.applied):
            if r.kind == "batch" and isinstance(r.params.get("new"), int):
                return r.params["new"]
        return None

    def under_use(self) -> str | None:
        """After a run that fits with a batch fix: a sentence when the budget would hold a much larger
        micro-batch by the activations' share of this run (the fix cut too deep), else None."""
        from .categories import under_use

        if self.outcome != "ok" or self.categories is None or self.batch is None or not self.budget:
            return None
        return under_use(self.categories, self.batch, self.budget)

    def headline(self) -> str:
        """One line a person reads first."""
        ranks = self.ranks
        if ranks is not None and (ranks.out_of_memory is not None or self.outcome == "ok"):
            return ranks.headline()  # the kernel's own figures say nothing of its ranks
        if self.outcome == "oom" and self.unrecorded:
            asked = self.report.requested if self.report is not None else None
            where = (
                f" ({self.report.device}:{self.report.gpu_index})"
                if self.report and self.report.gpu_index is not None
                else ""
            )
            return (
                f"{self.unrecorded}{where} ran out of memory"
                + (f" asking for {format_bytes(asked)}" if asked else "")
                + ", read from its output: its ranks record nothing (run its work inside `with "
                "oommagic.rank_recorder():` for per-rank figures and a measured fix)"
            )
        if self.outcome == "oom" and self.report is not None:
            return oom_headline(self.report, self.budget)
        if self.outcome == "oom":
            return "out of memory"
        if self.outcome == "error":
            return f"failed: {self.error or 'error'}"
        if self.outcome == "interrupted":
            return "interrupted"
        budget = f" of {format_bytes(self.budget)}" if self.budget else ""
        return (
            f"peak {format_bytes(self.peak_allocated)} allocated, {format_bytes(self.peak_reserved)} "
            f"reserved{budget} in {self.wall_s:.2f} s"
        )

    def to_json(self) -> dict:
        rec = self.recording
        return {
            "version": SCHEMA_VERSION,
            "id": self.id,
            "parent": self.parent,
            "source": self.source,
            "original": self.original,
            "device": rec.device,
            "options": self.options.to_json(),
            "applied": [r.to_json() for r in self.applied],
            "execution_count": self.execution_count,
            "cell_id": self.cell_id,
            "started": self.started,
            "wall_s": self.wall_s,
            "outcome": self.outcome,
            "headline": self.headline(),
            "before_allocated": rec.before_allocated,
            "before_reserved": rec.before_reserved,
            "after_allocated": rec.after_allocated,
            "after_reserved": rec.after_reserved,
            "peak_allocated": rec.peak_allocated,
            "peak_reserved": rec.peak_reserved,
            "capacity": rec.capacity,
            "limit": rec.limit,
            "headroom": self.headroom,
            "timeline": rec.timeline.downsample().to_json(),
            "report": self.report.to_json() if self.report else None,
            "freed": self.freed,
            "dropped": [list(d) for d in self.dropped],
            "error": self.error,
            "findings": [f.to_json() for f in self.findings],
            "plan": self.plan.to_json() if self.plan is not None else None,
            "change": self.change,
            "categories": self.categories.to_json() if self.categories is not None else None,
            "gpu_busy": self.gpu_busy,
            "snapshot_ms": self.snapshot_ms,
            "under_use": self.under_use(),
            "ranks": self.ranks.to_json() if self.ranks is not None else None,
        }

    def to_json_str(self) -> str:
        return json.dumps(self.to_json())


def oom_headline(report: OOMReport, budget: int | None) -> str:
    """'needed 2.00 GiB more than the 24.00 GiB card had: 9.35 GiB of it reserved but unused'."""
    cap = budget if budget is not None else (report.limit or report.capacity)
    req = report.requested
    if req is None:
        return f"out of memory on {report.device or 'the device'}"
    short = req - report.free if report.free is not None else req
    card = (
        f"the {format_bytes(cap)} {'limit' if report.limit or report.emulated else 'card'}"
        if cap
        else "the card"
    )
    line = f"needed {format_bytes(max(short, 0) or req)} more than {card} had"
    if report.reserved_unallocated:
        line += f": {format_bytes(report.reserved_unallocated)} of it reserved but unused"
    return line
