"""A fix measured on every rank (issue #24, build 5): after a rank of a distributed cell runs out of
memory, the plan relaunches the ranks with each candidate for a bounded trial and reads every rank's
record; "fits" only where no rank ran out and every rank's peak keeps the margin against its own budget.

On CPU (gloo, ``--device cpu --limit``): two ranks forked from the cell, the way
``accelerate.notebook_launcher`` starts them, the training function defined in the cell. Rank 1 holds 4 MiB
more than rank 0 (a buffer only it keeps), so its batch of 512 does not fit under the 8 MiB limit while
rank 0's does. The batch fix is a smaller per-rank batch with accumulation: each optimizer step of each rank
still sees 512 samples, the global batch 1024.
"""

from __future__ import annotations

import json
import os
import socket

import pytest

import oommagic
from oommagic.diagnosis.plan import DOES_NOT_FIT, FITS, NOT_MEASURED
from oommagic.diagnosis.rank_trials import trial_of_ranks
from oommagic.diagnosis.ranks import RankResult, Ranks
from oommagic.diagnosis.write_back import cell_write
from oommagic.run.ranks import alive
from oommagic.run.session import session_for
from oommagic.view.widget import ReportWidget

MiB = 1024**2
STEPS, BATCH, WORLD = 3, 512, 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `seen[rank]`: the optimizer steps Adam itself counted and the samples the rank's loop took, in memory
# shared with the kernel (a forked rank's prints and files are not the test's to read).
CELL = """\
import torch, torch.distributed as dist, torch.multiprocessing as mp
batch_size = {batch}
def work(rank, port, batch_size, seen):
    torch.set_num_threads(1)  # a forked child hangs in libgomp's barrier if it reuses the kernel's pool
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    opt = torch.optim.Adam(model.parameters())
    cache = torch.zeros(4 * 1024 * 1024, dtype=torch.uint8) if rank == 1 else None
    for step in range({steps}):
        x = torch.randn(batch_size, 128)
        loss = model(x).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        opt.step()
        opt.zero_grad()
        seen[rank, 1] += x.shape[0]
    seen[rank, 0] = int(opt.state[model[0].weight]["step"])
    dist.destroy_process_group()
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
mp.start_processes(work, args=({port}, batch_size, seen), nprocs=2, start_method="fork")
"""


def children() -> set[int]:
    """Live child processes of this process: every rank of a run or a trial was one."""
    mine = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and fields[0] != "Z":
            mine.append(int(pid))
    return set(mine)


@pytest.fixture
def trained_before(shell, fresh_names):
    # A notebook that launches ranks has imported what an optimizer step imports (torch._dynamo's
    # pieces): forked ranks inherit it instead of importing it each (seconds on two busy cores).
    shell.run_cell(
        "_warm = torch.nn.Linear(2, 2); _warm_opt = torch.optim.Adam(_warm.parameters())\n"
        "_warm(torch.ones(1, 2)).sum().backward(); _warm_opt.step()\ndel _warm, _warm_opt"
    )


def test_the_first_fix_fits_on_every_rank_when_pressed(shell, run_cell, trained_before):
    started_with = children()
    run_cell(
        "%%gpumem --limit 8MiB --device cpu --quiet --no-raise --plan-budget 60\n"
        + CELL.format(batch=BATCH, steps=STEPS, port=free_port())
    )
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.ranks.out_of_memory.rank == 1
    assert [r.status for r in failed.ranks.results] == ["stopped", "oom"]

    first = failed.plan.entries[0]
    assert first.verdict == FITS, [e.line() for e in failed.plan.entries]
    (fix,) = first.fixes
    assert fix.kind == "batch" and fix.params["new"] * fix.params["accumulate"] == BATCH
    assert fix.params["new"] < BATCH
    # Measured on the ranks, rank 1 named: the tightest, within the margin of its own 8 MiB.
    assert "tightest of 2 ranks: rank 1 (cpu)" in first.line()
    assert first.budget == 8 * MiB and first.peak <= 0.95 * 8 * MiB

    widget = ReportWidget(failed, session_for(shell))
    assert widget.fixes[0].kind == "batch"
    fitted = widget.click("batch")

    assert fitted.outcome == "ok", fitted.headline()
    assert [r.status for r in fitted.ranks.results] == ["ok", "ok"]
    # Every rank kept the margin it was promised, against its own limit.
    assert all(r.peak_reserved <= 0.95 * r.limit for r in fitted.ranks.results)
    # The work is kept: every rank took the optimizer steps the cell as written takes, each step of each
    # rank on 512 samples, so the global batch is 1024 as written.
    seen = shell.user_ns["seen"].tolist()
    assert [steps for steps, _ in seen] == [STEPS, STEPS]
    assert [r.steps for r in fitted.ranks.results] == [STEPS, STEPS]
    assert sum(samples for _, samples in seen) // STEPS == WORLD * BATCH
    assert not any(alive(r.pid) for r in fitted.ranks.results)
    assert children() <= started_with, "a rank of a trial or of a run is left"
    # What "Apply to cell" and `%gpumem --fix 1` write is what was measured and pressed.
    assert fitted.source == fix.new_source
    assert cell_write(fitted.source, fitted.original, ()).body == fix.new_source


