"""The workloads the benchmarks run: a GPT-2-sized training loop (built from its config, no download), a
loop of thousands of tiny elementwise ops, and one batch-size trial; plus the memory limit they run under.

``tiny=True`` gives a GPT-2 of the same shape small enough for a CPU smoke run.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

SEQ = 512


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def gpt2(device: str, tiny: bool = False) -> torch.nn.Module:
    """GPT-2 124M (``GPT2Config(n_positions=512)``), fp32, in training mode, on ``device``."""
    from transformers import GPT2Config, GPT2LMHeadModel

    if tiny:
        config = GPT2Config(n_positions=64, n_embd=64, n_layer=2, n_head=2, vocab_size=512)
    else:
        config = GPT2Config(n_positions=SEQ)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = GPT2LMHeadModel(config)
    return model.train()


def tokens(model: torch.nn.Module, batch: int, seq: int, device: str) -> torch.Tensor:
    return torch.randint(0, model.config.vocab_size, (batch, seq), device=device)


class TrainLoop:
    """A training loop with one optimizer that lives across cells, as in a notebook."""

    def __init__(self, model: torch.nn.Module, batch: int, seq: int, device: str) -> None:
        self.model, self.device = model, device
        self.opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        self.x = tokens(model, batch, seq, device)

    def step(self) -> None:
        loss = self.model(input_ids=self.x, labels=self.x).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, steps: int) -> list[float]:
        return timed(self.step, steps, self.device)


class SmallOps:
    """Thousands of tiny elementwise ops per step: each allocates a fresh 1 KiB block, which is what
    an allocator trace or a GIL-hungry poller costs most on."""

    def __init__(self, device: str, ops: int = 2000) -> None:
        self.device, self.ops = device, ops
        self.x = torch.ones(256, device=device)

    def step(self) -> None:
        x = self.x
        for _ in range(self.ops // 2):
            x = x * 1.0001 + 0.0001
        self.out = x

    def run(self, steps: int) -> list[float]:
        return timed(self.step, steps, self.device)


def timed(step: Callable[[], None], steps: int, device: str) -> list[float]:
    """Seconds of each of ``steps`` calls, the device synchronised around each."""
    out = []
    for _ in range(steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        out.append(time.perf_counter() - t0)
    return out


def train_trial(
    model: torch.nn.Module, batch: int, steps: int, device: str, seq: int = SEQ, autocast: Any = None
) -> None:
    """``steps`` optimizer steps at ``batch`` with a fresh AdamW (step 1 creates Adam's state, so a
    trial needs two steps to reach a step's real peak). Raises the out-of-memory error when it does
    not fit; gradients and the optimizer are gone afterwards either way."""
    model.zero_grad(set_to_none=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    try:
        x = tokens(model, batch, seq, device)
        for _ in range(steps):
            ctx = (
                torch.autocast(device.split(":")[0], dtype=autocast) if autocast else contextlib.nullcontext()
            )
            with ctx:
                loss = model(input_ids=x, labels=x).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        sync(device)
    finally:
        model.zero_grad(set_to_none=True)
        opt.state.clear()


def clean(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@dataclass
class Held:
    """Peak reserved and allocated bytes while a ``memory_limit`` block ran (absolute, not above a
    baseline; the CPU emulation counts no cache, so there they are the same)."""

    peak_reserved: int = 0
    peak_allocated: int = 0


@contextlib.contextmanager
def memory_limit(device: str, limit: int | None) -> Iterator[Held]:
    """Cap this process at ``limit`` bytes (None: no cap, only measure): ``set_per_process_memory_fraction``
    on CUDA (the allocator weighs its reserved total against it); on CPU, oommagic's emulation (a recorder
    that raises ``torch.OutOfMemoryError`` past the limit). Yields the block's peak reserved and allocated
    bytes, filled at exit."""
    held = Held()
    if device.startswith("cuda"):
        index = torch.device(device).index or 0
        getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
        old = getter(index) if getter else 1.0
        if limit is not None:
            total = torch.cuda.mem_get_info(index)[1]
            torch.cuda.set_per_process_memory_fraction(limit / total, index)
        torch.cuda.reset_peak_memory_stats(index)
        try:
            yield held
        finally:
            held.peak_reserved = torch.cuda.max_memory_reserved(index)
            held.peak_allocated = torch.cuda.max_memory_allocated(index)
            torch.cuda.set_per_process_memory_fraction(old, index)
    else:
        from oommagic.run.capture import CpuRecorder

        recorder = CpuRecorder(limit)
        try:
            with recorder:
                yield held
        finally:
            held.peak_reserved = held.peak_allocated = recorder.recording().peak_reserved
