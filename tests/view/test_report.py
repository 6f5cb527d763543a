"""The report reads at a glance: a one-line headline, the memory by category against the budget, the fix
plan and its buttons, the timeline, and folded the findings, the largest allocations, two runs side by
side and the figures; the text form in the same order. A real shell, a real CPU out-of-memory error,
buttons clicked."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from oommagic.categories import Breakdown
from oommagic.cellrun import CellRun
from oommagic.diagnosis.findings import Remedy
from oommagic.run.session import session_for
from oommagic.timeline import Recording
from oommagic.view.text import render_text
from oommagic.view.widget import ReportWidget

MiB = 1024**2

TRAIN = """%%gpumem --limit 24MiB --plan-budget 20 --quiet --no-raise -o failed
batch_size = 64
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(batch_size, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


@pytest.fixture
def failed(shell, run_cell):
    for name in [k for k, v in shell.user_ns.items() if isinstance(v, (torch.Tensor, torch.nn.Module))]:
        del shell.user_ns[name]
    shell.run_line_magic("reset", "-f out")
    gc.collect()
    run_cell(TRAIN)
    run = shell.user_ns["failed"]
    assert run.outcome == "oom" and run.categories is not None
    return run


def shown(widget) -> list:
    return [c for c in widget.root.children if getattr(c.layout, "display", None) != "none"]


def test_report_reads_headline_bar_plan_timeline_then_details_folded(shell, failed):
    widget = ReportWidget(failed, session_for(shell))
    order = shown(widget)
    assert order.index(widget.headline) < order.index(widget.bar) < order.index(widget.plan)
    assert order.index(widget.plan) < order.index(widget.fix_row) < order.index(widget.plot)
    assert order.index(widget.plot) < order.index(widget.details) and widget.details.selected_index is None
    folded = list(widget.details.children[0].children)
    assert folded.index(widget.findings) < folded.index(widget.top) < folded.index(widget.table)
    bar = widget.bar.value
    assert "Memory at the failure" in bar and "of 24.00 MiB" in bar
    assert "parameters" in bar and "activations &amp; temporaries" in bar
    assert "did not fit" in bar, "the refused request is drawn against the budget"
    assert "<details class='oommagic-figures'>" in widget.table.value, "figures folded (no open attribute)"
    assert widget.compare_box.layout.display == "none", "one run: nothing to put side by side"


def test_finding_code_spans_render_as_code_and_no_backtick_is_left(shell, failed):
    widget = ReportWidget(failed, session_for(shell))
    evidence = [f.evidence for f in failed.findings if "`" in f.evidence]
    assert evidence, "a finding of this cell quotes code (`--limit`)"
    html = widget.findings.value + widget.plan.value
    assert "`" not in html
    assert "<code>--limit</code>" in html


def test_buttons_are_of_one_size(shell, failed):
    widget = ReportWidget(failed, session_for(shell))
    sizes = {(b.layout.width, b.layout.height) for b in [*widget.buttons, widget.save]}
    assert len(sizes) == 1 and None not in next(iter(sizes))


def test_a_retry_puts_the_two_runs_side_by_side_and_any_two_can_be_picked(shell, failed):
    widget = ReportWidget(failed, session_for(shell))
    retry = widget.click(widget.fixes[0].kind)
    assert retry.outcome == "ok"
    assert widget.compare_box.layout.display is None
    assert (widget.pick_a.value, widget.pick_b.value) == (0, 1)
    table = widget.compare.value
    assert "at the failure" in table and "at the peak" in table and "total" in table
    assert table.count("<tr") >= 4, "the categories and the largest allocations of both runs, row by row"
    widget.pick_a.value, widget.pick_b.value = 1, 0
    assert widget.compare.value.index("#2") < widget.compare.value.index("#1")
    assert "<td" in widget.attempts.value and "peak reserved" in widget.attempts.value


def test_save_snapshot_writes_what_memory_viz_reads(shell, failed, tmp_path, monkeypatch):
    from torch.cuda import _memory_viz

    monkeypatch.chdir(tmp_path)
    widget = ReportWidget(failed, session_for(shell))
    assert widget.save.layout.display is None
    widget.save.click()
    written = tmp_path / f"oommagic-snapshot-{failed.id}.pickle"
    with written.open("rb") as f:
        snap = pickle.load(f)
    assert sum(s["total_size"] for s in snap["segments"]) == failed.categories.total
    assert "segments" in _memory_viz.segsum(snap)


def test_text_form_keeps_the_widget_order(failed):
    lines = render_text(failed).splitlines()

    def at(prefix: str) -> int:
        return next(i for i, line in enumerate(lines) if line.startswith(prefix))

    assert at("%%gpumem [OUT OF MEMORY]") == 0
    assert (
        at("memory at the failure:") < at("fix plan:") < at("- ") < at("largest allocations") < at("figures:")
    )
    assert any(line.strip().startswith("parameters") and "MiB" in line for line in lines)


def test_json_carries_the_categories_the_sidebar_draws(failed):
    data = failed.to_json()
    cats = data["categories"]
    assert cats["at"] == "failure" and cats["measured"] == "tracker"
    assert sum(cats["bytes"].values()) == cats["total"] == failed.report.allocated
    assert cats["order"][0] == "parameters" and cats["labels"]["kv_cache"] == "KV cache"
    assert cats["top"][0]["bytes"] >= cats["top"][-1]["bytes"] and "what" in cats["top"][0]
    assert Breakdown.from_json(cats) == failed.categories
    assert data["gpu_busy"] is None and data["under_use"] is None


def test_a_batch_fix_that_cut_too_deep_is_said_after_the_run_that_fits():
    batch = Remedy(
        "batch", "Batch 64 → 8", automatic=True, params={"name": "batch_size", "new": 8, "old": 64}
    )
    cats = Breakdown(
        at="peak",
        parts=(("parameters", 10 * MiB), ("optimizer", 20 * MiB), ("activations", 8 * MiB)),
        measured="tracker",
        budget=100 * MiB,
    )
    run = CellRun(
        source="train()",
        recording=Recording(device="cpu", peak_allocated=38 * MiB, peak_reserved=38 * MiB, limit=100 * MiB),
        applied=(batch,),
        categories=cats,
    )
    # 1 MiB of activations per sample and 30 MiB that does not grow: 70 samples fit in 100 MiB.
    assert "about 70 would still fit" in run.under_use()
    assert "about 70 would still fit" in render_text(run)
    snug = CellRun(
        source="train()",
        recording=run.recording,
        applied=(batch,),
        categories=Breakdown(
            at="peak",
            parts=(("parameters", 30 * MiB), ("activations", 60 * MiB)),
            measured="tracker",
            budget=100 * MiB,
        ),
    )
    assert snug.under_use() is None
