"""The memory by category as people read it: a stacked bar against the budget, the largest allocations,
and two runs side by side, each as HTML (for the widget) and as plain lines (for the text report)."""

from __future__ import annotations

import html

from ..categories import LABELS, Breakdown, compare, compare_top
from ..cellrun import CellRun
from ..sizes import format_bytes

COLOURS = {
    "parameters": "#3b75af",
    "gradients": "#e1812c",
    "optimizer": "#8e44ad",
    "activations": "#3a923a",
    "kv_cache": "#c03d3e",
    "cache": "#9bb7d4",
    "outside": "#7f7f7f",
    "others": "#333333",
}
_FREE = "repeating-linear-gradient(45deg,#f3f3f3,#f3f3f3 4px,#e6e6e6 4px,#e6e6e6 8px)"
_ASKED = "box-sizing:border-box;border:2px dashed #c0392b;background:#fbeaea"
_MARKER = "position:absolute;top:-3px;bottom:-3px;"
_AT = {"failure": "at the failure", "peak": "at the peak", "end": "at the end"}


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def moment(run: CellRun) -> str:
    """'at the failure' / 'at the peak' / 'at the end'."""
    return _AT.get(run.categories.at, "") if run.categories is not None else ""


def _share(n: int, whole: int) -> str:
    return f"{n / whole:.0%}" if whole else "—"


def bar_html(run: CellRun, width_px: int = 760) -> str:
    """A stacked bar of ``run``'s categories against its budget, the free part in grey, with a legend."""
    bd = run.categories
    if bd is None:
        return ""
    asked = run.report.requested if run.outcome == "oom" and run.report is not None else None
    scale = max(bd.budget or 0, bd.total + (asked or 0), 1)
    cells = []
    for key, n in bd.nonzero():
        pct = 100 * n / scale
        label = f"{LABELS[key]} {format_bytes(n)}"
        cells.append(
            f"<div title='{_esc(label)}' style='width:{pct:.3f}%;background:{COLOURS[key]};"
            "height:100%'></div>"
        )
    # The request that did not fit starts where the held memory ends and runs past the budget's marker;
    # what stays free after it (a request that failed on fragmentation) is hatched.
    if asked:
        cells.append(
            f"<div title='requested {_esc(format_bytes(asked))}, did not fit' "
            f"style='width:{100 * asked / scale:.3f}%;height:100%;{_ASKED}'></div>"
        )
    free = (bd.budget or 0) - bd.total - (asked or 0)
    if free > 0:
        cells.append(
            f"<div title='free {_esc(format_bytes(free))}' style='width:{100 * free / scale:.3f}%;"
            f"height:100%;background:{_FREE}'></div>"
        )
    legend = "".join(
        f"<span style='margin-right:1.1em;white-space:nowrap'><span style='display:inline-block;width:0.8em;"
        f"height:0.8em;background:{COLOURS[key]};margin-right:0.3em;vertical-align:-0.05em'></span>"
        f"{_esc(LABELS[key])} <b>{_esc(format_bytes(n))}</b> <span style='color:#777'>"
        f"{_share(n, bd.total)}</span></span>"
        for key, n in bd.nonzero()
    )
    budget = f" of {format_bytes(bd.budget)}" if bd.budget else ""
    over = f"; the request of {format_bytes(asked)} that did not fit is dashed" if asked else ""
    head = (
        f"<div style='color:#555'><b style='color:#222'>Memory {_esc(moment(run))}</b>: "
        f"{_esc(format_bytes(bd.total))}{_esc(budget)}{_esc(over)}{_esc(_measured(bd))}</div>"
    )
    marker = ""
    if bd.budget and scale > bd.budget:
        marker = (
            f"<div title='budget {_esc(format_bytes(bd.budget))}' style='{_MARKER}"
            f"left:{100 * bd.budget / scale:.3f}%;border-left:2px solid #c0392b'></div>"
        )
    bar = (
        f"<div class='oommagic-bar' style='position:relative;display:flex;height:18px;max-width:{width_px}px;"
        f"border:1px solid #bbb;border-radius:3px;margin:0.25em 0'>{''.join(cells)}{marker}</div>"
    )
    return f"<div class='oommagic-categories'>{head}{bar}<div style='font-size:0.92em'>{legend}</div></div>"


def _measured(bd: Breakdown) -> str:
    return {
        "tracker": " (every tensor storage the CPU tracker holds)",
        "device": " (the device's used memory, NVML)",
        "allocator": " (reserved by PyTorch, plus memory outside it read at the end)",
        "residual": " (the device's used memory; outside PyTorch is the rest: NVML lists no figure for this "
        "process)",
    }.get(bd.measured, "")


