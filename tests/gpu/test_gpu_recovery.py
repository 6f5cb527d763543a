"""A real CUDA out-of-memory error inside a cell: %%gpumem gives the failed cell's memory back; plain
IPython keeps all of it pinned (through sys.last_* and the last execution result)."""

from __future__ import annotations

import pytest
import torch

import oommagic
from oommagic.run.release import free_failed_cell

pytestmark = pytest.mark.gpu

MiB, GiB = 1024**2, 1024**3
HELD = 40 * GiB

FAILING = """import weakref
def fill_and_fail():
    held = torch.empty({held}, dtype=torch.uint8, device="cuda")
    _refs.append(weakref.ref(held))
    more = torch.empty({huge}, dtype=torch.uint8, device="cuda")
fill_and_fail()
"""


def failing_cell() -> str:
    return FAILING.format(held=HELD, huge=torch.cuda.mem_get_info()[1])


def test_oom_in_a_cell_gives_the_40_gib_back(shell, cell):
    refs: list = []
    shell.user_ns["_refs"] = refs
    base = torch.cuda.memory_allocated()
    result = cell("%%gpumem\n" + failing_cell())
    held = torch.cuda.memory_allocated() - base
    run = oommagic.history()[-1]
    print(
        f"%%gpumem: still allocated after the OOM {held:+,d} B; run.freed {run.freed:,d} B; "
        f"tensor alive: {refs[0]() is not None}"
    )
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert run.outcome == "oom"
    assert abs(held) <= 2 * MiB
    assert refs[0]() is None, "the failed function's 40 GiB tensor is still alive"
    assert run.freed is not None and abs(run.freed - HELD) <= 2 * MiB


def test_plain_ipython_keeps_the_40_gib_until_freed(shell, cell):
    refs: list = []
    shell.user_ns["_refs"] = refs
    base = torch.cuda.memory_allocated()
    result = cell(failing_cell())
    error = result.error_in_exec
    held = torch.cuda.memory_allocated() - base
    print(f"plain IPython: still allocated after the OOM {held:+,d} B; tensor alive: {refs[0]() is not None}")
    assert isinstance(error, torch.OutOfMemoryError)
    assert held >= HELD and refs[0]() is not None
    free_failed_cell(shell, error, "cuda:0")
    del error
    after = torch.cuda.memory_allocated() - base
    print(f"plain IPython after oommagic.run.release.free_failed_cell: {after:+,d} B")
    assert abs(after) <= 2 * MiB and refs[0]() is None
