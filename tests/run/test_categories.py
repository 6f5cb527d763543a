"""Memory by category in CPU mode, in a real IPython shell: the categories of a run sum to the tracker's
bytes exactly and match a count by hand; the largest allocations name what made them; the snapshot opens
in PyTorch's memory viewer."""

from __future__ import annotations

import gc
import pickle

import pytest
import torch

from oommagic.categories import Breakdown, compare
from oommagic.run.capture import LEDGER

PARAMS = (256 * 1024 + 1024 + 1024 * 256 + 256) * 4  # two Linear layers, fp32: 2,102,272 B
LAYER2 = (1024 * 256 + 256) * 4
X64 = 64 * 64 * 256 * 4  # the batch of 64 that runs out: 4 MiB

# Step 1 (batch 1) leaves gradients and Adam's moments; step 2 (batch 64) runs out in its first layer.
TRAIN_OOM = """%%gpumem --limit 24MiB --plan-budget 0 --quiet --no-raise -o failed
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.Adam(model.parameters())
for batch_size in (1, 64):
    x = torch.randn(batch_size, 64, 256)
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
"""

TRAIN_OK = """%%gpumem --quiet -o fitted
for _ in range(2):
    x = torch.randn(8, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
del x
"""


def clean(shell):
    for name in [k for k, v in shell.user_ns.items() if isinstance(v, (torch.Tensor, torch.nn.Module))]:
        del shell.user_ns[name]
    for name in ("opt", "failed", "fitted", "loss"):
        shell.user_ns.pop(name, None)
    shell.run_line_magic("reset", "-f out")
    gc.collect()


@pytest.fixture
def failed(shell, run_cell):
    clean(shell)
    before = LEDGER.allocated
    run_cell(TRAIN_OOM)
    run = shell.user_ns["failed"]
    assert run.outcome == "oom"
    return run, before


def test_categories_at_a_training_oom_sum_to_the_tracker_and_match_a_hand_count(failed):
    run, before = failed
    cats = run.categories
    assert cats.at == "failure" and cats.measured == "tracker"
    # What the tracker held when the limit refused the 16 MiB of the first layer's output.
    assert cats.total == run.report.allocated == before + PARAMS * 4 + 16 + X64 + 4
    assert cats["parameters"] == PARAMS
    assert cats["gradients"] == PARAMS
    # exp_avg and exp_avg_sq per parameter, and Adam's four one-element fp32 `step` counters.
    assert cats["optimizer"] == 2 * PARAMS + 4 * 4
    # This step's batch and the loss of the step before; the rest of the cell's earlier cells' bytes too.
    assert cats["activations"] == before + X64 + 4
    assert cats["cache"] == cats["outside"] == cats["others"] == cats["kv_cache"] == 0


def test_the_largest_allocations_name_the_tensor_or_the_operator(failed):
    run, _ = failed
    top = run.categories.top
    assert [a.nbytes for a in top] == sorted((a.nbytes for a in top), reverse=True)
    assert top[0].nbytes == X64 and top[0].category == "activations" and top[0].op == "aten.randn"
    named = {a.name for a in top if a.category in ("parameters", "gradients")}
    assert {"model.0.weight", "model.2.weight", "model.0.weight.grad"} <= named


def test_a_run_that_fits_is_broken_down_at_its_peak_with_the_gradients_it_freed(shell, run_cell, failed):
    # The failed cell's names were dropped: bind a model and an optimizer again, outside the failure.
    run_cell(
        "%%gpumem --quiet\nmodel = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), "
        "torch.nn.Linear(1024, 256))\nopt = torch.optim.Adam(model.parameters())"
    )
    run_cell(TRAIN_OK)
    run = shell.user_ns["fitted"]
    cats = run.categories
    assert run.outcome == "ok" and cats.at == "peak"
    assert cats.total == run.peak_allocated
    # The peak came in the second step's backward pass, inside the first layer: the second layer's
    # gradients existed, the first's not yet. zero_grad() freed them before the cell ended; the step's
    # observation still knew them, by their parameter's name.
    assert cats["gradients"] == LAYER2
    assert {a.name for a in cats.top if a.category == "gradients"} == {"model.2.weight.grad"}
    assert cats["parameters"] == PARAMS and cats["optimizer"] == 2 * PARAMS + 4 * 4
    assert cats["activations"] == run.peak_allocated - PARAMS - LAYER2 - 2 * PARAMS - 16


def test_the_kv_cache_of_a_generation_loop_is_its_own_category(shell, run_cell):
    clean(shell)
    run_cell(
        """%%gpumem --limit 8MiB --plan-budget 0 --quiet --no-raise -o failed
class DynamicCache:
    def __init__(self):
        self.key_cache, self.value_cache = [], []

def generate(steps):
    past_key_values = DynamicCache()
    for _ in range(steps):
        past_key_values.key_cache.append(torch.zeros(64, 1024))
        past_key_values.value_cache.append(torch.zeros(64, 1024))
    return past_key_values

generate(100)
"""
    )
    run = shell.user_ns["failed"]
    cats = run.categories
    assert run.outcome == "oom" and cats["kv_cache"] > 0
    # Every 256 KiB tensor the loop made before the limit is in the cache.
    assert (
        cats["kv_cache"] % (64 * 1024 * 4) == 0 and cats["kv_cache"] >= 8 * 2**20 - 2 * 64 * 1024 * 4 - 2**20
    )
    assert any(a.name and a.name.startswith("past_key_values") for a in cats.top)


