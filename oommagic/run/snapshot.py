"""Take the user's state before a trial and put it back after: a trial or a search probe runs the cell
for real, and only the run the person accepts may keep its effects.

What is kept is whatever the namespace reaches, found by a walk rather than by a list of types: the
bindings; the attributes of every object with a ``__dict__`` (models at any depth, optimizers, schedulers,
a ``Trainer``, the user's own classes); the contents of every mutable mapping, sequence and set
(``defaultdict``, ``deque``, ``OrderedDict`` included); the values of every tensor (with its ``.grad``)
and NumPy array; the state of every random generator object (torch, NumPy, ``random``) and of the global
ones. Restoring writes the saved values back into the same tensor and container objects, so references
the user holds stay valid, then checks that nothing tracked differs (``UserState.verify``).
"""

from __future__ import annotations

import contextlib
import random
import sys
import threading
from collections.abc import Callable, Iterator, Mapping, MutableSet
from dataclasses import dataclass, field
from typing import Any

from ..diagnosis.context import instance_dict
from ..diagnosis.holdings import is_leaf
from ..sizes import format_bytes
from .reach import Reach
from .restored import Restored

# Leave this share of the host's available memory free when deciding whether a snapshot fits.
HOST_RESERVE = 0.2
# A tensor on an accelerator whose version counter did not move is compared with its copy this much at a time.
COMPARE_BYTES = 64 * 2**20


class SnapshotTooLarge(RuntimeError):
    """The user's state does not fit in host memory; trials would change it for good. ``why`` is what
    the plan's entries say instead of a verdict."""

    why = "the state snapshot does not fit in host memory"


class _Tensor:
    """One tensor as it was: its values on the host, the storage it used, its version counter (which
    every in-place write moves), its ``.grad``'s values and whether it required grad. The gradient object
    itself is not held: a trial that sets it to None frees its memory, as the run it measures would."""

    __slots__ = ("alias", "grad", "path", "requires_grad", "saved", "tensor", "version")

    def __init__(self, tensor: Any, path: str) -> None:
        self.tensor, self.path = tensor, path
        # Shares the storage and the version counter: `t.data = other` swaps the storage, this keeps it.
        self.alias = tensor.detach()
        self.saved = tensor.detach().to("cpu", copy=True)
        self.version = _version(tensor)
        grad = tensor.grad if is_leaf(tensor) else None
        self.grad = grad.detach().to("cpu", copy=True) if grad is not None else None
        self.requires_grad = tensor.requires_grad