def test_ranks_started_one_by_one_are_read_and_fixed(shell, run_cell, trained_before):
    """The tutorials' way: ``mp.Process(target=work, args=(rank, ...)).start()`` for each rank, then
    ``join``. Before, the forked ranks ran under the cell's limit unrecorded and the cell read "[ok] peak 0
    bytes" while rank 1 ran out. Now each is recorded as the rank it was started as: the headline names it,
    the cell returns as without the tool (no launcher raises), and the plan's first fix fits on both ranks
    when pressed, the global batch kept."""
    one_by_one = CELL.replace(
        'mp.start_processes(work, args=({port}, batch_size, seen), nprocs=2, start_method="fork")',
        "ranks = [mp.Process(target=work, args=(rank, {port}, batch_size, seen)) for rank in range(2)]\n"
        "for p in ranks:\n    p.start()\nfor p in ranks:\n    p.join()\n"
        "exit_codes = [p.exitcode for p in ranks]",
    )
    assert "mp.Process(" in one_by_one and "start_processes" not in one_by_one
    started_with = children()
    run_cell(
        "%%gpumem --limit 8MiB --device cpu --quiet --no-raise --plan-budget 60\n"
        + one_by_one.format(batch=BATCH, steps=STEPS, port=free_port())
    )
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and not failed.raised
    assert failed.headline().startswith("rank 1 (cpu) ran out of memory asking for"), failed.headline()
    assert [(r.rank, r.status) for r in failed.ranks.results] == [(0, "stopped"), (1, "oom")]
    first = failed.plan.entries[0]
    assert first.verdict == FITS and first.fixes[0].kind == "batch", [e.line() for e in failed.plan.entries]

    fitted = ReportWidget(failed, session_for(shell)).click("batch")
    assert fitted.outcome == "ok", fitted.headline()
    assert [(r.status, r.steps) for r in fitted.ranks.results] == [("ok", STEPS), ("ok", STEPS)]
    assert shell.user_ns["exit_codes"] == [0, 0]
    seen = shell.user_ns["seen"].tolist()
    assert [steps for steps, _ in seen] == [STEPS, STEPS]
    assert sum(samples for _, samples in seen) // STEPS == WORLD * BATCH
    assert children() <= started_with, "a rank of a trial or of a run is left"
    assert fitted.source == first.fixes[0].new_source


def test_a_library_process_or_a_helper_of_the_cell_is_no_rank(run_cell, fresh_names):
    """A DataLoader's workers (processes the kernel starts for a library) are not ranks, nor is a process
    of the person's that never joins a process group: the cell's report stays the kernel's."""
    run_cell(
        "%%gpumem --device cpu --quiet\n"
        "loader = torch.utils.data.DataLoader(torch.arange(64.0), batch_size=16, num_workers=2)\n"
        "total = sum(float(b.sum()) for b in loader)"
    )
    run = oommagic.history()[-1]
    assert run.outcome == "ok" and run.ranks is None
    run_cell(
        "%%gpumem --device cpu --quiet\nimport torch.multiprocessing as mp\n"
        "def helper():\n    torch.ones(1024).sum()\n"
        "p = mp.Process(target=helper)\np.start()\np.join()\n"
        "kept = torch.zeros(256, 1024)"
    )
    run = oommagic.history()[-1]
    assert run.outcome == "ok" and run.ranks is None and run.peak_allocated >= 256 * 1024 * 4, run.headline()


