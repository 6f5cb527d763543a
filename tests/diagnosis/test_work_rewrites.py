"""Rewrites that keep the cell's work, read and written on text (one also run, for its update): a step
whose batch the cell slices off a tensor, a loop that accumulates gradients with its own counter, and the
training loader handed to a trainer's fit."""

from __future__ import annotations

import ast

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from oommagic.diagnosis.context import loader_batch, sliced_first
from oommagic.diagnosis.rewrite import micro_batch_source, own_accumulation, rewrite_batch
from oommagic.diagnosis.source import BatchGuess, find_batch, whole_step
from oommagic.diagnosis.source.slices import rows_taken


@pytest.mark.parametrize(
    "expr, rows",
    [
        ("stream[it * mb:(it + 1) * mb].to(device)", "mb"),
        ("X[mb * it:mb * (it + 1)]", "mb"),
        ("X[i:i + b]", "b"),
        ("X[i:b + i].cuda()", "b"),
        ("corpus[pos:pos + window]", "window"),
        ("torch.randperm(n)[:b]", "b"),
        ("data[k * cfg.bs:(k + 1) * cfg.bs]", "cfg.bs"),
        ("data[:, :-1]", None),
        ("data[:-1]", None),
        ("data[0]", None),
        ("data[i:j]", None),
        ("data[::2]", None),
    ],
)
def test_the_rows_a_slice_takes_are_read_in_every_spelling(expr, rows):
    found = rows_taken(ast.parse(expr, mode="eval").body, {})
    assert (ast.unparse(found) if found is not None else None) == rows


PERMUTED = """\
n_batch = 2048
for step in range(2):
    idx = torch.randperm(len(feats))[:n_batch]
    xb, yb = feats[idx], labels[idx]
    sgd.zero_grad()
    loss = F.cross_entropy(clf(xb), yb)
    loss.backward()
    sgd.step()
"""


def test_a_step_on_rows_picked_by_a_cut_permutation_runs_on_micro_batches_of_them():
    step = whole_step(PERMUTED)
    assert [(n, ast.unparse(e)) for n, e in step.sizes] == [("xb", "n_batch"), ("yb", "n_batch")]
    new = micro_batch_source(PERMUTED, ("xb", "yb"), 2048, 512)
    # The permutation is drawn once per step, as before; the step's update sums its four micro-batches.
    assert new.count("torch.randperm") == 1 and new.count("sgd.step()") == 1, new
    assert "for xb_rows, yb_rows in zip(xb.split(512), yb.split(512)):" in new
    assert "(loss * len(xb_rows) / len(xb)).backward()" in new
    assert new.index("sgd.zero_grad()") < new.index("for xb_rows")


def test_a_range_stepping_by_the_batch_keeps_its_own_rewrite_and_slices_elsewhere_get_micro_batches():
    stepping = "bs = 64\nfor i in range(0, len(X), bs):\n    xb = X[i:i + bs]\n    net(xb).sum().backward()\n"
    named = find_batch(stepping)
    sliced = BatchGuess("bs", 64, "rows", path=("xb",))
    assert sliced_first(stepping, named, sliced) is named
    counted = (
        "bs = 64\nfor it in range(3):\n    xb = X[it * bs:(it + 1) * bs]\n    net(xb).sum().backward()\n"
    )
    assert sliced_first(counted, find_batch(counted), sliced) is sliced
    assert sliced_first(counted, None, sliced) is sliced


OWN_NAMED = """\
accum = 2
for i, (xb, yb) in enumerate(DataLoader(points, batch_size=1024)):
    loss = loss_fn(mlp(xb), yb) / accum
    loss.backward()
    if (i + 1) % accum == 0:
        opt.step()
        opt.zero_grad()
"""
OWN_LITERAL = """\
for j, (xb, yb) in enumerate(DataLoader(points, batch_size=1024)):
    out = mlp(xb)
    (loss_fn(out, yb) / 2).backward()
    if (j + 1) % 2 == 0:
        opt.step()
        opt.zero_grad()
"""


