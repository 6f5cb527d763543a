"""The first offered fix fits, in shapes the scenario suite found without one: an evaluation loop whose batch
is a plain variable of the cell, a Trainer evaluated with the batch set in an earlier cell, and a model
whose float32 weights do not fit while it is being built. Each: the cell fails under ``--limit``, the
report widget's first fix is the one that matters, and clicking it gives a run that fits."""

from __future__ import annotations

import copy

import pytest
import torch

import oommagic
from oommagic.diagnosis.rewrite import default_dtype_source
from oommagic.diagnosis.source import BatchGuess
from oommagic.run.capture import LEDGER
from oommagic.run.session import session_for
from oommagic.view.widget import ReportWidget
from tests.run.work import counted, failed_and_first

pytestmark = pytest.mark.usefixtures("fresh_names")


def first_click(limit_mib: float, cell: str, shell, run_cell):
    """The cell failed under the limit, then the report's first fix pressed (the widget a person sees;
    ``--quiet`` only keeps it off the screen)."""
    failed, widget, first = failed_and_first(shell, run_cell, cell, limit_mib)
    return failed, first, widget.click(first.kind)


EVAL_LOOP = """\
batch_size = 64
sums = []
with torch.no_grad():
    for i in range(0, len(rows), batch_size):
        hidden = encoder(rows[i:i + batch_size])
        sums.append(hidden.sum(1).cpu())
"""


def test_an_evaluation_loop_gets_its_own_batch_halved_and_fits(shell, run_cell):
    shell.run_cell(
        "torch.manual_seed(0)\n"
        "encoder = torch.nn.Sequential(\n"
        "    torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))\n"
        "rows = torch.randn(256, 32, 256)"
    )
    run_cell("%%gpumem --quiet -o probe\n" + EVAL_LOOP.replace("64", "8"))
    probe = shell.user_ns["probe"]
    # Room for batch 8 and a half again: batch 64 does not fit, a smaller one does.
    limit = (probe.before_allocated + 1.5 * (probe.peak_allocated - probe.before_allocated)) / 2**20
    failed, fix, fitted = first_click(limit, EVAL_LOOP, shell, run_cell)
    ev = next(f for f in failed.findings if f.key == "activations")
    assert "evaluation" in ev.evidence and "whose batch is batch_size" in ev.evidence, ev.evidence
    assert fix.kind == "batch" and "effective batch" not in fix.title, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    assert fitted.applied[0].params["new"] < 64
    assert "batch_size = 64" not in fitted.source


WEIGHTS = """\
model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(12)]).to(device)
with torch.no_grad():
    out = model(torch.randn(4, 512, device=device))
"""


def test_a_model_too_large_in_float32_while_it_is_built_gets_bfloat16_weights(shell, run_cell):
    shell.user_ns["device"] = "cpu"
    weights = 12 * (512 * 512 + 512) * 4
    limit = (LEDGER.allocated + 0.75 * weights) / 2**20  # float32 weights 4/3 of the card, bfloat16 2/3
    failed, fix, fitted = first_click(limit, WEIGHTS, shell, run_cell)
    found = next(f for f in failed.findings if f.key == "weights")
    assert "built on the failing line" in found.evidence, found.evidence
    assert fix.kind == "quantize" and fix.title == "bfloat16 weights"
    assert fitted.outcome == "ok", fitted.headline()
    assert shell.user_ns["model"][0].weight.dtype == torch.bfloat16
    assert torch.get_default_dtype() == torch.float32, "the default dtype is put back after the line"
    assert "torch.set_default_dtype(torch.bfloat16)" in fitted.source


def test_the_default_dtype_rewrite_wraps_the_one_statement_and_puts_the_dtype_back():
    source = "x = 1\nfor i in range(2):\n    model = Net(\n        4).to(device)\n    y = model(x)\n"
    new = default_dtype_source(source, line=4)
    assert new == (
        "import torch\nx = 1\nfor i in range(2):\n"
        "    torch.set_default_dtype(torch.bfloat16)\n    try:\n"
        "        model = Net(\n            4).to(device)\n"
        "    finally:\n        torch.set_default_dtype(torch.float32)\n    y = model(x)\n"
    )
    # Found again by its text on a cell another fix changed.
    again = default_dtype_source("z = 0\n" + source, statement="model = Net(")
    assert again is not None and again.count("set_default_dtype") == 2
    assert default_dtype_source(source, line=99) is None


TRAINER = """
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments
torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=2000, n_positions=128)
model = GPT2LMHeadModel(config)
data = [{"input_ids": torch.randint(0, 2000, (128,)), "labels": torch.randint(0, 2000, (128,))}
        for _ in range(64)]
args = TrainingArguments(output_dir="/tmp/oommagic-eval-test", per_device_train_batch_size=4,
                         per_device_eval_batch_size=2, report_to=[], logging_strategy="no",
                         save_strategy="no", use_cpu=True, dataloader_pin_memory=False)
trainer = Trainer(model=model, args=args, eval_dataset=data)
"""


def test_a_trainer_evaluated_with_an_earlier_cells_settings_gets_its_eval_batch_changed(shell, run_cell):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    shell.run_cell(TRAINER)
    run_cell("%%gpumem --quiet -o probe\ntrainer.evaluate()\n")
    probe = shell.user_ns["probe"]
    shell.run_cell("trainer.args.per_device_eval_batch_size = 32")
    limit = (probe.before_allocated + 4 * (probe.peak_allocated - probe.before_allocated)) / 2**20
    _, fix, fitted = first_click(limit, "trainer.evaluate()\n", shell, run_cell)
    params = fix.fixes[0].params
    assert fix.kind == "batch" and params["name"] == "trainer.args.per_device_eval_batch_size", params
    assert fitted.outcome == "ok", fitted.headline()
    args = shell.user_ns["trainer"].args
    assert args.per_device_eval_batch_size < 32 and args.per_device_train_batch_size == 4


# The batch written other ways people write it: a key of a settings dict, a loop's literal step.
DICT_LOOP = EVAL_LOOP.replace("batch_size = 64\n", "").replace("batch_size", 'S["batch"]')
STEP_LOOP = EVAL_LOOP.replace("batch_size = 64\n", "").replace("batch_size", "64")


