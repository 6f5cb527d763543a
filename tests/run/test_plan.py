"""The fix plan in a real IPython shell, CPU mode: measured verdicts, the user's state as it was after every
trial, fixes that cannot fit said so, and host memory that cannot hold the snapshot refused."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import oommagic
from oommagic.run.session import session_for

MiB = 1024**2

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
model(torch.randn(4, 256)).sum().backward()
opt.step()
sched.step()
opt.zero_grad()
history = [1.0]
batch_size = 64  # the failed cell binds it again: that binding is its own, not a trial's
"""

# Trains the model and optimizer that exist before the cell: every trial steps them for real.
TRAIN = """%%gpumem --limit 24MiB --quiet --no-raise
batch_size = 64
for _ in range(2):
    x = torch.ones(batch_size, 64, 256)  # the failing run draws no random numbers: the trials do
    model(x).square().mean().backward()
    opt.step()
    sched.step()
    opt.zero_grad()
    history.append(float(torch.rand(1)))
"""


def fingerprint(ns: dict) -> dict:
    """What a trial must leave as it was: weights, gradients, optimizer and scheduler state, RNGs, the
    namespace's bindings and the contents of its lists."""
    model, opt, sched = ns["model"], ns["opt"], ns["sched"]
    return {
        "weights": [p.detach().clone() for p in model.parameters()],
        "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
        "opt": {
            k: {n: v.clone() if torch.is_tensor(v) else v for n, v in s.items()} for k, s in opt.state.items()
        },
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": sched.state_dict(),
        "torch_rng": torch.get_rng_state(),
        "numpy_rng": np.random.get_state()[1].copy(),
        "random": random.getstate(),
        # `x` is the failed cell's own binding, dropped with its memory (not a trial's doing).
        "names": {k: id(v) for k, v in ns.items() if not k.startswith("_") and k != "x"},
        "history": list(ns["history"]),
    }


def same(a: dict, b: dict) -> bool:
    def eq(x, y):
        if torch.is_tensor(x):
            return torch.is_tensor(y) and torch.equal(x, y)
        if isinstance(x, dict):
            return x.keys() == y.keys() and all(eq(x[k], y[k]) for k in x)
        if isinstance(x, (list, tuple)):
            return len(x) == len(y) and all(eq(i, j) for i, j in zip(x, y, strict=True))
        if isinstance(x, np.ndarray):
            return bool((x == y).all())
        return x == y

    return all(eq(a[k], b[k]) for k in a)


@pytest.fixture
def trained(shell):
    for name in ("model", "opt", "sched", "history", "failed"):
        shell.user_ns.pop(name, None)
    shell.run_cell(SETUP)
    return shell


def test_trials_leave_model_optimizer_rng_and_namespace_as_they_were(trained, run_cell):
    np.random.seed(3)
    random.seed(3)
    before = fingerprint(trained.user_ns)
    run_cell(TRAIN)
    run = oommagic.history()[-1]
    assert run.outcome == "oom" and run.plan.trials >= 2, run.plan.summary
    after = fingerprint(trained.user_ns)
    assert same(before, after), _diff(before, after)
    assert "restored after each" in run.plan.summary
    assert run.plan.snapshot_bytes > 0 and "kept in host memory" in run.plan.summary


def test_the_accepted_fix_is_the_only_run_that_trains(trained, run_cell):
    run_cell(TRAIN)
    run = oommagic.history()[-1]
    first = run.plan.recommended
    assert first is not None and first is run.plan.entries[0], run.plan.summary
    steps_before = trained.user_ns["sched"].last_epoch
    new = session_for(trained).retry(run, first.fixes)
    assert new.outcome == "ok"
    assert trained.user_ns["sched"].last_epoch == steps_before + 2, "the accepted run stepped for real"


def test_search_probes_leave_the_model_as_it_was(trained, run_cell):
    before = fingerprint(trained.user_ns)
    run_cell(TRAIN.replace("--no-raise", "--find-batch batch_size"))
    after = fingerprint(trained.user_ns)
    after["names"].pop("batch_size", None)
    before["names"].pop("batch_size", None)
    assert same(before, after)
    assert 1 <= trained.user_ns["batch_size"] < 64, "the search binds the answer it was asked for"


NEVER_FITS = """%%gpumem --limit 16MiB --quiet --no-raise
kept = []
for step in range(100):
    w = torch.nn.Parameter(torch.zeros(1024))
    kept.append(torch.ones(2 * 2**20, dtype=torch.uint8))
    w.grad = torch.ones_like(w)
    torch.optim.SGD([w], lr=0.1).step()
"""

