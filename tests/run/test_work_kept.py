"""The first offered fix fits and keeps the cell's work, counted as a person would: the optimizer steps
taken and the samples that reached the model's forward in training, over the click's run alone. Shapes the
hold-out found without a fitting first click: a step whose batch is sliced off a tensor by the cell itself
(slice arithmetic, a permutation cut, a moving window); a loop that already accumulates gradients with its
own counter under names the product does not know; a Lightning ``validate``/``fit`` given a loader made in
an earlier cell."""

from __future__ import annotations

import pytest

from tests.run.work import counted, failed_and_first

pytestmark = pytest.mark.usefixtures("fresh_names")


def fail_then_click(
    shell, run_cell, cell: str, model: str, room: float = 0.6, training: bool = True, between: str = ""
):
    """Run ``cell`` once to size a limit (``room`` of what it grew by, above what was held), run
    ``between``, fail the cell under that limit, press the report's first fix and count the work of the
    cell as written and of the click (``model``: the module whose forwards count, a dotted name)."""
    module = eval(model, dict(shell.user_ns))
    with counted(module, training) as written:
        run_cell("%%gpumem --quiet -o _probe_run\n" + cell)
    probe = shell.user_ns.pop("_probe_run")
    assert probe.outcome == "ok", probe.headline()
    limit = (probe.before_allocated + room * (probe.peak_allocated - probe.before_allocated)) / 2**20
    run_cell(between)
    # A budget well above the trials' few seconds: on a loaded machine a plan cut short says "not measured".
    _, widget, first = failed_and_first(shell, run_cell, cell, limit, budget=120)
    with counted(module, training) as clicked:
        fitted = widget.click(first.kind)
    return first, fitted, written, clicked


# --- 1. a step's batch sliced off a tensor by the cell ------------------------------------------------

LM_SETUP = """
import torch.nn.functional as F
torch.manual_seed(0)
class WordLM(torch.nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, width)
        self.out = torch.nn.Linear(width, vocab)
    def forward(self, ids):
        return self.out(torch.tanh(self.emb(ids)))
word_lm = WordLM(4000, 32)
adam = torch.optim.Adam(word_lm.parameters(), lr=1e-3)
stream = torch.randint(0, 4000, (64, 33))
"""
LM_CELL = """\
mb = 32
for it in range(2):
    chunk = stream[it * mb:(it + 1) * mb]
    logits = word_lm(chunk[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))
    loss.backward()
    adam.step()
    adam.zero_grad()
"""
PERM_SETUP = """
torch.manual_seed(0)
clf = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024),
                          torch.nn.ReLU(), torch.nn.Linear(1024, 10))
sgd = torch.optim.SGD(clf.parameters(), lr=0.05)
feats = torch.randn(4096, 256)
labels = torch.randint(0, 10, (4096,))
"""
PERM_CELL = """\
n_batch = 2048
for step in range(2):
    idx = torch.randperm(len(feats))[:n_batch]
    xb, yb = feats[idx], labels[idx]
    sgd.zero_grad()
    loss = torch.nn.functional.cross_entropy(clf(xb), yb)
    loss.backward()
    sgd.step()
"""
WINDOW_SETUP = """
torch.manual_seed(0)
ae = torch.nn.Sequential(torch.nn.Linear(128, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 128))
opt_ae = torch.optim.AdamW(ae.parameters(), lr=1e-3)
corpus = torch.randn(8192, 128)
"""
WINDOW_CELL = """\
window = 4096
pos = 0
while pos < 2 * window:
    seq = corpus[pos:pos + window]
    recon = ae(seq)
    loss = ((recon - seq) ** 2).mean()
    loss.backward()
    opt_ae.step()
    opt_ae.zero_grad()
    pos += window
"""


@pytest.mark.parametrize(
    "setup, cell, model, inputs",
    [
        (LM_SETUP, LM_CELL, "word_lm", "(chunk)"),
        (PERM_SETUP, PERM_CELL, "clf", "(xb, yb)"),
        (WINDOW_SETUP, WINDOW_CELL, "ae", "(seq)"),
    ],
    ids=["slice-arithmetic-lm", "randperm-cut", "moving-window"],
)
def test_a_step_whose_batch_the_cell_slices_runs_on_micro_batches_and_keeps_its_work(
    shell, run_cell, setup, cell, model, inputs
):
    run_cell(setup)
    fix, fitted, written, clicked = fail_then_click(shell, run_cell, cell, model)
    assert fix.kind == "batch" and fix.verdict == "fits", (fix.title, fix.verdict)
    assert "micro-batches" in fix.title and fix.title.endswith(inputs), fix.title
    assert fitted.outcome == "ok", fitted.headline()
    assert ".split(" in fitted.source and "tensor_split" not in fitted.source, fitted.source
    assert written["steps"] == 2 and clicked == written, (clicked, written)


# --- 3. a loop that accumulates gradients with its own counter -----------------------------------------