LIGHTNING = """\
import torch, pytorch_lightning as pl
class Net(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 128))
    def training_step(self, batch, index):
        if self.global_rank == 1 and not hasattr(self, "cache"):
            self.cache = torch.zeros(4 * 1024 * 1024, dtype=torch.uint8)
        return self.body(batch).square().mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())
"""


def test_lightning_ddp_notebook_gets_its_accumulation(shell, run_cell, trained_before):
    """Lightning's ``ddp_notebook`` forks its ranks and hands their results back over a queue: a trial's
    rank ends once both reported. The fix writes ``accumulate_grad_batches`` beside the smaller batch."""
    pytest.importorskip("pytorch_lightning")
    started_with = children()
    shell.run_cell(LIGHTNING)
    run_cell(
        "%%gpumem --limit 8MiB --device cpu --quiet --no-raise --plan-budget 60\n"
        "torch.set_num_threads(1)\n"
        f"loader = torch.utils.data.DataLoader(torch.randn(4096, 128), batch_size={BATCH})\n"
        f"trainer = pl.Trainer(accelerator='cpu', devices=2, strategy='ddp_notebook', max_steps={STEPS},\n"
        "    logger=False, enable_checkpointing=False, enable_progress_bar=False,\n"
        "    enable_model_summary=False)\n"
        "trainer.fit(Net(), loader)"
    )
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.ranks.out_of_memory.rank == 1
    first = failed.plan.entries[0]
    assert first.verdict == FITS and "tightest of 2 ranks: rank 1 (cpu)" in first.line(), first.line()
    (fix,) = first.fixes
    assert fix.params["new"] * fix.params["accumulate"] == BATCH and fix.params["new"] < BATCH
    assert f"accumulate_grad_batches={fix.params['accumulate']}" in fix.new_source

    fitted = ReportWidget(failed, session_for(shell)).click("batch")
    assert fitted.outcome == "ok", fitted.headline()
    assert [(r.status, r.steps) for r in fitted.ranks.results] == [("ok", STEPS), ("ok", STEPS)]
    assert all(r.peak_reserved <= 0.95 * r.limit for r in fitted.ranks.results)
    assert not any(alive(r.pid) for r in fitted.ranks.results)
    assert children() <= started_with, "a rank of a trial or of a run is left"


# --- the verdict of a trial's ranks, with data ---------------------------------------------------------


def rank(i, status="ok", peak=4 * MiB, limit=8 * MiB, **kw):
    return RankResult(
        rank=i, pid=100 + i, status=status, peak_allocated=peak, peak_reserved=peak, limit=limit, **kw
    )


def test_a_rank_that_ran_out_decides_and_is_named():
    seen = trial_of_ranks(
        Ranks.of(
            [rank(0, "stopped", stopped_by=1), rank(1, "oom", 7 * MiB, requested=2 * MiB, failed_at=1.0)]
        )
    )
    assert seen.verdict == DOES_NOT_FIT and seen.rank.rank == 1
    assert seen.note == "rank 1 (cpu) ran out of memory asking for 2.00 MiB under its 8.00 MiB"


def test_the_tightest_rank_is_by_its_own_budget():
    # Rank 0 holds more bytes, but rank 1's smaller card is the fuller one.
    ranks = Ranks.of(
        [rank(0, peak=6 * MiB, limit=16 * MiB, steps=2), rank(1, peak=5 * MiB, limit=6 * MiB, steps=2)]
    )
    seen = trial_of_ranks(ranks)
    assert seen.verdict is None and seen.rank.rank == 1 and seen.steps == 2
    assert seen.note == "tightest of 2 ranks: rank 1 (cpu)"


def test_ranks_that_took_different_steps_or_ran_out_of_time_are_no_fit():
    uneven = trial_of_ranks(Ranks.of([rank(0, steps=2), rank(1, steps=3)]))
    assert uneven.verdict == DOES_NOT_FIT and "rank 0 2, rank 1 3" in uneven.note
    late = trial_of_ranks(Ranks.of([rank(0, steps=1), rank(1, "timed_out", steps=1)]))
    assert late.verdict == NOT_MEASURED and late.note == "rank 1 ran out of the time budget"


