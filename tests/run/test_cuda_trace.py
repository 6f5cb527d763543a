"""The CUDA allocator trace replayed with plain data (no GPU here): the column replay gives exactly what a
loop over the entries gives (timeline, events, the peak, the blocks alive before the trace), the history
leaves out what the replay never reads where torch can, and a snapshot written for PyTorch's viewer gets
its frees back."""

from __future__ import annotations

import pickle
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from oommagic.categories import Block, live_at
from oommagic.run.capture.cuda import SKIPPED_ACTIONS, record_history
from oommagic.run.capture.snapshot_file import for_viewer, write_snapshot
from oommagic.run.capture.trace import (
    CUDA_TRACE_ENTRIES,
    TraceColumns,
    TraceEvents,
    cuda_timeline,
    live_at_event,
    packed,
    snapshot_blocks,
    start_blocks,
    unpacked,
    user_line,
)
from oommagic.timeline import Timeline

# --- the reference: one loop over the entries, as the replay was first written ---------------------------


def reference_replay(snapshot, index, start_us, before, steps, origin_us=None):
    """(Timeline, events, peak, top) by a plain loop: each entry read in turn."""
    origin = start_us if origin_us is None else origin_us
    traces = snapshot.get("device_traces") or []
    entries = traces[index] if index < len(traces) else []
    allocated, reserved = before
    top, peak = allocated, -1
    t, a, r, events = [0.0], [allocated], [reserved], []
    oom_at = None
    for e in entries:
        when = e.get("time_us", 0)
        if when < start_us:
            continue
        action = e.get("action")
        size = -(-e.get("size", 0) // 512) * 512
        if action == "alloc":
            allocated += size
            frames = e.get("frames")
            events.append((when, e["addr"], size, None, user_line(frames) if frames else None))
            if allocated > top:
                top, peak = allocated, len(events) - 1
        elif action == "free_requested":
            allocated -= size
            events.append((when, e["addr"], -size, None, None))
        elif action in ("segment_alloc", "segment_map"):
            reserved += size
        elif action in ("segment_free", "segment_unmap"):
            reserved -= size
        elif action == "oom":
            oom_at = (when - origin) / 1e6
        else:
            continue
        t.append(max((when - origin) / 1e6, 0.0))
        a.append(allocated)
        r.append(reserved)
    first = entries[0].get("time_us", 0) if entries else 0
    truncated = len(entries) >= CUDA_TRACE_ENTRIES and first > start_us
    timeline = Timeline(
        t=tuple(t),
        allocated=tuple(a),
        reserved=tuple(r),
        steps=tuple(steps),
        oom_at=oom_at,
        truncated=truncated,
        events=len(t) - 1,
    )
    return timeline, events, peak, top


def reference_start(events, end_blocks):
    born, start = set(), {}
    for _, addr, size, _op, _line in events:
        if size > 0:
            born.add(addr)
        elif addr not in born and addr not in start:
            start[addr] = Block(addr, -size)
    for b in end_blocks:
        if b.key not in born:
            start.setdefault(b.key, b)
    return start


def assert_same_replay(snapshot, start_us=0.0, before=(0, 0), origin_us=None, lines=True):
    steps = [0.001, 0.002]
    timeline, events, peak, top = reference_replay(snapshot, 0, start_us, before, steps, origin_us)
    replayed = TraceEvents()
    got = cuda_timeline(snapshot, 0, start_us, before, steps, origin_us, events=replayed, lines=lines)
    assert got == timeline
    assert [type(x) for x in got.allocated] == [type(x) for x in timeline.allocated]
    assert list(replayed) == events
    assert [replayed[i] for i in range(len(replayed))] == events
    assert (replayed.peak, replayed.top) == (peak, top)
    blocks, _ = snapshot_blocks(snapshot, 0)
    start = start_blocks(replayed, blocks)
    assert list(start.items()) == list(reference_start(events, blocks).items())
    expected = live_at(start, events, peak)
    assert live_at(start, replayed, replayed.peak) == expected
    got_live = live_at_event(start, replayed, replayed.peak)
    assert got_live == expected and list(got_live) == list(expected), "the same blocks, in the same order"
    # Kept as columns (what a recorder keeps), the snapshot replays the same and unpacks to itself.
    kept = packed(snapshot)
    assert unpacked(kept) == snapshot
    again = TraceEvents()
    assert cuda_timeline(kept, 0, start_us, before, steps, origin_us, events=again, lines=lines) == timeline
    assert list(again) == list(replayed)
    assert (again.peak, again.top) == (peak, top)
    return got, replayed


# --- traces -------------------------------------------------------------------------------------------

A, B, OLD = 0x7F0000000000, 0x7F0000000400, 0x7F0000000800


def small_op_loop(steps: int, t0: int = 1_795_552_353_267_890, completed: bool = True) -> dict:
    """What `_x = _x * 1.0001` in a loop leaves (the trace of the failure_snapshot benchmark's cell): each
    step allocates the new 1 KiB block and frees the old one; the first frees a block from before."""
    trace, when, live, spare = [], t0, OLD, A
    for i in range(steps):
        when += i % 5
        trace.append({"action": "alloc", "addr": spare, "size": 1024, "stream": 0, "time_us": when})
        for action in ("free_requested", "free_completed") if completed else ("free_requested",):
            trace.append({"action": action, "addr": live, "size": 1024, "stream": 0, "time_us": when + 1})
        live, spare = spare, live if live != OLD else B
    segment = {
        "device": 0,
        "address": A,
        "total_size": 2 << 20,
        "blocks": [{"address": live, "size": 1024, "state": "active_allocated", "frames": []}],
    }
    return {"segments": [segment], "device_traces": [trace]}


def test_the_small_op_loop_replays_as_the_loop_does():
    snapshot = small_op_loop(10_000)
    first = snapshot["device_traces"][0][0]["time_us"]
    timeline, events = assert_same_replay(snapshot, before=(1024, 2 << 20), origin_us=first - 50, lines=False)
    assert timeline.events == 20_000 and len(events) == 20_000
    assert timeline.peak_allocated == 2048 and events.peak == 0


def test_leaving_out_free_completed_changes_nothing_the_replay_shows():
    full, lean = small_op_loop(500), small_op_loop(500, completed=False)
    assert cuda_timeline(full, 0, 0.0, (1024, 0), []) == cuda_timeline(lean, 0, 0.0, (1024, 0), [])


def test_a_trace_with_segments_ooms_frames_and_a_start_cut():
    def e(action, addr, size, when, **extra):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": when, **extra}

    frames = [{"filename": "/x/torch/nn/functional.py", "line": 1, "name": "f"}]
    frames.append({"filename": "/home/me/train.py", "line": 7, "name": "step"})
    trace = [
        e("alloc", A, 4096, 90),  # before the cut
        e("segment_alloc", A, 2 << 20, 100),
        e("alloc", A, 1000, 101, frames=frames),  # rounds up to 1024
        e("alloc", B, 3 << 20, 102, frames=[]),
        e("snapshot", 0, 0, 103),
        e("free_requested", OLD, 512, 104),  # a block from before the cell
        e("free_completed", OLD, 512, 104),
        e("segment_map", B, 4 << 20, 105),
        e("oom", 8 << 30, 1 << 30, 106, device_free=12345),
        e("free_requested", A, 1000, 107),
        e("alloc", A, 1024, 108, frames=frames),
        e("segment_unmap", B, 4 << 20, 109),
        e("segment_free", A, 2 << 20, 110),
        e("user_defined", 0, 0, 111),
    ]
    snapshot = {"segments": [], "device_traces": [[], []]}
    snapshot["device_traces"][0] = trace
    timeline, events = assert_same_replay(snapshot, start_us=100, before=(512, 0), origin_us=95)
    assert timeline.oom_at == (106 - 95) / 1e6 and timeline.events == 10
    assert events.lines[0] == "train.py:7 in step" and events.peak == 1
    assert_same_replay(snapshot, start_us=0.0, before=(0, 0))
    assert_same_replay({"device_traces": [trace]}, start_us=200)  # all before the start: no events
    assert cuda_timeline(snapshot, 5, 0.0, (7, 9), [0.5]) == Timeline(
        t=(0.0,), allocated=(7,), reserved=(9,), steps=(0.5,)
    )


def test_a_hand_written_trace_may_leave_fields_out():
    trace = [{"action": "segment_alloc", "size": 2 << 20}, {"action": "oom"}, {"time_us": 5}]
    assert_same_replay({"device_traces": [trace]})


ACTIONS = ["alloc", "free_requested", "free_completed", "segment_alloc", "segment_free", "segment_map"]
ACTIONS += ["segment_unmap", "oom", "snapshot"]
ENTRY = st.fixed_dictionaries(
    {
        "action": st.sampled_from(ACTIONS),
        "addr": st.sampled_from([A, B, OLD, A + 4096]),
        "size": st.integers(0, 1 << 22),
        "time_us": st.integers(1_000, 1_200),
    },
    optional={"frames": st.just([{"filename": "<ipython-input-3-x>", "line": 2, "name": "<module>"}])},
)


@settings(max_examples=200, deadline=None)
@given(
    entries=st.lists(ENTRY, max_size=60),
    start_us=st.sampled_from([0.0, 1_100.0, 1_100]),
    before=st.tuples(st.integers(0, 1 << 24), st.integers(0, 1 << 26)),
)
def test_any_trace_replays_as_the_loop_does(entries, start_us, before):
    entries.sort(key=lambda e: e["time_us"])
    assert_same_replay({"device_traces": [entries]}, start_us, before, origin_us=1_050.0)


# --- recording the history ----------------------------------------------------------------------------


def fake_torch(record):
    return SimpleNamespace(cuda=SimpleNamespace(memory=SimpleNamespace(_record_memory_history=record)))


def test_the_history_leaves_out_free_completed_where_torch_can():
    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=0, skip_actions=None):
        calls.append((context, skip_actions))

    assert record_history(fake_torch(record), stacks=False) == SKIPPED_ACTIONS == ("free_completed",)
    assert calls == [(None, ["free_completed"])]


