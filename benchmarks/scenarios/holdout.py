"""The hold-out: scenario notebooks written before the fixes of issue #22, by a tester who read the README and
not the package, in the format of ``scenarios.py`` (setup cells build models from configs, data is made
in-process, the emulated card is sized from probe runs, then ONE ``%%gpumem --limit $LIMIT --plan-budget
$PLAN`` cell). ``run.py --suite holdout`` runs them; ``HOLDOUT.md`` has their results before the fixes.

Each fittable one carries the author's own fix (``control``) and the work the cell does (``work``: optimizer
steps, training samples, or a check of its result), so the runner can tell whether the accepted run kept it.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat

sys.path.insert(0, str(Path(__file__).resolve().parent))

from scenarios import (
    GPT2,
    Scenario,
    control_source_of,
    notebook_of,
    oom,
    probe,
)

SCENARIOS: list[Scenario] = []


def add(*a, **kw) -> None:
    SCENARIOS.append(Scenario(*a, **kw))


GPT2_CPU = dict(layers=2, embd=128, heads=4, vocab=1000, seq=128)
GPT2_GPU = dict(layers=6, embd=512, heads=8, vocab=8000, seq=512)
CARD = "_, _, card = card_for({a}, {b}, {na}, {nb}, batch={room})\nLIMIT = mib(card)\nLIMIT"


def card(a: str, b: str, na: int, nb: int, room: int) -> str:
    return CARD.format(a=a, b=b, na=na, nb=nb, room=room)


# 1. HF Trainer with gradient_accumulation_steps: the steady state comes after N micro-batches --------------
TRAIN_CFG = """from transformers import Trainer, TrainingArguments
train_cfg = dict(output_dir="/tmp/holdout-out", report_to=[], save_strategy="no", logging_strategy="no",
                 disable_tqdm=True, use_cpu=(device == "cpu"), learning_rate=5e-5)
ids = torch.randint(0, S["vocab"], (S["n"], S["seq"]))
train_ds = [{"input_ids": row, "labels": row} for row in ids]
"""
add(
    "trainer_grad_accum",
    "HF Trainer.train with gradient_accumulation_steps=4 and a per-device batch too large",
    [
        GPT2 + TRAIN_CFG,
        probe(
            "p2",
            """
model = GPT2LMHeadModel(config)
Trainer(model=model, args=TrainingArguments(**train_cfg, per_device_train_batch_size=2, max_steps=2),
        train_dataset=train_ds).train()""",
        ),
        probe(
            "p4",
            """
Trainer(model=model, args=TrainingArguments(**train_cfg, per_device_train_batch_size=4, max_steps=2),
        train_dataset=train_ds).train()""",
        ),
        card("p2", "p4", 2, 4, 8),
        oom("""
args = TrainingArguments(**train_cfg, per_device_train_batch_size=S["per_device"],
                         gradient_accumulation_steps=S["accum"], max_steps=S["steps"])
trainer = Trainer(model=model, args=args, train_dataset=train_ds)
result = trainer.train()
print(result.global_step, "steps")"""),
    ],
    cpu={**GPT2_CPU, "n": 256, "per_device": 32, "accum": 4, "steps": 2},
    gpu={**GPT2_GPU, "n": 256, "per_device": 32, "accum": 4, "steps": 2},
    expect="per_device_train_batch_size 8 with gradient_accumulation_steps 16",
    control="""
args = TrainingArguments(**train_cfg, per_device_train_batch_size=S["per_device"] // 4,
                         gradient_accumulation_steps=S["accum"] * 4, max_steps=S["steps"])
Trainer(model=model, args=args, train_dataset=train_ds).train()""",
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["per_device"] * S["accum"]'},
)

# 2. AdamW full fine-tune: weights + grads + AdamW state pass the card whatever the batch -------------------
FT_LOOP = """
for step, ids in enumerate(batches):
    ids = ids.to(device)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step}: loss {out.loss.item():.3f}")"""
add(
    "adamw_full_finetune",
    "full fine-tune with AdamW: weights, gradients and the AdamW moments alone pass the card",
    [
        GPT2
        + """batches = [torch.randint(0, S["vocab"], (S["batch"], S["seq"])) for _ in range(S["steps"])]
""",
        probe(
            "setup",
            """
model = GPT2LMHeadModel(config).to(device)
model.train()
n_params = sum(p.numel() for p in model.parameters())""",
        ),
        # Two steps of plain SGD (lr 0: the weights stay): weights, gradients and activations, no state.
        probe(
            "p_sgd",
            """
opt_probe = torch.optim.SGD(model.parameters(), lr=0.0)
for ids in batches[:2]:
    ids = ids.to(device)
    model(input_ids=ids, labels=ids).loss.backward()
    opt_probe.step()
    opt_probe.zero_grad(set_to_none=True)
del opt_probe""",
        ),
        # Room for half the weights again: AdamW's two moments (twice the weights) cannot fit; a factored
        # optimizer (row and column statistics) can.
        'LIMIT = mib(p_sgd.peak_reserved + 0.5 * 4 * n_params)\nprint(f"{n_params / 1e6:.1f}M parameters")\nLIMIT',
        oom(
            """
from torch.optim import AdamW

opt = AdamW(model.parameters(), lr=2e-5, weight_decay=0.01)"""
            + FT_LOOP
        ),
    ],
    cpu=dict(layers=6, embd=256, heads=4, vocab=2000, seq=64, batch=2, steps=3),
    gpu=dict(layers=24, embd=1024, heads=16, vocab=32000, seq=128, batch=1, steps=3),
    expect="a factored optimizer (Adafactor) or 8-bit AdamW; bf16 weights",
    control="""
from transformers.optimization import Adafactor

opt = Adafactor(model.parameters(), lr=2e-5, weight_decay=0.01, relative_step=False, scale_parameter=False)"""
    + FT_LOOP,
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["batch"]'},
)

