"""The kernel end of the sidebar's comm, through a real ipykernel: what a frontend sees on iopub when a
``%%gpumem`` run is published, and what the kernel answers to the frontend's messages."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 60

PUBLISH = textwrap.dedent(
    """
    import oommagic
    from oommagic import cellrun, comm, timeline
    run = cellrun.CellRun(source="x = 1", recording=timeline.Recording("cpu", peak_allocated=4096),
                          outcome="ok", cell_id="cell-a", execution_count=3, id={run_id!r}, parent={parent!r})
    oommagic.history().append(run)
    comm.publish(run, oommagic.history())
    """
)


@pytest.fixture
def kernel() -> Iterator[Any]:
    """A fresh ipykernel that imports oommagic from this checkout, and a client connected to it."""
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=env, cwd=str(ROOT))
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=TIMEOUT)
        yield kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def until_idle(kc: Any, parent_id: str) -> list[dict]:
    """The iopub messages caused by request ``parent_id``, up to the kernel going idle."""
    seen = []
    deadline = time.monotonic() + TIMEOUT
    while True:
        msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != parent_id:
            continue
        seen.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return seen


def execute(kc: Any, code: str) -> list[dict]:
    msgs = until_idle(kc, kc.execute(code))
    errors = [m["content"] for m in msgs if m["msg_type"] == "error"]
    assert not errors, errors
    return msgs


def publish(kc: Any, run_id: str, parent: str | None = None) -> list[dict]:
    return execute(kc, PUBLISH.format(run_id=run_id, parent=parent))


def send_comm_msg(kc: Any, comm_id: str, data: dict) -> list[dict]:
    msg = kc.session.msg("comm_msg", {"comm_id": comm_id, "data": data})
    kc.shell_channel.send(msg)
    return until_idle(kc, msg["header"]["msg_id"])


def of_type(msgs: list[dict], msg_type: str) -> list[dict]:
    return [m["content"] for m in msgs if m["msg_type"] == msg_type]


def test_first_publish_opens_the_comm_with_a_hello_then_sends_the_run(kernel: Any) -> None:
    msgs = publish(kernel, "first")

    [opened] = of_type(msgs, "comm_open")
    assert opened["target_name"] == "oommagic"
    hello = opened["data"]
    assert hello["version"] == 1
    assert hello["type"] == "hello"
    assert [r["id"] for r in hello["runs"]] == ["first"]

    [sent] = of_type(msgs, "comm_msg")
    assert sent["comm_id"] == opened["comm_id"]
    assert sent["data"]["version"] == 1
    assert sent["data"]["type"] == "run"
    run = sent["data"]["run"]
    assert (run["id"], run["outcome"], run["cell_id"], run["execution_count"]) == ("first", "ok", "cell-a", 3)
    assert run["peak_allocated"] == 4096
    assert run["headline"].startswith("peak 4.00 KiB allocated")


def test_later_runs_use_the_same_comm_and_carry_their_parent(kernel: Any) -> None:
    [opened] = of_type(publish(kernel, "failed"), "comm_open")
    msgs = publish(kernel, "retry", parent="failed")

    assert of_type(msgs, "comm_open") == []
    [sent] = of_type(msgs, "comm_msg")
    assert sent["comm_id"] == opened["comm_id"]
    assert sent["data"]["run"]["parent"] == "failed"


def test_sync_from_the_frontend_resends_the_hello_with_every_run(kernel: Any) -> None:
    [opened] = of_type(publish(kernel, "one"), "comm_open")
    publish(kernel, "two")

    [answer] = of_type(send_comm_msg(kernel, opened["comm_id"], {"type": "sync"}), "comm_msg")

    assert answer["comm_id"] == opened["comm_id"]
    assert answer["data"]["type"] == "hello"
    assert answer["data"]["version"] == 1
    assert [r["id"] for r in answer["data"]["runs"]] == ["one", "two"]


def test_a_message_the_kernel_does_not_know_is_ignored(kernel: Any) -> None:
    [opened] = of_type(publish(kernel, "one"), "comm_open")

    msgs = send_comm_msg(kernel, opened["comm_id"], {"type": "gossip", "version": 9})
    msgs += send_comm_msg(kernel, opened["comm_id"], ["not", "an", "object"])

    assert of_type(msgs, "comm_msg") == []
    assert of_type(msgs, "error") == []
    assert [s for s in of_type(msgs, "stream") if s["name"] == "stderr"] == []


def test_a_comm_the_frontend_closed_is_reopened_with_every_run(kernel: Any) -> None:
    # A frontend without the `oommagic` target answers comm_open with comm_close.
    [opened] = of_type(publish(kernel, "one"), "comm_open")
    close = kernel.session.msg("comm_close", {"comm_id": opened["comm_id"], "data": {}})
    kernel.shell_channel.send(close)
    until_idle(kernel, close["header"]["msg_id"])

    msgs = publish(kernel, "two")

    [reopened] = of_type(msgs, "comm_open")
    assert reopened["comm_id"] != opened["comm_id"]
    assert [r["id"] for r in reopened["data"]["runs"]] == ["one", "two"]
    assert [m["data"]["run"]["id"] for m in of_type(msgs, "comm_msg")] == ["two"]


def test_publish_outside_a_kernel_sends_nothing_and_imports_no_ipykernel() -> None:
    script = textwrap.dedent(
        """
        import sys
        from oommagic import cellrun, comm, timeline
        run = cellrun.CellRun(source="x = 1", recording=timeline.Recording("cpu"))
        comm.publish(run, [run])
        comm.publish(run, [run])
        print("ipykernel" in sys.modules)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT, check=True
    )
    assert done.stdout.strip() == "False"
    assert done.stderr == ""


