"""GPU: a fix measured on every rank (issue #24, build 5), on two GPUs from a ``%%gpumem`` cell of a real
kernel (nbclient). DDP over NCCL; rank 1 keeps a 1 GiB buffer rank 0 does not, so under the per-rank
``--limit 3GiB`` its batch of 16384 rows does not fit while rank 0's does. The plan relaunches the ranks for
each trial; its first entry must fit on every rank (within the margin of each rank's own limit), and
pressing it (the report's button, through ``ReportWidget.click``) must fit on both GPUs, with each rank
taking the cell's optimizer steps on as many samples each (the global batch kept), no rank process left,
and each GPU's memory back to its level before the cell (NVML).

``torch.multiprocessing.spawn`` imports its function from a module, so there the cell hands the batch and
the accumulation steps to it (a training script's usual arguments) and the fix rewrites those two numbers;
``accelerate.notebook_launcher`` forks a function the cell defines, and the fix rewrites its loop. Skipped
without two CUDA devices. Run with ``-s``: each test prints the plan and the per-rank figures.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.gpu.test_gpu_rank_launchers import SETUP, free_port

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

GiB = 1024**3
STEPS, BATCH, WORLD = 6, 16384, 2

# `seen[rank]`: the optimizer steps AdamW itself counted and the rows the rank's loop took, in CPU memory
# shared with the kernel. The kernel makes it before the ranks start: no CUDA in the kernel.
MODULE = """
import datetime, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

def train(rank, world, port, batch_size, grad_accum_steps, steps, seen):
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(minutes=10), device_id=device)
    layers = (torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    cache = torch.empty(1024**3, dtype=torch.uint8, device=device) if rank == 1 else None
    for step in range(steps * grad_accum_steps):
        x = torch.randn(batch_size, 4096, device=device)
        (model(x).square().mean() / grad_accum_steps).backward()
        seen[rank, 1] += x.shape[0]
        if (step + 1) % grad_accum_steps == 0:
            optimizer.step()
            optimizer.zero_grad()
    seen[rank, 0] = int(optimizer.state[model.module[0].weight]["step"])
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
"""

LAUNCHED = """
import datetime, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from accelerate import notebook_launcher
batch_size = {batch}
def work(batch_size, seen):
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=device)
    layers = (torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    cache = torch.empty(1024**3, dtype=torch.uint8, device=device) if rank == 1 else None
    for step in range({steps}):
        x = torch.randn(batch_size, 4096, device=device)
        loss = model(x).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seen[rank, 1] += x.shape[0]
    seen[rank, 0] = int(optimizer.state[model.module[0].weight]["step"])
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
notebook_launcher(work, args=(batch_size, seen), num_processes=2, use_port="{port}")
"""

# The kernel's child processes, as [PID, command]; `known`: those it had before the `%%gpumem` cell (a library
# can start its own: Lightning's MPI check starts Open MPI's daemon where mpi4py is installed, with the tool
# or without it).
CHILDREN = """
import os
def children():
    # Every rank of the failed run, of each trial and of the pressed run was a child of this kernel.
    mine = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) != os.getpid() or fields[0] == "Z":
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                command = fh.read().replace(b"\\0", b" ").decode(errors="replace")
        except OSError:
            command = ""
        # multiprocessing's resource tracker: started by the first spawn, it lives as long as the kernel,
        # with the tool or without it; no rank.
        if "multiprocessing.resource_tracker" not in command:
            mine.append([int(pid), command[:120]])
    return mine
"""

# The failed cell's plan, then its first offered fix pressed as the button does, both read back.
PRESS = """
from oommagic.run.session import session_for
from oommagic.view.widget import ReportWidget
failed = oommagic.history()[-1]
first = failed.plan.entries[0]
widget = ReportWidget(failed, session_for(get_ipython()))
offered = globals().get("PRESSING") or widget.fixes[0].kind
fitted = widget.click(offered)
time.sleep(1)  # NVML's figures settle once the processes are reaped
def ranks_of(run):
    return [[r.rank, r.device, r.status, r.steps, r.peak_reserved, r.limit] for r in run.ranks.results]