def test_a_limit_bounds_the_allocator_alone():
    # Under a per-process limit the memory outside PyTorch (CUDA context, NCCL) is not counted against it;
    # against the whole card it is.
    assert rank(0, outside=MiB).held == 4 * MiB
    assert rank(0, outside=MiB, limit=None, capacity=16 * MiB).held == 5 * MiB


def test_which_fixes_reach_the_ranks():
    from oommagic.diagnosis.findings import Remedy
    from oommagic.diagnosis.kinds import reaches_ranks

    assert reaches_ranks(Remedy("batch", "b", params={"where": "namespace"}))
    assert reaches_ranks(Remedy("checkpointing", "c", new_source="x = 1"))
    # Switched on for a model of the kernel's namespace, checkpointing stays in the kernel.
    assert not reaches_ranks(Remedy("checkpointing", "c", params={"models": ["model"]}))
    assert not reaches_ranks(Remedy("autocast", "a"))
    # quantize's rewrite needs autocast held in the kernel beside it.
    assert not reaches_ranks(Remedy("quantize", "q", new_source="x = 1"))


def test_a_plan_says_which_fixes_it_could_not_try_on_the_ranks():
    from oommagic.cellrun import CellRun
    from oommagic.diagnosis.findings import Finding, Remedy
    from oommagic.diagnosis.ranks import in_every_rank
    from oommagic.run.plan import _unreached
    from oommagic.timeline import Recording

    finding = Finding(
        "activations",
        "Activations",
        "e",
        remedies=(
            Remedy("batch", "Batch 512 → 128, accumulate 4 steps", automatic=True, new_source="b = 1"),
            Remedy("autocast", "bfloat16 autocast", automatic=True),
            Remedy("expandable_segments", "Expandable segments", automatic=True),
        ),
    )
    findings = in_every_rank((finding,))
    assert [r.automatic for r in findings[0].remedies] == [True, False, False]
    run = CellRun(source="", recording=Recording(device="cpu"), outcome="oom", findings=findings)
    assert _unreached(run) == (
        " Not tried: bfloat16 autocast, Expandable segments: a setting of this kernel's process, which does "
        "not reach the ranks (its snippet goes into the rank function)."
    )


def test_a_rank_in_a_trial_stops_at_the_steady_state(tmp_path):
    """A trial's bounds reach the rank: it stops at the first backward pass after its optimizer steps, as
    the trial in the kernel would, reports itself "ok" with where it stopped, and returns (the launcher sees
    no failure)."""
    import torch

    from oommagic.run.bounds import Bounds
    from oommagic.run.rank_process import RankRecorder

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = 0
    with RankRecorder(str(tmp_path), None, "cpu", 0, Bounds(steps=2, seconds=60).for_ranks()):
        for _ in range(10):
            model(torch.ones(4, 8)).sum().backward()
            opt.step()
            opt.zero_grad()
            taken += 1
    (name,) = [p.name for p in tmp_path.iterdir() if not p.name.startswith("pid-")]
    result = json.loads((tmp_path / name).read_text())
    assert name.startswith("ok-rank0-") and taken == 2
    assert result["steps"] == 2 and result["trial_stop"].startswith("steady state")


# Weights, gradients and optimizer state are the bulk of each rank (four 512 × 512 layers under Adam, a
# batch of 8): a smaller batch frees next to nothing, FSDP2 halves the state on each of the two ranks.
STATE_CELL = """\
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
batch_size = 8
def work(rank, port, batch_size, seen):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    torch.manual_seed(0)
    layers = [torch.nn.Linear(512, 512) for _ in range(4)]
    model = DistributedDataParallel(torch.nn.Sequential(*layers))
    opt = torch.optim.Adam(model.parameters())
    for step in range({steps}):
        x = torch.randn(batch_size, 512)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen[rank, 1] += x.shape[0]
    seen[rank, 0] = int(opt.state[model.module[0].weight]["step"])
    dist.destroy_process_group()
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
mp.start_processes(work, args=({port}, batch_size, seen), nprocs=2, start_method="fork")
"""