ACCUM_SETUP = """
from torch.utils.data import DataLoader, TensorDataset
torch.manual_seed(0)
mlp = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512),
                          torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU(),
                          torch.nn.Linear(512, 8))
mlp_opt = torch.optim.SGD(mlp.parameters(), lr=0.01)
points = TensorDataset(torch.randn(2048, 64), torch.randint(0, 8, (2048,)))
loss_fn = torch.nn.CrossEntropyLoss()
"""
# An accumulation count under a name of the person's own, an `(i + 1) % n` test.
ACCUM_ENUMERATE = """\
accum = 2
loader = DataLoader(points, batch_size=512)
for i, (xb, yb) in enumerate(loader):
    loss = loss_fn(mlp(xb), yb) / accum
    loss.backward()
    if (i + 1) % accum == 0:
        mlp_opt.step()
        mlp_opt.zero_grad()
"""
# The person's counter is called `micro_step`, the name the product's own accumulation would take.
ACCUM_COUNTER = """\
every = 2
micro_step = 0
for xb, yb in DataLoader(points, batch_size=512, shuffle=True):
    (loss_fn(mlp(xb), yb) / every).backward()
    micro_step += 1
    if micro_step % every == 0:
        mlp_opt.step()
        mlp_opt.zero_grad()
print(micro_step, "micro-steps")
"""
# Literal numbers only: the modulus and the loss's divisor.
ACCUM_LITERAL = """\
for batch_idx, (xb, yb) in enumerate(DataLoader(points, batch_size=512)):
    out = mlp(xb)
    loss = loss_fn(out, yb) / 2
    loss.backward()
    if (batch_idx + 1) % 2 == 0:
        mlp_opt.step()
        mlp_opt.zero_grad()
"""


@pytest.mark.parametrize(
    "cell",
    [ACCUM_ENUMERATE, ACCUM_COUNTER, ACCUM_LITERAL],
    ids=["named-accum", "micro-step-counter", "literal"],
)
def test_a_loop_with_its_own_accumulation_gets_it_scaled_and_keeps_its_steps_and_samples(
    shell, run_cell, cell
):
    run_cell(ACCUM_SETUP)
    fix, fitted, written, clicked = fail_then_click(shell, run_cell, cell, "mlp")
    assert fix.kind == "batch" and fix.verdict == "fits", (fix.title, fix.verdict)
    assert fitted.outcome == "ok", fitted.headline()
    assert written == {"steps": 2, "samples": 2048} and clicked == written, (clicked, written, fitted.source)


# --- 2. a loader made in an earlier cell, handed to Lightning ------------------------------------------

LIT_SETUP = """
import lightning as L
from torch.utils.data import DataLoader, TensorDataset
import torch.nn.functional as F
torch.manual_seed(0)
class LitNet(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.GELU(),
                                        torch.nn.Linear(1024, 1024), torch.nn.GELU(),
                                        torch.nn.Linear(1024, 1))
    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.body(x).squeeze(-1), y)
    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_mse", F.mse_loss(self.body(x).squeeze(-1), y))
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)
lit_net = LitNet()
rows = TensorDataset(torch.randn(4096, 64), torch.randn(4096))
train_loader = DataLoader(rows, batch_size=2048)
scoring_loader = DataLoader(rows, batch_size=4096)
"""
LIT_TRAINER = """
lit_trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, max_epochs=1)
"""


def test_a_loader_of_an_earlier_cell_handed_to_lightnings_fit_is_rebatched_with_accumulation(shell, run_cell):
    pytest.importorskip("lightning")
    run_cell(LIT_SETUP + LIT_TRAINER)
    # The trainer has finished its one epoch after the sizing run: a new one, as a person would make.
    fix, fitted, written, clicked = fail_then_click(
        shell, run_cell, "lit_trainer.fit(lit_net, train_loader)", "lit_net.body", between=LIT_TRAINER
    )
    assert fix.kind == "batch" and fix.verdict == "fits" and "accumulate" in fix.title, (
        fix.title,
        fix.verdict,
    )
    assert fitted.outcome == "ok", fitted.headline()
    assert written == {"steps": 2, "samples": 4096} and clicked == written, (clicked, written)
    # The cell says what runs: the loader re-batched and the trainer's accumulation beside it.
    assert "oommagic.rebatched(train_loader," in fitted.source, fitted.source
    assert "lit_trainer.accumulate_grad_batches = " in fitted.source, fitted.source
    assert shell.user_ns["lit_trainer"].accumulate_grad_batches > 1


@pytest.mark.parametrize(
    "passed", ["dataloaders=scoring_loader", "scoring_loader"], ids=["keyword", "position"]
)
def test_a_loader_of_an_earlier_cell_handed_to_lightnings_validate_is_rebatched_and_scores_every_row(
    shell, run_cell, passed
):
    pytest.importorskip("lightning")
    run_cell(LIT_SETUP + LIT_TRAINER)
    fix, fitted, written, clicked = fail_then_click(
        shell,
        run_cell,
        f"scores = lit_trainer.validate(lit_net, {passed}, verbose=False)",
        "lit_net.body",
        room=0.2,  # an eighth of the batch or less: the search halves more than once
        training=False,
    )
    assert fix.kind in ("eval_batch", "batch") and fix.verdict == "fits", (fix.title, fix.verdict)
    assert fitted.outcome == "ok", fitted.headline()
    assert written["samples"] == 4096 and clicked == written, (clicked, written)
    assert shell.user_ns["scores"][0]["val_mse"] > 0
    assert "batch_size=2048" not in fitted.source, fitted.source
