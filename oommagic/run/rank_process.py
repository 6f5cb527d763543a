"""In a rank process: ``RankRecorder`` records the rank and stops it when another rank fails.

It gets there without a change to the user's code through ``RankTarget`` (the kernel wraps the function
``torch.multiprocessing.start_processes`` runs, see ``run.ranks``), or through ``rank_recorder()``, the one
call a script run by ``!torchrun`` makes.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

from ..oom import is_oom, parse_oom
from .bounds import ENV_BOUNDS, TrialStop, bounded, rank_bounds
from .rank_cuda import RankLimit, cuda_figures
from .rank_files import ENV_DEVICE, ENV_DIR, ENV_LIMIT, failed_rank, limit_bytes, unreported, write

POLL_S = 0.05
STOP_WAIT = 3.0
STOPPED_EXIT = 1  # what a stopped rank exits with: a failure, so launchers end the others too
# A trial's rank still running this long after its deadline is stuck (in a collective whose peer stopped at
# its own bounds, say): its watcher ends it.
PAST_DEADLINE_S = 2.0


# --- the settings a rank reads ------------------------------------------------------------------------


def _settings_from_env() -> tuple[str, str | None, str, str | None] | None:
    directory = os.environ.get(ENV_DIR)
    if not directory:
        return None
    limit, device = os.environ.get(ENV_LIMIT) or None, os.environ.get(ENV_DEVICE, "cpu")
    return directory, limit, device, os.environ.get(ENV_BOUNDS) or None


@contextlib.contextmanager
def rank_recorder(index: int | None = None) -> Iterator[None]:
    """Record this process as one rank of a ``%%gpumem`` cell (the one call a script run by ``torchrun``
    or ``subprocess`` from the cell makes: ``with oommagic.rank_recorder(): train()``).

    Reads the settings the magic put in the environment; outside a ``%%gpumem`` cell it records nothing.
    ``index`` defaults to ``LOCAL_RANK`` (the GPU a rank uses by convention), else ``RANK``.
    """
    settings = _settings_from_env()
    if settings is None:
        yield
        return
    directory, limit, device, bounds = settings
    os.makedirs(directory, exist_ok=True)  # the cell names it; the first rank makes it
    if index is None:
        index = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    with RankRecorder(directory, limit, device, index, bounds):
        yield


class RankTarget:
    """The user's rank function, wrapped so that the child process records itself. Pickled by reference
    to ``fn`` (the user's function must be importable in the child, as ``torch.multiprocessing`` already
    requires with the spawn start method).

    ``indexed``: ``fn`` takes the rank's index first (what ``torch.multiprocessing.start_processes``
    passes); otherwise it is the function torch.distributed.elastic's worker calls with the user's own
    arguments, and the index is ``LOCAL_RANK`` (set by that worker). ``index``: the rank's index where the
    kernel knows it (the order in which the cell started its processes one by one). ``returns``: where a
    trial's bounds end the rank, it returns as if ``fn`` had (its launcher then sees it succeed); otherwise
    ``fn`` owes its launcher more than its return (Lightning's worker hands its results over a queue after
    it), and the rank ends its process once every rank reported."""

    def __init__(
        self,
        fn: Any,
        directory: str,
        limit: str | None,
        device: str,
        bounds: str | None = None,
        indexed: bool = True,
        returns: bool = True,
        index: int | None = None,
    ) -> None:
        self.fn = fn
        self.directory, self.limit, self.device, self.bounds = directory, limit, device, bounds
        self.indexed, self.returns, self.index = indexed, returns, index

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        index = self.index
        if index is None:
            index = args[0] if self.indexed else int(os.environ.get("LOCAL_RANK", "0"))
        alone = self.index is not None
        with RankRecorder(self.directory, self.limit, self.device, index, self.bounds, self.returns, alone):
            return self.fn(*args, **kwargs)


# --- in the rank process ------------------------------------------------------------------------------


class RankRecorder:
    """Records this rank process: its peak, its out-of-memory error, its GPU contexts; stops it when
    another rank fails; writes one result file. In CPU mode the tensor tracker with the per-rank limit;
    on CUDA nothing touches a GPU before the user's code does, and nothing but the rank's own device after
    (no stray context of our own): the limit goes on the device the rank chooses (``RankLimit``), and the
    figures are read at the end from the device the rank worked on (``own_device``), without opening a
    context anywhere.
    """

    def __init__(
        self,
        directory: str,
        limit: str | None,
        device: str,
        index: int,
        bounds: str | None = None,
        returns: bool = True,
        alone: bool = False,
    ) -> None:
        self.directory = directory
        self.returns = returns
        # A process the cell started one by one is a rank only once it joins a process group (a helper
        # process of the person's is not): ``joined`` says whether it did, for the kernel to tell.
        self.alone = alone
        self._joined = False
        self.limit = limit
        self.device = device
        self.index = index
        # A trial's bounds (``bounds.Bounds.for_ranks``): the rank stops at the same steady state as a trial
        # in the kernel would. None: the cell's own run, which only counts the optimizer steps.
        self.bounds = rank_bounds(bounds)
        self._counting: contextlib.ExitStack | None = None
        self._counter: Any = None
        self.pid = os.getpid()
        self._cpu: Any = None
        self._limit: RankLimit | None = None
        self._lock = threading.Lock()
        self._written = False
        self._done = threading.Event()
        self._main = threading.get_ident()
        self._watcher: threading.Thread | None = None

    # The life of a rank.

    def __enter__(self) -> RankRecorder:
        write(self.directory, f"pid-{self.pid}", {"pid": self.pid, "index": self.index, "alone": self.alone})
        if self.device == "cpu":
            self._cpu = _cpu_recorder(self.limit)
            self._cpu.__enter__()
        elif self.limit is not None:
            self._limit = RankLimit(self.limit, self.index)
            self._limit.install()
        self._count_steps()
        self._watcher = threading.Thread(target=self._watch, name="oommagic-rank-watch", daemon=True)
        self._watcher.start()
        return self

    def __exit__(self, etype: Any, exc: BaseException | None, tb: Any) -> bool:
        self._done.set()
        failed_at = time.time()
        if self._counting is not None:
            self._counter.running = False
            with contextlib.suppress(Exception):
                self._counting.close()
        if self._cpu is not None:
            with contextlib.suppress(Exception):
                self._cpu.__exit__(None, None, None)
        if self._limit is not None:
            self._limit.remove()
        if exc is None:
            self._report("ok")
            return False
        if isinstance(exc, TrialStop):
            # The trial's own end, at the same point in every rank: the rank returns as if its function
            # had (the launcher sees no failure); a rank out of time is said so.
            self._report("timed_out" if exc.timed_out else "ok", trial_stop=str(exc))
            if not self.returns:
                self._end_after_the_others()
            return True
        if isinstance(exc, Exception):
            frames = _traceback_frames(tb)
            if not is_oom(exc):
                # Another rank failed first and aborted the process group: this rank's collective broke
                # under it before the watcher saw the report. It was stopped by that failure, not failing.
                stopped_by = failed_rank(self.directory, self.pid)
                if stopped_by is not None:
                    self._report("stopped", exc=exc, stopped_by=stopped_by, frames=frames)
                    return False
            status = "oom" if is_oom(exc) else "error"
            if self._report(status, exc=exc, failed_at=failed_at, frames=frames):
                self._stop_the_others()
                _abort_process_group()
        return False

    def _count_steps(self) -> None:
        """Count this rank's optimizer steps; in a trial, stop it at its bounds. A forked rank drops the
        kernel's trial bounds it inherited (a torch function mode of the thread that forked), and keeps any
        other mode (``with torch.device(...)`` around the launch)."""
        from torch.overrides import _get_current_function_mode_stack, _pop_mode, _push_mode

        stack = _get_current_function_mode_stack()
        kept = [m for m in stack if not getattr(m, "oommagic_trial", False)]
        if len(kept) != len(stack):
            while _get_current_function_mode_stack():
                _pop_mode()
            for mode in kept:
                _push_mode(mode)
        bounds, deadline = self.bounds if self.bounds is not None else (None, None)
        self._counting = contextlib.ExitStack()
        self._counter = self._counting.enter_context(bounded(bounds, deadline, count=True))

    def _past_deadline(self) -> bool:
        deadline = self.bounds[1] if self.bounds is not None else None
        return deadline is not None and time.time() > deadline + PAST_DEADLINE_S

    def _watch(self) -> None:
        """Another rank failed: write this rank's figures and end this process (its memory goes back).
        A trial's rank stuck past its deadline ends the same way, as out of time."""
        while not self._done.wait(POLL_S):
            self._joined = self._joined or _in_process_group()
            if self._past_deadline():
                if self._report("timed_out", trial_stop="stuck past the trial's deadline"):
                    os._exit(STOPPED_EXIT)
                return
            failed = failed_rank(self.directory, self.pid)
            if failed is None:
                continue
            frames = _thread_frames(self._main)
            if self._report("stopped", stopped_by=failed, frames=frames):
                with contextlib.suppress(Exception):
                    sys.stdout.flush()
                    sys.stderr.flush()
                os._exit(STOPPED_EXIT)
            return

    def _end_after_the_others(self) -> None:
        """End this trial's rank once every rank reported (their bounds end them at the same step), or
        past the trial's deadline: ended first, it would be a failure to its launcher, which would stop
        the others before they report."""
        deadline = self.bounds[1] if self.bounds is not None and self.bounds[1] else time.time() + STOP_WAIT
        while unreported(self.directory) - {self.pid} and time.time() < deadline + PAST_DEADLINE_S:
            time.sleep(POLL_S)
        with contextlib.suppress(Exception):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(STOPPED_EXIT)

    def _stop_the_others(self) -> None:
        """Wait for every other rank to report (their watchers stop them), then kill those that did not."""
        deadline = time.time() + STOP_WAIT
        while time.time() < deadline:
            if not unreported(self.directory):
                return
            time.sleep(POLL_S / 2)
        for pid in unreported(self.directory):
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)

    # The result file.

    def _report(
        self,
        status: str,
        exc: BaseException | None = None,
        failed_at: float | None = None,
        stopped_by: int | None = None,
        frames: list[Any] | None = None,
        trial_stop: str | None = None,
    ) -> bool:
        """Write this rank's result once (the main thread and the watcher may race); False if written."""
        with self._lock:
            if self._written:
                return False
            self._written = True
        # The report is written whatever a reading below meets: a rank without one reads as "lost".
        result: dict[str, Any] = {"pid": self.pid}
        with contextlib.suppress(Exception):
            result = self._figures()
        result.update(status=status, stopped_by=stopped_by, failed_at=failed_at, ended_at=time.time())
        result.update(steps=self._counter.steps if self._counter is not None else None, trial_stop=trial_stop)
        if exc is not None:
            message = _message(exc)
            report = parse_oom(message) if status == "oom" else None
            result["message"] = report.text if report is not None else message[-4000:]
            result["requested"] = report.requested if report is not None else None
            exact = getattr(self._cpu, "exact", None) or {}
            if exact.get("requested"):
                result["requested"] = exact["requested"]
        with contextlib.suppress(Exception):
            result.update(_state_bytes(frames or []))
        result["rank"] = _rank(self.index)
        result.update(alone=self.alone, joined=self._joined or _in_process_group())
        name = f"{status}-rank{result['rank']}-pid{self.pid}"
        write(self.directory, name, result)
        return True

    def _figures(self) -> dict:
        figures: dict[str, Any] = {"pid": self.pid}
        if self._cpu is not None:
            rec = self._cpu.recording()
            figures.update(
                device="cpu",
                peak_allocated=rec.peak_allocated,
                peak_reserved=rec.peak_reserved,
                limit=rec.limit,
                capacity=rec.capacity,
            )
            return figures
        figures.update(cuda_figures(self.index, self.limit))
        return figures


