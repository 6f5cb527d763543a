"""The ``%%gpumem`` cell magic and the ``%gpumem`` line magic."""

from __future__ import annotations

import warnings
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Float, Int

from .cellrun import CellRun
from .options import OptionError, Options
from .sizes import format_bytes

TORCH_MISSING = (
    "%%gpumem needs PyTorch, which is not installed in this kernel's environment. "
    "Install it with `pip install torch` (see https://pytorch.org/get-started/ for the build that "
    "matches your CUDA), then restart the kernel."
)


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise UsageError(TORCH_MISSING) from None
    return torch


@magics_class
class GpuMemMagics(Magics):
    """``%%gpumem`` and ``%gpumem``. Knobs are settable in ``ipython_config.py``
    (``c.GpuMemMagics.plan_margin = 0.1``) or live with ``%config GpuMemMagics.plan_margin = 0.1``."""

    trace_entries = Int(
        500_000,
        help="Allocator trace entries kept per cell on CUDA (a longer cell loses its earliest events from "
        "the timeline; the peak stays exact).",
    ).tag(config=True)
    plan_margin = Float(
        0.05,
        help="Share of the budget a fix must leave free in its trial to be called 'fits' (the steps after "
        "the trial may allocate a little more).",
    ).tag(config=True)
    search_margin = Float(
        0.02, help="Share of the budget the batch search keeps free when it predicts the largest batch."
    ).tag(config=True)
    plan_budget_factor = Float(
        8.0,
        help="Default time budget of the fix plan's trials, as a multiple of the failed run's own time "
        "(within plan_budget_min and plan_budget_max); --plan-budget overrides it.",
    ).tag(config=True)
    plan_budget_min = Float(20.0, help="Least default time budget of the fix plan, in seconds.").tag(
        config=True
    )
    plan_budget_max = Float(300.0, help="Most default time budget of the fix plan, in seconds.").tag(
        config=True
    )

    @magic_arguments()
    @argument(
        "--limit",
        metavar="SIZE|FRACTION",
        help="emulate a smaller card: 24GiB, 8GB, 512MiB or a fraction like 0.5 of the device. On CUDA "
        "through set_per_process_memory_fraction; on CPU the tracker raises torch.OutOfMemoryError.",
    )
    @argument("--device", metavar="N|cpu", help="device to record: N or cuda:N, or cpu for CPU mode")
    @argument("--quiet", action="store_true", help="record, print nothing")
    @argument("--no-raise", action="store_true", help="an out-of-memory error does not fail the cell")
    @argument("--text", action="store_true", help="plain-text report instead of the widget")
    @argument(
        "--keep",
        action="store_true",
        help="after an out-of-memory error keep the names the failed cell bound to device memory (by "
        "default they are dropped with the rest of the failed attempt's memory)",
    )
    @argument(
        "--no-timeline",
        action="store_true",
        help="record no timeline: on CUDA the allocator trace stays off (it costs about 0.3 us per "
        "allocation, felt in loops of thousands of tiny ops); the peak stays exact, the plot and the "
        "findings read from it go",
    )
    @argument("--batch", metavar="NAME", help="the variable that holds the batch size, for retries")
    @argument(
        "--find-batch",
        metavar="NAME",
        help="search the largest batch size NAME that fits (probes, a fit, a check) instead of one run",
    )
    @argument(
        "--plan-budget",
        metavar="SECONDS",
        help="time for the fix plan's trials after an out-of-memory error (60, 90s, 2min; 0: no trials, "
        "every fix 'not measured'); default: scaled from the failed run's own time",
    )
    @argument(
        "--no-snapshot",
        action="store_true",
        help="let trials and searches run without keeping the model, optimizer, RNG and namespace in host "
        "memory to restore them (for state larger than host memory): their changes then remain",
    )
    @argument(
        "--report-errors",
        action="store_true",
        help="show the memory report for a cell that fails with another error too (it still fails)",
    )
    @argument("--stacks", action="store_true", help="record the Python line of each allocation (slower)")
    @argument("-o", dest="output", metavar="NAME", help="store the CellRun in the user namespace as NAME")
    @line_cell_magic
    def gpumem(self, line: str = "", cell: str | None = None) -> CellRun | None:
        """Record a cell's GPU memory; on out-of-memory, give it back, diagnose, offer fixes that fit.

        As a cell magic (``%%gpumem [options]``) the cell runs as usual through IPython; afterwards its
        wall time, peak allocated and reserved memory, memory held after vs before, headroom and a
        timeline of allocated/reserved memory (optimizer steps marked) are shown. When the cell runs out
        of memory, its memory is given back at once, the error's figures are laid out with a diagnosis,
        the candidate fixes are measured by bounded trials (your model, optimizer, RNG and namespace are
        restored after each), and buttons run the cell with the cheapest fix that fits. The cell still
        fails, with a ``torch.OutOfMemoryError`` whose text is PyTorch's message, so Run All stops; any
        other error ends the cell unchanged.

        Without CUDA (or with ``--device cpu``) it runs in CPU mode: tensor storage bytes are tracked
        exactly and ``--limit`` emulates a card of that size.

        Ranks the cell starts through ``torch.multiprocessing`` (``mp.spawn``, ``start_processes``,
        accelerate's ``notebook_launcher``) are recorded each in its own process under the same
        ``--limit`` per rank: the report gets a table per rank, names the rank that ran out first and
        the bottleneck, and flags stray CUDA contexts. When one rank runs out, the others are stopped at
        once instead of waiting in their next collective. Scripts the cell runs through ``!torchrun``
        record themselves with ``with oommagic.rank_recorder(): train()``.

        As a line magic (``%gpumem``) it prints each visible GPU: used/total, this process's
        allocated/reserved memory and the other processes on it (NVML), ranks marked.

        Examples::

            %%gpumem --limit 24GiB
            train(model, batch_size=64)

            %%gpumem --find-batch batch_size --limit 0.5
            train(model, batch_size=batch_size)
        """
        __tracebackhide__ = True  # the cell's own error shows its own frames, not the magic's
        if cell is None:
            if line.strip():
                raise UsageError(
                    f"%gpumem takes no options (got {line.strip()!r}); %%gpumem is the cell magic"
                )
            print(device_status(self._rank_pids()))
            return None
        try:
            options = Options.from_args(parse_argstring(self.gpumem, line))
        except UsageError as err:
            usage = self.gpumem.parser.format_usage().strip().replace("usage: ", "", 1)
            raise UsageError(f"{err}\nusage: %%{usage} (see %%gpumem?)") from None
        except OptionError as err:
            raise UsageError(str(err)) from None
        _import_torch()
        from .run.runner import RunSpec, cell_id

        session = self._session()
        spec = RunSpec(
            source=cell, options=options, cell_id=cell_id(self.shell), execution_count=self.shell.execution_count
        )
        if options.find_batch:
            from .run.batch_search import find_batch

            return find_batch(session, spec, options.find_batch)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run = session.run(spec)
        except OptionError as err:
            raise UsageError(str(err)) from None
        for w in caught:
            print(f"%%gpumem: {w.message}")
        return self._finish(session, run)

    def _rank_pids(self) -> dict[int, int]:
        """PID → rank of every rank a ``%%gpumem`` cell of this shell started."""
        from .run.session import session_for

        runs = session_for(self.shell).history
        return {pid: rank for run in runs if run.ranks for pid, rank in run.ranks.pids().items()}

    def _session(self) -> Any:
        from .run.session import session_for

        session = session_for(self.shell)
        session.plan_margin = self.plan_margin
        session.search_margin = self.search_margin
        session.trace_entries = self.trace_entries
        session.budget_rule = (self.plan_budget_factor, self.plan_budget_min, self.plan_budget_max)
        return session

    def _finish(self, session: Any, run: CellRun) -> CellRun | None:
        __tracebackhide__ = True
        options = run.options
        if options.output:
            self.shell.user_ns[options.output] = run
        error = session.pending_error(run)
        shown = run.outcome != "error" or options.report_errors
        if shown and not options.quiet:
            from .view import show

            show(run, session, text=options.text)
        if run.outcome == "oom" and not options.no_raise:
            freed = f"; {format_bytes(run.freed)} given back" if run.freed else ""
            from .run.errors import out_of_memory_error

            message = run.report.text if run.report is not None else "out of memory"
            raise out_of_memory_error(message, f"{run.headline()}{freed} (report above)") from None
        if error is not None:
            raise error.with_traceback(error.__traceback__)
        return None


def device_status(ranks: dict[int, int] | None = None) -> str:
    """Text table of the visible GPUs (NVML) with this process's torch figures where CUDA is up, and the
    processes ``ranks`` (PID → rank) names marked with their rank."""
    from .devices import read_devices, render_devices_text

    mine: dict[int, tuple[int, int]] = {}
    try:
        import torch

        if torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                mine[i] = (torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i))
    except ImportError:
        pass
    return render_devices_text(read_devices(), this_process=mine, ranks=ranks)
