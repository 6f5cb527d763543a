"""Write a run's allocator snapshot where PyTorch's viewer opens it: a pickle for pytorch.org/memory_viz
(drag and drop) and ``python -m torch.cuda._memory_viz``, or, for a name ending in ``.html``, the viewer's
own page with the snapshot inside (``torch.cuda._memory_viz.trace_plot``)."""

from __future__ import annotations

import pickle
from pathlib import Path


def write_snapshot(snapshot: dict, path: str | Path) -> Path:
    """Write ``snapshot`` to ``path`` (pickle, or the viewer's HTML page for ``*.html``) as the viewer
    reads it (``for_viewer``); returns the path. Touches only that file."""
    target = Path(path).expanduser()
    snapshot = for_viewer(snapshot)
    if target.suffix.lower() == ".html":
        from torch.cuda._memory_viz import trace_plot

        target.write_text(trace_plot(snapshot), encoding="utf-8")
    else:
        with target.open("wb") as f:
            pickle.dump(snapshot, f)
    return target


def for_viewer(snapshot: dict) -> dict:
    """``snapshot`` with a free_completed after each free_requested where the recorder left them out of
    the history (``snapshot["oommagic"]["skipped_actions"]``): the viewer ends a block's life at its
    free_completed. A new dict; ``snapshot`` stays as it was."""
    if "free_completed" not in snapshot.get("oommagic", {}).get("skipped_actions", ()):
        return snapshot
    traces = []
    for trace in snapshot.get("device_traces", ()):
        restored = []
        for entry in trace:
            restored.append(entry)
            if entry.get("action") == "free_requested":
                # Without another stream using the block, the allocator completes the free at once.
                restored.append({**entry, "action": "free_completed"})
        traces.append(restored)
    return {**snapshot, "device_traces": traces}
