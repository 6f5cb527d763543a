"""Run a cell's source through the IPython shell under a recorder: the one place that knows how a run is
measured, how an out-of-memory error is caught and how its memory is given back.

``execute`` returns an ``Attempt`` (what happened, the recording, the namespace as it was at a failure); it
keeps no history and shows nothing: ``session`` turns attempts into ``CellRun``s.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..categories import Breakdown
from ..diagnosis.context import NamespaceScan
from ..diagnosis.ranks import Ranks
from ..oom import OOMReport, is_runtime_oom, parse_oom
from ..options import Settings
from ..timeline import Recording
from .bounds import Bounds, TrialStop, bounded
from .release import drop_bound_by_cell, free_failed_cell, identities
from .spec import RunSpec

__all__ = ["Attempt", "Bounds", "RunSpec", "TrialStop", "cell_id", "execute"]


@dataclass
class Attempt:
    """One execution of a cell: ``outcome`` is ok / oom / error / interrupted, or ``stopped`` for a trial
    that reached its bounds without running out. ``error`` is the exception the magic ends the cell with:
    the cell's own, or after an out-of-memory error the tool's (``errors.out_of_memory_error``: no frame of
    the failed cell); ``scan`` the namespace as the failure left it (before anything was dropped)."""

    recording: Recording
    outcome: str = "ok"
    report: OOMReport | None = None
    error: BaseException | None = None
    error_text: str | None = None
    freed: int | None = None
    dropped: list[tuple[str, int]] = field(default_factory=list)
    scan: NamespaceScan | None = None
    started: float = 0.0
    wall_s: float = 0.0
    steps: int = 0
    stopped_by: str | None = None
    categories: Breakdown | None = None
    busy: float | None = None
    snapshot: Any = None  # () -> the allocator snapshot dict (memory_viz format), or None
    snapshot_ms: float | None = None
    ranks: Ranks | None = None  # the ranks the cell started (torch.distributed), if any
    raised: bool = True  # False: a rank ran out under a launcher that returned (``!torchrun``)
    # Who ran out, read from the output of a launched script whose ranks record nothing themselves.
    unrecorded: str | None = None


class _Catch:
    """Keeps what the nested run raises instead of showing it: an out-of-memory error gets the report
    instead of a traceback; any other is raised again by the magic, so the cell fails with it and IPython
    shows it once (``errors.show_as_without_the_magic``). IPython shows a ``SystemExit`` or a
    ``BaseException`` of the cell's own without asking its custom handlers: those are caught where it shows
    them. An interrupt shows as usual: the session raises it again."""

    def __init__(self, shell: Any) -> None:
        self.shell = shell
        self.exc: BaseException | None = None
        self._saved = (shell.custom_exceptions, shell.CustomTB)
        self._shows = vars(shell).get("showtraceback")

    def handler(self, shell: Any, etype: type, value: BaseException, tb: Any, tb_offset: Any = None) -> Any:
        self.exc = value
        return None

    def _showtraceback(self, exc_tuple: Any = None, *args: Any, **kwargs: Any) -> Any:
        value = exc_tuple[1] if exc_tuple is not None else sys.exc_info()[1]
        # An Exception shown here did not fail the cell (a repr or an event callback that raised: IPython
        # shows it and goes on); the cell's own reach the handler above.
        if value is None or isinstance(value, (Exception, KeyboardInterrupt)):
            shows = self._shows or type(self.shell).showtraceback.__get__(self.shell)
            return shows(exc_tuple, *args, **kwargs)
        self.exc = value
        return None

    @contextlib.contextmanager
    def installed(self) -> Iterator[_Catch]:
        self.shell.set_custom_exc((Exception,), self.handler)
        self.shell.showtraceback = self._showtraceback
        try:
            yield self
        finally:
            self.shell.custom_exceptions, self.shell.CustomTB = self._saved
            if self._shows is None:
                vars(self.shell).pop("showtraceback", None)
            else:
                self.shell.showtraceback = self._shows


def cell_id(shell: Any) -> str | None:
    """The notebook cell id JupyterLab sends with an execute request (None outside a kernel)."""
    kernel = getattr(shell, "kernel", None)
    try:
        parent = kernel.get_parent() if kernel is not None else None
    except Exception:
        return None
    return (parent or {}).get("metadata", {}).get("cellId")


def execute(
    shell: Any,
    spec: RunSpec,
    bounds: Bounds | None = None,
    scan: bool = True,
    settings: Settings | None = None,
) -> Attempt:
    """Run ``spec.source`` in ``shell`` under a recorder, with ``spec.applied``'s settings in force.

    An out-of-memory error is caught, the namespace read (``scan``), its memory given back (frames, and the
    names the cell bound to device memory unless ``--keep``) and its figures parsed into ``report``; a trial
    (``scan=False``) leaves the final collection to its caller. Any
    other exception is kept in ``error``. ``bounds`` makes it a trial that stops at its steady state. A
    KeyboardInterrupt stops the run after every setting is restored (outcome ``interrupted``: the caller
    re-raises it once the run is recorded). ``settings``: the magic's knobs (the recorder's trace length).
    """
    from ..diagnosis.context import scan_namespace
    from .capture import open_recorder
    from .capture.roles import frames_of
    from .fixes import in_force
    from .ranks import watch_ranks
    from .script_output import OutputTail, rank_oom_in

    options = spec.options
    limit = bounds.limit if bounds is not None and bounds.limit is not None else options.limit
    entries = (settings or Settings()).trace_entries
    recorder = open_recorder(
        options.device, limit, timeline=options.timeline, stacks=options.stacks, trace_entries=entries
    )
    catch = _Catch(shell)
    bound_before = identities(shell.user_ns)
    # Read before the cell runs: an error in it replaces `sys.last_value`, which lets an earlier error's
    # frames go, but they held their memory while this cell ran.
    pins = _pins(shell, recorder.device) if scan else ()
    attempt = Attempt(recording=Recording(device=recorder.device), started=time.time())
    held_at_failure = None
    interrupted = False
    with contextlib.ExitStack() as stack:
        stack.enter_context(recorder)
        allocated_before = recorder.allocated()
        stack.enter_context(catch.installed())
        stack.enter_context(in_force(spec.applied, shell, recorder.device))
        counter = stack.enter_context(bounded(bounds))
        ranks = stack.enter_context(watch_ranks(limit, recorder.device, bounds))
        output = stack.enter_context(OutputTail(spec.source))
        t0 = time.perf_counter()
        result = None
        try:
            result = shell.run_cell(spec.source, store_history=False)
        except KeyboardInterrupt:
            interrupted = True
        counter.running = False  # the bounds are the cell's: what follows (dropping names) is not stopped
        attempt.wall_s = time.perf_counter() - t0
        attempt.steps = counter.steps
        exc, catch.exc = catch.exc, None
        if exc is None and result is not None and not isinstance(result.error_in_exec, KeyboardInterrupt):
            exc = result.error_in_exec  # what IPython stops on silently (bdb.BdbQuit) fails the cell too
        attempt.ranks = ranks.gather(stop=interrupted or exc is not None)
        rank_oom = attempt.ranks.report() if attempt.ranks is not None else None
        if result is not None and exc is not None and result.error_in_exec is exc:
            result.error_in_exec = None
        if result is not None and exc is not None and result.error_before_exec is exc:
            result.error_before_exec = None
            if isinstance(exc, SyntaxError):
                # The cell does not compile: IPython shows that without frames (its parser's are not the
                # cell's), and so does the magic (errors.show_as_without_the_magic reads this None).
                exc.__traceback__ = None
        if isinstance(exc, TrialStop):
            attempt.outcome, attempt.stopped_by = "stopped", str(exc)
            free_failed_cell(shell, exc, recorder.device, then_collect=scan)
        elif exc is not None and (is_runtime_oom(exc) or rank_oom is not None):
            held_at_failure = recorder.allocated()
            attempt.outcome = "oom"
            # A rank's error reaches the kernel wrapped by its launcher: the rank's message is the report.
            attempt.report = rank_oom or _report(exc, recorder.exact)
            attempt.error = _tools_error(attempt.report, exc if is_runtime_oom(exc) else None)
            if scan:
                _what_filled(recorder, [shell.user_ns, *frames_of(exc.__traceback__)])
                # At the moment of the failure (the message's figure: what the unwinding freed counts).
                at_failure = attempt.report.allocated if attempt.report.allocated else held_at_failure
                grown = max(at_failure - allocated_before, 0)
                attempt.scan = _scan(scan_namespace, shell.user_ns, recorder.device, spec, exc, pins, grown)
            if not options.keep:
                attempt.dropped = drop_bound_by_cell(shell.user_ns, bound_before, recorder.device)
            # A trial (no scan) is collected once by its caller, after the user's state is put back.
            free_failed_cell(shell, exc, recorder.device, then_collect=scan)
        elif exc is not None:
            attempt.outcome, attempt.error = "error", exc
            attempt.error_text = f"{type(exc).__name__}: {_message(exc)}"
        elif rank_oom is not None and not interrupted:
            # A launcher that returns when a rank fails (``!torchrun``, ``subprocess.run`` without
            # ``check``): the run is out of memory, and the cell ends as it would without the tool.
            attempt.outcome, attempt.report, attempt.raised = "oom", rank_oom, False
            if scan:
                attempt.scan = _scan(scan_namespace, shell.user_ns, recorder.device, spec, None, pins)
        elif attempt.ranks is None and not interrupted and (seen := rank_oom_in(output.text)) is not None:
            # A launched script whose ranks record nothing printed a rank's error, and its launcher returned:
            # out of memory, as the output says, the cell ending as without the tool; nothing measured.
            who, attempt.report = seen
            attempt.outcome, attempt.raised = "oom", False
            attempt.unrecorded = (
                "a rank of the launched script" if who is None else f"rank {who} of the script"
            )
        elif result is not None and isinstance(result.error_in_exec, KeyboardInterrupt):
            interrupted = True
        del exc
        if interrupted:
            attempt.outcome = "interrupted"
    attempt.recording = recorder.recording()
    if scan:
        attempt.categories = _what_filled(recorder, [shell.user_ns], attempt.recording.timeline)
        attempt.snapshot = recorder.snapshot
        attempt.snapshot_ms = getattr(recorder, "snapshot_ms", None)
        attempt.busy = getattr(recorder, "busy", None)
    if held_at_failure is not None:
        attempt.freed = max(held_at_failure - attempt.recording.after_allocated, 0)
    return attempt


def _what_filled(recorder: Any, spaces: list, timeline: Any = None) -> Breakdown | None:
    """The recorder's breakdown by category: at the failure (no ``timeline``: the moment is now), else at
    the peak or the end. A bug here must not hide the report: it says so and the figures stand."""
    try:
        if timeline is None:
            return recorder.capture_failure(spaces)
        return recorder.categories(spaces, timeline)
    except Exception as err:
        print(f"%%gpumem: the breakdown by category failed ({type(err).__name__}: {err}); the figures stand")
        return None


def _pins(shell: Any, device: str) -> tuple:
    from ..diagnosis.pins import find_pins

    try:
        return find_pins(shell, device)
    except Exception:  # a diagnosis bug must not stop the run
        return ()


def _scan(
    scan_namespace: Any,
    namespace: dict,
    device: str,
    spec: RunSpec,
    exc: BaseException,
    pins: tuple,
    grown: int | None = None,
) -> NamespaceScan | None:
    try:
        applied = tuple(r.kind for r in spec.applied)
        return scan_namespace(namespace, device, spec.source, applied, exc, pins, grown)
    except Exception as err:  # a diagnosis bug must not hide the report itself
        print(f"%%gpumem: reading the namespace failed ({type(err).__name__}: {err}); the figures stand")
        return None


def _report(exc: BaseException, exact: dict[str, int]) -> OOMReport:
    """The parsed message, with the recorder's exact byte counts where the message rounds them."""
    from dataclasses import replace

    text = _message(exc)
    report = parse_oom(text)
    if report is None:
        return OOMReport(text=text, source="unknown")
    if exact and (report.emulated or report.source == "allocator"):
        fields = {k: v for k, v in exact.items() if getattr(report, k) is not None or report.emulated}
        report = replace(report, **fields)
    return report


def _tools_error(report: OOMReport, exc: BaseException | None) -> BaseException:
    """The error an out-of-memory cell ends with: the runtime's message, and its class kept where it was
    one of the runtime's own (``torch.AcceleratorError``), so ``except`` clauses written for it hold."""
    from .errors import out_of_memory_error

    return out_of_memory_error(report.text or "out of memory", like=type(exc) if exc is not None else None)


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return repr(type(exc))