def test_an_older_torch_records_everything():
    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=0, device=None):
        calls.append((enabled, context, stacks, max_entries))

    assert record_history(fake_torch(record), stacks=True) == ()
    assert calls == [("all", "alloc", "python", CUDA_TRACE_ENTRIES)]


def test_a_torch_that_names_actions_otherwise_records_everything():
    calls = []

    def record(enabled="all", context="all", stacks="all", max_entries=0, skip_actions=None):
        if skip_actions:
            raise RuntimeError(f"unknown action {skip_actions[0]}")
        calls.append(context)

    assert record_history(fake_torch(record), stacks=False) == ()
    assert calls == [None]


# --- the snapshot for PyTorch's viewer ----------------------------------------------------------------


def test_a_snapshot_written_for_the_viewer_gets_its_frees_back(tmp_path):
    snapshot = small_op_loop(3, completed=False)
    snapshot["oommagic"] = {"skipped_actions": ["free_completed"]}
    target = write_snapshot(snapshot, tmp_path / "run.pickle")
    with target.open("rb") as f:
        written = pickle.load(f)
    assert written["device_traces"] == small_op_loop(3)["device_traces"]
    assert snapshot["device_traces"] == small_op_loop(3, completed=False)["device_traces"], "left as it was"
    assert for_viewer(small_op_loop(3)) == small_op_loop(3), "a full trace is left alone"