@dataclass
class UserState:
    """A snapshot of the user's state (see the module docstring); ``nbytes`` of host memory it holds;
    ``kept`` names what it keeps for the plan's summary, ``not_kept`` what it could not, with why."""

    namespace: dict = field(default_factory=dict)
    tensors: list = field(default_factory=list)
    arrays: list = field(default_factory=list)
    containers: list = field(default_factory=list)
    objects: list = field(default_factory=list)
    generators: list = field(default_factory=list)
    rng: dict = field(default_factory=dict)
    tracked: set = field(default_factory=set)
    open_files: list = field(default_factory=list)
    failed: list = field(default_factory=list)  # what the last restore could not put back, and why
    kept: tuple = ()
    not_kept: tuple = ()
    nbytes: int = 0

    @classmethod
    def take(cls, namespace: Mapping, device: str = "", check_host: bool = True) -> UserState:
        """Snapshot ``namespace`` and everything it reaches. Raises ``SnapshotTooLarge`` (before copying
        anything) when the copies would not fit in host memory."""
        walk = Reach(namespace)
        nbytes = sum(
            _bytes(t) + (_bytes(t.grad) if is_leaf(t) and t.grad is not None else 0)
            for t, _, _ in walk.tensors
        )
        nbytes += sum(a.nbytes for a, _, _ in walk.arrays)
        if check_host:
            available = host_available()
            if available is not None and nbytes > available * (1 - HOST_RESERVE):
                largest = sorted(walk.tensors, key=lambda e: -e[0].numel() * e[0].element_size())[:3]
                raise SnapshotTooLarge(
                    f"keeping what the cell can change for the trials needs {format_bytes(nbytes)} of host "
                    f"memory (largest: {', '.join(p for _, p, _ in largest)}) and "
                    f"{format_bytes(available)} is available; trials would change it for good. Run with "
                    "--no-snapshot to try anyway (the trials then leave their changes), or --plan-budget 0 "
                    "to skip trials."
                )
        state = cls(namespace=dict(namespace), nbytes=nbytes, tracked=set(walk.seen))
        not_kept = list(walk.not_kept)

        def copy() -> None:
            for t, path, _ in walk.tensors:
                try:
                    state.tensors.append(_Tensor(t, path))
                except Exception as err:  # a meta or otherwise storage-less tensor: named, not kept
                    not_kept.append((path, f"not copyable: {type(err).__name__}"))

        off_the_main_thread(copy)
        state.arrays = [(a, a.copy(), path) for a, path, _ in walk.arrays]
        state.containers = [(c, _contents(c), path) for c, path, _ in walk.containers]
        state.objects = [(o, dict(instance_dict(o)), path) for o, path, _ in walk.objects]
        for g, path, _ in walk.generators:
            try:
                get, put = _generator_state(g)
                state.generators.append((g, put, get()))
            except Exception:
                not_kept.append((path, "its state cannot be read"))
        state.open_files = [f for f, _ in walk.files]
        state.rng = _rng_state()
        state.kept, state.not_kept = walk.names(), tuple(not_kept)
        return state

    def restore(self, namespace: dict) -> None:
        """Put everything back as it was when the snapshot was taken: bindings, attributes, contents,
        then the tensors whose values differ, the generators and the global RNGs. One thing that cannot
        be put back does not stop the others: it is named by ``verify``."""

        self.failed = []
        for key in [k for k in namespace if k not in self.namespace]:
            del namespace[key]
        for key, value in self.namespace.items():
            if namespace.get(key, _MISSING) is not value:
                namespace[key] = value
        for obj, attrs, path in self.objects:
            with self._naming(path):
                current = instance_dict(obj)
                if not _same_items(current, attrs):
                    current.clear()
                    current.update(attrs)
        for container, saved, path in self.containers:
            with self._naming(path):
                if not _same_contents(container, saved):
                    _refill(container, saved)

        def write_back() -> None:
            for kept in self.tensors:
                with self._naming(kept.path):
                    _restore_tensor(kept)

        off_the_main_thread(write_back)
        # Views share their base's version counter (`mu, logvar = h.chunk(2)`): writing one back moves the
        # counter the other read, so the counters are read once every value is back.
        for kept in self.tensors:
            kept.version = _version(kept.tensor)
        numpy = sys.modules.get("numpy")
        for array, saved, path in self.arrays:
            with self._naming(path):
                if array.shape != saved.shape:
                    raise ValueError("its shape changed")
                if not numpy.array_equal(array, saved, equal_nan=_has_nan(saved)):
                    numpy.copyto(array, saved)
        for generator, put, state in self.generators:
            with self._naming(type(generator).__name__):
                put(state)
        with self._naming("the global RNGs"):
            _set_rng_state(self.rng)

    @contextlib.contextmanager
    def _naming(self, path: str) -> Iterator[None]:
        try:
            yield
        except Exception as err:  # named in the summary; the rest is still put back
            self.failed.append(f"{path} ({type(err).__name__}: {err})"[:120])

    def record(self) -> Restored:
        """What this snapshot keeps, for the plan's summary."""
        return Restored(
            kept=self.kept,
            not_kept=tuple(f"{path} ({why})" for path, why in self.not_kept),
            nbytes=self.nbytes,
        )

    def verify(self, namespace: Mapping) -> tuple[str, ...]:
        """What differs from the snapshot after ``restore`` (empty when nothing does): a tensor written
        again, a container or attributes not as kept, or an object the namespace now reaches that the
        snapshot never saw (state the restore could not reach)."""
        differs: list[str] = list(self.failed)
        for kept in self.tensors:
            t = kept.tensor
            if _version(t) != kept.version or t.shape != kept.saved.shape or _ptr(t) != _ptr(kept.alias):
                differs.append(kept.path)
            elif is_leaf(t) and (t.grad is None) != (kept.grad is None):
                differs.append(f"{kept.path}.grad")
        differs += [path for c, saved, path in self.containers if not _same_contents(c, saved)]
        differs += [path for o, attrs, path in self.objects if not _same_items(instance_dict(o), attrs)]
        if set(namespace) != set(self.namespace):
            differs.append("the namespace's names")
        walk = Reach(namespace, stop_at=self.tracked)
        differs += [f"{path} (new after the trial)" for path in walk.new[:3]]
        return tuple(dict.fromkeys(differs))


_MISSING = object()


def off_the_main_thread(work: Callable[[], None]) -> None:
    """Run the tool's own tensor copies and comparisons (``work``) on a short-lived thread of their own,
    under ``no_grad``, and wait for it. A parallel CPU op starts an OpenMP team for the thread that runs
    it, and GNU OpenMP's team does not survive a fork: a cell that forks its ranks afterwards (Lightning's
    ``ddp_notebook``, ``start_method="fork"``) gets children whose first parallel op on the main thread
    hangs (here) or segfaults (measured on the H100 machine, in a trial of a Lightning cell whose 3 GiB
    loader tensor the snapshot had copied). The team of a thread that has ended is gone with it, and the
    kernel's main thread keeps none the person did not start. (Setting torch's thread count to 1 around the
    copies instead made every forked CUDA rank abort: once a count was ever set, each autograd device
    thread sets it again at start, which torch 2.11's thread pool refuses after a fork: measured on 2 ×
    H100.) An interrupt while it works waits for it to finish, then is raised: a copy is never left half
    written."""
    import torch

    failed: list[BaseException] = []

    def run() -> None:
        try:
            with torch.no_grad():
                work()
        except BaseException as err:  # raised again on the caller's thread
            failed.append(err)

    helper = threading.Thread(target=run, name="oommagic-snapshot", daemon=True)
    helper.start()
    interrupted: BaseException | None = None
    while helper.is_alive():
        try:
            helper.join()
        except KeyboardInterrupt as err:
            interrupted = err
    if failed:
        raise failed[0]
    if interrupted is not None:
        raise interrupted