# 3. A torch.compile'd model -------------------------------------------------------------------------------
MLP = """cfg = {"in": S["dim"], "hidden": S["hidden"], "depth": S["depth"], "classes": 10, "lr": 1e-3}


class ResidualMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.inp = nn.Linear(cfg["in"], cfg["hidden"])
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(cfg["hidden"]), nn.Linear(cfg["hidden"], cfg["hidden"]), nn.GELU())
            for _ in range(cfg["depth"]))
        self.out = nn.Linear(cfg["hidden"], cfg["classes"])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + block(h)
        return self.out(h)


feats = torch.randn(S["n"], S["dim"])
labels = torch.randint(0, 10, (S["n"],))
# inductor on the GPU; on a CPU its C++ build takes a minute a shape here, aot_eager traces the same graphs
backend = "inductor" if device == "cuda" else "aot_eager"
"""
COMPILED = """
bsz = {B}
for step in range(S["steps"]):
    idx = torch.randint(0, len(feats), (bsz,))
    logits = cmodel(feats[idx].to(device))
    loss = F.cross_entropy(logits, labels[idx].to(device))
    opt.zero_grad()
    loss.backward()
    opt.step()
print("loss", round(loss.item(), 4))"""
add(
    "compiled_model",
    "training a torch.compile'd residual MLP, batch too large",
    [
        MLP,
        probe(
            "setup",
            """
model = ResidualMLP(cfg).to(device)
cmodel = torch.compile(model, backend=backend)
opt = torch.optim.Adam(model.parameters(), lr=cfg["lr"])""",
        ),
        probe("p_a", COMPILED.replace("{B}", 'S["pa"]')),
        probe("p_b", COMPILED.replace("{B}", 'S["pb"]')),
        'LIMIT = mib(card_for(p_a, p_b, S["pa"], S["pb"], batch=S["room"])[2])\nLIMIT',
        oom(COMPILED.replace("{B}", 'S["bsz"]')),
    ],
    cpu=dict(dim=256, hidden=512, depth=4, n=8192, pa=64, pb=128, room=256, bsz=2048, steps=3),
    gpu=dict(dim=1024, hidden=4096, depth=8, n=65536, pa=512, pb=1024, room=2048, bsz=16384, steps=3),
    expect="bsz / 8 with 8 micro-batches accumulated per step",
    control="""
bsz, accum = S["bsz"], 8
for step in range(S["steps"]):
    opt.zero_grad()
    for _ in range(accum):
        idx = torch.randint(0, len(feats), (bsz // accum,))
        loss = F.cross_entropy(cmodel(feats[idx].to(device)), labels[idx].to(device)) / accum
        loss.backward()
    opt.step()""",
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["bsz"]'},
)

# 4. Inference over documents sorted by length: the last batches are the longest -------------------------
add(
    "sorted_lengths_inference",
    "mean-pooled embeddings of documents sorted by length (short first): only the last batches overflow",
    [
        GPT2
        + """lengths = torch.randint(S["short"], S["seq"], (S["n"],))
docs = sorted((torch.randint(1, S["vocab"], (int(n),)) for n in lengths), key=len)  # less padding


def collate(batch):
    return torch.nn.utils.rnn.pad_sequence(batch, batch_first=True, padding_value=0)
""",
        probe("setup", "encoder = GPT2Model(config).to(device).eval()"),
        probe(
            "p_last",
            """
with torch.no_grad():
    ids = collate(docs[-(S["batch"] // 4):])
    encoder(input_ids=ids.to(device), attention_mask=(ids != 0).long().to(device))""",
        ),
        "LIMIT = mib(p_last.peak_reserved * 1.3)\nLIMIT",
        oom("""
B = S["batch"]
pooled = []
with torch.inference_mode():
    for start in range(0, len(docs), B):
        ids = collate(docs[start:start + B]).to(device)
        mask = (ids != 0).long()
        h = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled.append(((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).cpu())
pooled = torch.cat(pooled)
print(pooled.shape)"""),
    ],
    cpu={**GPT2_CPU, "seq": 512, "short": 16, "n": 192, "batch": 32},
    gpu={**GPT2_GPU, "seq": 2048, "short": 64, "n": 512, "batch": 64},
    expect="B // 4 (or batches by token count)",
    control="""
B = S["batch"] // 4
pooled = []
with torch.inference_mode():
    for start in range(0, len(docs), B):
        ids = collate(docs[start:start + B]).to(device)
        mask = (ids != 0).long()
        h = encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled.append(((h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)).cpu())
pooled = torch.cat(pooled)""",
    work={"check": 'pooled.shape[0] == S["n"]'},
)

# 5. A loop bound written with the batch variable ---------------------------------------------------------
CONVNET = """def conv_net(width):
    def stage(cin, cout):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                             nn.Conv2d(cout, cout, 3, padding=1), nn.GroupNorm(8, cout), nn.SiLU(),
                             nn.AvgPool2d(2))
    return nn.Sequential(stage(3, width), stage(width, 2 * width), stage(2 * width, 4 * width),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * width, 10))


images = torch.randn(S["n"], 3, S["px"], S["px"])
targets = torch.randint(0, 10, (S["n"],))
"""
RANGE_LOOP = """
bs = {B}
net.train()
for i in range(0, {N} * bs, bs):
    x = images[i:i + bs].to(device)
    t = targets[i:i + bs].to(device)
    loss = F.cross_entropy(net(x), t)
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(i // bs, f"{loss.item():.4f}")"""
add(
    "range_bound_batch",
    "CNN training whose loop bound is written with the batch variable: range(0, 3 * bs, bs)",
    [
        CONVNET,
        probe(
            "setup",
            """
net = conv_net(S["width"]).to(device)
opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9, nesterov=True)""",
        ),
        probe("p4", RANGE_LOOP.replace("{B}", "4").replace("{N}", "2")),
        probe("p8", RANGE_LOOP.replace("{B}", "8").replace("{N}", "2")),
        card("p4", "p8", 4, 8, 16),
        oom(RANGE_LOOP.replace("{B}", 'S["bs"]').replace("{N}", "3")),
    ],
    cpu=dict(px=32, width=16, n=384, bs=128),
    gpu=dict(px=128, width=64, n=1536, bs=512),
    expect="micro-batches of bs // 8 accumulated, still 3 steps of bs images",
    control="""
bs, mb = S["bs"], S["bs"] // 8
for i in range(0, 3 * bs, bs):
    opt.zero_grad()
    for j in range(i, i + bs, mb):
        loss = F.cross_entropy(net(images[j:j + mb].to(device)), targets[j:j + mb].to(device)) / 8
        loss.backward()
    opt.step()""",
    work={"steps": "3", "samples": '3 * S["bs"]'},
)

