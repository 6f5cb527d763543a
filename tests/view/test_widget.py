"""The report widget in a real IPython shell: buttons clicked as a person would (``Button.click()``)."""

from __future__ import annotations

import gc
import re
from dataclasses import replace

import pytest
import torch

import oommagic
from oommagic.cellrun import CellRun
from oommagic.diagnosis.findings import Remedy
from oommagic.oom import OOMReport
from oommagic.run.capture import LEDGER
from oommagic.run.fixes import spec_of
from oommagic.run.session import session_for
from oommagic.timeline import Recording
from oommagic.view.text import render_text
from oommagic.view.widget import ReportWidget

MiB = 1024**2

TRAIN = """%%gpumem --limit 24MiB -o failed
batch_size = 64
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(batch_size, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def drop_tensors(shell):
    held = [
        k
        for k, v in shell.user_ns.items()
        if isinstance(v, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer))
    ]
    for name in held:
        del shell.user_ns[name]
    shell.run_line_magic("reset", "-f out")
    gc.collect()


@pytest.fixture
def failed(shell, run_cell):
    # Each test starts from a namespace without the tensors of earlier cells (they would be leftovers).
    drop_tensors(shell)
    result, _ = run_cell(TRAIN)
    assert isinstance(result.error_in_exec, Exception)
    run = shell.user_ns["failed"]
    assert run.outcome == "oom"
    return run


def widget_for(shell, run):
    return ReportWidget(run, session_for(shell))


def checksum(model) -> float:
    return float(sum(p.detach().double().sum() for p in model.parameters()))


def test_the_first_offered_fix_is_measured_and_fits(shell, failed):
    widget = widget_for(shell, failed)
    assert "oommagic-report" in widget.root._dom_classes
    first = widget.fixes[0]
    assert first.verdict == "fits", [(f.kind, f.verdict, f.line) for f in widget.fixes]
    assert "Fix plan" in widget.plan.value and first.title in widget.plan.value
    retry = widget.click(first.kind)
    assert retry.outcome == "ok", retry.headline()
    assert retry.parent == failed.id and retry.applied == first.fixes
    assert retry.peak_reserved <= 24 * MiB
    assert "oommagic-retry-ok" in widget.headline.value and "fits" in widget.headline.value
    assert widget.fixes == [], "a report that fits offers no more fixes"
    assert len(widget.runs) == 2 and first.title in widget.attempts.value


def test_a_fix_applied_from_the_sidebar_turns_the_report_to_fits(shell, failed):
    widget = widget_for(shell, failed)
    first = widget.fixes[0]
    # What the sidebar's Apply does through the comm: the session retries the run it names.
    fitted = session_for(shell).retry(failed, first.fixes)
    assert fitted.outcome == "ok", fitted.headline()
    assert widget.runs[-1] is fitted and len(widget.runs) == 2
    assert "oommagic-retry-ok" in widget.headline.value and "fits" in widget.headline.value
    assert widget.fixes == []
    # A run of another cell is not this report's.
    other = session_for(shell).run(replace(spec_of(fitted), source="x = 1", parent=None, original=None))
    assert other not in widget.runs


def test_the_batch_fix_keeps_the_samples_per_optimizer_step(shell, failed):
    widget = widget_for(shell, failed)
    batch = next(f for f in widget.fixes if f.kind == "batch")
    remedy = batch.fixes[0]
    new, acc = remedy.params["new"], remedy.params["accumulate"]
    assert new * acc == 64 and acc > 1, remedy.title
    assert f"accumulate {acc} steps" in remedy.title
    retry = widget.click("batch")
    assert retry.outcome == "ok"
    # The loop itself divides the loss and steps the optimizer every `acc` micro-batches.
    assert f"(model(x).square().mean() / {acc}).backward()" in retry.source
    # The counter is `micro_step`, or with `_` added where an earlier accepted run left that name bound.
    assert (
        re.search(rf"\n    if (micro_step_*) % {acc} == 0:", retry.source)
        and f"range(2 * {acc})" in retry.source
    )
    assert len(retry.timeline.steps) == 2, "two optimizer steps, as the cell was written"


def test_fixes_stack_and_can_be_removed_one_by_one(shell, failed):
    session = session_for(shell)
    autocast = Remedy("autocast", "bfloat16 autocast", automatic=True, params={"dtype": "bfloat16"})
    first = session.retry(failed, autocast)  # not enough on its own under 24 MiB
    assert first.outcome == "oom" and first.applied == (autocast,)
    assert not torch.is_autocast_enabled("cpu"), "autocast is switched off again after the run"
    widget = widget_for(shell, first)
    assert "Fixes in force" in str([c.value for c in widget.applied_row.children if hasattr(c, "value")])
    second = widget.click(widget.fixes[0].kind)
    assert second.outcome == "ok" and second.applied[0] == autocast and len(second.applied) >= 2
    assert second.parent == first.id
    # Removing the autocast fix runs the cell again with the rest in force.
    without = session.remove(second, 0)
    assert [r.kind for r in without.applied] == [r.kind for r in second.applied[1:]]
    assert without.source == second.source, "the batch rewrite stays, autocast was only a setting"


def test_leftovers_are_listed_and_freed(shell, run_cell):
    drop_tensors(shell)
    run_cell("%%gpumem --quiet\nstale = torch.empty(80 * 2**20, dtype=torch.uint8)")
    before = LEDGER.allocated
    run_cell("%%gpumem --limit 96MiB --quiet -o failed\nfresh = torch.empty(32 * 2**20, dtype=torch.uint8)")
    failed = shell.user_ns["failed"]
    finding = next(f for f in failed.findings if f.key == "leftovers")
    assert "stale" in finding.evidence and "80.00 MiB" in finding.evidence
    widget = widget_for(shell, failed)
    assert widget.fixes[0].kind == "free_leftovers" and widget.fixes[0].verdict == "fits"
    assert "stale" in shell.user_ns, "the plan's trial freed nothing for good"
    retry = widget.click("free_leftovers")
    assert retry.outcome == "ok"
    assert "stale" not in shell.user_ns
    assert LEDGER.allocated <= before - 80 * MiB + 32 * MiB


def test_interrupt_during_a_retry_restores_every_setting(shell, failed):
    from dataclasses import replace

    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks = len(_global_optimizer_post_hooks)
    autocast = Remedy("autocast", "bfloat16 autocast", automatic=True, params={"dtype": "bfloat16"})
    stuck = replace(
        failed, source="x = torch.ones(4)\nassert torch.is_autocast_enabled('cpu')\nraise KeyboardInterrupt"
    )
    with pytest.raises(KeyboardInterrupt):
        session_for(shell).retry(stuck, autocast)
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_dispatch_stack() == 0
    assert torch._C._len_torch_function_stack() == 0
    assert len(_global_optimizer_post_hooks) == hooks
    assert LEDGER.listener is None
    assert oommagic.history()[-1].outcome == "interrupted"


def test_text_fallback_has_the_plan_figures_and_fixes(failed):
    text = render_text(failed)
    assert "OUT OF MEMORY" in text and "requested" in text and "fix plan:" in text
    assert failed.plan.entries[0].title in text


def test_hostile_message_is_escaped_in_html(shell):
    hostile = "CUDA out of memory. Tried to allocate 2.00 GiB <script>alert('x')</script> & <b>"
    run = CellRun(
        source="x = 1",
        recording=Recording(device="cpu"),
        outcome="oom",
        report=OOMReport(text=hostile, device="cuda"),
        error="<img src=x onerror=alert(1)>",
    )
    widget = widget_for(shell, run)
    html = widget.headline.value + widget.table.value
    assert "<script>" not in html and "<img" not in html
    from dataclasses import replace

    widget.show(replace(run, outcome="error"))
    assert "<img" not in widget.headline.value and "&lt;img" in widget.headline.value


def test_plain_text_form_of_the_widget_is_the_report(shell, failed):
    bundle = widget_for(shell, failed)._repr_mimebundle_()
    assert bundle["text/plain"] == render_text(failed)
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_clicking_a_fix_that_is_not_offered_says_what_is(shell, failed):
    with pytest.raises(LookupError, match="offered: "):
        widget_for(shell, failed).click("other_gpu")


def test_find_batch_button_searches_binds_the_answer_and_leaves_the_model(shell, failed):
    shell.run_cell("model = torch.nn.Linear(8, 8)\nopt = torch.optim.Adam(model.parameters())")
    model, opt = shell.user_ns["model"], shell.user_ns["opt"]
    before = checksum(model)
    widget = widget_for(shell, failed)
    button = next(b for b in widget.buttons if "oommagic-find-batch" in b._dom_classes)
    assert "batch_size" in button.description
    count = len(oommagic.history())
    button.click()
    best = shell.user_ns["batch_size"]
    assert 1 <= best < 64
    assert len(oommagic.history()) == count, "search trials are not runs of the notebook"
    assert shell.user_ns["model"] is model and shell.user_ns["opt"] is opt and checksum(model) == before
    assert opt.state == {} or len(opt.state) == 0
    assert not any(b.disabled for b in widget.buttons)


def test_the_report_after_a_failure_shows_its_plan_first_and_folds_the_details(shell, failed):
    widget = widget_for(shell, failed)
    order = list(widget.root.children)
    # Headline, memory bar, the plan and its buttons come before the timeline and the folded details.
    assert order.index(widget.fix_row) < order.index(widget.plot) < order.index(widget.details)
    assert widget.details.selected_index is None, "the details start folded"
    folded = widget.details.children[0].children
    assert widget.findings in folded and widget.table in folded and widget.top in folded
    # The plan's figures are said once, in its rows, not again in a sentence above them.
    assert widget.plan.value.count(widget.fixes[0].line) == 1
    for button in widget.buttons:
        assert "…" not in button.description and button.layout.width == "auto", button.description
    first = widget.buttons[0]
    assert first.tooltip.startswith(widget.fixes[0].title) and first.description in widget.fixes[0].title


def test_a_button_label_is_the_fix_without_its_parenthesis():
    from oommagic.view.widget import label

    assert label("Batch 256 → 16, accumulate 16 steps (effective batch 256, was 256)") == (
        "Batch 256 → 16, accumulate 16"
    )
    assert label("Gradient checkpointing + Batch 64 → 32") == "Gradient checkpointing + Batch 64 → 32"


def test_the_timeline_picture_ends_where_the_run_ended():
    from oommagic.timeline import Timeline
    from oommagic.view.plot import drawn

    tl = Timeline(t=(0.0, 0.1, 0.2, 0.6, 0.9), allocated=(1, 5, 9, 0, 0), reserved=(1, 5, 9, 0, 0))
    tl = replace(tl, steps=(0.05, 0.7), oom_at=0.2)
    shown = drawn(tl)
    assert shown.t == (0.0, 0.1, 0.2) and shown.allocated == (1, 5, 9) and shown.steps == (0.05,)
    assert drawn(replace(tl, oom_at=None)) == replace(tl, oom_at=None)
    # Raised a moment after its last allocation: the memory held then is drawn up to the error.
    late = drawn(replace(tl, oom_at=0.3))
    assert late.t == (0.0, 0.1, 0.2, 0.3) and late.allocated == (1, 5, 9, 9)
