"""The per-cell directory the ranks of a ``%%gpumem`` cell report into, and the environment that names it.

One JSON file per rank process: ``pid-<PID>`` when it starts, then ``oom-``, ``error-``, ``ok-`` or
``stopped-rank<R>-pid<PID>`` with its figures. Each file is written whole and renamed into place.
"""

from __future__ import annotations

import contextlib
import json
import os

ENV_DIR = "OOMMAGIC_RANKS_DIR"
ENV_LIMIT = "OOMMAGIC_LIMIT"
ENV_DEVICE = "OOMMAGIC_DEVICE"


def limit_text(limit: float | int | None) -> str | None:
    """``--limit`` for the environment: bytes as digits, a fraction with its decimal point."""
    if limit is None:
        return None
    return str(int(limit)) if isinstance(limit, int) else repr(float(limit))


def limit_bytes(limit: str | None, capacity: int) -> int | None:
    """``limit_text``'s value read back as bytes of ``capacity``."""
    if limit is None:
        return None
    return int(limit) if limit.isdigit() else int(float(limit) * capacity)


def write(directory: str, name: str, data: dict) -> None:
    # Written whole, then renamed: a reader never sees half a file. A rank that outlives its cell
    # (join=False) finds the directory gone: nothing to report to.
    tmp = os.path.join(directory, f".{name}.tmp")
    with contextlib.suppress(FileNotFoundError):
        with open(tmp, "w") as fh:
            json.dump(data, fh)
        os.replace(tmp, os.path.join(directory, f"{name}.json"))


def names(directory: str) -> list[str]:
    """The reports in ``directory`` (empty once it is gone)."""
    try:
        return [n for n in os.listdir(directory) if n.endswith(".json")]
    except OSError:
        return []


def failed_rank(directory: str, own_pid: int) -> int | None:
    """The rank of another process that reported a failure (None: none did)."""
    for name in names(directory):
        if name.startswith(("oom-", "error-")) and not name.endswith(f"-pid{own_pid}.json"):
            return int(name.split("-rank", 1)[1].split("-", 1)[0])
    return None


def pids(directory: str) -> tuple[set[int], set[int]]:
    """(PIDs that started as ranks, PIDs that wrote a result)."""
    started, reported = set(), set()
    for name in names(directory):
        if name.startswith("pid-"):
            started.add(int(name[4:-5]))
        else:
            reported.add(int(name.rsplit("-pid", 1)[1][:-5]))
    return started, reported


def unreported(directory: str) -> set[int]:
    """PIDs of ranks that started, wrote no result yet and still run."""
    started, reported = pids(directory)
    return {pid for pid in started - reported if alive(pid)}


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, dead but not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
        except OSError:
            return False
        return True
