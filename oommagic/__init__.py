"""oommagic: ``%%gpumem`` records a cell's GPU memory and turns an out-of-memory error into a diagnosis
and a one-click fix.

``import oommagic`` and ``%load_ext oommagic`` import neither torch nor NVML; the magics do, when run.
"""

from __future__ import annotations

from .cellrun import CellRun, history
from .oom import OOMReport, is_oom, parse_oom
from .sizes import format_bytes, parse_size
from .timeline import Timeline

__version__ = "0.1.0"
__all__ = [
    "CellRun",
    "OOMReport",
    "Timeline",
    "format_bytes",
    "history",
    "is_oom",
    "load_ipython_extension",
    "parse_oom",
    "parse_size",
    "report_widget",
]


def report_widget():
    """The ``%%gpumem`` report widget shown last in this kernel; ``.click("batch")`` presses a fix."""
    from .view import report_widget as last

    return last()


def load_ipython_extension(ipython) -> None:
    from .magics import GpuMemMagics

    ipython.register_magics(GpuMemMagics)


def unload_ipython_extension(ipython) -> None:
    from .magics import GpuMemMagics

    ipython.magics_manager.registry.pop(GpuMemMagics.__name__, None)


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "oommagic"}]


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "oommagic.server"}]
