"""Distributed cells on CPU: ranks started from a ``%%gpumem`` cell (torch.distributed, gloo) each record
themselves under the per-rank ``--limit``; when one runs out, the others are stopped at once and the cell
ends with the per-rank table, the failing rank named, and no rank left running.

The rank functions live in a module the test writes to a temporary directory on ``sys.path``: with the
spawn start method (``torch.multiprocessing.spawn``'s, the one CUDA needs) each child imports the function
by name, as it would import a user's ``train.py``. The fork test defines its function in the cell itself,
as ``accelerate.notebook_launcher`` users do (fork needs no import).
"""

from __future__ import annotations

import socket
import time

import pytest

from oommagic.diagnosis.ranks import RankResult, Ranks, batch_across_ranks, rank_findings
from oommagic.diagnosis.rewrite_shard import shard_source
from oommagic.diagnosis.source import BatchGuess
from oommagic.run.ranks import alive

MiB = 1024**2

RANK_MODULE = '''
import datetime
import os
import time

import torch
import torch.distributed as dist


def train(rank, world, port, overrun_rank, steps):
    """Each rank trains a small layer and all-reduces its gradients; ``overrun_rank`` allocates 96 MiB at
    step 2 (over a 64 MiB limit) while the others wait for it in the next collective."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
        timeout=datetime.timedelta(seconds=300),
    )
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    for step in range(steps):
        loss = model(torch.randn(16, 256)).square().mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        optimizer.zero_grad()
        if rank == overrun_rank and step == 2:
            torch.empty(96 * 1024 * 1024, dtype=torch.uint8)
    dist.destroy_process_group()
'''


@pytest.fixture
def rank_module(tmp_path, shell):
    (tmp_path / "ranks_train.py").write_text(RANK_MODULE)
    shell.run_cell(f"import sys; sys.path.insert(0, {str(tmp_path)!r})")
    yield "ranks_train"
    shell.run_cell(f"sys.path.remove({str(tmp_path)!r})")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_run():
    import oommagic

    return oommagic.history()[-1]


@pytest.mark.parametrize("world", [2, 4])
def test_one_rank_out_of_memory_stops_the_others(run_cell, rank_module, world):
    overrun = world - 1
    t0 = time.perf_counter()
    result, out = run_cell(
        f"%%gpumem --limit 64MiB --device cpu --text\n"
        f"import torch.multiprocessing as mp\nimport {rank_module}\n"
        f"mp.spawn({rank_module}.train, args=({world}, {free_port()}, {overrun}, 50), nprocs={world})"
    )
    took = time.perf_counter() - t0
    run = last_run()
    assert run.outcome == "oom"
    assert type(result.error_in_exec).__name__ == "OutOfMemoryError"
    ranks = run.ranks
    assert ranks is not None and [r.rank for r in ranks.results] == list(range(world))
    assert ranks.failed_first.rank == overrun and ranks.failed_first.status == "oom"
    assert ranks.failed_first.requested == 96 * MiB
    assert ranks.bottleneck.rank == overrun
    # Each other rank reports itself stopped, unless torch's spawn killed it (SIGTERM) before it could write
    # its report: "lost". Either way none is left running (checked below).
    assert {r.status for r in ranks.results if r.rank != overrun} <= {"stopped", "lost"}
    assert all(r.stopped_by == overrun for r in ranks.results if r.status == "stopped")
    # A lost rank wrote no report, so it has no figures to hold to.
    assert all(r.limit == 64 * MiB and r.peak_allocated > 0 for r in ranks.results if r.status != "lost")
    assert not any(alive(r.pid) for r in ranks.results), "a rank is still running"
    assert not ranks.left_running
    # The gloo timeout is 300 s: the cell ended long before any collective could time out.
    assert took < 120
    assert f"rank {overrun} (cpu) ran out of memory first" in out
    assert run.headline().startswith(f"rank {overrun} (cpu) ran out of memory asking for 96.00 MiB")
    assert "OUT OF MEMORY (asked 96.00 MiB)" in out and f"stopped (rank {overrun} failed)" in out
    assert run.report is not None and run.report.requested == 96 * MiB and run.report.emulated
    # The training code is in a module the cell imports: no fix of the cell reaches it, and no trial ran.
    assert run.plan.summary.startswith("Not measured: no fix a relaunch of the ranks can apply")
    assert run.plan.trials == 0
    data = run.to_json()["ranks"]
    assert data["failed_first"] == overrun and len(data["ranks"]) == world