# --- the trace a recorder keeps -----------------------------------------------------------------------


def test_a_trace_is_kept_as_columns_and_given_back_as_the_allocators_dicts():
    snapshot = small_op_loop(1_000, completed=False)
    for entry in snapshot["device_traces"][0]:
        entry.update(compile_context="N/A", user_metadata="", frames=[])
    oom = {"action": "oom", "device_free": 5, "size": 1 << 30, "stream": 0, "time_us": 9}
    oom.update(compile_context="N/A", user_metadata="", frames=[])
    snapshot["device_traces"][0].insert(10, oom)
    marked = {**snapshot["device_traces"][0][20], "user_metadata": "step 3"}
    snapshot["device_traces"][0][20] = marked
    kept = packed(snapshot)
    trace = kept["device_traces"][0]
    assert isinstance(trace, TraceColumns) and len(trace) == 2_001 and trace.whole == {10: oom}
    assert trace.values["time_us"].dtype.name == "int64" and trace.values["stream"].value == 0
    assert trace.frames() is None and isinstance(trace.values["user_metadata"], list), "one entry marked"
    back = unpacked(kept)
    assert back == snapshot and back["device_traces"][0][20]["user_metadata"] == "step 3"
    assert back["device_traces"][0][0]["frames"] is not back["device_traces"][0][1]["frames"]
    assert unpacked(snapshot) is snapshot
    assert packed(kept)["device_traces"][0] is trace, "kept once"


def test_a_trace_with_frames_on_some_entries_keeps_them():
    frames = [{"filename": "<ipython-input-3-x>", "line": 2, "name": "<module>"}]
    trace = [
        {"action": "alloc", "addr": A, "size": 512, "time_us": 1, "frames": frames},
        {"action": "free_requested", "addr": A, "size": 512, "time_us": 2},
    ]
    kept = TraceColumns.read(trace)
    assert kept.frames() is not None and kept.entries() == trace and not kept.whole
    uneven = [{"action": "oom", "size": 1}, {"action": "alloc", "addr": 1}, {"time_us": 5}]
    assert unpacked(packed({"t": 1, "device_traces": [uneven]}))["device_traces"] == [uneven]
    assert TraceColumns.read([]).entries() == []
