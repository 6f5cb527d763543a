"""The report widget: headline, figures, timeline, findings with fix buttons, retries and attempts.

The widget is a view of ``CellRun`` records; a retry makes a new ``CellRun`` (``parent`` = the run it
retried) and the widget shows the latest one. Message text is escaped wherever it reaches HTML.
"""

from __future__ import annotations

import contextlib
import html
from collections.abc import Iterator
from typing import Any

from ..cellrun import CellRun
from ..sizes import format_bytes
from .plot import timeline_png
from .text import figures, render_text

_STATUS = {
    "ok": ("ok", "#2e7d32"),
    "oom": ("out of memory", "#c0392b"),
    "error": ("error", "#c0392b"),
    "interrupted": ("interrupted", "#888"),
}


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def headline_html(run: CellRun) -> str:
    label, colour = _STATUS[run.outcome]
    return (
        f"<div style='font-size:1.05em'><b style='color:{colour}'>%%gpumem · {label}</b> — "
        f"{_esc(run.headline())}</div>"
    )


def figures_html(run: CellRun) -> str:
    cells = "".join(
        f"<tr><td style='padding:0 1em 0 0;color:#555'>{_esc(k)}</td><td><code>{_esc(v)}</code></td></tr>"
        for k, v in figures(run)
    )
    return f"<table class='oommagic-figures' style='border-collapse:collapse'>{cells}</table>"


def finding_html(finding: Any) -> str:
    saving = f" — saves ~{format_bytes(finding.saving)}" if finding.saving else ""
    parts = [
        f"<div><b>{_esc(finding.title)}</b>{_esc(saving)}</div>",
        f"<div style='color:#444'>{_esc(finding.evidence)}</div>",
    ]
    for remedy in finding.remedies:
        parts.append(
            f"<div style='margin-top:0.3em'>• <b>{_esc(remedy.title)}</b>: {_esc(remedy.explanation)}</div>"
        )
        if remedy.code:
            parts.append(f"<pre style='margin:0.2em 0 0 1em;font-size:0.9em'>{_esc(remedy.code)}</pre>")
    return "".join(parts)


def attempts_html(runs: list[CellRun]) -> str:
    rows = "".join(
        f"<tr><td>{i}</td><td>{_esc(r.change or 'as written')}</td><td>{_esc(_STATUS[r.outcome][0])}</td>"
        f"<td>{_esc(format_bytes(r.peak_allocated))}</td><td>{r.wall_s:.2f} s</td></tr>"
        for i, r in enumerate(runs, 1)
    )
    head = "<tr><th>#</th><th>change</th><th>outcome</th><th>peak</th><th>time</th></tr>"
    return f"<table class='oommagic-attempts'>{head}{rows}</table>"


