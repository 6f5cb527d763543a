"""The one owner of "after a run": ``Session.run``, ``retry``, ``remove`` and ``search`` each execute the
cell, build its ``CellRun`` once, append it to the history and publish it to the sidebar.

The magic and every widget button call a ``Session``; the views render what it returns. One session per
IPython shell (``session_for``).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from ..cellrun import CellRun
from ..diagnosis.findings import Remedy
from ..diagnosis.kinds import kind_of, rewrite_again
from ..diagnosis.plan import with_measured
from ..options import Settings
from .fixes import spec_of, spec_with, undo
from .release import drop_new_blas_workspaces
from .runner import Attempt, Bounds, RunSpec, execute

# Allocator snapshots kept for "Save snapshot" (each up to the trace's 500k entries).
KEPT_SNAPSHOTS = 4


class Session:
    """The ``%%gpumem`` runs of one shell, and the actions that make new ones.

    ``publish`` is called with each new run (the comm to the sidebar by default); ``progress`` receives
    one line at a time while a plan or a search runs trials.
    """

    def __init__(self, shell: Any, publish: Callable[[CellRun], None] | None = None) -> None:
        self.shell = shell
        self.history: list[CellRun] = []
        self._publish = publish
        self.progress: Callable[[str], None] = _print_progress
        # The magic's knobs (``GpuMemMagics`` traits), replaced by the magic at each call.
        self.settings = Settings()
        self._errors: dict[str, BaseException] = {}
        self.last_snapshot_bytes = 0
        # What the trials of the last plan or search put back, for its summary (``restored.Restored``).
        self.restored: Any = None
        self._keeping = False
        self._kept: Any = None  # the snapshot the next trial of this plan reuses
        # run id -> () -> allocator snapshot, for the last few runs (`%gpumem --snapshot`, the button).
        self.snapshots: dict[str, Callable[[], dict | None] | None] = {}
        # Views told of each new run (a report widget follows the retries the sidebar makes of its cell).
        self._watchers: list[weakref.WeakMethod] = []

    def watch(self, method: Callable[[CellRun], None]) -> None:
        """Call the bound ``method`` with every new run while its object lives."""
        self._watchers.append(weakref.WeakMethod(method))

    # --- the actions ----------------------------------------------------------------------------------

    def run(self, spec: RunSpec) -> CellRun:
        """Run ``spec`` once; after an out-of-memory error, diagnose it and measure the fix plan."""
        attempt = execute(self.shell, spec, settings=self.settings)
        run = self._build(spec, attempt)
        if run.outcome == "oom" and run.findings:
            # A distributed cell's trials relaunch its ranks, each bounded as a trial is (``run.plan``).
            plan = self._plan(run)
            run = replace(run, plan=plan, findings=with_measured(run.findings, plan))
        if run.outcome == "oom":
            drop_new_blas_workspaces(run.device, run.recording.before_allocated)
        self._record(run, attempt)
        if run.outcome == "interrupted":
            raise KeyboardInterrupt
        return run

    def retry(self, run: CellRun, fixes: Remedy | tuple[Remedy, ...]) -> CellRun:
        """Run ``run``'s cell again with ``fixes`` (one remedy or a plan entry's combination) stacked on
        the fixes already in force."""
        fixes = (fixes,) if isinstance(fixes, Remedy) else tuple(fixes)
        for remedy in fixes:
            kind_of(remedy)  # an unknown kind is refused before anything is freed or run
            if not remedy.automatic:
                raise ValueError(
                    f"{remedy.title}: not something a retry can apply; the snippet shows how to do it"
                )
        for remedy in fixes:
            frees = kind_of(remedy).frees
            if frees == "names":
                from .release import free_names

                free_names(self.shell.user_ns, remedy.params.get("names", []), measure=lambda: 0)
            elif frees == "pinned":
                from .release import free_pinned

                free_pinned(self.shell, run.device)
        return self.run(spec_with(run, fixes))

    def remove(self, run: CellRun, index: int) -> CellRun:
        """Run ``run``'s cell again without the fix at ``index`` of ``run.applied`` (the others stay)."""
        kept = run.applied[:index] + run.applied[index + 1 :]
        source = run.original or run.source
        for remedy in kept:
            source = rewrite_again(source, remedy, run.context.helpers if run.context else ())
        undo(run.applied[index], self.shell.user_ns)
        spec = RunSpec(
            source=source,
            options=run.options,
            applied=kept,
            cell_id=run.cell_id,
            execution_count=run.execution_count,
            parent=run.id,
            original=run.original,
        )
        return self.run(spec)

    def search(self, run: CellRun, name: str) -> Any:
        """Search the largest ``name`` that fits (``%%gpumem --find-batch``) for ``run``'s cell, with its
        fixes in force; every probe leaves the user's state as it was."""
        from .batch_search import find_batch

        with self._trials():
            return find_batch(self, spec_of(run), name)

    def trial(self, spec: RunSpec, bounds: Bounds | None = None) -> Attempt:
        """Run ``spec`` as a trial: bounded, quiet, recorded nowhere, and the user's state put back after:
        everything the namespace reaches (``snapshot.UserState``) and every file it wrote
        (``trial_files``), checked after the restore. An interrupt while the state is taken or put back
        is held until that ends, then raised; one during the run stops it, and the state is put back."""
        from IPython.utils.capture import capture_output

        from .held_interrupt import HeldInterrupt
        from .release import collect
        from .restored import Restored
        from .snapshot import UserState
        from .trial_files import CellWritesFiles, TrialFiles

        ns = self.shell.user_ns
        files = TrialFiles()
        with HeldInterrupt() as hold:
            saved = None
            if not spec.options.no_snapshot:
                saved = (
                    self._kept if self._kept is not None else UserState.take(ns, spec.options.device or "")
                )
            self.last_snapshot_bytes = saved.nbytes if saved is not None else 0
            if saved is not None:
                files.hold_open(saved.open_files)
            try:
                with hold.released(), files.watching(), capture_output():
                    attempt = execute(self.shell, spec, bounds=bounds, scan=False, settings=self.settings)
            finally:
                hold.holding = True
                files.stop()
                if saved is not None:
                    saved.restore(ns)
                # Before the files go back: a file object the trial left open flushes as it is collected.
                collect(spec.options.device)
                written = files.restore()
                differs = (saved.verify(ns) if saved is not None else ()) + files.differs()
                # Within one plan or search nothing runs between trials: the next trial goes back to the
                # same snapshot (where a check found something different, it is said, and no baseline moves).
                self._kept = saved if self._keeping else None
                record = saved.record() if saved is not None else Restored(snapshot=False)
                record = replace(record, files=written, differs=differs)
                keep_on = self._keeping and self.restored is not None
                self.restored = self.restored.merged(record) if keep_on else record
        if files.refused is not None:
            raise CellWritesFiles(
                f"Not measured: {files.refused}; the trial stopped there and left the files as they were."
            )
        if attempt.outcome == "interrupted" or hold.arrived:
            raise KeyboardInterrupt
        return attempt

    @contextlib.contextmanager
    def _trials(self) -> Iterator[None]:
        """The trials of one plan or search: one snapshot serves them all (nothing runs between them);
        ``restored`` gathers what they put back and what a check after a restore found different."""
        self._keeping, self._kept, self.restored = True, None, None
        try:
            yield
        finally:
            self._keeping, self._kept = False, None

    # --- building the record --------------------------------------------------------------------------

    def _build(self, spec: RunSpec, attempt: Attempt) -> CellRun:
        context, findings = None, ()
        if attempt.scan is not None:
            from ..diagnosis.context import make_context
            from ..diagnosis.rules import diagnose

            try:
                context = make_context(
                    spec.source,
                    attempt.recording,
                    attempt.report,
                    attempt.scan,
                    batch_name=spec.options.batch,
                    applied=tuple(r.kind for r in spec.applied),
                    dropped=[name for name, _ in attempt.dropped],
                )
                findings = tuple(diagnose(attempt.report, context))
                if attempt.ranks is not None:
                    from ..diagnosis.ranks import in_every_rank, rank_findings

                    ranks = rank_findings(attempt.ranks, spec.source, context.batch)
                    findings = ranks + in_every_rank(findings)
            except Exception as err:  # a diagnosis bug must not hide the report itself
                print(f"%%gpumem: the diagnosis failed ({type(err).__name__}: {err}); the figures stand")
        return CellRun(
            source=spec.source,
            recording=attempt.recording,
            options=spec.options,
            applied=spec.applied,
            outcome=attempt.outcome,
            report=attempt.report,
            error=attempt.error_text,
            freed=attempt.freed,
            dropped=tuple(attempt.dropped),
            context=context,
            findings=findings,
            execution_count=spec.execution_count,
            cell_id=spec.cell_id,
            started=attempt.started,
            wall_s=attempt.wall_s,
            parent=spec.parent,
            original=spec.original,
            categories=attempt.categories,
            gpu_busy=attempt.busy,
            snapshot_ms=attempt.snapshot_ms,
            ranks=attempt.ranks,
            raised=attempt.raised,
            unrecorded=attempt.unrecorded,
        )

    def _plan(self, run: CellRun) -> Any:
        from .plan import measure_plan, unmeasured_plan

        try:
            with self._trials():
                return measure_plan(self, run)
        except KeyboardInterrupt:
            self.progress("plan stopped: the fixes below are not measured")
            return unmeasured_plan(run, "stopped")
        except Exception as err:  # a bug of the plan must not replace the cell's own out-of-memory error
            self.progress(
                f"%%gpumem: the fix plan failed ({type(err).__name__}: {err}); its fixes are not measured"
            )
            return unmeasured_plan(run, f"the plan failed ({type(err).__name__}: {err})")

    def pending_error(self, run: CellRun) -> BaseException | None:
        """The exception ``run``'s cell ends with, handed over once: the cell's own, which the magic raises
        again so the cell fails with its own type and traceback, or after an out-of-memory error the
        ``torch.OutOfMemoryError`` the magic raises instead (``run.errors``)."""
        return self._errors.pop(run.id, None)

    def _record(self, run: CellRun, attempt: Attempt) -> CellRun:
        if attempt.error is not None:
            self._errors[run.id] = attempt.error
        self.history.append(run)
        self.snapshots[run.id] = attempt.snapshot
        while len(self.snapshots) > KEPT_SNAPSHOTS:
            self.snapshots.pop(next(iter(self.snapshots)))
        if self._publish is not None:
            with contextlib.suppress(Exception):
                self._publish(run)
        self._watchers = [ref for ref in self._watchers if ref() is not None]
        for ref in list(self._watchers):
            method = ref()
            if method is not None:
                with contextlib.suppress(Exception):  # a view's bug must not fail the run
                    method(run)
        return run


def _print_progress(line: str) -> None:
    # A trial's line ("  trial 3: Batch 256 → 16 …") stays open until its result ends it.
    print(line, end="" if line.endswith("…") else "\n", flush=True)


_SESSIONS: dict[int, Session] = {}


def session_for(shell: Any) -> Session:
    """The session of ``shell`` (made on first use; its runs go to the sidebar through the comm)."""
    session = _SESSIONS.get(id(shell))
    if session is None or session.shell is not shell:
        from .. import comm

        session = Session(shell)
        session._publish = lambda run, s=session: comm.publish(run, s.history)
        comm.serve(session)
        _SESSIONS[id(shell)] = session
    return session


def history() -> list[CellRun]:
    """Every ``%%gpumem`` run of this kernel's shell, oldest first (the live list)."""
    from IPython import get_ipython

    shell = get_ipython()
    return session_for(shell).history if shell is not None else []
