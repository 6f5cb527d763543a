"""Ranks started from a ``%%gpumem`` cell: each rank process records itself, and the cell gathers them.

How a rank gets its recorder, without a change to the user's code: while the cell runs, the magic wraps
the target of ``torch.multiprocessing.start_processes`` (which ``torch.multiprocessing.spawn`` and
torch.distributed.elastic, hence ``accelerate.notebook_launcher``, call) in a ``RankTarget``, a picklable
object of ``run.rank_process`` that opens a ``RankRecorder`` around the user's function in the child. Scripts
started through ``!torchrun`` or ``subprocess`` are other programs; they read the same settings from the
environment the magic sets (``OOMMAGIC_RANKS_DIR``, ``OOMMAGIC_LIMIT``, ``OOMMAGIC_DEVICE``) through one
documented call, ``with oommagic.rank_recorder(): train()``. (A ``sitecustomize`` on ``PYTHONPATH`` would
reach them unasked, but it would shadow the interpreter's own and run in every Python the cell starts.)

Each rank writes one JSON file into a per-cell directory: ``oom-``, ``error-``, ``ok-`` or ``stopped-``.
When one rank fails, a watcher thread in every other rank sees its file (it lists the directory every
50 ms: a file-system call, not a memory poll), writes its own figures and ends its process, which gives its
memory back; the failing rank waits for them (at most ``STOP_WAIT`` s), kills any that did not report,
aborts its process group and fails. The launcher then sees the failure at once instead of the others
waiting in their next collective until its timeout.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import replace
from typing import Any

from ..diagnosis.ranks import RankResult, Ranks
from .bounds import ENV_BOUNDS, Bounds
from .rank_files import ENV_DEVICE, ENV_DIR, ENV_LIMIT, alive, limit_text, names, pids
from .rank_process import RankTarget

__all__ = ["RankWatch", "alive", "watch_ranks"]

_base: str | None = None
_cells = itertools.count()


def _cell_directory() -> str:
    """A new directory name for one cell's ranks, inside one private directory per kernel (made once,
    removed when the kernel exits). Not made: most cells start no rank, and making and removing a
    directory on every cell costs milliseconds on some file systems. The launcher makes it."""
    global _base
    if _base is None or not os.path.isdir(_base):
        _base = tempfile.mkdtemp(prefix="oommagic-ranks-")
        atexit.register(shutil.rmtree, _base, True)
    return os.path.join(_base, f"cell-{next(_cells)}")


class RankWatch:
    """For one cell: the directory the ranks report into, the environment that names it, the wrapped
    ``start_processes`` and ``Process.start``; ``gather()`` reads the ranks back and kills any still
    running."""

    def __init__(self, limit: float | int | None, device: str, bounds: Bounds | None = None) -> None:
        self.limit = limit_text(limit)
        self.device = "cpu" if device == "cpu" else "cuda"
        # A trial's ranks stop where a trial in the kernel would (``bounds``): the same steady state.
        self.bounds = bounds.for_ranks() if bounds is not None else None
        self.directory = ""
        self._saved_env: dict[str, str | None] = {}
        self._patched: list[tuple[Any, str, Any]] = []
        self._pid = os.getpid()
        self._started = itertools.count()  # the index of the next process the cell starts itself

    def __enter__(self) -> RankWatch:
        self.directory = _cell_directory()
        values = {
            ENV_DIR: self.directory,
            ENV_LIMIT: self.limit,
            ENV_DEVICE: self.device,
            ENV_BOUNDS: self.bounds,
        }
        for key, value in values.items():
            self._saved_env[key] = os.environ.get(key)
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._patch()
        return self

    def __exit__(self, *exc: Any) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _remove(self.directory)

    def _patch(self) -> None:
        # torch.multiprocessing.spawn() calls its own module's start_processes; torch.distributed.elastic
        # (torchrun's agent, accelerate's notebook_launcher) calls torch.multiprocessing.start_processes.
        import torch.multiprocessing  # torch is imported by the recorder already

        for owner in (torch.multiprocessing, sys.modules.get("torch.multiprocessing.spawn")):
            if owner is not None and hasattr(owner, "start_processes"):
                original = owner.start_processes
                owner.start_processes = self._wrapped(original)
                self._patched.append((owner, "start_processes", original))
        # Ranks the cell starts one by one (`mp.Process(target=run, args=(rank, world)).start()`, the
        # tutorials' way): every Process class of multiprocessing and torch.multiprocessing starts here.
        import multiprocessing.process

        base = multiprocessing.process.BaseProcess
        self._patched.append((base, "start", base.start))
        base.start = self._started_process(base.start)

    def _started_process(self, original: Any) -> Any:
        watch = self

        def start(process: Any) -> None:
            target = getattr(process, "_target", None)
            # Only a process this kernel starts for the cell's own function: not one a rank starts (a
            # forked rank inherits this class), nor a library's (DataLoader workers, launchers' own).
            if os.getpid() == watch._pid and _user_function(target) and not isinstance(target, RankTarget):
                os.makedirs(watch.directory, exist_ok=True)
                settings = (watch.directory, watch.limit, watch.device, watch.bounds)
                process._target = RankTarget(target, *settings, index=next(watch._started))
            return original(process)

        start.__wrapped__ = original  # type: ignore[attr-defined]
        return start

    def _wrapped(self, original: Any) -> Any:
        watch = self

        def start_processes(fn, args=(), nprocs=1, join=True, daemon=False, start_method="spawn"):
            os.makedirs(watch.directory, exist_ok=True)
            settings = (watch.directory, watch.limit, watch.device, watch.bounds)
            if _elastic_worker(fn) and args and not isinstance(args[0], RankTarget):
                # torch.distributed.elastic's worker (notebook_launcher's) hands the user's function's
                # return back after it: the recorder goes around the user's function, inside the worker.
                args = (RankTarget(args[0], *settings, indexed=False), *args[1:])
            elif not isinstance(fn, RankTarget) and not _elastic_worker(fn):
                fn = RankTarget(fn, *settings, returns=not _hands_results_over(fn))
            return original(fn, args, nprocs, join, daemon, start_method)

        start_processes.__doc__ = original.__doc__
        start_processes.__wrapped__ = original  # type: ignore[attr-defined]
        return start_processes

    def gather(self, stop: bool = False) -> Ranks | None:
        """The ranks that reported into this cell's directory (None: the cell started none). After a
        rank failed, or with ``stop`` (the cell failed or was interrupted), a rank still running now is
        killed and marked ``left_running``; one that wrote nothing is ``lost`` (``running`` when it was
        left to work: started with ``join=False`` by a cell that ended well)."""
        started, _ = pids(self.directory)
        if not started:
            return None
        results: dict[int, RankResult] = {}
        helpers: set[int] = set()
        for name in names(self.directory):
            if name.startswith("pid-"):
                continue
            with contextlib.suppress(OSError, ValueError, TypeError):
                with open(os.path.join(self.directory, name)) as fh:
                    data = json.load(fh)
                if data.get("alone") and data.get("joined") is False:
                    # A process the cell started one by one that never joined a process group: a helper
                    # of the person's, not a rank.
                    helpers.add(data["pid"])
                    continue
                result = RankResult.from_json(data)
                results[result.pid] = result
        started -= helpers
        if not started:
            return None
        failed = stop or any(r.status in ("oom", "error") for r in results.values())
        for pid in started:
            still = alive(pid)
            # After a failure no rank may outlive the cell; ranks started with join=False that are
            # still working are left alone (``%gpumem`` maps their PIDs to ranks).
            if still and failed:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            if pid not in results:
                with open(os.path.join(self.directory, f"pid-{pid}.json")) as fh:
                    index = json.load(fh).get("index", -1)
                status = "running" if still and not failed else "lost"
                results[pid] = RankResult(rank=index, pid=pid, status=status, device=self.device)
            if still and failed:
                results[pid] = replace(results[pid], left_running=True)
        return Ranks.of(list(results.values()))


def _elastic_worker(fn: Any) -> bool:
    return getattr(fn, "__module__", "") == "torch.distributed.elastic.multiprocessing.api" and (
        getattr(fn, "__name__", "") == "_wrap"
    )


# Libraries whose own processes are not ranks of the cell (workers, pools, launchers that record their
# ranks through start_processes).
_LIBRARY_PROCESSES = (
    "multiprocessing",
    "concurrent",
    "torch",
    "joblib",
    "loky",
    "tqdm",
    "IPython",
    "ipykernel",
    "jupyter",
    "zmq",
    "lightning",
    "pytorch_lightning",
    "lightning_fabric",
    "accelerate",
    "transformers",
    "datasets",
)


def _user_function(target: Any) -> bool:
    """Whether ``target`` is a function of the person's (a notebook's, or a module of theirs), not a
    library's."""
    if target is None or not callable(target):
        return False
    module = getattr(target, "__module__", None) or ""
    return module.split(".", 1)[0] not in _LIBRARY_PROCESSES


def _hands_results_over(fn: Any) -> bool:
    """Whether ``fn`` is a launcher's worker that passes its results to the parent after the user's
    function returns (Lightning's ``ddp_notebook``/``ddp_spawn`` worker, a bound method of its launcher)."""
    module = getattr(fn, "__module__", None) or ""
    return module.startswith(("lightning", "pytorch_lightning", "lightning_fabric"))


def _remove(directory: str) -> None:
    # By full paths, not shutil.rmtree: rmtree removes by names relative to an open directory, which a
    # trial's file watch (``trial_files``) cannot tell from the user's files.
    for name in os.listdir(directory) if os.path.isdir(directory) else ():
        with contextlib.suppress(OSError):
            os.remove(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(directory)


def watch_ranks(limit: float | int | None, device: str, bounds: Bounds | None = None) -> RankWatch:
    """The rank watch of one cell: enter it around the cell, ``gather()`` after it. ``bounds``: the cell
    runs as a trial, and so do its ranks."""
    return RankWatch(limit, device, bounds)
