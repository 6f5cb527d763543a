"""The kernel end of the sidebar's comm: ``publish(run)`` sends each ``%%gpumem`` run to JupyterLab.

Protocol version 1 (the frontend end is ``labextension/src/protocol.ts``):

- the kernel opens the comm, target ``oommagic``, on the first ``publish`` with
  ``{"version": 1, "type": "hello", "runs": [<CellRun.to_json()>, ...]}``: every run so far;
- then sends ``{"version": 1, "type": "run", "run": <CellRun.to_json()>}`` for each run (a retry has
  ``parent`` = the id of the run it retried);
- the frontend sends ``{"type": "sync"}`` to have the hello sent again (a reloaded page does, after
  finding the open comm by ``comm_info_request``);
- the frontend sends ``{"type": "remove", "run": <id>, "index": <i>}`` to run that run's cell again without
  the fix at ``applied[i]``, and ``{"type": "apply", "run": <id>, "entry": <k>}`` to run it with the fix
  plan's entry ``k``; the new run arrives as a ``run`` message (its ``parent`` is ``<id>``), or, when the
  action cannot be done, ``{"version": 1, "type": "error", "run": <id>, "message": "..."}``;
- a run that fits with a rewritten source carries ``write`` (``diagnosis/write_back.py``: the cell's body,
  and the notebook functions it redefined with their text as the notebook holds it); after a fix pressed
  in the report widget fits, the kernel sends ``{"version": 1, "type": "write", "run": <id>, "cell_id":
  ..., "write": {...}}`` and the frontend writes it into the notebook (unless its setting says not to), then
  answers ``{"type": "written", "run": <id>}``.

Uses the ``comm`` package, which ipykernel wires to the kernel; outside a kernel (terminal IPython, a
script) ``comm.create_comm`` gives a comm that sends nothing, so ``publish`` builds no message, and
ipykernel is never imported here. Each run's message body is built once: a frontend without the
``oommagic`` target closes every comm, and each publish then opens a new one with every run.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from .cellrun import CellRun

TARGET = "oommagic"
PROTOCOL_VERSION = 1

log = logging.getLogger(__name__)

# The one open comm of this kernel; None until the first publish or after the frontend closed it.
_comm: Any = None
# Where the hello's runs come from: the session's history, handed over with each publish.
_runs: Sequence[CellRun] = ()
# What runs a sidebar action: the session registers it (this module knows no session).
_actions: Any = None
# run id -> (the run, its CellRun.to_json()): a run is frozen, its body the same at every send.
_bodies: dict[str, tuple[CellRun, dict[str, Any]]] = {}
# run id -> the bound method to call when the frontend wrote that run into the notebook (weakly held: a
# report closed meanwhile is not kept alive for an answer that may never come).
_on_written: dict[str, weakref.WeakMethod] = {}


def serve(actions: Any) -> None:
    """Let the sidebar's ``remove`` and ``apply`` messages act through ``actions`` (the session)."""
    global _actions
    _actions = actions


def hello(runs: Sequence[CellRun]) -> dict[str, Any]:
    """The hello message: every ``%%gpumem`` run of this kernel so far, oldest first."""
    return {"version": PROTOCOL_VERSION, "type": "hello", "runs": [_body(run) for run in runs]}


def run_message(run: CellRun) -> dict[str, Any]:
    """The message that announces one run."""
    return {"version": PROTOCOL_VERSION, "type": "run", "run": _body(run)}


def _body(run: CellRun) -> dict[str, Any]:
    kept = _bodies.get(run.id)
    if kept is None or kept[0] is not run:
        kept = _bodies[run.id] = (run, {**run.to_json(), "write": _write_of(run)})
    return kept[1]


def _write_of(run: CellRun) -> dict[str, Any] | None:
    """What writing ``run`` into the notebook changes, for a run that fits with a rewritten source."""
    from .diagnosis.write_back import cell_write

    original = run.original or run.source
    if run.outcome != "ok" or run.source == original:
        return None
    # The functions as the notebook holds them were read by the run the person started (the root).
    by_id = {r.id: r for r in _runs}
    root, seen = run, set()
    while root.parent in by_id and root.id not in seen:
        seen.add(root.id)
        root = by_id[root.parent]
    helpers = root.context.helpers if root.context is not None else ()
    return cell_write(run.source, original, helpers).to_json()


