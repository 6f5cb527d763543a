"""The table of fix kinds: every kind a builder makes has its row and every row is made somewhere, an
unknown kind is refused, the tiers order fixes by what they change, and a rewrite made again from a
remedy's params is the rewrite the builder made."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from oommagic.diagnosis import kinds
from oommagic.diagnosis.findings import Remedy
from oommagic.diagnosis.kinds import COMPUTED, NUMERICS, SAME, UnknownFixKind, kind_of, rewrite_again, tier

DIAGNOSIS = Path(kinds.__file__).parent


def kinds_built() -> set[str]:
    """The kinds named by the builders' own calls (``_made(fig, "batch", ...)``, ``Remedy("batch", ...)``,
    ``Remedy(kind="batch", ...)``, and the generation keyword a rule passes ``generate_keyword``, which is
    its kind) anywhere in the diagnosis."""
    found = set()
    for path in DIAGNOSIS.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, (ast.Name, ast.Attribute)):
                continue
            func = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
            args = {"_made": node.args[1:2], "Remedy": node.args[:1], "generate_keyword": node.args[2:3]}.get(
                func
            )
            if args is None:
                continue
            args = args + [k.value for k in node.keywords if k.arg == "kind"]
            found |= {a.value for a in args if isinstance(a, ast.Constant) and isinstance(a.value, str)}
    return found


def test_every_kind_a_builder_makes_has_one_row_and_every_row_is_made():
    built = kinds_built()
    assert built, "the builders' calls were not found"
    assert built - set(kinds.KINDS) == set()
    assert set(kinds.KINDS) - built == set()


def test_an_unknown_kind_is_refused_with_the_known_ones_named():
    with pytest.raises(UnknownFixKind, match=r"'smaller_model' is not a kind of fix oommagic knows.*batch"):
        kind_of(Remedy("smaller_model", "Use a smaller model", automatic=True))


def test_tiers_say_what_a_fix_changes_beyond_memory():
    kept = Remedy("batch", "Batch 64 → 16, accumulate 4 steps", params={"keeps_effective": True})
    smaller = Remedy("batch", "Batch 64 → 16", params={"keeps_effective": False})
    assert tier(kept) == SAME  # the same samples per optimizer step
    assert tier(smaller) == COMPUTED
    assert tier(Remedy("autocast", "bfloat16 autocast")) == NUMERICS
    assert tier(Remedy("truncate", "max_length 512", params={"outlier": True})) == SAME
    assert tier(Remedy("truncate", "max_length 512")) == COMPUTED


def test_rows_that_cannot_be_tried_here_act_outside_the_process():
    untried = {name for name, row in kinds.KINDS.items() if not row.trial}
    assert untried == {
        "other_gpu",
        "multi_gpu",
        "launch_blocking",
        "shutdown_kernel",
        "max_split_size",
        "offload",
    }


def test_a_checkpointing_rewrite_is_made_again_after_another_fix_is_removed():
    source = "args = TrainingArguments(output_dir='out', per_device_train_batch_size=8)\ntrainer.train()\n"
    remedy = Remedy("checkpointing", "Gradient checkpointing", automatic=True, new_source="(rewritten)")
    again = rewrite_again(source, remedy)
    assert "gradient_checkpointing=True" in again
    assert again.endswith("trainer.train()\n")


def test_a_fix_without_a_rewrite_leaves_the_source_as_it_is():
    source = "loss = model(x).sum()\nloss.backward()\n"
    assert rewrite_again(source, Remedy("autocast", "bfloat16 autocast", automatic=True)) == source


def test_eval_accumulation_is_written_where_the_run_reads_it_and_made_again_from_its_params():
    from oommagic.diagnosis.findings import Gathered
    from oommagic.diagnosis.remedies import accumulation_target

    made_here = (
        "trainer = Trainer(model=model, args=TrainingArguments(**cfg, per_device_eval_batch_size=16))\n"
        "pred = trainer.predict(test_ds)\n"
    )
    earlier = Gathered("evaluate", 4096, 2, 32, trainer="trainer", args="args")
    # The cell makes its Trainer (and the namespace binds the one of the failed attempt): its arguments' call.
    assert accumulation_target(made_here, earlier) == "call"
    # A Trainer of an earlier cell: its own arguments; one made from an earlier cell's arguments: those.
    assert accumulation_target("metrics = trainer.evaluate()\n", earlier) == "trainer.args"
    from_args = "t = Seq2SeqTrainer(model=m, args=args)\nt.predict(ds)\n"
    assert accumulation_target(from_args, Gathered("predict", 4096, 2, 32, args="args")) == "args"
    assert accumulation_target(from_args, Gathered("predict", 4096, 2, 32)) is None

    remedy = Remedy(
        "eval_accumulation",
        "eval_accumulation_steps=2",
        params={"steps": 2, "target": "call"},
        new_source="x",
    )
    again = rewrite_again(made_here, remedy)
    assert "TrainingArguments(**cfg, per_device_eval_batch_size=16, eval_accumulation_steps=2)" in again
    on_trainer = Remedy(
        "eval_accumulation", "", params={"steps": 1, "target": "trainer.args"}, new_source="x"
    )
    assert rewrite_again("trainer.evaluate()\n", on_trainer).startswith(
        "trainer.args.eval_accumulation_steps = 1"
    )
    assert tier(remedy) == SAME