FORKED = """
import os, torch, torch.distributed as dist, torch.multiprocessing as mp
def work(rank, port, overrun_rank):
    torch.set_num_threads(1)  # a forked child hangs in libgomp's barrier if it reuses the kernel's pool
    if port is None:  # started by a launcher that set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT
        dist.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = torch.nn.Linear(256, 256)
    optimizer = torch.optim.Adam(model.parameters())
    for step in range(3):
        model(torch.randn(16, 256)).sum().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optimizer.step()
        if rank == overrun_rank:
            torch.empty(80 * 1024 * 1024, dtype=torch.uint8)
    dist.destroy_process_group()
"""


def test_ranks_that_fit_are_recorded(run_cell):
    _, out = run_cell(
        "%%gpumem --limit 64MiB --device cpu --text\n"
        + FORKED
        + f"mp.start_processes(work, args=({free_port()}, -1), nprocs=2, start_method='fork')"
    )
    run = last_run()
    assert run.outcome == "ok", out
    assert [r.status for r in run.ranks.results] == ["ok", "ok"]
    # Weights, gradients and Adam's two moments of a 256x256 layer, on each rank.
    assert all(r.peak_allocated >= 4 * 256 * 257 * 4 for r in run.ranks.results)
    assert run.ranks.failed_first is None and "rank  device  PID" in out


def test_forked_ranks_defined_in_the_cell(run_cell):
    # fork, as accelerate.notebook_launcher starts ranks: the function is defined in the cell (fork needs
    # no import), and each rank drops the tracker it inherited from the kernel. (The plan's trials on
    # ranks are tests/run/test_rank_plan.py's: none here.)
    _, out = run_cell(
        "%%gpumem --limit 64MiB --device cpu --text --plan-budget 0\n"
        "kernel_tensor = torch.empty(8 * 1024 * 1024, dtype=torch.uint8)\n"
        + FORKED
        + f"mp.start_processes(work, args=({free_port()}, 0), nprocs=2, start_method='fork')"
    )
    run = last_run()
    assert run.outcome == "oom", out
    first = run.ranks.failed_first
    assert first.rank == 0 and first.requested == 80 * MiB
    assert run.ranks.results[1].status == "stopped"
    # The 8 MiB the kernel held before the fork is not counted in the ranks.
    assert all(r.peak_allocated < 8 * MiB for r in run.ranks.results)
    assert not any(alive(r.pid) for r in run.ranks.results)


def test_notebook_launcher(run_cell):
    pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState

    # A Trainer in an earlier test of this process made accelerate's state, which the launcher refuses
    # ("no cell may initialise an Accelerator"): a notebook that launches starts without one.
    AcceleratorState._reset_state(reset_partial_state=True)
    _, out = run_cell(
        "%%gpumem --limit 64MiB --device cpu --text --plan-budget 0\n"
        "from accelerate import notebook_launcher\n"
        + FORKED
        + "def launched(overrun_rank):\n    work(int(os.environ['RANK']), None, overrun_rank)\n"
        + f"notebook_launcher(launched, args=(1,), num_processes=2, use_port='{free_port()}')"
    )
    run = last_run()
    assert run.outcome == "oom", out
    assert run.ranks.failed_first.rank == 1 and run.ranks.failed_first.requested == 80 * MiB
    assert [r.status for r in run.ranks.results] == ["stopped", "oom"]
    assert not any(alive(r.pid) for r in run.ranks.results)


