"""Run a cell's source through the IPython shell under a recorder and make a ``CellRun`` of it.

The magic and the widget's retry buttons both come through ``execute``; this is the one place that
knows how a run is measured, how an out-of-memory error is caught and how its memory is given back.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from .cellrun import CellRun, history
from .oom import OOMReport, is_oom, parse_oom
from .release import free_failed_cell


@dataclass
class RunSpec:
    """What to run and how: the parsed ``%%gpumem`` options plus what a retry changes."""

    source: str
    device: str | None = None
    limit: float | int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    around: Callable[[], contextlib.AbstractContextManager] | None = None
    change: str | None = None
    parent: str | None = None
    record: bool = True
    drop_bound: bool = True
    batch_name: str | None = None


class _Catch:
    """An IPython custom-exception handler for the nested run: out-of-memory errors are kept (and not
    printed: the report replaces the traceback); everything else goes to the handler that was there
    before, or to IPython's own traceback."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.exc: BaseException | None = None
        self._saved = (shell.custom_exceptions, shell.CustomTB)

    def handler(self, shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> Any:
        if is_oom(value):
            self.exc = value
            return None
        user_types, user_tb = self._saved
        if user_types and isinstance(value, user_types):
            return user_tb(etype, value, tb, tb_offset)
        shell.showtraceback((etype, value, tb), tb_offset=tb_offset, running_compiled_code=True)
        return None

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Catch]:
        self.shell.set_custom_exc((Exception,), self.handler)
        try:
            yield self
        finally:
            self.shell.custom_exceptions, self.shell.CustomTB = self._saved


def _cell_id(shell: Any) -> str | None:
    """The notebook cell id JupyterLab sends with an execute request (None outside a kernel)."""
    kernel = getattr(shell, "kernel", None)
    try:
        parent = kernel.get_parent() if kernel is not None else None
    except Exception:
        return None
    return (parent or {}).get("metadata", {}).get("cellId")


def execute(shell: Any, spec: RunSpec) -> CellRun:
    """Run ``spec.source`` in ``shell`` under a recorder; returns the run (also appended to history).

    An out-of-memory error is caught, its memory given back (frames, and the names the cell bound to
    device memory unless ``spec.drop_bound`` is off), its figures parsed into ``run.report`` and
    diagnosed into ``run.findings``;
    any other exception is shown with its normal traceback and recorded as ``outcome="error"``. A
    KeyboardInterrupt stops the run after every setting is restored, and is re-raised.
    """
    from .capture import open_recorder

    recorder = open_recorder(spec.device, spec.limit, timeline=not spec.options.get("no_timeline"))
    run = CellRun(
        source=spec.source,
        device=recorder.device,
        options=dict(spec.options),
        execution_count=getattr(shell, "execution_count", None),
        cell_id=_cell_id(shell),
        started=time.time(),
        change=spec.change,
        parent=spec.parent,
    )
    catch = _Catch(shell)
    ids_before = {name: id(value) for name, value in shell.user_ns.items()}
    result = None
    interrupted = False
    held_at_failure = None
    ctx = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(recorder)
        stack.enter_context(catch.installed())
        if spec.around is not None:
            stack.enter_context(spec.around())
        t0 = time.perf_counter()
        try:
            result = shell.run_cell(spec.source, store_history=False)
        except KeyboardInterrupt:
            interrupted = True
        run.wall_s = time.perf_counter() - t0
        if catch.exc is not None:
            held_at_failure = recorder.allocated()
            exc, catch.exc = catch.exc, None
            run.outcome = "oom"
            run.report = _report(exc, recorder.exact)
            if result is not None and result.error_in_exec is exc:
                result.error_in_exec = None
            ctx = _namespace_context(run, shell, spec.batch_name) if spec.record else None
            if spec.drop_bound:
                from .context import drop_bound_by_cell

                run.dropped = drop_bound_by_cell(shell.user_ns, ids_before, recorder.device)
            free_failed_cell(shell, exc, recorder.device)
            del exc
        elif result is not None and result.error_in_exec is not None:
            err = result.error_in_exec
            if isinstance(err, KeyboardInterrupt):
                interrupted = True
            else:
                run.outcome = "error"
                run.error = f"{type(err).__name__}: {err}"
        if interrupted:
            run.outcome = "interrupted"
    rec = recorder.recording()
    run.before_allocated, run.before_reserved = rec.before_allocated, rec.before_reserved
    run.after_allocated, run.after_reserved = rec.after_allocated, rec.after_reserved
    run.peak_allocated, run.peak_reserved = rec.peak_allocated, rec.peak_reserved
    run.capacity, run.limit, run.timeline = rec.capacity, rec.limit, rec.timeline
    if held_at_failure is not None:
        run.freed = max(held_at_failure - rec.after_allocated, 0)
    if ctx is not None:
        _diagnose(run, ctx)
    if spec.record:
        history().append(run)
    if interrupted:
        raise KeyboardInterrupt
    return run


def _report(exc: BaseException, exact: dict[str, int]) -> OOMReport:
    """The parsed message, with the recorder's exact byte counts where the message rounds them."""
    text = _message(exc)
    report = parse_oom(text)
    if report is None:
        return OOMReport(text=text, source="unknown")
    if exact and (report.emulated or report.source == "allocator"):
        report = replace(
            report, **{k: v for k, v in exact.items() if getattr(report, k) is not None or report.emulated}
        )
    return report


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return repr(type(exc))


def _namespace_context(run: CellRun, shell: Any, batch_name: str | None) -> Any:
    """What the namespace says about an out-of-memory run (models, leftovers, the batch), read before
    the failed cell's names are dropped; None when reading it failed."""
    from .context import gather_context

    try:
        return gather_context(run, shell.user_ns, run.report, batch_name=batch_name)
    except Exception as err:  # a diagnosis bug must not hide the report itself
        print(f"%%gpumem: the diagnosis failed ({type(err).__name__}: {err}); the figures above stand")
        return None


def _diagnose(run: CellRun, ctx: Any) -> None:
    """Fill ``run.findings`` from the report, the run's final figures and the namespace context."""
    from .diagnose import diagnose

    dropped = {name for name, _ in run.dropped}
    ctx = replace(
        ctx,
        timeline=run.timeline,
        before_allocated=run.before_allocated,
        capacity=run.capacity,
        limit=run.limit,
        leftovers=tuple(x for x in ctx.leftovers if x.name not in dropped),
    )
    try:
        run.findings = diagnose(run.report, ctx)
    except Exception as err:
        print(f"%%gpumem: the diagnosis failed ({type(err).__name__}: {err}); the figures above stand")
