"""The report widget, in the order a person reads it: a one-line headline, the memory by category against
the budget, the fix plan with its buttons, the fixes in force, the timeline, and folded under "Details" the
findings, the largest allocations, two runs side by side and the figures: after a failure the whole report
fits one screen (1400×900), the plan's first button on it.

A view of ``CellRun`` records: it renders a run and forwards clicks to the session it was given
(``actions``: ``retry``, ``remove``, ``search``, ``pending_error``); it executes nothing itself. A click
makes a new run, which the widget shows in place of the old one. Text is escaped wherever it reaches HTML.
"""

from __future__ import annotations

import contextlib
import html
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..cellrun import CellRun
from ..diagnosis.findings import Remedy
from ..diagnosis.plan import FITS, LIKELY_FITS, PlanEntry
from ..sizes import format_bytes
from .categories import bar_html, run_label, side_by_side_html, top_html
from .plot import timeline_png
from .text import figures, fitted_lines, render_text

_STATUS = {
    "ok": ("ok", "#2e7d32"),
    "oom": ("out of memory", "#c0392b"),
    "error": ("error", "#c0392b"),
    "interrupted": ("interrupted", "#888"),
}
_VERDICT_COLOUR = {FITS: "#2e7d32", LIKELY_FITS: "#8a6d00", "does not fit": "#c0392b"}


# Buttons are as wide as their short label (never cut); the tooltip carries the whole title.
BUTTON = {"width": "auto", "height": "2.1em"}
# JupyterLab gives widget HTML the line height of a widget row (28 px): wrapped text would read
# double-spaced. Every block sets its own.
_BLOCK = "line-height:1.4;margin:0.35em 0"


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _rich(text: object) -> str:
    """Escaped text with `code` spans (the findings' convention) as <code>."""
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", _esc(text))


def block(inner: str) -> str:
    return f"<div style='{_BLOCK}'>{inner}</div>" if inner else ""


@dataclass(frozen=True)
class Fix:
    """One offered fix: a plan entry (one remedy or a combination) or, without a plan, one remedy.
    ``kind`` is what ``ReportWidget.click`` takes (``"batch"``, ``"checkpointing+batch"``)."""

    kind: str
    title: str
    fixes: tuple[Remedy, ...]
    verdict: str = ""
    line: str = ""


def offered(run: CellRun) -> list[Fix]:
    """The fixes the report offers, in the plan's order (first = recommended): every automatic plan entry
    that fits or was not measured (ones measured not to fit are shown, not offered); without a plan, the
    findings' automatic remedies."""
    if run.plan is not None and run.plan.entries:
        entries: list[PlanEntry] = [e for e in run.plan.entries if e.verdict != "does not fit"]
        return [Fix(e.kind, e.title, e.fixes, e.verdict, e.line()) for e in entries]
    seen: dict[str, Fix] = {}
    for finding in run.findings:
        for r in finding.remedies:
            if r.automatic and r.kind not in seen:
                seen[r.kind] = Fix(r.kind, r.title, (r,))
    return list(seen.values())


def headline_html(run: CellRun, fitted_after: CellRun | None = None) -> str:
    label, colour = _STATUS[run.outcome]
    line = (
        f"<div class='oommagic-headline' style='font-size:1.05em'><b style='color:{colour}'>%%gpumem · "
        f"{label}</b> — {_esc(run.headline())}</div>"
    )
    if run.outcome == "ok" and run.applied:
        line += f"<div style='color:#2e7d32'>with {_esc(run.change)}</div>"
    line += "".join(f"<div style='color:#555'>{_esc(x)}</div>" for x in fitted_lines(run))
    return block(line)


def figures_html(run: CellRun) -> str:
    cells = "".join(
        f"<tr><td style='padding:0.05em 1.5em 0.05em 0;color:#555'>{_esc(k)}</td><td>{_esc(v)}</td></tr>"
        for k, v in figures(run)
    )
    return block(
        "<details class='oommagic-figures'><summary>Figures</summary>"
        f"<table style='border-collapse:collapse'>{cells}</table></details>"
    )


