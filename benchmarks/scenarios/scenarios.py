"""The scenario notebooks, as data: each one is a few setup cells (model built from a config, data made
in-process, the emulated card sized from probe runs), then ONE ``%%gpumem --limit`` cell that runs out of
memory, written the way people write notebooks.

``SCENARIO_SCALE=cpu|gpu`` picks the sizes inside the notebook (``S``); ``SCENARIO_PLAN_BUDGET`` the
``--plan-budget`` of the failing cell. ``notebook(name)`` builds the ``.ipynb``; ``write_all(folder)``
writes every one of them (``python benchmarks/scenarios/scenarios.py OUT_DIR``).

``fit``: True where a fit exists (a change the scenario's author knows makes the cell fit), False for the
ones that cannot fit whatever the setting.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

PREAMBLE = '''import os, math, time, itertools
import torch, oommagic
import torch.nn as nn
import torch.nn.functional as F

SCALE = os.environ.get("SCENARIO_SCALE", "cpu")
device = "cuda" if SCALE == "gpu" and torch.cuda.is_available() else "cpu"
PLAN = os.environ.get("SCENARIO_PLAN_BUDGET", "30")
torch.manual_seed(0)
S = {sizes}[SCALE]


def mib(nbytes):
    return f"{{max(int(nbytes / 2**20), 1)}}MiB"


def card_for(small, large, b_small, b_large, batch, room=1.2):
    """An emulated card that holds `batch` samples, from the line through two probe runs."""
    per = max(large.peak_reserved - small.peak_reserved, 1) / (b_large - b_small)
    base = small.peak_reserved - per * b_small
    return base, per, base + per * batch * room
'''

GPT2 = """import transformers
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model
transformers.logging.set_verbosity_error()
config = GPT2Config(n_layer=S["layers"], n_embd=S["embd"], n_head=S["heads"], vocab_size=S["vocab"],
                    n_positions=S["seq"])
"""

TRAINER = """from transformers import Trainer, TrainingArguments


def training_args(**kw):
    base = dict(output_dir="/tmp/scenario-out", max_steps=2, report_to=[], save_strategy="no",
                logging_strategy="no", disable_tqdm=True, use_cpu=(device == "cpu"))
    return TrainingArguments(**{**base, **kw})


ids = torch.randint(0, S["vocab"], (S["n"], S["seq"]))
dataset = [{"input_ids": x, "labels": x} for x in ids]
"""

CLASSIFIER = """class TextClassifier(nn.Module):
    def __init__(self, vocab, dim, layers, classes=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        block = nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=4 * dim, batch_first=True)
        self.encoder = nn.TransformerEncoder(block, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, x):
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