@pytest.mark.parametrize("cell", [DICT_LOOP, STEP_LOOP], ids=["dict-key", "literal-step"])
def test_a_batch_read_from_a_dict_or_written_as_a_loop_step_is_rewritten_and_fits(shell, run_cell, cell):
    shell.run_cell(
        "torch.manual_seed(0)\n"
        "encoder = torch.nn.Sequential(\n"
        "    torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))\n"
        "rows = torch.randn(256, 32, 256)\nS = {'batch': 64}"
    )
    run_cell("%%gpumem --quiet -o probe\n" + STEP_LOOP.replace("64", "8"))
    probe = shell.user_ns["probe"]
    limit = (probe.before_allocated + 1.5 * (probe.peak_allocated - probe.before_allocated)) / 2**20
    failed, fix, fitted = first_click(limit, cell, shell, run_cell)
    assert failed.context.batch.value == 64
    assert fix.kind == "batch", fix.title
    assert fitted.outcome == "ok", fitted.headline()
    new = fitted.applied[0].params["new"]
    assert f"range(0, len(rows), {new})" in fitted.source and f"rows[i:i + {new}]" in fitted.source
    assert shell.user_ns["S"] == {"batch": 64}, "the settings dict is the person's own"


def test_batch_expressions_and_steps_are_read_from_the_cell():
    from oommagic.diagnosis.source import batch_expressions, step_batch

    src = 'for i in range(0, n, cfg.train.batch_size):\n    f(x[i:i + S["bs"]], opts["lr"], cfg.batch_size)\n'
    assert batch_expressions(src) == (("cfg", "train", "batch_size"), ("S", "bs"), ("cfg", "batch_size"))
    assert step_batch("for i in range(0, len(x), 32):\n    y = x[i:i + 32]\n").value == 32
    # A step that no slice uses is not a batch.
    assert step_batch("for i in range(0, 100, 32):\n    print(i)\n") is None


def test_a_step_batch_rewrite_also_sizes_the_data_the_loop_makes_beside_its_slices():
    from oommagic.diagnosis.rewrite import rewrite_batch
    from oommagic.diagnosis.source import step_batch

    gan = (
        "for i in range(0, 4096, 1024):\n"
        "    real = real_data[i:i + 1024]\n"
        "    z = torch.randn(1024, 128)\n"
        "    loss = bce(D(real), torch.ones(1024, 1)) + bce(D(G(z)), torch.zeros((1024, 1)))\n"
        "    w = torch.randn(128, 1024)\n"
    )
    guess = step_batch(gan)
    assert guess is not None and guess.value == 1024
    assert rewrite_batch(gan, guess, 256) == (
        "for i in range(0, 4096, 256):\n"
        "    real = real_data[i:i + 256]\n"
        "    z = torch.randn(256, 128)\n"
        "    loss = bce(D(real), torch.ones(256, 1)) + bce(D(G(z)), torch.zeros((256, 1)))\n"
        "    w = torch.randn(128, 1024)\n"
    ), "the noise and the labels of each step follow; a 1024 that is no first dimension stays"


SYNTHETIC = """\
for step in range(3):
    x = torch.randn(64, 256, 256)
    labels = torch.randint(0, 4, (64,))
    loss = torch.nn.functional.cross_entropy(head(x).mean(1), labels)
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_data_made_in_the_loop_gets_its_first_dimension_as_the_batch(shell, run_cell):
    shell.run_cell(
        "torch.manual_seed(0)\nhead = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), "
        "torch.nn.Linear(1024, 4))\nopt = torch.optim.SGD(head.parameters(), lr=0.1)"
    )
    run_cell("%%gpumem --quiet -o probe\n" + SYNTHETIC.replace("64", "8"))
    probe = shell.user_ns["probe"]
    limit = (probe.before_allocated + 2 * (probe.peak_allocated - probe.before_allocated)) / 2**20
    failed, fix, fitted = first_click(limit, SYNTHETIC, shell, run_cell)
    assert failed.context.batch.where == "shape" and failed.context.batch.value == 64
    assert fix.kind == "batch", fix.title
    assert fitted.outcome == "ok", fitted.headline()
    new = fitted.applied[0].params["new"]
    assert f"torch.randn({new}, 256, 256)" in fitted.source and f"(0, 4, ({new},))" in fitted.source


def test_the_first_dimension_of_factory_calls_is_read_in_every_spelling():
    from oommagic.diagnosis.source import shape_batch, shape_literals

    for call, value in [
        ("torch.randn(32, 3)", 32),
        ("torch.zeros((16, 8), device=d)", 16),
        ("torch.randint(0, 9, (12, 5))", 12),
        ("torch.full((6, 2), 0.5)", 6),
        ("torch.empty(size=(24, 4))", 24),
    ]:
        guess = shape_batch(f"for _ in range(2):\n    x = {call}\n")
        assert guess is not None and guess.value == value, call
    assert shape_batch("x = torch.randn(32, 3)\n") is None, "outside a loop it is data, not a batch"
    # A name as the first dimension is the batch, whatever it is called: bound in the cell or the namespace.
    loop = "N = 48\nfor _ in range(2):\n    x = torch.randint(0, 9, (N, 400))\n"
    assert shape_batch(loop) == BatchGuess("N", 48, "source")
    assert shape_batch(loop.replace("N = 48\n", ""), {"N": 48}) == BatchGuess("N", 48, "namespace")
    assert shape_batch(loop.replace("N = 48\n", ""), {"N": 1}) is None
    assert shape_batch("N = 48\nN = 24\n" + loop.split("\n", 1)[1]) is None, "bound twice: not a clear batch"
    assert (
        len(shape_literals("a = torch.randn(8, 3)\nb = torch.randint(0, 2, (8,))\nc = torch.ones(3, 8)", 8))
        == 2
    )


def test_a_leftover_and_a_batch_too_large_get_both_fixes_in_one_click(shell, run_cell):
    # Made under the magic, so the CPU tracker counts them (as a GPU would).
    run_cell(
        "%%gpumem --quiet\ntorch.manual_seed(0)\n"
        "encoder = torch.nn.Sequential(\n"
        "    torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 256))\n"
        "rows = torch.randn(256, 32, 256)"
    )

    def growth(batch: int) -> int:
        run_cell("%%gpumem --quiet -o probe\n" + EVAL_LOOP.replace("64", str(batch)))
        probe = shell.user_ns["probe"]
        return probe.peak_allocated - probe.before_allocated

    one, full = growth(1), growth(64)
    shell.run_cell("del hidden, sums")  # the probes' last outputs: the limit counts from without them
    # An earlier cell's table, unused here, half of what batch 64 needs; beside it the card leaves less
    # than batch 1 needs: no batch alone fits, freeing the table alone leaves batch 64 short, both fit.
    run_cell(f"%%gpumem --quiet\ntable = torch.empty({full // 2}, dtype=torch.uint8)")
    limit = (LEDGER.allocated + 0.9 * one) / 2**20
    failed, fix, fitted = first_click(limit, EVAL_LOOP, shell, run_cell)
    kinds = [f.kind for f in ReportWidget(failed, session_for(shell)).fixes]
    assert fix.kind == "free_leftovers+batch", kinds
    assert fitted.outcome == "ok", fitted.headline()
    assert "table" not in shell.user_ns


LOADER_SETUP = """%%gpumem --quiet
torch.manual_seed(0)
from torch.utils.data import DataLoader, TensorDataset
clf = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 10))
clf_opt = torch.optim.SGD(clf.parameters(), lr=0.01)
clf_ds = TensorDataset(torch.randn(512, 64, 256), torch.randint(0, 10, (512,)))
train_loader = DataLoader(clf_ds, batch_size=128, shuffle=True, drop_last=True)
"""
LOADER_LOOP = """\
for xb, yb in train_loader:
    loss = torch.nn.functional.cross_entropy(clf(xb).mean(1), yb)
    loss.backward()
    clf_opt.step()
    clf_opt.zero_grad()
