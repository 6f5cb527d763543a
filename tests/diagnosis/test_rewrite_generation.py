"""How a cell's generation is rewritten, on text: a generate() setting written where the call takes it from
(its keyword, the dict the cell makes, or one merged spread: never passed twice), a notebook function's
calls run on chunks of their batch, and the helper those calls use joining every row back in order."""

from __future__ import annotations

import ast

import pytest
import torch

from oommagic.diagnosis.findings import Remedy
from oommagic.diagnosis.kinds import rewrite_again
from oommagic.diagnosis.rewrite_generation import (
    IN_CHUNKS,
    set_generation_setting,
    split_calls_source,
    split_generate_source,
)


def calls_of(source: str) -> list[ast.Call]:
    return [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.Call) and getattr(n.func, "attr", "") == "generate"
    ]


def test_a_setting_in_a_dict_the_cell_makes_is_changed_there():
    cell = "settings = dict(num_beams=8, max_new_tokens=64)\nout = model.generate(ids, **settings)\n"
    new = set_generation_setting(cell, "max_new_tokens", 32, ("num_beams", "max_new_tokens"))
    assert new == "settings = dict(num_beams=8, max_new_tokens=32)\nout = model.generate(ids, **settings)\n"
    shown = '{"num_beams": 8}\n'
    new = set_generation_setting("cfg = " + shown + "out = m.generate(x, **cfg)\n", "num_beams", 4)
    assert new.startswith('cfg = {"num_beams": 4}\n')


def test_a_setting_in_a_dict_of_an_earlier_cell_is_overridden_after_the_spread_not_passed_twice():
    cell = "out = model.generate(input_ids=src, attention_mask=m, **gen_kwargs)\n"
    new = set_generation_setting(cell, "max_new_tokens", 64, ("num_beams", "max_new_tokens"))
    assert (
        new
        == "out = model.generate(input_ids=src, attention_mask=m, **{**gen_kwargs, 'max_new_tokens': 64})\n"
    )
    # Two spreads become one, the setting after both: whichever held it, it is given once.
    two = set_generation_setting("out = m.generate(**enc, **gen)\n", "num_beams", 2)
    assert two == "out = m.generate(**{**enc, **gen, 'num_beams': 2})\n"
    (call,) = calls_of(two)
    assert [k.arg for k in call.keywords] == [None]


def test_a_setting_the_call_did_not_receive_is_added_as_a_keyword_beside_the_spread():
    cell = "out = m.generate(ids, **sampling)\n"
    assert set_generation_setting(cell, "max_new_tokens", 16, ("do_sample",)) == (
        "out = m.generate(ids, **sampling, max_new_tokens=16)\n"
    )
    assert set_generation_setting("out = m.generate(ids, num_beams=8)\n", "num_beams", 4) == (
        "out = m.generate(ids, num_beams=4)\n"
    )
    assert set_generation_setting("x = 1\n", "num_beams", 4) is None


def test_a_keyword_fix_made_again_on_the_cell_writes_it_the_same_way():
    cell = "out = model.generate(src, **gen_kwargs)\n"
    new = set_generation_setting(cell, "num_beams", 4, ("num_beams",))
    remedy = Remedy(
        "num_beams",
        "t",
        params={"keyword": "num_beams", "old": 8, "new": 4, "given": ["num_beams"]},
        new_source=new,
    )
    assert rewrite_again(cell, remedy) == new


def test_a_notebook_functions_calls_run_on_chunks_of_their_batch():
    cell = "completions = greedy(lm, prompts.to(device), 64)\nprint(completions.shape)\n"
    new = split_calls_source(cell, "greedy", 8, taken={"in_chunks"})
    assert "def in_chunks_(func, chunk, *args, **kwargs):" in new
    assert "completions = in_chunks_(greedy, 8, lm, prompts.to(device), 64)\n" in new
    assert split_calls_source(cell, "decode", 8) is None
    remedy = Remedy("split_calls", "t", params={"func": "greedy", "chunk": 8, "batch": 32}, new_source=new)
    assert rewrite_again(cell, remedy) == new


def helper(source: str, name: str):
    scope: dict = {}
    exec(compile(source, "<helper>", "exec"), scope)
    return scope[name]


def test_the_chunk_helper_keeps_every_row_in_order_in_each_shape_of_result():
    in_chunks = helper(IN_CHUNKS, "in_chunks")
    x = torch.arange(10).reshape(10, 1)
    mask = torch.ones(10, 3)
    weight = torch.ones(4, 4)  # not as many rows as the batch (its first tensor): passed whole
    seen = []

    def model_like(ids, w, attention_mask=None, steps=2):
        seen.append((ids.shape[0], attention_mask.shape[0], w.shape[0]))
        return ids * steps, [int(i) for i in ids[:, 0]], {"ids": ids}

    ids, rows, out = in_chunks(model_like, 4, x, weight, attention_mask=mask, steps=3)
    assert seen == [(4, 4, 4), (4, 4, 4), (2, 2, 4)]
    assert torch.equal(ids, x * 3) and rows == list(range(10)) and torch.equal(out["ids"], x)


def test_the_generate_helper_pads_outputs_of_different_lengths_with_the_pad_token():
    source = split_generate_source("out = model.generate(ids)\n", 2)
    generate_in_chunks = helper(source.split("\n\nout =")[0], "generate_in_chunks")

    def generate(ids, pad_token_id=None):
        return torch.cat([ids, torch.full((ids.shape[0], 1 + int(ids[0, 0])), 7)], dim=1)

    ids = torch.tensor([[0], [0], [1], [1]])
    out = generate_in_chunks(generate, 2, ids, pad_token_id=5)
    assert out.tolist() == [[0, 7, 5], [0, 7, 5], [1, 7, 7], [1, 7, 7]]


@pytest.mark.parametrize("chunk", [1, 3, 16])
def test_the_chunk_helper_gives_the_unchunked_result_whatever_the_chunk(chunk):
    in_chunks = helper(IN_CHUNKS, "in_chunks")
    x = torch.randn(7, 5)
    assert torch.equal(in_chunks(lambda t: t.softmax(-1), chunk, x), x.softmax(-1))


def test_the_chunk_helper_refuses_results_without_a_row_per_prompt():
    in_chunks = helper(IN_CHUNKS, "in_chunks")
    x = torch.randn(8, 4)
    with pytest.raises(ValueError, match="not a row per prompt"):
        in_chunks(lambda t: t.sum(), 4, x)
    with pytest.raises(ValueError, match="do not have a row per prompt"):
        in_chunks(lambda t: t.mean(0), 3, x)  # a mean over the rows: 4 values for 3, 3 and 2 rows
    # Several rows per prompt (sequences returned per prompt) are rows in order.
    assert torch.equal(in_chunks(lambda t: t.repeat_interleave(2, 0), 3, x), x.repeat_interleave(2, 0))
