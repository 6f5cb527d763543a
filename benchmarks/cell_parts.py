"""Where the fixed cost of a ``%%gpumem`` cell goes: the allocator snapshot, the rest of the recorder's
exit, the trace's replay into a timeline, the breakdown by category, the publish to the sidebar, and what
the magic does besides. Wraps those calls with timers while the cells run; changes nothing they do."""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Iterator
from typing import Any

# (label, where the time goes) in the order of a cell's life.
PARTS = (
    ("snapshot", "torch.cuda.memory._snapshot()"),
    ("exit", "the recorder's exit besides the snapshot and the replay (memory_stats, history off)"),
    ("replay", "the trace packed into columns and replayed into the timeline (in the recorder's exit)"),
    ("categories", "the breakdown by category at the peak"),
    ("publish", "the run sent to the sidebar (comm.publish)"),
)


@contextlib.contextmanager
def timed(into: dict[str, float]) -> Iterator[None]:
    """Add the milliseconds each part of ``PARTS`` took while the block runs to ``into``."""
    from unittest import mock

    import torch

    from oommagic import comm
    from oommagic.run.capture import cuda
    from oommagic.run.capture.cuda import CudaRecorder

    def timer(owner: Any, name: str, label: str) -> Any:
        original = getattr(owner, name, None)
        if original is None:  # an older oommagic, for a comparison: that part is left in "rest"
            return contextlib.nullcontext()

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                into[label] = into.get(label, 0.0) + (time.perf_counter() - t0) * 1e3

        return mock.patch.object(owner, name, timed_call)

    with (
        timer(torch.cuda.memory, "_snapshot", "snapshot"),
        timer(CudaRecorder, "__exit__", "exit"),
        timer(cuda, "packed", "replay"),
        timer(cuda, "cuda_timeline", "replay"),
        timer(CudaRecorder, "categories", "categories"),
        timer(comm, "publish", "publish"),
    ):
        yield
    # The exit's own time, without the snapshot it takes and the replay it does.
    into["exit"] = into.get("exit", 0.0) - into.get("snapshot", 0.0) - into.get("replay", 0.0)


def rows(parts: list[dict[str, float]], fixed_ms: float) -> list[list[str]]:
    """A table of the parts' medians over cells, then the rest of ``fixed_ms`` (magic − plain cell)."""
    medians = {label: statistics.median(p.get(label, 0.0) for p in parts) for label, _ in PARTS}
    table = [[label, what, f"{medians[label]:.2f}"] for label, what in PARTS]
    rest = fixed_ms - sum(medians.values())
    table.append(
        ["rest", "the magic besides (options, the run record, roles, ranks, NVML, IPython)", f"{rest:.2f}"]
    )
    table.append(["fixed cost", "%%gpumem cell − plain cell", f"{fixed_ms:.2f}"])
    return table


HEADERS = ["part", "what", "ms per cell (median)"]
