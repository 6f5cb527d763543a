"""A trial leaves no trace (issue #23), in a real IPython shell, CPU mode: a failing cell whose fix plan runs
trials changes, in each trial, a raw tensor stepped by its own optimizer, a model two attributes deep, a
tensor updated in place, a list inside a dict, a defaultdict, a deque, generator objects of torch, NumPy
and ``random``, a log file and a checkpoint; after the plan every one of them is as it was, and the plan
names what it restored."""

from __future__ import annotations

import collections
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

import oommagic

ROOT = Path(__file__).resolve().parents[2]

SETUP = """
import collections, random
import numpy as np
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
raw = torch.zeros(8, requires_grad=True)
raw_opt = torch.optim.Adam([raw], lr=0.1)
class Box:
    pass
exp = Box()
exp.parts = Box()
exp.parts.head = torch.nn.Linear(4, 4)
head_opt = torch.optim.SGD(exp.parts.head.parameters(), lr=0.1, momentum=0.9)
ema = torch.zeros(4)
total = torch.zeros(4)
stats = {"losses": []}
counts = collections.defaultdict(int)
recent = collections.deque(maxlen=5)
np_rng = np.random.default_rng(1)
py_rng = random.Random(1)
torch_gen = torch.Generator().manual_seed(1)
"""

# Fails at its first forward pass (batch 256); a trial with a smaller batch runs a whole step and changes
# everything above before its bound stops it. `reached` (a function: not state) counts the trials that did.
CELL = """%%gpumem --limit 5MiB --quiet --no-raise --plan-budget 4
batch_size = 256
for step in range(2):
    x = torch.ones(batch_size, 16, 32)
    loss = model(x).square().mean() + (raw * 2).sum() + exp.parts.head(torch.ones(2, 4)).sum()
    loss.backward()
    opt.step(); raw_opt.step(); head_opt.step()
    opt.zero_grad()
    with torch.no_grad():
        ema.mul_(0.9).add_(1.0)
        total.data.add_(1.0)  # through .data: the version counter does not see it
    stats["losses"].append(float(loss))
    counts["steps"] += 1
    recent.append(step)
    draws = (np_rng.random(), py_rng.random(), torch.rand(1, generator=torch_gen))
    with open(LOG, "a") as f:
        f.write(f"step {step}\\n")
    held_log.write(f"step {step}\\n")
    torch.save(exp.parts.head.state_dict(), CKPT)
    reached(step)
"""


def state(ns: dict) -> dict:
    """Each thing the cell changes, by the name of the failure it would be."""
    return {
        "raw tensor and its optimizer": (ns["raw"].detach().clone(), str(ns["raw_opt"].state_dict())),
        "module two attributes deep": [p.detach().clone() for p in ns["exp"].parts.head.parameters()]
        + [str(ns["head_opt"].state_dict())],
        "tensor updated in place": ns["ema"].clone(),
        "tensor updated through .data": ns["total"].clone(),
        "list inside a dict": list(ns["stats"]["losses"]),
        "defaultdict": dict(ns["counts"]),
        "deque": list(ns["recent"]),
        "numpy generator": ns["np_rng"].bit_generator.state,
        "random.Random": ns["py_rng"].getstate(),
        "torch.Generator": ns["torch_gen"].get_state(),
        "log file": open(ns["LOG"], "rb").read(),
        "log file held open": (ns["held_log"].flush(), open(ns["HELD"], "rb").read(), ns["held_log"].tell()),
        "checkpoint": os.path.exists(ns["CKPT"]) and open(ns["CKPT"], "rb").read(),
        "model": [p.detach().clone() for p in ns["model"].parameters()],
    }


def equal(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(equal, a, b))
    return a == b


@pytest.fixture(scope="module")
def planned(shell, tmp_path_factory):
    """The failing cell once, with its plan's trials: (state before, state after, the run, trials that
    reached the end of a step)."""
    folder = tmp_path_factory.mktemp("files")
    log, ckpt = folder / "train.log", folder / "head.pt"
    log.write_text("started\n")
    held = folder / "held.log"
    held.write_text("opened before\n")
    reached: list[int] = []
    shell.run_cell(SETUP)
    shell.user_ns.update(LOG=str(log), CKPT=str(ckpt), HELD=str(held), reached=reached.append)
    held_log = shell.user_ns["held_log"] = open(held, "a")  # noqa: SIM115 (the user's, open across cells)
    before = state(shell.user_ns)
    np.random.seed(5)
    random.seed(5)
    rngs = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    shell.run_cell(CELL)
    run = oommagic.history()[-1]
    after = state(shell.user_ns)
    rngs_after = (torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate())
    yield before, after, run, reached, (rngs, rngs_after)
    held_log.close()
    for name in set(shell.user_ns) - shell._oommagic_tests_started_with:
        shell.user_ns.pop(name, None)


