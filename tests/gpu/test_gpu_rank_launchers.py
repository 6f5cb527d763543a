"""GPU: every way a notebook starts ranks on two GPUs, from a ``%%gpumem`` cell of a real kernel (nbclient).

The kernel has started no CUDA when the cell runs (as a notebook about to fork its ranks must not have):
``accelerate.notebook_launcher`` and Lightning's ``ddp_notebook`` fork, ``torch.multiprocessing.spawn``
spawns, ``!torchrun`` runs a script that records itself with ``oommagic.rank_recorder()``. One rank runs
out of memory (a 6 GiB request over a 4 GiB per-rank ``--limit``) in the forward pass, inside the backward
pass or in the optimizer step (no fix fits a 6 GiB request: the cells run no fix plan, whose trials on ranks
are ``test_gpu_rank_plan.py``'s). Each test: the cell ends within 30 s of the first failure, the headline and
the table name the rank and its own device, no stray context is reported that the code did not open, no
rank process is left, each GPU's memory is back to its level before the cell (NVML), and the kernel still
has not started CUDA. Skipped without two CUDA devices. Run with ``-s``: each test prints what it measured.
"""

from __future__ import annotations

import json
import socket

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GiB = 1024**3

SETUP = """%load_ext oommagic
import json, os, sys, time, torch, oommagic
from oommagic.devices import read_devices
from oommagic.run.ranks import alive
def gpu_used():
    return {d.cuda_index: d.used for d in read_devices().devices if d.cuda_index is not None}
def check(before):
    run = oommagic.history()[-1]
    ranks = run.ranks
    first = ranks.failed_first
    time.sleep(1)  # NVML's figures settle once the processes are reaped
    print("CHECK " + json.dumps({
        "outcome": run.outcome, "raised": run.raised, "headline": run.headline(),
        "ranks": [[r.rank, r.device, r.status, r.requested, r.limit] for r in ranks.results],
        "summary": ranks.summary(),
        "strays": [[s.rank, s.index, s.used] for s in ranks.strays],
        "after_failure_s": None if first is None else run.started + run.wall_s - first.failed_at,
        "alive": [r.pid for r in ranks.results if alive(r.pid)],
        "before": before, "after": gpu_used(), "kernel_cuda": torch.cuda.is_initialized(),
    }))
"""