def test_a_run_whose_state_is_the_bulk_is_sharded_with_fsdp2_on_every_rank(shell, run_cell, trained_before):
    """Build 5's sharding: the plan relaunches the ranks with the cell's DDP wrap rewritten to FSDP2's
    ``fully_shard``; it fits where no smaller batch does, and pressed it fits on both ranks with the same
    optimizer steps and samples per step."""
    started_with = children()
    run_cell(
        "%%gpumem --limit 16MiB --device cpu --quiet --no-raise --plan-budget 90\n"
        + STATE_CELL.format(steps=STEPS, port=free_port())
    )
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.ranks.out_of_memory is not None
    shard = next(r for f in failed.findings for r in f.remedies if r.kind == "shard")
    assert "Weights, gradients and optimizer state are" in next(
        f.evidence for f in failed.findings if shard in f.remedies
    )
    first = failed.plan.entries[0]
    assert first.verdict == FITS, [e.line() for e in failed.plan.entries]
    assert "tightest of 2 ranks" in first.line() and first.peak <= 0.95 * 16 * MiB
    (fix,) = first.fixes
    assert fix.kind == "shard" and "model = fully_shard(model)" in fix.new_source
    # No smaller batch frees what the state holds: measured, not assumed.
    batch = next(e for e in failed.plan.entries if e.fixes[0].kind == "batch")
    assert batch.verdict == DOES_NOT_FIT

    widget = ReportWidget(failed, session_for(shell))
    assert widget.fixes[0].kind == "shard"
    fitted = widget.click("shard")
    assert fitted.outcome == "ok", fitted.headline()
    assert [(r.status, r.steps) for r in fitted.ranks.results] == [("ok", STEPS), ("ok", STEPS)]
    assert all(r.peak_reserved <= 0.95 * r.limit for r in fitted.ranks.results)
    # The same work: each rank took the cell's optimizer steps on batches of 8, as written.
    seen = shell.user_ns["seen"].tolist()
    assert seen == [[STEPS, 8 * STEPS], [STEPS, 8 * STEPS]]
    assert not any(alive(r.pid) for r in fitted.ranks.results)
    assert children() <= started_with, "a rank of a trial or of a run is left"
    assert fitted.source == fix.new_source


# Activations are the bulk: four residual blocks of two layers each (a transformer's MLP), DDP over gloo, on
# sequences of 32 tokens. Checkpointing each block keeps only its input for the backward pass.
BLOCKS_CELL = """\
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel as DDP
class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(128, 512), torch.nn.Linear(512, 128)
    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block() for _ in range(4))
    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
def work(rank, port, seen):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=rank, world_size=2)
    torch.manual_seed(0)
    net = DDP(Net())
    opt = torch.optim.Adam(net.parameters())
    for step in range({steps}):
        x = torch.randn(64, 32, 128)
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        seen[rank, 1] += x.shape[0]
    seen[rank, 0] = int(opt.state[net.module.blocks[0].up.weight]["step"])
    dist.destroy_process_group()
seen = torch.zeros(2, 2, dtype=torch.long).share_memory_()
mp.start_processes(work, args=({port}, seen), nprocs=2, start_method="fork")
"""


def test_activation_checkpointing_is_measured_on_every_rank(shell, run_cell, trained_before):
    """Build 5's activation checkpointing: the plan relaunches the ranks with the model the cell's DDP wrap
    takes handed through ``oommagic.checkpointed`` (each block recomputed in the backward pass); it fits
    where the run as written does not, and pressed it fits on both ranks with the same steps and samples."""
    started_with = children()
    run_cell(
        "%%gpumem --limit 36MiB --device cpu --quiet --no-raise --plan-budget 90\n"
        + BLOCKS_CELL.format(steps=STEPS, port=free_port())
    )
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.ranks.out_of_memory is not None
    entry = next(e for e in failed.plan.entries if e.fixes[0].kind == "checkpointing")
    assert entry.verdict == FITS, [e.line() for e in failed.plan.entries]
    (fix,) = entry.fixes
    assert "net = DDP(oommagic.checkpointed(Net()))" in fix.new_source
    # The run as written needed 49 MiB a rank; checkpointed, about half.
    assert "tightest of 2 ranks" in entry.line() and entry.peak <= 0.95 * 36 * MiB

    fitted = ReportWidget(failed, session_for(shell)).click("checkpointing")
    assert fitted.outcome == "ok", fitted.headline()
    assert [(r.status, r.steps) for r in fitted.ranks.results] == [("ok", STEPS), ("ok", STEPS)]
    assert all(r.peak_reserved <= 0.95 * r.limit for r in fitted.ranks.results)
    # The same work: each rank took the cell's optimizer steps on batches of 64, as written.
    assert shell.user_ns["seen"].tolist() == [[STEPS, 64 * STEPS], [STEPS, 64 * STEPS]]
    assert not any(alive(r.pid) for r in fitted.ranks.results)
    assert children() <= started_with, "a rank of a trial or of a run is left"
    assert fitted.source == fix.new_source