def write_to_cell(run: CellRun, on_written: Callable[[str], None] | None = None) -> None:
    """Ask the frontend to write ``run`` (a fix pressed in the report widget that fits) into its notebook
    cell, so that the notebook says what the kernel now runs; the bound method ``on_written(run.id)`` is
    called when the frontend answers that it did (``{"type": "written", "run": <id>}``). Never raises;
    nothing outside a kernel."""
    if not _in_kernel() or run.cell_id is None:
        return
    write = _body(run)["write"]
    if write is None:
        return
    if on_written is not None:
        _on_written[run.id] = weakref.WeakMethod(on_written)  # type: ignore[arg-type]
    try:
        _open().send(
            {
                "version": PROTOCOL_VERSION,
                "type": "write",
                "run": run.id,
                "cell_id": run.cell_id,
                "write": write,
            }
        )
    except Exception:
        log.warning(
            "oommagic: could not ask the frontend to write run %s into its cell", run.id, exc_info=True
        )


def publish(run: CellRun, runs: Sequence[CellRun]) -> None:
    """Send ``run`` to the sidebar, opening the comm (with the hello of ``runs``, the kernel's history)
    first if none is open.

    Never raises: a frontend that is not there, or a message that cannot be sent, is logged and the
    cell's own result stands.
    """
    global _runs
    _runs = runs  # the live history list: a later sync reads it again
    if not _in_kernel():
        return
    try:
        _open().send(run_message(run))
    except Exception:
        log.warning("oommagic: could not send run %s to the sidebar", run.id, exc_info=True)


def _in_kernel() -> bool:
    """Whether a kernel wired the ``comm`` package: ipykernel replaces ``comm.create_comm``; the package's
    own makes comms that send nothing."""
    import comm

    return comm.create_comm is not getattr(comm, "_create_comm", None)


def _open() -> Any:
    global _comm
    if _comm is None:
        import comm

        # Looked up at call time: ipykernel replaces comm.create_comm when the kernel starts.
        opened = comm.create_comm(target_name=TARGET, data=hello(_runs))
        opened.on_msg(_on_msg)
        opened.on_close(lambda msg: _forget(opened))
        _comm = opened
    return _comm


def _on_msg(msg: dict[str, Any]) -> None:
    data = msg.get("content", {}).get("data")
    # Anything else (a newer frontend's message, garbage) is ignored.
    if not isinstance(data, dict) or _comm is None:
        return
    kind = data.get("type")
    if kind == "sync":
        try:
            _comm.send(hello(_runs))
        except Exception:
            log.warning("oommagic: could not answer the sidebar's sync", exc_info=True)
    elif kind in ("remove", "apply") and _actions is not None:
        _act(kind, data)
    elif kind == "written":
        ref = _on_written.pop(str(data.get("run")), None)
        done = ref() if ref is not None else None
        if done is not None:
            try:
                done(str(data.get("run")))
            except Exception:  # a view's bug must not break the comm
                log.warning("oommagic: the report could not show that its fix was written", exc_info=True)


def _act(kind: str, data: dict[str, Any]) -> None:
    """Run a sidebar action; the session publishes the new run. A bad request is answered, never raised."""
    run = next((r for r in _runs if r.id == data.get("run")), None)
    try:
        if run is None:
            raise ValueError(f"no run {data.get('run')!r} in this kernel")
        if kind == "remove":
            index = int(data.get("index", -1))
            if not 0 <= index < len(run.applied):
                raise ValueError(f"run {run.id} has no fix {index} in force")
            _actions.remove(run, index)
        else:
            entries = run.plan.entries if run.plan is not None else ()
            k = int(data.get("entry", -1))
            if not 0 <= k < len(entries):
                raise ValueError(f"run {run.id} has no plan entry {k}")
            _actions.retry(run, entries[k].fixes)
    except (ValueError, TypeError) as err:
        _comm.send(
            {"version": PROTOCOL_VERSION, "type": "error", "run": data.get("run"), "message": str(err)}
        )
    except Exception as err:  # the cell's own error: the kernel goes on, the sidebar is told
        _comm.send(
            {"version": PROTOCOL_VERSION, "type": "error", "run": data.get("run"), "message": repr(err)}
        )


def _forget(closed: Any) -> None:
    # A frontend without the target (another client on the same kernel) closes comms it cannot
    # place; the next publish opens a new one, with a hello that carries every run.
    global _comm
    if _comm is closed:
        _comm = None
