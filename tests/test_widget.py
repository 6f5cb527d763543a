"""The report widget in a real IPython shell: buttons clicked as a person would (``Button.click()``)."""

from __future__ import annotations

import gc

import pytest
import torch

import oommagic
from oommagic.capture import LEDGER
from oommagic.cellrun import CellRun
from oommagic.oom import OOMReport
from oommagic.remedies import Remedy
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


def test_batch_retry_rewrites_the_source_and_fits(shell, failed):
    widget = ReportWidget(failed, shell)
    assert "oommagic-report" in widget.root._dom_classes
    batch = [b for b in widget.buttons if "oommagic-fix-batch" in b._dom_classes]
    assert batch, [b.description for b in widget.buttons]
    retry = widget.click("batch")
    assert retry.outcome == "ok", retry.headline()
    assert retry.parent == failed.id
    assert "batch_size = 64" not in retry.source and "batch_size = " in retry.source
    assert retry.peak_reserved <= 24 * MiB
    ok = widget.result.children[0]
    assert "oommagic-retry-ok" in ok._dom_classes and "It fits" in ok.value
    assert all(b.disabled for b in widget.buttons), "a solved report offers no more retries"
    assert len(widget.runs) == 2 and "Batch 64" in widget.attempts.value


def test_a_retry_that_fails_again_shows_a_new_report_in_the_same_widget(shell, failed):
    widget = ReportWidget(failed, shell)
    shell.user_ns["torch"] = torch
    retry = widget.click("autocast")  # bf16 on CPU halves the activations, not enough under 24 MiB
    assert retry.outcome == "oom", retry.headline()
    assert not torch.is_autocast_enabled("cpu"), "autocast is switched off again after the retry"
    assert widget.latest is retry and [r.id for r in widget.runs] == [failed.id, retry.id]
    assert retry.parent == failed.id and retry.findings, "the new report has its own diagnosis"
    assert "oommagic-retry-ok" not in str([c._dom_classes for c in widget.result.children])
    # The new report's buttons work in the same widget; each further retry builds on the last report.
    chain = [retry]
    while chain[-1].outcome == "oom" and len(chain) < 4:
        chain.append(widget.click("batch"))
    assert chain[-1].outcome == "ok", [r.headline() for r in chain]
    assert [r.parent for r in chain[1:]] == [r.id for r in chain[:-1]]


def test_leftovers_are_listed_and_freed(shell, run_cell):
    run_cell("%%gpumem --quiet\nstale = torch.empty(80 * 2**20, dtype=torch.uint8)")
    before = LEDGER.allocated
    run_cell("%%gpumem --limit 96MiB --quiet -o failed\nfresh = torch.empty(32 * 2**20, dtype=torch.uint8)")
    failed = shell.user_ns["failed"]
    finding = next(f for f in failed.findings if f.key == "leftovers")
    assert "stale" in finding.evidence and "80.00 MiB" in finding.evidence
    widget = ReportWidget(failed, shell)
    retry = widget.click("free_leftovers")
    assert retry.outcome == "ok"
    assert "stale" not in shell.user_ns
    assert LEDGER.allocated <= before - 80 * MiB + 32 * MiB


def test_interrupt_during_a_retry_restores_every_setting(shell, failed):
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks = len(_global_optimizer_post_hooks)
    widget = ReportWidget(failed, shell)
    autocast = Remedy("autocast", "bfloat16 autocast", automatic=True, params={"dtype": "bfloat16"})
    failed.source = "x = torch.ones(4)\nassert torch.is_autocast_enabled('cpu')\nraise KeyboardInterrupt"
    widget.retry(
        widget.buttons[0], failed, autocast
    )  # the output area shows the interrupt; the kernel goes on
    assert not torch.is_autocast_enabled("cpu")
    assert torch._C._len_torch_dispatch_stack() == 0
    assert len(_global_optimizer_post_hooks) == hooks
    assert LEDGER.listener is None
    assert not widget.busy and not any(b.disabled for b in widget.buttons)
    assert oommagic.history()[-1].outcome == "interrupted"


def test_text_fallback_has_the_figures_and_fixes(failed):
    text = render_text(failed)
    assert "OUT OF MEMORY" in text and "requested" in text and "fix: Batch 64 → 16" in text


def test_hostile_message_is_escaped_in_html(shell):
    hostile = "CUDA out of memory. Tried to allocate 2.00 GiB <script>alert('x')</script> & <b>"
    run = CellRun(
        source="x = 1",
        device="cpu",
        outcome="oom",
        report=OOMReport(text=hostile, device="cuda"),
        error="<img src=x onerror=alert(1)>",
    )
    widget = ReportWidget(run, shell)
    html = widget.headline.value + widget.table.value
    assert "<script>" not in html and "<img" not in html
    run.outcome = "error"
    widget.show(run)
    assert "<img" not in widget.headline.value and "&lt;img" in widget.headline.value


def test_plain_text_form_of_the_widget_is_the_report(shell, failed):
    bundle = ReportWidget(failed, shell)._repr_mimebundle_()
    assert bundle["text/plain"] == render_text(failed)
    assert "application/vnd.jupyter.widget-view+json" in bundle


def test_clicking_a_fix_that_is_not_offered_says_what_is(shell, failed):
    with pytest.raises(LookupError, match="offered: "):
        ReportWidget(failed, shell).click("other_gpu")


def test_find_batch_button_searches_and_binds_the_batch_that_fits(shell, failed):
    widget = ReportWidget(failed, shell)
    button = next(b for b in widget.buttons if "oommagic-find-batch" in b._dom_classes)
    assert "batch_size" in button.description
    count = len(oommagic.history())
    button.click()
    best = shell.user_ns["batch_size"]
    assert 1 <= best < 64
    assert len(oommagic.history()) == count, "search trials are not runs of the notebook"
    assert not any(b.disabled for b in widget.buttons)