# A script run through `!torchrun`, as the README says: its batch and accumulation on its command line
# (argparse), the work recorded with `oommagic.rank_recorder()`. Each rank writes what it took to a file
# beside the script (the last run's figures are the pressed run's).
TORCHRUN_SCRIPT = """
import argparse, json, os, sys, torch, torch.distributed as dist, oommagic

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=3)
parser.add_argument("-b", "--batch-size", type=int, default=64)
parser.add_argument("--grad-accum", dest="gradient_accumulation_steps", type=int, default=1)
args = parser.parse_args()

def main():
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    opt = torch.optim.Adam(model.parameters())
    cache = torch.zeros(4 * 1024 * 1024, dtype=torch.uint8) if rank == 1 else None
    samples = 0
    for step in range(args.steps * args.gradient_accumulation_steps):
        x = torch.randn(args.batch_size, 128)
        (model(x).square().mean() / args.gradient_accumulation_steps).backward()
        samples += x.shape[0]
        if (step + 1) % args.gradient_accumulation_steps == 0:
            for p in model.parameters():
                dist.all_reduce(p.grad)
            opt.step()
            opt.zero_grad()
    seen = [int(opt.state[model[0].weight]["step"]), samples]
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), f"seen-{rank}.json"), "w") as f:
        json.dump(seen, f)
    dist.destroy_process_group()

with oommagic.rank_recorder():
    main()
"""


def test_a_torchrun_scripts_batch_is_fixed_on_its_command_line(shell, run_cell, trained_before, tmp_path):
    """``!torchrun train.py --batch-size 512``: the script reads its batch and accumulation through
    argparse, so the fix is the cell's command line (the script, the person's file, stays as it is): the
    plan relaunches torchrun with a smaller per-rank batch and the accumulation that keeps the global batch,
    and pressed, it fits on both ranks with the same optimizer steps and samples."""
    script = tmp_path / "train.py"
    script.write_text(TORCHRUN_SCRIPT)
    written = script.read_text()
    shell.user_ns["script"] = str(script)
    started_with = children()
    run_cell(
        "%%gpumem --limit 8MiB --device cpu --quiet --plan-budget 120\n"
        "import os, sys\npath = os.pathsep.join(sys.path)\n"
        f"!PYTHONPATH=$path {{sys.executable}} -m torch.distributed.run --nproc_per_node 2 --master_port"
        f" {free_port()} {{script}} --steps {STEPS} --batch-size {BATCH}"
    )
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.ranks.out_of_memory.rank == 1, failed.headline()
    assert not failed.raised, "torchrun returns: the cell does not fail, as without the tool"

    first = failed.plan.entries[0]
    assert first.verdict == FITS, [e.line() for e in failed.plan.entries]
    (fix,) = first.fixes
    assert fix.kind == "batch" and fix.params["where"] == "command"
    new, acc = fix.params["new"], fix.params["accumulate"]
    assert new < BATCH and new * acc == BATCH
    assert f"--batch-size {new} --grad-accum {acc}" in fix.new_source, fix.new_source
    assert "tightest of 2 ranks: rank 1 (cpu)" in first.line()

    fitted = ReportWidget(failed, session_for(shell)).click("batch")
    assert fitted.outcome == "ok", fitted.headline()
    assert [(r.status, r.steps) for r in fitted.ranks.results] == [("ok", STEPS), ("ok", STEPS)]
    assert all(r.peak_reserved <= 0.95 * r.limit for r in fitted.ranks.results)
    # The same work: each rank took the cell's optimizer steps on 512 samples each.
    seen = [json.loads((tmp_path / f"seen-{rank}.json").read_text()) for rank in range(WORLD)]
    assert seen == [[STEPS, BATCH * STEPS], [STEPS, BATCH * STEPS]]
    assert script.read_text() == written, "the script is the person's: not rewritten"
    assert not any(alive(r.pid) for r in fitted.ranks.results)
    assert children() <= started_with, "a rank of a trial or of a run is left"
    assert fitted.source == fix.new_source


