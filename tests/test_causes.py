"""Each common cause of an out-of-memory error, end to end in a real IPython shell on the CPU: the cell fails
under ``--limit``, the diagnosis names the cause with this run's numbers, its fix rewrites the cell (the
expected diff) or changes a setting, and the cell run with the fix fits.

Limits are set relative to what the CPU ledger already holds, so earlier tests in the session do not move
them.
"""

from __future__ import annotations

import gc

import pytest
import torch

import oommagic
from oommagic.diagnosis.rewrite import TOO_LONG, TRUNCATED_COLLATE
from oommagic.run.capture import LEDGER
from oommagic.run.session import session_for
from oommagic.sizes import format_bytes
from oommagic.view.widget import offered

MiB = 1024**2


@pytest.fixture(scope="module", autouse=True)
def leave_the_shell_as_found(shell):
    """The shell is shared by the whole session: drop what these tests bound and give back what their
    outputs and errors pin, so later tests start from the memory they expect."""
    from oommagic.run.release import free_pinned

    # And start from it: what earlier modules' errors and outputs still pin (IPython's `Out`, the last
    # traceback) would be memory held before every cell here, which these tests size their limits against.
    free_pinned(shell, "cpu")
    shell.run_line_magic("reset", "-f out")
    gc.collect()
    before = set(shell.user_ns)
    yield
    for name in set(shell.user_ns) - before:
        shell.user_ns.pop(name, None)
    free_pinned(shell, "cpu")


def last_run():
    return oommagic.history()[-1]


def limit_above(extra: int) -> str:
    """A --limit of ``extra`` bytes above what the CPU ledger holds now."""
    return f"{LEDGER.allocated + extra}B"


def finding(run, key: str):
    return finding_of(run.findings, key)


def finding_of(findings, key: str):
    found = {f.key: f for f in findings}
    assert key in found, [(f.key, f.evidence) for f in findings]
    return found[key]


def remedy(f, kind: str):
    found = {r.kind: r for r in f.remedies}
    assert kind in found, [r.kind for r in f.remedies]
    return found[kind]


def retried(shell, run, fix):
    new = session_for(shell).retry(run, fix)
    assert new.outcome == "ok", (new.headline(), new.error)
    return new


# --- 1. tensors kept across iterations ----------------------------------------------------------------

KEEPS_OUTPUTS = """\
outs = []
for i in range(100):
    outs.append(net1(xs1[i % 4]))
"""


@pytest.fixture
def net1(shell, run_cell):
    run_cell(
        "%%gpumem --quiet\ntorch.manual_seed(0)\n"
        "net1 = torch.nn.Sequential(torch.nn.Linear(64, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 4))\n"
        "xs1 = [torch.randn(64, 64) for _ in range(4)]\nnet1(xs1[0]);"
    )
    yield
    for name in ("net1", "xs1", "outs"):
        shell.user_ns.pop(name, None)


def test_an_inference_loop_keeping_outputs_with_graphs_keeps_detached_copies(shell, run_cell, net1):
    run_cell(f"%%gpumem --limit {limit_above(48 * MiB)} --plan-budget 0 --quiet\n{KEEPS_OUTPUTS}")
    run = last_run()
    assert run.outcome == "oom" and len(run.timeline.steps) == 0
    kept = finding(run, "kept")
    held = run.context.kept[0]
    assert held.name == "outs" and held.items >= 2 and held.graphs == held.items
    assert f"`outs` held {held.items} tensors" in kept.evidence
    assert f"{held.graphs} of them with their autograd graph" in kept.evidence
    assert "line 3 `outs.append(net1(xs1[i % 4]))`" in kept.evidence
    fix = remedy(kept, "keep_numbers")
    assert fix.automatic
    assert fix.new_source == KEEPS_OUTPUTS.replace("net1(xs1[i % 4]))", "net1(xs1[i % 4]).detach().cpu())")
    new = retried(shell, run, fix)
    assert len(shell.user_ns["outs"]) == 100 and shell.user_ns["outs"][0].grad_fn is None
    assert new.applied == (fix,)