# 6. The user's own accumulation counter is named micro_step ---------------------------------------------
TAGGER = """from torch.utils.data import DataLoader, TensorDataset


class SentenceTagger(nn.Module):
    def __init__(self, vocab, emb, hidden, classes=5):
        super().__init__()
        self.emb = nn.Embedding(vocab, emb, padding_idx=0)
        self.rnn = nn.LSTM(emb, hidden, num_layers=2, batch_first=True, bidirectional=True)
        self.cls = nn.Linear(2 * hidden, classes)

    def forward(self, tokens):
        states, _ = self.rnn(self.emb(tokens))
        return self.cls(states.max(dim=1).values)


tokens = torch.randint(1, S["vocab"], (S["n"], S["seq"]))
tags = torch.randint(0, 5, (S["n"],))
train_set = TensorDataset(tokens, tags)
criterion = nn.CrossEntropyLoss(label_smoothing=0.1)
"""
MICRO = """
accum_steps = {A}
loader = DataLoader(train_set, batch_size={B}, shuffle=True, drop_last=True)
model.train()
micro_step = 0
for tokens_b, tags_b in loader:
    loss = criterion(model(tokens_b.to(device)), tags_b.to(device)) / accum_steps
    loss.backward()
    micro_step += 1
    if micro_step % accum_steps == 0:
        optimizer.step()
        optimizer.zero_grad()
print(f"{micro_step} micro-steps, {micro_step // accum_steps} optimizer steps")"""
MICRO_PROBE = """
for step, (tokens_b, tags_b) in enumerate(DataLoader(train_set, batch_size={B})):
    criterion(model(tokens_b.to(device)), tags_b.to(device)).backward()
    optimizer.step()
    optimizer.zero_grad()
    if step == 1:
        break"""
add(
    "user_micro_step",
    "an LSTM trained with the user's own gradient accumulation, its counter named micro_step",
    [
        TAGGER,
        probe(
            "setup",
            """
model = SentenceTagger(S["vocab"], S["emb"], S["hidden"]).to(device)
optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)""",
        ),
        probe("p4", MICRO_PROBE.replace("{B}", "4")),
        probe("p8", MICRO_PROBE.replace("{B}", "8")),
        card("p4", "p8", 4, 8, 16),
        oom(MICRO.replace("{A}", 'S["accum"]').replace("{B}", 'S["batch"]')),
    ],
    cpu=dict(vocab=1000, emb=64, hidden=128, seq=64, n=512, batch=64, accum=2),
    gpu=dict(vocab=8000, emb=256, hidden=1024, seq=256, n=4096, batch=512, accum=2),
    expect="batch_size // 4 with accum_steps * 4",
    control=MICRO.replace("{A}", 'S["accum"] * 4').replace("{B}", 'S["batch"] // 4'),
    work={"steps": 'S["n"] // S["batch"] // S["accum"]', "samples": 'S["n"] // S["batch"] * S["batch"]'},
)

# 7. A loop that keeps every batch's token states on purpose (a search index) ----------------------------
KEEP = """
token_states = []
with torch.inference_mode():
    for i in range(0, len(corpus), S["batch"]):
        out = enc(input_ids=corpus[i:i + S["batch"]].to(device))
        token_states.append(out.last_hidden_state{HOST})
index = {CAT}(token_states)
del token_states
print(index.shape, index.dtype)"""
add(
    "keep_token_states",
    "token-level hidden states of a corpus kept on purpose for a search index: more than the card holds",
    [
        GPT2 + 'corpus = torch.randint(1, S["vocab"], (S["n"], S["seq"]))\nimport numpy as np\n',
        probe("setup", "enc = GPT2Model(config).to(device).eval()"),
        probe(
            "p1",
            """
with torch.inference_mode():
    enc(input_ids=corpus[:S["batch"]].to(device)).last_hidden_state.sum().item()""",
        ),
        """kept = S["n"] * S["seq"] * S["embd"] * 4
LIMIT = mib(p1.peak_reserved + 0.6 * kept)  # the index alone is 1/0.6 of what is left
print(f"index {kept / 2**20:.0f} MiB, card {LIMIT}")""",
        oom(KEEP.replace("{HOST}", "").replace("{CAT}", "torch.cat")),
    ],
    cpu={**GPT2_CPU, "seq": 64, "n": 512, "batch": 32},
    gpu={**GPT2_GPU, "n": 4096, "batch": 64},
    expect="move each batch's states to the host (np.array(h.cpu())), concatenate there",
    control=KEEP.replace("{HOST}", ".cpu().numpy().copy()").replace("{CAT}", "np.concatenate"),
    work={"check": 'len(index) == S["n"]'},
)

