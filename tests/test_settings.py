"""Every ``%config GpuMemMagics`` knob reaches the part that uses it, through one ``Settings`` record the
magic builds from its traits at each call: set in a real IPython shell, seen in what the next run did."""

from __future__ import annotations

import pickle
import re

import pytest

import oommagic
from oommagic.options import Settings

SETUP = """
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
"""
TRAIN = """%%gpumem --device cpu --limit 24MiB --quiet --no-raise
batch_size = 64
for _ in range(2):
    x = torch.ones(batch_size, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""
MANY = "%%gpumem --device cpu --quiet\nparts = [torch.ones(64) for _ in range(40)]\ndel parts"


@pytest.fixture
def knobs(shell):
    """Set knobs with ``%config`` for one test; every knob is back at its default after it."""
    shell.run_cell(SETUP)

    def configure(**values) -> None:
        for name, value in values.items():
            shell.run_line_magic("config", f"GpuMemMagics.{name} = {value!r}")

    yield configure
    configure(**{name: getattr(Settings, name) for name in Settings.names()})


def test_the_settings_record_has_every_knob_of_the_magic():
    from oommagic.magics import GpuMemMagics

    traits = set(GpuMemMagics.class_traits(config=True))
    assert set(Settings.names()) == traits
    assert all(GpuMemMagics.class_traits()[n].default_value == getattr(Settings, n) for n in traits)


def test_trace_entries_is_the_length_the_recorder_keeps(shell, knobs, tmp_path):
    def traced(entries: int | None) -> int:
        if entries is not None:
            knobs(trace_entries=entries)
        shell.run_cell(MANY)
        path = tmp_path / f"{entries}.pickle"
        shell.run_line_magic("gpumem", f"--snapshot {path}")
        return len(pickle.loads(path.read_bytes())["device_traces"][0])

    assert traced(None) >= 80, "every alloc and free of the cell with the default length"
    assert traced(12) == 12, "the last 12 events, as the CUDA history's ring keeps them"


def test_plan_margin_is_the_room_a_fit_must_leave(shell, knobs):
    # Nothing leaves 99 % of the budget free: what ran within it is "likely fits", never "fits".
    knobs(plan_margin=0.99)
    shell.run_cell(TRAIN)
    entries = oommagic.history()[-1].plan.entries
    likely = [e for e in entries if e.verdict == "likely fits"]
    assert likely and not any(e.verdict == "fits" for e in entries), [e.line() for e in entries]
    assert all("less than the 99% margin" in e.note for e in likely)
    knobs(plan_margin=0.0)
    shell.run_cell(TRAIN)
    entries = oommagic.history()[-1].plan.entries
    assert any(e.verdict == "fits" for e in entries) and not any(e.verdict == "likely fits" for e in entries)


def test_plan_budget_knobs_set_the_plans_time(shell, knobs):
    knobs(plan_budget_factor=0.0, plan_budget_min=7.0, plan_budget_max=100.0)
    shell.run_cell(TRAIN)
    assert oommagic.history()[-1].plan.budget_s == 7.0
    knobs(plan_budget_factor=1000.0, plan_budget_min=0.0, plan_budget_max=9.0)
    shell.run_cell(TRAIN)
    assert oommagic.history()[-1].plan.budget_s == 9.0
    knobs(plan_budget_factor=2.0, plan_budget_min=0.0, plan_budget_max=1000.0)
    shell.run_cell(TRAIN)
    run = oommagic.history()[-1]
    assert run.plan.budget_s == pytest.approx(2.0 * run.wall_s)


def test_search_margin_is_the_room_a_search_keeps(shell, knobs, run_cell):
    probed = {}
    for margin in (0.0, 0.6):
        knobs(search_margin=margin)
        _, out = run_cell(TRAIN.replace("--no-raise", "--find-batch batch_size"))
        probed[margin] = [int(b) for b in re.findall(r"trial \d+: \w+ batch_size=(\d+)", out)]
    # The line through the first probes aims at what it leaves free: a wider margin, a smaller next batch.
    assert len(probed[0.0]) > 1 and len(probed[0.6]) > 1, probed
    assert probed[0.6][1] < probed[0.0][1], probed