# In a fresh process with two CPU threads (Lightning leaves a rank's thread count alone where
# OMP_NUM_THREADS is set): a dataset of an earlier cell that the trial's snapshot copies, then a Lightning
# cell whose forked ranks shuffle it (a parallel randperm in each rank).
FORKED_AFTER_SNAPSHOT = """
import sys
from IPython.core.interactiveshell import InteractiveShell
import torch, oommagic
from tests.run.test_rank_plan import LIGHTNING, BATCH, STEPS
ip = InteractiveShell.instance()
ip.run_line_magic("load_ext", "oommagic")
ip.run_cell("import torch")
ip.run_cell(LIGHTNING)
ip.run_cell("rows = torch.randn(1, 128).expand(400_000, 128)")  # 195 MiB as a snapshot copies it
ip.run_cell(
    "%%gpumem --limit 8MiB --device cpu --quiet --no-raise --plan-budget 60\\n"
    f"loader = torch.utils.data.DataLoader(rows, batch_size={BATCH}, shuffle=True)\\n"
    f"trainer = pl.Trainer(accelerator='cpu', devices=2, strategy='ddp_notebook', max_steps={STEPS},\\n"
    "    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\\n"
    "trainer.fit(Net(), loader)"
)
plan = oommagic.history()[-1].plan
print("FIRST", plan.entries[0].verdict)
print("SUMMARY", plan.summary)
"""


def test_lightning_ranks_forked_after_a_trials_snapshot_run(tmp_path):
    """Measured on two H100s: every trial's forked Lightning rank segfaulted at its first parallel CPU op,
    because the snapshot's parallel copy had started an OpenMP team in the kernel (it does not survive a
    fork). Here the same ranks hung until the plan's budget ran out ("not measured") before the snapshot
    copied on a thread of its own; now the first entry fits."""
    pytest.importorskip("pytorch_lightning")
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    script = tmp_path / "forked_after_snapshot.py"
    script.write_text(FORKED_AFTER_SNAPSHOT)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(root)}
    done = subprocess.run(
        [sys.executable, str(script)], env=env, cwd=root, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "FIRST fits" in done.stdout, done.stdout[-3000:]
    assert "195.8" in done.stdout, "the snapshot copied the earlier cell's dataset"


def test_checkpointed_recomputes_each_block_and_keeps_the_gradients():
    """``oommagic.checkpointed``: the blocks of a model's outermost list of multi-layer blocks run under
    checkpoint (fewer tensors kept for the backward pass), the gradients are the same; a model of single
    layers is left as it is; a second call changes nothing."""
    import torch

    torch.manual_seed(0)
    encoder = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), num_layers=3
    )
    plain = torch.nn.Sequential(torch.nn.Linear(16, 64), encoder, torch.nn.Linear(64, 1))
    twin = torch.nn.Sequential(
        torch.nn.Linear(16, 64),
        torch.nn.TransformerEncoder(
            torch.nn.TransformerEncoderLayer(64, 4, 128, dropout=0.0, batch_first=True), num_layers=3
        ),
        torch.nn.Linear(64, 1),
    )
    twin.load_state_dict(plain.state_dict())
    assert oommagic.checkpointed(twin) is twin
    assert all("forward" in vars(layer) for layer in twin[1].layers)
    assert "forward" not in vars(twin[0]) and "forward" not in vars(twin)
    x = torch.randn(4, 10, 16)

    def kept(model):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            loss = model(x).square().mean()
        loss.backward()
        return len(saved)

    assert kept(twin) < kept(plain)
    for a, b in zip(plain.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
    forwards = [vars(layer)["forward"] for layer in twin[1].layers]
    oommagic.checkpointed(twin)
    assert [vars(layer)["forward"] for layer in twin[1].layers] == forwards
    layers = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
    oommagic.checkpointed(layers)
    assert not any("forward" in vars(m) for m in layers.modules())