def ranks_html(run: CellRun) -> str:
    """The per-rank table of a distributed cell (empty for a single process)."""
    if run.ranks is None:
        return ""
    header, *rows = run.ranks.rows()
    failed = run.ranks.failed_first
    cell = "padding:0.1em 1em 0.1em 0"
    head = "".join(f"<th style='{cell};text-align:left'>{_esc(h)}</th>" for h in header)
    first = str(failed.rank) if failed is not None else None
    body = "".join(
        f"<tr style='color:{'#c0392b' if row[0] == first else 'inherit'}'>"
        + "".join(f"<td style='{cell}'>{_esc(c)}</td>" for c in row)
        + "</tr>"
        for row in rows
    )
    summary = "".join(f"<div>{_esc(line)}</div>" for line in run.ranks.summary())
    return f"<div class='oommagic-ranks'>{summary}<table><tr>{head}</tr>{body}</table></div>"


def plan_html(run: CellRun) -> str:
    """The plan's entries with their verdicts, under one line that says how they were measured (the
    entries say what fits: the plan's summary would say the first one twice)."""
    plan = run.plan
    if plan is None or not plan.entries:
        return ""
    rows = "".join(
        f"<tr><td style='padding:0.1em 1.5em 0.1em 0'>{i}. {_rich(e.title)}</td>"
        f"<td style='color:{_VERDICT_COLOUR.get(e.verdict, '#555')}'>{_rich(e.line())}</td></tr>"
        for i, e in enumerate(plan.entries, 1)
    )
    how = (
        f"{plan.trials} trial{'s' if plan.trials != 1 else ''} in {plan.spent_s:.1f} s of the "
        f"{plan.budget_s:.0f} s budget; {plan.summary.partition('; ')[2] or 'restored after each'}"
        if plan.trials
        else plan.summary
    )
    parts = [f"<div><b>Fix plan</b> <span style='color:#555'>— {_rich(how)}</span></div>"]
    if plan.unfittable:
        parts.append(f"<div class='oommagic-unfittable' style='color:#c0392b'>{_rich(plan.unfittable)}</div>")
    parts.append(f"<table class='oommagic-plan' style='border-collapse:collapse'>{rows}</table>")
    return block("".join(parts))


def finding_html(finding: Any, plan: Any = None) -> str:
    saving = f" — saves ~{format_bytes(finding.saving)}" if finding.saving else ""
    parts = [
        f"<div><b>{_rich(finding.title)}</b>{_esc(saving)}</div>",
        f"<div style='color:#444'>{_rich(finding.evidence)}</div>",
    ]
    for remedy in finding.remedies:
        entry = plan.measured(remedy.kind) if plan is not None else None
        remedy = entry.fixes[0] if entry is not None else remedy  # the plan's measured size of it
        verdict = (
            f" <i>({_esc(entry.verdict)}, measured)</i>"
            if entry is not None
            else " <i>(estimate)</i>"
            if plan is not None and plan.entries
            else ""
        )
        parts.append(
            f"<div style='margin-top:0.3em'>• <b>{_rich(remedy.title)}</b>{verdict}: "
            f"{_rich(remedy.explanation)}</div>"
        )
        if remedy.code:
            parts.append(f"<pre style='margin:0.2em 0 0 1em;font-size:0.9em'>{_esc(remedy.code)}</pre>")
    return "".join(parts)


