"""The figures %%gpumem reports on CUDA: the peak is max_memory_allocated to the byte (the replayed
timeline too), the user's own history recording is left as it was, and --limit makes a real
out-of-memory error at the limit whose message parses exactly."""

from __future__ import annotations

import pytest
import torch

import oommagic

pytestmark = pytest.mark.gpu

MiB, GiB = 1024**2, 1024**3

PATTERN = """%%gpumem --quiet
a = torch.empty(300 * 1024**2, dtype=torch.uint8, device="cuda")
b = torch.empty(700 * 1024**2, dtype=torch.uint8, device="cuda")
del a
c = torch.empty(123_456_789, dtype=torch.uint8, device="cuda")
d = torch.randn(1000, 1000, device="cuda") @ torch.randn(1000, 1000, device="cuda")
del b, c
"""


def run_pattern(cell) -> tuple[oommagic.CellRun, int]:
    torch.cuda.reset_peak_memory_stats()
    result = cell(PATTERN)
    assert result.success
    return oommagic.history()[-1], torch.cuda.max_memory_allocated()


def test_peak_is_max_memory_allocated_to_the_byte(cell):
    run, truth = run_pattern(cell)
    print(
        f"reported peak {run.peak_allocated:,d} B, timeline peak {run.timeline.peak_allocated:,d} B, "
        f"max_memory_allocated {truth:,d} B, {run.timeline.events} trace events"
    )
    assert run.peak_allocated == truth
    assert run.timeline.peak_allocated == truth
    assert not torch._C._cuda_isHistoryEnabled(), "the magic left history recording on"


def test_no_timeline_leaves_the_trace_off_and_the_peak_exact(shell, cell):
    torch.cuda.reset_peak_memory_stats()
    source = PATTERN.replace("%%gpumem --quiet", "%%gpumem --quiet --no-timeline")
    result = cell(source + "_tracing = torch._C._cuda_isHistoryEnabled()\n")
    assert result.success
    run, truth = oommagic.history()[-1], torch.cuda.max_memory_allocated()
    print(f"--no-timeline: tracing in the cell {shell.user_ns['_tracing']}; peak {run.peak_allocated:,d} B")
    assert shell.user_ns["_tracing"] is False
    assert run.peak_allocated == truth and len(run.timeline.t) == 2


def test_the_users_history_recording_is_left_as_it_was(cell):
    marker = torch.empty(5_555_555, dtype=torch.uint8, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        again = torch.empty(3_333_333, dtype=torch.uint8, device="cuda")
        run, truth = run_pattern(cell)
        on_after = torch._C._cuda_isHistoryEnabled()
        trace = torch.cuda.memory._snapshot()["device_traces"][0]
        kept = any(e["action"] == "alloc" and e["addr"] == again.data_ptr() for e in trace)
        print(
            f"user's recording: on after the cell: {on_after}; their pre-cell alloc still in the trace: "
            f"{kept}; {len(trace)} entries; peak {run.peak_allocated:,d} B vs {truth:,d} B, timeline "
            f"{run.timeline.peak_allocated:,d} B"
        )
        assert on_after and kept
        assert run.peak_allocated == truth and run.timeline.peak_allocated == truth
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    run, truth = run_pattern(cell)
    print(f"recording off before the cell: off after it: {not torch._C._cuda_isHistoryEnabled()}")
    assert not torch._C._cuda_isHistoryEnabled()
    assert run.peak_allocated == truth
    del marker


LIMIT_CELL = """%%gpumem --limit 8GiB --no-raise
def fill():
    chunks = []
    while True:
        _state.append((torch.cuda.memory_allocated(), torch.cuda.memory_reserved()))
        chunks.append(torch.empty(512 * 1024**2, dtype=torch.uint8, device="cuda"))
fill()
"""


def test_limit_8gib_runs_out_at_8gib_and_parses_exactly(shell, cell, rounding):
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    fraction_before = getter(0) if getter else None
    state: list = []
    shell.user_ns["_state"] = state
    base = torch.cuda.memory_allocated()
    cell(LIMIT_CELL)
    run = oommagic.history()[-1]
    rep = run.report
    allocated, reserved = state[-1]  # the allocator right before the request that failed
    print(
        f"limit run: outcome {run.outcome}; {len(state) - 1} chunks of 512 MiB fitted; report: limit "
        f"{rep.limit}, requested {rep.requested}, allocated {rep.allocated} (allocator {allocated}), "
        f"reserved {rep.reserved} (allocator {reserved}), reserved_unallocated {rep.reserved_unallocated}, "
        f"free {rep.free}, capacity {rep.capacity}, process_used {rep.process_used}\n"
        f"message: {rep.text[:400]}"
    )
    assert run.outcome == "oom" and run.limit == 8 * GiB
    assert rep.limit == 8 * GiB
    assert rep.requested == 512 * MiB
    assert 7 * GiB <= allocated <= 8 * GiB
    assert abs(rep.allocated - allocated) <= rounding(allocated)
    assert abs(rep.reserved - reserved) <= 2 * rounding(reserved)
    total = torch.cuda.mem_get_info()[1]
    assert rep.capacity is not None and abs(rep.capacity - total) <= rounding(total)
    if getter:
        print(f"fraction before {fraction_before}, after {getter(0)}")
        assert getter(0) == fraction_before
    assert abs(torch.cuda.memory_allocated() - base) <= 2 * MiB


def test_a_limit_holds_over_memory_an_earlier_cell_left_cached(shell, cell):
    # An earlier cell cached 6 GiB (made and dropped): a 4 GiB card could never hold that cache, so a
    # cell under --limit 4GiB that needs 5 GiB runs out, rather than running on the cached segments.
    shell.run_cell("_c = torch.empty(6 * 1024**3, dtype=torch.uint8, device='cuda'); del _c")
    assert torch.cuda.memory_reserved() >= 6 * GiB
    cell(
        "%%gpumem --limit 4GiB --no-raise --quiet\n"
        "_x = torch.empty(5 * 1024**3, dtype=torch.uint8, device='cuda')"
    )
    run = oommagic.history()[-1]
    assert run.outcome == "oom", run.headline()
    assert "_x" not in shell.user_ns