# 8. A DataLoader wrapped by accelerate's prepare in an earlier cell --------------------------------------
VIT = """from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset


class TinyViT(nn.Module):
    def __init__(self, px, patch, dim, depth, classes=10):
        super().__init__()
        self.patchify = nn.Conv2d(3, dim, patch, stride=patch)
        self.pos = nn.Parameter(torch.zeros(1, (px // patch) ** 2, dim))
        layer = nn.TransformerEncoderLayer(dim, 4, 4 * dim, batch_first=True, norm_first=True)
        self.blocks = nn.TransformerEncoder(layer, depth, enable_nested_tensor=False)
        self.head = nn.Linear(dim, classes)

    def forward(self, images):
        x = self.patchify(images).flatten(2).transpose(1, 2) + self.pos
        return self.head(self.blocks(x).mean(1))


accelerator = Accelerator(cpu=(device == "cpu"))
train_ds = TensorDataset(torch.randn(S["n"], 3, S["px"], S["px"]), torch.randint(0, 10, (S["n"],)))
model = TinyViT(S["px"], S["patch"], S["dim"], S["depth"])
optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.05)
model, optimizer = accelerator.prepare(model, optimizer)
"""
ACC_PROBE = """
for step, (images, labels) in enumerate(accelerator.prepare(DataLoader(train_ds, batch_size={B}))):
    loss = F.cross_entropy(model(images), labels)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step == 1:
        break"""
add(
    "accelerate_prepared_loader",
    "a loop over a DataLoader that accelerate's prepare wrapped in an earlier cell, batch too large",
    [
        VIT,
        probe("p4", ACC_PROBE.replace("{B}", "4")),
        probe("p8", ACC_PROBE.replace("{B}", "8")),
        card("p4", "p8", 4, 8, 16)
        + '\ntrain_dl = accelerator.prepare(DataLoader(train_ds, batch_size=S["batch"], shuffle=True))',
        oom("""
model.train()
for step, (images, labels) in enumerate(train_dl):
    logits = model(images)
    loss = F.cross_entropy(logits, labels)
    accelerator.backward(loss)
    optimizer.step()
    optimizer.zero_grad()
    if step + 1 == S["steps"]:
        break
print(f"loss {loss.item():.3f}")"""),
    ],
    cpu=dict(px=32, patch=4, dim=96, depth=2, n=512, batch=64, steps=2),
    gpu=dict(px=224, patch=16, dim=512, depth=8, n=1024, batch=256, steps=2),
    expect="a loader of batch // 8, 8 micro-batches per optimizer step",
    control="""
small_dl = accelerator.prepare(DataLoader(train_ds, batch_size=S["batch"] // 8, shuffle=True))
for i, (images, labels) in enumerate(small_dl):
    accelerator.backward(F.cross_entropy(model(images), labels) / 8)
    if (i + 1) % 8 == 0:
        optimizer.step()
        optimizer.zero_grad()
    if i + 1 == S["steps"] * 8:
        break""",
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["batch"]'},
)

# 9. HF Trainer.predict gathers every batch's logits on the device ---------------------------------------
add(
    "trainer_predict_logits",
    "HF Trainer.predict over a test set: the gathered logits of every batch outgrow the card",
    [
        GPT2
        + """from transformers import Trainer, TrainingArguments
eval_cfg = dict(output_dir="/tmp/holdout-eval", report_to=[], disable_tqdm=True, use_cpu=(device == "cpu"),
                per_device_eval_batch_size=S["batch"])
test_ids = torch.randint(0, S["vocab"], (S["n"], S["seq"]))
test_ds = [{"input_ids": x, "labels": x} for x in test_ids]
""",
        probe("setup", "model = GPT2LMHeadModel(config).to(device)"),
        probe("p1", 'Trainer(model=model, args=TrainingArguments(**eval_cfg)).predict(test_ds[:S["batch"]])'),
        """all_logits = S["n"] * S["seq"] * S["vocab"] * 4
LIMIT = mib(p1.peak_reserved + 0.3 * all_logits)
print(f"logits of the test set {all_logits / 2**20:.0f} MiB, card {LIMIT}")""",
        oom("""
trainer = Trainer(model=model, args=TrainingArguments(**eval_cfg))
pred = trainer.predict(test_ds)
next_token_acc = (pred.predictions[:, :-1].argmax(-1) == test_ids[:, 1:].numpy()).mean()
print(f"next-token accuracy {next_token_acc:.4f}, loss {pred.metrics['test_loss']:.3f}")"""),
    ],
    cpu={**GPT2_CPU, "vocab": 3000, "seq": 64, "n": 96, "batch": 16},
    gpu={**GPT2_GPU, "vocab": 32000, "n": 192, "batch": 16},
    expect="eval_accumulation_steps=1 (the logits go to the host each step)",
    control="""
trainer = Trainer(model=model, args=TrainingArguments(**eval_cfg, eval_accumulation_steps=1))
pred = trainer.predict(test_ds)""",
    work={"check": 'pred.predictions.shape[0] == S["n"]'},
)