def attempts_html(runs: list[CellRun]) -> str:
    left, right = (
        "padding:0.1em 1.6em 0.1em 0;text-align:left",
        "padding:0.1em 1.6em 0.1em 0;text-align:right",
    )
    rows = "".join(
        f"<tr><td style='{right}'>{i}</td><td style='{left}'>{_esc(r.change or 'as written')}</td>"
        f"<td style='{left};color:{_STATUS[r.outcome][1]}'>{_esc(_STATUS[r.outcome][0])}</td>"
        f"<td style='{right}'>{_esc(format_bytes(r.peak_reserved))}</td>"
        f"<td style='{right}'>{r.wall_s:.2f} s</td></tr>"
        for i, r in enumerate(runs, 1)
    )
    head = "".join(
        f"<th style='{style}'>{h}</th>"
        for h, style in (
            ("#", right),
            ("fixes", left),
            ("outcome", left),
            ("peak reserved", right),
            ("time", right),
        )
    )
    return block(
        f"<b>Attempts</b><table class='oommagic-attempts' style='border-collapse:collapse'><tr>{head}</tr>"
        f"{rows}</table>"
    )


class ReportWidget:
    """The widget for one cell and its retries. ``display()`` it; its plain-text form is the text report.

    ``fixes`` are the offered fixes in the plan's order; ``click(kind)`` presses one as a person would."""

    def __init__(self, run: CellRun, actions: Any) -> None:
        import ipywidgets as w

        self._w = w
        self.actions = actions
        self.runs: list[CellRun] = [run]
        self.busy = False
        self.headline = w.HTML()
        self.bar = w.HTML()
        self.plot = w.Image(format="png", layout=w.Layout(max_width="760px"))
        self.plan = w.HTML()
        self.fix_row = w.HBox(layout=w.Layout(flex_flow="row wrap"))
        self.applied_row = w.HBox(layout=w.Layout(flex_flow="row wrap", align_items="center"))
        self.output = w.Output()
        self.findings = w.HTML()
        self.top = w.HTML()
        self.pick_a = w.Dropdown(description="", layout=w.Layout(width="24em"))
        self.pick_b = w.Dropdown(description="vs", layout=w.Layout(width="26em"))
        self.pick_a.observe(self._compare_picked, names="value")
        self.pick_b.observe(self._compare_picked, names="value")
        self.compare = w.HTML()
        self.compare_box = w.VBox(
            [
                w.HTML(block("<b>Side by side</b> — any two runs of this report")),
                w.HBox([self.pick_a, self.pick_b]),
                self.compare,
            ]
        )
        self.attempts = w.HTML()
        self.table = w.HTML()
        self.save = w.Button(
            description="Save snapshot",
            tooltip="write this run's allocator snapshot for PyTorch's viewer (pytorch.org/memory_viz)",
            layout=w.Layout(**BUTTON),
        )
        self.save.add_class("oommagic-save-snapshot")
        self.save.on_click(lambda b: self.save_snapshot())
        self.tools_output = w.Output()
        # The change the last fix made to the cell, folded: the notebook shows it, the kernel ran it.
        self.change = w.HTML()
        self.buttons: list[Any] = []
        self._fixes: dict[Any, Fix] = {}
        self.details = w.Accordion(
            children=[
                w.VBox(
                    [
                        self.findings,
                        self.top,
                        self.compare_box,
                        self.table,
                        w.HBox([self.save]),
                        self.tools_output,
                    ]
                )
            ],
            selected_index=None,
        )
        self.details.set_title(0, "Details: findings, largest allocations, figures")
        self.details.add_class("oommagic-details")
        self.root = w.VBox(
            [
                self.headline,
                self.bar,
                self.plan,
                self.fix_row,
                self.output,
                self.change,
                self.applied_row,
                self.attempts,
                self.plot,
                self.details,
            ],
            layout=w.Layout(max_width="1000px"),
        )
        self.root.add_class("oommagic-report")
        self.show(run)
        if hasattr(actions, "watch"):
            actions.watch(self._followed)

    def _followed(self, run: CellRun) -> None:
        """A run made elsewhere (the sidebar's Apply or ✕) from one of this report's runs: shown here
        too, so the report reads "fits" once the cell fits, wherever the click came from."""
        mine = {r.id for r in self.runs}
        if self.busy or run.id in mine or run.parent not in mine:
            return
        self.runs.append(run)
        self.show(run)
        if run.outcome == "ok":
            self.headline.value = _fitted_html(run, self._redefined(run))

    @property
    def latest(self) -> CellRun:
        return self.runs[-1]

    @property
    def fixes(self) -> list[Fix]:
        """The offered fixes of the run shown, in the plan's order (first = recommended)."""
        return offered(self.latest) if self.latest.outcome != "ok" else []

    def show(self, run: CellRun) -> None:
        w = self._w
        self.headline.value = headline_html(run)
        self.bar.value = block(bar_html(run))
        self.plot.value = timeline_png(run) if run.timeline.t else b""
        self.plot.layout.display = None if run.timeline.t else "none"
        self.plan.value = plan_html(run) if run.outcome == "oom" else ""
        self.findings.value = "".join(
            f"<div class='oommagic-finding' style='{_BLOCK}'>{finding_html(f, run.plan)}</div>"
            for f in run.findings
        )
        self.top.value = block(top_html(run))
        self.table.value = ranks_html(run) + figures_html(run)
        self.buttons, self._fixes = [], {}
        row = []
        if run.outcome == "oom":
            for i, fix in enumerate(offered(run)):
                button = w.Button(
                    description=label(fix.title),
                    tooltip=f"{fix.title}: {fix.line}" if fix.line else fix.title,
                    button_style="primary" if i == 0 and fix.verdict == FITS else "",
                    layout=w.Layout(**BUTTON),
                )
                button.add_class("oommagic-fix")
                button.add_class(f"oommagic-fix-{fix.kind.split('+')[-1].replace('_', '-')}")
                button.on_click(lambda b, f=fix, src=run: self.retry(b, src, f))
                row.append(button)
                self.buttons.append(button)
                self._fixes[button] = fix
            batch = next((r for f in run.findings for r in f.remedies if r.kind == "batch"), None)
            if batch is not None:
                name = batch.params["name"]
                search = w.Button(
                    description=f"Find the largest {name}",
                    tooltip=f"search the largest {name} that fits (probes, a fit, a check)",
                    layout=w.Layout(**BUTTON),
                )
                search.add_class("oommagic-find-batch")
                search.on_click(lambda b, src=run, n=name: self.find_batch(b, src, n))
                self.buttons.append(search)
                row.append(search)
        self.fix_row.children = row
        self.applied_row.children = self._applied(run)
        self.attempts.value = attempts_html(self.runs) if len(self.runs) > 1 else ""
        self._show_compare()
        take = getattr(self.actions, "snapshots", {}).get(run.id)
        self.save.layout.display = None if take is not None else "none"

    def _show_compare(self) -> None:
        """Two runs side by side once the widget holds two: the first that failed against the latest by
        default; the two pickers choose any two."""
        runs = [r for r in self.runs if r.categories is not None]
        if len(runs) < 2:
            self.compare_box.layout.display = "none"
            return
        self.compare_box.layout.display = None
        options = [(run_label(r, self.runs.index(r) + 1), self.runs.index(r)) for r in runs]
        first = next((self.runs.index(r) for r in runs if r.outcome == "oom"), options[0][1])
        self._picking = True
        self.pick_a.options, self.pick_b.options = options, options
        self.pick_a.value, self.pick_b.value = first, options[-1][1]
        self._picking = False
        self._compare_picked()

    _picking = False

    def _compare_picked(self, *_: Any) -> None:
        if self._picking or self.pick_a.value is None or self.pick_b.value is None:
            return
        a, b = self.runs[self.pick_a.value], self.runs[self.pick_b.value]
        self.compare.value = block(
            side_by_side_html(a, b, f"#{self.pick_a.value + 1}", f"#{self.pick_b.value + 1}", title=False)
        )

    def save_snapshot(self, path: str | None = None) -> Any:
        """Write the allocator snapshot of the run shown (``oommagic-snapshot-<id>.pickle`` here by
        default) for PyTorch's memory viewer; returns the path, or None when the run kept none. On CPU the
        snapshot is the tracker's, in the same format."""
        from ..run.capture.snapshot_file import write_snapshot

        run = self.latest
        take = getattr(self.actions, "snapshots", {}).get(run.id)
        snapshot = take() if take is not None else None
        with self.tools_output:
            self.tools_output.clear_output()
            if snapshot is None:
                print("this run kept no snapshot (--no-timeline on a run that did not fail)")
                return None
            where = write_snapshot(snapshot, path or f"oommagic-snapshot-{run.id}.pickle")
            print(f"snapshot written to {where}: open it at https://pytorch.org/memory_viz")
        return where

    def _applied(self, run: CellRun) -> list[Any]:
        """The fixes in force, each with a button that runs the cell again without it."""
        w = self._w
        if not run.applied:
            return []
        items: list[Any] = [w.HTML("<b>Fixes in force:</b>")]
        for i, remedy in enumerate(run.applied):
            undo = w.Button(
                description=f"✕ {label(remedy.title)}",
                tooltip=f"run without {remedy.title}",
                layout=w.Layout(**BUTTON),
            )
            undo.add_class("oommagic-remove-fix")
            undo.on_click(lambda b, i=i, src=run: self.remove(b, src, i))
            self.buttons.append(undo)
            items.append(undo)
        return items

    @contextlib.contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        """Hold every button down while a retry or a search runs."""
        self.busy = True
        for b in self.buttons:
            b.disabled = True
        try:
            yield
        finally:
            self.busy = False
            for b in self.buttons:
                b.disabled = False

    def _accepts(self, button: Any) -> bool:
        # Clicks queued while a retry ran arrive afterwards on buttons that are no longer shown.
        return not self.busy and button in self.buttons

    def retry(self, button: Any, run: CellRun, fix: Fix) -> None:
        """Run the cell with ``fix`` stacked on the fixes in force, into this widget's output area."""
        if not self._accepts(button):
            return
        self._act(lambda: self.actions.retry(run, fix.fixes), f"running with: {fix.title}", run, fix.fixes)

    def remove(self, button: Any, run: CellRun, index: int) -> None:
        """Run the cell again without the fix at ``index`` of ``run.applied``."""
        if not self._accepts(button):
            return
        self._act(
            lambda: self.actions.remove(run, index), f"running without: {run.applied[index].title}", run, ()
        )

    def _act(self, action: Any, what: str, run: CellRun, fixes: tuple[Remedy, ...]) -> None:
        new = None
        self.change.value = ""
        with self._one_at_a_time(), self.output:
            self.output.clear_output()
            print(what)
            try:
                new = action()
            except ValueError as err:
                print(err)
                return
            error = self.actions.pending_error(new)
            if error is not None and new.outcome == "error":
                print(f"the cell failed: {type(error).__name__}: {error}")
        self.runs.append(new)
        self.show(new)
        if new.outcome == "ok":
            self.output.clear_output()
            self.headline.value = _fitted_html(new, self._redefined(new))
            self.change.value = change_html(new)
            if fixes:
                from .. import comm

                # JupyterLab and Notebook 7 write the source that fitted into the notebook, and say so.
                comm.write_to_cell(new, on_written=self._written)

    def _redefined(self, run: CellRun) -> tuple[str, ...]:
        """The notebook functions ``run`` redefined (the kernel now runs the new ones)."""
        from ..diagnosis.write_back import cell_write

        root = self.runs[0]
        helpers = root.context.helpers if root.context is not None else ()
        return tuple(f.name for f in cell_write(run.source, run.original or run.source, helpers).functions)

    def _written(self, run_id: str) -> None:
        """The frontend wrote run ``run_id`` into the notebook: the report says so."""
        if self.latest.id == run_id and self.latest.outcome == "ok":
            self.headline.value = _fitted_html(self.latest, written=True)

    def find_batch(self, button: Any, run: CellRun, name: str) -> Any:
        """Search the largest ``name`` that fits (``%%gpumem --find-batch``) into the output area."""
        if not self._accepts(button):
            return None
        search = None
        with self._one_at_a_time(), self.output:
            search = self.actions.search(run, name)
            print(search.summary())
        return search

    def click(self, kind: str) -> CellRun:
        """Press the offered fix ``kind`` ("batch", "autocast", "checkpointing+batch", ...) as a person
        would; returns the new run. A kind offered only inside a combination presses that combination.
        Raises ``LookupError`` when no such fix is offered."""
        live = {b: f for b, f in self._fixes.items() if not b.disabled}
        match = next((b for b, f in live.items() if f.kind == kind), None)
        match = match or next((b for b, f in live.items() if kind in f.kind.split("+")), None)
        if match is None:
            offered_kinds = ", ".join(f.kind for f in live.values()) or "none"
            raise LookupError(f"no {kind!r} fix offered in this report; offered: {offered_kinds}")
        before = len(self.runs)
        match.click()
        if len(self.runs) == before:
            raise RuntimeError(f"the {kind} fix did not run (see the widget's output)")
        return self.runs[-1]

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = self.root._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = render_text(self.latest)
        return bundle


