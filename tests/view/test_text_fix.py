"""The text report of a quickstart-like cell that runs out of memory, in a real IPython shell (CPU mode):
it fits a screen, says each thing once, shows each plan entry's change and the command that runs it; the
trials' progress lines end with their results; ``%gpumem --fix`` runs an entry as the button does and
then says which names in the kernel differ from the cell as written."""

from __future__ import annotations

import re
import textwrap

import pytest
from IPython.core.error import UsageError

import oommagic
from oommagic.magics import chosen_fix
from oommagic.view.text import render_text, short_diff

FITS = "%%gpumem --device cpu --quiet -o fits\nmodel = make_model()\nloss = train(model, batch_size=8)"
FAILS = """%%gpumem --device cpu --text --limit $LIMIT
batch_size = 64
model = make_model()
loss = train(model, batch_size=batch_size)"""


def screen_lines(text: str, width: int = 100) -> int:
    """Lines the text takes in a terminal ``width`` columns wide."""
    return sum(max(1, -(-len(line) // width)) for line in text.splitlines())


@pytest.fixture(scope="module")
def failed(shell, small_quickstart):
    from IPython.utils.capture import capture_output

    shell.run_cell(small_quickstart)
    shell.run_cell(FITS)
    shell.user_ns["LIMIT"] = f"{2 * shell.user_ns['fits'].peak_reserved // 2**20 + 1}MiB"
    with capture_output() as cap:
        shell.run_cell(FAILS)
    run = oommagic.history()[-1]
    assert run.outcome == "oom" and run.plan is not None and run.plan.recommended is not None, cap.stdout
    return run, re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout)


def test_report_after_the_failure_fits_a_screen_plan_and_command_first(failed):
    run, _ = failed
    text = render_text(run)
    assert screen_lines(text) <= 30, f"{screen_lines(text)} lines at 100 columns:\n{text}"
    head = text.splitlines()[:12]
    assert any(line.startswith(f"  1. {run.plan.entries[0].title}") for line in head), text
    assert any("%gpumem --fix 1" in line for line in head), text


def test_report_says_each_thing_once(failed):
    run, _ = failed
    text = render_text(run)
    first = run.plan.entries[0].title
    assert text.count(first) == 1, f"the recommended fix is named {text.count(first)} times:\n{text}"
    sentences = [s.strip() for s in re.split(r"(?<=[.:])\s", text) if len(s.strip()) > 30]
    repeated = {s for s in sentences if sentences.count(s) > 1}
    assert not repeated, repeated
    assert first not in run.plan.summary, "the plan's summary repeats its first entry"


def test_each_entry_shows_its_change_and_the_command_that_runs_it(failed):
    run, _ = failed
    text = render_text(run)
    entry = run.plan.entries[0]
    new = entry.fixes[0].params["new"]
    block = text[text.index("  1. ") :]
    assert "%gpumem --fix 1 runs it:" in block
    assert f"- batch_size = 64\n       + batch_size = {new}" in block, block
    assert "more lines" in block, "a long rewrite is elided, not printed whole"


def test_short_diff_pairs_a_changed_line_with_its_replacement_and_counts_the_rest():
    old = "batch_size = 256\nloss = train(model, batch_size=batch_size)\n"
    new = (
        "# written by %%gpumem\n\ndef train(m, b):\n    a = 1\n    b = 2\n\nbatch_size = 16\n"
        + old.split("\n")[1]
    )
    assert short_diff(old, new, 4) == [
        "- batch_size = 256",
        "+ batch_size = 16",
        "+ def train(m, b):",
        "… 2 more lines",
    ]


def test_each_trial_line_ends_with_its_result(failed):
    _, out = failed
    trials = [line for line in out.splitlines() if line.lstrip().startswith("trial ")]
    assert len(trials) >= 2, out
    for line in trials:
        assert re.search(
            r"… (fits, peak [\d.]+ \w+|does not fit, peak at least [\d.]+ \w+|stopped.*)$", line
        ), line


def test_fix_usage_errors_say_what_to_do(failed, shell):
    run, _ = failed
    with pytest.raises(UsageError, match="no %%gpumem cell has run out of memory"):
        chosen_fix([], "recommended")
    n = len(run.plan.entries)
    with pytest.raises(UsageError, match=f"entries 1 to {n}"):
        shell.run_line_magic("gpumem", f"--fix {n + 1}")
    with pytest.raises(UsageError, match="expects the number of a plan entry"):
        shell.run_line_magic("gpumem", "--fix two")
    unfit = next((i for i, e in enumerate(run.plan.entries, 1) if e.verdict == "does not fit"), None)
    if unfit is not None:
        with pytest.raises(UsageError, match="measured not to fit"):
            shell.run_line_magic("gpumem", f"--fix {unfit}")
    with pytest.raises(UsageError, match="belong to the line magic"):
        shell.run_cell_magic("gpumem", "--fix 1", "x = 1")


def test_fix_runs_the_recommended_entry_then_says_what_the_kernel_holds(failed, shell, run_cell):
    run, _ = failed
    entry = run.plan.recommended
    result, out = run_cell("%gpumem --fix")
    new = oommagic.history()[-1]
    assert result.success, out
    assert new.outcome == "ok" and new.parent == run.id and new.applied == entry.fixes, out
    steps = entry.fixes[0].params["accumulate"]
    assert f"`train` is the rewritten one: cells that call it run {steps} micro-batches" in out, out
    assert f"`batch_size` is now {entry.fixes[0].params['new']} (the cell says 64)" in out, out
    pasted = out[out.index("paste into the cell") :].split("\n", 1)[1]
    assert textwrap.dedent(pasted).strip() == new.source.strip(), "the code to paste is what ran"
    with pytest.raises(UsageError, match="already fits"):
        shell.run_line_magic("gpumem", "--fix")


NAMESPACE_BATCH = """
import torch
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
net_opt = torch.optim.Adam(net.parameters(), lr=1e-3)
bs = 64
"""
# The batch lives in the namespace (an earlier cell's `bs`), not in the failing cell's text.
TRAIN_NS = """%%gpumem --device cpu --limit 24MiB --text
for _ in range(2):
    x = torch.ones(bs, 64, 256)
    net(x).square().mean().backward()
    net_opt.step()
    net_opt.zero_grad()
"""


def test_a_batch_rebound_in_the_namespace_is_named_and_set_in_the_code_to_paste(shell, run_cell):
    shell.run_cell(NAMESPACE_BATCH)
    run_cell(TRAIN_NS)
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.plan.recommended is not None, render_text(failed)
    fix = failed.plan.recommended.fixes[-1]
    assert fix.kind == "batch" and fix.params["where"] == "namespace", fix.params
    _, out = run_cell("%gpumem --fix")
    new = oommagic.history()[-1]
    assert new.outcome == "ok", out
    assert f"`bs` is now {fix.params['new']} (was 64)" in out, out
    pasted = textwrap.dedent(out[out.index("paste into the cell") :].split("\n", 1)[1])
    assert pasted.startswith(f"bs = {fix.params['new']}\n"), "the value the kernel holds, set before the cell"
    assert shell.user_ns["bs"] == fix.params["new"]
