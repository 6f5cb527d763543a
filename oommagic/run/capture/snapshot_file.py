"""Write a run's allocator snapshot where PyTorch's viewer opens it: a pickle for pytorch.org/memory_viz
(drag and drop) and ``python -m torch.cuda._memory_viz``, or, for a name ending in ``.html``, the viewer's
own page with the snapshot inside (``torch.cuda._memory_viz.trace_plot``)."""

from __future__ import annotations

import pickle
from pathlib import Path


def write_snapshot(snapshot: dict, path: str | Path) -> Path:
    """Write ``snapshot`` to ``path`` (pickle, or the viewer's HTML page for ``*.html``); returns the path.
    Touches only that file."""
    target = Path(path).expanduser()
    if target.suffix.lower() == ".html":
        from torch.cuda._memory_viz import trace_plot

        target.write_text(trace_plot(snapshot), encoding="utf-8")
    else:
        with target.open("wb") as f:
            pickle.dump(snapshot, f)
    return target