"""


def test_a_loader_made_in_an_earlier_cell_is_remade_with_a_smaller_batch(shell, run_cell):
    run_cell(LOADER_SETUP)
    old = shell.user_ns["train_loader"]
    failed, fix, fitted = first_click(60, LOADER_LOOP, shell, run_cell)
    guess = failed.context.batch
    assert (guess.name, guess.value, guess.where) == ("train_loader.batch_size", 128, "loader")
    assert fix.kind == "batch" and "accumulate" in fix.title, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    new = shell.user_ns["train_loader"]
    remedy = fitted.applied[0]
    assert new is not old and new.batch_size == remedy.params["new"] < 128
    # The same data, order and collation, the effective batch kept by the loop's accumulation.
    assert new.dataset is old.dataset and type(new.sampler) is type(old.sampler) and new.drop_last
    assert new.batch_size * remedy.params["accumulate"] == 128
    assert old.batch_size == 128, "the person's loader itself is left as it was"
    # The cell says what the kernel runs: it re-batches the loader itself, so running it again does the same.
    assert f"train_loader = oommagic.rebatched(train_loader, {new.batch_size})" in fitted.source


PREPARED_SETUP = (
    LOADER_SETUP
    + """from accelerate import Accelerator
accelerator = Accelerator(cpu=True)
clf, clf_opt, train_loader = accelerator.prepare(clf, clf_opt, train_loader)
"""
)


def test_a_loader_prepared_by_accelerate_gets_its_batch_sampler_cut_and_keeps_its_wrapper(shell, run_cell):
    pytest.importorskip("accelerate")
    run_cell(PREPARED_SETUP)
    old = shell.user_ns["train_loader"]
    assert getattr(old, "batch_size", None) is None, "the wrapper's batch lives in its batch sampler"
    failed, fix, fitted = first_click(60, LOADER_LOOP, shell, run_cell)
    guess = failed.context.batch
    assert (guess.name, guess.value, guess.where) == ("train_loader.batch_size", 128, "loader")
    assert fix.kind == "batch" and "accumulate" in fix.title, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    new = shell.user_ns["train_loader"]
    remedy = fitted.applied[0]
    assert type(new) is type(old) and new is not old
    assert len(next(iter(new))[0]) == remedy.params["new"] < 128
    assert remedy.params["new"] * remedy.params["accumulate"] == 128
    assert len(next(iter(old))[0]) == 128, "the person's loader itself is left as it was"


GEN_SETUP = """%%gpumem --quiet
import transformers
from transformers import GPT2Config, GPT2LMHeadModel
transformers.logging.set_verbosity_error()
torch.manual_seed(0)
config = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=500, n_positions=256)
gen_model = GPT2LMHeadModel(config).eval()
prompts = torch.randint(1, 500, (32, 16))
"""
GENERATE = """\
out = gen_model.generate(prompts, attention_mask=torch.ones_like(prompts), num_beams=4, max_new_tokens=16,
                         min_new_tokens=16, do_sample=False, pad_token_id=0)
"""


def test_a_generation_where_neither_greedy_nor_half_the_prompts_fit_gets_fewer_prompts_at_a_time(
    shell, run_cell
):
    pytest.importorskip("transformers")
    run_cell(GEN_SETUP)
    small = GENERATE.replace("num_beams=4", "num_beams=1").replace("prompts,", "prompts[:12],")
    run_cell(
        "%%gpumem --quiet -o probe\n"
        + small.replace("torch.ones_like(prompts)", "torch.ones_like(prompts[:12])")
    )
    probe = shell.user_ns["probe"]
    # Room for greedy search over 16 prompts: neither greedy search over 32 nor beams in chunks of 16 fit;
    # the chunks are halved until they do, the beams kept (the same results, where greedy changes them).
    limit = (probe.before_allocated + 1.5 * (probe.peak_allocated - probe.before_allocated)) / 2**20
    failed, fix, fitted = first_click(limit, GENERATE, shell, run_cell)
    greedy = [e for e in failed.plan.entries if e.fixes[0].kind == "num_beams" and len(e.fixes) == 1]
    assert all(e.verdict != "fits" for e in greedy), [e.line() for e in failed.plan.entries]
    assert fix.kind == "split_generate" and fix.verdict == "fits", (fix.kind, fix.verdict)
    assert fix.fixes[0].params["chunk"] <= 8, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    assert tuple(shell.user_ns["out"].shape) == (32, 16 + 16)


KEEPS_LOGITS = """\
all_logits = []
for i in range(0, len(rows), 16):
    logits = head(rows[i:i + 16])
    loss = logits.logsumexp(-1).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    all_logits.append(logits)
accuracy = (torch.cat(all_logits).argmax(-1) == labels).float().mean()
"""


def test_a_loop_keeping_logits_read_only_by_argmax_keeps_the_argmax_and_fits(shell, run_cell):
    # On the CPU a "host copy" (`.detach().cpu()`) is on the same device: only keeping less helps, and the
    # cell reads its logits only through argmax, so each step keeps that.
    shell.run_cell(
        "torch.manual_seed(0)\nhead = torch.nn.Linear(64, 4096)\n"
        "opt = torch.optim.SGD(head.parameters(), lr=0.1)\n"
        "rows = torch.randn(512, 64)\nlabels = torch.randint(0, 4096, (512,))"
    )
    step = 16 * 4096 * 4
    limit = (LEDGER.allocated + 2 * 4096 * 64 * 4 + 12 * step) / 2**20  # room for 12 of the 32 steps' logits
    failed, fix, fitted = first_click(limit, KEEPS_LOGITS, shell, run_cell)
    assert any(f.key in ("kept", "growth") for f in failed.findings), [f.key for f in failed.findings]
    assert fix.kind == "keep_numbers" and "logits.argmax(-1)" in fix.title, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    assert "all_logits.append(logits.argmax(-1))" in fitted.source
    assert "torch.cat(all_logits) == labels" in fitted.source
    assert shell.user_ns["all_logits"][0].shape == (16,)
    assert 0 <= float(shell.user_ns["accuracy"]) <= 1


SCORES = """\
classifier.eval()
all_scores = []
with torch.no_grad():
    for xb, yb in val_loader:
        all_scores.append(classifier(xb))