# 9b. HF Trainer.evaluate with compute_metrics, the Trainer made in an earlier cell ---------------------
add(
    "trainer_eval_metrics_logits",
    "HF Trainer.evaluate with a compute_metrics that reads the logits: gathered on the device, they outgrow it",
    [
        GPT2
        + """import numpy as np
from transformers import Trainer, TrainingArguments
eval_cfg = dict(output_dir="/tmp/holdout-eval", report_to=[], disable_tqdm=True, use_cpu=(device == "cpu"),
                per_device_eval_batch_size=S["batch"])
val_ids = torch.randint(0, S["vocab"], (S["n"], S["seq"]))
val_ds = [{"input_ids": x, "labels": x} for x in val_ids]


def token_accuracy(eval_pred):
    logits, labels = eval_pred
    return {"token_acc": float((logits[:, :-1].argmax(-1) == labels[:, 1:]).mean())}
""",
        probe("setup", "model = GPT2LMHeadModel(config).to(device)"),
        probe(
            "p1",
            'Trainer(model=model, args=TrainingArguments(**eval_cfg), eval_dataset=val_ds[:S["batch"]],\n'
            "        compute_metrics=token_accuracy).evaluate()",
        ),
        """all_logits = S["n"] * S["seq"] * S["vocab"] * 4
LIMIT = mib(p1.peak_reserved + 0.3 * all_logits)
trainer = Trainer(model=model, args=TrainingArguments(**eval_cfg), eval_dataset=val_ds,
                  compute_metrics=token_accuracy)
LIMIT""",
        oom("""
metrics = trainer.evaluate()
print({k: round(v, 4) for k, v in metrics.items() if isinstance(v, float)})"""),
    ],
    cpu={**GPT2_CPU, "vocab": 3000, "seq": 64, "n": 96, "batch": 16},
    gpu={**GPT2_GPU, "vocab": 32000, "n": 192, "batch": 16},
    expect="eval_accumulation_steps=1 (or preprocess_logits_for_metrics keeping the argmax)",
    control="""
metrics = Trainer(model=model, args=TrainingArguments(**eval_cfg, eval_accumulation_steps=1), eval_dataset=val_ds,
                  compute_metrics=token_accuracy).evaluate()""",
    work={"check": '"eval_token_acc" in metrics'},
)

# 10. Encoder-decoder beam search returning several sequences per source ---------------------------------
add(
    "t5_beams_return",
    "a T5 (from its config) summarising a batch of sources with beam search and num_return_sequences",
    [
        """from transformers import T5Config, T5ForConditionalGeneration
import transformers
transformers.logging.set_verbosity_error()
config = T5Config(vocab_size=S["vocab"], d_model=S["d"], d_kv=S["d"] // 4, d_ff=4 * S["d"],
                  num_layers=S["layers"], num_decoder_layers=S["layers"], num_heads=4,
                  decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
sources = torch.randint(2, S["vocab"], (S["n"], S["src"]))
gen_kwargs = dict(num_beams=S["beams"], num_return_sequences=S["ret"], max_new_tokens=S["new"],
                  min_new_tokens=S["new"], early_stopping=True)
""",
        probe("setup", "seq2seq = T5ForConditionalGeneration(config).to(device).eval()"),
        probe("p1", "seq2seq.generate(input_ids=sources[:1].to(device), **gen_kwargs).shape"),
        probe("p2", "seq2seq.generate(input_ids=sources[:2].to(device), **gen_kwargs).shape"),
        card("p1", "p2", 1, 2, 4),
        oom("""
with torch.no_grad():
    summaries = seq2seq.generate(input_ids=sources.to(device),
                                 attention_mask=torch.ones_like(sources).to(device), **gen_kwargs)
print(summaries.shape)"""),
    ],
    cpu=dict(vocab=2000, d=128, layers=2, n=32, src=64, new=48, beams=6, ret=3),
    gpu=dict(vocab=32000, d=512, layers=6, n=64, src=512, new=128, beams=8, ret=4),
    expect="the sources in chunks of 4",
    control="""
with torch.no_grad():
    summaries = torch.cat([seq2seq.generate(input_ids=chunk.to(device),
                                            attention_mask=torch.ones_like(chunk).to(device), **gen_kwargs)
                           for chunk in sources.split(4)])""",
    work={"check": 'summaries.shape[0] == S["n"] * S["ret"]'},
)

# 11. A hand-written greedy decoding loop over past_key_values -------------------------------------------
GREEDY = """
@torch.no_grad()
def greedy(lm, prompt_ids, steps):
    past, cur, pieces = None, prompt_ids, []
    for _ in range(steps):
        out = lm(input_ids=cur, past_key_values=past, use_cache=True)
        past = out.past_key_values
        cur = out.logits[:, -1:].argmax(-1)
        pieces.append(cur)
    return torch.cat(pieces, dim=1)

"""
add(
    "kv_cache_decode_loop",
    "a hand-written greedy decoding loop over past_key_values for a batch of prompts",
    [
        GPT2 + 'prompts = torch.randint(1, S["vocab"], (S["n"], S["prompt"]))\n',
        probe("setup", "lm = GPT2LMHeadModel(config).to(device).eval()"),
        probe("p8", GREEDY + 'greedy(lm, prompts[:8].to(device), S["new"]).shape'),
        "LIMIT = mib(p8.peak_reserved * 1.25)\nLIMIT",
        oom(GREEDY + 'completions = greedy(lm, prompts.to(device), S["new"])\ncompletions.shape'),
    ],
    cpu={**GPT2_CPU, "vocab": 2000, "seq": 256, "n": 48, "prompt": 96, "new": 64},
    gpu={**GPT2_GPU, "vocab": 32000, "seq": 1024, "n": 64, "prompt": 512, "new": 256},
    expect="the prompts in chunks of 8 (or logits of the last position only)",
    control=GREEDY
    + 'completions = torch.cat([greedy(lm, p.to(device), S["new"]) for p in prompts.split(8)])',
    work={"check": 'tuple(completions.shape) == (S["n"], S["new"])'},
)

