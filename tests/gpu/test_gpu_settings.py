"""``%config GpuMemMagics.trace_entries`` on CUDA: the allocator history keeps that many events, so a cell
that makes more loses its earliest from the timeline (and says so) while its peak stays exact."""

from __future__ import annotations

import pytest
import torch

import oommagic

pytestmark = pytest.mark.gpu

MANY = """%%gpumem --quiet
keep = [torch.empty(1024, device="cuda") for _ in range(400)]
del keep
"""


def test_trace_entries_is_the_allocator_historys_length(shell, cell):
    torch.cuda.reset_peak_memory_stats()
    assert cell(MANY).success
    whole = oommagic.history()[-1]
    shell.run_line_magic("config", "GpuMemMagics.trace_entries = 64")
    try:
        assert cell(MANY).success
        cut = oommagic.history()[-1]
    finally:
        shell.run_line_magic("config", "GpuMemMagics.trace_entries = 500000")
    print(f"events: {whole.timeline.events} with the default length, {cut.timeline.events} with 64")
    assert not whole.timeline.truncated and cut.timeline.truncated
    assert cut.timeline.events < whole.timeline.events
    assert cut.peak_allocated == whole.peak_allocated
