"""A Hugging Face Trainer's evaluation keeps every batch's predictions on the device until it ends: the
gathered logits grow with the evaluation set, so no smaller evaluation batch fits. The plan offers
``eval_accumulation_steps`` (the predictions go to the host every few batches, every one kept), written
where the run reads it: on a Trainer an earlier cell made, into the ``TrainingArguments(...)`` of a cell
that makes its Trainer, or on the arguments an earlier cell made. Each cell fails under ``--limit``; the
first fix offered is pressed, fits, and keeps every prediction (or the metrics read from them)."""

from __future__ import annotations

import pytest

from tests.run.work import failed_and_first

pytest.importorskip("transformers")
pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def fresh_accelerator(fresh_names):
    yield
    # The Trainer made an Accelerator in this process, whose state outlives the test (see
    # tests/run/test_trainer_settings.py): gone again, as in a fresh kernel.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def fails_then_first_fix(shell, run_cell, probe: str, cell: str, logits_per_batch: int, setting: str | None):
    """Size the emulated card from ``probe`` (one batch of the evaluation): its peak and one and a half
    batches' logits more, so the evaluation runs out once a few batches are gathered. Then the cell under
    that limit, and the report's first fix pressed as a person would. ``setting``: where the evaluation
    reads ``eval_accumulation_steps``, which the trials leave as it was."""
    before = set(shell.user_ns)
    run_cell(f"%%gpumem --quiet -o probe\n{probe}\n")
    for name in set(shell.user_ns) - before - {"probe"}:
        shell.user_ns.pop(name)  # the probe's predictions: held, they would be on the card before the cell
    limit = (shell.user_ns["probe"].peak_reserved + 1.5 * logits_per_batch) / 2**20
    failed, widget, first = failed_and_first(shell, run_cell, cell, limit)
    finding = next((f for f in failed.findings if f.key == "gathered"), None)
    assert finding is not None, [(f.key, f.evidence) for f in failed.findings]
    assert "smaller evaluation batch does not shrink them" in finding.evidence
    assert first.kind == "eval_accumulation", [e.line() for e in failed.plan.entries]
    assert failed.plan.recommended.verdict == "fits", failed.plan.recommended.line()
    if setting is not None:
        assert shell.ev(setting) is None, "the trials put the setting back"
    return failed, first.fixes[0], widget.click(first.kind)


MLM_SETUP = """
import torch
from transformers import BertConfig, BertForMaskedLM, Trainer, TrainingArguments
torch.manual_seed(0)
mlm = BertForMaskedLM(BertConfig(vocab_size=1500, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=64, max_position_embeddings=64))
sentences = torch.randint(0, 1500, (24, 24))
held_out = [{"input_ids": s, "labels": s} for s in sentences]


def masked_accuracy(p):
    return {"masked_acc": float((p.predictions.argmax(-1) == p.label_ids).mean())}


mlm_trainer = Trainer(
    model=mlm,
    args=TrainingArguments(output_dir="/tmp/oommagic-evalacc-mlm", per_device_eval_batch_size=8, report_to=[],
                           use_cpu=True, disable_tqdm=True, dataloader_pin_memory=False),
    eval_dataset=held_out,
    compute_metrics=masked_accuracy,
)
"""


def test_an_earlier_trainers_evaluate_with_metrics_gets_its_predictions_moved_to_the_host(shell, run_cell):
    shell.run_cell(MLM_SETUP)
    _, first, fitted = fails_then_first_fix(
        shell,
        run_cell,
        "mlm_trainer.evaluate(held_out[:8])",
        "scores = mlm_trainer.evaluate()\n",
        8 * 24 * 1500 * 4,
        "mlm_trainer.args.eval_accumulation_steps",
    )
    # Written on the Trainer the earlier cell made.
    assert first.new_source.startswith("mlm_trainer.args.eval_accumulation_steps = ")
    assert fitted.outcome == "ok", fitted.headline()
    assert "eval_masked_acc" in shell.user_ns["scores"], shell.user_ns["scores"]
    steps = first.params["steps"]
    assert shell.user_ns["mlm_trainer"].args.eval_accumulation_steps == steps


CAUSAL_SETUP = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
lm = LlamaForCausalLM(LlamaConfig(vocab_size=1200, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64))
prompts = torch.randint(0, 1200, (24, 20))
test_rows = [{"input_ids": p, "labels": p} for p in prompts]
"""

CAUSAL_CELL = """\
from transformers import Trainer, TrainingArguments
scorer = Trainer(
    model=lm,
    args=TrainingArguments(output_dir="/tmp/oommagic-evalacc-lm", per_device_eval_batch_size=6, report_to=[],
                           use_cpu=True, disable_tqdm=True, dataloader_pin_memory=False),
)
out = scorer.predict(ROWS)
"""


def test_a_trainer_made_in_the_cell_gets_the_setting_in_its_training_arguments(shell, run_cell):
    shell.run_cell(CAUSAL_SETUP)
    _, first, fitted = fails_then_first_fix(
        shell,
        run_cell,
        CAUSAL_CELL.replace("ROWS", "test_rows[:6]"),
        CAUSAL_CELL.replace("ROWS", "test_rows"),
        6 * 20 * 1200 * 4,
        None,  # the cell makes `scorer` anew: the failed attempt's one was dropped with its memory
    )
    # Written where the cell makes the object: a setting on the old `scorer` would be lost to the new one.
    assert "scorer.args" not in first.new_source
    assert "dataloader_pin_memory=False, eval_accumulation_steps=" in first.new_source.replace("\n", " ")
    assert fitted.outcome == "ok", fitted.headline()
    assert shell.user_ns["out"].predictions.shape == (24, 20, 1200), "every row's logits kept"


S2S_SETUP = """
import torch
from transformers import Seq2SeqTrainer, Seq2SeqTrainingArguments, T5Config, T5ForConditionalGeneration
torch.manual_seed(0)
t5 = T5ForConditionalGeneration(T5Config(vocab_size=1000, d_model=32, d_kv=8, d_ff=64, num_layers=1,
                                         num_decoder_layers=1, num_heads=2, decoder_start_token_id=0))
pairs = [{"input_ids": torch.randint(0, 1000, (12,)), "labels": torch.randint(0, 1000, (16,))}
         for _ in range(20)]
s2s_args = Seq2SeqTrainingArguments(output_dir="/tmp/oommagic-evalacc-s2s", per_device_eval_batch_size=5,
                                    report_to=[], use_cpu=True, disable_tqdm=True,
                                    dataloader_pin_memory=False)
"""

S2S_CELL = """\
summarizer = Seq2SeqTrainer(model=t5, args=s2s_args)
result = summarizer.predict(ROWS)
"""


def test_a_trainer_made_in_the_cell_from_earlier_arguments_gets_a_line_on_those_arguments(shell, run_cell):
    shell.run_cell(S2S_SETUP)
    _, first, fitted = fails_then_first_fix(
        shell,
        run_cell,
        S2S_CELL.replace("ROWS", "pairs[:5]"),
        S2S_CELL.replace("ROWS", "pairs"),
        5 * 16 * 1000 * 4,
        "s2s_args.eval_accumulation_steps",
    )
    assert shell.user_ns["s2s_args"].eval_accumulation_steps == first.params["steps"]
    assert first.new_source.startswith("s2s_args.eval_accumulation_steps = ")
    assert fitted.outcome == "ok", fitted.headline()
    logits = shell.user_ns["result"].predictions[0]
    assert logits.shape == (20, 16, 1000), "every row's logits kept"
