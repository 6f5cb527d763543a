"""NVML figures a run's report needs: the device's used memory, this process's and the other processes'
share of it (for the categories), and how busy the GPU was while the cell ran (sampled at 10 Hz).

``pynvml`` comes from the ``nvidia-ml-py`` distribution; without it, or without a driver, every reader
returns None and the report leaves the figure out. NVML ignores ``CUDA_VISIBLE_DEVICES``: the device is
matched by the UUID torch reports.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
from dataclasses import dataclass
from typing import Any

# 10 Hz: NVML's utilisation counter is itself an average over its sample period (1/6 s to 1 s by GPU),
# and a reading costs ~10 µs; a faster thread would only contend for the GIL.
BUSY_PERIOD_S = 0.1


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes NVML reports for one device: ``used`` on the whole device, ``process`` this process's figure
    (None where NVML lists no such PID: containers show host PIDs, Windows shows none), ``others`` the sum
    of the other processes listed on it."""

    used: int
    process: int | None
    others: int


@functools.cache
def handle_for(index: int) -> Any:
    """The NVML handle of ``cuda:index`` (None without NVML), looked up once per process: NVML stays
    initialised and the devices a process sees do not change. Initialises NVML, never CUDA: where torch
    has started CUDA the device is matched by the UUID torch reports, else by ``CUDA_VISIBLE_DEVICES``
    (asking torch for the UUID would start CUDA, which a later fork, as ``notebook_launcher`` makes, cannot
    survive)."""
    try:
        import pynvml
        import torch

        pynvml.nvmlInit()
        if not torch.cuda.is_initialized():
            return _handle_by_ordinal(pynvml, index)
        uuid = str(getattr(torch.cuda.get_device_properties(index), "uuid", "")).removeprefix("GPU-")
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            u = pynvml.nvmlDeviceGetUUID(h)
            u = (u.decode() if isinstance(u, bytes) else u).removeprefix("GPU-")
            if uuid and u == uuid:
                return h
        return pynvml.nvmlDeviceGetHandleByIndex(index) if not uuid else None
    except Exception:
        return None


def _handle_by_ordinal(pynvml: Any, index: int) -> Any:
    from ...devices import cuda_ordinals

    handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
    uuids = []
    for h in handles:
        u = pynvml.nvmlDeviceGetUUID(h)
        uuids.append(u.decode() if isinstance(u, bytes) else u)
    for nvml_index, ordinal in cuda_ordinals(os.environ.get("CUDA_VISIBLE_DEVICES"), uuids).items():
        if ordinal == index:
            return handles[nvml_index]
    return None


def total_memory(handle: Any) -> int | None:
    """The device's whole memory in bytes as NVML reports it (None without NVML): what
    ``torch.cuda.mem_get_info`` gives as its total, read without starting CUDA."""
    if handle is None:
        return None
    try:
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
    except Exception:
        return None


def device_memory(handle: Any) -> DeviceMemory | None:
    """NVML's memory figures for ``handle`` now (None without NVML)."""
    if handle is None:
        return None
    try:
        import pynvml

        try:
            # v2 keeps what the driver and firmware reserve (~0.5 GiB on an H100) out of `used`: no process
            # holds it, so the processes' figures sum to v2's used, not v1's.
            used = int(pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2).used)
        except Exception:
            used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        me, others = None, 0
        with contextlib.suppress(Exception):
            for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
                n = int(p.usedGpuMemory or 0)
                if p.pid == os.getpid():
                    me = (me or 0) + n
                else:
                    others += n
        return DeviceMemory(used, me, others)
    except Exception:
        return None


class BusySampler:
    """Samples the GPU's busy percentage every ``BUSY_PERIOD_S`` on a daemon thread while a cell runs;
    ``mean`` is the average of the samples (None with none). Sleeps between samples, never spins."""

    def __init__(self, handle: Any) -> None:
        self.handle = handle
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.handle is None:
            return
        self._thread = threading.Thread(target=self._run, name="oommagic-busy", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            # A cell shorter than one period still gets the counter's own average over its last period.
            with contextlib.suppress(Exception):
                import pynvml

                self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))

    def _run(self) -> None:
        import pynvml

        while not self._stop.wait(BUSY_PERIOD_S):
            try:
                self.samples.append(int(pynvml.nvmlDeviceGetUtilizationRates(self.handle).gpu))
            except Exception:
                return

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