def change_html(run: CellRun) -> str:
    """What ``run``'s fixes changed in the cell as the person wrote it, as a folded diff (empty when they
    changed no text)."""
    written = run.original or run.source
    if run.source == written:
        return ""
    from ..diagnosis.rewrite import unified_diff

    diff = unified_diff(written, run.source)
    return block(
        "<details class='oommagic-change'><summary>What changed in the cell</summary>"
        f"<pre style='margin:0.2em 0 0 1em;font-size:0.9em'>{_esc(diff)}</pre></details>"
    )


def _fitted_html(run: CellRun, redefined: tuple[str, ...] = (), written: bool = False) -> str:
    """The headline of a run that fits after a fix, and whether the notebook says what the kernel ran:
    ``written`` once the frontend wrote it; else the names the kernel now holds rewritten."""
    extra = "".join(f"<div style='color:#555'>{_esc(x)}</div>" for x in fitted_lines(run)[1:])
    busy = f", GPU busy {run.gpu_busy:.0f}%" if run.gpu_busy is not None else ""
    if written:
        notebook = (
            " <span class='oommagic-written'>Written into the notebook: Ctrl+Z in a changed cell "
            "undoes it.</span>"
        )
    elif run.source != (run.original or run.source):
        one = len(redefined) == 1
        names = ", ".join(f"<code>{_esc(n)}</code>" for n in redefined)
        kernel = (
            f" In the kernel {names} {'is' if one else 'are'} now the rewritten {'one' if one else 'ones'}: "
            f"cells that call {'it' if one else 'them'} run the new code."
            if redefined
            else ""
        )
        notebook = (
            f" <span class='oommagic-not-written'>The cell still shows what you wrote.{kernel} The change to "
            "paste is under “What changed in the cell”.</span>"
        )
    else:
        notebook = ""
    return block(
        "<div class='oommagic-retry-ok' style='border-left:4px solid #2e7d32;padding:0.3em 0.6em'>"
        f"<b style='color:#2e7d32'>%%gpumem · fits</b> with {_esc(run.change or 'the cell as written')}: "
        f"peak {_esc(format_bytes(run.peak_reserved))} of {_esc(format_bytes(run.budget))}, headroom "
        f"{_esc(format_bytes(run.headroom))}{_esc(busy)}.{notebook}{extra}</div>"
    )


def label(title: str) -> str:
    """A button's label: each fix's title without its parenthesis or the word "steps" ("Batch 256 → 16,
    accumulate 16"); the tooltip carries the whole title."""
    return " + ".join(re.sub(r" steps$", "", part.split(" (")[0]) for part in title.split(" + "))