def host_available() -> int | None:
    """Bytes of host memory available now (``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _generator_state(g: Any) -> tuple:
    """(read the state, write it back) for a generator object of torch, NumPy or ``random``."""
    import copy

    if isinstance(g, random.Random):
        g.getstate()  # SystemRandom has none: raises here, so the walk names it as not kept
        return g.getstate, g.setstate
    if hasattr(g, "get_state") and hasattr(g, "set_state"):  # torch.Generator, numpy RandomState
        return g.get_state, g.set_state
    bits = g.bit_generator if hasattr(g, "bit_generator") else g

    def put(state: Any) -> None:
        bits.state = state

    return (lambda: copy.deepcopy(bits.state)), put


def _contents(container: Any) -> tuple:
    if isinstance(container, Mapping):
        return (tuple(container.items()), getattr(container, "default_factory", None))
    return (tuple(container), None)


def _same_contents(container: Any, saved: tuple) -> bool:
    items, factory = saved
    if getattr(container, "default_factory", None) is not factory:
        return False
    now = tuple(container.items()) if isinstance(container, Mapping) else tuple(container)
    if len(now) != len(items):
        return False
    if isinstance(container, Mapping):
        return all(a[0] is b[0] and a[1] is b[1] for a, b in zip(now, items, strict=True))
    if isinstance(container, (set, MutableSet)):
        return {id(v) for v in now} == {id(v) for v in items}
    return all(a is b for a, b in zip(now, items, strict=True))


def _same_items(current: dict, saved: dict) -> bool:
    return current.keys() == saved.keys() and all(current[k] is v for k, v in saved.items())


def _refill(container: Any, saved: tuple) -> None:
    """Put ``saved`` back into the same container object, in its order."""
    items, factory = saved
    if hasattr(container, "default_factory"):
        container.default_factory = factory
    if isinstance(container, Mapping):
        container.clear()
        container.update(items)
    elif isinstance(container, (list, bytearray)):
        container[:] = items
    elif isinstance(container, (set, MutableSet)):
        container.clear()
        container |= set(items)
    else:  # deque and any other mutable sequence
        container.clear()
        container.extend(items)


def _restore_tensor(kept: _Tensor) -> None:
    """Values back where they differ: at once where the version counter or the storage moved, else
    after a comparison (a write through ``.data`` or NumPy does not move the counter)."""

    t, saved = kept.tensor, kept.saved
    if _ptr(t) != _ptr(kept.alias) or t.shape != kept.alias.shape or t.dtype != kept.alias.dtype:
        t.data = kept.alias
    changed = kept.version is None or _version(t) != kept.version
    if not changed and saved.numel():
        try:
            changed = not _equal(t, saved)
        except RuntimeError:
            changed = True
    if changed:
        # Through a detached alias (same storage, same version counter): a view of a multi-output op
        # whose base was just written refuses in-place writes of its own (seen on an H100).
        t.detach().copy_(saved)
    kept.version = _version(t)
    if is_leaf(t):
        grad, saved_grad = t.grad, kept.grad
        if saved_grad is None:
            if grad is not None:
                t.grad = None
        elif grad is not None and grad.shape == saved_grad.shape and grad.dtype == saved_grad.dtype:
            if not _equal(grad, saved_grad):
                grad.detach().copy_(saved_grad)
        else:
            t.grad = saved_grad.to(t.device, copy=True)
        if t.requires_grad != kept.requires_grad:
            t.requires_grad_(kept.requires_grad)


def _bytes(t: Any) -> int:
    return t.numel() * t.element_size()


def _equal(t: Any, saved: Any) -> bool:
    """Whether ``t`` holds ``saved``'s values; on an accelerator, compared a slice at a time so that the
    comparison never holds more than ``COMPARE_BYTES`` of device memory (the card was just full)."""
    import torch

    # Detached: a view of a multi-output op (`mu, logvar = stats.chunk(2)`) whose base a restore wrote
    # refuses any view of it while autograd records (seen on an H100: every trial of a VAE cell failed).
    t = t.detach()
    if t.device.type == "cpu":
        return torch.equal(t, saved)
    if not (t.is_contiguous() and saved.is_contiguous()) or t.shape != saved.shape:
        return False
    flat, host = t.reshape(-1), saved.reshape(-1)
    step = max(1, COMPARE_BYTES // max(t.element_size(), 1))
    return all(
        torch.equal(flat[i : i + step], host[i : i + step].to(t.device)) for i in range(0, flat.numel(), step)
    )


def _version(t: Any) -> int | None:
    """The tensor's version counter (None for an inference tensor, which keeps none)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _ptr(t: Any) -> int:
    try:
        return t.data_ptr()
    except RuntimeError:  # sparse and other layouts without one storage
        return 0


def _has_nan(array: Any) -> bool:
    return array.dtype.kind in "fc"


def _rng_state() -> dict:
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