def test_each_run_becomes_json_once_however_often_a_frontend_closes_the_comm(monkeypatch) -> None:
    import comm as comm_package

    from oommagic import cellrun, comm, timeline

    sent, closers = [], []

    class Frontend:
        """A kernel's comm to a frontend without the ``oommagic`` target: each comm gets closed."""

        def __init__(self, target_name: str, data: dict) -> None:
            sent.append(data)

        def on_msg(self, callback: Any) -> None:
            pass

        def on_close(self, callback: Any) -> None:
            closers.append(callback)

        def send(self, data: dict) -> None:
            sent.append(data)

    monkeypatch.setattr(comm_package, "create_comm", Frontend)
    monkeypatch.setattr(comm, "_comm", None)
    monkeypatch.setattr(comm, "_bodies", {})
    built = []
    to_json = cellrun.CellRun.to_json
    monkeypatch.setattr(cellrun.CellRun, "to_json", lambda run: built.append(run.id) or to_json(run))
    runs: list = []
    for name in ("one", "two", "three"):
        runs.append(cellrun.CellRun(source="x = 1", recording=timeline.Recording("cpu"), id=name))
        comm.publish(runs[-1], runs)
        closers[-1]({})
    assert [m["type"] for m in sent] == ["hello", "run"] * 3
    assert [r["id"] for r in sent[-2]["runs"]] == ["one", "two", "three"]
    assert built == ["one", "two", "three"]


