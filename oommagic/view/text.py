"""The plain-text report: what terminal IPython, nbconvert and anything without widgets shows."""

from __future__ import annotations

import re
import textwrap

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


# Screen budget of the report after a failure (the quickstart's cell fits 30 lines at 100 columns): the
# first entry's diff gets this many lines, the others fewer; the rest of a rewrite is counted, not shown.
FIRST_DIFF_LINES = 4
OTHER_DIFF_LINES = 2
WIDTH = 100


def fix_command(number: int) -> str:
    """The line magic that runs plan entry ``number`` (1-based, as the report numbers them)."""
    return f"%gpumem --fix {number}"


def short_diff(old: str, new: str, limit: int = FIRST_DIFF_LINES) -> list[str]:
    """The change from ``old`` to ``new`` in at most ``limit`` lines (``- old`` / ``+ new``): a changed line
    beside the line that replaces it first, then the lines added or removed; blank and comment lines left
    out; the rest counted ('… 12 more lines')."""
    import difflib

    def shown(lines: list[str]) -> list[str]:
        return [x.strip() for x in lines if x.strip() and not x.lstrip().startswith("#")]

    a, b = old.splitlines(), new.splitlines()
    paired: list[str] = []
    rest: list[str] = []
    for op, i1, i2, j1, j2 in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes():
        if op == "equal":
            continue
        added = shown(b[j1:j2])
        for line in shown(a[i1:i2]):
            # The added line most like a removed one replaces it ('batch_size = 256' → '= 16').
            match = max(added, key=lambda x: difflib.SequenceMatcher(a=line, b=x).ratio(), default=None)
            if match is not None and difflib.SequenceMatcher(a=line, b=match).ratio() >= 0.6:
                paired += [f"- {line}", f"+ {match}"]
                added.remove(match)
            else:
                rest.append(f"- {line}")
        rest += [f"+ {x}" for x in added]
    lines = paired + rest
    if len(lines) <= limit:
        return lines
    return [*lines[: limit - 1], f"… {len(lines) - limit + 1} more lines"]


def _clip(line: str, width: int = WIDTH) -> str:
    return line if len(line) <= width else line[: width - 1] + "…"


def plan_lines(run: CellRun) -> list[str]:
    """The fix plan: what was measured and how, then each entry with its verdict; an entry a retry can run
    with the command that runs it and its change to the cell as a short diff."""
    from ..diagnosis.plan import DOES_NOT_FIT

    plan = run.plan
    lines = [f"fix plan: {plan.summary}"]
    if plan.unfittable:
        lines.append(f"  {plan.unfittable}")
    for i, e in enumerate(plan.entries, 1):
        lines.append(f"  {i}. {e.title}: {e.line()}")
        if e.verdict == DOES_NOT_FIT or not all(r.automatic for r in e.fixes):
            continue
        source = next((r.new_source for r in e.fixes if r.new_source), None)
        diff = (
            short_diff(run.source, source, FIRST_DIFF_LINES if i == 1 else OTHER_DIFF_LINES) if source else []
        )
        held = "" if source else " (a setting held while the cell runs; its text stays)"
        lines.append(f"     {fix_command(i)} runs it{held}{':' if diff else ''}")
        lines += [_clip(f"       {d}") for d in diff]
    return lines


def finding_lines(run: CellRun, findings: int = 5) -> list[str]:
    """The findings, each with the fixes the plan does not already list (said once, in the plan)."""
    plan = run.plan
    in_plan = {r.kind for e in plan.entries for r in e.fixes} if plan is not None else set()
    lines = []
    for f in run.findings[:findings]:
        # A title the evidence's first sentence already says ('The limit ran out, not the card') is said
        # once.
        first = f.evidence.split(". ", 1)[0].lower()
        said = set(re.findall(r"[a-z]+", f.title.lower())) <= set(re.findall(r"[a-z]+", first))
        lines.append(f"- {f.evidence}" if said else f"- {f.title}: {f.evidence}")
        others = [r for r in f.remedies[:3] if r.kind not in in_plan]
        label = "also" if in_plan else "fix"
        lines += [f"    {label}: {remedy_line(r, plan)}" for r in others]
    return lines


def figure_lines(run: CellRun, folded: bool) -> list[str]:
    """The figures: a table, or folded into a few lines of 'label value' pairs after a failure."""
    rows = figures(run)
    if not folded:
        width = max(len(label) for label, _ in rows)
        return ["figures:"] + [f"  {label:<{width}}  {value}" for label, value in rows]
    # Figures of the same value are said once, their labels together ('capacity, limit 3.00 MiB').
    same: dict[str, list[str]] = {}
    for label, value in rows:
        same.setdefault(value, []).append(label)
    return textwrap.wrap(
        "figures: " + " · ".join(f"{', '.join(labels)} {value}" for value, labels in same.items()),
        WIDTH,
        subsequent_indent="  ",
        break_on_hyphens=False,
    )