def test_trials_ran_whole_steps(planned):
    _, _, run, reached, _ = planned
    assert run.outcome == "oom" and run.plan.trials >= 1, run.plan.summary
    assert reached, "no trial reached the end of a step: the checks below would prove nothing"


@pytest.mark.parametrize(
    "what",
    [
        "raw tensor and its optimizer",
        "module two attributes deep",
        "tensor updated in place",
        "tensor updated through .data",
        "list inside a dict",
        "defaultdict",
        "deque",
        "numpy generator",
        "random.Random",
        "torch.Generator",
        "log file",
        "log file held open",
        "checkpoint",
        "model",
    ],
)
def test_a_trial_leaves_it_as_it_was(planned, what):
    before, after, run, _, _ = planned
    assert equal(before[what], after[what]), f"{what} changed by the trials; {run.plan.summary}"


def test_global_random_states_as_they_were(planned):
    (torch_rng, np_rng, py_rng), (torch_after, np_after, py_after) = planned[4]
    assert torch.equal(torch_rng, torch_after) and (np_rng == np_after).all() and py_rng == py_after


def test_the_plan_names_what_it_restored(planned):
    summary = planned[2].plan.summary
    for named in ("model", "opt (Adam)", "raw_opt (Adam)", "exp", "1 defaultdict", "1 deque", "3 random gen"):
        assert named in summary, summary
    assert "3 files (" in summary and all(f in summary for f in ("train.log", "head.pt", "held.log")), summary
    assert "the model, optimizer, RNG and namespace" not in summary


def test_a_cell_without_a_model_is_not_said_to_have_one(shell, run_cell):
    for name in set(shell.user_ns) - shell._oommagic_tests_started_with:
        shell.user_ns.pop(name, None)
    shell.run_cell("rows = []")
    run_cell(
        "%%gpumem --limit 6MiB --quiet --no-raise --plan-budget 3\n"
        "batch_size = 256\n"
        "with torch.no_grad():\n"
        "    for _ in range(2):\n"
        "        rows.append(torch.nn.functional.relu(torch.ones(batch_size, 16, 256) * 2).sum().item())\n"
    )
    run = oommagic.history()[-1]
    assert run.outcome == "oom" and run.plan.trials >= 1, run.plan.summary
    assert "model" not in run.plan.summary and "optimizer" not in run.plan.summary, run.plan.summary
    assert "restored after each trial: 1 list, the global RNGs." in run.plan.summary, run.plan.summary
    assert shell.user_ns["rows"] == []


_ = collections  # the setup's own imports run in the shell


def test_a_file_too_large_to_keep_aside_stops_the_trial_and_the_plan_says_so(
    shell, run_cell, tmp_path, monkeypatch
):
    import oommagic.run.trial_files as trial_files

    # The bound is a size of the machine's disk: a small one here, for a small file.
    monkeypatch.setattr(trial_files, "FILE_BOUND", 1024)
    big = tmp_path / "big.bin"
    big.write_bytes(b"x" * 4096)
    shell.run_cell(SETUP)
    shell.user_ns.update(BIG=str(big))
    run_cell(
        "%%gpumem --limit 5MiB --quiet --no-raise --plan-budget 3\n"
        "batch_size = 256\n"
        "for step in range(2):\n"
        "    model(torch.ones(batch_size, 16, 32)).square().mean().backward()\n"
        "    opt.step()\n"
        "    with open(BIG, 'wb') as f:\n"
        "        f.write(b'trial')\n"
    )
    run = oommagic.history()[-1]
    assert run.outcome == "oom"
    assert run.plan.summary.startswith(f"Not measured: the cell writes {big} (4.00 KiB)"), run.plan.summary
    assert all(e.verdict == "not measured" for e in run.plan.entries)
    assert big.read_bytes() == b"x" * 4096