# 12. A large-vocabulary loss -----------------------------------------------------------------------------
LM_LOOP = """
mb = {B}
for it in range({N}):
    chunk = stream[it * mb:(it + 1) * mb].to(device)
    logits = lm(chunk[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), chunk[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
print(f"loss {loss.item():.3f}")"""
add(
    "big_vocab_loss",
    "a small recurrent LM with a large vocabulary: the logits and their loss fill the card",
    [
        """class TinyLM(nn.Module):
    def __init__(self, vocab, d):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.rnn = nn.GRU(d, d, batch_first=True)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        return self.head(self.rnn(self.tok(ids))[0])


stream = torch.randint(0, S["vocab"], (S["n"], S["seq"] + 1))
""",
        probe(
            "setup",
            """
lm = TinyLM(S["vocab"], S["d"]).to(device)
opt = torch.optim.Adam(lm.parameters(), lr=1e-3)""",
        ),
        probe("p_a", LM_LOOP.replace("{B}", "1").replace("{N}", "2")),
        probe("p_b", LM_LOOP.replace("{B}", "2").replace("{N}", "2")),
        # The probes at 1 and 2 rows are ruled by the first AdamW step, not the logits: the card is sized from
        # the logits, their log-softmax and its gradient (3 x rows x seq x vocab floats) of `room` rows.
        'LIMIT = mib(p_b.peak_reserved + S["room"] * S["seq"] * S["vocab"] * 4 * 3)\nLIMIT',
        oom(LM_LOOP.replace("{B}", 'S["batch"]').replace("{N}", 'S["steps"]')),
    ],
    cpu=dict(vocab=8000, d=128, seq=64, n=128, batch=32, room=8, steps=2),
    gpu=dict(vocab=64000, d=1024, seq=1024, n=64, batch=16, room=4, steps=2),
    expect="mb // 8 with accumulation (or a chunked cross-entropy)",
    control="""
mb, k = S["batch"], 8
for it in range(S["steps"]):
    chunk = stream[it * mb:(it + 1) * mb].to(device)
    for part in chunk.split(mb // k):
        logits = lm(part[:, :-1])
        (F.cross_entropy(logits.reshape(-1, logits.size(-1)), part[:, 1:].reshape(-1)) / k).backward()
    opt.step()
    opt.zero_grad()""",
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["batch"]'},
)

# 13. A VAE whose settings live in a dataclass ------------------------------------------------------------
VAE = """from dataclasses import dataclass


@dataclass
class Config:
    image_size: int = S["px"]
    channels: int = S["ch"]
    latent: int = 32
    batch_size: int = 64
    lr: float = 2e-4
    steps: int = S["steps"]


class ConvVAE(nn.Module):
    def __init__(self, c, latent, px):
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(3, c, 4, 2, 1), nn.LeakyReLU(0.2), nn.Conv2d(c, 2 * c, 4, 2, 1),
                                 nn.BatchNorm2d(2 * c), nn.LeakyReLU(0.2), nn.Conv2d(2 * c, 4 * c, 4, 2, 1),
                                 nn.BatchNorm2d(4 * c), nn.LeakyReLU(0.2), nn.Flatten())
        side = px // 8
        self.to_stats = nn.Linear(4 * c * side * side, 2 * latent)
        self.from_z = nn.Linear(latent, 4 * c * side * side)
        self.dec = nn.Sequential(nn.Unflatten(1, (4 * c, side, side)), nn.ConvTranspose2d(4 * c, 2 * c, 4, 2, 1),
                                 nn.BatchNorm2d(2 * c), nn.ReLU(), nn.ConvTranspose2d(2 * c, c, 4, 2, 1),
                                 nn.BatchNorm2d(c), nn.ReLU(), nn.ConvTranspose2d(c, 3, 4, 2, 1))

    def forward(self, x):
        mu, logvar = self.to_stats(self.enc(x)).chunk(2, dim=1)
        z = mu + torch.randn_like(mu) * (0.5 * logvar).exp()
        return self.dec(self.from_z(z)), mu, logvar


images = torch.rand(S["n"], 3, S["px"], S["px"])
"""
VAE_LOOP = """
cfg = Config(batch_size={B})
vae.train()
history = []
for step in range(cfg.steps):
    x = images[torch.randint(0, len(images), (cfg.batch_size,))].to(device)
    recon, mu, logvar = vae(x)
    rec = F.binary_cross_entropy_with_logits(recon, x, reduction="sum") / x.size(0)
    kl = -0.5 * torch.mean(torch.sum(1 + logvar - mu.pow(2) - logvar.exp(), dim=1))
    loss = rec + kl
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    history.append(loss.item())
print(history)"""
add(
    "vae_dataclass_config",
    "a convolutional VAE whose batch size is a field of a dataclass config, batch too large",
    [
        VAE,
        probe(
            "setup",
            """
vae = ConvVAE(S["ch"], 32, S["px"]).to(device)
opt = torch.optim.Adam(vae.parameters(), lr=2e-4, betas=(0.5, 0.999))""",
        ),
        probe("p8", VAE_LOOP.replace("{B}", "8")),
        probe("p16", VAE_LOOP.replace("{B}", "16")),
        card("p8", "p16", 8, 16, 'S["room"]'),
        oom(VAE_LOOP.replace("{B}", 'S["batch"]')),
    ],
    cpu=dict(px=32, ch=32, n=2048, batch=256, room=32, steps=2),
    gpu=dict(px=128, ch=64, n=4096, batch=2048, room=128, steps=2),
    expect="a smaller batch (BatchNorm: accumulation is close, not exact)",
    control=VAE_LOOP.replace("{B}", 'S["room"]').replace(
        "for step in range(cfg.steps):", 'for step in range(cfg.steps * S["batch"] // S["room"]):'
    ),
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["batch"]'},
)