print("PLAN " + json.dumps({
    "failed": failed.outcome, "failed_ranks": ranks_of(failed), "summary": failed.plan.summary,
    "lines": [e.title + ": " + e.line() for e in failed.plan.entries],
    "verdict": first.verdict, "kind": first.kind, "params": first.fixes[0].params,
    "entries": [[e.kind, e.verdict, e.peak, e.fixes[0].new_source] for e in failed.plan.entries],
    "budget": first.budget, "peak": first.peak, "new_source": first.fixes[0].new_source,
    "offered": offered, "fitted": fitted.outcome, "fitted_ranks": ranks_of(fitted),
    "fitted_source": fitted.source, "seen": seen.tolist(),
    "alive": [r.pid for run in oommagic.history() if run.ranks for r in run.ranks.results if alive(r.pid)],
    "children": [c for c in children() if c[0] not in known],
    "before": before, "after": gpu_used(), "kernel_cuda": torch.cuda.is_initialized(),
}))
"""


def plan_record(tmp_path, *cells: str) -> dict:
    pytest.importorskip("nbclient")
    from tests.test_kernel import execute, notebook, texts

    *before, gpumem = cells
    known = "known = {pid for pid, _ in children()}"
    nb = notebook(
        f"import sys\nsys.path.insert(0, {str(tmp_path)!r})\n" + SETUP,
        CHILDREN,
        *before,
        known,
        gpumem,
        PRESS,
    )
    # Each trial starts two NCCL ranks (seconds each): the cell's plan has minutes, not the default budget.
    execute(nb, allow_errors=True, timeout=900)
    for cell in nb.cells:
        print(texts(cell)[-6000:])
    (record,) = [
        json.loads(line[5:])
        for cell in nb.cells
        for line in texts(cell).splitlines()
        if line.startswith("PLAN ")
    ]
    print(json.dumps({k: v for k, v in record.items() if "source" not in k}, indent=1))
    return record


def assert_fits_on_every_rank(record: dict) -> None:
    assert record["failed"] == "oom"
    assert "oom" in [r[2] for r in record["failed_ranks"]], "a rank ran out of memory"
    # The first entry fits on every rank: rank 1 is the tightest, within the margin of its own 3 GiB.
    assert record["verdict"] == "fits", record["lines"]
    assert "tightest of 2 ranks: rank 1 (cuda:1)" in record["lines"][0]
    assert record["budget"] == 3 * GiB and record["peak"] <= 0.95 * 3 * GiB
    # A smaller per-rank batch with accumulation: the global batch kept.
    params = record["params"]
    assert (
        record["kind"] == "batch" and params["new"] < BATCH and params["new"] * params["accumulate"] == BATCH
    )
    # Pressed, it fits on both GPUs, each rank on its own, within the margin of its own limit.
    assert record["offered"] == "batch" and record["fitted"] == "ok"
    fitted = record["fitted_ranks"]
    assert [r[:4] for r in fitted] == [[0, "cuda:0", "ok", STEPS], [1, "cuda:1", "ok", STEPS]]
    assert all(r[5] == 3 * GiB and r[4] <= 0.95 * r[5] for r in fitted)
    # Every rank took the cell's optimizer steps, on as many samples each: the global batch kept.
    assert [steps for steps, _ in record["seen"]] == [STEPS, STEPS]
    assert sum(rows for _, rows in record["seen"]) // STEPS == WORLD * BATCH
    # What "Apply to cell" and `%gpumem --fix 1` write is what was measured and pressed.
    assert record["fitted_source"] == record["new_source"]
    assert record["alive"] == [] and record["children"] == [], "a rank process is left"
    assert not record["kernel_cuda"], "the kernel started CUDA"
    for index, used in record["before"].items():
        assert record["after"][index] <= used + 64 * 1024**2, f"GPU {index} holds memory after the plan"


def test_spawn_plan_fits_on_every_rank(tmp_path):
    (tmp_path / "gpu_plan_train.py").write_text(MODULE)
    record = plan_record(
        tmp_path,
        "import gpu_plan_train, torch.multiprocessing as mp\nbefore = gpu_used()",
        "%%gpumem --limit 3GiB --text --no-raise --plan-budget 300\n"
        f"batch_size = {BATCH}\ngrad_accum_steps = 1\n"
        "seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()\n"
        f"mp.spawn(gpu_plan_train.train, args=(2, {free_port()}, batch_size, grad_accum_steps, {STEPS},"
        " seen), nprocs=2)",
    )
    assert_fits_on_every_rank(record)
    assert f"grad_accum_steps = {record['params']['accumulate']}" in record["fitted_source"]


# The same work on a model the ranks shard with FSDP2 themselves (no DDP): rank 1 keeps 1.5 GiB more, as
# the sharded state is smaller than DDP's copies and buckets.
SHARDED_RUN = (
    LAUNCHED.replace(
        "    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), device_ids=[rank])\n",
        "    from torch.distributed.fsdp import fully_shard\n"
        "    model = torch.nn.Sequential(*layers).to(device)\n"
        "    for layer in (model[0], model[2]):\n        fully_shard(layer)\n    fully_shard(model)\n",
    )
    .replace("model.module[0].weight", "model[0].weight")
    .replace("torch.empty(1024**3,", "torch.empty(3 * 1024**3 // 2,")
)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_notebook_launcher_plan_fits_on_every_rank(tmp_path, wrap):
    """The ranks wrap the model in DDP, or shard it with FSDP2 themselves: the same batch fix either way."""
    pytest.importorskip("accelerate")
    cell = {"ddp": LAUNCHED, "fsdp2": SHARDED_RUN}[wrap]
    assert wrap == "ddp" or ("fully_shard(model)" in cell and "DistributedDataParallel(" not in cell)
    record = plan_record(
        tmp_path,
        "before = gpu_used()",
        "%%gpumem --limit 3GiB --text --no-raise --plan-budget 300\n"
        + cell.format(batch=BATCH, steps=STEPS, port=free_port()),
    )
    assert_fits_on_every_rank(record)
    assert f"range({STEPS} * {record['params']['accumulate']})" in record["fitted_source"]


# Activations are the bulk: eight residual blocks of two layers (a transformer's MLP, 2048 → 8192 → 2048)
# on 16 sequences of 1024 tokens: about 9 GiB of activations beside 5 GiB of weights, gradients, DDP's
# buckets and AdamW's state a rank, over a 10 GiB limit. Checkpointing each block keeps only its input.
BLOCKS = """
import datetime, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from accelerate import notebook_launcher
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(2048, 8192), torch.nn.Linear(8192, 2048)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(8))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
def work(seen):
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=device)
    model = DistributedDataParallel(Net().to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range({steps}):
        x = torch.randn(16, 1024, 2048, device=device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen[rank, 1] += x.shape[0]
    seen[rank, 0] = int(optimizer.state[model.module.blocks[0].up.weight]["step"])
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
notebook_launcher(work, args=(seen,), num_processes=2, use_port="{port}")
"""


def test_notebook_launcher_checkpointing_fits_on_every_rank(tmp_path):
    pytest.importorskip("accelerate")
    record = plan_record(
        tmp_path,
        "PRESSING = 'checkpointing'\nbefore = gpu_used()",
        "%%gpumem --limit 10GiB --text --no-raise --plan-budget 300\n"
        + BLOCKS.format(steps=STEPS, port=free_port()),
    )
    assert record["failed"] == "oom"
    (_, verdict, peak, source), *_ = [e for e in record["entries"] if e[0] == "checkpointing"]
    assert verdict == "fits" and peak <= 0.95 * 10 * GiB, record["lines"]
    assert "DistributedDataParallel(oommagic.checkpointed(Net().to(device)), device_ids=[rank])" in source
    assert record["offered"] == "checkpointing" and record["fitted"] == "ok"
    fitted = record["fitted_ranks"]
    assert [r[:4] for r in fitted] == [[0, "cuda:0", "ok", STEPS], [1, "cuda:1", "ok", STEPS]]
    assert all(r[5] == 10 * GiB and r[4] <= 0.95 * r[5] for r in fitted)
    # The same work: each rank took the cell's optimizer steps on batches of 16 sequences.
    assert record["seen"] == [[STEPS, 16 * STEPS], [STEPS, 16 * STEPS]]
    assert record["fitted_source"] == source
    assert record["alive"] == [] and record["children"] == [], "a rank process is left"
    assert not record["kernel_cuda"], "the kernel started CUDA"
    for index, used in record["before"].items():
        assert record["after"][index] <= used + 64 * 1024**2, f"GPU {index} holds memory after the plan"


# A script run through `!torchrun` (as the README says: `with oommagic.rank_recorder(): main()`), its batch
# and accumulation argparse options. Each rank writes [optimizer steps, rows] beside the script; `seen` reads
# them back (the last run's: the pressed one's).
SCRIPT = """
import argparse, datetime, json, os, torch, torch.distributed as dist, oommagic
from torch.nn.parallel import DistributedDataParallel

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=1)
parser.add_argument("--batch-size", type=int, default=64)
parser.add_argument("--grad-accum", type=int, default=1)
args = parser.parse_args()

def main():
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=device)
    layers = (torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    cache = torch.empty(1024**3, dtype=torch.uint8, device=device) if rank == 1 else None
    rows = 0
    for step in range(args.steps * args.grad_accum):
        x = torch.randn(args.batch_size, 4096, device=device)
        (model(x).square().mean() / args.grad_accum).backward()
        rows += x.shape[0]
        if (step + 1) % args.grad_accum == 0:
            optimizer.step()
            optimizer.zero_grad()
    steps = int(optimizer.state[model.module[0].weight]["step"])
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"seen-{rank}.json"), "w") as f:
        json.dump([steps, rows], f)
    torch.cuda.synchronize(device)
    dist.destroy_process_group()