X = torch.randint(0, S["vocab"], (S["n"], S["seq"]))
y = torch.randint(0, 4, (S["n"],))
"""

GPT2_SIZES_CPU = dict(layers=2, embd=128, heads=4, vocab=1000, seq=128, n=256)
GPT2_SIZES_GPU = dict(layers=6, embd=512, heads=8, vocab=8000, seq=512, n=1024)


@dataclass
class Scenario:
    name: str
    title: str
    cells: list[str]
    cpu: dict
    gpu: dict
    fit: bool = True
    needs: tuple[str, ...] = ()
    gpu_only: bool = False
    expect: str = ""  # the fix the scenario's author would apply
    notes: str = ""
    extra: list[str] = field(default_factory=list)
    control: str = ""  # the cell with the author's fix: run last, under the same LIMIT, to show a fit exists
    # The work the cell does, to check the accepted run kept it: "steps" and "samples" (expressions in S:
    # optimizer steps and training samples the cell takes), "check" (an expression over the notebook's
    # names that is true after a run that did the whole work, e.g. "len(embeddings) == 192").
    work: dict = field(default_factory=dict)


# A setup cell that fails on purpose (the error is part of the story, e.g. an earlier out-of-memory error
# in a cell without %%gpumem): it starts with this comment.
EXPECTED_ERROR = "# this cell fails on purpose"


def oom(body: str) -> str:
    return "%%gpumem --limit $LIMIT --plan-budget $PLAN\n" + body.strip("\n")


def probe(name: str, body: str) -> str:
    return f"%%gpumem --quiet -o {name}\n" + body.strip("\n")


SCENARIOS: list[Scenario] = []


def add(*a, **kw) -> None:
    SCENARIOS.append(Scenario(*a, **kw))


# A GPT-2 with AdamW, measured over two training steps (`p_train`): the cells scenarios size their limit from.
def gpt2_trained(first: str = GPT2, batch: str = 'S["batch"]') -> list:
    """The setup cell ``first`` (GPT-2's imports and config), the model with its optimizer, and the probe
    of two training steps at ``batch`` (source text)."""
    return [
        first,
        probe(
            "setup",
            """
model = GPT2LMHeadModel(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)""",
        ),
        probe(
            "p_train",
            f"""
for step in range(2):
    ids = torch.randint(0, S["vocab"], ({batch}, S["seq"]), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()""",
        ),
    ]


GPT2_TRAINED = gpt2_trained()


# 1. HF Trainer, training ----------------------------------------------------------------------------------
add(
    "hf_trainer_train",
    "HF Trainer.train with a per-device batch too large",
    [
        GPT2 + TRAINER,
        probe(
            "p2",
            """
model = GPT2LMHeadModel(config)
Trainer(model=model, args=training_args(per_device_train_batch_size=2), train_dataset=dataset).train()""",
        ),
        probe(
            "p4",
            """
Trainer(model=model, args=training_args(per_device_train_batch_size=4), train_dataset=dataset).train()""",
        ),
        """_, _, card = card_for(p2, p4, 2, 4, batch=8)
LIMIT = mib(card)
trainer = Trainer(model=model, args=training_args(per_device_train_batch_size=S["batch"], max_steps=S["steps"]),
                  train_dataset=dataset)
LIMIT""",
        oom("trainer.train()"),
    ],
    cpu={**GPT2_SIZES_CPU, "batch": 64, "steps": 3},
    gpu={**GPT2_SIZES_GPU, "batch": 64, "steps": 3},
    expect="batch (per_device_train_batch_size, with gradient_accumulation_steps)",
)

# 2. HF Trainer, evaluation --------------------------------------------------------------------------------
add(
    "hf_trainer_eval",
    "HF Trainer.evaluate with per_device_eval_batch_size too large",
    [
        GPT2 + TRAINER,
        probe(
            "p4",
            """
model = GPT2LMHeadModel(config)
Trainer(model=model, args=training_args(per_device_eval_batch_size=4), eval_dataset=dataset[:8]).evaluate()""",
        ),
        probe(
            "p8",
            """
Trainer(model=model, args=training_args(per_device_eval_batch_size=8), eval_dataset=dataset[:16]).evaluate()""",
        ),
        """_, _, card = card_for(p4, p8, 4, 8, batch=16)
LIMIT = mib(card)
trainer = Trainer(model=model, args=training_args(per_device_eval_batch_size=S["batch"]), eval_dataset=dataset)
LIMIT""",
        oom("metrics = trainer.evaluate()\nmetrics"),
    ],
    cpu={**GPT2_SIZES_CPU, "batch": 128},
    gpu={**GPT2_SIZES_GPU, "batch": 256},
    expect="batch (per_device_eval_batch_size)",
)

# 3. A plain PyTorch training loop ---------------------------------------------------------------------------
LOOP = """
batch_size = {B}
model.train()
for step in range(S["steps"]):
    idx = torch.randint(0, len(X), (batch_size,))
    xb, yb = X[idx].to(device), y[idx].to(device)
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(f"loss {loss.item():.3f}")"""
add(
    "plain_loop",
    "hand-written training loop (nn.TransformerEncoder, AdamW), batch too large",
    [
        CLASSIFIER,
        probe(
            "setup",
            """
model = TextClassifier(S["vocab"], S["dim"], S["layers"]).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4)""",
        ),
        probe("p2", LOOP.replace("{B}", "2")),
        probe("p4", LOOP.replace("{B}", "4")),
        "_, _, card = card_for(p2, p4, 2, 4, batch=8)\nLIMIT = mib(card)\nLIMIT",
        oom(LOOP.replace("{B}", "S['batch']")),
    ],
    cpu=dict(vocab=1000, dim=128, layers=2, seq=128, n=512, batch=128, steps=3),
    gpu=dict(vocab=8000, dim=512, layers=8, seq=512, n=2048, batch=256, steps=3),
    expect="batch (with accumulation)",
)

# 4. Lightning Trainer.fit ------------------------------------------------------------------------------------
add(
    "lightning_fit",
    "Lightning Trainer.fit, DataLoader batch too large",
    [
        CLASSIFIER
        + """import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class LitClassifier(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = TextClassifier(S["vocab"], S["dim"], S["layers"])

    def training_step(self, batch, batch_idx):
        xb, yb = batch
        return F.cross_entropy(self.net(xb), yb)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-4)


def make_trainer(steps):
    return L.Trainer(max_steps=steps, accelerator="gpu" if device == "cuda" else "cpu", devices=1,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False)


train_ds = TensorDataset(X, y)
lit = LitClassifier()
""",
        probe("p2", "make_trainer(2).fit(lit, DataLoader(train_ds, batch_size=2))"),
        probe("p4", "make_trainer(2).fit(lit, DataLoader(train_ds, batch_size=4))"),
        "_, _, card = card_for(p2, p4, 2, 4, batch=8)\nLIMIT = mib(card)\nLIMIT",
        oom("""
train_loader = DataLoader(train_ds, batch_size=S["batch"], shuffle=True)
trainer = make_trainer(S["steps"])
trainer.fit(lit, train_loader)"""),
    ],
    cpu=dict(vocab=1000, dim=128, layers=2, seq=128, n=512, batch=128, steps=3),
    gpu=dict(vocab=8000, dim=512, layers=8, seq=512, n=2048, batch=256, steps=3),
    needs=("lightning",),
    expect="batch (DataLoader batch_size, accumulate_grad_batches)",
)

# 5. A CNN (torchvision ResNet-18 when present, else a hand-written one) -----------------------------------------
CNN_LOOP = """
batch_size = {B}
model.train()
for step in range(S["steps"]):
    images = torch.randn(batch_size, 3, S["px"], S["px"], device=device)
    labels = torch.randint(0, 10, (batch_size,), device=device)
    loss = criterion(model(images), labels)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()"""
add(
    "cnn_train",
    "image classifier training (ResNet-18 if torchvision, else a VGG-style CNN), batch too large",
    [
        """try:
    from torchvision.models import resnet18
    def make_model():
        return resnet18(num_classes=10)
    ARCH = "torchvision resnet18"
except ImportError:
    def make_model():
        layers, c = [], 3
        for out in (32, 64, 128, 256):
            layers += [nn.Conv2d(c, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(),
                       nn.Conv2d(out, out, 3, padding=1), nn.BatchNorm2d(out), nn.ReLU(), nn.MaxPool2d(2)]
            c = out
        return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))
    ARCH = "hand-written CNN (no torchvision)"
