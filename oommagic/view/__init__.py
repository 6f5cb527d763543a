"""Views of a ``CellRun``: the ipywidgets report in a notebook, plain text everywhere else."""

from __future__ import annotations

from typing import Any

from ..cellrun import CellRun
from .text import render_text


def in_notebook(shell: Any) -> bool:
    """True when a frontend that renders widgets may be listening (a Jupyter kernel)."""
    return getattr(shell, "kernel", None) is not None


def show(run: CellRun, actions: Any, text: bool = False) -> Any:
    """Display ``run``: the widget in a kernel (its text/plain form is the text report), else text.
    ``actions`` is the session the widget's buttons call."""
    from IPython.display import display

    if text or not in_notebook(actions.shell):
        print(render_text(run))
        return None
    from .widget import ReportWidget

    global _LAST
    widget = ReportWidget(run, actions)
    _LAST = widget
    display(widget)
    return widget


_LAST: Any = None


def report_widget() -> Any:
    """The report widget shown last in this kernel (None before any).

    ``report_widget().fixes`` are its offered fixes, first = recommended; ``.click("batch")`` presses one."""
    return _LAST
