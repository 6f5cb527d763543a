"""No hang, whatever fails where: DDP or FSDP2 over gloo, two ranks forked from a ``%%gpumem`` cell (as
``notebook_launcher`` forks them) and joined by hand, rank 1 out of memory under the per-rank CPU
``--limit`` in the forward pass, inside the backward pass (a gradient hook: rank 0's bucket all-reduce
waits for it) or in the optimizer step: rank 0 is stopped by the tool while it waits in a collective,
every rank ends within 30 s of the first failure, no process is left, and the headline names the rank.
(On gloo a peer that exits breaks the collective at once; the wait NCCL shows is measured on two GPUs in
``tests/gpu/test_gpu_rank_launchers.py``.) Also here: a rank whose parameters have no storage of their
own still reports, and ``!torchrun`` from a cell.
"""

from __future__ import annotations

import time

import pytest
import torch

from oommagic.run.ranks import alive
from tests.run.test_ranks import free_port, last_run

MiB = 1024**2

DDP_CELL = """
import datetime, torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
def ddp(rank, port, overrun_rank, phase, wrap):
    torch.set_num_threads(1)  # a forked child hangs in libgomp's barrier if it reuses the kernel's pool
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=300))
    layer = torch.nn.Linear(256, 256)
    if wrap == "fsdp2":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        model = fully_shard(torch.nn.Sequential(layer), mesh=init_device_mesh("cpu", (2,)))
    else:
        model = DistributedDataParallel(torch.nn.Sequential(layer))
    optimizer = torch.optim.Adam(model.parameters())
    state = {"step": 0}
    def overrun(*_):
        if rank == overrun_rank and state["step"] == 1:
            torch.empty(80 * 1024 * 1024, dtype=torch.uint8)
    if phase == "forward":
        layer.register_forward_pre_hook(overrun)
    elif phase == "backward" and wrap == "fsdp2":
        layer.register_full_backward_hook(overrun)  # its reduce-scatter follows: rank 0 waits in it
    elif phase == "backward":
        layer.weight.register_hook(overrun)
    else:
        optimizer.register_step_pre_hook(overrun)
    for step in range(4):
        state["step"] = step
        model(torch.randn(16, 256)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    dist.destroy_process_group()
"""


@pytest.fixture(scope="module", autouse=True)
def ddp_imports_before_the_fork():
    """DDP's first construction imports torch._dynamo (~800 modules, 8 s on a loaded CI core): imported
    once here, each forked rank inherits it instead of importing it on its own."""
    import torch._dynamo  # noqa: F401


@pytest.mark.parametrize(
    ("wrap", "phase"), [("ddp", "forward"), ("ddp", "backward"), ("ddp", "step"), ("fsdp2", "backward")]
)
def test_no_rank_waits_after_one_runs_out(run_cell, wrap, phase):
    # Joined by hand, as a launcher of one's own does: nothing but the tool ends rank 0 (torch's own join
    # would terminate it), and nothing raises in the cell.
    result, out = run_cell(
        "%%gpumem --limit 64MiB --device cpu --text --plan-budget 0\n"  # no plan: the stop is the test
        + DDP_CELL
        + f"ranks = mp.start_processes(ddp, args=({free_port()}, 1, {phase!r}, {wrap!r}), nprocs=2,"
        " start_method='fork', join=False)\nfor process in ranks.processes:\n    process.join()"
    )
    ended = time.time()
    run = last_run()
    assert run.outcome == "oom", out
    # No launcher raised: the cell ends as it would without the tool, its headline names the rank.
    assert result.error_in_exec is None and not run.raised
    assert run.headline().startswith("rank 1 (cpu) ran out of memory asking for 80.00 MiB")
    first = run.ranks.failed_first
    assert (first.rank, first.status, first.requested) == (1, "oom", 80 * MiB)
    # Stopped by the tool, before gloo noticed anything.
    stopped = run.ranks.results[0]
    assert (stopped.status, stopped.stopped_by) == ("stopped", 1)
    assert ended - first.failed_at <= 30, f"the cell ended {ended - first.failed_at:.1f} s after the failure"
    assert all(r.ended_at - first.failed_at <= 30 for r in run.ranks.results)
    assert not any(alive(r.pid) for r in run.ranks.results), "a rank is still running"