with oommagic.rank_recorder():
    main()
"""

SEEN_FROM_FILES = """
class FromFiles:
    def tolist(self):
        return [json.load(open(os.path.join({where!r}, f"seen-{{rank}}.json"))) for rank in range(2)]
seen = FromFiles()
before = gpu_used()
"""


def test_torchrun_script_plan_fits_on_every_rank(tmp_path):
    (tmp_path / "plan_script.py").write_text(SCRIPT)
    written = (tmp_path / "plan_script.py").read_text()
    record = plan_record(
        tmp_path,
        SEEN_FROM_FILES.format(where=str(tmp_path)),
        "%%gpumem --limit 3GiB --text --no-raise --plan-budget 300\n"
        f"!{{sys.executable}} -m torch.distributed.run --nproc_per_node 2 --master_port {free_port()}"
        f" {tmp_path / 'plan_script.py'} --steps {STEPS} --batch-size {BATCH}",
    )
    assert_fits_on_every_rank(record)
    # The fix is the cell's command line; the script, the person's file, is as it was.
    accumulate = record["params"]["accumulate"]
    assert f"--batch-size {BATCH // accumulate} --grad-accum {accumulate}" in record["fitted_source"]
    assert (tmp_path / "plan_script.py").read_text() == written


# Lightning's `ddp_notebook` forks the ranks from the kernel. `seen[rank]`: the optimizer steps Lightning took
# (`global_step`) and the rows its training steps saw. The loader is the cell's, one row repeated (no data
# to hold): the batch is its `batch_size`, the fix's accumulation Lightning's `accumulate_grad_batches`.
LIGHTNING_PLAN = """
import torch, pytorch_lightning as pl
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
class Wide(pl.LightningModule):
    def __init__(self):
        super().__init__()
        layers = (torch.nn.Linear(4096, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 4096))
        self.body = torch.nn.Sequential(*layers)
    def training_step(self, batch, index):
        if self.global_rank == 1 and not hasattr(self, "cache"):
            self.cache = torch.empty(1024**3, dtype=torch.uint8, device=self.device)
        seen[self.global_rank, 1] += batch.shape[0]
        return self.body(batch).square().mean()
    def on_train_end(self):
        seen[self.global_rank, 0] = self.trainer.global_step
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
rows = torch.randn(1, 4096).expand({rows}, 4096)
loader = torch.utils.data.DataLoader(rows, batch_size={batch})
trainer = pl.Trainer(accelerator="gpu", devices=2, strategy="ddp_notebook", max_steps={steps},
    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Wide(), loader)