FAILING = """%load_ext oommagic
import torch
"""
OOM_CELL = """%%gpumem --limit 24MiB --no-raise --quiet
batch_size = 64
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(batch_size, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def test_the_sidebar_applies_a_plan_entry_and_removes_a_fix(kernel: Any) -> None:
    execute(kernel, FAILING)
    msgs = execute(kernel, OOM_CELL)
    [opened] = of_type(msgs, "comm_open")
    failed = of_type(msgs, "comm_msg")[-1]["data"]["run"]
    assert failed["outcome"] == "oom" and failed["plan"]["entries"][0]["verdict"] == "fits"

    # Press the plan's first entry from the sidebar: a new run of the cell, parent = the failed run.
    sent = of_type(
        send_comm_msg(kernel, opened["comm_id"], {"type": "apply", "run": failed["id"], "entry": 0}),
        "comm_msg",
    )
    fitted = sent[-1]["data"]["run"]
    assert fitted["parent"] == failed["id"] and fitted["outcome"] == "ok"
    assert [f["kind"] for f in fitted["applied"]] == failed["plan"]["entries"][0]["kind"].split("+")

    # Remove that fix again: the cell runs as written, and runs out of memory as it did.
    sent = of_type(
        send_comm_msg(kernel, opened["comm_id"], {"type": "remove", "run": fitted["id"], "index": 0}),
        "comm_msg",
    )
    again = next(m["data"]["run"] for m in sent if m["data"]["type"] == "run")
    assert again["parent"] == fitted["id"] and again["applied"] == [] and again["outcome"] == "oom"

    # A request the kernel cannot do is answered, not raised.
    sent = of_type(
        send_comm_msg(kernel, opened["comm_id"], {"type": "remove", "run": "nope", "index": 0}), "comm_msg"
    )
    assert sent[-1]["data"]["type"] == "error" and "no run" in sent[-1]["data"]["message"]


HELPER = """def train(model, opt, batch_size):
    for _ in range(2):
        x = torch.randn(batch_size, 64, 256)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
"""
CALLS_HELPER = """%%gpumem --limit 24MiB --no-raise
batch_size = 64
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
train(model, opt, batch_size)
"""


def execute_in_cell(kc: Any, code: str, cell_id: str) -> list[dict]:
    """Execute ``code`` as JupyterLab runs a cell: the cell's model id in the request's metadata."""
    content = {"code": code, "silent": False, "store_history": True, "user_expressions": {},
               "allow_stdin": False, "stop_on_error": True}  # fmt: skip
    msg = kc.session.msg("execute_request", content, metadata={"cellId": cell_id})
    kc.shell_channel.send(msg)
    msgs = until_idle(kc, msg["header"]["msg_id"])
    assert not of_type(msgs, "error"), of_type(msgs, "error")
    return msgs


def test_a_fix_pressed_in_the_report_is_sent_to_be_written_where_the_notebook_defines_it(kernel: Any) -> None:
    execute(kernel, FAILING)
    execute_in_cell(kernel, HELPER, "cell-defs")
    msgs = execute_in_cell(kernel, CALLS_HELPER, "cell-fails")
    [opened] = [m for m in of_type(msgs, "comm_open") if m["target_name"] == "oommagic"]
    failed = [m["data"]["run"] for m in of_type(msgs, "comm_msg") if m["data"].get("type") == "run"][-1]
    assert failed["outcome"] == "oom" and failed["plan"]["entries"][0]["kind"] == "batch"

    # The report's first button, pressed as a person would.
    pressed = execute(kernel, "import oommagic; oommagic.report_widget().click('batch')")
    sent = [m["data"] for m in of_type(pressed, "comm_msg") if m["data"].get("type") in ("run", "write")]
    assert [d["type"] for d in sent] == ["run", "write"]
    fitted, write = sent[0]["run"], sent[1]
    assert fitted["outcome"] == "ok" and write["run"] == fitted["id"] and write["cell_id"] == "cell-fails"
    # The cell gets its own lines back, with the new batch; train goes back to the cell that defines it.
    body = write["write"]["body"]
    assert "def train" not in body and "batch_size = 64" not in body
    assert body.endswith("train(model, opt, batch_size)")
    [train] = write["write"]["functions"]
    assert train["name"] == "train" and train["was"] == HELPER
    assert train["now"].startswith("def train(") and train["now"] != HELPER.rstrip()
    assert fitted["write"] == write["write"]

    # Until the frontend says it wrote it, the report says what the kernel now runs that the cell does not.
    def headline() -> str:
        shown = execute(kernel, "print(oommagic.report_widget().headline.value)")
        return "".join(m["text"] for m in of_type(shown, "stream"))

    assert "The cell still shows what you wrote" in headline() and "<code>train</code>" in headline()
    send_comm_msg(kernel, opened["comm_id"], {"type": "written", "run": fitted["id"]})
    assert "Written into the notebook" in headline()
