"""The plain-text report: what terminal IPython, nbconvert and anything without widgets shows."""

from __future__ import annotations

from ..cellrun import CellRun
from ..sizes import format_bytes


def figures(run: CellRun) -> list[tuple[str, str]]:
    """(label, value) rows of the run's figures, shared by the text and the HTML table."""
    rows = [("device", run.device), ("wall time", f"{run.wall_s:.2f} s")]
    rows += [
        ("peak allocated", format_bytes(run.peak_allocated)),
        ("peak reserved", format_bytes(run.peak_reserved)),
        (
            "held before → after",
            f"{format_bytes(run.before_allocated)} → {format_bytes(run.after_allocated)}",
        ),
    ]
    if run.capacity is not None:
        rows.append(("capacity", format_bytes(run.capacity)))
    if run.limit is not None:
        rows.append(("limit", format_bytes(run.limit)))
    if run.headroom is not None and run.outcome == "ok":
        rows.append(("headroom", format_bytes(run.headroom)))
    rep = run.report
    if rep is not None:
        rows += [
            (label, format_bytes(value))
            for label, value in (
                ("requested", rep.requested),
                ("free", rep.free),
                ("allocated by PyTorch", rep.allocated),
                ("reserved by PyTorch", rep.reserved),
                ("reserved but unallocated", rep.reserved_unallocated),
                ("in use by this process", rep.process_used),
            )
            if value is not None
        ]
        rows += [(f"process {pid}", format_bytes(used)) for pid, used in rep.other_processes]
    if run.freed is not None:
        rows.append(("given back after the error", format_bytes(run.freed)))
    if run.dropped:
        names = ", ".join(f"{name} ({format_bytes(n)})" for name, n in run.dropped)
        rows.append(("names the failed cell bound, dropped", names))
    if run.timeline.steps:
        rows.append(("optimizer steps", str(len(run.timeline.steps))))
    if run.gpu_busy is not None:
        rows.append(("GPU busy (NVML, 10 Hz)", f"{run.gpu_busy:.0f}%"))
    if run.snapshot_ms is not None:
        rows.append(("allocator snapshot at the failure", f"{run.snapshot_ms:.1f} ms"))
    return rows


def fitted_lines(run: CellRun) -> list[str]:
    """After a run that fits: headroom, how busy the GPU was, and a batch that cut too deep."""
    if run.outcome != "ok":
        return []
    parts = []
    if run.headroom is not None and run.budget:
        parts.append(f"headroom {format_bytes(run.headroom)} ({run.headroom / run.budget:.0%} of the budget)")
    if run.gpu_busy is not None:
        parts.append(f"GPU busy {run.gpu_busy:.0f}%")
    lines = ["; ".join(parts)] if parts else []
    under = run.under_use()
    if under:
        lines.append(under)
    return lines


def rank_lines(run: CellRun) -> list[str]:
    """The per-rank table of a distributed cell, with who failed first and the bottleneck above it."""
    if run.ranks is None:
        return []
    rows = run.ranks.rows()
    widths = [max(len(row[col]) for row in rows) for col in range(len(rows[0]))]
    lines = [f"ranks: {s}" for s in run.ranks.summary()]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return lines


def remedy_line(remedy, plan) -> str:
    """A finding's fix as the plan measured it ('Batch 32 → 10: fits, measured'), else its first guess
    marked as one."""
    entry = plan.measured(remedy.kind) if plan is not None else None
    if entry is not None:
        return f"{entry.title}: {entry.verdict}, measured (see the plan)"
    if plan is not None and plan.entries:
        return f"{remedy.title} (estimate, not measured)"
    return remedy.title


def render_text(run: CellRun, findings: int = 5) -> str:
    """The report as plain text, in the widget's order: headline, memory by category, the fix plan, the
    findings, the largest allocations, the figures."""
    from .categories import bar_text, top_text

    status = {"ok": "ok", "oom": "OUT OF MEMORY", "error": "error", "interrupted": "interrupted"}[run.outcome]
    lines = [f"%%gpumem [{status}] {run.headline()}"]
    if run.applied:
        lines.append(f"  fixes in force: {run.change}")
    lines += [f"  {line}" for line in fitted_lines(run)]
    lines += bar_text(run)
    plan = run.plan
    if plan is not None and plan.entries and run.outcome == "oom":
        lines.append(f"fix plan: {plan.summary}")
        if plan.unfittable:
            lines.append(f"  {plan.unfittable}")
        lines += [f"  {i}. {e.title}: {e.line()}" for i, e in enumerate(plan.entries, 1)]
    lines += rank_lines(run)
    for f in run.findings[:findings]:
        lines.append(f"- {f.title}: {f.evidence}")
        lines += [f"    fix: {remedy_line(r, plan)}" for r in f.remedies[:3]]
    lines += top_text(run)
    width = max(len(label) for label, _ in figures(run))
    lines.append("figures:")
    lines += [f"  {label:<{width}}  {value}" for label, value in figures(run)]
    if run.timeline.truncated:
        lines.append("  (the timeline lost its earliest events: the cell made more than the trace keeps)")
    if run.options.no_timeline:
        lines.append("  (--no-timeline: no timeline between the start and the end; the peak is exact)")
    return "\n".join(lines)
