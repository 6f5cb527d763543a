"""Every scenario notebook runs through a real kernel (nbclient) on CPU, widget state stored, and its
fix turns the out-of-memory cell into a run that fits."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from test_kernel import ROOT, execute, texts

pytest.importorskip("transformers")

EXPECTED = {
    "finetune_oom": ["Batch 32 → ", "accumulate", "-> ok"],
    "generation_oom": ["-> ok"],
    "dataset_lengths": ["ok ", "above"],
    "monitoring": ["Free cache, features", "| fits", "-> ok | cache still defined: False"],
}


# A notebook takes about a minute; a cell that has not ended in 150 s is a kernel that stopped answering,
# and the notebook runs once more (``test_kernel.run_watched``): room for both.
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_scenario_notebook_runs_and_its_fix_fits(name):
    nb = execute(nbformat.read(ROOT / "notebooks" / f"{name}.ipynb", as_version=4), timeout=150)
    shown = "\n".join(texts(c) for c in nb.cells if c.cell_type == "code")
    for expected in EXPECTED[name]:
        assert expected in shown, f"{name}: {expected!r} not in the outputs"
    oom_cells = [c for c in nb.cells if "raises-exception" in c.get("metadata", {}).get("tags", [])]
    for cell in oom_cells:
        assert any(o.output_type == "error" and o.ename == "OutOfMemoryError" for o in cell.outputs)
    assert nb.metadata.get("widgets"), "widget state is stored"


def test_every_notebook_is_covered():
    names = {p.stem for p in Path(ROOT, "notebooks").glob("*.ipynb")} - {"quickstart"}
    assert names == set(EXPECTED)
