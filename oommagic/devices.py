"""The GPUs as NVML sees them: memory per card, the processes on it, and which CUDA ordinal it is here.

``read_devices()`` imports ``pynvml`` (the ``nvidia-ml-py`` distribution) when called, never at import,
and never raises: a missing library, a missing driver or one broken card end up as ``error`` strings in
the report. ``render_devices_text()`` is the ``%gpumem`` line magic's table.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from .sizes import format_bytes

_T = TypeVar("_T")


@dataclass(frozen=True)
class GpuProcess:
    """A process holding memory on one GPU. ``pid`` is the host's PID (differs inside containers);
    ``name`` is None when NVML may not read it, ``used`` (bytes) when NVML does not report it (Windows
    WDDM, MIG)."""

    pid: int
    name: str | None
    used: int | None

    def to_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "name": self.name, "used": self.used}


@dataclass(frozen=True)
class GpuStatus:
    """One GPU: ``nvml_index`` is NVML's (PCI bus) order, ``cuda_index`` the ordinal this process uses
    (``cuda:N``), None when ``CUDA_VISIBLE_DEVICES`` hides the card. Bytes are ``int``; a figure NVML
    refused is None and ``error`` says what was refused."""

    nvml_index: int
    cuda_index: int | None
    uuid: str | None
    name: str | None
    used: int | None
    total: int | None
    free: int | None
    processes: tuple[GpuProcess, ...]
    error: str | None

    def to_json(self) -> dict[str, Any]:
        return {
            "nvml_index": self.nvml_index,
            "cuda_index": self.cuda_index,
            "uuid": self.uuid,
            "name": self.name,
            "used": self.used,
            "total": self.total,
            "free": self.free,
            "processes": [p.to_json() for p in self.processes],
            "error": self.error,
        }


@dataclass(frozen=True)
class DeviceReport:
    """What NVML said. ``available`` is False (with ``error`` saying why) when NVML could not be
    loaded, initialised or asked for the device count; ``devices`` then is empty."""

    available: bool
    error: str | None
    driver: str | None
    devices: tuple[GpuStatus, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "available": self.available,
            "error": self.error,
            "driver": self.driver,
            "devices": [d.to_json() for d in self.devices],
        }


# ---------------------------------------------------------------------------------------------------
# CUDA_VISIBLE_DEVICES → CUDA ordinals (a decision: pure, tested with data)
# ---------------------------------------------------------------------------------------------------

_LEADING_DIGITS = re.compile(r"\+?(\d+)")


def cuda_ordinals(
    visible: str | None,
    uuids: Sequence[str | None],
    mig_parents: Mapping[str, str] | None = None,
) -> dict[int, int]:
    """Map NVML index → CUDA ordinal for a ``CUDA_VISIBLE_DEVICES`` value; hidden cards are absent.

    ``uuids[i]`` is the UUID (``GPU-…``) of NVML device ``i`` (None if unreadable); ``mig_parents``
    maps a ``MIG-<instance uuid>`` entry to the UUID of the card holding that instance.

    Follows the CUDA runtime (as torch's ``torch.cuda._parse_visible_devices`` does): entries are
    integers or UUID prefixes; the first entry that names no card ends the list, a card named twice
    hides every card, and only the first MIG instance is enumerated. ``None`` (unset) shows every card
    in NVML order. Integers are taken as NVML indices, which holds when ``CUDA_DEVICE_ORDER=PCI_BUS_ID``
    or the cards are one model (CUDA's default "fastest first" order breaks ties by PCI bus, as NVML
    orders).
    """
    if visible is None:
        return {i: i for i in range(len(uuids))}
    ordinals: dict[int, int] = {}
    for entry in (e.strip() for e in visible.split(",")):
        index = _entry_index(entry, uuids, mig_parents or {})
        if index is None:
            break
        if index in ordinals:
            return {}
        ordinals[index] = len(ordinals)
        if entry.startswith("MIG-"):
            break
    return ordinals


def _entry_index(entry: str, uuids: Sequence[str | None], mig_parents: Mapping[str, str]) -> int | None:
    """The NVML index one ``CUDA_VISIBLE_DEVICES`` entry names, or None when it names no single card."""
    if entry.startswith("MIG-GPU-"):  # before CUDA 11.1: MIG-<card uuid>/<gi>/<ci>
        return _uuid_index(entry[len("MIG-") :].split("/")[0], uuids)
    if entry.startswith("MIG-"):  # since CUDA 11.1: MIG-<instance uuid>, which only NVML can place
        parent = mig_parents.get(entry)
        return _uuid_index(parent, uuids) if parent else None
    if entry.startswith("GPU-"):
        return _uuid_index(entry, uuids)
    # CUDA reads integers like strtoul: "1gpu" is 1, "-1" ends the list.
    match = _LEADING_DIGITS.match(entry)
    if not match:
        return None
    index = int(match.group(1))
    return index if index < len(uuids) else None


def _uuid_index(prefix: str, uuids: Sequence[str | None]) -> int | None:
    """The one card whose UUID starts with ``prefix`` (CUDA accepts abbreviations); None if 0 or 2+."""
    hits = [i for i, uuid in enumerate(uuids) if uuid and uuid.startswith(prefix)]
    return hits[0] if len(hits) == 1 else None


# ---------------------------------------------------------------------------------------------------
# Reading NVML (effectful shell)
# ---------------------------------------------------------------------------------------------------


def read_devices(nvml: Any = None) -> DeviceReport:
    """Read every GPU through NVML: memory, processes, CUDA ordinal. Never raises.

    ``nvml`` is the ``pynvml`` module or a stand-in with its API; by default ``pynvml`` is imported now.
    Initialises NVML and shuts it down again (NVML counts references, so a caller's own session is
    untouched). Blocks for as long as the driver takes: call it off an event loop.
    """
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError as exc:
            return _unavailable(f"pynvml is not installed: pip install nvidia-ml-py ({exc})")
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError, or OSError from a broken driver install
        return _unavailable(_describe(exc))
    try:
        return _read_initialised(nvml)
    except Exception as exc:  # a driver answering in a shape nobody expected must not break %gpumem
        return _unavailable(f"unexpected answer from NVML: {_describe(exc)}")
    finally:
        # A failed shutdown changes nothing about the figures already read.
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()


def _unavailable(error: str) -> DeviceReport:
    return DeviceReport(available=False, error=error, driver=None, devices=())


def _read_initialised(nvml: Any) -> DeviceReport:
    driver, _ = _attempt(nvml.nvmlSystemGetDriverVersion)
    count, error = _attempt(nvml.nvmlDeviceGetCount)
    if error is not None:
        return DeviceReport(available=False, error=error, driver=_text(driver), devices=())
    devices = [_read_device(nvml, index) for index in range(count)]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ordinals = cuda_ordinals(visible, [d.uuid for d in devices], _mig_parents(nvml, visible))
    devices = [replace(d, cuda_index=ordinals.get(d.nvml_index)) for d in devices]
    return DeviceReport(available=True, error=None, driver=_text(driver), devices=tuple(devices))


def _read_device(nvml: Any, index: int) -> GpuStatus:
    """One card; every query that fails leaves its field None and adds to ``error``."""
    blank = GpuStatus(index, None, None, None, None, None, None, (), None)
    handle, error = _attempt(nvml.nvmlDeviceGetHandleByIndex, index)
    if error is not None:
        return replace(blank, error=error)
    uuid, uuid_error = _attempt(nvml.nvmlDeviceGetUUID, handle)
    name, name_error = _attempt(nvml.nvmlDeviceGetName, handle)
    memory, memory_error = _attempt(nvml.nvmlDeviceGetMemoryInfo, handle)
    processes, process_error = _read_processes(nvml, handle)
    errors = [
        f"{what}: {e}"
        for what, e in (
            ("uuid", uuid_error),
            ("name", name_error),
            ("memory", memory_error),
            ("processes", process_error),
        )
        if e is not None
    ]
    return replace(
        blank,
        uuid=_text(uuid),
        name=_text(name),
        used=_bytes(getattr(memory, "used", None)),
        total=_bytes(getattr(memory, "total", None)),
        free=_bytes(getattr(memory, "free", None)),
        processes=processes,
        error="; ".join(errors) or None,
    )


def _read_processes(nvml: Any, handle: Any) -> tuple[tuple[GpuProcess, ...], str | None]:
    """Compute and graphics processes, one entry per PID (a process with both contexts is in both
    lists with the same figure). The error is that of the compute list, the one that matters here."""
    compute, error = _attempt(nvml.nvmlDeviceGetComputeRunningProcesses, handle)
    graphics, _ = _attempt(nvml.nvmlDeviceGetGraphicsRunningProcesses, handle)
    seen: dict[int, int | None] = {}
    for info in [*(compute or ()), *(graphics or ())]:
        used = _bytes(getattr(info, "usedGpuMemory", None))
        if info.pid not in seen or (used or 0) > (seen[info.pid] or 0):
            seen[info.pid] = used
    processes = tuple(GpuProcess(pid, _process_name(nvml, pid), used) for pid, used in seen.items())
    return processes, error


def _process_name(nvml: Any, pid: int) -> str | None:
    # Fails for processes of other users without privileges, and for host PIDs inside a container.
    name, _ = _attempt(nvml.nvmlSystemGetProcessName, pid)
    return _text(name) or None


def _mig_parents(nvml: Any, visible: str | None) -> dict[str, str]:
    """For each ``MIG-<instance uuid>`` entry of ``CUDA_VISIBLE_DEVICES``, the UUID of its card."""
    parents: dict[str, str] = {}
    for entry in (e.strip() for e in (visible or "").split(",")):
        is_instance = entry.startswith("MIG-") and not entry.startswith("MIG-GPU-")
        parent = _mig_parent_uuid(nvml, entry) if is_instance else None
        if parent:
            parents[entry] = parent
    return parents


def _mig_parent_uuid(nvml: Any, entry: str) -> str | None:
    try:
        instance = nvml.nvmlDeviceGetHandleByUUID(entry)
        card = nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(instance)
        return _text(nvml.nvmlDeviceGetUUID(card))
    except Exception:
        return None  # an instance NVML does not know ends the list, as any unknown entry does


def _attempt(call: Callable[..., _T], *args: Any) -> tuple[_T | None, str | None]:
    """``(result, None)``, or ``(None, reason)`` when NVML (or a stand-in lacking the call) refuses."""
    try:
        return call(*args), None
    except Exception as exc:
        return None, _describe(exc)


def _describe(exc: BaseException) -> str:
    # NVMLError's str() is the driver's wording ("NVML Shared Library Not Found"); keep it as is.
    return str(exc) or type(exc).__name__


def _text(value: object) -> str | None:
    """NVML strings as ``str``: old ``nvidia-ml-py`` releases and some stand-ins return bytes."""
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def _bytes(value: object) -> int | None:
    return int(value) if isinstance(value, int) else None


# ---------------------------------------------------------------------------------------------------
# Text for %gpumem
# ---------------------------------------------------------------------------------------------------

_NO_NVML_HINT = (
    "NVML ships with the NVIDIA driver: without an NVIDIA GPU, or in a container started without GPU "
    "access, there is nothing to read."
)


def render_devices_text(
    report: DeviceReport,
    this_process: dict[int, tuple[int, int]] | None = None,
    ranks: Mapping[int, int] | None = None,
) -> str:
    """The ``%gpumem`` table: each GPU's use, this process's PyTorch figures and every process on it.

    ``this_process`` maps a CUDA ordinal to ``(allocated, reserved)`` bytes as torch reports them;
    ``ranks`` a PID to the rank of a ``%%gpumem`` cell that started it (shown next to the PID). Cards
    this process can use come first, in CUDA order; hidden ones follow, marked as such.
    """
    mine = this_process or {}
    if not report.available:
        return "\n".join(
            [f"NVML is not available ({report.error}): no GPU figures. {_NO_NVML_HINT}", *_torch_only(mine)]
        )
    driver = f" (driver {report.driver})" if report.driver else ""
    if not report.devices:
        return f"NVML found no GPUs{driver}."
    gpus = sorted(report.devices, key=_visible_first)
    header = ("device", "nvml", "name", "used", "total", "free")
    rows = [_device_row(gpu) for gpu in gpus]
    widths = [max(len(row[col]) for row in [header, *rows]) for col in range(len(header))]
    lines = [f"GPU memory from NVML{driver}", _aligned(header, widths)]
    for gpu, row in zip(gpus, rows, strict=True):
        lines.append(_aligned(row, widths))
        lines.extend(f"    {line}" for line in _device_details(gpu, mine, ranks or {}))
    return "\n".join(lines)


def _torch_only(mine: Mapping[int, tuple[int, int]]) -> list[str]:
    # Without NVML (ROCm builds, some WSL setups) PyTorch's own figures are all there is.
    return [
        f"cuda:{index}: this process has {format_bytes(allocated)} allocated, "
        f"{format_bytes(reserved)} reserved by PyTorch"
        for index, (allocated, reserved) in sorted(mine.items())
    ]


def _visible_first(gpu: GpuStatus) -> tuple[int, int]:
    return (0, gpu.cuda_index) if gpu.cuda_index is not None else (1, gpu.nvml_index)


def _device_row(gpu: GpuStatus) -> tuple[str, str, str, str, str, str]:
    device = f"cuda:{gpu.cuda_index}" if gpu.cuda_index is not None else "hidden"
    return (
        device,
        str(gpu.nvml_index),
        gpu.name or "?",
        format_bytes(gpu.used),
        format_bytes(gpu.total),
        format_bytes(gpu.free),
    )


def _device_details(
    gpu: GpuStatus, mine: Mapping[int, tuple[int, int]], ranks: Mapping[int, int] | None = None
) -> list[str]:
    lines: list[str] = []
    if gpu.error:
        lines.append(f"NVML error: {gpu.error}")
    if gpu.cuda_index is None:
        lines.append("not visible to this process (CUDA_VISIBLE_DEVICES)")
    elif gpu.cuda_index in mine:
        allocated, reserved = mine[gpu.cuda_index]
        lines.append(
            f"this process: {format_bytes(allocated)} allocated, {format_bytes(reserved)} reserved by PyTorch"
        )
    own_pid = os.getpid()
    for proc in sorted(gpu.processes, key=lambda p: -(p.used or 0)):
        tag = "  (this process)" if proc.pid == own_pid else ""
        if ranks and proc.pid in ranks:
            tag = f"  (rank {ranks[proc.pid]})"
        used = format_bytes(proc.used) if proc.used is not None else "? (not reported)"
        lines.append(f"PID {proc.pid}  {proc.name or '?'}  {used}{tag}")
    if not gpu.processes and not gpu.error:
        lines.append("no processes")
    return lines


def _aligned(cells: Sequence[str], widths: Sequence[int]) -> str:
    return "  ".join(cell.ljust(width) for cell, width in zip(cells, widths, strict=True)).rstrip()
