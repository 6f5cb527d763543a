"""oommagic: ``%%gpumem`` records a cell's GPU memory and turns an out-of-memory error into a diagnosis
and a one-click fix.

``import oommagic`` and ``%load_ext oommagic`` import neither torch nor NVML; the magics do, when run.
"""

from __future__ import annotations

from .cellrun import CellRun
from .oom import OOMReport, is_oom, parse_oom
from .sizes import format_bytes, parse_size
from .timeline import Timeline

__version__ = "0.1.0"
__all__ = [
    "CellRun",
    "OOMReport",
    "Timeline",
    "checkpointed",
    "format_bytes",
    "history",
    "is_oom",
    "load_ipython_extension",
    "parse_oom",
    "parse_size",
    "rank_recorder",
    "rebatched",
    "report_widget",
]


def checkpointed(model):
    """``model`` itself, its blocks' activations recomputed in the backward pass instead of kept (a
    transformers model through ``gradient_checkpointing_enable``; else each element of its outermost
    ``ModuleList``/``Sequential`` made of layers, under ``torch.utils.checkpoint``). A fix for a
    distributed cell writes it where the ranks wrap the model:
    ``DistributedDataParallel(oommagic.checkpointed(model))``."""
    from .run.fixes import checkpointed as recomputing

    return recomputing(model)


def history() -> list[CellRun]:
    """Every ``%%gpumem`` run of this kernel, oldest first (the live list)."""
    from .run.session import history as runs

    return runs()


def rank_recorder(index: int | None = None):
    """Context manager: record this process as one rank of the ``%%gpumem`` cell that started it, for
    scripts the cell runs through ``!torchrun`` or ``subprocess`` (ranks started in the kernel through
    ``torch.multiprocessing`` or ``notebook_launcher`` are recorded without it). Outside such a cell it
    records nothing. ``with oommagic.rank_recorder(): train()``."""
    from .run.rank_process import rank_recorder as recorder

    return recorder(index)


def rebatched(loader, batch_size: int):
    """A copy of ``loader`` (a ``DataLoader``, one wrapped by accelerate's ``prepare``, a batch sampler)
    whose batches hold ``batch_size`` samples: same dataset, sampler and order, collation and wrapper;
    ``loader`` itself is left as it is. A fix written into a cell re-batches a loader an earlier cell made
    with it: ``train_loader = oommagic.rebatched(train_loader, 8)``."""
    from .run.fixes import rebatched as copy_with

    return copy_with(loader, batch_size)


def report_widget():
    """The ``%%gpumem`` report widget shown last in this kernel; ``.click("batch")`` presses a fix."""
    from .view import report_widget as last

    return last()


def load_ipython_extension(ipython) -> None:
    from .magics import GpuMemMagics
    from .view.text import render_text

    ipython.register_magics(GpuMemMagics)
    # A CellRun prints as its text report (``Out[n]``, ``print(run)`` in IPython).
    ipython.display_formatter.formatters["text/plain"].for_type(
        CellRun, lambda run, p, cycle: p.text("CellRun(...)" if cycle else render_text(run))
    )


def unload_ipython_extension(ipython) -> None:
    from .magics import GpuMemMagics

    ipython.magics_manager.registry.pop(GpuMemMagics.__name__, None)


def _jupyter_labextension_paths() -> list[dict]:
    return [{"src": "labextension", "dest": "oommagic"}]


def _jupyter_server_extension_points() -> list[dict]:
    return [{"module": "oommagic.server"}]