criterion = nn.CrossEntropyLoss()
print(ARCH)""",
        probe(
            "setup",
            """
model = make_model().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)""",
        ),
        probe("p2", CNN_LOOP.replace("{B}", "2")),
        probe("p4", CNN_LOOP.replace("{B}", "4")),
        "_, _, card = card_for(p2, p4, 2, 4, batch=8)\nLIMIT = mib(card)\nLIMIT",
        oom(CNN_LOOP.replace("{B}", "S['batch']")),
    ],
    cpu=dict(px=64, batch=256, steps=2),
    gpu=dict(px=224, batch=512, steps=2),
    expect="batch",
)

# 6. generate() with beams and long outputs ------------------------------------------------------------------
GEN = """
outputs = model.generate(prompts[:{B}], attention_mask=torch.ones_like(prompts[:{B}]), num_beams=S["beams"],
                         max_new_tokens=S["new"], min_new_tokens=S["new"], do_sample=False,
                         pad_token_id=0)
outputs.shape"""
add(
    "generate_beams",
    "model.generate with beam search and long outputs for a batch of prompts",
    [
        GPT2,
        probe(
            "setup",
            """
model = GPT2LMHeadModel(config).to(device).eval()
prompts = torch.randint(1, S["vocab"], (S["batch"], S["prompt"]), device=device)""",
        ),
        probe("p1", GEN.replace("{B}", "1")),
        probe("p2", GEN.replace("{B}", "2")),
        "_, _, card = card_for(p1, p2, 1, 2, batch=4)\nLIMIT = mib(card)\nLIMIT",
        oom(GEN.replace("{B}", "S['batch']").replace("prompts[:S['batch']]", "prompts")),
    ],
    cpu={**GPT2_SIZES_CPU, "seq": 256, "batch": 32, "prompt": 32, "new": 96, "beams": 4},
    gpu={**GPT2_SIZES_GPU, "seq": 1024, "batch": 32, "prompt": 128, "new": 384, "beams": 8},
    expect="smaller batch of prompts / fewer beams",
)

# 7. A loop that keeps tensors: losses.append(loss) -------------------------------------------------------------
VAL = """
model.eval()
losses = []
for i in range(0, len(val_ids), {B}):
    batch = val_ids[i:i + {B}].to(device)
    loss = model(input_ids=batch, labels=batch).loss
    losses.append(loss)
print("val loss", torch.stack(losses).mean().item())"""
add(
    "keeps_losses",
    "validation loop that keeps every loss tensor (losses.append(loss)) with its graph",
    [
        GPT2 + 'val_ids = torch.randint(0, S["vocab"], (S["n"], S["seq"]))\n',
        probe("setup", "model = GPT2LMHeadModel(config).to(device)"),
        probe("p1", VAL.replace("{B}", "S['batch']").replace("len(val_ids)", "S['batch']")),
        "del losses, loss  # the probe's graph\nLIMIT = mib(p1.peak_reserved * 1.5)\nLIMIT",
        oom(VAL.replace("{B}", "S['batch']")),
    ],
    cpu={**GPT2_SIZES_CPU, "n": 256, "batch": 16},
    gpu={**GPT2_SIZES_GPU, "n": 1024, "batch": 16},
    expect="losses.append(loss.item()) or torch.no_grad()",
)

# 8. Evaluation without no_grad -------------------------------------------------------------------------------
EVAL = """
model.eval()
correct = 0
for i in range(0, len(X), {B}):
    logits = model(X[i:i + {B}].to(device))
    correct += (logits.argmax(-1).cpu() == y[i:i + {B}]).sum().item()