def render_text(run: CellRun, findings: int = 5) -> str:
    """The report as plain text, in the widget's order: headline, memory by category, the fix plan with
    the command and the change of each entry, the findings, the largest allocations, the figures (folded
    after a failure, so the report fits a screen)."""
    from .categories import bar_text, top_text

    status = {"ok": "ok", "oom": "OUT OF MEMORY", "error": "error", "interrupted": "interrupted"}[run.outcome]
    lines = [f"%%gpumem [{status}] {run.headline()}"]
    if run.applied:
        lines.append(f"  fixes in force: {run.change}")
    lines += [f"  {line}" for line in fitted_lines(run)]
    lines += bar_text(run)
    failed = run.outcome == "oom"
    if run.plan is not None and run.plan.entries and failed:
        lines += plan_lines(run)
    lines += rank_lines(run)
    lines += finding_lines(run, findings)
    lines += top_text(run, 3 if failed else 5)
    lines += figure_lines(run, folded=failed)
    if run.timeline.truncated:
        lines.append("  (the timeline lost its earliest events: the cell made more than the trace keeps)")
    if run.options.no_timeline:
        lines.append("  (--no-timeline: no timeline between the start and the end; the peak is exact)")
    lines += differs_lines(run)
    return "\n".join(lines)


# --- after a fix no frontend wrote into the cell -----------------------------------------------------------

# Fixes whose whole effect is held while the run executes (a setting): the cell as written runs without it.
_HELD = {"autocast", "expandable_segments", "empty_cache", "checkpointing", "quantize"}


def _top_level(source: str) -> tuple[dict[str, str], dict[str, str]]:
    """(functions and classes the cell defines → their text, names it assigns once → the value's text)."""
    import ast

    from ..diagnosis.source import tree_of

    tree = tree_of(source)
    defs: dict[str, str] = {}
    values: dict[str, str] = {}
    for node in tree.body if tree is not None else ():
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defs[node.name] = ast.unparse(node)
        elif (
            isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        ):
            values[node.targets[0].id] = ast.unparse(node.value)
    return defs, values


def _effect(remedy) -> str:
    """What a rewritten function now does, in the words of the fix ('16 micro-batches of 16 per optimizer
    step')."""
    p = remedy.params
    if remedy.kind == "batch" and p.get("where") == "rows":
        return f"each step runs on {p['accumulate']} micro-batches of {p['new']} rows"
    if remedy.kind == "batch" and p.get("accumulate", 1) > 1:
        return f"cells that call it run {p['accumulate']} micro-batches of {p['new']} per optimizer step"
    return f"cells that call it run with {remedy.title}"


def kernel_differences(run: CellRun) -> list[str]:
    """The names in the kernel that the fixes in force made differ from the cell as it was written (a
    function redefined at the top of the cell, a value rebound), and the settings held for that run only."""
    original = run.original or run.source
    old_defs, old_values = _top_level(original)
    new_defs, new_values = _top_level(run.source)
    rewritten = [r for r in run.applied if r.new_source]
    notes: list[str] = []
    named: set[str] = set()
    for name, text in new_defs.items():
        if old_defs.get(name) != text:
            what = "; ".join(dict.fromkeys(_effect(r) for r in rewritten)) or "as the fix wrote it"
            notes.append(f"`{name}` is the rewritten one: {what}")
            named.add(name)
    for name, text in new_values.items():
        if name in old_values and old_values[name] != text:
            notes.append(f"`{name}` is now {text} (the cell says {old_values[name]})")
            named.add(name)
    for r in run.applied:
        p = r.params
        if (
            r.kind == "batch"
            and p.get("where") in ("namespace", "option", "attribute")
            and p["name"] not in named
        ):
            notes.append(f"`{p['name']}` is now {p['new']} (was {p['old']})")
            if p.get("accumulation"):
                path, old, new = p["accumulation"]
                notes.append(f"`{path}` is now {new} (was {old})")
            notes += [f"`{path}` is now {new} (was {old})" for path, old, new in p.get("mirrors", [])]
        elif r.kind == "batch" and p.get("where") == "loader":
            loader = p["path"][0]
            notes.append(
                f"`{loader}` is now a DataLoader of the same data with batch_size={p['new']} (was {p['old']})"
            )
        elif r.kind in _HELD and not r.new_source:
            notes.append(f"{r.title} was held for those runs only: the cell as written runs without it")
    return notes


def paste_code(run: CellRun) -> str:
    """The code that makes the notebook say what ran: the values a fix rebound in the kernel (set before the
    cell), the rewritten cell, and each held setting's own snippet."""
    rebound: list[str] = []
    held: list[str] = []
    for r in run.applied:
        p = r.params
        if r.kind == "batch" and p.get("where") in ("namespace", "option", "attribute"):
            rebound.append(f"{p['name']} = {p['new']}")
            if p.get("accumulation"):
                rebound.append(f"{p['accumulation'][0]} = {p['accumulation'][2]}")
            rebound += [f"{path} = {new}" for path, _, new in p.get("mirrors", [])]
        elif not r.new_source and r.code:
            held.append(r.code.rstrip())
    parts = ["\n".join(rebound)] if rebound else []
    if run.original is not None and run.source != run.original:
        parts.append(run.source.rstrip())
    return "\n\n".join(parts + held)


def differs_lines(run: CellRun) -> list[str]:
    """After fixes in force (``%gpumem --fix``, a button, where no frontend wrote the cell): which names in
    the kernel now differ from the cell's text, and the code to paste into the cell so that they agree."""
    if not run.applied:
        return []
    notes = kernel_differences(run)
    if not notes:
        return []
    lines = ["the kernel now differs from the cell as written:", *(f"  {n}" for n in notes)]
    # The code that ran is worth pasting once it fits; after a retry that failed, the next fix comes first.
    code = paste_code(run) if run.outcome == "ok" else ""
    if code:
        lines.append("paste into the cell what ran, so that the notebook and the kernel agree:")
        lines += [f"    {line}" if line else "" for line in code.splitlines()]
    return lines