"""


def test_lightning_ddp_notebook_plan_fits_on_every_rank(tmp_path):
    pytest.importorskip("pytorch_lightning")
    record = plan_record(
        tmp_path,
        # Lightning's start in the kernel, as a notebook's earlier cell would (its MPI check starts Open
        # MPI's daemon where mpi4py is installed): known before the `%%gpumem` cell.
        "import pytorch_lightning as pl\npl.Trainer(accelerator='cpu', devices=1, logger=False)\n"
        "before = gpu_used()",
        "%%gpumem --limit 3GiB --text --no-raise --plan-budget 300\n"
        + LIGHTNING_PLAN.format(rows=WORLD * BATCH * STEPS, batch=BATCH, steps=STEPS),
    )
    assert_fits_on_every_rank(record)
    assert f"accumulate_grad_batches={record['params']['accumulate']}" in record["fitted_source"]


# Weights, gradients and optimizer state are the bulk: six 8192 × 8192 layers under AdamW (1.5 GiB of
# weights, as much of gradients and of DDP's buckets, 3 GiB of state) on a batch of 64, under 6 GiB a rank.
SHARDED = """
import datetime, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from accelerate import notebook_launcher
batch_size = 64
def work(batch_size, seen):
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=10), device_id=device)
    layers = [torch.nn.Linear(8192, 8192) for _ in range(6)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers).to(device), device_ids=[rank])
    optimizer = torch.optim.AdamW(model.parameters())
    for step in range({steps}):
        x = torch.randn(batch_size, 8192, device=device)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        seen[rank, 1] += x.shape[0]
    seen[rank, 0] = int(optimizer.state[model.module[0].weight]["step"])
    torch.cuda.synchronize(device)
    dist.destroy_process_group()
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
notebook_launcher(work, args=(batch_size, seen), num_processes=2, use_port="{port}")
"""


def test_notebook_launcher_state_bulk_plan_shards_with_fsdp2(tmp_path):
    """Written 2026-11-28 with the CPU version (tests/run/test_rank_plan.py), not yet run on two GPUs."""
    pytest.importorskip("accelerate")
    record = plan_record(
        tmp_path,
        "before = gpu_used()",
        "%%gpumem --limit 6GiB --text --no-raise --plan-budget 300\n"
        + SHARDED.format(steps=STEPS, port=free_port()),
    )
    assert record["failed"] == "oom"
    assert record["verdict"] == "fits" and record["kind"] == "shard", record["lines"]
    assert record["budget"] == 6 * GiB and record["peak"] <= 0.95 * 6 * GiB
    assert record["offered"] == "shard" and record["fitted"] == "ok"
    fitted = record["fitted_ranks"]
    assert [r[:4] for r in fitted] == [[0, "cuda:0", "ok", STEPS], [1, "cuda:1", "ok", STEPS]]
    assert all(r[5] == 6 * GiB and r[4] <= 0.95 * r[5] for r in fitted)
    # The same work: each rank took the cell's optimizer steps on batches of 64.
    assert record["seen"] == [[STEPS, 64 * STEPS], [STEPS, 64 * STEPS]]
    assert "model = fully_shard(model)" in record["fitted_source"]
    assert record["fitted_source"] == record["new_source"]
    assert record["alive"] == [] and record["children"] == [], "a rank process is left"
    assert not record["kernel_cuda"], "the kernel started CUDA"
    for index, used in record["before"].items():
        assert record["after"][index] <= used + 64 * 1024**2, f"GPU {index} holds memory after the plan"
