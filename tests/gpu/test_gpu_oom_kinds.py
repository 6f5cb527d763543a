"""Several kinds of real CUDA out-of-memory errors, each caught, parsed against the allocator's own
figures and given back: one huge request, a slow fill across optimizer steps, a fragmented cache. The
fragmented run is retried through the report widget's buttons with expandable segments and with the
cache emptied after every optimizer step; both fit."""

from __future__ import annotations

import pytest
import torch

import oommagic

pytestmark = pytest.mark.gpu

MiB, GiB = 1024**2, 1024**3


def last_run() -> oommagic.CellRun:
    return oommagic.history()[-1]


def test_one_huge_request(shell, cell, rounding):
    free, total = torch.cuda.mem_get_info()
    allocated, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    cell(f"%%gpumem --no-raise\nhuge = torch.empty({2 * total}, dtype=torch.uint8, device='cuda')")
    run, rep = last_run(), last_run().report
    print(
        f"huge request: requested {rep.requested:,d} (asked {2 * total:,d}); capacity {rep.capacity:,d} "
        f"(mem_get_info {total:,d}); free {rep.free:,d} ({free:,d}); allocated {rep.allocated} "
        f"({allocated}); "
        f"reserved {rep.reserved} ({reserved}); process_used {rep.process_used}"
    )
    assert run.outcome == "oom" and "huge" not in shell.user_ns
    assert abs(rep.requested - 2 * total) <= 2 * MiB
    assert abs(rep.capacity - total) <= rounding(total)
    assert abs(rep.free - free) <= rounding(free) + 64 * MiB
    assert abs(rep.allocated - allocated) <= rounding(allocated)
    assert abs((rep.reserved or 0) - reserved) <= 2 * rounding(reserved) + 1024
    assert rep.process_used is None or rep.process_used >= reserved
    assert abs(torch.cuda.memory_allocated() - allocated) <= 2 * MiB


SLOW_FILL = """%%gpumem --limit 4GiB --no-raise
def slow_fill(steps):
    w = torch.nn.Parameter(torch.zeros(1024, device="cuda"))
    opt = torch.optim.SGD([w], lr=0.1)
    kept = []
    for _ in range(steps):
        kept.append(torch.empty(256 * 1024**2, dtype=torch.uint8, device="cuda"))  # a leak per step
        w.grad = torch.ones_like(w)
        opt.step()
slow_fill(100)
"""


def test_slow_fill_across_optimizer_steps(cell, rounding):
    base = torch.cuda.memory_allocated()
    cell(SLOW_FILL)
    run = last_run()
    rep, tl = run.report, run.timeline
    print(
        f"slow fill: {len(tl.steps)} steps marked, OOM at {tl.oom_at} s "
        f"(last step {tl.steps[-1] if tl.steps else None}); "
        f"allocated at the error {rep.allocated:,d}; findings {[f.key for f in run.findings]}"
    )
    assert run.outcome == "oom"
    assert rep.limit == 4 * GiB and rep.requested == 256 * MiB
    assert 10 <= len(tl.steps) <= 16
    # The OOM comes after the last step; the trace's clock and time.time() may differ by a little.
    assert tl.oom_at is not None and tl.oom_at >= tl.steps[-1] - 0.01
    # Each completed step left one 256 MiB chunk; the message rounds to two decimals.
    assert abs(rep.allocated - base - len(tl.steps) * 256 * MiB) <= rounding(rep.allocated) + 2 * MiB
    assert abs(torch.cuda.memory_allocated() - base) <= 2 * MiB
    # What filled the card: the chunk kept every step, found from the allocated level between steps.
    assert run.findings[0].key == "growth", [f.key for f in run.findings]
    assert "rose 256.00 MiB per step" in run.findings[0].evidence


# Every step: a growing activation block is freed, then (after the optimizer step) a scratch block and a
# block kept across steps are carved out of its cached segment. The kept blocks pin every segment about
# half-empty: under 8 GiB it runs out at step ~20 with ~4 GiB reserved but unallocated. With expandable
# segments the free pages are unmapped and reused; with the cache emptied after each optimizer step the
# scratch and kept blocks get segments of their own. Either way the peak is ~5.9 GiB.
FRAGMENTING = """%%gpumem --limit 8GiB --no-raise
def fragmenting_steps(steps):
    w = torch.nn.Parameter(torch.zeros(1024, device="cuda"))
    opt = torch.optim.SGD([w], lr=0.1)
    kept = []
    for i in range(steps):
        mib = 256 + 16 * i
        activations = torch.empty(mib * 1024**2, dtype=torch.uint8, device="cuda")
        del activations
        w.grad = torch.ones_like(w)
        opt.step()
        scratch = torch.empty(2 * mib // 5 * 1024**2, dtype=torch.uint8, device="cuda")
        kept.append(torch.empty(mib // 2 * 1024**2, dtype=torch.uint8, device="cuda"))
        del scratch
    return len(kept)
fragmenting_steps(24)
"""


def fragmented_run(cell) -> oommagic.CellRun:
    base = torch.cuda.memory_allocated()
    cell(FRAGMENTING)
    run = last_run()
    rep = run.report
    print(
        f"fragmentation: outcome {run.outcome}; reserved {rep.reserved}, reserved but unallocated "
        f"{rep.reserved_unallocated}, allocated {rep.allocated}, requested {rep.requested}"
    )
    assert run.outcome == "oom"
    assert rep.reserved_unallocated is not None and rep.reserved_unallocated >= 1 * GiB
    assert rep.reserved_unallocated >= 0.25 * rep.reserved
    assert abs(torch.cuda.memory_allocated() - base) <= 2 * MiB
    return run


def test_fragmentation_fits_with_expandable_segments(cell, retry_with):
    from oommagic.diagnosis.context import expandable_segments_on

    widget = retry_with(fragmented_run(cell), "expandable_segments")
    assert widget.runs[-1].outcome == "ok"
    assert not expandable_segments_on(), "the retry left expandable segments on"


def test_fragmentation_fits_with_the_cache_emptied_every_step(cell, retry_with):
    from torch.optim.optimizer import _global_optimizer_post_hooks

    from oommagic.diagnosis.findings import Remedy

    hooks = len(_global_optimizer_post_hooks)
    # Fragmentation is expandable segments' case; the cache-clearing retry is proven on it all the same.
    hand_made = Remedy(
        "empty_cache",
        "Empty the cache after every optimizer step",
        automatic=True,
        params={"every": "optimizer_step"},
    )
    widget = retry_with(fragmented_run(cell), "empty_cache", hand_made)
    assert widget.runs[-1].outcome == "ok"
    assert len(_global_optimizer_post_hooks) == hooks
