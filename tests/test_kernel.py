"""%%gpumem in a real kernel through nbclient: notebooks run, an OOM fails the cell (Run All stops)
and its memory is given back."""

from __future__ import annotations

import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

ROOT = Path(__file__).resolve().parents[1]


def execute(nb, allow_errors=False, timeout=600):
    env_path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    os.environ["PYTHONPATH"] = env_path
    client = NotebookClient(
        nb,
        timeout=timeout,
        kernel_name="python3",
        allow_errors=allow_errors,
        store_widget_state=True,
        resources={"metadata": {"path": str(ROOT / "notebooks")}},
    )
    client.execute()
    return nb


def notebook(*sources):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    return nb


def texts(cell):
    out = []
    for o in cell.outputs:
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type == "error":
            out.append(f"{o.ename}: {o.evalue}")
        else:
            out.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def test_quickstart_notebook_executes():
    nb = execute(nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4))
    code = [c for c in nb.cells if c.cell_type == "code"]
    fits = next(c for c in code if "-o fits" in c.source)
    assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in fits.outputs)
    assert "peak" in texts(fits)
    overrun = next(c for c in code if "batch_size = 512" in c.source)
    errors = [o for o in overrun.outputs if o.output_type == "error"]
    assert errors and errors[0].ename == "CellOutOfMemory"
    assert "needed" in errors[0].evalue
    report = texts(overrun)
    assert "OUT OF MEMORY" in report and "requested" in report
    search = next(c for c in code if "--find-batch" in c.source)
    assert "largest batch_size that fits" in texts(search)
    assert nb.metadata.get("widgets"), "widget state is stored in the notebook"


OVERRUN = """%%gpumem --limit 96MiB
import weakref
def fill():
    held = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)
    refs.append(weakref.ref(held))
    return held, torch.empty(100 * 1024 * 1024, dtype=torch.uint8)
fill()
"""


def test_oom_stops_run_all():
    nb = notebook("%load_ext oommagic\nimport torch\nrefs = []", OVERRUN, "print('ran past the OOM')")
    with pytest.raises(CellExecutionError) as err:
        execute(nb)
    assert "CellOutOfMemory" in str(err.value)
    assert not nb.cells[2].outputs


def test_oom_in_kernel_gives_memory_back():
    check = (
        "from oommagic.capture import LEDGER\n"
        "print('alive' if refs[0]() is not None else 'dead', LEDGER.allocated == before)"
    )
    nb = notebook(
        "%load_ext oommagic\nimport torch\nrefs = []\n"
        "from oommagic.capture import LEDGER\nbefore = LEDGER.allocated",
        OVERRUN,
        check,
    )
    execute(nb, allow_errors=True)
    assert texts(nb.cells[2]).strip() == "dead True"