def test_a_loops_own_accumulation_is_scaled_and_no_second_counter_is_added():
    guess = find_batch(OWN_NAMED)
    assert [ast.unparse(n) for n, _ in own_accumulation(ast.parse(OWN_NAMED))] == ["accum"]
    new = rewrite_batch(OWN_NAMED, guess, 256, accumulate=4)
    assert "accum = 8" in new and "batch_size=256" in new and "micro_step" not in new, new
    literal = rewrite_batch(OWN_LITERAL, find_batch(OWN_LITERAL), 256, accumulate=4)
    assert "(j + 1) % 8 == 0" in literal and "(loss_fn(out, yb) / 2 / 4).backward()" in literal, literal
    assert "micro_step" not in literal


def test_an_accumulation_count_read_from_the_namespace_is_scaled_where_the_loop_tests_it():
    cell = OWN_NAMED.replace("accum = 2\n", "")
    new = rewrite_batch(cell, find_batch(cell), 256, accumulate=4)
    assert "if (i + 1) % (accum * 4) == 0:" in new and "(loss / 4).backward()" in new, new


class _Trainer:
    """Stands for any trainer that keeps its accumulation as a plain attribute, as Lightning's does."""

    def __init__(self) -> None:
        self.accumulate_grad_batches = 1


def test_the_training_loader_handed_to_a_trainers_fit_is_its_batch_with_its_accumulation():

    data = TensorDataset(torch.zeros(8, 2))
    ns = {
        "tr": _Trainer(),
        "train_dl": DataLoader(data, batch_size=4),
        "val_dl": DataLoader(data, batch_size=8),
    }
    for cell in (
        "tr.fit(model, train_dl, val_dl)",
        "tr.fit(model, val_dataloaders=val_dl, train_dataloaders=train_dl)",
    ):
        guess = loader_batch(cell, ns, None)
        assert guess == BatchGuess(
            "train_dl.batch_size", 4, "loader", ("tr.accumulate_grad_batches", 1), path=("train_dl",)
        )
    assert loader_batch("tr.fit(model, val_dataloaders=val_dl)", ns, None) is None
    # A trainer the cell makes is made again by every run: no setting of the old one holds.
    assert loader_batch("tr = make_trainer()\ntr.fit(model, train_dl)", ns, None) is None


SHORT_LAST = """\
b = 4
for it in range(3):
    xb = X[it * b:(it + 1) * b]
    loss = ((net(xb) - xb.sum(1, keepdim=True)) ** 2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
"""


def test_micro_batches_of_sliced_rows_make_the_same_update_also_where_the_last_slice_is_short():
    def run(cell: str) -> torch.Tensor:
        torch.manual_seed(0)
        net = torch.nn.Linear(3, 1)
        ns = {"X": torch.randn(10, 3), "net": net, "opt": torch.optim.SGD(net.parameters(), lr=0.1)}
        exec(cell, ns)
        return net.weight.detach()

    step = whole_step(SHORT_LAST)
    new = micro_batch_source(SHORT_LAST, tuple(n for n, _ in step.sizes), 4, 3)
    # The third slice has 2 rows: split by 3 gives one micro-batch of 2, no empty one.
    assert "for xb_rows in xb.split(3):" in new, new
    torch.testing.assert_close(run(new), run(SHORT_LAST))


def test_an_accumulation_beside_a_batch_read_from_a_dict_is_scaled_with_it():
    cell = OWN_LITERAL.replace("batch_size=1024", 'batch_size=cfg["batch_size"]')
    guess = BatchGuess("cfg['batch_size']", 1024, "expression", path=("cfg", "batch_size"))
    new = rewrite_batch(cell, guess, 256, accumulate=4)
    assert "batch_size=256" in new and "(j + 1) % 8 == 0" in new and "/ 2 / 4" in new, new
