"""The memory timeline as a small PNG: allocated and reserved over time, capacity and limit lines,
optimizer steps and the out-of-memory moment marked. Uses matplotlib's Agg canvas directly, so it
neither needs nor changes the notebook's plotting backend."""

from __future__ import annotations

import io
from dataclasses import replace

from ..cellrun import CellRun
from ..timeline import Timeline

GIB = 1024**3


def drawn(tl: Timeline) -> Timeline:
    """The part of ``tl`` the picture shows: up to the out-of-memory error, where the run ended. What the
    recorder saw after it is the memory given back, a flat line at the bottom that would take half the
    picture after an early failure."""
    end = tl.oom_at
    if end is None:
        return tl
    n = sum(1 for x in tl.t if x <= end)
    t, allocated, reserved = tl.t[:n], tl.allocated[:n], tl.reserved[:n]
    if t and t[-1] < end:
        # What was held at the last allocation stayed held until the error was raised.
        t, allocated, reserved = (*t, end), (*allocated, allocated[-1]), (*reserved, reserved[-1])
    return replace(
        tl, t=t, allocated=allocated, reserved=reserved, steps=tuple(x for x in tl.steps if x <= end)
    )


def timeline_png(run: CellRun, width: float = 7.0, height: float = 2.0) -> bytes:
    """PNG bytes of ``run``'s timeline."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tl = drawn(run.timeline.downsample(800))
    t, allocated, reserved, steps, end = tl.t, tl.allocated, tl.reserved, tl.steps, tl.oom_at
    # The frame: the limit, else the card; in CPU mode without a limit the host's memory would flatten
    # the curve, so the curve alone.
    frame = run.limit or (run.capacity if run.device != "cpu" else None)
    scale, unit = (GIB, "GiB") if max(run.peak_reserved, frame or 0) >= GIB / 2 else (1024**2, "MiB")
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    if t:
        ax.step(t, [r / scale for r in reserved], where="post", color="#9bb7d4", label="reserved")
        ax.fill_between(t, [a / scale for a in allocated], step="post", color="#3b75af", alpha=0.35)
        ax.step(t, [a / scale for a in allocated], where="post", color="#3b75af", label="allocated")
    if run.options.no_timeline:
        # The start and the end only: draw the exact peak the line between them cannot show.
        ax.axhline(
            run.peak_allocated / scale, color="#3b75af", lw=1, ls=":", label="peak (--no-timeline: no curve)"
        )
    # A capacity far above the limit would squash the curve: with a limit, the limit is the frame.
    if run.capacity and run.limit is None and frame:
        ax.axhline(run.capacity / scale, color="#444", lw=1, ls="--", label="capacity")
    if run.limit:
        ax.axhline(run.limit / scale, color="#c0392b", lw=1, ls="--", label="limit")
    for step in steps:
        ax.axvline(step, color="#8e44ad", lw=0.6, alpha=0.5)
    if steps:
        ax.plot([], [], color="#8e44ad", lw=0.6, label="optimizer step")
    top = max(run.peak_reserved, frame or 0, max(reserved, default=0), 1) / scale
    ax.set_ylim(0, top * 1.12)
    if tl.oom_at is not None:
        ax.axvline(tl.oom_at, color="#c0392b", lw=1.5)
        # Inside the frame, left of the line, in axes height: never cut by the top edge.
        ax.annotate(
            "OOM",
            (tl.oom_at, 0.97),
            xycoords=("data", "axes fraction"),
            xytext=(-3, 0),
            textcoords="offset points",
            color="#c0392b",
            ha="right",
            va="top",
            fontsize=8,
            fontweight="bold",
        )
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel(unit, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.margins(x=0.01)
    if end is not None and t:
        ax.set_xlim(min(t[0], end), end + 0.02 * max(end - t[0], 1e-6))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    # Above the axes, outside the curves and the limit line.
    ax.legend(fontsize=7, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False, ncol=6, borderaxespad=0.2)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()
