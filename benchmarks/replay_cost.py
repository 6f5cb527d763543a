"""What the Python side of a ``%%gpumem`` cell costs at 20,000 allocation events, on any machine: the
allocator trace's replay (a loop over the entries, as it was first written, against ``cuda_timeline``, on
the same trace in one run), then whole ``%%gpumem --quiet`` cells on a stand-in CUDA device whose
allocator hands back a recorded snapshot, the cost split into its parts.

The stand-in answers the CUDA calls a ``CudaRecorder`` makes (``torch.cuda`` patched at the hardware edge)
and ``_snapshot()`` returns the snapshot at once: what the real allocator takes to build it (19 ms for
30,003 entries on an H100 host) is for ``failure_snapshot.py`` on a GPU to measure.

    python benchmarks/replay_cost.py                          # the trace of 10,000 small ops, made here
    python benchmarks/replay_cost.py --snapshot snap.pickle   # a snapshot written on a GPU
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import pickle
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cell_parts
import report

STEPS = 10_000
ADDRESSES = (0x7F0000000000, 0x7F0000000400)


def small_op_loop(steps: int, completed: bool) -> dict:
    """The snapshot `_x = _x * 1.0001` repeated ``steps`` times leaves on a GPU (the shape of one recorded
    on an H100: two 1 KiB blocks taking turns, times 0-6 µs apart); ``completed``: with the
    free_completed entries a history keeps unless told to skip them."""
    trace, when, live = [], int(time.time() * 1e6) - 3 * steps, 0x7EFF00000000
    for i in range(steps):
        new = ADDRESSES[i % 2]
        when += i % 7
        trace.append({"action": "alloc", "addr": new, "size": 1024, "stream": 0, "time_us": when})
        for action in ("free_requested", "free_completed") if completed else ("free_requested",):
            trace.append({"action": action, "addr": live, "size": 1024, "stream": 0, "time_us": when + 1})
        live = new
    block = {"address": live, "size": 1024, "requested_size": 1024, "state": "active_allocated", "frames": []}
    segment = {"device": 0, "address": ADDRESSES[0], "total_size": 2 << 20, "blocks": [block]}
    return {"segments": [segment], "device_traces": [trace]}


def without_free_completed(snapshot: dict) -> dict:
    traces = [
        [e for e in trace if e.get("action") != "free_completed"] for trace in snapshot["device_traces"]
    ]
    return {**snapshot, "device_traces": traces}


# --- the replay as it was first written: one loop over the entries, a tuple per event ----------------


def loop_replay(snapshot: dict, index: int, start_us: float, before: tuple[int, int], origin: float) -> Any:
    from oommagic.run.capture.trace import user_line
    from oommagic.timeline import Timeline

    entries = snapshot["device_traces"][index]
    allocated, reserved = before
    top, peak = allocated, -1
    t, a, r, events = [0.0], [allocated], [reserved], []
    oom_at = None
    alloc_delta = {"alloc": 1, "free_requested": -1}
    reserve_delta = {"segment_alloc": 1, "segment_map": 1, "segment_free": -1, "segment_unmap": -1}
    for e in entries:
        when = e.get("time_us", 0)
        if when < start_us:
            continue
        action = e.get("action")
        size = -(-e.get("size", 0) // 512) * 512
        if action in alloc_delta:
            allocated += alloc_delta[action] * size
            if action == "alloc":
                frames = e.get("frames")
                events.append((when, e["addr"], size, None, user_line(frames) if frames else None))
                if allocated > top:
                    top, peak = allocated, len(events) - 1
            else:
                events.append((when, e["addr"], -size, None, None))
        elif action in reserve_delta:
            reserved += reserve_delta[action] * size
        elif action == "oom":
            oom_at = (when - origin) / 1e6
        else:
            continue
        t.append(max((when - origin) / 1e6, 0.0))
        a.append(allocated)
        r.append(reserved)
    timeline = Timeline(t=tuple(t), allocated=tuple(a), reserved=tuple(r), oom_at=oom_at, events=len(t) - 1)
    return timeline, events, peak


def column_replay(snapshot: dict, index: int, start_us: float, before: tuple[int, int], origin: float) -> Any:
    from oommagic.run.capture.trace import TraceEvents, cuda_timeline

    events = TraceEvents()
    timeline = cuda_timeline(snapshot, index, start_us, before, [], origin, events=events, lines=False)
    return timeline, events, events.peak


def replay_rows(snapshot: dict, rounds: int) -> tuple[list[list], float]:
    """Loop vs columns on the same trace, alternated round by round (ms, medians), each checked against
    the other first; then the loop on the trace with free_completed against the columns without."""
    first = snapshot["device_traces"][0][0]["time_us"]
    args = (0, 0.0, (1024, 2 << 20), first - 100.0)
    lean = without_free_completed(snapshot)
    old_tl, old_events, old_peak = loop_replay(snapshot, *args)
    new_tl, new_events, new_peak = column_replay(snapshot, *args)
    assert new_tl == old_tl and list(new_events) == old_events and new_peak == old_peak, "replays differ"
    assert column_replay(lean, *args)[0] == old_tl, "free_completed changed the replay"
    times: dict[str, list[float]] = {"loop": [], "columns": [], "columns, lean": []}
    for _ in range(rounds):
        for name, replay, snap in (
            ("loop", loop_replay, snapshot),
            ("columns", column_replay, snapshot),
            ("columns, lean", column_replay, lean),
        ):
            t0 = time.perf_counter()
            replay(snap, *args)
            times[name].append((time.perf_counter() - t0) * 1e3)
    entries, lean_entries = len(snapshot["device_traces"][0]), len(lean["device_traces"][0])
    loop, columns, lean_ms = (statistics.median(times[k]) for k in times)
    rows = [
        ["loop over the entries (before)", f"{entries:,d}", f"{loop:.2f}", "1.00"],
        ["columns + numpy", f"{entries:,d}", f"{columns:.2f}", f"{loop / columns:.2f}"],
        ["columns, history without free_completed (after)", f"{lean_entries:,d}", f"{lean_ms:.2f}", ""],
    ]
    return rows, loop / lean_ms


# --- whole cells on a stand-in CUDA device -------------------------------------------------------------


@contextlib.contextmanager
def stand_in_cuda(snapshot: dict) -> Iterator[None]:
    """``torch.cuda`` as a machine without a GPU would see one device: the calls a ``CudaRecorder`` makes
    answered with fixed figures, and ``_snapshot()`` handing back ``snapshot``."""
    from unittest import mock

    import torch

    stats = {
        "allocated_bytes.all.peak": 2048,
        "reserved_bytes.all.peak": 2 << 20,
        "allocated_bytes.all.current": 1024,
        "reserved_bytes.all.current": 2 << 20,
    }
    cuda, memory, c = torch.cuda, torch.cuda.memory, torch._C
    patches = [
        mock.patch.object(cuda, "is_available", lambda: True),
        mock.patch.object(cuda, "is_initialized", lambda: True),
        mock.patch.object(cuda, "current_device", lambda: 0),
        mock.patch.object(cuda, "device_count", lambda: 1),
        mock.patch.object(cuda, "mem_get_info", lambda *a: (78 << 30, 80 << 30)),
        mock.patch.object(cuda, "memory_allocated", lambda *a: 1024),
        mock.patch.object(cuda, "memory_reserved", lambda *a: 2 << 20),
        mock.patch.object(cuda, "reset_peak_memory_stats", lambda *a: None),
        mock.patch.object(cuda, "memory_stats", lambda *a: dict(stats)),
        mock.patch.object(cuda, "empty_cache", lambda: None),
        mock.patch.object(memory, "_snapshot", lambda *a, **k: dict(snapshot)),
        mock.patch.object(memory, "_record_memory_history", lambda *a, **k: None),
        mock.patch.object(c, "_cuda_isHistoryEnabled", lambda: False, create=True),
        mock.patch.object(c, "_cuda_attach_out_of_memory_observer", lambda cb: None, create=True),
    ]
    with contextlib.ExitStack() as stack:
        for p in patches:
            stack.enter_context(p)
        yield


def cell_rows(snapshot: dict, rounds: int, profile: bool) -> tuple[list[list], float]:
    """Plain cells against ``%%gpumem --quiet`` cells on the stand-in device, alternated (ms, medians)."""
    from IPython.core.interactiveshell import InteractiveShell

    import oommagic

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "oommagic")
    shell.run_cell("import torch")
    work = "_y = sum(range(100))\n"
    parts: list[dict[str, float]] = []
    plain, magic = [], []
    with stand_in_cuda(snapshot):
        for r in range(rounds + 2):
            t0 = time.perf_counter()
            shell.run_cell(work)
            p = time.perf_counter() - t0
            timings: dict[str, float] = {}
            with cell_parts.timed(timings):
                t0 = time.perf_counter()
                shell.run_cell("%%gpumem --quiet\n" + work)
                m = time.perf_counter() - t0
            if r >= 2:  # the first two: imports
                plain.append(p * 1e3)
                magic.append(m * 1e3)
                parts.append(timings)
        if profile:
            import cProfile
            import pstats

            prof = cProfile.Profile()
            prof.enable()
            for _ in range(5):
                shell.run_cell("%%gpumem --quiet\n" + work)
            prof.disable()
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
    replayed = sum(e.get("action") in ("alloc", "free_requested") for e in snapshot["device_traces"][0])
    run = oommagic.history()[-1]
    assert run.device == "cuda:0" and run.timeline.events == replayed, "the stand-in cell replayed the trace"
    fixed = statistics.median(magic) - statistics.median(plain)
    return cell_parts.rows(parts, fixed), fixed


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--snapshot", help="a snapshot pickle (torch.cuda.memory._snapshot()) to replay")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--profile", action="store_true", help="print a cProfile of five stand-in cells")
    args = parser.parse_args()
    if args.snapshot:
        with open(args.snapshot, "rb") as f:
            snapshot = pickle.load(f)
        source = f"`{Path(args.snapshot).name}`"
    else:
        snapshot = small_op_loop(STEPS, completed=True)
        source = f"made here: {STEPS:,d} small ops, the shape of the trace recorded on an H100"
    gc.collect()
    replay, ratio = replay_rows(snapshot, args.rounds)
    report.summary("replay of the trace: loop / columns without free_completed", f"{ratio:.2f}x", "", None)
    cells, fixed = cell_rows(without_free_completed(snapshot), args.rounds, args.profile)
    report.summary("stand-in CUDA cell: fixed cost on the CPU side", f"{fixed:+.1f} ms", "", None)
    body = (
        f"Trace: {source}. Medians of {args.rounds} rounds, alternated, after a check that both replays "
        "give the same timeline, events and peak.\n\n"
        + report.table(["replay", "entries", "ms", "× faster"], replay)
        + "\n\n`%%gpumem --quiet` cells against plain cells on a stand-in CUDA device (torch.cuda patched, "
        "its snapshot the trace above without free_completed, handed back at once), per part:\n\n"
        + report.table(cell_parts.HEADERS, cells)
    )
    import torch

    env = report.environment("cpu")
    env["torch"] = torch.__version__
    report.write_markdown("replay_cost", "The Python side of a %%gpumem cell at 20,000 events", env, body)
    print(body)
    print(f"wrote {report.out_dir() / 'replay_cost.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
