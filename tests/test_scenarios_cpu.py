"""A few scenarios of the suite (benchmarks/scenarios) at CPU size, through the runner: the out-of-memory
cell fails with torch.OutOfMemoryError, its memory comes back, the plan's trials leave the model and
optimizer as they were, and the first offered fix fits (or, for an unfittable cell, the plan says so and
offers nothing that fails).

The full suite: ``python benchmarks/scenarios/run.py --scale cpu`` (see benchmarks/scenarios/README.md).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("nbclient")

HERE = Path(__file__).resolve().parents[1] / "benchmarks" / "scenarios"
sys.path.insert(0, str(HERE))

import run as runner  # noqa: E402

# Small and quick at CPU size; one of each outcome the suite scores. A scenario the product fails today is
# marked with what it does (not strict: it passes once the product is fixed).
NO_FIX = (
    "product: only the 'limit ran out' finding, no automatic fix offered (eval without no_grad not diagnosed)"
)
SILENT = (
    "product: weights over the card in every dtype get 'Not measured: no automatic fix.' "
    "and no unfittable text"
)
CASES = [
    "leftovers",
    pytest.param("eval_no_grad", marks=pytest.mark.xfail(reason=NO_FIX, strict=False)),
    pytest.param("unfit_weights", marks=pytest.mark.xfail(reason=SILENT, strict=False)),
]


@pytest.fixture(scope="module", autouse=True)
def cpu_env():
    saved = {k: os.environ.get(k) for k in ("SCENARIO_SCALE", "SCENARIO_PLAN_BUDGET", "PYTHONPATH")}
    os.environ["SCENARIO_SCALE"] = "cpu"
    os.environ["SCENARIO_PLAN_BUDGET"] = os.environ.get("SCENARIO_TEST_PLAN_BUDGET", "15")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(runner.ROOT), saved["PYTHONPATH"]) if p)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.mark.parametrize("name", CASES)
def test_scenario_scores(name):
    res = runner.judge(runner.run_scenario(name, "cpu", timeout=240, keep=None))
    assert res["status"] == "ran", res.get("reason")
    assert res["ename"] == "OutOfMemoryError"
    # Nothing of the failed attempt stays held. (The level can come out *below* the one before: in CPU mode
    # the plan's trials put the optimizer state back as storages the ledger does not count, ~4 MiB here;
    # reported to the lead, scored by the suite's "memory left" column, not asserted here.)
    assert max(res["mem_after_failures"]) <= runner.SLACK, (
        f"memory left after failures: {res['mem_after_failures']}"
    )
    assert not res["trial_changed"], f"the plan's trials changed {res['trial_changed']}"
    if res["fit_exists"]:
        assert res["fixes"], f"no fix offered: {res['report']}"
        assert res["fitted_at"] == 1, f"clicks: {res['clicks']}"
    else:
        assert res["says_unfittable"], res["report"]["plan"]
        assert not res["false_fits"], res["clicks"]


def test_every_scenario_builds():
    import nbformat
    from scenarios import SCENARIOS, notebook

    assert len(SCENARIOS) >= 15
    for s in SCENARIOS:
        nb = notebook(s.name)
        nbformat.validate(nb)
        oom_cells = [c for c in nb.cells if "oom-cell" in c.metadata.get("tags", [])]
        assert len(oom_cells) == 1, s.name
        assert not s.fit or s.control, f"{s.name}: a fittable scenario needs the author's fix"