class ReportWidget:
    """The widget for one cell and its retries. ``display()`` it; its plain-text form is the text report."""

    def __init__(self, run: CellRun, shell: Any) -> None:
        import ipywidgets as w

        self._w = w
        self.shell = shell
        self.runs: list[CellRun] = [run]
        self.busy = False
        self.solved = False
        self.headline = w.HTML()
        self.table = w.HTML()
        self.plot = w.Image(format="png", layout=w.Layout(max_width="720px"))
        self.findings = w.VBox()
        self.output = w.Output()
        self.result = w.VBox()
        self.attempts = w.HTML()
        self.buttons: list[Any] = []
        self._remedies: dict[Any, Any] = {}
        self.root = w.VBox(
            [self.headline, self.table, self.plot, self.findings, self.output, self.result, self.attempts]
        )
        self.root.add_class("oommagic-report")
        self.show(run)

    @property
    def latest(self) -> CellRun:
        return self.runs[-1]

    def show(self, run: CellRun) -> None:
        w = self._w
        self.headline.value = headline_html(run)
        self.table.value = figures_html(run)
        self.plot.value = timeline_png(run) if run.timeline.t else b""
        self.buttons = []
        self._remedies = {}
        boxes = []
        for finding in run.findings:
            row = []
            for remedy in finding.remedies:
                if not remedy.automatic:
                    continue
                button = w.Button(
                    description=_short(remedy.title), tooltip=remedy.title, layout=w.Layout(width="auto")
                )
                button.add_class("oommagic-fix")
                button.add_class(f"oommagic-fix-{remedy.kind.replace('_', '-')}")
                button.on_click(lambda b, r=remedy, src=run: self.retry(b, src, r))
                row.append(button)
                self.buttons.append(button)
                self._remedies[button] = remedy
            boxes.append(w.VBox([w.HTML(finding_html(finding)), w.HBox(row)]))
        batch = next((r for f in run.findings for r in f.remedies if r.kind == "batch"), None)
        if batch is not None and run.outcome == "oom":
            name = batch.params["name"]
            search = w.Button(description=f"Find the largest {name} that fits", layout=w.Layout(width="auto"))
            search.add_class("oommagic-find-batch")
            search.on_click(lambda b, src=run, n=name: self.find_batch(b, src, n))
            self.buttons.append(search)
            boxes.append(search)
        self.findings.children = boxes
        self.attempts.value = attempts_html(self.runs) if len(self.runs) > 1 else ""

    @contextlib.contextmanager
    def _one_at_a_time(self) -> Iterator[None]:
        """Hold every button down while a retry or a search runs; they come back up afterwards unless
        a retry solved the cell (``_after_retry`` decides)."""
        self.busy = True
        for b in self.buttons:
            b.disabled = True
        try:
            yield
        finally:
            self.busy = False
            if not self.solved:
                for b in self.buttons:
                    b.disabled = False

    def _accepts(self, button: Any) -> bool:
        # Clicks queued while a retry ran arrive afterwards on buttons that are no longer shown.
        return not (self.busy or self.solved) and button in self.buttons

    def retry(self, button: Any, run: CellRun, remedy: Any) -> None:
        """Re-run the cell with ``remedy`` into this widget's output area; one retry at a time."""
        if not self._accepts(button):
            return
        from .. import comm
        from ..retry import spec_for
        from ..runner import execute

        new = None
        with self._one_at_a_time():
            with self.output:
                print(f"retrying with: {remedy.title}")
                if remedy.new_source:
                    from ..rewrite import unified_diff

                    print(unified_diff(run.source, remedy.new_source))
                try:
                    spec = spec_for(run, remedy, self.shell)
                except ValueError as err:
                    print(err)
                    return
                new = execute(self.shell, spec)
                new.cell_id = run.cell_id
                new.execution_count = run.execution_count
                comm.publish(new)
            if new is not None:
                self.runs.append(new)
                self._after_retry(new, remedy)

    def find_batch(self, button: Any, run: CellRun, name: str) -> Any:
        """Search the largest ``name`` that fits (``%%gpumem --find-batch``) into the output area."""
        if not self._accepts(button):
            return None
        from ..batch_search import find_batch_magic
        from ..runner import RunSpec

        search = None
        with self._one_at_a_time(), self.output:
            spec = RunSpec(
                source=run.source,
                device=run.options.get("device") or run.device,
                limit=run.limit,
                options=dict(run.options),
            )
            search = find_batch_magic(self.shell, spec, name)
            print(search.summary())
        return search

    def _after_retry(self, new: CellRun, remedy: Any) -> None:
        w = self._w
        if new.outcome == "ok":
            self.solved = True
            for b in self.buttons:
                b.disabled = True
            keep = remedy.new_source or remedy.code or ""
            ok = w.HTML(
                f"<div style='border-left:4px solid #2e7d32;padding:0.3em 0.6em'><b>It fits</b> with "
                f"{_esc(remedy.title)}: peak {_esc(format_bytes(new.peak_allocated))} allocated, "
                f"{_esc(format_bytes(new.peak_reserved))} reserved, headroom "
                f"{_esc(format_bytes(new.headroom))}. Keep this change:"
                f"<pre>{_esc(keep)}</pre></div>"
            )
            ok.add_class("oommagic-retry-ok")
            self.result.children = (ok,)
            self.attempts.value = attempts_html(self.runs)
        else:
            self.show(new)

    def click(self, kind: str) -> CellRun:
        """Press the fix button of remedy ``kind`` ("batch", "autocast", ...), as a person would; returns
        the retry's run. Raises ``LookupError`` when no such button is offered."""
        for button, remedy in self._remedies.items():
            if remedy.kind == kind and not button.disabled:
                before = len(self.runs)
                button.click()
                if len(self.runs) == before:
                    raise RuntimeError(f"the {kind} retry did not run (see the widget's output)")
                return self.runs[-1]
        offered = sorted({r.kind for b, r in self._remedies.items() if not b.disabled})
        raise LookupError(f"no enabled {kind!r} fix in this report; offered: {', '.join(offered) or 'none'}")

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        bundle = self.root._repr_mimebundle_(**kwargs)
        bundle["text/plain"] = render_text(self.latest)
        return bundle


def _short(title: str, width: int = 48) -> str:
    return title if len(title) <= width else title[: width - 1] + "…"
