"""What a fixed run writes into the notebook: the cell's body, and the notebook functions it redefined
written back where the notebook defines them (one definition of each, not two)."""

from __future__ import annotations

from oommagic.diagnosis.write_back import cell_write

TRAIN = """def train(model, batch_size, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        loss = model(torch.randn(batch_size, 8)).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
"""
CELL = "batch_size = 256\nmodel = make_model()\nloss = train(model, batch_size=batch_size)"
# What the batch fix runs (remedies.batch_source): the function redefined on top, under its note.
FIXED = """# gradient accumulation over 16 micro-batches, written by %%gpumem

@torch.no_grad  # a decorator goes with its function
def train(model, batch_size, steps=3):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    micro_step = 0
    for _ in range(steps * 16):
        loss = model(torch.randn(batch_size, 8)).sum()
        (loss / 16).backward()
        micro_step += 1
        if micro_step % 16 == 0:
            opt.step()
            opt.zero_grad()

batch_size = 16
model = make_model()
loss = train(model, batch_size=batch_size)
"""


def test_a_redefined_notebook_function_is_taken_out_of_the_cell_with_its_old_text():
    write = cell_write(FIXED, CELL, (("train", TRAIN),))
    assert write.body == "batch_size = 16\nmodel = make_model()\nloss = train(model, batch_size=batch_size)"
    [train] = write.functions
    assert train.name == "train" and train.was == TRAIN
    assert train.now.startswith("@torch.no_grad") and "(loss / 16).backward()" in train.now
    assert train.now.endswith("opt.zero_grad()") and "batch_size = 16" not in train.now
    assert write.to_json()["functions"][0] == {"name": "train", "was": TRAIN, "now": train.now}


def test_a_function_the_cell_defines_itself_stays_in_the_cell():
    own = "def train(model, batch_size):\n    pass\n\n" + CELL
    write = cell_write(
        own.replace("256", "16"), own, (("train", "def train(model, batch_size):\n    pass\n"),)
    )
    assert write.functions == () and write.body == own.replace("256", "16")


def test_a_source_that_is_not_python_is_written_whole():
    source = "!nvidia-smi\nbatch_size = 16"
    assert cell_write(source, source, (("train", TRAIN),)).body == source
