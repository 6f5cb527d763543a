"""A Hugging Face Trainer whose TrainingArguments were made in an earlier cell: the `%%gpumem` cell is only
`trainer.train()`, so the batch lives in `trainer.args`. The batch fix sets the trainer's own settings
(batch and gradient accumulation), the trials put them back, and the accepted run keeps them."""

from __future__ import annotations

import pytest

import oommagic
from oommagic.run.session import session_for

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

SETUP = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=128)
model = GPT2LMHeadModel(config)
data = [{"input_ids": torch.randint(0, 500, (128,)), "labels": torch.randint(0, 500, (128,))}
        for _ in range(64)]
args = TrainingArguments(output_dir="/tmp/oommagic-trainer-test", per_device_train_batch_size=32, max_steps=2,
                         report_to=[], logging_strategy="no", save_strategy="no", use_cpu=True,
                         dataloader_pin_memory=False)
trainer = Trainer(model=model, args=args, train_dataset=data)
"""


@pytest.fixture
def accelerate_state():
    yield
    # The Trainer made an Accelerator in this process, whose state outlives the test in the session's
    # shell; accelerate's notebook_launcher (tests/run/test_ranks.py) refuses to start in a process that
    # has one, as in a notebook. Gone again, as in a fresh kernel.
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


@pytest.mark.usefixtures("accelerate_state")
def test_a_trainer_made_earlier_gets_its_batch_and_accumulation_settings(shell, run_cell):
    shell.run_cell(SETUP)
    # Size the emulated card from a run at batch 2: half again what it needed, so batch 32 overruns.
    shell.run_cell("trainer.args.per_device_train_batch_size = trainer._train_batch_size = 2")
    run_cell("%%gpumem --quiet -o probe\ntrainer.train()\n")
    shell.run_cell("trainer.args.per_device_train_batch_size = trainer._train_batch_size = 32")
    limit = int(shell.user_ns["probe"].peak_reserved * 1.5) // 2**20
    run_cell(f"%%gpumem --limit {limit}MiB --quiet --no-raise --plan-budget 120\ntrainer.train()\n")
    run = oommagic.history()[-1]
    assert run.outcome == "oom", run.headline()
    guess = run.context.batch
    assert (guess.name, guess.value, guess.where) == (
        "trainer.args.per_device_train_batch_size",
        32,
        "attribute",
    )
    assert shell.user_ns["trainer"].args.per_device_train_batch_size == 32, "the trials put the setting back"
    first = run.plan.recommended
    assert first is not None, [e.line() for e in run.plan.entries]
    batch = next(r for r in first.fixes if r.kind == "batch")
    new, acc = batch.params["new"], batch.params["accumulate"]
    assert new * acc == 32 and "accumulate" in batch.title
    fitted = session_for(shell).retry(run, first.fixes)
    assert fitted.outcome == "ok", fitted.headline()
    args = shell.user_ns["trainer"].args
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (new, acc)
    assert shell.user_ns["trainer"]._train_batch_size == new, "the batch the Trainer copied when it was made"
    # Removed again, the trainer's settings are the person's own.
    session_for(shell).remove(fitted, len(fitted.applied) - 1)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (32, 1)