predicted = torch.cat(all_scores).argmax(dim=1)
"""


def test_class_scores_of_a_loader_read_by_argmax_over_dim_1_keep_the_argmax_and_fit(shell, run_cell):
    # Another shape: a conv classifier evaluated over a DataLoader, its 2-D scores reduced by `dim=1`.
    run_cell(
        "%%gpumem --quiet\nfrom torch.utils.data import DataLoader, TensorDataset\ntorch.manual_seed(0)\n"
        "classifier = torch.nn.Sequential(torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.ReLU(),\n"
        "    torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(256, 5000))\n"
        "images = torch.randn(2048, 3, 32, 32)\ntargets = torch.randint(0, 5000, (2048,))\n"
        "val_loader = DataLoader(TensorDataset(images, targets), batch_size=64)"
    )
    limit = (LEDGER.allocated + 0.4 * 2048 * 5000 * 4 + 8 * 2**20) / 2**20  # 40% of the scores kept
    failed, fix, fitted = first_click(limit, SCORES, shell, run_cell)
    assert any(f.key == "kept" for f in failed.findings), [f.key for f in failed.findings]
    assert fix.kind == "keep_numbers" and "classifier(xb).argmax(-1)" in fix.title, fix.title
    assert fitted.outcome == "ok", fitted.headline()
    assert "predicted = torch.cat(all_scores)\n" in fitted.source
    assert shell.user_ns["predicted"].shape == (2048,)


ADAM_SETUP = """%%gpumem --quiet
torch.manual_seed(0)
from torch.utils.data import DataLoader, TensorDataset
cfg = {"bs": 256, "lr": 1e-3}
wide_ds = TensorDataset(torch.randn(2048, 512), torch.randint(0, 10, (2048,)))
wide = torch.nn.Sequential(
    torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
    torch.nn.Linear(2048, 10))
"""
ADAM_LOOP = """\
loader = DataLoader(wide_ds, batch_size=cfg["bs"], shuffle=True)
opt = torch.optim.Adam(wide.parameters(), lr=cfg["lr"])
for xb, yb in loader:
    rows16 = xb.unsqueeze(1).expand(-1, 16, -1).reshape(-1, 512)
    loss = torch.nn.functional.cross_entropy(wide(rows16), yb.repeat_interleave(16))
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_batch_whose_probes_peak_in_the_optimizer_step_keeps_a_micro_batch_near_what_fit(shell, run_cell):
    # Adam's first step (its moments and its temporaries beside the weights and gradients) is the peak of
    # every probe, whatever the batch: the probes' line is flat and says nothing of the micro-batches'
    # own peak. The micro-batch comes from the largest probe that fit, checked by the rewritten cell's run,
    # not from that line (it said batch 1: 256 micro-batches of one sample).
    run_cell(ADAM_SETUP)
    failed, fix, fitted = first_click(130, ADAM_LOOP, shell, run_cell)
    assert fix.kind == "batch"
    assert fitted.outcome == "ok", fitted.headline()
    batch = next(r for r in fitted.applied if r.kind == "batch")
    assert batch.params["accumulate"] * batch.params["new"] == 256, batch.params
    assert batch.params["new"] >= 32, batch.params
    # The plan's peak counts the probe's optimizer step, not only the two micro-batches the rewritten cell
    # ran (which end before any step).
    entry = next(e for e in failed.plan.entries if e.kind == "batch")
    assert entry.peak > 0.9 * fitted.peak_reserved, (entry.peak, fitted.peak_reserved)


FOREACH_SETUP = """%%gpumem --quiet
torch.manual_seed(0)
layers = [torch.nn.Linear(256, 1024), torch.nn.GELU()]
for _ in range(6):
    layers += [torch.nn.Linear(1024, 1024), torch.nn.GELU()]
deep = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))
# foreach: torch's default for parameters on a GPU; on CPU it has to be asked for.
deep_opt = torch.optim.AdamW(deep.parameters(), lr=1e-4, foreach=True)
pairs = [(torch.randn(64, 256), torch.randint(0, 10, (64,))) for _ in range(4)]
"""
FOREACH_LOOP = """\
for xb, yb in pairs:
    loss = torch.nn.functional.cross_entropy(deep(xb), yb)
    loss.backward()
    deep_opt.step()
    deep_opt.zero_grad(set_to_none=True)
"""