# One training function for every launcher: DDP (or FSDP2) over NCCL; ``overrun`` asks for 6 GiB at step 3
# of ``phase`` on rank ``overrun_rank``. Each rank chooses its device first (``set_device``), or, with
# ``choose=False``, names it on every call and never sets it (the current device stays cuda:0 in every rank).
TRAIN = """
import datetime, os, torch, torch.distributed as dist

def train(rank, world, phase, overrun_rank, wrap="ddp", port=None, choose=True):
    device = torch.device("cuda", rank)
    if choose:
        torch.cuda.set_device(device)
    kwargs = {}
    if port is not None:
        kwargs = {"init_method": f"tcp://127.0.0.1:{port}", "rank": rank, "world_size": world}
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=device, **kwargs)
    layers = (torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
    model = torch.nn.Sequential(*layers).to(device)
    if wrap == "fsdp2":
        from torch.distributed.fsdp import fully_shard
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        inner = model
    else:
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, device_ids=[rank])
        inner = model.module
    optimizer = torch.optim.AdamW(model.parameters())
    state = {"step": 0}
    def overrun(*_):
        if rank == overrun_rank and state["step"] == 3:
            torch.empty(6 * 1024**3, dtype=torch.uint8, device=device)
    if phase == "forward":
        inner[0].register_forward_pre_hook(overrun)
    elif phase == "backward":
        inner[2].weight.register_hook(overrun)
    else:
        optimizer.register_step_pre_hook(overrun)
    for step in range(20):
        state["step"] = step
        model(torch.randn(64, 4096, device=device)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_notebook(tmp_path, *cells: str) -> list[dict]:
    """Run SETUP then ``cells`` in a fresh kernel; the CHECK records printed, in order."""
    pytest.importorskip("nbclient")
    from tests.test_kernel import execute, notebook, texts

    nb = notebook(f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + SETUP, *cells)
    execute(nb, allow_errors=True, timeout=300)
    for cell in nb.cells:
        print(texts(cell)[-3000:])
    return [
        json.loads(line[6:])
        for cell in nb.cells
        for line in texts(cell).splitlines()
        if line.startswith("CHECK ")
    ]


def assert_one_rank_ran_out(record: dict, rank: int, raised: bool = True, world: int = 2) -> None:
    print(json.dumps(record, indent=1))
    assert record["outcome"] == "oom" and record["raised"] is raised
    device = f"cuda:{rank}"
    assert record["headline"].startswith(f"rank {rank} ({device}) ran out of memory asking for 6.00 GiB")
    own = [[r, f"cuda:{r}"] for r in range(world)]
    assert [r[:2] for r in record["ranks"]] == own, "each rank on its own GPU"
    statuses = {r[0]: r[2] for r in record["ranks"]}
    assert statuses[rank] == "oom"
    assert all(statuses[r] in ("stopped", "lost") for r in range(world) if r != rank)
    assert all(r[4] == 4 * GiB for r in record["ranks"] if r[2] != "lost"), "the limit on each rank's own GPU"
    assert record["strays"] == [], "no context the code did not open"
    assert record["after_failure_s"] <= 30
    assert record["alive"] == []
    assert not record["kernel_cuda"], "the kernel still has not started CUDA"
    for index, used in record["before"].items():
        assert record["after"][index] <= used + 64 * 1024**2, f"GPU {index} holds memory after the cell"


def test_notebook_launcher(tmp_path):
    pytest.importorskip("accelerate")
    launch = (
        "%%gpumem --limit 4GiB --text --plan-budget 0\nfrom accelerate import notebook_launcher\n"
        "notebook_launcher(lambda *a: train(int(os.environ['LOCAL_RANK']), 2, *a), args=({args}),"
        " num_processes=2, use_port='{port}')\n"
    )
    records = run_notebook(
        tmp_path,
        TRAIN,
        "before = gpu_used()",
        launch.format(args="'forward', -1", port=free_port()),
        "check(before)",
        launch.format(args="'forward', 1", port=free_port()),
        "check(before)",
    )
    fitted, failed = records
    print(json.dumps(fitted, indent=1))
    assert fitted["outcome"] == "ok" and [r[2] for r in fitted["ranks"]] == ["ok", "ok"]
    assert [r[1] for r in fitted["ranks"]] == ["cuda:0", "cuda:1"] and not fitted["kernel_cuda"]
    assert_one_rank_ran_out(failed, 1)


@pytest.mark.parametrize(("wrap", "phase"), [("ddp", "backward"), ("fsdp2", "step"), ("fsdp2", "forward")])
def test_spawn(tmp_path, wrap, phase):
    (tmp_path / "gpu_train.py").write_text(TRAIN)
    records = run_notebook(
        tmp_path,
        "import gpu_train, torch.multiprocessing as mp\nbefore = gpu_used()",
        f"%%gpumem --limit 4GiB --text --plan-budget 0\n"
        f"mp.spawn(gpu_train.train, args=(2, {phase!r}, 0, {wrap!r}, {free_port()}), nprocs=2)",
        "check(before)",
    )
    assert_one_rank_ran_out(records[0], 0)


def test_processes_started_one_by_one(tmp_path):
    """The tutorials' way: a ``multiprocessing`` ``Process`` a rank (forked), then ``join``; no launcher
    raises, so the cell returns as without the tool, and its headline names the rank that ran out."""
    records = run_notebook(
        tmp_path,
        TRAIN + "before = gpu_used()",
        "%%gpumem --limit 4GiB --text --plan-budget 0\nimport torch.multiprocessing as mp\n"
        f"ranks = [mp.Process(target=train, args=(rank, 2, 'forward', 1, 'ddp', {free_port()})) for rank in"
        " range(2)]\nfor p in ranks:\n    p.start()\nfor p in ranks:\n    p.join()",
        "check(before)",
    )
    assert_one_rank_ran_out(records[0], 1, raised=False)


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")
def test_spawn_four_ranks(tmp_path):
    """One rank of four runs out in the backward pass (inside DDP's bucket all-reduce): the three others
    stop, every rank ends within 30 s of the failure, and all four GPUs are back to their level."""
    (tmp_path / "gpu_train.py").write_text(TRAIN)
    records = run_notebook(
        tmp_path,
        "import gpu_train, torch.multiprocessing as mp\nbefore = gpu_used()",
        f"%%gpumem --limit 4GiB --text --plan-budget 0\n"
        f"mp.spawn(gpu_train.train, args=(4, 'backward', 2, 'ddp', {free_port()}), nprocs=4)",
        "check(before)",
    )
    assert_one_rank_ran_out(records[0], 2, world=4)


SCRIPT = """
import os, oommagic
from gpu_train import train

with oommagic.rank_recorder():
    # As the issue's script: the device named on every call, never set (rank 1's current device is cuda:0).
    train(int(os.environ["LOCAL_RANK"]), 2, "step", 0, choose=False)
"""


def test_torchrun_script(tmp_path):
    (tmp_path / "gpu_train.py").write_text(TRAIN)
    (tmp_path / "script.py").write_text(SCRIPT)
    records = run_notebook(
        tmp_path,
        f"before = gpu_used()\nos.environ['PYTHONPATH'] += os.pathsep + {str(tmp_path)!r}",
        f"%%gpumem --limit 4GiB --text --plan-budget 0\n"
        f"!{{sys.executable}} -m torch.distributed.run --nproc_per_node 2"
        f" --master_port {free_port()} {tmp_path / 'script.py'}",
        "check(before)",
    )
    # torchrun returns: the cell does not fail, as without the tool; its headline says which rank ran out.
    assert_one_rank_ran_out(records[0], 0, raised=False)


LIGHTNING = """
import pytorch_lightning as pl

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4096, 4096)
    def training_step(self, batch, index):
        if self.global_rank == 1 and index == 3:
            torch.empty(6 * 1024**3, dtype=torch.uint8, device=self.device)
        return self.layer(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
    def train_dataloader(self):
        return torch.utils.data.DataLoader(torch.randn(640, 4096), batch_size=64)
"""


def test_lightning_ddp_notebook(tmp_path):
    pytest.importorskip("pytorch_lightning")
    records = run_notebook(
        tmp_path,
        LIGHTNING + "before = gpu_used()",
        "%%gpumem --limit 4GiB --text --plan-budget 0\n"
        "trainer = pl.Trainer(accelerator='gpu', devices=2, strategy='ddp_notebook', max_steps=10,"
        " logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
        "trainer.fit(Model())",
        "check(before)",
    )
    assert_one_rank_ran_out(records[0], 1)
