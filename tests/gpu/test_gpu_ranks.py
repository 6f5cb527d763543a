"""GPU: DDP on two GPUs started from a ``%%gpumem`` cell through ``torch.multiprocessing.spawn`` (NCCL).

Skipped unless this process sees at least two CUDA devices. Run with ``-s -v``: each test prints the
per-rank table it measured. The rank functions live in a module written to a temporary directory on
``sys.path`` (spawn imports them by name in each child, as it would a user's ``train.py``).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from oommagic.run.ranks import alive

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GiB = 1024**3

DDP_MODULE = '''
import datetime
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel


def ddp(rank, world, port, overrun_rank, stray):
    """DDP over ``world`` GPUs; ``overrun_rank`` asks for 6 GiB at step 3 (over a 4 GiB per-rank limit)
    while the others wait in the next all-reduce (NCCL's timeout: 10 minutes). With ``stray`` each rank
    makes a CUDA call before choosing its device, which opens a context on GPU 0."""
    if stray:
        torch.cuda.synchronize()
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    model = DistributedDataParallel(torch.nn.Linear(4096, 4096).cuda(), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range(20):
        loss = model(torch.randn(64, 4096, device="cuda")).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rank == overrun_rank and step == 3:
            torch.empty(6 * 1024**3, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    dist.destroy_process_group()
'''


@pytest.fixture
def ddp_module(tmp_path, shell):
    (tmp_path / "gpu_ranks_ddp.py").write_text(DDP_MODULE)
    shell.run_cell(f"import sys; sys.path.insert(0, {str(tmp_path)!r})")
    yield "gpu_ranks_ddp"
    shell.run_cell(f"sys.path.remove({str(tmp_path)!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_run():
    import oommagic

    return oommagic.history()[-1]


def nvml_sees_our_pids() -> bool:
    """NVML lists host PIDs: inside a container they differ from ours and no per-process figure maps."""
    from oommagic.devices import read_devices

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    return any(p.pid == __import__("os").getpid() for d in read_devices().devices for p in d.processes)


def spawn_cell(module: str, overrun: int, stray: bool, limit: str = "4GiB") -> str:
    return (
        f"%%gpumem --limit {limit} --text --no-raise\n"
        f"import torch.multiprocessing as mp\nimport {module}\n"
        f"mp.spawn({module}.ddp, args=(2, {free_port()}, {overrun}, {stray}), nprocs=2)"
    )


def test_ddp_one_rank_out_of_memory(cell, ddp_module):
    t0 = time.perf_counter()
    cell(spawn_cell(ddp_module, overrun=1, stray=False))
    took = time.perf_counter() - t0
    run = last_run()
    ranks = run.ranks
    print(f"cell took {took:.1f} s; ranks: {[r.to_json() for r in ranks.results]}")
    assert run.outcome == "oom"
    assert [r.rank for r in ranks.results] == [0, 1]
    assert [r.device for r in ranks.results] == ["cuda:0", "cuda:1"]
    failed = ranks.failed_first
    assert failed.rank == 1 and failed.status == "oom" and failed.requested >= 6 * GiB
    assert ranks.results[0].status == "stopped" and ranks.results[0].stopped_by == 1
    assert ranks.bottleneck.rank == 1
    for r in ranks.results:
        assert r.limit == 4 * GiB and 0 < r.peak_allocated <= r.peak_reserved <= r.limit
    assert not any(alive(r.pid) for r in ranks.results), "a rank is still running"
    # NCCL's timeout is 10 minutes: the cell ended long before it.
    assert took < 120
    assert run.report is not None and run.report.requested >= 6 * GiB
    assert run.headline().startswith("rank 1 (cuda:1) ran out of memory asking for 6.00 GiB"), run.headline()
    if nvml_sees_our_pids():
        assert all(r.outside is not None and r.outside > 0 for r in ranks.results), "NVML used − reserved"
    # Every rank's memory is back: no process of the cell holds memory on either GPU.
    from oommagic.devices import read_devices

    held = {p.pid for d in read_devices().devices for p in d.processes}
    assert not held & {r.pid for r in ranks.results}


def test_ddp_stray_context_on_gpu0(cell, ddp_module):
    if not nvml_sees_our_pids():
        pytest.skip("NVML lists host PIDs here (a container): per-process contexts cannot be mapped to ranks")
    cell(spawn_cell(ddp_module, overrun=-1, stray=True))
    run = last_run()
    print(f"ranks: {[r.to_json() for r in run.ranks.results]}; strays {run.ranks.strays}")
    assert run.outcome == "ok"
    strays = run.ranks.strays
    assert [(s.rank, s.index) for s in strays] == [(1, 0)]
    assert strays[0].used >= 256 * 1024**2  # a CUDA context: ~0.5 GiB
    assert "stray CUDA context" in " ".join(run.ranks.summary())
