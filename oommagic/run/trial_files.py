"""The files a trial writes, put back after it: before the first write to a file during a trial its bytes
are copied aside (or its absence noted), and after the trial every such file is put back exactly (its
content, its modification time, whether it exists). A file too large to copy aside stops the trial at
that write, and the plan says the cell writes it instead of measuring.

Python's audit hooks see every ``open`` for writing and every remove or rename (PEP 578). A hook cannot be
removed, so one is installed per process, at the first trial, and does nothing unless a trial is watching.
``torch.save`` to a path opens the file in C++, out of the hooks' sight: while a trial watches, its
writer is wrapped to announce the open the way Python's own ``open`` does.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from ..sizes import format_bytes
from .bounds import TrialStop
from .snapshot import SnapshotTooLarge

# Bytes of files a trial may copy aside to put back (a checkpoint per step of a large model is more).
FILE_BOUND = 1024**3
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
# Not files of the user's: the kernel's own devices and pseudo-files.
_SYSTEM = ("/dev/", "/proc/", "/sys/")


def compiler_caches() -> tuple[str, ...]:
    """Where torch.compile's compilers keep their caches (inductor's in the temp folder, Triton's in the
    home folder): a compiled model's trial writes and removes scratch folders there, which are no work of
    the user's to put back (a compiled model's every trial was refused for one, on an H100)."""
    import getpass

    dirs = [
        os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
        os.path.join(tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}"),
        os.environ.get("TRITON_CACHE_DIR"),
        os.path.join(os.path.expanduser("~"), ".triton"),
    ]
    return tuple(os.path.abspath(d) + os.sep for d in dirs if d)


def launcher_scratch() -> tuple[str, ...]:
    """What a distributed cell's trial writes that is the launch's, not the user's: the directory its ranks
    report into (``run.ranks``, removed after each run), the error files torch's launcher keeps for each
    rank while it runs and torch.distributed.elastic's log directory (``notebook_launcher``'s)."""
    temp = os.path.abspath(tempfile.gettempdir())
    return tuple(os.path.join(temp, p) for p in ("oommagic-ranks-", "pytorch-errorfile-", "torchelastic_"))


_watching: TrialFiles | None = None
_installed = False


class FileTooLarge(TrialStop):
    """Stops a trial at a write to a file larger than a trial keeps aside."""


class CellWritesFiles(SnapshotTooLarge):
    """The trial was stopped at a write it could not undo: the plan says so instead of a verdict."""

    why = "the cell writes files a trial cannot put back"


class TrialFiles:
    """The files one trial wrote, each with a copy of what it held before (None: it did not exist)."""

    def __init__(self, bound: int | None = None) -> None:
        self.bound = FILE_BOUND if bound is None else bound
        self.kept: dict[str, str | None] = {}
        self.made_dirs: list[str] = []
        self.refused: str | None = None
        self.caches = compiler_caches() + launcher_scratch()
        self.kept_bytes = 0
        # Files the namespace holds open for writing: (file object, bytes before, position before).
        self.held: dict[str, tuple[Any, int, int | None]] = {}
        self._scratch: str | None = None
        self._busy = threading.local()

    @contextlib.contextmanager
    def watching(self) -> Iterator[TrialFiles]:
        """Copy aside each file before its first write while the block runs."""
        global _watching
        _install()
        writer = _announce_torch_writes()
        _watching = self
        try:
            yield self
        finally:
            self.stop()
            writer()

    def stop(self) -> None:
        global _watching
        if _watching is self:
            _watching = None

    def hold_open(self, files: list) -> None:
        """Before the trial: files the namespace holds open for writing (a log, a ``FileHandler``'s
        stream) take writes no hook sees. One appended to (or at its end) is cut back to its length after
        the trial; any other is copied aside like a file opened in the trial."""
        for f in files:
            try:
                f.flush()
                path = os.path.abspath(f.name)
                size = os.path.getsize(path)
                position = f.tell()
            except (OSError, ValueError):
                continue
            if "a" not in getattr(f, "mode", "") and position != size:
                try:
                    self.keep(path)
                except FileTooLarge as err:
                    raise CellWritesFiles(f"Not measured: {err} (it is open for writing)") from None
            self.held[path] = (f, size, position)

    def restore(self) -> tuple[str, ...]:
        """Put every file the trial wrote back as it was; returns their paths. Files the trial made are
        removed, then the directories it made (once empty)."""
        touched = []
        for path, (f, size, position) in self.held.items():
            with contextlib.suppress(OSError, ValueError):
                f.flush()  # the trial's writes still buffered land now, before the file is put back
                if path not in self.kept and os.path.getsize(path) != size:
                    os.truncate(path, size)
                    touched.append(path)
                if position is not None:
                    f.seek(position)
        for path, copy in self.kept.items():
            with contextlib.suppress(OSError):
                if copy is None:
                    if os.path.lexists(path) and not os.path.isdir(path):
                        os.remove(path)
                else:
                    shutil.copy2(copy, path)
        for path in reversed(self.made_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(path)
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
        return tuple(dict.fromkeys([*self.kept, *touched]))

    def differs(self) -> tuple[str, ...]:
        """The files not as they were before the trial (empty after ``restore``)."""
        out = []
        for path, copy in self.kept.items():
            if copy is None and os.path.lexists(path):
                out.append(path)
        return tuple(out)

    # --- called by the audit hook -------------------------------------------------------------------

    def keep(self, raw: Any) -> None:
        """Before ``raw`` (a path) is first written, copy it aside or note that it does not exist."""
        try:
            path = os.path.abspath(os.fsdecode(os.fspath(raw)))
        except TypeError:
            return  # a file descriptor: the file was opened before, or by path in this trial
        if path in self.kept or path.startswith(_SYSTEM):
            return
        if self._scratch is not None and path.startswith(self._scratch):
            return
        if os.path.isdir(path):
            return
        if not os.path.lexists(path):
            self.kept[path] = None
            return
        real = os.path.realpath(path)
        size = os.path.getsize(real)
        if self.kept_bytes + size > self.bound:
            self.refused = (
                f"the cell writes {path} ({format_bytes(size)}), more than the {format_bytes(self.bound)} a "
                "trial copies aside to put back"
            )
            raise FileTooLarge(self.refused)
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="oommagic-trial-")
        copy = os.path.join(self._scratch, str(len(self.kept)))
        shutil.copy2(real, copy)
        self.kept_bytes += size
        self.kept[real] = copy
        if real != path:
            self.kept.setdefault(path, copy)

    def made(self, raw: Any) -> None:
        with contextlib.suppress(TypeError):
            path = os.path.abspath(os.fsdecode(os.fspath(raw)))
            if not os.path.lexists(path):
                self.made_dirs.append(path)

    def refuse(self, raw: Any, what: str) -> None:
        self.refused = f"the cell {what} {os.fsdecode(os.fspath(raw))}, which a trial cannot put back"
        raise FileTooLarge(self.refused)


def _on_event(event: str, args: tuple) -> None:
    files = _watching
    if files is None:
        return  # the hook's whole cost outside a trial
    handle = _EVENTS.get(event)
    if handle is None or getattr(files._busy, "on", False):
        return
    if args and _in_caches(args[0], files.caches):
        return
    files._busy.on = True  # copying a file aside opens files too
    try:
        handle(files, args)
    finally:
        files._busy.on = False


def _in_caches(raw: Any, caches: tuple[str, ...]) -> bool:
    try:
        return os.path.abspath(os.fsdecode(os.fspath(raw))).startswith(caches)
    except TypeError:
        return False


def _open(files: TrialFiles, args: tuple) -> None:
    path, mode, flags = args
    writes = any(c in mode for c in "wax+") if isinstance(mode, str) else bool((flags or 0) & _WRITE_FLAGS)
    if writes:
        files.keep(path)


def _rename(files: TrialFiles, source: Any, target: Any) -> None:
    with contextlib.suppress(TypeError):
        if os.path.isdir(os.fspath(source)):
            files.refuse(source, "moves the directory")
    files.keep(source)
    files.keep(target)


_EVENTS = {
    "open": _open,
    "os.remove": lambda files, args: files.keep(args[0]),
    "os.rename": lambda files, args: _rename(files, *args[:2]),
    "os.truncate": lambda files, args: files.keep(args[0]),
    "os.link": lambda files, args: files.keep(args[1]),
    "os.symlink": lambda files, args: files.keep(args[1]),
    "os.mkdir": lambda files, args: files.made(args[0]),
    "os.rmdir": lambda files, args: files.refuse(args[0], "removes the directory"),
    "shutil.rmtree": lambda files, args: files.refuse(args[0], "removes the directory"),
}


def _install() -> None:
    global _installed
    if not _installed:
        sys.addaudithook(_on_event)
        _installed = True


def _announce_torch_writes() -> Any:
    """While a trial watches, ``torch.save(obj, "path")`` raises the ``open`` audit event before its C++
    writer opens the file. Returns the undo."""
    torch = sys.modules.get("torch")
    writer = getattr(getattr(torch, "_C", None), "PyTorchFileWriter", None)
    if writer is None:
        return lambda: None

    def announced(target: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(target, (str, bytes, os.PathLike)):
            sys.audit("open", target, "wb", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        return writer(target, *args, **kwargs)

    torch._C.PyTorchFileWriter = announced

    def undo() -> None:
        torch._C.PyTorchFileWriter = writer

    return undo
