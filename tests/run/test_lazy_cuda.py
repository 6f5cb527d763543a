"""Launch as without the tool: ``%%gpumem`` starts no CUDA in the kernel on the cell's behalf.

``notebook_launcher`` forks its ranks; a kernel that started CUDA before the fork fails them ("Cannot
re-initialize CUDA in forked subprocess"). The CUDA recorder therefore starts its recording from torch's
queue of calls run at lazy initialisation, when the cell's own code starts CUDA. On this CPU build of torch
every call that starts CUDA raises ("Torch not compiled with CUDA enabled"), so a recorder that made one
fails these tests outright.
"""

from __future__ import annotations

import os

import pytest
import torch

from oommagic.run.capture.cuda import CudaRecorder, start_when
from tests.run.test_ranks import free_port

MiB = 1024**2

needs_cuda_unstarted = pytest.mark.skipif(
    torch.cuda.is_initialized(), reason="CUDA already runs in this process: the lazy start is not taken"
)


def queued_by(recorder: CudaRecorder) -> list:
    return [call for call, _ in torch.cuda._queued_calls if getattr(call, "__self__", None) is recorder]


def test_when_the_recording_starts():
    assert start_when(initialised=True) == "now"
    assert start_when(initialised=False) == "with the cell's CUDA"
    # A rank forked from the kernel inherits the queue: the kernel's recording never starts there.
    assert start_when(initialised=False, own_process=False) == "never"


@needs_cuda_unstarted
def test_a_cell_that_never_starts_cuda_leaves_it_unstarted():
    recorder = CudaRecorder(0, limit=64 * MiB)
    with recorder:
        waiting = queued_by(recorder)
        torch.ones(1024).sum()
    assert len(waiting) == 1, "the start waits for the cell's CUDA"
    assert not torch.cuda.is_initialized()
    assert queued_by(recorder) == [], "a start left queued would run in a later cell"
    rec = recorder.recording()
    assert not recorder.started and rec.device == "cuda:0" and rec.peak_allocated == 0
    assert recorder.categories([], rec.timeline) is None and recorder.snapshot() is None


@needs_cuda_unstarted
def test_a_forked_rank_does_not_start_the_kernels_recording():
    recorder = CudaRecorder(0, limit=64 * MiB)
    with recorder:
        (start,) = queued_by(recorder)
        pid = os.fork()
        if pid == 0:  # the rank: its CUDA start runs the inherited queue
            start()
            os._exit(0 if recorder._waiting and not recorder.started else 1)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


LAUNCH = """
import os, torch, torch.distributed as dist
def reduced(out_dir):
    torch.set_num_threads(1)  # a forked child hangs in libgomp's barrier if it reuses the kernel's pool
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    with open(os.path.join(out_dir, f"rank{rank}"), "w") as fh:
        cuda = torch.cuda.is_initialized()
        fh.write(f"rank {rank} of {dist.get_world_size()}: {value.item():.0f} on {cuda}")
    dist.destroy_process_group()
def results(out_dir):
    found = []
    for name in sorted(os.listdir(out_dir)):
        with open(os.path.join(out_dir, name)) as fh:
            found.append(fh.read())
    return found
"""


def test_fork_launches_as_from_a_plain_cell(tmp_path):
    """``notebook_launcher`` from a plain cell and from a ``%%gpumem`` cell of a real kernel: the same
    ranks, the same results, CUDA unstarted in the kernel after; and the CUDA recorder entered around a
    ``torch.multiprocessing`` fork leaves CUDA unstarted and nothing queued."""
    pytest.importorskip("accelerate")
    pytest.importorskip("nbclient")
    from tests.test_kernel import execute, notebook, texts

    dirs = [tmp_path / name for name in ("plain", "magic", "recorder")]
    for d in dirs:
        d.mkdir()
    launch = "notebook_launcher(reduced, args=({d!r},), num_processes=2, use_port='{port}')\n"
    fork = (
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT='{port}', WORLD_SIZE='2')\n"
        "mp.start_processes(lambda i, d: (os.environ.update(RANK=str(i)), reduced(d)), args=({d!r},),"
        " nprocs=2, start_method='fork')\n"
    )
    show = "print(results({d!r}), torch.cuda.is_initialized())"
    nb = notebook(
        "%load_ext oommagic\nimport torch.multiprocessing as mp\nfrom accelerate import notebook_launcher\n"
        + LAUNCH,
        launch.format(d=str(dirs[0]), port=free_port()) + show.format(d=str(dirs[0])),
        "%%gpumem --quiet\n" + launch.format(d=str(dirs[1]), port=free_port()) + show.format(d=str(dirs[1])),
        "from oommagic.run.capture.cuda import CudaRecorder\nrecorder = CudaRecorder(0, limit=1 << 30)\n"
        "with recorder:\n    "
        + fork.format(d=str(dirs[2]), port=free_port()).replace("\n", "\n    ")
        + "\n"
        + show.format(d=str(dirs[2]))
        + "\nprint(recorder.started, [c for c, _ in torch.cuda._queued_calls"
        " if getattr(c, '__self__', 0) is recorder])",
    )
    execute(nb, timeout=180)
    expected = "['rank 0 of 2: 3 on False', 'rank 1 of 2: 3 on False'] False"
    outputs = [texts(cell).strip() for cell in nb.cells[1:]]
    assert outputs[0].endswith(expected), outputs[0]
    assert outputs[1].endswith(expected), outputs[1]
    assert outputs[2].splitlines()[-2:] == [expected, "False []"], outputs[2]
