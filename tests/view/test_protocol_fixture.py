"""The contract between ``CellRun.to_json()`` and the sidebar: the runs the kernel sends are the committed
fixture ``labextension/test/fixtures/cellrun.json`` that the TypeScript parser is tested on
(``labextension/test/contract.spec.tsx``), so neither side can change a field without the other noticing.

The runs come from real ``%%gpumem`` cells in a fresh IPython shell (CPU mode, ``--limit`` emulating a
small card), run in a subprocess so that no earlier test's tensors change their figures; one of them raises
a real CUDA out-of-memory message, which the magic reads with ``oommagic.parse_oom``. What changes from run
to run (ids, clock times, measured durations, the timeline's seconds) is normalised before comparing.

``OOMMAGIC_WRITE_FIXTURES=1 pytest tests/test_protocol_fixture.py`` rewrites the fixture; commit it together
with the change of ``to_json`` and, where the sidebar reads the field, of ``labextension/src/protocol.ts``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "labextension" / "test" / "fixtures" / "cellrun.json"

# Each cell under a --limit, so that the card's capacity is the limit and not this machine's RAM.
CELLS = {
    # Binds nothing on the device, so the next cell starts from an empty card.
    "ok": "%%gpumem --limit 64MiB --quiet\ntotal = torch.ones(1000).sum().item()",
    # A batch too large: findings with a remedy that rewrites the cell (`new_source`).
    "oom_batch": (
        "%%gpumem --limit 64MiB --quiet\nbatch_size = 64\ndef step(n):\n"
        "    x = torch.empty(n, 1024, 1024, dtype=torch.uint8)\n"
        "    return x.float().sum()\ny = step(batch_size)"
    ),
    # The failed cell bound `bound_big` to 32 MiB: it is dropped with the failed attempt (`dropped`).
    "oom_dropped": (
        "%%gpumem --limit 48MiB --quiet\nkept_small = 7\n"
        "bound_big = torch.ones(32 * 2**20, dtype=torch.uint8)\n"
        "more = torch.empty(32 * 2**20, dtype=torch.uint8)"
    ),
    "error": "%%gpumem --limit 64MiB --quiet\nraise ValueError('boom 42')",
}

# torch 2.1+ on an H200 with a second process on the card (the message as DESIGN.md quotes it).
CUDA_MESSAGE = (
    "CUDA out of memory. Tried to allocate 8.00 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
    "3.29 GiB is free. Process 4242 has 20.00 GiB memory in use. Including non-PyTorch memory, this process "
    "has 116.51 GiB memory in use. Of the allocated memory 112.00 GiB is allocated by PyTorch, and 2.50 GiB "
    "is reserved by PyTorch but unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
# The CUDA message raised in a cell: the magic reads it with `oommagic.parse_oom`, as on a GPU.
CUDA_CELL = f"%%gpumem --limit 64MiB --quiet\nraise torch.OutOfMemoryError({CUDA_MESSAGE!r})"

EPOCH = 1718000000.0
WALL_S = 0.25


def build_runs() -> dict[str, dict]:
    """The ``to_json()`` of each run, by name (runs in this process's own IPython shell)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    import oommagic
    from oommagic.run.session import session_for
    from oommagic.view.widget import ReportWidget

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "oommagic")
    shell.run_cell("import torch")
    cells = {**CELLS, "cuda_oom": CUDA_CELL}
    runs = {}
    for name, cell in cells.items():
        with capture_output():
            shell.run_cell(cell, store_history=True)
        runs[name] = oommagic.history()[-1]
        if name == "oom_batch":
            # The batch fix pressed as a person would: a retry with its parent and the change it made.
            with capture_output():
                runs["retry"] = ReportWidget(runs[name], session_for(shell)).click("batch")
    assert runs["cuda_oom"].report == oommagic.parse_oom(CUDA_MESSAGE)
    return {name: run.to_json() for name, run in runs.items()}


# Measured durations, wherever they sit in a run (its own wall time, the fix plan's trials), and the
# sentences that quote them.
SECONDS = {"wall_s": WALL_S, "spent_s": 1.0, "seconds_per_step": 0.1, "time_ratio": 1.0}
SECONDS_IN_TEXT = [
    (re.compile(r"\b\d+\.\d+ s\b"), f"{WALL_S:.2f} s"),
    (re.compile(r"\b\d+\.\d+× the time"), "1.0× the time"),
]


def steady(value):
    """``value`` with every measured duration, and every sentence quoting one, replaced by a fixed one."""
    if isinstance(value, dict):
        return {
            key: SECONDS[key] if key in SECONDS and isinstance(item, (int, float)) else steady(item)
            for key, item in value.items()
        }
    if isinstance(value, list):
        return [steady(item) for item in value]
    if isinstance(value, str):
        for pattern, fixed in SECONDS_IN_TEXT:
            value = pattern.sub(fixed, value)
    return value


def normalise(runs: dict[str, dict]) -> dict[str, dict]:
    """The runs with what differs between two identical runs replaced by fixed values, in their order."""
    ids = {run["id"]: f"run-{i}" for i, run in enumerate(runs.values())}
    out = {}
    for i, (name, run) in enumerate(runs.items()):
        run = steady(run)
        run["id"] = ids[run["id"]]
        run["parent"] = ids.get(run["parent"], run["parent"])
        run["started"] = EPOCH + i
        timeline = run["timeline"]
        seconds = timeline["t"]
        timeline["t"] = [round(0.05 * k, 2) for k in range(len(seconds))]
        if timeline["oom_at"] is not None:
            # The event the error came at (or after the last one), on the normalised clock.
            at = next((k for k, s in enumerate(seconds) if s >= timeline["oom_at"]), len(seconds))
            timeline["oom_at"] = round(0.05 * at, 2)
        timeline["steps"] = [
            round(0.05 * next((k for k, s in enumerate(seconds) if s >= step), 0), 2)
            for step in timeline["steps"]
        ]
        out[name] = run
    return out


def produced_runs() -> dict[str, dict]:
    env = dict(os.environ)
    # The oommagic of this checkout, whatever the environment has installed.
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, __file__], capture_output=True, text=True, env=env, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return normalise(json.loads(done.stdout))


def test_the_sidebar_fixture_is_what_cellrun_to_json_writes():
    produced = produced_runs()
    if os.environ.get("OOMMAGIC_WRITE_FIXTURES") == "1":
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps(produced, indent=2, ensure_ascii=False) + "\n")
    committed = json.loads(FIXTURE.read_text())
    hint = (
        f"CellRun.to_json() no longer writes what {FIXTURE.relative_to(ROOT)} holds: if the change is meant, "
        "rewrite it with OOMMAGIC_WRITE_FIXTURES=1 pytest tests/test_protocol_fixture.py, run `jlpm test` in "
        "labextension/ and commit both"
    )
    assert list(produced) == list(committed), hint
    for name in produced:
        assert sorted(produced[name]) == sorted(committed[name]), f"{name}: fields differ. {hint}"
        assert produced[name] == committed[name], f"{name}: values differ. {hint}"


def test_the_fixture_covers_every_outcome_the_sidebar_draws():
    runs = json.loads(FIXTURE.read_text())
    assert {run["outcome"] for run in runs.values()} >= {"ok", "oom", "error"}
    assert any(run["dropped"] for run in runs.values())
    assert any(run["parent"] for run in runs.values())
    assert any(r["new_source"] for run in runs.values() for f in run["findings"] for r in f["remedies"])
    assert any(run["report"] and run["report"]["other_processes"] for run in runs.values())


if __name__ == "__main__":
    print(json.dumps(build_runs()))
