"""The ``%%gpumem`` cell magic and the ``%gpumem`` line magic."""

from __future__ import annotations

import warnings
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring
from traitlets import Float, Int

from .cellrun import CellRun
from .options import OptionError, Options, Settings
from .sizes import format_bytes

# What ``%gpumem --fix`` without a number runs: the plan's recommended entry.
RECOMMENDED = "recommended"

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
        Settings.trace_entries,
        help="Allocator trace entries kept per cell on CUDA (a longer cell loses its earliest events from "
        "the timeline; the peak stays exact).",
    ).tag(config=True)
    plan_margin = Float(
        Settings.plan_margin,
        help="Share of the budget a fix must leave free in its trial to be called 'fits' (the steps after "
        "the trial may allocate a little more).",
    ).tag(config=True)
    search_margin = Float(
        Settings.search_margin,
        help="Share of the budget the batch search keeps free when it predicts the largest batch.",
    ).tag(config=True)
    plan_budget_factor = Float(
        Settings.plan_budget_factor,
        help="Default time budget of the fix plan's trials, as a multiple of the failed run's own time "
        "(within plan_budget_min and plan_budget_max); --plan-budget overrides it.",
    ).tag(config=True)
    plan_budget_min = Float(
        Settings.plan_budget_min, help="Least default time budget of the fix plan, in seconds."
    ).tag(config=True)
    plan_budget_max = Float(
        Settings.plan_budget_max, help="Most default time budget of the fix plan, in seconds."
    ).tag(config=True)

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
        help="let trials and searches run without keeping what the namespace reaches (models, optimizers, "
        "tensors, containers, random generators) in host memory to restore them (for state larger than "
        "host memory): their changes then remain",
    )
    @argument(
        "--report-errors",
        action="store_true",
        help="show the memory report for a cell that fails with another error too (it still fails)",
    )
    @argument(
        "--stacks",
        action="store_true",
        help="record the Python line that made each allocation, shown with the largest allocations (costs "
        "a frame walk per allocation on CPU and Python stacks in the allocator trace on CUDA)",
    )
    @argument(
        "--snapshot",
        metavar="FILE",
        help="write the allocator snapshot (taken at the failure, else at the end) for PyTorch's memory "
        "viewer: a pickle for pytorch.org/memory_viz, or its HTML page for FILE.html. As a line magic, "
        "%%gpumem --snapshot FILE writes the last run's",
    )
    @argument("-o", dest="output", metavar="NAME", help="store the CellRun in the user namespace as NAME")
    @argument(
        "--fix",
        nargs="?",
        const=RECOMMENDED,
        metavar="N",
        help="line magic: run the last failed cell again with entry N of its fix plan (numbered as the "
        "report numbers them; default: the recommended one), as its button does",
    )
    @argument(
        "--free",
        action="store_true",
        help="line magic: give back the device memory pinned outside the namespace (an earlier error's "
        "traceback, Out, ...) without a restart",
    )
    @line_cell_magic
    def gpumem(self, line: str = "", cell: str | None = None) -> CellRun | None:
        """Record a cell's GPU memory; on out-of-memory, give it back, diagnose, offer fixes that fit.

        As a cell magic (``%%gpumem [options]``) the cell runs as usual through IPython; afterwards its
        wall time, peak allocated and reserved memory, memory held after vs before, headroom and a
        timeline of allocated/reserved memory (optimizer steps marked) are shown. When the cell runs out
        of memory, its memory is given back at once, the error's figures are laid out with a diagnosis,
        the candidate fixes are measured by bounded trials (what the namespace reaches and the files the
        cell writes are put back after each), and buttons run the cell with the cheapest fix that fits.
        The cell still fails, with a ``torch.OutOfMemoryError`` whose text is PyTorch's message, so Run
        All stops; any other error ends the cell unchanged.

        Without CUDA (or with ``--device cpu``) it runs in CPU mode: tensor storage bytes are tracked
        exactly and ``--limit`` emulates a card of that size.

        Ranks the cell starts through ``torch.multiprocessing`` (``mp.spawn``, ``start_processes``,
        accelerate's ``notebook_launcher``) are recorded each in its own process under the same
        ``--limit`` per rank: the report gets a table per rank, names the rank that ran out first and
        the bottleneck, and flags stray CUDA contexts. When one rank runs out, the others are stopped at
        once instead of waiting in their next collective. Scripts the cell runs through ``!torchrun``
        record themselves with ``with oommagic.rank_recorder(): train()``.

        As a line magic (``%gpumem``) it prints each visible GPU: used/total, this process's
        allocated/reserved memory and the other processes on it (NVML), then what pins device memory
        outside the namespace's variables (an earlier error's traceback, ``Out``/``_``, exceptions,
        generators and closures kept in variables), with the path to each. ``%gpumem --free`` gives that
        memory back without a kernel restart and says how much came back; ``%gpumem --snapshot FILE``
        writes the last run's allocator snapshot for PyTorch's memory viewer (pytorch.org/memory_viz);
        ``%gpumem --fix [N]`` runs the last failed cell again with entry N of its fix plan (default: the
        recommended one) exactly as the report's button does, from a terminal, VS Code or a script.
        Processes of the ranks a ``%%gpumem`` cell started are marked with their rank.

        Examples::

            %%gpumem --limit 24GiB
            train(model, batch_size=64)

            %%gpumem --find-batch batch_size --limit 0.5
            train(model, batch_size=batch_size)
        """
        __tracebackhide__ = True  # the cell's own error shows its own frames, not the magic's
        if cell is None:
            return self._line(line)
        try:
            args = parse_argstring(self.gpumem, line)
            options = Options.from_args(args)
        except UsageError as err:
            usage = self.gpumem.parser.format_usage().strip().replace("usage: ", "", 1)
            raise UsageError(f"{err}\nusage: %%{usage} (see %%gpumem?)") from None
        except OptionError as err:
            raise UsageError(str(err)) from None
        if args.fix is not None or args.free:
            raise UsageError("--fix and --free belong to the line magic: %gpumem --fix [N], %gpumem --free")
        _import_torch()
        from .run.runner import RunSpec, cell_id

        session = self._session()
        spec = RunSpec(
            source=cell,
            options=options,
            cell_id=cell_id(self.shell),
            execution_count=self.shell.execution_count,
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
            if not _ipython_exit_hint(w):
                print(f"%%gpumem: {w.message}")
        if args.snapshot:
            self._write_snapshot(session, run, args.snapshot)
        return self._finish(session, run)

    def _line(self, line: str) -> CellRun | None:
        """``%gpumem``: the devices and what pins memory; with ``--free``, ``--fix [N]`` or ``--snapshot
        FILE``, that action alone."""
        __tracebackhide__ = True
        if not line.strip():
            print(device_status(self._rank_pids()))
            print(pinned_status(self.shell))
            return None
        try:
            args = parse_argstring(self.gpumem, line)
        except UsageError:
            args = None
        actions = {"free", "fix", "snapshot"}
        chosen = [k for k in actions if args is not None and getattr(args, k) not in (None, False)]
        others = [k for k, v in vars(args).items() if v and k not in actions] if args is not None else []
        if len(chosen) != 1 or others:
            raise UsageError(
                f"%gpumem takes --free, --fix [N] or --snapshot FILE (got {line.strip()!r}); %%gpumem is the "
                "cell magic"
            )
        if args.free:
            print(free_pinned_memory(self.shell))
            return None
        if args.fix is not None:
            return self._fix(args.fix)
        session = self._session()
        if not session.history:
            raise UsageError("%gpumem --snapshot: no %%gpumem run in this kernel yet")
        self._write_snapshot(session, session.history[-1], args.snapshot)
        return None

    def _fix(self, which: str) -> CellRun | None:
        """``%gpumem --fix [N]``: the last failed cell run again with entry N of its plan, through the
        session's ``retry`` as the report's button runs it; the report of the new run follows."""
        __tracebackhide__ = True
        from .diagnosis.plan import NOT_MEASURED
        from .view import in_notebook
        from .view.text import differs_lines

        session = self._session()
        run, number, entry = chosen_fix(session.history, which)
        if entry.verdict == NOT_MEASURED:
            why = entry.note or entry.method or "no trial ran it"
            print(f"%gpumem --fix {number}: {entry.title} was not measured ({why}); this run measures it")
        print(f"%gpumem --fix {number}: running the cell again with {entry.title}", flush=True)
        new = session.retry(run, entry.fixes)
        shown_as_widget = not new.options.text and in_notebook(self.shell) and not new.options.quiet
        try:
            return self._finish(session, new)
        finally:
            # The widget shows no text: where a fix cannot be written into the cell, say what differs.
            if shown_as_widget and new.outcome == "ok" and differs_lines(new):
                print("\n".join(differs_lines(new)))

    def _write_snapshot(self, session: Any, run: CellRun, path: str) -> None:
        from .run.capture.snapshot_file import write_snapshot

        take = session.snapshots.get(run.id)
        snapshot = take() if take is not None else None
        if snapshot is None:
            print("%gpumem --snapshot: this run kept no snapshot (--no-timeline on a run that did not fail)")
            return
        where = write_snapshot(snapshot, path)
        print(
            f"%gpumem: snapshot of run {run.id} written to {where} (open it at https://pytorch.org/memory_viz)"
        )

    def _rank_pids(self) -> dict[int, int]:
        """PID → rank of every rank a ``%%gpumem`` cell of this shell started."""
        from .run.session import session_for

        runs = session_for(self.shell).history
        return {pid: rank for run in runs if run.ranks for pid, rank in run.ranks.pids().items()}

    def _session(self) -> Any:
        from .run.session import session_for

        session = session_for(self.shell)
        session.settings = self.settings()
        return session

    def settings(self) -> Settings:
        """The knobs as set now (``%config``, ``ipython_config.py``), as one frozen record."""
        return Settings(**{name: getattr(self, name) for name in Settings.names()})

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
        if run.outcome == "oom" and run.raised and not options.no_raise:
            freed = f"; {format_bytes(run.freed)} given back" if run.freed else ""
            from .run.errors import out_of_memory_error

            if error is None:
                error = out_of_memory_error(run.report.text if run.report is not None else "out of memory")
            error.summary = f"{run.headline()}{freed} (report above)"
            raise error from None
        if error is not None and run.outcome != "oom":
            from .run.errors import show_as_without_the_magic

            show_as_without_the_magic(self.shell, error)
            raise error.with_traceback(error.__traceback__)
        return None


def _ipython_exit_hint(w: warnings.WarningMessage) -> bool:
    """IPython's "To exit: use 'exit'" after a SystemExit in the cell: it says it again when the magic
    raises the SystemExit, as it would without the magic."""
    return "IPython" in w.filename and str(w.message).startswith("To exit")


def chosen_fix(history: list[CellRun], which: str) -> tuple[CellRun, int, Any]:
    """(the last run that ran out of memory, the entry's number, its plan entry) for ``%gpumem --fix
    which`` (``which``: a number as the report numbers the entries, or the recommended one); raises a
    ``UsageError`` that says what to do where there is no such entry or it cannot be run."""
    from .diagnosis.plan import DOES_NOT_FIT

    failed = [r for r in history if r.outcome == "oom"]
    if not failed:
        raise UsageError(
            "%gpumem --fix: no %%gpumem cell has run out of memory in this kernel yet; the fixes come with "
            "the report of a cell that did"
        )
    run = failed[-1]
    fitted = next((r for r in history if r.parent == run.id and r.outcome == "ok"), None)
    if fitted is not None:
        raise UsageError(
            f"%gpumem --fix: the last cell that ran out of memory already fits with {fitted.change} "
            "(`%gpumem --fix` fixes a cell whose last run failed)"
        )
    entries = run.plan.entries if run.plan is not None else ()
    if not entries:
        raise UsageError(
            "%gpumem --fix: the last failed cell's report has no fix plan (no fix a retry can apply); its "
            "findings say what to change in the cell"
        )
    span = f"1 to {len(entries)}" if len(entries) > 1 else "1"
    if which == RECOMMENDED:
        entry = run.plan.recommended
        if entry is None:
            raise UsageError(
                "%gpumem --fix: no entry of the plan was measured to fit, so none is recommended; run one "
                f"by its number to measure it: %gpumem --fix N (N: {span}, as the report numbers them)"
            )
        return run, entries.index(entry) + 1, entry
    try:
        number = int(which)
    except ValueError:
        raise UsageError(f"--fix expects the number of a plan entry ({span}), got {which!r}") from None
    if not 1 <= number <= len(entries):
        raise UsageError(f"%gpumem --fix {number}: the plan of the last failed cell has entries {span}")
    entry = entries[number - 1]
    if entry.verdict == DOES_NOT_FIT:
        raise UsageError(
            f"%gpumem --fix {number}: {entry.title} was measured not to fit ({entry.line()}); "
            "the report offers no button for it either"
        )
    manual = [r.title for r in entry.fixes if not r.automatic]
    if manual:
        raise UsageError(
            f"%gpumem --fix {number}: {', '.join(manual)} is not something a retry can apply; the report's "
            "code shows what to write"
        )
    return run, number, entry


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


def _pin_device() -> str:
    """The device whose pins ``%gpumem`` reads: the current CUDA device where CUDA is up, else the CPU."""
    import torch

    if torch.cuda.is_initialized():
        return f"cuda:{torch.cuda.current_device()}"
    return "cpu"


def pinned_status(shell: Any) -> str:
    """What pins device memory outside the namespace's variables, one line per holder."""
    if "torch" not in __import__("sys").modules:
        return "Pinned outside the namespace: nothing (torch is not imported)."
    from .diagnosis.pins import describe, find_pins, pinned_bytes

    device = _pin_device()
    pins = find_pins(shell, device)
    if not pins:
        return f"Pinned on {device} outside the namespace's variables: nothing."
    lines = [f"Pinned on {device} outside the namespace's variables: {format_bytes(pinned_bytes(pins))}"]
    lines += describe(pins)
    lines.append("%gpumem --free gives it back without a restart.")
    return "\n".join(lines)


def free_pinned_memory(shell: Any) -> str:
    """Free what pins device memory outside the namespace (``run.release.free_pinned``); say how much."""
    _import_torch()
    from .diagnosis.pins import find_pins, pinned_bytes
    from .run.release import free_pinned

    device = _pin_device()
    pinned = pinned_bytes(find_pins(shell, device))
    back = free_pinned(shell, device)
    text = f"%gpumem --free: {format_bytes(back)} given back on {device}"
    if pinned > back:
        text += f" ({format_bytes(pinned - back)} of what was pinned is still referenced elsewhere)"
    return text + "."
