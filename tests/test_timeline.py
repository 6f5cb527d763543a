"""Timeline maths with plain data: downsampling keeps the peak, the CUDA trace replay."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from oommagic.run.capture import cuda_timeline
from oommagic.timeline import Timeline


def test_downsampling_keeps_peak_and_dips():
    rng = random.Random(1)
    n = 50_000
    alloc = [rng.randrange(1000) for _ in range(n)]
    alloc[31_337] = 10**9
    tl = Timeline(
        t=tuple(i / 1000 for i in range(n)), allocated=tuple(alloc), reserved=tuple(a + 5 for a in alloc)
    )
    small = tl.downsample(400)
    assert len(small.t) <= 1_300
    assert small.peak_allocated == 10**9 and small.peak_reserved == 10**9 + 5
    assert min(small.allocated) == min(alloc)
    assert small.t == tuple(sorted(small.t)) and small.t[-1] == tl.t[-1]


def reference_downsample(tl: Timeline, points: int) -> list[int]:
    """The samples a downsample keeps, picked one sample at a time."""
    n = len(tl.t)
    if n <= points:
        return list(range(n))
    per = max(1, (3 * n) // points)
    keep = []
    for start in range(0, n, per):
        idx = range(start, min(start + per, n))
        picked = {start, max(idx, key=tl.allocated.__getitem__), min(idx, key=tl.allocated.__getitem__)}
        picked.add(max(idx, key=tl.reserved.__getitem__))
        keep.extend(sorted(picked))
    return keep if keep[-1] == n - 1 else [*keep, n - 1]


@given(
    levels=st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), min_size=1, max_size=300),
    points=st.integers(1, 60),
)
def test_downsampling_keeps_the_first_extremes_of_each_bucket(levels, points):
    tl = Timeline(
        t=tuple(i / 10 for i in range(len(levels))),
        allocated=tuple(a for a, _ in levels),
        reserved=tuple(a + r for a, r in levels),
        oom_at=0.5,
        events=len(levels),
    )
    keep = reference_downsample(tl, points)
    small = tl.downsample(points)
    assert small.t == tuple(tl.t[i] for i in keep)
    assert small.allocated == tuple(tl.allocated[i] for i in keep)
    assert small.reserved == tuple(tl.reserved[i] for i in keep)
    assert (small.oom_at, small.events) == (tl.oom_at, tl.events)


def test_step_peaks_split_at_optimizer_steps():
    tl = Timeline(t=(0, 1, 2, 3, 4, 5), allocated=(1, 5, 2, 7, 3, 4), reserved=(0,) * 6, steps=(1.5, 3.5))
    assert tl.step_peaks() == [5, 7, 4]
    assert Timeline().step_peaks() == []


def test_json_round_trip():
    tl = Timeline(t=(0.0, 1.0), allocated=(1, 2), reserved=(3, 4), steps=(0.5,), oom_at=1.0)
    assert Timeline.from_json(tl.to_json()) == tl


def test_cuda_trace_replay_matches_the_allocator_counters():
    start_us = 1_000_000.0
    trace = [
        {"action": "alloc", "size": 512, "time_us": 999_000},  # before the cell: ignored
        {"action": "segment_alloc", "size": 2 << 20, "time_us": 1_000_100},
        {"action": "alloc", "size": 1 << 20, "time_us": 1_000_200},
        {"action": "alloc", "size": 512 << 10, "time_us": 1_000_300},
        {"action": "free_requested", "size": 1 << 20, "time_us": 1_000_400},
        {"action": "free_completed", "size": 1 << 20, "time_us": 1_000_401},
        {"action": "oom", "size": 8 << 30, "time_us": 1_000_500},
        {"action": "segment_free", "size": 2 << 20, "time_us": 1_000_600},
    ]
    snap = {"device_traces": [[], trace]}
    tl = cuda_timeline(snap, 1, start_us=start_us, before=(4096, 8192), steps=[0.0003])
    assert tl.peak_allocated == 4096 + (1 << 20) + (512 << 10)
    assert tl.allocated[-1] == 4096 + (512 << 10)
    assert tl.peak_reserved == 8192 + (2 << 20) and tl.reserved[-1] == 8192
    assert abs(tl.oom_at - 0.0005) < 1e-9
    assert tl.steps == (0.0003,) and tl.events == 6
    assert not tl.truncated


def test_step_floors_are_what_stays_between_steps():
    # Each step: the batch comes in (+100), is freed (-100), and 10 bytes stay (a leak).
    t = (0, 1, 2, 3, 4, 5, 6, 7, 8, 9)
    alloc = (0, 100, 10, 110, 20, 120, 30, 130, 40, 0)  # the last sample: memory given back after the OOM
    tl = Timeline(t=t, allocated=alloc, reserved=alloc, steps=(1.5, 3.5, 5.5, 7.5), oom_at=8.5)
    assert tl.step_floors() == [10, 20, 30, 40]
    assert Timeline().step_floors() == []