def test_stacks_give_the_python_line_of_each_large_allocation(shell, run_cell):
    clean(shell)
    run_cell("%%gpumem --stacks --quiet -o fitted\nbig = torch.zeros(1024, 1024)\nsmall = torch.ones(8)")
    top = shell.user_ns["fitted"].categories.top
    assert top[0].nbytes == 4 * 2**20
    assert top[0].line == "cell:1 big = torch.zeros(1024, 1024)"
    run_cell("%%gpumem --quiet -o fitted\nbig = torch.zeros(1024, 1024)")
    assert shell.user_ns["fitted"].categories.top[0].line is None, "no stacks by default"


def test_snapshot_is_written_for_the_last_run_and_opens_in_memory_viz(shell, run_cell, failed, tmp_path):
    from torch.cuda import _memory_viz

    run, _ = failed
    target = tmp_path / "oom.pickle"
    _, out = run_cell(f"%gpumem --snapshot {target}")
    assert str(target) in out
    with target.open("rb") as f:
        snap = pickle.load(f)
    live = sum(seg["total_size"] for seg in snap["segments"])
    assert live == run.categories.total, "the snapshot is the memory at the failure"
    assert "aten.randn" in _memory_viz.memory(snap, format_flamegraph=lambda lines: lines)
    trace = snap["device_traces"][0]
    assert {e["action"] for e in trace} >= {"alloc", "free_requested", "free_completed"}
    html = tmp_path / "oom.html"
    run_cell(f"%gpumem --snapshot {html}")
    assert "Active Memory Timeline" in html.read_text()


def test_line_magic_refuses_other_options(run_cell):
    _, out = run_cell("%gpumem --limit 1GiB")
    assert "takes --free, --fix [N] or --snapshot FILE" in out


def test_two_runs_side_by_side_by_category(failed, shell, run_cell):
    run, _ = failed
    run_cell("%%gpumem --quiet -o fitted\nx = torch.randn(4, 64, 256)")
    rows = compare(run.categories, shell.user_ns["fitted"].categories)
    by = {r.label: r for r in rows}
    assert by["parameters"].a == PARAMS and by["parameters"].b == 0 and by["parameters"].delta == -PARAMS
    assert rows[-1].label == "total" and rows[-1].a == run.categories.total
    assert Breakdown.from_json(run.categories.to_json()) == run.categories


def test_the_cuda_trace_replay_breaks_down_the_peak_its_timeline_shows():
    """The CUDA path's arithmetic on an allocator snapshot made by hand (no GPU here): the blocks alive at
    the timeline's peak, a block from before the cell freed in it, a gradient seen at a step."""
    from oommagic.categories import Observation, breakdown, live_at
    from oommagic.run.capture.trace import TraceEvents, cuda_timeline, snapshot_blocks, start_blocks

    MiB = 2**20
    old, grad, act, late = 0x1000000, 0x2000000, 0x3000000, 0x4000000

    def entry(action, addr, size, t):
        return {"action": action, "addr": addr, "size": size, "time_us": t, "frames": []}

    trace = [
        entry("alloc", grad, 2 * MiB, 10),  # a gradient, seen at the step at t=25
        entry("alloc", act, 3 * MiB, 20),
        entry("free_requested", old, 1 * MiB, 30),  # alive before the cell: the peak (t=20) counts it
        entry("free_requested", act, 3 * MiB, 40),
        entry("free_requested", grad, 2 * MiB, 45),
        entry("alloc", late, 1 * MiB, 50),
    ]
    snapshot = {
        "segments": [
            {
                "device": 0,
                "total_size": 8 * MiB,
                "blocks": [{"address": late, "size": MiB, "state": "active_allocated"}],
            }
        ],
        "device_traces": [trace],
    }
    events = TraceEvents()
    timeline = cuda_timeline(snapshot, 0, 0.0, (1 * MiB, 8 * MiB), [], events=events)
    blocks, reserved = snapshot_blocks(snapshot, 0)
    at_peak = live_at(start_blocks(events, blocks), events, events.peak)
    bd = breakdown(
        at_peak.values(), [Observation(25, grad, "gradients")], "peak", "allocator", None, reserved
    )
    assert timeline.peak_allocated == 6 * MiB == bd.total - bd["cache"]
    assert (bd["gradients"], bd["activations"], bd["cache"]) == (2 * MiB, 4 * MiB, 2 * MiB)
    # The same address reused after the step is not a gradient any more.
    again = breakdown(
        at_peak.values(), [Observation(55, grad, "gradients")], "peak", "allocator", None, reserved
    )
    assert again["gradients"] == 0


def test_a_sharded_parameters_memory_is_read_at_its_local_shard():
    """FSDP2's parameters and gradients are ``DTensor``s, whose own storage is no memory: reading its address
    raised inside the person's optimizer step on the H100s ("invalid python storage") and killed every rank
    of an FSDP2 trial. The step's observer reads the local shard's address; a tensor with no storage reads
    as None, without raising."""
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from oommagic.run.capture.roles import StepRoles, storage_address

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        weight = torch.nn.Parameter(distribute_tensor(torch.randn(8, 4), mesh, [Shard(0)]))
        weight.grad = distribute_tensor(torch.ones(8, 4), mesh, [Shard(0)])
        optimizer = torch.optim.SGD([weight], lr=0.1)
        local = weight._local_tensor.untyped_storage().data_ptr()
        grad = weight.grad._local_tensor.untyped_storage().data_ptr()
        with pytest.raises(RuntimeError):
            weight.untyped_storage().data_ptr()
        steps = StepRoles(storage_address, lambda: 1.0)
        steps(optimizer)
        assert steps.steps == [(1.0, ((grad, local),))]
        plain = torch.zeros(3)
        assert storage_address(plain) == plain.untyped_storage().data_ptr()
        assert storage_address(torch.zeros(3).to_sparse()) is None
    finally:
        dist.destroy_process_group()
