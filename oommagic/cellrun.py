"""``CellRun``: the one record of one execution of a ``%%gpumem`` cell, and the history of them.

The text view, the widget, the comm message to the sidebar and ``oommagic.history()`` all read this
record; nothing keeps a second copy of its figures.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from .oom import OOMReport
from .sizes import format_bytes
from .timeline import Timeline

SCHEMA_VERSION = 1


@dataclass
class CellRun:
    """What one run of a cell did to memory.

    ``outcome`` is ``"ok"``, ``"oom"``, ``"error"`` (another exception) or ``"interrupted"``.
    Bytes are ``int``; ``capacity`` is the card's (or the emulated card's) total, ``limit`` the
    per-process cap that ``--limit`` set, if any.
    """

    source: str
    device: str
    options: dict[str, Any] = field(default_factory=dict)
    execution_count: int | None = None
    cell_id: str | None = None
    started: float = 0.0
    wall_s: float = 0.0
    outcome: str = "ok"
    before_allocated: int = 0
    before_reserved: int = 0
    after_allocated: int = 0
    after_reserved: int = 0
    peak_allocated: int = 0
    peak_reserved: int = 0
    capacity: int | None = None
    limit: int | None = None
    timeline: Timeline = field(default_factory=Timeline)
    report: OOMReport | None = None
    freed: int | None = None
    dropped: list[tuple[str, int]] = field(default_factory=list)
    error: str | None = None
    findings: list = field(default_factory=list)
    change: str | None = None
    parent: str | None = None
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])

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

    def headline(self) -> str:
        """One line a person reads first."""
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
        return {
            "version": SCHEMA_VERSION,
            "id": self.id,
            "parent": self.parent,
            "source": self.source,
            "device": self.device,
            "options": self.options,
            "execution_count": self.execution_count,
            "cell_id": self.cell_id,
            "started": self.started,
            "wall_s": self.wall_s,
            "outcome": self.outcome,
            "headline": self.headline(),
            "before_allocated": self.before_allocated,
            "before_reserved": self.before_reserved,
            "after_allocated": self.after_allocated,
            "after_reserved": self.after_reserved,
            "peak_allocated": self.peak_allocated,
            "peak_reserved": self.peak_reserved,
            "capacity": self.capacity,
            "limit": self.limit,
            "headroom": self.headroom,
            "timeline": self.timeline.downsample().to_json(),
            "report": self.report.to_json() if self.report else None,
            "freed": self.freed,
            "dropped": [list(d) for d in self.dropped],
            "error": self.error,
            "findings": [f.to_json() for f in self.findings],
            "change": self.change,
        }

    def to_json_str(self) -> str:
        return json.dumps(self.to_json())

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        from .view.text import render_text

        p.text("CellRun(...)" if cycle else render_text(self))


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


_HISTORY: list[CellRun] = []


def history() -> list[CellRun]:
    """Every ``%%gpumem`` run of this kernel, oldest first (the live list)."""
    return _HISTORY