TOO_BIG = """%%gpumem --limit 8MiB --quiet --no-raise
big = torch.nn.Linear(2048, 2048)
out = big(torch.randn(8, 2048))
"""


@pytest.mark.parametrize("cell", [NEVER_FITS, TOO_BIG], ids=["keeps-growing", "weights-too-big"])
def test_a_cell_that_cannot_fit_says_so_and_offers_nothing_that_fails(shell, run_cell, cell):
    run_cell(cell)
    run = oommagic.history()[-1]
    assert run.outcome == "oom"
    plan = run.plan
    if plan is not None and plan.entries:
        assert plan.recommended is None, plan.summary
        assert plan.unfittable, plan.summary
    from oommagic.view.widget import offered

    session = session_for(shell)
    for fix in offered(run):
        # Only fixes not measured are offered; pressing one must never pretend to fit.
        assert fix.verdict != "fits"
        assert session.retry(run, fix.fixes).outcome != "ok" or fix.verdict == "not measured"


def test_a_snapshot_host_memory_cannot_hold_is_refused_and_said(trained, run_cell, monkeypatch):
    import oommagic.run.snapshot as snapshot

    # The host-memory reading is the hardware edge: pretend the machine has 1 MiB free.
    monkeypatch.setattr(snapshot, "host_available", lambda: 1 * MiB)
    before = fingerprint(trained.user_ns)
    run_cell(TRAIN)
    run = oommagic.history()[-1]
    assert run.plan.recommended is None and run.plan.trials == 0
    assert "host memory" in run.plan.summary and "--no-snapshot" in run.plan.summary
    after = fingerprint(trained.user_ns)
    assert same(before, after), _diff(before, after)


def test_plan_budget_zero_measures_nothing(shell, run_cell):
    shell.run_cell("import torch")
    run_cell(
        TRAIN.replace("--no-raise", "--no-raise --plan-budget 0")
        .replace("model(x)", "torch.nn.Linear(256, 256)(x)")
        .replace("    opt.step()\n    sched.step()\n    opt.zero_grad()\n", "")
        .replace("    history.append(float(torch.rand(1)))\n", "")
    )
    run = oommagic.history()[-1]
    assert run.outcome == "oom" and run.plan.trials == 0
    assert all(e.verdict == "not measured" for e in run.plan.entries)


def _diff(a, b):
    return [k for k in a if not same({k: a[k]}, {k: b[k]})]


def test_a_fix_of_an_unknown_kind_is_refused_before_the_cell_runs(trained, run_cell):
    from oommagic.diagnosis.findings import Remedy
    from oommagic.diagnosis.kinds import UnknownFixKind

    run_cell(TRAIN.replace("--no-raise", "--no-raise --plan-budget 0"))
    run = oommagic.history()[-1]
    runs = len(oommagic.history())
    steps_before = trained.user_ns["sched"].last_epoch
    unknown = Remedy("smaller_model", "Use a smaller model", automatic=True, new_source="pass\n")
    with pytest.raises(UnknownFixKind, match="smaller_model"):
        session_for(trained).retry(run, unknown)
    assert len(oommagic.history()) == runs, "nothing ran"
    assert trained.user_ns["sched"].last_epoch == steps_before


def test_every_setting_a_kind_holds_is_one_the_run_can_hold():
    from oommagic.diagnosis.kinds import KINDS
    from oommagic.run.fixes import HOLDS

    named = {row.hold for row in KINDS.values() if row.hold}
    assert named == set(HOLDS)


# The loop's length is computed from the batch before the loop: a smaller batch shortens it, and with
# accumulation over more micro-batches than the loop then has, the rewritten cell never steps.
SHORTENED = """%%gpumem --limit 24MiB --quiet --no-raise --plan-budget 60
batch_size = 64
n = 2 * batch_size
for i in range(0, n, batch_size):
    x = torch.ones(batch_size, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_rewrite_that_would_take_no_optimizer_step_is_never_offered_as_fitting(trained, run_cell):
    from torch.optim.optimizer import register_optimizer_step_post_hook

    run_cell(SHORTENED)
    run = oommagic.history()[-1]
    assert run.outcome == "oom"
    assert any("took no optimizer step" in e.note for e in run.plan.entries), [
        e.line() for e in run.plan.entries
    ]
    # Every entry offered as fitting, pressed, takes the two optimizer steps the cell as written takes.
    for entry in [e for e in run.plan.entries if e.verdict == "fits"]:
        steps: list[int] = []
        handle = register_optimizer_step_post_hook(lambda *_, steps=steps: steps.append(1))
        try:
            pressed = session_for(trained).retry(run, entry.fixes)
        finally:
            handle.remove()
        assert pressed.outcome == "ok", entry.line()
        assert len(steps) == 2, entry.line()