def test_a_compilers_cache_folder_is_no_file_of_the_users(tmp_path, monkeypatch):
    import shutil

    from oommagic.run.trial_files import FileTooLarge, TrialFiles

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    files = TrialFiles()
    with files.watching():
        scratch = tmp_path / "inductor" / "triton" / "tmp.pid_1"
        scratch.mkdir(parents=True)
        (scratch / "kernel.py").write_text("compiled")
        shutil.rmtree(scratch)
    assert files.refused is None
    files.restore()
    mine = tmp_path / "mine"
    mine.mkdir()
    files = TrialFiles()
    with pytest.raises(FileTooLarge), files.watching():
        shutil.rmtree(mine)
    assert "removes the directory" in files.refused


def test_views_of_a_multi_output_op_whose_base_was_written_are_snapshotted_and_put_back():
    """`mu, logvar = h.chunk(2)` left by an earlier cell, their base then written in place (a restore
    writing one view bumps the counter both share): `is_leaf` and `grad_fn` raise on such a view. On an
    H100 every trial of a VAE cell then "could not start"; the snapshot must take them and put them back."""
    from oommagic.run.snapshot import UserState

    w = torch.randn(4, 6, requires_grad=True)
    h = w * 2
    mu, logvar = h.chunk(2, dim=1)
    h.detach().add_(1)
    with pytest.raises(RuntimeError, match="modified inplace"):
        _ = mu.is_leaf  # what the snapshot used to ask
    namespace = {"mu": mu, "logvar": logvar}
    before = (mu.detach().clone(), logvar.detach().clone())
    state = UserState.take(namespace)
    mu.detach().mul_(0)
    logvar.detach().add_(5)
    state.restore(namespace)
    assert torch.equal(mu.detach(), before[0]) and torch.equal(logvar.detach(), before[1])
    assert state.verify(namespace) == ()


def test_a_scan_reads_views_whose_base_was_written_without_raising(shell):
    shell.run_cell(
        "import torch\nw = torch.randn(64, 8, requires_grad=True)\nh = w * 2\nmu, logvar = h.chunk(2, dim=1)"
    )
    shell.run_cell("h.detach().add_(1)")
    result = shell.run_cell(
        "%%gpumem --limit 5MiB --quiet --no-raise --plan-budget 4\n"
        "batch_size = 256\nx = torch.ones(batch_size, 64, 256, requires_grad=True)\ny = (x * 2).sum()"
    )
    assert result.success, result.error_in_exec
    run = oommagic.history()[-1]
    assert run.outcome == "oom"
    assert not any("could not start" in e.note for e in run.plan.entries), [e.note for e in run.plan.entries]


FORK_AFTER_SNAPSHOT = """
import os, signal, sys, time, torch
from oommagic.run.snapshot import UserState
# Torch's thread count is the person's: once any count is set, each CUDA autograd thread of a rank forked
# later sets it again, which torch 2.11 refuses after a fork (every rank aborted on 2 x H100).
counts = []
set_threads = torch.set_num_threads
torch.set_num_threads = lambda n: (counts.append(n), set_threads(n))[1]
# 64 MiB, made and changed without a torch op (NumPy): only the tool's copies and comparisons run torch's
# CPU kernels here, which at this size run in parallel (OMP_NUM_THREADS=2) on the thread that calls them.
namespace = {"rows": torch.frombuffer(bytearray(64 * 1024 * 1024), dtype=torch.float32)}
state = UserState.take(namespace, check_host=False)
namespace["rows"].numpy()[:] = 1.0
state.restore(namespace)
assert not namespace["rows"].numpy().any()
assert torch.get_num_threads() == 2 and counts == [], (torch.get_num_threads(), counts)
pid = os.fork()
if pid == 0:  # a rank forked by the cell afterwards: its first parallel CPU op
    torch.randperm(4 * 1024 * 1024)
    (namespace["rows"] * 2).sum()
    os._exit(0)
deadline = time.time() + 30
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print("child", status)
        break
    time.sleep(0.1)
else:
    os.kill(pid, signal.SIGKILL)
    print("child hung")
"""


def test_a_process_the_cell_forks_after_a_trial_can_run_parallel_cpu_ops(tmp_path):
    """The snapshot's copies and comparisons start no OpenMP team on the kernel's main thread (a team does
    not survive a fork: a cell that forks its ranks after a trial, Lightning's ``ddp_notebook``, got
    children that hung at their first parallel op, segfaulted on the H100 machine), and never set torch's
    thread count (forked CUDA ranks then aborted). In a fresh process, two threads."""
    import subprocess
    import sys

    script = tmp_path / "fork_after_snapshot.py"
    script.write_text(FORK_AFTER_SNAPSHOT)
    env = {**os.environ, "OMP_NUM_THREADS": "2", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "child 0" in done.stdout, done.stdout + done.stderr