def _cpu_recorder(limit: str | None) -> Any:
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode

    from .capture.cpu import LEDGER, CpuRecorder, host_memory

    # A forked rank (notebook_launcher) inherits the kernel's tracker and ledger: this process starts
    # its own count.
    while _get_current_dispatch_mode_stack():
        _pop_mode()
    LEDGER.live.clear()
    LEDGER.allocated = 0
    LEDGER.listener = None
    return CpuRecorder(limit_bytes(limit, host_memory()), timeline=False)


def _in_process_group() -> bool:
    """Whether this process is in a torch.distributed process group now (read without importing it)."""
    dist = sys.modules.get("torch.distributed")
    try:
        return dist is not None and dist.is_available() and dist.is_initialized()
    except Exception:
        return False


def _rank(index: int) -> int:
    with contextlib.suppress(Exception):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", index))


def _abort_process_group() -> None:
    """Abort (NCCL) or destroy (gloo) the default process group, so that this rank leaves no collective
    waiting on it; in a thread, bounded, since a destroy can block on an unfinished collective."""
    try:
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            return
    except Exception:
        return

    def end() -> None:
        with contextlib.suppress(Exception):
            if dist.get_backend() == "nccl" and hasattr(dist.distributed_c10d, "_abort_process_group"):
                dist.distributed_c10d._abort_process_group()
            else:
                dist.destroy_process_group()

    worker = threading.Thread(target=end, daemon=True)
    worker.start()
    worker.join(STOP_WAIT)