print("accuracy", correct / len(X))"""
add(
    "eval_no_grad",
    "evaluation loop without torch.no_grad (activations saved for a backward that never comes)",
    [
        CLASSIFIER,
        probe("setup", "model = TextClassifier(S['vocab'], S['dim'], S['layers']).to(device)"),
        probe(
            "p1",
            "with torch.no_grad():\n"
            + "\n".join(
                "    " + l
                for l in EVAL.replace("{B}", "S['batch']")
                .replace("len(X)", "S['batch']")
                .strip("\n")
                .splitlines()
            ),
        ),
        "LIMIT = mib(p1.peak_reserved * 1.6)\nLIMIT",
        oom(EVAL.replace("{B}", "S['batch']")),
    ],
    cpu=dict(vocab=1000, dim=128, layers=4, seq=256, n=256, batch=128),
    gpu=dict(vocab=8000, dim=512, layers=8, seq=512, n=1024, batch=256),
    expect="torch.no_grad() / inference_mode",
)

# 9. A long-sample outlier batch ------------------------------------------------------------------------------
add(
    "outlier_batch",
    "embedding extraction over documents padded per batch; one document is many times longer",
    [
        GPT2
        + """lengths = torch.randint(S["short"] // 2, S["short"], (S["n"],))
lengths[S["n"] * 2 // 3] = S["seq"]  # one long document, two thirds of the way in
docs = [torch.randint(1, S["vocab"], (int(n),)) for n in lengths]


def pad(batch):
    width = max(len(d) for d in batch)
    ids = torch.zeros(len(batch), width, dtype=torch.long)
    mask = torch.zeros(len(batch), width, dtype=torch.long)
    for row, d in enumerate(batch):
        ids[row, :len(d)] = d
        mask[row, :len(d)] = 1
    return ids, mask
""",
        probe("setup", "encoder = GPT2Model(config).to(device).eval()"),
        probe(
            "p1",
            """
with torch.no_grad():
    ids, mask = pad(docs[:S["batch"] // 4 - 1] + [docs[S["n"] * 2 // 3]])
    encoder(input_ids=ids.to(device), attention_mask=mask.to(device))""",
        ),
        "LIMIT = mib(p1.peak_reserved * 1.3)\nLIMIT",
        oom("""
batch_size = S["batch"]
embeddings = []
with torch.no_grad():
    for i in range(0, len(docs), batch_size):
        ids, mask = pad(docs[i:i + batch_size])
        hidden = encoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        embeddings.append((hidden * mask.to(device)[..., None]).sum(1).cpu())
embeddings = torch.cat(embeddings)
embeddings.shape"""),
    ],
    cpu={**GPT2_SIZES_CPU, "seq": 512, "short": 48, "n": 192, "batch": 32},
    gpu={**GPT2_SIZES_GPU, "seq": 2048, "short": 192, "n": 768, "batch": 64},
    expect="smaller batch (or sort by length / truncate)",
)

# 10. Weights too large in fp32; bf16 fits ----------------------------------------------------------------------
WEIGHTS = """
model = AutoModelForCausalLM.from_config(config).to(device)
model.eval()
with torch.no_grad():
    out = model(input_ids=sample.to(device))
print(out.logits.shape)"""
add(
    "weights_fp32",
    "model built in fp32 does not fit; in bf16 it does",
    [
        GPT2
        + """from transformers import AutoModelForCausalLM
with torch.device("meta"):
    n_params = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
sample = torch.randint(0, S["vocab"], (1, 64))
LIMIT = mib(n_params * 4 * 0.75)  # fp32 weights are 4/3 of the card, bf16 weights 2/3
print(f"{n_params / 1e6:.1f}M parameters, card {LIMIT}")""",
        oom(WEIGHTS),
    ],
    cpu=dict(layers=4, embd=256, heads=4, vocab=8000, seq=256),
    gpu=dict(layers=12, embd=768, heads=12, vocab=32000, seq=1024),
    expect="bf16 weights (dtype=torch.bfloat16)",
)

# 11. Leftovers of earlier cells -------------------------------------------------------------------------------
add(
    "leftovers",
    "an earlier cell's hidden-state cache is still bound when the training cell runs",
    [
        *GPT2_TRAINED,
        "LIMIT = mib(p_train.peak_reserved * 1.25)\nrows = max(int(p_train.peak_reserved * 0.8 / (S['seq'] * S['embd'] * 4)), 1)\nLIMIT, rows",
        probe(
            "features",
            """
# hidden states of a slice of the corpus, for a probing experiment
with torch.no_grad():
    corpus = torch.randint(0, S["vocab"], (rows, S["seq"]), device=device)
    hidden_cache = torch.cat([model.transformer(input_ids=corpus[i:i + 8]).last_hidden_state
                              for i in range(0, rows, 8)])
hidden_cache.shape""",
        ),
        oom("""
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (S["batch"], S["seq"]), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(loss.item())"""),
    ],
    cpu={**GPT2_SIZES_CPU, "batch": 8, "steps": 3},
    gpu={**GPT2_SIZES_GPU, "batch": 8, "steps": 3},
    expect="free hidden_cache (del + empty_cache)",
)

# 12. Another process holds memory (GPU only) -------------------------------------------------------------------
add(
    "other_process",
    "another process on the same GPU holds most of it; the training cell gets what is left",
    [
        *gpt2_trained(
            GPT2
            + '''import subprocess, sys
HOLDER = """
import os, sys, time, torch
x = torch.empty(int(sys.argv[1]), dtype=torch.uint8, device="cuda")
print("holding", flush=True)
parent = os.getppid()
for _ in range(900):
    if os.getppid() != parent:
        break
    time.sleep(1)
"""''',
            batch="8",
        ),
        """torch.cuda.empty_cache()
free, total = torch.cuda.mem_get_info()
leave = int(p_train.peak_reserved * 1.3) - torch.cuda.memory_reserved()
holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(free - leave - 600 * 2**20)], stdout=subprocess.PIPE, text=True)
print(holder.stdout.readline().strip(), torch.cuda.mem_get_info())""",
        """%%gpumem --plan-budget $PLAN
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (S["batch"], S["seq"]), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(loss.item())""",
    ],
    cpu={**GPT2_SIZES_CPU, "batch": 64, "steps": 3},
    gpu={**GPT2_SIZES_GPU, "batch": 64, "steps": 3},
    gpu_only=True,
    expect="smaller batch (or stop the other process)",
    extra=["holder.kill()"],
)

# 13. Two fixes: checkpointing + smaller batch -------------------------------------------------------------------
CK = """
batch_size = {B}
model.train()
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (batch_size, S["seq"]), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()"""
add(
    "two_fixes_ckpt_batch",
    "long-context training: batch 1 alone does not fit, checkpointing alone does not; both do",
    [
        GPT2 + "config.use_cache = False\n",
        probe(
            "setup",
            """
model = GPT2LMHeadModel(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)""",
        ),
        probe("p1", CK.replace("{B}", "1")),
        # The next probe's reserved peak starts from what the allocator caches: give the cache back first.
        """model.gradient_checkpointing_enable()
if device == "cuda":
    torch.cuda.empty_cache()""",
        probe("p_ck", CK.replace("{B}", "2")),
        '''model.gradient_checkpointing_disable()
LIMIT = mib((p_ck.peak_reserved + p1.peak_reserved) / 2)
print("batch 1:", mib(p1.peak_reserved), "checkpointed batch 2:", mib(p_ck.peak_reserved), "card:", LIMIT)
assert p_ck.peak_reserved < p1.peak_reserved, "checkpointing does not save enough at this size"''',
        oom(CK.replace("{B}", "S['batch']")),
    ],
    cpu=dict(layers=8, embd=128, heads=4, vocab=500, seq=512, batch=16, steps=2),
    gpu=dict(layers=12, embd=512, heads=8, vocab=2000, seq=2048, batch=16, steps=2),
    expect="gradient checkpointing + smaller batch",
)

# 14. Two fixes: leftovers + smaller batch -----------------------------------------------------------------------
LB = """
model.eval()
total = 0.0
with torch.no_grad():
    for i in range(0, len(X), {B}):
        logits = model(X[i:i + {B}].to(device))
        total += F.cross_entropy(logits, y[i:i + {B}].to(device), reduction="sum").item()
print("eval loss", total / len(X))"""
add(
    "two_fixes_leftover_batch",
    "an earlier cell's embedding table is still bound and the eval batch is too large: both must go",
    [
        CLASSIFIER,
        probe("setup", "model = TextClassifier(S['vocab'], S['dim'], S['layers']).to(device)"),
        probe("p2", LB.replace("{B}", "2").replace("len(X)", "2")),
        probe("p4", LB.replace("{B}", "4").replace("len(X)", "4")),
        """base, per, card = card_for(p2, p4, 2, 4, batch=8)
LIMIT = mib(card)
rows = max(int((card - base) / (S["seq"] * S["dim"] * 4)), 1)
LIMIT, rows""",
        probe(
            "table",
            """
# token embeddings of a slice of the data, kept for a nearest-neighbour look-up
with torch.no_grad():
    token_table = torch.cat([model.embed(X[i:i + 16].to(device)) for i in range(0, rows, 16)])
token_table.shape""",
        ),
        oom(LB.replace("{B}", "S['batch']")),
    ],
    cpu=dict(vocab=1000, dim=128, layers=2, seq=256, n=256, batch=128),
    gpu=dict(vocab=8000, dim=512, layers=8, seq=512, n=1024, batch=256),
    expect="free token_table + smaller batch",
)

# 15. Unfittable: the weights alone exceed the card in every dtype -------------------------------------------------
add(
    "unfit_weights",
    "the model's weights exceed the card even in bf16",
    [
        GPT2
        + """from transformers import AutoModelForCausalLM
with torch.device("meta"):
    n_params = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
sample = torch.randint(0, S["vocab"], (1, 64))
LIMIT = mib(n_params * 2 * 0.6)  # bf16 weights alone are 5/3 of the card
print(f"{n_params / 1e6:.1f}M parameters, card {LIMIT}")""",
        oom(WEIGHTS),
    ],
    cpu=dict(layers=4, embd=256, heads=4, vocab=8000, seq=256),
    gpu=dict(layers=12, embd=768, heads=12, vocab=32000, seq=1024),
    fit=False,
    expect="nothing fits (a smaller model, quantization or offloading)",
)

# 16. Unfittable: memory grows without bound -----------------------------------------------------------------------
add(
    "unfit_growth",
    "features of an endless stream collected on the device: the cell grows until the card is full",
    [
        GPT2
        + """def stream(batch_size):
    while True:  # a streaming dataset with no end
        yield torch.randint(0, S["vocab"], (batch_size, S["seq"]))
""",
        probe("setup", "encoder = GPT2Model(config).to(device).eval()"),
        "LIMIT = mib(setup.peak_reserved + 40 * S['batch'] * S['seq'] * S['embd'] * 4)\nLIMIT",
        oom("""
features = []
with torch.no_grad():
    for batch in stream(S["batch"]):
        features.append(encoder(input_ids=batch.to(device)).last_hidden_state)
len(features)"""),
    ],
    cpu={**GPT2_SIZES_CPU, "batch": 8},
    gpu={**GPT2_SIZES_GPU, "batch": 8},
    fit=False,
    expect="nothing fits (the loop has no end)",
)

# 17. Training loop that keeps logits for a metric ------------------------------------------------------------------
add(
    "keeps_logits",
    "training loop that keeps every batch's logits (with their graph) for an epoch-end accuracy",
    [
        GPT2,
        probe(
            "setup",
            """
model = GPT2LMHeadModel(config).to(device)
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
train_ids = torch.randint(0, S["vocab"], (S["n"], S["seq"]))""",
        ),
        probe(
            "p1",
            """
for i in range(0, 2 * S["batch"], S["batch"]):
    batch = train_ids[i:i + S["batch"]].to(device)
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()""",
        ),
        "LIMIT = mib(p1.peak_reserved * 1.5)\nLIMIT",
        oom("""
all_logits = []
model.train()
for i in range(0, len(train_ids), S["batch"]):
    batch = train_ids[i:i + S["batch"]].to(device)
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    all_logits.append(out.logits)
accuracy = (torch.cat(all_logits)[:, :-1].argmax(-1).cpu() == train_ids[:, 1:]).float().mean()
print("train accuracy", accuracy.item())"""),
    ],
    cpu={**GPT2_SIZES_CPU, "n": 256, "batch": 8},
    gpu={**GPT2_SIZES_GPU, "n": 512, "batch": 8},
    expect="all_logits.append(out.logits.argmax(-1).cpu()) (keep predictions, not logits)",
)


# 18. Memory pinned by an earlier error in a cell without %%gpumem (GPU only: the CPU tracker sees only the
# tensors made under the magic) ---------------------------------------------------------------------------
add(
    "pinned_by_earlier_error",
    "a first try without %%gpumem ran out of memory; its traceback still holds a large buffer",
    [
        *GPT2_TRAINED,
        """LIMIT = mib(p_train.peak_reserved * 1.25)
HELD = int(p_train.peak_reserved * 0.6)


def embed_corpus(n_bytes):
    buffer = torch.empty(n_bytes, dtype=torch.uint8, device=device)  # staging buffer for the corpus
    expanded = torch.empty(1 << 44, dtype=torch.uint8, device=device)  # far more than any card holds
    return buffer, expanded
LIMIT""",
        EXPECTED_ERROR + "\nembed_corpus(HELD)",
        oom("""
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (S["batch"], S["seq"]), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
print(loss.item())"""),
    ],
    cpu={**GPT2_SIZES_CPU, "batch": 8, "steps": 3},
    gpu={**GPT2_SIZES_GPU, "batch": 8, "steps": 3},
    gpu_only=True,
    expect="%gpumem --free (the earlier traceback's buffer)",
)

# 19. One request larger than the budget: the logits of every position, where only the last is read -------------
add(
    "logits_one_request",
    "scoring the next token of long prompts: the logits of every position are one request larger than the card",
    [
        GPT2,
        probe("setup", "model = GPT2LMHeadModel(config).to(device).eval()"),
        """prompts = torch.randint(0, S["vocab"], (S["batch"], S["seq"]))
LIMIT = mib(setup.peak_reserved + S["batch"] * S["seq"] * S["vocab"] * 4 * 0.6)
LIMIT""",
        oom("""
with torch.no_grad():
    logits = model(input_ids=prompts.to(device)).logits
next_token = logits[:, -1].argmax(-1)
next_token.shape"""),
    ],
    cpu={**GPT2_SIZES_CPU, "vocab": 8000, "batch": 16},
    gpu={**GPT2_SIZES_GPU, "vocab": 50257, "batch": 32},
    expect="logits_to_keep=1 (or a smaller batch)",
)

# 20. Requests of varied size leave the allocator's cache in pieces: expandable segments -------------------------
FRAGMENTS = """
features = []
with torch.no_grad():
    for n in lengths:
        views = torch.randn(8, n, S["dim"], device=device)  # 8 augmented views of a document of n tokens
        features.append(encoder(views).mean(0))  # its token features, kept on the GPU for the search
best = [(queries @ f.T).max(1).values for f in features]
len(best)"""
add(
    "fragmented_cache",
    "encoding documents of varied length and keeping each one's token features on the GPU: pieces of the "
    "freed blocks, split for the kept features, pin segments the next longer document cannot use",
    [
        probe(
            "setup",
            """
torch.manual_seed(0)
encoder = nn.Sequential(nn.Linear(S["dim"], 4 * S["dim"]), nn.GELU(), nn.Linear(4 * S["dim"], S["dim"]))
encoder = encoder.to(device)
lengths = torch.randint(S["short"], S["long"], (S["docs"],)).tolist()
queries = torch.randn(16, S["dim"], device=device)""",
        ),
        # Measured on an H100: peak reserved 1.47 GiB with expandable segments, the cache fragmented past
        # 1.56 GiB without them (712 MiB reserved but unallocated at the error).
        'LIMIT = S["limit"]\nLIMIT',
        oom(FRAGMENTS),
    ],
    cpu={"dim": 64, "short": 16, "long": 256, "docs": 160, "limit": "8MiB"},
    gpu={"dim": 1024, "short": 128, "long": 2048, "docs": 160, "limit": "1600MiB"},
    gpu_only=True,
    expect="expandable segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True)",
)

# 21. The optimizer's first step runs out: the foreach step's temporaries ------------------------------------
STEP_LOOP = """
for xb, yb in batches:
    loss = F.cross_entropy(net(xb.to(device)), yb.to(device))
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)"""
add(
    "optimizer_step",
    "a deep MLP fine-tuned with AdamW at a small batch: the first step's moments and foreach temporaries",
    [
        """def block():
    return nn.Sequential(nn.Linear(S["dim"], S["dim"]), nn.GELU())
net = nn.Sequential(*[block() for _ in range(S["layers"])], nn.Linear(S["dim"], 10)).to(device)
batches = [(torch.randn(S["batch"], S["dim"]), torch.randint(0, 10, (S["batch"],))) for _ in range(4)]
params = sum(p.numel() * p.element_size() for p in net.parameters())""",
        # The same steps one tensor at a time: the card is sized halfway to the foreach step's peak.
        probe("p_step", "opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=False)" + STEP_LOOP),
        "LIMIT = mib(p_step.peak_reserved + params // 2)\nLIMIT",
        # foreach: torch's default for parameters on a GPU; on CPU it has to be asked for.
        "opt = torch.optim.AdamW(net.parameters(), lr=1e-4, foreach=True)",
        oom(STEP_LOOP),
    ],
    cpu=dict(dim=512, layers=8, batch=16),
    gpu=dict(dim=4096, layers=12, batch=16),
    expect="the optimizer stepped one tensor at a time (foreach=False)",
    notes="the failed step leaves in opt.state the AdamW moments it had made: the optimizer's own state",
)

# 22. A model called on a whole tensor at once, under no_grad ------------------------------------------------
add(
    "whole_tensor_inference",
    "scores for a whole test set in one call of an MLP under no_grad",
    [
        """scorer = nn.Sequential(nn.Linear(S["dim"], S["wide"]), nn.ReLU(), nn.Linear(S["wide"], S["wide"]),
                       nn.ReLU(), nn.Linear(S["wide"], 10)).to(device).eval()
X_test = torch.randn(S["rows"], S["dim"], device=device)""",
        probe("p_rows", "with torch.no_grad():\n    scorer(X_test[:S['rows'] // 16])"),
        # Room for a quarter of the rows at once.
        "LIMIT = mib(p_rows.before_allocated + 4 * (p_rows.peak_reserved - p_rows.before_allocated))\nLIMIT",
        oom("""
with torch.no_grad():
    scores = scorer(X_test)
preds = scores.argmax(-1)
preds.bincount(minlength=10)"""),
    ],
    cpu=dict(dim=128, wide=2048, rows=8192),
    gpu=dict(dim=1024, wide=8192, rows=65536),
    expect="the rows in chunks",
)

# 23. Full-batch training: every step on the whole training set at once ----------------------------------
FULL_BATCH = """
opt_fb = torch.optim.SGD(net_fb.parameters(), lr=0.01, momentum=0.9)
for epoch in range(S["epochs"]):
    pred = net_fb(X_train)
    loss = F.cross_entropy(pred, y_train)
    opt_fb.zero_grad()
    loss.backward()
    opt_fb.step()
    print(epoch, round(loss.item(), 4))"""
add(
    "full_batch_training",
    "an MLP trained on its whole training set at once (full batch), as small-data tutorials do",
    [
        """net_fb = nn.Sequential(nn.Linear(S["dim"], S["wide"]), nn.ReLU(), nn.Linear(S["wide"], S["wide"]),
                       nn.ReLU(), nn.Linear(S["wide"], 10)).to(device)
X_train = torch.randn(S["rows"], S["dim"], device=device)
y_train = torch.randint(0, 10, (S["rows"],), device=device)""",
        # Two steps on an eighth of the rows (lr 0: the weights stay): the card is sized to twice it.
        probe(
            "p_fb",
            """opt_p = torch.optim.SGD(net_fb.parameters(), lr=0.0, momentum=0.9)
for _ in range(2):
    loss = F.cross_entropy(net_fb(X_train[:S["rows"] // 8]), y_train[:S["rows"] // 8])
    opt_p.zero_grad()
    loss.backward()
    opt_p.step()
del opt_p, loss
net_fb.zero_grad(set_to_none=True)""",
        ),
        "LIMIT = mib(p_fb.before_allocated + 2 * (p_fb.peak_reserved - p_fb.before_allocated))\nLIMIT",
        oom(FULL_BATCH),
    ],
    cpu=dict(dim=128, wide=2048, rows=8192, epochs=3),
    gpu=dict(dim=1024, wide=8192, rows=65536, epochs=3),
    expect="each step on micro-batches of the rows, the gradients accumulated",
)

# The author's fix for each fittable scenario: run by the runner under the same LIMIT when the clicks did
# not reach a fit, to tell "the product missed a fit" from "the scenario has none".
CONTROLS = {
    "fragmented_cache": 'torch.cuda.memory._set_allocator_settings("expandable_segments:True")\n' + FRAGMENTS,
    "pinned_by_earlier_error": """
import gc, sys
sys.last_value = sys.last_traceback = sys.last_exc = None
gc.collect()
torch.cuda.empty_cache()
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (S["batch"], S["seq"]), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()""",
    "logits_one_request": """
with torch.no_grad():
    logits = model(input_ids=prompts.to(device), logits_to_keep=1).logits
next_token = logits[:, -1].argmax(-1)""",
    "hf_trainer_train": """
trainer = Trainer(model=model, args=training_args(per_device_train_batch_size=8, max_steps=S["steps"],
                  gradient_accumulation_steps=S["batch"] // 8), train_dataset=dataset)
trainer.train()""",
    "hf_trainer_eval": """
trainer = Trainer(model=model, args=training_args(per_device_eval_batch_size=16), eval_dataset=dataset)
trainer.evaluate()""",
    "plain_loop": LOOP.replace("{B}", "8"),
    "lightning_fit": "make_trainer(S['steps']).fit(lit, DataLoader(train_ds, batch_size=8, shuffle=True))",
    "cnn_train": CNN_LOOP.replace("{B}", "8"),
    "generate_beams": GEN.replace("{B}", "4"),
    "keeps_losses": "with torch.no_grad():\n"
    + "\n".join("    " + l for l in VAL.replace("{B}", "S['batch']").strip("\n").splitlines()),
    "eval_no_grad": "with torch.no_grad():\n"
    + "\n".join("    " + l for l in EVAL.replace("{B}", "S['batch']").strip("\n").splitlines()),
    "outlier_batch": """
batch_size = S["batch"] // 4
embeddings = []
with torch.no_grad():
    for i in range(0, len(docs), batch_size):
        ids, mask = pad(docs[i:i + batch_size])
        hidden = encoder(input_ids=ids.to(device), attention_mask=mask.to(device)).last_hidden_state
        embeddings.append((hidden * mask.to(device)[..., None]).sum(1).cpu())
len(embeddings)""",
    "weights_fp32": """
torch.set_default_dtype(torch.bfloat16)
try:
    model = AutoModelForCausalLM.from_config(config).to(device)
finally:
    torch.set_default_dtype(torch.float32)
with torch.no_grad():
    out = model(input_ids=sample.to(device))""",
    "leftovers": """
hidden_cache = None
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (S["batch"], S["seq"]), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()""",
    "other_process": """
for step in range(S["steps"]):
    ids = torch.randint(0, S["vocab"], (8, S["seq"]), device=device)
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()""",
    "optimizer_step": "for group in opt.param_groups:\n    group['foreach'] = False\n" + STEP_LOOP,
    "whole_tensor_inference": """
with torch.no_grad():
    scores = torch.cat([scorer(rows) for rows in X_test.split(S["rows"] // 8)])""",
    "full_batch_training": FULL_BATCH.replace(
        """    pred = net_fb(X_train)
    loss = F.cross_entropy(pred, y_train)
    opt_fb.zero_grad()
    loss.backward()""",
        """    opt_fb.zero_grad()
    for xb, yb in zip(X_train.chunk(4), y_train.chunk(4)):
        loss = F.cross_entropy(net_fb(xb), yb)
        (loss / 4).backward()""",
    ),
    "two_fixes_ckpt_batch": "model.gradient_checkpointing_enable()\n" + CK.replace("{B}", "2"),
    "two_fixes_leftover_batch": "token_table = None\n" + LB.replace("{B}", "8"),
    "keeps_logits": """
preds = []
model.train()
for i in range(0, len(train_ids), S["batch"]):
    batch = train_ids[i:i + S["batch"]].to(device)
    out = model(input_ids=batch, labels=batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    preds.append(out.logits.argmax(-1).cpu())
print("train accuracy", (torch.cat(preds)[:, :-1] == train_ids[:, 1:]).float().mean().item())""",
}
for _s in SCENARIOS:
    _s.control = CONTROLS.get(_s.name, "")
BY_NAME = {s.name: s for s in SCENARIOS}


SIZE_REF = re.compile(r"""S\[(['"])(\w+)\1\]""")


def literal(source: str, sizes: dict) -> str:
    """``S["batch"]`` → ``128``: the cells read the way a person writes them, with the numbers in."""
    return SIZE_REF.sub(lambda m: repr(sizes[m.group(2)]), source)


def notebook(name: str, scale: str | None = None) -> nbformat.NotebookNode:
    """The scenario's notebook at ``scale`` (default ``$SCENARIO_SCALE``, else cpu): the cells carry that
    scale's sizes as literals; ``S`` (both scales' sizes, picked by ``SCENARIO_SCALE``) stays defined."""
    return notebook_of(BY_NAME[name], scale)


def notebook_of(s: Scenario, scale: str | None = None) -> nbformat.NotebookNode:
    """``notebook`` for a scenario of any suite (this one, ``holdout.py``)."""
    import os

    scale = scale or os.environ.get("SCENARIO_SCALE", "cpu")
    sizes = s.gpu if scale == "gpu" else s.cpu
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.metadata["scenario"] = {"name": s.name, "scale": scale, "fit": s.fit, "expect": s.expect}
    head = f"# {s.name} ({scale} size)\n\n{s.title}.\n\nThe fix a person would apply: {s.expect}."
    if not s.fit:
        head += "\n\nNothing fits: the report should say so and offer nothing that fails."
    cells = [nbformat.v4.new_markdown_cell(head), nbformat.v4.new_code_cell("%load_ext oommagic")]
    cells.append(nbformat.v4.new_code_cell(PREAMBLE.format(sizes=repr({"cpu": s.cpu, "gpu": s.gpu}))))
    for src in s.cells:
        cell = nbformat.v4.new_code_cell(literal(src, sizes))
        if src.startswith("%%gpumem") and "--quiet" not in src.splitlines()[0]:
            cell.metadata["tags"] = ["raises-exception", "oom-cell"]
        elif src.startswith(EXPECTED_ERROR):
            cell.metadata["tags"] = ["raises-exception", "expected-error"]
        cells.append(cell)
    for src in s.extra:
        cells.append(nbformat.v4.new_code_cell(src, metadata={"tags": ["teardown"]}))
    nb.cells = cells
    return nb


def control_source(name: str, scale: str) -> str:
    return control_source_of(BY_NAME[name], scale)


def control_source_of(s: Scenario, scale: str) -> str:
    return literal(s.control, s.gpu if scale == "gpu" else s.cpu)


def write_all(folder: Path, scale: str = "cpu") -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for s in SCENARIOS:
        path = folder / f"{s.name}.ipynb"
        nbformat.write(notebook(s.name, scale), path)
        out.append(path)
    return out


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "notebooks")
    for p in write_all(folder, sys.argv[2] if len(sys.argv) > 2 else "cpu"):
        print(p)
