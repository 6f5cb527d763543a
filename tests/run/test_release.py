"""Which names a failed cell bound: the object each name held before the cell, told apart from a new one
that CPython put at the same address."""

from __future__ import annotations

import gc

import torch

from oommagic.run.release import drop_bound_by_cell, identities, same_binding


class Output:
    """Like a model's output: a small object that holds a large tensor (and, in training, its graph)."""

    def __init__(self, n: int) -> None:
        self.logits = torch.zeros(n)


def test_a_new_object_at_the_address_of_the_one_bound_before_is_a_new_binding():
    ns = {"out": Output(4), "n": 4}
    before = identities(ns)
    kept = ns["out"]
    assert same_binding(before["out"], kept)
    del kept
    ns["out"] = None
    gc.collect()
    # The object bound before is gone; whatever now sits at its address is another one.
    new = Output(4)
    stale = (id(new), before["out"][1])
    assert stale[1]() is None
    assert not same_binding(stale, new)
    # Values that take no weak reference are compared by identity alone.
    assert same_binding(before["n"], ns["n"])


def test_a_name_rebound_in_a_loop_is_dropped_even_where_its_object_reuses_the_address():
    ns = {"out": Output(4)}
    before = identities(ns)
    ns["out"] = Output(2**16)  # a loop of the cell: `out = model(x)`, the first rebinding frees the old
    gc.collect()
    assert before["out"][1]() is None
    # Whether CPython gives the new object the freed address depends on its allocator's state; put the
    # case that happened (1.4 GiB kept in a notebook) in place rather than wait for it.
    before["out"] = (id(ns["out"]), before["out"][1])
    dropped = drop_bound_by_cell(ns, before, "cpu")
    assert "out" not in ns and dropped == [("out", 2**16 * 4)]