def bar_text(run: CellRun) -> list[str]:
    """'memory at the failure: 12.02 MiB of 24.00 MiB' and one line per category."""
    bd = run.categories
    if bd is None:
        return []
    budget = f" of {format_bytes(bd.budget)}" if bd.budget else ""
    lines = [f"memory {moment(run)}: {format_bytes(bd.total)}{budget}"]
    width = max((len(LABELS[k]) for k, _ in bd.nonzero()), default=0)
    for key, n in bd.nonzero():
        lines.append(f"  {LABELS[key]:<{width}}  {format_bytes(n):>10}  {_share(n, bd.total):>4}")
    return lines


def top_html(run: CellRun, n: int = 8) -> str:
    """The largest live allocations, folded, the largest one named in the summary."""
    bd = run.categories
    if bd is None or not bd.top:
        return ""
    pad = "padding:0.1em 1.4em 0.1em 0"
    rows = "".join(
        f"<tr><td style='{pad};text-align:right'>{_esc(format_bytes(a.nbytes))}</td>"
        f"<td style='{pad};color:{COLOURS.get(a.category, '#555')}'>"
        f"{_esc(LABELS.get(a.category, a.category))}</td>"
        f"<td style='{pad}'><code>{_esc(a.name or a.op or '')}</code></td>"
        f"<td style='color:#555'>{_esc(a.line or '')}</td></tr>"
        for a in bd.top[:n]
    )
    first = bd.top[0]
    hint = "" if any(a.line for a in bd.top) else " (run with --stacks for the Python line of each)"
    return (
        f"<details class='oommagic-top'><summary>Largest allocations {_esc(moment(run))}: "
        f"{_esc(format_bytes(first.nbytes))} {_esc(first.what)}{_esc(hint)}</summary>"
        f"<table style='border-collapse:collapse;margin-top:0.2em'>{rows}</table></details>"
    )


def top_text(run: CellRun, n: int = 5) -> list[str]:
    bd = run.categories
    if bd is None or not bd.top:
        return []
    lines = [f"largest allocations {moment(run)}:"]
    for a in bd.top[:n]:
        lines.append(f"  {format_bytes(a.nbytes):>10}  {LABELS.get(a.category, a.category)}: {a.what}")
    return lines


def run_label(run: CellRun, number: int) -> str:
    """'#1 as written (out of memory)'."""
    outcome = {"ok": "fits", "oom": "out of memory"}.get(run.outcome, run.outcome)
    return f"#{number} {run.change or 'as written'} ({outcome})"


def side_by_side_html(a: CellRun, b: CellRun, label_a: str, label_b: str, title: bool = True) -> str:
    """Two runs by category and by their largest allocations, with the change from ``a`` to ``b``."""
    if a.categories is None or b.categories is None:
        return ""
    pad = "padding:0.1em 1.4em 0.1em 0;text-align:right"
    head = (
        f"<tr><th style='{pad};text-align:left'></th><th style='{pad}'>{_esc(label_a)}<br>"
        f"<span style='font-weight:normal;color:#777'>{_esc(moment(a))}</span></th>"
        f"<th style='{pad}'>{_esc(label_b)}<br><span style='font-weight:normal;color:#777'>"
        f"{_esc(moment(b))}</span></th><th style='{pad}'>change</th></tr>"
    )

    def rows(items: list, code: bool) -> str:
        out = []
        for r in items:
            colour = "#2e7d32" if r.delta < 0 else "#c0392b" if r.delta > 0 else "#555"
            label = f"<code>{_esc(r.label)}</code>" if code else _esc(r.label)
            weight = "font-weight:bold;" if r.label == "total" else ""
            out.append(
                f"<tr style='{weight}'><td style='padding:0.1em 1.4em 0.1em 0'>{label}</td>"
                f"<td style='{pad}'>{_esc(format_bytes(r.a))}</td>"
                f"<td style='{pad}'>{_esc(format_bytes(r.b))}</td>"
                f"<td style='{pad};color:{colour}'>{_esc(_signed(r.delta))}</td></tr>"
            )
        return "".join(out)

    by_cat = rows(compare(a.categories, b.categories), code=False)
    by_top = rows(compare_top(a.categories, b.categories), code=True)
    sep = "<tr><td colspan='4' style='padding-top:0.5em;color:#555'>largest allocations</td></tr>"
    return (
        f"<div class='oommagic-compare'>{'<b>Side by side</b>' if title else ''}"
        f"<table style='border-collapse:collapse;margin-top:0.2em'>{head}{by_cat}{sep}{by_top}</table></div>"
    )


def side_by_side_text(a: CellRun, b: CellRun, label_a: str, label_b: str) -> list[str]:
    if a.categories is None or b.categories is None:
        return []
    items = compare(a.categories, b.categories)
    width = max(len(r.label) for r in items)
    lines = [f"side by side: {label_a} {moment(a)} vs {label_b} {moment(b)}"]
    for r in items:
        lines.append(
            f"  {r.label:<{width}}  {format_bytes(r.a):>10}  {format_bytes(r.b):>10}  {_signed(r.delta):>11}"
        )
    return lines


def _signed(n: int) -> str:
    if n == 0:
        return "="
    return ("+" if n > 0 else "−") + format_bytes(abs(n))
