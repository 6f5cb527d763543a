"""The report widget is the whole experience where no JupyterLab extension runs (VS Code's Jupyter
extension renders ipywidgets, not lab extensions): a real kernel through nbclient, which has no
``oommagic`` comm target, shows the full report as a widget and its fix buttons retry the cell."""

from __future__ import annotations

import json
import os
from pathlib import Path

import nbformat
from test_kernel import WatchedClient, run_watched

ROOT = Path(__file__).resolve().parents[1]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"

OOM_CELL = """%%gpumem --limit 64MiB
import torch
batch_size = 64
def step(n):
    x = torch.empty(n, 1024, 1024, dtype=torch.uint8)
    return x.float().sum()
y = step(batch_size)"""

CLICK_CELL = """import oommagic
widget = oommagic.report_widget()
retry = widget.click("batch")
print("retry:", retry.outcome)"""


class RecordingClient(WatchedClient):
    """nbclient as it is (no frontend comm targets but the widget manager's), noting each comm opened."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm_targets: list[str] = []

    def process_message(self, msg, cell, cell_index):
        if msg["msg_type"] == "comm_open":
            self.comm_targets.append(msg["content"].get("target_name", ""))
        return super().process_message(msg, cell, cell_index)


def test_widget_report_and_retry_work_with_no_lab_extension(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in ("%load_ext oommagic", OOM_CELL, CLICK_CELL)]
    # Each cell takes seconds: one that has not ended in 100 s is a kernel that stopped answering.
    client = run_watched(
        nb,
        RecordingClient,
        timeout=100,
        kernel_name="python3",
        allow_errors=True,
        store_widget_state=True,
    )
    oom, click = nb.cells[1], nb.cells[2]

    # The kernel offered the sidebar its runs; nothing on this side took them.
    assert "oommagic" in client.comm_targets

    errors = [o for o in oom.outputs if o.output_type == "error"]
    assert len(errors) == 1 and "OutOfMemory" in errors[0].ename, errors
    views = [o for o in oom.outputs if WIDGET_VIEW in o.get("data", {})]
    assert len(views) == 1, "the report is one widget"
    # A frontend without widgets still gets the text report.
    assert "OUT OF MEMORY" in views[0]["data"]["text/plain"]
    assert "64.00 MiB limit" in views[0]["data"]["text/plain"]

    # What VS Code draws comes from the widget models the kernel sent, stored here as they were after
    # the retry: the report with its figures, the timeline image, the fix buttons, the retry's result.
    models = nb.metadata["widgets"][WIDGET_STATE]["state"]
    state = json.dumps(models)
    assert "oommagic-report" in state
    assert "peak allocated" in state
    assert any(m["model_name"] == "ImageModel" for m in models.values())
    buttons = [m["state"] for m in models.values() if m["model_name"] == "ButtonModel"]
    assert any("oommagic-fix-batch" in b["_dom_classes"] for b in buttons), "a smaller-batch button"
    assert "oommagic-retry-ok" in state, "the widget shows the retry that fit"
    # No frontend here writes the fix into the cell: the report says so, and where the change to paste is.
    assert "The cell still shows what you wrote" in state and "What changed in the cell" in state

    printed = "".join(o.get("text", "") for o in click.outputs if o.output_type == "stream")
    assert not [o for o in click.outputs if o.output_type == "error"], printed
    assert "retry: ok" in printed
    assert "could not send" not in printed
