"""The names a rewrite adds (counters, loop variables, helper functions) are its own: fresh against the
cell, the notebook functions it calls and the namespace, so a rewritten cell reads and overwrites none of
the person's."""

from __future__ import annotations

import torch

from oommagic.diagnosis.findings import Remedy
from oommagic.diagnosis.kinds import rewrite_again
from oommagic.diagnosis.remedies import batch_source, step_per_tensor_source
from oommagic.diagnosis.rewrite import (
    accumulate_loops,
    fresh_name,
    micro_batch_source,
    skip_long_source,
    split_rows_source,
    truncate_source,
)
from oommagic.diagnosis.rewrite_generation import split_generate_source
from oommagic.diagnosis.source import BatchGuess

LOOP = """\
micro_step = 0
for x in loader:
    loss = model(x).sum()
    loss.backward()
    micro_step += 1
    opt.step()
    opt.zero_grad()
"""


def test_a_name_is_fresh_against_the_cell_and_the_namespace():
    assert fresh_name("micro_step", "x = 1") == "micro_step"
    assert fresh_name("micro_step", "micro_step = 0") == "micro_step_"
    assert fresh_name("micro_step", "micro_step = 0", taken={"micro_step_"}) == "micro_step__"
    assert fresh_name("too_long", "print('too_long')") == "too_long_", "a word in a string counts too"


def test_the_accumulation_counter_is_not_the_cells_own():
    new = accumulate_loops(LOOP, 4, taken={"micro_step_"})
    assert "micro_step__ = 0\nfor x in loader:" in new
    assert "    micro_step__ += 1\n    micro_step += 1\n    if micro_step__ % 4 == 0:" in new, new
    assert new.count("micro_step = 0") == 1, "the cell's own counter is set once, by the cell"


def run_loop(source: str, batches: int) -> tuple[int, int]:
    """(optimizer steps, the cell's micro_step) of ``source`` run over ``batches`` batches."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    steps = []
    opt.register_step_post_hook(lambda *_: steps.append(1))
    ns = {"model": model, "opt": opt, "loader": [torch.ones(2, 4)] * batches}
    exec(source, ns)
    return len(steps), ns["micro_step"]


def test_the_accumulated_loop_steps_as_often_as_intended():
    assert run_loop(LOOP, 3) == (3, 3)
    # Four micro-batches for each batch the cell had: the optimizer steps as many times as before.
    assert run_loop(accumulate_loops(LOOP, 4), 12) == (3, 12)


HELPER = """\
def train(model, loader):
    global micro_step
    for x in loader:
        model(x).sum().backward()
        micro_step += 1
        opt.step()
        opt.zero_grad()
"""


def test_a_counter_in_a_notebook_function_is_fresh_against_it_and_one_for_the_cell():
    guess = BatchGuess("bs", 64, "namespace")
    new, kept = batch_source("train(model, loader)\n", (("train", HELPER),), guess, 16, 4)
    assert kept and "    micro_step_ = 0\n    for x in loader:" in new
    assert "if micro_step_ % 4 == 0:" in new and "        micro_step += 1\n" in new


def test_a_rewrite_made_again_chooses_the_names_it_chose_then():
    guess = BatchGuess("bs", 64, "source")
    cell = "bs = 64\n" + LOOP.replace("micro_step", "seen")
    # `micro_step` was bound in the namespace when the fix was offered.
    new, _ = batch_source(cell, (), guess, 16, 4, taken={"micro_step"})
    assert "bs = 16\n" in new and "micro_step_ = 0" in new
    params = {"name": "bs", "old": 64, "new": 16, "accumulate": 4, "where": "source"}
    remedy = Remedy("batch", "Batch 64 → 16", automatic=True, new_source=new, params=params)
    assert rewrite_again(cell, remedy) == new


def test_helpers_defined_at_the_top_of_the_cell_take_no_name_of_the_persons():
    gen = "def generate_in_chunks(*a):\n    return 0\nout = model.generate(ids, max_new_tokens=4)\n"
    new = split_generate_source(gen, 8, taken={"generate_in_chunks_"})
    assert "def generate_in_chunks__(generate, chunk" in new
    assert "out = generate_in_chunks__(model.generate, 8, ids" in new
    assert "def generate_in_chunks(*a):" in new, "the person's function stays as it is"

    collate = "truncated = 3\nloader = DataLoader(ds, collate_fn=pad)\n"
    new = truncate_source(collate, 512, taken={"truncated_"})
    assert "def truncated__(collate, max_length):" in new and "collate_fn=truncated__(pad, 512)" in new

    loop = "for batch in loader:\n    model(batch).loss.backward()\n"
    new = skip_long_source(loop, "batch", 512, taken={"too_long"})
    assert "def too_long_(batch, max_length):" in new and "    if too_long_(batch, 512):\n" in new

    new = step_per_tensor_source("param_group = 7\n", ["opt"], taken={"param_group_"})
    assert new.startswith("for param_group__ in opt.param_groups:")
    assert 'param_group__["foreach"] = False' in new and new.endswith("param_group = 7\n")


def test_the_rows_of_a_split_are_not_a_tensor_the_expression_reads():
    cell = "nearest = torch.cdist(Xq, rows).argmin(dim=1)\n"
    new = split_rows_source(cell, "torch.cdist(Xq, rows).argmin(dim=1)", "Xq", 3)
    assert "for rows_ in Xq.split(3)" in new, new
    ns = {"torch": torch, "Xq": torch.randn(10, 4), "rows": torch.randn(6, 4)}
    expected = torch.cdist(ns["Xq"], ns["rows"]).argmin(dim=1)
    exec(new, ns)
    assert torch.equal(ns["nearest"], expected)


def test_micro_batches_take_no_name_of_the_namespace():
    cell = "loss = loss_fn(model(X), y)\nloss.backward()\nopt.step()\n"
    new = micro_batch_source(cell, ("X", "y"), 1000, 300, taken={"X_rows", "y_rows", "y_rows_"})
    assert "for X_rows_, y_rows__ in zip(X.tensor_split(4), y.tensor_split(4)):" in new, new