def test_a_training_loop_keeping_its_losses_keeps_numbers(shell, run_cell):
    # Each step's loss is kept with its graph: 100 graphs of 256 KiB activations each.
    cell = (
        "losses = []\n"
        "for step in range(100):\n"
        "    loss = (lin2(xs2[step % 4]) ** 2).mean()\n"
        "    losses.append(loss)\n"
    )
    run_cell(
        "%%gpumem --quiet\nlin2 = torch.nn.Linear(256, 256)\n"
        "xs2 = [torch.randn(256, 256) for _ in range(4)]\n"
        "lin2(xs2[0]).sum();"
    )
    run_cell(f"%%gpumem --limit {limit_above(16 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    fix = remedy(finding(run, "kept"), "keep_numbers")
    assert fix.new_source == cell.replace("losses.append(loss)", "losses.append(loss.item())")
    retried(shell, run, fix)
    assert all(type(x) is float for x in shell.user_ns["losses"])
    for name in ("lin2", "xs2", "losses", "loss"):
        shell.user_ns.pop(name, None)


def test_a_loop_that_keeps_nothing_gets_no_keep_finding(shell, run_cell, net1):
    cell = (
        "total = 0\nfor i in range(100):\n    total += net1(xs1[i % 4]).sum().item()\n"
        "big = torch.empty(64 * 2**20)\n"
    )
    run_cell(f"%%gpumem --limit {limit_above(48 * MiB)} --plan-budget 0 --quiet\n{cell}")
    assert last_run().outcome == "oom"
    assert "kept" not in {f.key for f in last_run().findings}


# --- 2. inference with autograd on --------------------------------------------------------------------

INFERENCE = """\
out = deep2(x2)
pred = out.argmax(-1)
"""


@pytest.fixture
def deep2(shell, run_cell):
    layers = "[torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Dropout(0.1)] * 8"
    run_cell(
        f"%%gpumem --quiet\ndeep2 = torch.nn.Sequential(*({layers}))\nx2 = torch.randn(512, 512)\ndeep2(x2);"
    )
    yield
    for name in ("deep2", "x2", "out", "pred"):
        shell.user_ns.pop(name, None)


def test_inference_with_autograd_on_runs_under_inference_mode_in_eval_mode(shell, run_cell, deep2):
    run_cell(f"%%gpumem --limit {limit_above(12 * MiB)} --plan-budget 0 --quiet\n{INFERENCE}")
    run = last_run()
    assert run.outcome == "oom"
    found = finding(run, "autograd")
    assert "Autograd was on where the error came (line 1 of the cell)" in found.evidence
    assert "deep2 has 1.00 MiB of parameters that require grad" in found.evidence
    fix = remedy(found, "no_grad")
    assert fix.automatic and fix.title == "Run under torch.inference_mode() with deep2.eval()"
    # The statements that call the model go under inference_mode; torch is imported (the cell names none).
    assert fix.new_source == (
        "import torch\ndeep2.eval()\nwith torch.inference_mode():\n"
        "    out = deep2(x2)\npred = out.argmax(-1)\n"
    )
    retried(shell, run, fix)
    assert shell.user_ns["deep2"].training is False


def test_inference_already_under_no_grad_gets_no_autograd_finding(shell, run_cell, deep2):
    cell = "with torch.no_grad():\n    out = deep2(torch.randn(4096, 512))\n"
    run_cell(f"%%gpumem --limit {limit_above(12 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    assert run.outcome == "oom"
    assert "autograd" not in {f.key for f in run.findings}


def test_generation_is_not_offered_no_grad(shell, run_cell):
    from oommagic.diagnosis.findings import DiagnosisContext, ModelInfo
    from oommagic.diagnosis.rules import diagnose

    ctx = DiagnosisContext(
        source="out = model.generate(ids, max_new_tokens=10)\n",
        generation=True,
        grad_enabled=True,
        models=(ModelInfo("model", 100 * MiB, trainable_bytes=100 * MiB),),
        limit=256 * MiB,
    )
    assert "autograd" not in {f.key for f in diagnose(None, ctx)}


# --- 3. the evaluation batch, not the training batch ---------------------------------------------------

EVALUATES = """\
train_loader = DataLoader(ds3, batch_size=8)
eval_loader = DataLoader(ds3, batch_size=2048)
for step, (xb,) in enumerate(train_loader):
    loss = mlp3(xb).pow(2).mean()
    loss.backward()
    opt3.step()
    opt3.zero_grad()
    if step == 3:
        break
with torch.no_grad():
    for (xb,) in eval_loader:
        preds = mlp3(xb).argmax(-1)
"""


def test_an_evaluation_failure_halves_the_evaluation_batch_not_the_training_one(shell, run_cell):
    run_cell(
        "%%gpumem --quiet\nfrom torch.utils.data import DataLoader, TensorDataset\ntorch.manual_seed(0)\n"
        "mlp3 = torch.nn.Sequential(\n"
        "    torch.nn.Linear(1024, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024)\n)\n"
        "opt3 = torch.optim.SGD(mlp3.parameters(), lr=0.01)\nds3 = TensorDataset(torch.randn(2048, 1024))\n"
        "ds3[0]\nmlp3(torch.zeros(1, 1024));"
    )
    run_cell(f"%%gpumem --limit {limit_above(18 * MiB)} --plan-budget 0 --quiet\n{EVALUATES}")
    run = last_run()
    assert run.outcome == "oom" and run.context.evaluating
    act = finding(run, "activations")
    assert act.title == "Activations of the batch in evaluation"
    assert "The failure came in an evaluation (line 12 of the cell" in act.evidence
    assert "batch" not in {r.kind for f in run.findings for r in f.remedies}
    assert "long_samples" not in {f.key for f in run.findings}
    fix = remedy(act, "eval_batch")
    assert fix.title == "Evaluation batch 2048 → 1024"
    assert fix.new_source == EVALUATES.replace("batch_size=2048", "batch_size=1024")
    retried(shell, run, fix)
    for name in ("mlp3", "opt3", "ds3", "train_loader", "eval_loader", "xb", "loss", "preds", "step"):
        shell.user_ns.pop(name, None)


LIGHTNING_MODULE = """\
class Lit5(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(256, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 4))

    def training_step(self, batch, i):
        (x,) = batch
        return self.net(x).pow(2).mean()

    def validation_step(self, batch, i):
        (x,) = batch
        self.log("val_loss", self.net(x).pow(2).mean())

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def train_dataloader(self):
        return DataLoader(ds5, batch_size=TRAIN_BATCH)

    def val_dataloader(self):
        return DataLoader(ds5, batch_size=1024)
"""
QUIET_TRAINER = (
    "trainer5 = pl.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=2, accelerator='cpu', "
    "logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)\n"
)


@pytest.fixture
def lightning5(shell, run_cell):
    pytest.importorskip("lightning")
    run_cell(
        "%%gpumem --quiet\nimport lightning.pytorch as pl\n"
        "from torch.utils.data import DataLoader, TensorDataset\ntorch.manual_seed(0)\n"
        "ds5 = TensorDataset(torch.randn(2048, 256))\nds5[0];"
    )
    yield
    for name in ("pl", "ds5", "Lit5", "lit5", "trainer5"):
        shell.user_ns.pop(name, None)


def test_a_lightning_validation_failure_halves_the_val_dataloader_of_an_earlier_cell(
    shell, run_cell, lightning5
):
    run_cell(LIGHTNING_MODULE.replace("TRAIN_BATCH", "8") + "lit5 = Lit5()\n")
    cell = QUIET_TRAINER + "trainer5.validate(lit5)\n"
    run_cell(f"%%gpumem --limit {limit_above(14 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    assert run.outcome == "oom" and run.context.evaluating
    act = finding(run, "activations")
    assert "The failure came in an evaluation (line 2 of the cell, in validate())" in act.evidence
    assert "per sample at batch_size=1024" in act.evidence
    # Lightning evaluates under inference_mode: no autograd finding, and never the training batch.
    assert {f.key for f in run.findings}.isdisjoint({"autograd", "kept"})
    assert "batch" not in {r.kind for f in run.findings for r in f.remedies}
    fix = remedy(act, "eval_batch")
    assert fix.title == "Evaluation batch 1024 → 512" and "Lit5.val_dataloader" in fix.explanation
    assert fix.new_source == cell.replace(
        "trainer5.validate(lit5)", "trainer5.validate(lit5, dataloaders=DataLoader(ds5, batch_size=512))"
    )
    new = retried(shell, run, fix)
    assert new.applied == (fix,) and "val_loss" in shell.user_ns["trainer5"].callback_metrics
    # Undone, the cell runs as written again (and runs out again): the class was never changed.
    undone = session_for(shell).remove(new, 0)
    assert undone.source == cell and undone.outcome == "oom"


def test_a_loader_of_an_earlier_cell_passed_to_validate_is_passed_again_with_half_the_batch(
    shell, run_cell, lightning5
):
    run_cell(
        LIGHTNING_MODULE.replace("TRAIN_BATCH", "8")
        + "lit5 = Lit5()\nval5 = DataLoader(ds5, batch_size=1024)\n"
    )
    cell = QUIET_TRAINER + "trainer5.validate(lit5, dataloaders=val5)\n"
    run_cell(f"%%gpumem --limit {limit_above(14 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    fix = remedy(finding(run, "activations"), "eval_batch")
    assert fix.title == "Evaluation batch 1024 → 512" and "(batch_size of val5)" in fix.explanation
    assert fix.new_source == "import torch\n" + cell.replace(
        "dataloaders=val5)",
        "dataloaders=torch.utils.data.DataLoader(val5.dataset, batch_size=512, collate_fn=val5.collate_fn, "
        "num_workers=val5.num_workers))",
    )
    retried(shell, run, fix)
    shell.user_ns.pop("val5", None)


def test_a_lightning_fit_failing_in_its_validation_changes_the_val_dataloader_in_the_cell(
    shell, run_cell, lightning5
):
    cell = LIGHTNING_MODULE.replace("TRAIN_BATCH", "8") + QUIET_TRAINER + "trainer5.fit(Lit5())\n"
    run_cell(f"%%gpumem --limit {limit_above(14 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    assert run.outcome == "oom" and run.context.evaluating
    fix = remedy(finding(run, "activations"), "eval_batch")
    assert fix.new_source == cell.replace("batch_size=1024", "batch_size=512")
    assert "batch_size=8" in fix.new_source  # the training loader stays
    retried(shell, run, fix)
    assert shell.user_ns["trainer5"].global_step == 2


def test_a_lightning_training_step_failure_is_not_an_evaluation(shell, run_cell, lightning5):
    cell = LIGHTNING_MODULE.replace("TRAIN_BATCH", "2048").replace("batch_size=1024)", "batch_size=8)")
    cell += QUIET_TRAINER + "trainer5.fit(Lit5())\n"
    run_cell(f"%%gpumem --limit {limit_above(14 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    assert run.outcome == "oom" and not run.context.evaluating and run.context.eval_batch is None
    assert "eval_batch" not in {r.kind for f in run.findings for r in f.remedies}


# --- 4. memory pinned outside %%gpumem -----------------------------------------------------------------


def test_output_history_pinning_memory_is_found_and_a_button_gives_it_back(shell, run_cell):
    run_cell("%%gpumem --quiet\nshown4 = torch.ones(8 * 2**20)")
    run_cell("shown4.mul_(1)")  # shown: Out[n], `_` and IPython's hidden copies hold it
    run_cell("del shown4")
    _, listing = run_cell("%gpumem")
    assert "32.00 MiB  Out[" in listing and "%gpumem --free" in listing
    run_cell(
        f"%%gpumem --limit {limit_above(16 * MiB)} --plan-budget 0 --quiet\nfresh4 = torch.ones(8 * 2**20)"
    )
    run = last_run()
    assert run.outcome == "oom"
    pinned = finding(run, "pinned")
    # Earlier tests of the session may have left outputs in the history too: they count, listed after.
    assert (
        "of device memory was held outside the namespace's variables when the cell ran: 32.00 MiB by Out["
        in (pinned.evidence)
    )
    fix = remedy(pinned, "free_pinned")
    assert fix.automatic and fix.saving >= 32 * MiB
    retried(shell, run, fix)
    shell.user_ns.pop("fresh4", None)


def test_an_earlier_errors_traceback_is_listed_and_freed_by_gpumem_free(shell, run_cell):
    run_cell("import weakref\n")
    run_cell("%%gpumem --quiet\nheld5 = torch.ones(4 * 2**20)\nrefs5 = [weakref.ref(held5)]")
    run_cell("def fails5(t):\n    raise ValueError('boom')\nfails5(held5)")
    run_cell("del held5")
    gc.collect()
    assert shell.user_ns["refs5"][0]() is not None
    _, listing = run_cell("%gpumem")
    assert "16.00 MiB  sys.last_value (ValueError) → traceback → fails5() → local 't'" in listing
    before = LEDGER.allocated
    _, said = run_cell("%gpumem --free")
    assert "%gpumem --free: 16.00 MiB given back on cpu." in said
    assert shell.user_ns["refs5"][0]() is None and before - LEDGER.allocated == 16 * MiB
    _, listing = run_cell("%gpumem")
    assert "outside the namespace's variables: nothing." in listing


def test_an_exception_kept_in_a_variable_and_a_generator_are_pins(shell, run_cell):
    run_cell(
        "%%gpumem --quiet\n"
        "def hold6(t):\n    raise KeyError('x')\n"
        "try:\n    hold6(torch.ones(2 * 2**20))\nexcept KeyError as e:\n    err6 = e\n"
        "def gen6():\n    t = torch.ones(2 * 2**20)\n    yield 1\n    yield t.sum()\n"
        "g6 = gen6()\nnext(g6)\n"
    )
    _, listing = run_cell("%gpumem")
    assert "8.00 MiB  err6 (KeyError) → traceback → hold6() → local 't'" in listing
    assert "8.00 MiB  g6 (a suspended generator, in gen6()) → gen6() → local 't'" in listing
    before = LEDGER.allocated
    _, said = run_cell("%gpumem --free")
    assert "16.00 MiB given back" in said and before - LEDGER.allocated == 16 * MiB
    assert isinstance(shell.user_ns["err6"], KeyError)  # the variable stays, its frames' locals go
    for name in ("err6", "g6", "hold6", "gen6"):
        shell.user_ns.pop(name, None)


def test_line_magic_options_are_checked(run_cell):
    _, out = run_cell("%gpumem --bogus")
    assert "%gpumem takes --free, --fix [N] or --snapshot FILE (got '--bogus')" in out


def test_the_scan_reads_no_grad_of_a_non_leaf_tensor_and_stays_silent(shell, run_cell):
    import warnings

    run_cell("%%gpumem --quiet\nw7 = torch.ones(1000, requires_grad=True)\nnon_leaf7 = w7 * 2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _, out = run_cell(f"%%gpumem --limit {limit_above(MiB)} --plan-budget 0\nz7 = torch.ones(2 * 2**20)")
    assert last_run().outcome == "oom"
    assert ".grad attribute of a Tensor that is not a leaf" not in out
    for name in ("w7", "non_leaf7"):
        shell.user_ns.pop(name, None)


# --- 5. weights too large for the budget ---------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    """A GPT-2 of 20 MiB float32 weights saved as a local checkpoint (random weights, no download)."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("gpt2")
    config = transformers.GPT2Config(n_embd=256, n_layer=4, n_head=4, vocab_size=8192, n_positions=256)
    transformers.GPT2LMHeadModel(config).save_pretrained(path)
    return str(path)


def test_float32_weights_that_fit_in_bfloat16_are_loaded_in_bfloat16(shell, run_cell, tiny_gpt2):
    shell.user_ns["path5"] = tiny_gpt2
    run_cell("%%gpumem --quiet\nids5 = torch.randint(0, 8192, (4, 64))\nids5 + 0;")
    cell = (
        "from transformers import AutoModelForCausalLM\n"
        "model5 = AutoModelForCausalLM.from_pretrained(path5)\n"
        "with torch.no_grad():\n"
        "    logits5 = model5(ids5).logits\n"
    )
    run_cell(f"%%gpumem --limit {limit_above(16 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    assert run.outcome == "oom"
    keys = [f.key for f in run.findings]
    assert "weights" in keys and "too_large" not in keys
    weights = finding(run, "weights")
    assert "line 2 `AutoModelForCausalLM.from_pretrained(" in weights.evidence
    assert "loads 20.31 MiB of float32 weights" in weights.evidence
    assert "In bfloat16 they take 10.15 MiB." in weights.evidence
    # bitsandbytes is not installed here: the 4-bit fix says how to install it and is no button.
    four = next(r for r in weights.remedies if r.params.get("bits") == 4)
    assert not four.automatic and "pip install bitsandbytes" in four.title
    assert four.code.startswith("%pip install bitsandbytes")
    bf16 = next(r for r in weights.remedies if r.params.get("dtype") == "bfloat16")
    assert bf16.automatic
    assert bf16.new_source == "import torch\n" + cell.replace("(path5)", "(path5, dtype=torch.bfloat16)")
    retried(shell, run, bf16)
    assert shell.user_ns["model5"].dtype == torch.bfloat16
    for name in ("model5", "ids5", "logits5", "path5"):
        shell.user_ns.pop(name, None)


def test_weights_quiet_when_they_are_a_small_share_of_the_budget():
    from oommagic.diagnosis.findings import DiagnosisContext, ModelInfo
    from oommagic.diagnosis.rules import diagnose

    small = DiagnosisContext(models=(ModelInfo("m", 10 * MiB),), limit=256 * MiB)
    assert "weights" not in {f.key for f in diagnose(None, small)}
    big = DiagnosisContext(models=(ModelInfo("m", 200 * MiB, is_hf=True),), limit=256 * MiB)
    found = {f.key: f for f in diagnose(None, big)}
    assert "m holds 200.00 MiB of float32 weights on the device: 78% of the 256.00 MiB limit" in (
        found["weights"].evidence
    )


# --- 6. one request larger than the budget --------------------------------------------------------------


@pytest.fixture
def lm6(shell, run_cell):
    """A GPT-2 of GPT-2's vocabulary (50,257) and two small layers, from a config (no download)."""
    pytest.importorskip("transformers")
    run_cell(
        "%%gpumem --quiet\nimport transformers\ntorch.manual_seed(0)\n"
        "cfg6 = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=2, vocab_size=50257, n_positions=256)\n"
        "lm6 = transformers.GPT2LMHeadModel(cfg6).eval()\nids6 = torch.randint(0, 50257, (4, 256))\n"
        "lm6(ids6[:1, :4]);"
    )
    yield
    for name in ("cfg6", "lm6", "ids6", "next6", "transformers"):
        shell.user_ns.pop(name, None)


NEXT_TOKEN = """\
with torch.no_grad():
    next6 = lm6(ids6).logits[:, -1].argmax(-1)
"""


def test_logits_larger_than_the_budget_are_named_and_computed_for_the_last_position_only(
    shell, run_cell, lm6
):
    run_cell(f"%%gpumem --limit {limit_above(64 * MiB)} --plan-budget 0 --quiet\n{NEXT_TOKEN}")
    run = last_run()
    assert run.outcome == "oom" and run.report.requested == 4 * 256 * 50257 * 4
    big = finding(run, "too_large")
    assert (
        f"One request of 196.32 MiB is larger than the whole {format_bytes(run.limit)} limit (line 2 of the "
        "cell, in forward()): the logits, the output of `lm_head` (Linear 64 → 50,257) of GPT2LMHeadModel: "
        "4 × 256 × 50,257 (batch × sequence × vocabulary) float32 values, 196.32 MiB."
    ) in big.evidence
    assert "(now 4)" in big.evidence and "shorter sequences (now 256 tokens)" in big.evidence
    keep = remedy(big, "logits_to_keep")
    assert keep.automatic and keep.saving == 4 * 255 * 50257 * 4
    assert keep.new_source == NEXT_TOKEN.replace("lm6(ids6)", "lm6(ids6, logits_to_keep=1)")
    new = retried(shell, run, keep)
    assert new.applied == (keep,) and new.peak_allocated - new.recording.before_allocated < 16 * MiB
    with torch.no_grad():  # the same next tokens as the full logits give
        expected = shell.user_ns["lm6"](shell.user_ns["ids6"][:1]).logits[:, -1].argmax(-1)
    assert shell.user_ns["next6"].shape == (4,) and shell.user_ns["next6"][0] == expected[0]


def test_one_request_whose_frames_name_no_operation_gets_no_shape(shell, run_cell, lm6):
    run_cell(
        f"%%gpumem --limit {limit_above(64 * MiB)} --plan-budget 0 --quiet\nbig6 = torch.empty(32 * 2**20)"
    )
    run = last_run()
    assert run.outcome == "oom" and run.context.request is None
    big = finding(run, "too_large")
    assert "×" not in big.evidence and "logits_to_keep" not in {r.kind for r in big.remedies}


def test_logits_read_in_full_are_not_offered_logits_to_keep(shell, run_cell, lm6):
    cell = "with torch.no_grad():\n    probs6 = lm6(ids6).logits.softmax(-1)\n"
    run_cell(f"%%gpumem --limit {limit_above(64 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    big = finding(run, "too_large")
    assert "4 × 256 × 50,257 (batch × sequence × vocabulary)" in big.evidence
    assert "logits_to_keep" not in {r.kind for r in big.remedies}
    shell.user_ns.pop("probs6", None)


# --- 9. generation -------------------------------------------------------------------------------------


def test_long_prompts_prefill_is_split_into_chunks_not_fewer_new_tokens(shell, run_cell, tiny_gpt2):
    shell.user_ns["path9"] = tiny_gpt2
    run_cell(
        "%%gpumem --quiet\nfrom transformers import AutoModelForCausalLM\n"
        "model9 = AutoModelForCausalLM.from_pretrained(path9)\nmodel9.generation_config.pad_token_id = 0\n"
        "ids9 = torch.randint(0, 8192, (16, 128))\nmodel9(ids9[:1, :2]);"
    )
    cell = "out9 = model9.generate(ids9, max_new_tokens=16, do_sample=False)\n"
    run_cell(f"%%gpumem --limit {limit_above(45 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    assert run.outcome == "oom"
    gen = finding(run, "generation")
    assert (
        "The error came in the prefill (`_prefill` in the traceback), where all 16 prompts of 128 tokens "
        "go through the model at once before any new token exists: fewer new tokens or a smaller KV cache "
        "cannot make it fit; generating fewer prompts at a time does"
    ) in gen.evidence
    assert {r.kind for r in gen.remedies}.isdisjoint({"max_new_tokens", "kv_cache", "quantized_cache"})
    split = remedy(gen, "split_generate")
    # The first chunk is sized from the figures: the prefill's activations in half of what the limit leaves.
    assert split.automatic and split.title == "Generate 4 prompts at a time (of 16)"
    assert split.new_source.endswith(
        "out9 = generate_in_chunks(model9.generate, 4, ids9, max_new_tokens=16, do_sample=False)\n"
    )
    retried(shell, run, split)
    assert tuple(shell.user_ns["out9"].shape) == (16, 144)
    for name in ("model9", "ids9", "out9", "path9", "generate_in_chunks"):
        shell.user_ns.pop(name, None)


GENERATES = "out9 = lm9.generate(ids9, max_new_tokens=16, min_new_tokens=16, do_sample=False)\n"


def test_a_kv_cache_that_outgrows_the_budget_is_quantized(shell, run_cell):
    pytest.importorskip("transformers")
    # 8 layers of 512-wide keys and values for 32 prompts: the float32 KV cache is most of what grows.
    run_cell(
        "%%gpumem --quiet\nimport transformers\ntorch.manual_seed(0)\n"
        "cfg9 = transformers.GPT2Config(n_embd=512, n_layer=8, n_head=8, vocab_size=64, n_positions=64)\n"
        "lm9 = transformers.GPT2LMHeadModel(cfg9).eval()\nlm9.generation_config.pad_token_id = 0\n"
        "ids9 = torch.randint(0, 64, (32, 8))\nlm9(ids9[:1, :2]);"
    )
    run_cell(f"%%gpumem --limit {limit_above(20 * MiB)} --plan-budget 0 --quiet\n{GENERATES}")
    run = last_run()
    assert run.outcome == "oom"
    if "fp8" not in (run.context.kv_backends or ()):
        pytest.skip("this transformers has no fp8 quantized cache, and no other backend is installed")
    gen = finding(run, "generation")
    quant = remedy(gen, "quantized_cache")
    assert quant.automatic and quant.title == "Quantized KV cache (fp8)"
    assert quant.new_source == GENERATES.replace(
        "do_sample=False)",
        'do_sample=False, cache_implementation=\'quantized\', cache_config={"backend": "fp8"})',
    )
    assert "25% of the float32 values' bytes" in quant.explanation
    new = retried(shell, run, quant)
    assert tuple(shell.user_ns["out9"].shape) == (32, 24) and new.applied == (quant,)
    for name in ("cfg9", "lm9", "ids9", "out9"):
        shell.user_ns.pop(name, None)


def test_a_quantized_cache_without_a_backend_says_what_to_install_and_is_no_button():
    from oommagic.diagnosis.findings import DiagnosisContext, Frame
    from oommagic.diagnosis.rules import diagnose
    from oommagic.oom import OOMReport

    ctx = DiagnosisContext(
        source="out = model.generate(**enc, max_new_tokens=2048)\n",
        generation=True,
        capacity=24 * 1024 * MiB,
        prompt_tokens=32,
        kv_backends=(),
    )
    report = OOMReport(text="CUDA out of memory.", requested=1024 * MiB, capacity=24 * 1024 * MiB, free=0)
    quant = remedy(finding_of(diagnose(report, ctx), "generation"), "quantized_cache")
    assert not quant.automatic and quant.title == "Quantized KV cache: first `pip install optimum-quanto`"
    assert quant.code.startswith("%pip install optimum-quanto\n")
    # A transformers without a quantized cache offers none; a failure in the prefill offers no cache at all.
    older = DiagnosisContext(**{**ctx.__dict__, "kv_backends": None})
    assert "quantized_cache" not in {r.kind for f in diagnose(report, older) for r in f.remedies}
    frames = (Frame("<module>", 1, True), Frame("generate", 2), Frame("_prefill", 3))
    prefill = DiagnosisContext(**{**ctx.__dict__, "frames": frames, "kv_backends": ("fp8",)})
    kinds = {r.kind for f in diagnose(report, prefill) for r in f.remedies}
    assert kinds.isdisjoint({"quantized_cache", "kv_cache", "max_new_tokens"})


def test_offloaded_kv_cache_is_a_rewrite_of_the_generate_call():
    from oommagic.diagnosis.findings import DiagnosisContext
    from oommagic.diagnosis.rules import diagnose
    from oommagic.oom import OOMReport

    ctx = DiagnosisContext(
        source="out = model.generate(**enc, max_new_tokens=2048)\n",
        generation=True,
        device="cuda:0",
        capacity=24 * 1024 * MiB,
        transformers_version="4.57.1",
        prompt_tokens=32,
    )
    report = OOMReport(text="CUDA out of memory.", requested=1024 * MiB, capacity=24 * 1024 * MiB, free=0)
    gen = {f.key: f for f in diagnose(report, ctx)}["generation"]
    offload = remedy(gen, "kv_cache")
    assert offload.automatic
    assert offload.new_source == (
        "out = model.generate(**enc, max_new_tokens=2048, cache_implementation='offloaded')\n"
    )
    older = DiagnosisContext(**{**ctx.__dict__, "transformers_version": "4.40.0"})
    assert "kv_cache" not in {r.kind for f in diagnose(report, older) for r in f.remedies}


# --- 7. long samples -----------------------------------------------------------------------------------

LONG_BATCH = """\
for texts in batches7:
    ids = tokenizer(texts)
    loss = lin7(emb7(ids)).pow(2).mean()
    loss.backward()
    opt7.step()
    opt7.zero_grad()
"""


@pytest.fixture
def long7(shell, run_cell):
    """Six batches of 64-character texts, then one of 2,048: a tokenizer that pads to the longest (and
    truncates when asked), an embedding and a linear layer trained with SGD."""
    run_cell(
        "%%gpumem --quiet\n"
        "def tokenizer(texts, truncation=False, max_length=None):\n"
        "    n = max(len(t) for t in texts)\n"
        "    if truncation and max_length:\n"
        "        n = min(n, max_length)\n"
        "    return torch.ones(len(texts), n, dtype=torch.long)\n"
        "emb7 = torch.nn.Embedding(16, 256)\nlin7 = torch.nn.Linear(256, 256)\n"
        "opt7 = torch.optim.SGD([*emb7.parameters(), *lin7.parameters()], lr=0.01)\n"
        'batches7 = [["a" * 64] * 8] * 6 + [["a" * 2048] * 8]\n'
        "lin7(emb7(torch.ones(1, 1, dtype=torch.long))).sum().backward()\nopt7.zero_grad()\n"
    )
    yield
    for name in (
        "tokenizer",
        "emb7",
        "lin7",
        "opt7",
        "batches7",
        "texts",
        "ids",
        "loss",
        "too_long",
        "steps7",
    ):
        shell.user_ns.pop(name, None)


def test_one_batch_of_long_samples_is_left_out_or_truncated_before_anything_else(shell, run_cell, long7):
    run_cell(f"%%gpumem --limit {limit_above(40 * MiB)} --plan-budget 60 --quiet\n{LONG_BATCH}")
    run = last_run()
    assert run.outcome == "oom" and len(run.timeline.steps) == 6
    assert run.findings[0].key == "long_samples"
    long = run.findings[0]
    assert "of the 5 completed steps" in long.evidence and "plot_lengths" in long.evidence
    assert "The batch it failed on, `ids`, is 8 × 2,048 tokens." in long.evidence
    cut = remedy(long, "truncate")
    assert cut.new_source == LONG_BATCH.replace(
        "tokenizer(texts)", "tokenizer(texts, truncation=True, max_length=512)"
    )
    # Both change only the outlier batch: they come first, measured to fit, the faster one first.
    first_two = {e.kind: e.verdict for e in run.plan.entries[:2]}
    assert first_two == {"skip_long": "fits", "truncate": "fits"}, [e.line() for e in run.plan.entries]
    retried(shell, run, cut)


def test_one_batch_of_long_samples_is_skipped_by_the_loop(shell, run_cell, long7):
    cell = "steps7 = 0\n" + LONG_BATCH + "    steps7 += 1\n"
    run_cell(f"%%gpumem --limit {limit_above(40 * MiB)} --plan-budget 0 --quiet\n{cell}")
    run = last_run()
    long = finding(run, "long_samples")
    skip = long.remedies[0]
    assert skip.kind == "skip_long" and skip.title == "Skip batches longer than 512 tokens"
    assert offered(run)[0].kind == "skip_long"  # the report's first button
    assert skip.new_source == TOO_LONG + "\n\n" + cell.replace(
        "    ids = tokenizer(texts)\n",
        "    ids = tokenizer(texts)\n    if too_long(ids, 512):\n        continue\n",
    )
    new = retried(shell, run, skip)
    assert shell.user_ns["steps7"] == 6  # every batch but the long one trained
    # Undone, the cell runs as written again: the long batch runs out again.
    undone = session_for(shell).remove(new, 0)
    assert undone.source == cell and undone.outcome == "oom"


COLLATED = """\
loader7 = DataLoader(samples7, batch_size=8, collate_fn=pad7)
for batch in loader7:
    loss = lin7(emb7(batch["input_ids"])).pow(2).mean()
    loss.backward()
    opt7.step()
    opt7.zero_grad()
"""


def test_long_samples_collated_without_a_tokenizer_call_are_cut_before_padding(shell, run_cell, long7):
    run_cell(
        "from torch.utils.data import DataLoader\n"
        "samples7 = [{'input_ids': [1] * 64}] * 48 + [{'input_ids': [1] * 2048}] * 8\n"
        "def pad7(features):\n"
        "    n = max(len(f['input_ids']) for f in features)\n"
        "    rows = [f['input_ids'] + [0] * (n - len(f['input_ids'])) for f in features]\n"
        "    return {'input_ids': torch.tensor(rows)}\n"
    )
    run_cell(f"%%gpumem --limit {limit_above(40 * MiB)} --plan-budget 0 --quiet\n{COLLATED}")
    run = last_run()
    long = finding(run, "long_samples")
    assert "The batch it failed on, `batch`, is 8 × 2,048 tokens." in long.evidence
    cut = remedy(long, "truncate")
    assert cut.automatic and "a collator pads, it never cuts" in cut.explanation
    assert cut.new_source == TRUNCATED_COLLATE + "\n\n" + COLLATED.replace(
        "collate_fn=pad7)", "collate_fn=truncated(pad7, 512))"
    )
    retried(shell, run, cut)
    for name in ("samples7", "pad7", "loader7", "batch", "truncated", "DataLoader"):
        shell.user_ns.pop(name, None)


def test_long_samples_without_a_loop_binding_the_batch_are_not_offered_a_skip():
    from oommagic.diagnosis.findings import DiagnosisContext
    from oommagic.diagnosis.rules import diagnose
    from oommagic.timeline import Timeline

    outlier = Timeline(
        t=tuple(range(12)),
        allocated=tuple([MiB, 10 * MiB] * 5 + [MiB, 40 * MiB]),
        reserved=tuple([MiB, 10 * MiB] * 5 + [MiB, 40 * MiB]),
        steps=(1.5, 3.5, 5.5, 7.5, 9.5),
    )
    ctx = DiagnosisContext(source="trainer.train()\n", timeline=outlier, limit=32 * MiB, trains=True)
    long = finding_of(diagnose(None, ctx), "long_samples")
    assert [r.kind for r in long.remedies] == ["truncate"] and "The batch it failed on" not in long.evidence


def test_long_samples_quiet_when_the_steps_are_even(shell, run_cell):
    from oommagic.diagnosis.findings import DiagnosisContext
    from oommagic.diagnosis.rules import diagnose
    from oommagic.timeline import Timeline

    even = Timeline(
        t=tuple(range(12)),
        allocated=tuple([MiB, 10 * MiB] * 6),
        reserved=tuple([MiB, 10 * MiB] * 6),
        steps=(1.5, 3.5, 5.5, 7.5, 9.5),
    )
    ctx = DiagnosisContext(source=LONG_BATCH, timeline=even, limit=12 * MiB, trains=True)
    assert "long_samples" not in {f.key for f in diagnose(None, ctx)}


def test_autograd_quiet_for_a_cell_that_runs_no_model(shell, run_cell, deep2):
    run_cell(f"%%gpumem --limit {limit_above(MiB)} --plan-budget 0 --quiet\nz8 = torch.zeros(2 * 2**20)")
    run = last_run()
    assert run.outcome == "oom" and any(m.name == "deep2" for m in run.context.models)
    assert "autograd" not in {f.key for f in run.findings}