def _traceback_frames(tb: Any) -> list[Any]:
    frames = []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    return frames


def _thread_frames(ident: int) -> list[Any]:
    frame = sys._current_frames().get(ident)
    frames = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    return frames


def _state_bytes(frames: list[Any]) -> dict:
    """Bytes of the weights, gradients and optimizer state of the models and optimizers the rank's
    frames hold (each storage once); empty where no frame holds one."""
    try:
        import torch
    except ImportError:
        return {}
    modules, optimizers = {}, {}
    for frame in frames:
        with contextlib.suppress(Exception):
            for value in list(frame.f_locals.values()):
                if isinstance(value, torch.nn.Module):
                    modules[id(value)] = value
                elif isinstance(value, torch.optim.Optimizer):
                    optimizers[id(value)] = value
    if not modules and not optimizers:
        return {}
    seen: set[int] = set()

    def size(tensors: Any) -> int:
        total = 0
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            # FSDP2's parameters are DTensors: this rank holds their local shard. A tensor subclass with
            # no storage of its own counts its elements.
            t = t.to_local() if hasattr(t, "to_local") else t
            try:
                storage = t.untyped_storage()
                key, nbytes = storage.data_ptr() or id(storage), storage.nbytes()
            except (RuntimeError, NotImplementedError):
                key, nbytes = id(t), t.numel() * t.element_size()
            if key not in seen:
                seen.add(key)
                total += nbytes
        return total

    params = [p for m in modules.values() for p in m.parameters()]
    params += [p for o in optimizers.values() for g in o.param_groups for p in g["params"]]
    return {
        "params": size(params),
        "grads": size(p.grad for p in params if p.grad is not None),
        "optimizer_state": size(t for o in optimizers.values() for s in o.state.values() for t in s.values()),
    }


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:
        return repr(type(exc))