class Sharded(torch.Tensor):
    """A tensor with no storage of its own, as FSDP2's DTensor parameters are."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.detach.default:
            return Sharded(args[0].shape)
        raise NotImplementedError(func)


def test_a_rank_with_sharded_parameters_reports_its_failure(tmp_path):
    """A report that could not read the rank's parameters is still written: without it, the rank that ran
    out reads as "lost" and the cell cannot say which rank failed (seen with FSDP2 on two H100s)."""
    import json

    from oommagic.run.rank_process import RankRecorder

    model = torch.nn.Linear(4, 4)
    model.weight = torch.nn.Parameter(Sharded((4, 4)))
    with pytest.raises(torch.OutOfMemoryError), RankRecorder(str(tmp_path), None, "cpu", 0):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 6.00 GiB. GPU 0 has a total ...")
    (report,) = tmp_path.glob("oom-rank0-*.json")
    result = json.loads(report.read_text())
    assert result["status"] == "oom" and result["requested"] == 6 * 1024**3
    assert result["params"] == 4 * 4 * 4 + 4 * 4  # the shard's elements, and the bias's storage
    assert model is not None


TORCHRUN_SCRIPT = """
import datetime, torch, torch.distributed as dist, oommagic

def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    model = torch.nn.Linear(256, 256)
    for step in range(4):
        model(torch.randn(16, 256)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        if dist.get_rank() == 0 and step == 1:
            torch.empty(80 * 1024 * 1024, dtype=torch.uint8)
    dist.destroy_process_group()

with oommagic.rank_recorder():
    main()
"""


def test_torchrun_from_the_cell(run_cell, tmp_path):
    """``!torchrun`` returns when a rank fails: the cell does not fail (as without the tool), and its
    headline says which rank ran out, asking for what."""
    (tmp_path / "train.py").write_text(TORCHRUN_SCRIPT)
    result, out = run_cell(
        "%%gpumem --limit 64MiB --device cpu --text --plan-budget 0\n"
        "import os, sys\npath = os.pathsep.join(sys.path)\n"
        f"!PYTHONPATH={{path}} {{sys.executable}} -m torch.distributed.run --nproc_per_node 2"
        f" --master_port {free_port()} {tmp_path / 'train.py'}"
    )
    run = last_run()
    assert result.error_in_exec is None and run.outcome == "oom" and not run.raised, out
    assert "%%gpumem [OUT OF MEMORY] rank 0 (cpu) ran out of memory asking for 80.00 MiB" in out
    assert [r.rank for r in run.ranks.results] == [0, 1]
    assert run.ranks.results[1].status in ("stopped", "lost")
    assert not any(alive(r.pid) for r in run.ranks.results)


UNRECORDED_SCRIPT = """
import os, torch
# A rank that runs out, as a CUDA rank would say it (this machine has no GPU); no oommagic.rank_recorder().
if int(os.environ["RANK"]) == 1:
    raise torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 6.00 GiB. GPU 1 has a total capacity of 79.19 GiB of which "
        "2.10 GiB is free. Including non-PyTorch memory, this process has 77.08 GiB memory in use. Of the "
        "allocated memory 76.50 GiB is allocated by PyTorch, and 64.00 MiB is reserved by PyTorch but "
        "unallocated."
    )
"""


def test_a_torchrun_script_that_records_nothing_is_not_read_as_ok(run_cell, tmp_path):
    """A script launched with ``!torchrun`` without ``oommagic.rank_recorder()``: its ranks report nothing,
    and torchrun returns. Before, the cell read "[ok] peak 0 bytes" while rank 1 ran out; now its headline
    says which rank ran out asking for what, read from the script's output, and how to get more; nothing
    is measured for it, and the cell does not fail (as without the tool)."""
    (tmp_path / "train.py").write_text(UNRECORDED_SCRIPT)
    result, out = run_cell(
        "%%gpumem --device cpu --text\nimport os, sys\npath = os.pathsep.join(sys.path)\n"
        f"!PYTHONPATH={{path}} {{sys.executable}} -m torch.distributed.run --nproc_per_node 2"
        f" --master_port {free_port()} {tmp_path / 'train.py'}"
    )
    run = last_run()
    assert result.error_in_exec is None and run.outcome == "oom" and not run.raised, out
    assert run.ranks is None and run.plan is None
    assert run.headline().startswith(
        "rank 1 of the script (cuda:1) ran out of memory asking for 6.00 GiB, read from its output"
    ), run.headline()
    assert "oommagic.rank_recorder()" in run.headline()
    assert "[OUT OF MEMORY] rank 1 of the script" in out
    assert "OutOfMemoryError" in out, "the script's own output is shown as without the tool"