def test_an_optimizer_step_that_runs_out_steps_one_tensor_at_a_time_and_fits(shell, run_cell):
    # 25 MiB of parameters: weights, gradients and AdamW's moments are 100 MiB; the foreach step's square
    # roots of the second moments are 25 MiB more at once, one tensor at a time 4 MiB. No batch size, no
    # precision, no checkpointing helps: the step is the peak.
    run_cell(FOREACH_SETUP)
    opt = shell.user_ns["deep_opt"]
    run_cell(f"%%gpumem --limit 116MiB --quiet --no-raise --plan-budget 60\n{FOREACH_LOOP}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    # The plan's trials put the setting back.
    assert all(g["foreach"] is True for g in opt.param_groups)
    finding = next(f for f in failed.findings if f.key == "optimizer_step")
    assert "deep_opt (AdamW, 25.07 MiB of parameters)" in finding.evidence, finding.evidence
    params = sum(p.nbytes for p in shell.user_ns["deep"].parameters())
    assert finding.remedies[0].saving == params - 4 * 2**20, "all the parameters less the largest"
    widget = ReportWidget(failed, session_for(shell))
    fix = widget.fixes[0]
    assert fix.kind == "step_per_tensor" and fix.verdict == "fits", widget.fixes
    fitted = widget.click(fix.kind)
    assert fitted.outcome == "ok", fitted.headline()
    assert fitted.source.startswith("for param_group in deep_opt.param_groups:"), fitted.source
    # The accepted run keeps it.
    assert all(g["foreach"] is False for g in opt.param_groups)


def test_the_optimizer_step_finding_needs_the_failure_in_the_step_and_a_foreach_optimizer(shell, run_cell):
    run_cell(FOREACH_SETUP.replace("foreach=True", "foreach=False"))
    run_cell(f"%%gpumem --limit 106MiB --quiet --no-raise --plan-budget 0\n{FOREACH_LOOP}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and "/torch/optim/" in "".join(f.file for f in failed.context.frames)
    assert not [f for f in failed.findings if f.key == "optimizer_step"], "already one tensor at a time"
    run_cell(FOREACH_SETUP)
    # Out of memory in the backward pass (the gradients): the step was never reached.
    run_cell(f"%%gpumem --limit 40MiB --quiet --no-raise --plan-budget 0\n{FOREACH_LOOP}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom"
    assert not any("/torch/optim/" in f.file for f in failed.context.frames)
    assert not [f for f in failed.findings if f.key == "optimizer_step"]


ROWS_SETUP = """%%gpumem --quiet
torch.manual_seed(0)
scorer = torch.nn.Sequential(
    torch.nn.Linear(128, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
    torch.nn.Linear(2048, 10)).eval()
X_test = torch.randn(8192, 128)
"""
ROWS_CELL = """\
with torch.no_grad():
    logits = scorer(X_test)
"""


def test_a_model_called_on_a_whole_tensor_without_grad_runs_on_chunks_of_rows_and_fits(shell, run_cell):
    # 8,192 rows through two 2048-wide layers at once: 112 MiB of activations beside 17 MiB of weights.
    run_cell(ROWS_SETUP)
    with torch.no_grad():
        expected = shell.user_ns["scorer"](shell.user_ns["X_test"])
    _, fix, fitted = first_click(80, ROWS_CELL, shell, run_cell)
    assert fix.kind == "split_rows" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok", fitted.headline()
    assert "torch.cat([scorer(rows) for rows in X_test.split(" in fitted.source, fitted.source
    assert torch.equal(shell.user_ns["logits"], expected), "the same results"


def test_a_model_called_on_a_whole_tensor_with_autograd_on_is_not_split(shell, run_cell):
    # Each chunk's graph would stay with the joined output: splitting saves nothing there.
    run_cell(ROWS_SETUP)
    run_cell("%%gpumem --limit 80MiB --quiet --no-raise --plan-budget 0\nlogits = scorer(X_test)\n")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.context.rows_call is not None
    assert "split_rows" not in {r.kind for f in failed.findings for r in f.remedies}
    assert "no_grad" in {r.kind for f in failed.findings for r in f.remedies}


EPOCH_SETUP = """%%gpumem --quiet
torch.manual_seed(0)
from torch.utils.data import DataLoader, TensorDataset
rows_ds = TensorDataset(torch.randn(4096, 512), torch.randint(0, 10, (4096,)))
mlp = torch.nn.Sequential(
    torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048), torch.nn.ReLU(),
    torch.nn.Linear(2048, 10))
"""
EPOCH_CELL = """\
def run_epoch(model, loader, opt):
    model.train()
    total = 0.0
    for xb, yb in loader:
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb.repeat_interleave(8, 0)), yb.repeat_interleave(8))
        loss.backward()
        opt.step()
        total += loss.item()
    return total / len(loader)

sgd = torch.optim.SGD(mlp.parameters(), lr=0.01, momentum=0.9)
rows_loader = DataLoader(rows_ds, batch_size=512, shuffle=True)
print(run_epoch(mlp, rows_loader, sgd))
"""


def test_an_accumulated_batch_is_checked_through_the_optimizers_step_and_stays_near_what_fits(
    shell, run_cell
):
    # After the first step each micro-batch's backward adds to gradients kept beside SGD's momentum (a
    # temporary per parameter as it adds): two micro-batches before any step passed at 64 of 512, and the
    # click ran out. Room for gradients the probes' peaks already held gave 4 × 128 steps instead (a click
    # twice as long); 16 × 32 fits here.
    run_cell(EPOCH_SETUP)
    _, fix, fitted = first_click(90, EPOCH_CELL, shell, run_cell)
    # The limit leaves the steady state a few MiB under it: verified within the budget, said "likely" where
    # that is less than the margin; either way the first entry and, pressed, it fits.
    assert fix.kind == "batch" and fix.verdict in ("fits", "likely fits"), fix
    assert fitted.outcome == "ok", fitted.headline()
    batch = next(r for r in fitted.applied if r.kind == "batch")
    assert batch.params["new"] * batch.params["accumulate"] == 512, batch.params
    assert batch.params["new"] >= 16, batch.params


TRAIN_HELPER = """%%gpumem --quiet
torch.manual_seed(0)
seqs = torch.randn(1024, 32, 256)
goals = torch.randn(1024, 32, 256)
enc = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256))
def train(model, epochs=1, bs=128):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(epochs):
        for i in range(0, len(seqs), bs):
            loss = torch.nn.functional.mse_loss(model(seqs[i:i + bs]), goals[i:i + bs])
            loss.backward()
            opt.step()
            opt.zero_grad()
"""


def test_a_batch_that_is_a_default_of_the_called_function_is_passed_smaller_with_accumulation(
    shell, run_cell
):
    # `train(enc)` leaves `bs=128` at its default: the fix passes the micro-batch to the call and writes
    # the accumulation into the function, redefined at the top of the cell.
    run_cell(TRAIN_HELPER)
    # `enc.train()` (a method of the same name) stays as it is; not the last line, so that no output
    # cache keeps the model after this module.
    run_cell("%%gpumem --limit 100MiB --quiet --no-raise --plan-budget 60\ntrain(enc)\nenc.train()\ndone = 1")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom" and failed.context.batch.where == "call", failed.context.batch
    widget = ReportWidget(failed, session_for(shell))
    assert "batch" in [f.kind for f in widget.fixes], [(f.kind, f.verdict) for f in widget.fixes]
    fitted = widget.click("batch")
    assert fitted.outcome == "ok", fitted.headline()
    batch = next(r for r in fitted.applied if r.kind == "batch")
    new, acc = batch.params["new"], batch.params["accumulate"]
    assert new * acc == 128 and acc > 1, batch.params
    assert f"train(enc, bs={new})" in fitted.source and "enc.train()" in fitted.source, fitted.source
    assert "def train(" in fitted.source, "the accumulation is written into the function"


def test_a_batch_default_is_not_read_where_the_call_passes_it_or_spreads_its_arguments():
    import types

    from oommagic.diagnosis.context import default_batch

    ns: dict = {}
    exec("def train(model, epochs=1, bs=128):\n    pass\ndef run(*, batch_size=64):\n    pass\n", ns)
    for f in ("train", "run"):
        ns[f] = types.FunctionType(ns[f].__code__, ns, f, ns[f].__defaults__)
        ns[f].__module__ = "__main__"
        ns[f].__kwdefaults__ = {"batch_size": 64} if f == "run" else None
    assert default_batch("train(m)", ns).path == ("train", "bs")
    assert default_batch("train(m)", ns).value == 128
    assert default_batch("run()", ns).path == ("run", "batch_size")
    for passed in ("train(m, 1, 32)", "train(m, bs=32)", "train(*xs)", "train(m, **kw)", "m.train()"):
        assert default_batch(passed, ns) is None, passed


HOST_DATA_SETUP = """\
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
ds = TensorDataset(torch.randn(2048, 64, 128), torch.randint(0, 10, (2048,)))
loader = DataLoader(ds, batch_size=512, shuffle=True)
net = nn.Sequential(nn.Flatten(), nn.Linear(64 * 128, 512), nn.ReLU(), nn.Linear(512, 10))
opt = torch.optim.Adam(net.parameters(), lr=1e-3)
"""
HOST_DATA_CELL = """\
for xb, yb in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(net(xb), yb).backward()
    opt.step()
"""


def test_a_loader_over_a_dataset_on_the_host_gets_its_batch_cut_and_fits(shell, run_cell):
    # The 64 MiB dataset was made outside %%gpumem: the samples the loader indexes out of it are views,
    # not the dataset on the card (which once left "not even batch 1 fits"). The model's 16 MiB of
    # weights, built in the same setup cell, are on the card from the cell's first use of them.
    run_cell(HOST_DATA_SETUP)
    failed, fix, fitted = first_click(100, HOST_DATA_CELL, shell, run_cell)
    counted = failed.categories
    assert counted["parameters"] >= 16 * 2**20, counted.parts
    assert all(a.nbytes < 64 * 2**20 for a in counted.top), "no sample counted as the whole dataset"
    assert fix.kind == "batch" and fix.verdict in ("fits", "likely fits"), fix
    assert fitted.outcome == "ok", fitted.headline()


def test_a_product_written_in_the_cell_too_large_for_the_card_runs_on_chunks_or_in_half_precision(
    shell, run_cell
):
    # 6,000 × 6,000 float32 similarities are 137 MiB, one request over a 100 MiB card; in bfloat16, 69 MiB.
    # `sims` is read once, by a reduction along its rows: chunks of rows with the reduction give the same
    # neighbours exactly, ahead of half precision, which is offered too.
    run_cell("torch.manual_seed(0)\nemb = torch.nn.functional.normalize(torch.randn(6000, 256), dim=1)")
    expected = (shell.user_ns["emb"][:30] @ shell.user_ns["emb"].T).topk(5, dim=1).indices
    cell = "sims = emb @ emb.T\nbest = sims.topk(5, dim=1).indices\n"
    failed, fix, fitted = first_click(100, cell, shell, run_cell)
    assert "too_large" in [f.key for f in failed.findings]
    assert fix.kind == "split_rows" and fix.verdict == "fits", fix
    assert "autocast" in [e.kind for e in failed.plan.entries]
    assert fitted.outcome == "ok" and shell.user_ns["best"].shape == (6000, 5), fitted.headline()
    assert torch.equal(shell.user_ns["best"][:30], expected)


NAMED_BATCH_SETUP = """\
torch.manual_seed(0)
tagger = torch.nn.Sequential(
    torch.nn.Embedding(1000, 64), torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 20)
)
tag_opt = torch.optim.Adam(tagger.parameters())
"""
NAMED_BATCH_CELL = """\
BATCH = 64
for step in range(2):
    x = torch.randint(0, 1000, (BATCH, 256))
    y = torch.randint(0, 20, (BATCH, 256))
    loss = torch.nn.functional.cross_entropy(tagger(x).flatten(0, 1), y.flatten())
    tag_opt.zero_grad()
    loss.backward()
    tag_opt.step()
"""


def test_a_batch_named_only_as_the_first_dimension_of_the_loops_data_is_cut_and_fits(shell, run_cell):
    # `BATCH` is no usual batch name: the loop's data made with it as their first dimension says it is.
    run_cell(NAMED_BATCH_SETUP)
    failed, fix, fitted = first_click(60, NAMED_BATCH_CELL, shell, run_cell)
    assert failed.context.batch == BatchGuess("BATCH", 64, "source")
    batch = next(e for e in failed.plan.entries if e.kind == "batch")
    assert batch.verdict == "fits" and "BATCH = " in (batch.fixes[-1].new_source or ""), batch
    assert fix.verdict == "fits" and fitted.outcome == "ok", fitted.headline()


def test_nearest_neighbours_over_a_distance_matrix_larger_than_the_card_run_on_chunks_and_fit(
    shell, run_cell
):
    # 4,000 queries × 20,000 points of float32 distances: one 305 MiB request over a 200 MiB card.
    run_cell("torch.manual_seed(0)\nXdb = torch.randn(20000, 64)\nXq = torch.randn(4000, 64)")
    expected = torch.cdist(shell.user_ns["Xq"][:50], shell.user_ns["Xdb"]).argmin(dim=1)
    cell = "nearest = torch.cdist(Xq, Xdb).argmin(dim=1)\n"
    _, fix, fitted = first_click(200, cell, shell, run_cell)
    assert fix.kind == "split_rows" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok", fitted.headline()
    assert "torch.cat([torch.cdist(rows, Xdb).argmin(dim=1) for rows in Xq.split(" in fitted.source
    assert torch.equal(shell.user_ns["nearest"][:50], expected), "the same neighbours"


def test_features_of_a_transformers_encoder_on_a_whole_tensor_run_on_chunks_of_rows_and_fit(shell, run_cell):
    pytest.importorskip("transformers")
    run_cell(
        "from transformers import GPT2Config, GPT2Model\n"
        "torch.manual_seed(0)\n"
        "config = GPT2Config(n_layer=2, n_embd=128, n_head=4, vocab_size=1000, n_positions=256)\n"
        "enc = GPT2Model(config).eval()\n"
        "ids = torch.randint(0, 1000, (1024, 128))\n"
    )
    with torch.no_grad():
        expected = shell.user_ns["enc"](input_ids=shell.user_ns["ids"][:8]).last_hidden_state.mean(dim=1)
    cell = "with torch.no_grad():\n    feats = enc(input_ids=ids).last_hidden_state.mean(dim=1)\n"
    _, fix, fitted = first_click(150, cell, shell, run_cell)
    assert fix.kind == "split_rows" and fix.verdict == "fits", fix
    assert (
        "torch.cat([enc(input_ids=rows).last_hidden_state.mean(dim=1) for rows in ids.split(" in fitted.source
    )
    assert fitted.outcome == "ok" and torch.allclose(shell.user_ns["feats"][:8], expected, atol=1e-5)


FULL_BATCH_SETUP = """%%gpumem --quiet
import copy
torch.manual_seed(0)
X_all = torch.randn(8192, 512)
y_all = torch.randint(0, 10, (8192,))
net = torch.nn.Sequential(
    torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
    torch.nn.Linear(1024, 10))
"""
FULL_BATCH_CELL = """\
opt = torch.optim.SGD(net.parameters(), lr=0.1)
for epoch in range(2):
    pred = net(X_all)
    loss = torch.nn.functional.cross_entropy(pred, y_all)
    opt.zero_grad()
    loss.backward()
    opt.step()
    accuracy = (pred.argmax(1) == y_all).float().mean().item()
"""


def test_a_step_on_a_whole_dataset_runs_on_micro_batches_and_makes_the_same_update(shell, run_cell):
    # Full-batch training: 8,192 rows through two 1024-wide layers hold about 130 MiB of activations
    # beside 10 MiB of weights and 10 MiB of gradients. The step on micro-batches adds up the same
    # gradients for the one optimizer step.
    run_cell(FULL_BATCH_SETUP)
    reference = copy.deepcopy(shell.user_ns["net"])
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(2):
        loss = torch.nn.functional.cross_entropy(reference(shell.user_ns["X_all"]), shell.user_ns["y_all"])
        opt.zero_grad()
        loss.backward()
        opt.step()
    failed, fix, fitted = first_click(70, FULL_BATCH_CELL, shell, run_cell)
    assert failed.context.batch == BatchGuess("rows", 8192, "rows", path=("X_all", "y_all"))
    assert fix.kind == "batch" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok", fitted.headline()
    assert "for X_all_rows, y_all_rows in zip(X_all.tensor_split(" in fitted.source, fitted.source
    assert fitted.source.count("opt.step()") == 1 and "(pred.argmax(1) == y_all_rows)" in fitted.source
    for got, want in zip(shell.user_ns["net"].parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


FULL_BATCH_FUNCTION = """\
def fit(model, X, y, epochs=2, lr=0.1):
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for epoch in range(epochs):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
    return loss.item()

last_loss = fit(net, X_all, y_all)
"""


def test_a_full_batch_training_function_defined_in_the_cell_gets_micro_batches_and_fits(shell, run_cell):
    run_cell(FULL_BATCH_SETUP)
    failed, fix, fitted = first_click(70, FULL_BATCH_FUNCTION, shell, run_cell)
    assert failed.context.batch == BatchGuess("rows", 8192, "rows", path=("X", "y"))
    assert fix.kind == "batch" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok" and "for X_rows, y_rows in zip(X.tensor_split(" in fitted.source
    assert isinstance(shell.user_ns["last_loss"], float)


def test_a_full_batch_training_function_from_an_earlier_cell_is_redefined_with_micro_batches(shell, run_cell):
    # `fit` was defined in an earlier cell; the failing cell only calls it.
    definition, call = FULL_BATCH_FUNCTION.split("\n\n")
    run_cell(FULL_BATCH_SETUP)
    run_cell(definition)
    failed, fix, fitted = first_click(70, call, shell, run_cell)
    assert failed.context.batch == BatchGuess("rows", 8192, "rows", path=("X", "y"))
    assert fix.kind == "batch" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok", fitted.headline()
    assert fitted.source.startswith("# each step on micro-batches of the rows, written by %%gpumem\ndef fit(")
    assert fitted.source.rstrip().endswith("last_loss = fit(net, X_all, y_all)")
    assert isinstance(shell.user_ns["last_loss"], float)


FINETUNE_SETUP = """
torch.manual_seed(0)
big = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(4)])
ft_data = [torch.randn(8, 1024) for _ in range(3)]
"""
FINETUNE = """\
from torch.optim import AdamW

opt_ft = AdamW(big.parameters(), lr=1e-3, weight_decay=0.01)
for xb in ft_data:
    big(xb).square().mean().backward()
    opt_ft.step()
    opt_ft.zero_grad(set_to_none=True)
"""


def test_a_full_fine_tune_whose_adam_moments_pass_the_budget_gets_a_factored_optimizer(shell, run_cell):
    if not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor needs torch 2.5")
    shell.run_cell(FINETUNE_SETUP)
    # 16 MiB of weights and as much of gradients: AdamW's two moments (32 MiB) cannot fit beside them, and
    # no batch or checkpointing changes that.
    run_cell(f"%%gpumem --limit 50MiB --quiet --no-raise --plan-budget 60\n{FINETUNE}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    widget = ReportWidget(failed, session_for(shell))
    first = widget.fixes[0]
    assert first.kind == "optimizer" and first.verdict == "fits", [e.line() for e in failed.plan.entries]
    assert "different optimizer" in first.fixes[0].explanation
    with counted(shell.user_ns["big"]) as work:
        fitted = widget.click(first.kind)
    assert fitted.outcome == "ok", fitted.headline()
    assert "torch.optim.Adafactor(big.parameters(), lr=1e-3, weight_decay=0.01)" in fitted.source
    assert work == {"steps": 3, "samples": 24}, "the accepted run takes the cell's three steps of 8 rows"


TOWERS_SETUP = """
torch.manual_seed(0)
def tower():
    return torch.nn.Sequential(*[m for _ in range(6) for m in (torch.nn.Linear(256, 256), torch.nn.GELU())])
img_tower, txt_tower = tower(), tower()
tower_opt = torch.optim.SGD([*img_tower.parameters(), *txt_tower.parameters()], lr=0.01)
img_feats, txt_feats = torch.randn(2048, 256), torch.randn(2048, 256)
import torch.nn.functional as F
"""
# A contrastive loss: every sample's negatives are the batch's others, so a smaller batch (even with
# accumulation) changes the loss; recomputing the towers' activations does not.
CONTRASTIVE = """\
B = 1024
for step in range(2):
    idx = torch.randperm(2048)[:B]
    zi, zt = img_tower(img_feats[idx]), txt_tower(txt_feats[idx])
    logits = zi @ zt.T
    target = torch.arange(B)
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    tower_opt.zero_grad()
    loss.backward()
    tower_opt.step()
"""


def test_plain_modules_the_cell_calls_get_checkpointed_calls_measured(shell, run_cell):
    shell.run_cell(TOWERS_SETUP)
    run_cell(f"%%gpumem --limit 40MiB --quiet --no-raise --plan-budget 60\n{CONTRASTIVE}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    entry = next(e for e in failed.plan.entries if e.kind == "checkpointing")
    assert entry.verdict == "fits", [e.line() for e in failed.plan.entries]
    assert "torch.utils.checkpoint.checkpoint(img_tower, img_feats[idx], use_reentrant=False)" in (
        entry.fixes[0].new_source
    )
    fitted = session_for(shell).retry(failed, entry.fixes)
    assert fitted.outcome == "ok", fitted.headline()


def test_a_similarity_matrix_bound_to_a_name_then_reduced_runs_on_chunks_of_queries_and_fits(shell, run_cell):
    # A retrieval cell in two statements: the 3,000 × 12,000 similarities (137 MiB) pass a 96 MiB card;
    # the top 4 of each row are what the cell keeps.
    run_cell(
        "torch.manual_seed(0)\ncorpus = torch.nn.functional.normalize(torch.randn(12000, 48), dim=1)\n"
        "questions = torch.nn.functional.normalize(torch.randn(3000, 48), dim=1)"
    )
    expected = (shell.user_ns["questions"][:40] @ shell.user_ns["corpus"].T).topk(4).indices
    cell = "scores = questions @ corpus.T\nhits = scores.topk(4).indices\nprint(hits.shape)\n"
    failed, fix, fitted = first_click(96, cell, shell, run_cell)
    assert failed.context.rows_call is not None and failed.context.rows_call.inlined == "scores"
    assert fix.kind == "split_rows" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok", fitted.headline()
    assert "scores =" not in fitted.source and "for rows in questions.split(" in fitted.source
    assert "`scores` is not kept" in fix.fixes[0].explanation
    assert torch.equal(shell.user_ns["hits"][:40], expected), "the same hits"
    assert tuple(shell.user_ns["hits"].shape) == (3000, 4)


def test_a_loader_loop_that_stops_on_its_count_keeps_its_steps_and_samples_when_accumulating(shell, run_cell):
    shell.run_cell(
        "torch.manual_seed(0)\nfrom torch.utils.data import DataLoader, TensorDataset\n"
        "clf = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 4))\n"
        "adam = torch.optim.Adam(clf.parameters())\n"
        "feats, tags = torch.randn(2048, 256), torch.randint(0, 4, (2048,))"
    )
    cell = (
        "loader = DataLoader(TensorDataset(feats, tags), batch_size=512, shuffle=True)\n"
        "for it, (xb, yb) in enumerate(loader):\n"
        "    loss = torch.nn.functional.cross_entropy(clf(xb), yb)\n"
        "    adam.zero_grad()\n"
        "    loss.backward()\n"
        "    adam.step()\n"
        "    if it == 1:\n"
        "        break\n"
    )
    run_cell(f"%%gpumem --limit 8MiB --quiet --no-raise --plan-budget 60\n{cell}")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    widget = ReportWidget(failed, session_for(shell))
    first = widget.fixes[0]
    assert first.kind == "batch" and first.verdict == "fits", [e.line() for e in failed.plan.entries]
    with counted(shell.user_ns["clf"]) as work:
        fitted = widget.click(first.kind)
    assert fitted.outcome == "ok", fitted.headline()
    assert work == {"steps": 2, "samples": 1024}, (work, fitted.source)


def test_a_tokenizers_output_splatted_into_an_encoder_at_once_runs_on_chunks_of_rows_and_fits(
    shell, run_cell
):
    # Every sentence through a BERT at once (`bert(**enc)`, the dict a tokenizer returns), its output read
    # in the next statement: the attention of all 512 rows passes a 150 MiB card.
    run_cell(
        "import transformers\nfrom transformers import BertConfig, BertModel\n"
        "transformers.logging.set_verbosity_error()\ntorch.manual_seed(0)\n"
        "bert = BertModel(BertConfig(vocab_size=3000, hidden_size=128, num_hidden_layers=2,\n"
        "                            num_attention_heads=4, intermediate_size=512)).eval()\n"
        "ids = torch.randint(5, 3000, (512, 256))\n"
        "enc = {'input_ids': ids, 'attention_mask': torch.ones_like(ids)}"
    )
    with torch.no_grad():
        ns = shell.user_ns
        expected = ns["bert"](**{k: v[:8] for k, v in ns["enc"].items()}).last_hidden_state.mean(dim=1)
    cell = "with torch.no_grad():\n    out = bert(**enc)\n    vecs = out.last_hidden_state.mean(dim=1)\n"
    _, fix, fitted = first_click(150, cell, shell, run_cell)
    assert fix.kind == "split_rows" and fix.verdict == "fits", fix
    assert fitted.outcome == "ok", fitted.headline()
    assert "for key, value in enc.items()" in fitted.source and "out =" not in fitted.source
    assert tuple(shell.user_ns["vecs"].shape) == (512, 128)
    assert torch.allclose(shell.user_ns["vecs"][:8], expected, atol=1e-5), "the same vectors"


OBJECT_SETUP = """
torch.manual_seed(0)
class Settings:
    def __init__(self):
        self.batch_size = 1024
        self.steps = 2
settings = Settings()
mlp = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1))
mlp_opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
pool = torch.randn(8192, 128)
def fit(model, opt, cfg):
    for step in range(cfg.steps):
        xb = pool[step * cfg.batch_size:(step + 1) * cfg.batch_size]
        loss = model(xb).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_batch_setting_of_an_object_the_cell_hands_to_a_function_is_set_in_the_cell_and_fits(
    shell, run_cell
):
    shell.run_cell(OBJECT_SETUP)
    # The batch is nowhere in the cell's text: `fit` reads `cfg.batch_size` of the object the cell passes.
    run_cell("%%gpumem --limit 8MiB --quiet --no-raise --plan-budget 60\nfit(mlp, mlp_opt, settings)")
    failed = oommagic.history()[-1]
    assert failed.outcome == "oom", failed.headline()
    guess = failed.context.batch
    assert (guess.name, guess.value, guess.where) == ("settings.batch_size", 1024, "object")
    assert shell.user_ns["settings"].batch_size == 1024, "the trials put the person's setting back"
    widget = ReportWidget(failed, session_for(shell))
    first = widget.fixes[0]
    assert first.kind == "batch" and first.verdict == "fits", [e.line() for e in failed.plan.entries]
    with counted(shell.user_ns["mlp"]) as work:
        fitted = widget.click(first.kind)
    assert fitted.outcome == "ok", fitted.headline()
    new = first.fixes[0].params["new"]
    # The cell says what runs: the setting at its top, `fit` redefined with the accumulation.
    assert fitted.source.startswith(f"settings.batch_size = {new}  # oommagic"), fitted.source
    assert shell.user_ns["settings"].batch_size == new
    assert work == {"steps": 2, "samples": 2048}, (work, fitted.source)