def test_cell_without_ranks_has_none(run_cell):
    run_cell("%%gpumem --device cpu --quiet\nx = torch.ones(10)")
    run = last_run()
    assert run.ranks is None and run.to_json()["ranks"] is None


def test_distributed_oom_in_a_kernel(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    from tests.test_kernel import execute, notebook, texts

    (tmp_path / "ranks_train.py").write_text(RANK_MODULE)
    nb = notebook(
        f"%load_ext oommagic\nimport sys\nsys.path.insert(0, {str(tmp_path)!r})\nimport ranks_train",
        f"%%gpumem --limit 64MiB --device cpu --text\nimport torch.multiprocessing as mp\n"
        f"mp.spawn(ranks_train.train, args=(2, {free_port()}, 1, 50), nprocs=2)",
        "import oommagic\nfrom oommagic.run.ranks import alive\nrun = oommagic.history()[-1]\n"
        "print(run.outcome, run.ranks.failed_first.rank, [r.status for r in run.ranks.results],"
        " any(alive(r.pid) for r in run.ranks.results))",
    )
    assert nbformat
    execute(nb, allow_errors=True, timeout=120)
    assert "rank 1 (cpu) ran out of memory first" in texts(nb.cells[1])
    assert texts(nb.cells[2]).strip() == "oom 1 ['stopped', 'oom'] False"


# --- the decisions, with data --------------------------------------------------------------------------


def rank(i, status="ok", peak=100 * MiB, **kw):
    return RankResult(
        rank=i,
        pid=1000 + i,
        device=kw.pop("device", "cpu"),
        status=status,
        peak_allocated=peak,
        peak_reserved=peak,
        limit=kw.pop("limit", 256 * MiB),
        **kw,
    )


def test_first_failure_is_by_time_and_bottleneck_by_share():
    ranks = Ranks.of(
        [
            rank(0, "stopped", stopped_by=2),
            rank(1, "oom", 200 * MiB, requested=80 * MiB, failed_at=12.5),
            rank(2, "oom", 150 * MiB, requested=20 * MiB, failed_at=12.0),
            rank(3, peak=250 * MiB, limit=512 * MiB),
        ]
    )
    assert ranks.failed_first.rank == 2
    assert ranks.out_of_memory.rank == 2
    assert ranks.bottleneck.rank == 1  # 280 MiB needed of 256 MiB
    assert ranks.summary()[0].startswith("rank 2 (cpu) ran out of memory first asking for 20.00 MiB")


def test_stray_contexts_from_nvml_process_data():
    gib = 1024**3
    ranks = Ranks.of(
        [
            rank(0, device="cuda:0", contexts=((0, 3 * gib),)),
            rank(1, device="cuda:1", contexts=((0, gib // 2), (1, 3 * gib))),
            rank(2, device="cuda:2", contexts=((2, 3 * gib), (0, 2 * MiB))),  # a few MiB: not a context
        ]
    )
    assert [(s.rank, s.index, s.used) for s in ranks.strays] == [(1, 0, gib // 2)]
    findings = rank_findings(ranks, "")
    assert findings[0].key == "stray_context" and "set_device" in findings[0].remedies[0].code


def test_batch_takes_the_minimum_across_ranks():
    ranks = Ranks.of([rank(0, peak=200 * MiB), rank(1, "oom", 300 * MiB, requested=100 * MiB, failed_at=1.0)])
    assert batch_across_ranks(ranks, 32) == 20  # 256 / 400 of 32 on the tightest rank
    finding = rank_findings(ranks, "", BatchGuess("batch_size", 32))[0]
    assert finding.remedies[0].kind == "batch" and finding.remedies[0].params["new"] == 20


def test_state_bulk_offers_sharding_as_a_diff():
    source = "import torch\nddp = DistributedDataParallel(model, device_ids=[rank])\ntrain(ddp)\n"
    ranks = Ranks.of(
        [
            rank(
                0,
                "oom",
                200 * MiB,
                requested=64 * MiB,
                failed_at=1.0,
                params=40 * MiB,
                grads=40 * MiB,
                optimizer_state=80 * MiB,
            ),
            rank(1, "stopped", 190 * MiB, stopped_by=0),
        ]
    )
    finding = rank_findings(ranks, source)[0]
    kinds = [r.kind for r in finding.remedies]
    assert kinds == ["shard", "multi_gpu", "checkpointing"]
    fsdp = finding.remedies[0]
    # A rewrite of the cell's own wrap: measured by a relaunch of the ranks, a button where it fits.
    assert fsdp.automatic and fsdp.new_source == shard_source(source)
    assert "ddp = fully_shard(ddp)" in fsdp.new_source and "DistributedDataParallel(" not in fsdp.new_source
    assert "ZeRO" in finding.remedies[1].title


def test_activations_bulk_offers_checkpointing_not_sharding():
    ranks = Ranks.of([rank(0, "oom", 200 * MiB, requested=64 * MiB, failed_at=1.0, params=MiB, grads=MiB)])
    assert [r.kind for r in rank_findings(ranks, "")[0].remedies] == ["checkpointing"]


def test_an_error_after_another_rank_failed_is_a_stop_not_a_failure(tmp_path, monkeypatch):
    """The failing rank aborts the process group: a rank waiting in a collective gets an error from gloo or
    NCCL, at times before its watcher read the failure. That rank was stopped by the failure; it did not
    fail on its own (a peer's error counted as a second failure would name the wrong first rank)."""
    import json

    from oommagic.run import rank_process
    from oommagic.run.rank_files import write

    monkeypatch.setattr(rank_process, "POLL_S", 60.0)  # the watcher sleeps: the error path decides
    directory = str(tmp_path)
    with (
        pytest.raises(RuntimeError, match="Connection closed by peer"),
        rank_process.RankRecorder(directory, None, "cpu", 0),
    ):
        write(directory, "oom-rank1-pid999999", {"rank": 1, "pid": 999999, "status": "oom"})
        raise RuntimeError("[gloo] Connection closed by peer")
    (mine,) = [p for p in tmp_path.iterdir() if p.name.startswith(("stopped-", "error-"))]
    result = json.loads(mine.read_text())
    assert mine.name.startswith("stopped-rank0-")
    assert result["status"] == "stopped" and result["stopped_by"] == 1
    assert "Connection closed by peer" in result["message"]

    # With no failure before it, the same error is this rank's own.
    other = tmp_path / "alone"
    other.mkdir()
    with pytest.raises(RuntimeError), rank_process.RankRecorder(str(other), None, "cpu", 0):
        raise RuntimeError("[gloo] Connection closed by peer")
    (own,) = [p.name for p in other.iterdir() if not p.name.startswith("pid-")]
    assert own.startswith("error-rank0-")


def test_result_round_trips_through_json():
    r = rank(1, "oom", requested=5, failed_at=2.0, contexts=((0, 7),))
    assert RankResult.from_json(r.to_json()) == r


def test_gpumem_line_maps_processes_to_ranks():
    from oommagic.devices import DeviceReport, GpuProcess, GpuStatus, render_devices_text

    gpu = GpuStatus(0, 0, "GPU-0", "H100", 6 * 1024**3, 80 * 1024**3, 74 * 1024**3, (), None)
    gpu = GpuStatus(
        **{**gpu.__dict__, "processes": (GpuProcess(4242, "python", 3 * 1024**3), GpuProcess(7, "x", MiB))}
    )
    text = render_devices_text(DeviceReport(True, None, "580", (gpu,)), ranks={4242: 1})
    assert "PID 4242  python  3.00 GiB  (rank 1)" in text and "(rank" not in text.split("PID 7")[1]


def test_views_show_a_row_per_rank():
    from oommagic.cellrun import CellRun
    from oommagic.timeline import Recording
    from oommagic.view.text import render_text
    from oommagic.view.widget import ranks_html

    ranks = Ranks.of(
        [rank(0, "stopped", stopped_by=1), rank(1, "oom", 200 * MiB, requested=80 * MiB, failed_at=1.0)]
    )
    run = CellRun(
        source="mp.spawn(train, nprocs=2)", recording=Recording(device="cpu"), outcome="oom", ranks=ranks
    )
    text = render_text(run)
    assert "ranks: rank 1 (cpu) ran out of memory first asking for 80.00 MiB; rank 0 was stopped" in text
    # The headline speaks of the rank that ran out, not of the kernel's own (empty) figures.
    assert text.splitlines()[0] == (
        "%%gpumem [OUT OF MEMORY] rank 1 (cpu) ran out of memory asking for 80.00 MiB with 200.00 MiB "
        "reserved of its 256.00 MiB limit; rank 0 was stopped"
    )
    assert "1001  100.00 MiB" not in text and "OUT OF MEMORY (asked 80.00 MiB)" in text
    html = ranks_html(run)
    assert html.count("<tr") == 3 and "stopped (rank 1 failed)" in html and "#c0392b" in html
    assert ranks_html(CellRun(source="", recording=Recording(device="cpu"))) == ""


def test_settings_of_the_kernel_become_snippets_for_the_ranks():
    from oommagic.diagnosis.findings import Finding, Remedy
    from oommagic.diagnosis.ranks import in_every_rank

    finding = Finding(
        "k",
        "t",
        "e",
        remedies=(
            Remedy("autocast", "bf16 autocast", "why.", automatic=True),
            Remedy("batch", "Batch 8 → 4", automatic=True, params={"where": "namespace"}),
            Remedy("checkpointing", "Checkpointing", automatic=True, new_source="x = 1"),
        ),
    )
    remedies = in_every_rank((finding,))[0].remedies
    assert [r.automatic for r in remedies] == [False, True, True]
    assert remedies[0].explanation.endswith("put the snippet into the rank function.")


SCRIPT = """
import torch
import oommagic

with oommagic.rank_recorder():
    torch.empty(96 * 1024 * 1024, dtype=torch.uint8)
"""


def test_script_started_by_the_cell_records_itself(run_cell, tmp_path):
    # What a script run through !torchrun does: one call, settings read from the environment the magic set.
    (tmp_path / "script.py").write_text(SCRIPT)
    _, out = run_cell(
        "%%gpumem --limit 64MiB --device cpu --text\nimport os, subprocess, sys\n"
        f"subprocess.run([sys.executable, {str(tmp_path / 'script.py')!r}], check=True,"
        " env={**os.environ, 'RANK': '0', 'PYTHONPATH': os.pathsep.join(sys.path)})"
    )
    run = last_run()
    assert run.outcome == "oom", out
    assert [(r.rank, r.status, r.requested) for r in run.ranks.results] == [(0, "oom", 96 * MiB)]
    assert "rank 0 (cpu) ran out of memory asking for 96.00 MiB" in run.headline()


def test_headline_of_ranks_that_fit_names_the_largest_peak():
    ranks = Ranks.of([rank(0, peak=100 * MiB), rank(1, peak=150 * MiB, device="cuda:1")])
    assert ranks.headline() == (
        "2 ranks: peak 150.00 MiB allocated, 150.00 MiB reserved of 256.00 MiB on rank 1 (cuda:1)"
    )


def test_rank_reads_its_own_device():
    from oommagic.run.rank_cuda import own_device, start_device

    # Where its allocator reserved memory, whatever its local rank says.
    assert own_device({0: 0, 1: 5 * MiB}, current=0, index=0, count=2) == 1
    # The device it set, where it allocated nothing yet.
    assert own_device({0: 0, 1: 0}, current=1, index=0, count=2) == 1
    # By convention its local rank; one visible device per rank (CUDA_VISIBLE_DEVICES) is device 0.
    assert own_device({0: 0, 1: 0}, current=0, index=1, count=2) == 1
    assert start_device(1, 1) == 0 and start_device(3, 2) is None and start_device(1, 4) == 1