# 14. A diffusion UNet whose settings come from an argparse namespace made in an earlier cell ------------
UNET = """import argparse

args = argparse.Namespace(batch_size=S["batch"], image_size=S["px"], base=S["base"], lr=1e-4,
                          timesteps=1000, steps=S["steps"])


class Block(nn.Module):
    def __init__(self, cin, cout, tdim):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.norm1, self.norm2 = nn.GroupNorm(8, cout), nn.GroupNorm(8, cout)
        self.time = nn.Linear(tdim, cout)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x, temb):
        h = F.silu(self.norm1(self.conv1(x))) + self.time(temb)[:, :, None, None]
        return F.silu(self.norm2(self.conv2(h))) + self.skip(x)


class UNet(nn.Module):
    def __init__(self, base, tdim=128):
        super().__init__()
        self.tdim = tdim
        self.inc = nn.Conv2d(3, base, 3, padding=1)
        self.down1, self.down2 = Block(base, base, tdim), Block(base, 2 * base, tdim)
        self.mid = Block(2 * base, 4 * base, tdim)
        self.up2, self.up1 = Block(6 * base, 2 * base, tdim), Block(3 * base, base, tdim)
        self.out = nn.Conv2d(base, 3, 1)

    def embed(self, t):
        freqs = torch.exp(-math.log(10000) * torch.arange(self.tdim // 2, device=t.device) / (self.tdim // 2))
        angles = t[:, None].float() * freqs[None]
        return torch.cat([angles.sin(), angles.cos()], dim=1)

    def forward(self, x, t):
        temb = self.embed(t)
        h1 = self.down1(self.inc(x), temb)
        h2 = self.down2(F.avg_pool2d(h1, 2), temb)
        m = self.mid(F.avg_pool2d(h2, 2), temb)
        u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2), h2], 1), temb)
        u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2), h1], 1), temb)
        return self.out(u1)


dataset = torch.randn(S["n"], 3, S["px"], S["px"])
"""
DIFF_LOOP = """
betas = torch.linspace(1e-4, 0.02, args.timesteps)
alphas_bar = torch.cumprod(1 - betas, 0).to(device)
unet.train()
for step in range(args.steps):
    x0 = dataset[torch.randint(0, len(dataset), (args.batch_size,))].to(device)
    t = torch.randint(0, args.timesteps, (args.batch_size,), device=device)
    noise = torch.randn_like(x0)
    ab = alphas_bar[t].view(-1, 1, 1, 1)
    x_t = ab.sqrt() * x0 + (1 - ab).sqrt() * noise
    loss = F.mse_loss(unet(x_t, t), noise)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(f"step {step} loss {loss.item():.4f}")"""
add(
    "unet_argparse_namespace",
    "a diffusion UNet trained with settings from an argparse.Namespace of an earlier cell, batch too large",
    [
        UNET,
        probe(
            "setup",
            """
unet = UNet(args.base).to(device)
optimizer = torch.optim.AdamW(unet.parameters(), lr=args.lr)""",
        ),
        probe("p4", "args.batch_size = 4\n" + DIFF_LOOP.replace("args.steps", "2")),
        probe("p8", "args.batch_size = 8\n" + DIFF_LOOP.replace("args.steps", "2")),
        card("p4", "p8", 4, 8, 16) + '\nargs.batch_size = S["batch"]',
        oom(DIFF_LOOP),
    ],
    cpu=dict(px=16, base=16, n=512, batch=128, steps=2),
    gpu=dict(px=64, base=64, n=2048, batch=512, steps=2),
    expect="args.batch_size // 8 with 8 micro-batches per step",
    control="""
betas = torch.linspace(1e-4, 0.02, args.timesteps)
alphas_bar = torch.cumprod(1 - betas, 0).to(device)
mb = args.batch_size // 8
for step in range(args.steps):
    optimizer.zero_grad()
    for _ in range(8):
        x0 = dataset[torch.randint(0, len(dataset), (mb,))].to(device)
        t = torch.randint(0, args.timesteps, (mb,), device=device)
        noise = torch.randn_like(x0)
        ab = alphas_bar[t].view(-1, 1, 1, 1)
        (F.mse_loss(unet(ab.sqrt() * x0 + (1 - ab).sqrt() * noise, t), noise) / 8).backward()
    optimizer.step()""",
    work={"steps": 'S["steps"]', "samples": 'S["steps"] * S["batch"]'},
)

# 15. A contrastive loss: the batch is the negatives, so a smaller batch changes the loss -----------------
TOWERS = """class Tower(nn.Module):
    def __init__(self, d_in, hidden, d_out):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, hidden), nn.LayerNorm(hidden), nn.GELU(),
                                 nn.Linear(hidden, d_out))

    def forward(self, x):
        return F.normalize(self.net(x), dim=-1)


img_feats = torch.randn(S["n"], S["d_img"])
txt_feats = torch.randn(S["n"], S["d_txt"])
"""
TOWERS_MADE = """
img_tower = Tower(S["d_img"], S["hidden"], S["out"]).to(device)
txt_tower = Tower(S["d_txt"], S["hidden"], S["out"]).to(device)
log_temp = nn.Parameter(torch.tensor(math.log(1 / 0.07), device=device))
opt = torch.optim.AdamW([*img_tower.parameters(), *txt_tower.parameters(), log_temp], lr=1e-4)
"""
CLIP_LOOP = """
B = S["batch"]
for step in range({N}):
    idx = torch.randperm(S["n"])[:B]
    zi = img_tower(img_feats[idx].to(device))
    zt = txt_tower(txt_feats[idx].to(device))
    logits = zi @ zt.T * log_temp.exp()
    target = torch.arange(B, device=device)
    loss = (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"contrastive loss {loss.item():.3f}")"""
CLIP_CKPT = CLIP_LOOP.replace(
    "img_tower(img_feats[idx].to(device))",
    "checkpoint(img_tower, img_feats[idx].to(device), use_reentrant=False)",
).replace(
    "txt_tower(txt_feats[idx].to(device))",
    "checkpoint(txt_tower, txt_feats[idx].to(device), use_reentrant=False)",
)
add(
    "contrastive_big_batch",
    "CLIP-style contrastive training of two towers: the batch is the negatives (accumulation changes the loss)",
    [
        TOWERS,
        probe("setup", TOWERS_MADE),
        probe("p_full", CLIP_LOOP.replace("{N}", "1")),
        "from torch.utils.checkpoint import checkpoint",
        probe("p_ck", CLIP_CKPT.replace("{N}", "1")),
        "LIMIT = mib((p_full.peak_reserved + p_ck.peak_reserved) / 2)\nprint(mib(p_full.peak_reserved), mib(p_ck.peak_reserved))\nLIMIT",
        oom(CLIP_LOOP.replace("{N}", 'S["steps"]')),
    ],
    cpu=dict(d_img=256, d_txt=256, hidden=1024, out=128, n=4096, batch=1024, steps=2),
    gpu=dict(d_img=768, d_txt=768, hidden=8192, out=512, n=16384, batch=8192, steps=2),
    expect="activation checkpointing of the towers (the batch, i.e. the negatives, kept)",
    control=CLIP_CKPT.replace("{N}", 'S["steps"]'),
    # Two towers, each called on the batch: samples count both calls.
    work={"steps": 'S["steps"]', "samples": '2 * S["steps"] * S["batch"]'},
    notes="a smaller batch with accumulation fits but computes another loss (fewer negatives per sample)",
)

# 15b. Lightning's trainer.validate with a loader made in an earlier cell (skipped without lightning) -----
LIT = """import lightning as L
from torch.utils.data import DataLoader, TensorDataset


class LitRegressor(L.LightningModule):
    def __init__(self, dim, hidden):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, hidden), nn.GELU(),
                                 nn.Linear(hidden, 1))

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x).squeeze(-1), y)
        self.log("val_loss", loss)
        return loss


val_ds = TensorDataset(torch.randn(S["n"], S["dim"]), torch.randn(S["n"]))
lit = LitRegressor(S["dim"], S["hidden"])
trainer = L.Trainer(accelerator="gpu" if device == "cuda" else "cpu", devices=1, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
"""
add(
    "lightning_validate_loader",
    "Lightning trainer.validate on a val loader made in an earlier cell, its batch too large",
    [
        LIT,
        probe(
            "p_a",
            'trainer.validate(lit, DataLoader(TensorDataset(*val_ds[:S["pa"]]), batch_size=S["pa"]), verbose=False)',
        ),
        probe(
            "p_b",
            'trainer.validate(lit, DataLoader(TensorDataset(*val_ds[:S["pb"]]), batch_size=S["pb"]), verbose=False)',
        ),
        card("p_a", "p_b", 'S["pa"]', 'S["pb"]', 'S["room"]')
        + '\nval_loader = DataLoader(val_ds, batch_size=S["batch"], num_workers=0)',
        oom("""
metrics = trainer.validate(lit, dataloaders=val_loader, verbose=False)
print(metrics)"""),
    ],
    cpu=dict(dim=256, hidden=2048, n=8192, pa=128, pb=256, room=512, batch=4096),
    gpu=dict(dim=1024, hidden=16384, n=65536, pa=1024, pb=2048, room=4096, batch=32768),
    needs=("lightning",),
    expect="a val loader of batch // 8",
    control="""
metrics = trainer.validate(lit, dataloaders=DataLoader(val_ds, batch_size=S["batch"] // 8), verbose=False)""",
    work={"check": 'metrics[0]["val_loss"] > 0'},
    notes="not run on the tester's CPU machine (lightning is not installed there)",
)

# 16. Unfittable: SGD training of a model whose fp32 weights are 1.5x the card ---------------------------
add(
    "unfit_sgd_weights",
    "plain SGD training of a model whose weights are 1.5x the card (bf16 weights and gradients: 1.5x too)",
    [
        GPT2
        + """with torch.device("meta"):
    n_params = sum(p.numel() for p in GPT2LMHeadModel(config).parameters())
LIMIT = mib(n_params * 4 / 1.5)
print(f"{n_params / 1e6:.1f}M parameters, card {LIMIT}")""",
        oom("""
with torch.device(device):
    model = GPT2LMHeadModel(config)
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(2):
    ids = torch.randint(0, S["vocab"], (1, 64), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad()"""),
    ],
    cpu=dict(layers=4, embd=256, heads=4, vocab=4000, seq=128),
    gpu=dict(layers=12, embd=1536, heads=16, vocab=32000, seq=128),
    fit=False,
    expect="none on this card (LoRA / offload are other methods)",
)

# 17. Unfittable: HF Trainer on a model whose fp32 weights are 2.5x the card ------------------------------
add(
    "unfit_trainer_weights",
    "HF Trainer.train on a model whose fp32 weights are 2.5x the card (bf16 weights: 1.25x)",
    [
        GPT2
        + TRAIN_CFG
        + """model = GPT2LMHeadModel(config)
n_params = sum(p.numel() for p in model.parameters())
LIMIT = mib(n_params * 4 / 2.5)
print(f"{n_params / 1e6:.1f}M parameters, card {LIMIT}")""",
        oom("""
trainer = Trainer(model=model, args=TrainingArguments(**train_cfg, per_device_train_batch_size=4, max_steps=2),
                  train_dataset=train_ds)
trainer.train()"""),
    ],
    cpu=dict(layers=4, embd=256, heads=4, vocab=4000, seq=64, n=32),
    gpu=dict(layers=24, embd=1024, heads=16, vocab=32000, seq=128, n=32),
    fit=False,
    expect="none on this card",
)

BY_NAME = {s.name: s for s in SCENARIOS}


def notebook(name: str, scale: str | None = None) -> nbformat.NotebookNode:
    return notebook_of(BY_NAME[name], scale)


def control_source(name: str, scale: str) -> str:
    return control_source_of(BY_NAME[name], scale)


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "holdout_notebooks")
    scale = sys.argv[2] if len(sys.argv) > 2 else "cpu"
    folder.mkdir(parents=True, exist_ok=True)
    for s in SCENARIOS:
        nbformat.write(notebook(s.name, scale), folder / f"{s.name}.ipynb")
        print(folder / f"{s.name}.ipynb")
