"""Finding a cell's batch size and rewriting the cell without touching anything else."""

from __future__ import annotations

import ast

import pytest

from oommagic.diagnosis.rewrite import (
    accumulates,
    changed_lines,
    keep_numbers_source,
    micro_batch_source,
    rewrite_batch,
    set_call_keyword,
    split_rows_source,
    unified_diff,
)
from oommagic.diagnosis.source import (
    BatchGuess,
    calls_with_keyword,
    find_batch,
    names_read,
    products_at,
    tokenizer_calls,
    whole_step,
)

TRAINER_CELL = """\
args = TrainingArguments(
    output_dir="out",
    per_device_train_batch_size=16,
    learning_rate=2e-5,  # warm-up is in the scheduler
    bf16=True,
)
trainer = Trainer(model=model, args=args, train_dataset=ds)
trainer.train()
"""

LOOP_CELL = """\
%%time
batch_size = 64
loader = DataLoader(ds, batch_size=batch_size, shuffle=True)
for batch in loader:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def _outside(old: str, new: str, old_literal: str, new_literal: str) -> tuple[str, str]:
    """Both sources with their changed literal cut out: what must stay byte-identical."""
    i = old.index(old_literal)
    j = new.index(new_literal)
    return old[:i] + old[i + len(old_literal) :], new[:j] + new[j + len(new_literal) :]


# --- find_batch ---------------------------------------------------------------------------------------


def test_batch_found_in_an_assignment():
    assert find_batch("batch_size = 64\ntrain(batch_size)\n") == BatchGuess("batch_size", 64, "source")


def test_batch_found_in_a_dataloader_keyword():
    guess = find_batch("loader = DataLoader(ds, batch_size=32, shuffle=True)\n")
    assert guess == BatchGuess("batch_size", 32, "source")


def test_batch_found_in_training_arguments():
    assert find_batch(TRAINER_CELL) == BatchGuess("per_device_train_batch_size", 16, "source")


def test_training_arguments_batch_wins_over_a_loose_bs():
    cell = "bs = 64\n" + TRAINER_CELL
    assert find_batch(cell).name == "per_device_train_batch_size"


def test_batch_found_in_the_namespace_when_the_cell_only_reads_it():
    guess = find_batch("loader = DataLoader(ds, batch_size=BATCH_SIZE)\n", {"BATCH_SIZE": 48, "epochs": 3})
    assert guess == BatchGuess("BATCH_SIZE", 48, "namespace")


def test_variable_behind_a_batch_keyword_counts_whatever_its_name():
    guess = find_batch("loader = DataLoader(ds, batch_size=n)\n", {"n": 24})
    assert guess == BatchGuess("n", 24, "namespace")


def test_explicit_name_found_as_a_literal_in_the_source():
    assert find_batch("per_gpu = 12\nrun(per_gpu)\n", name="per_gpu") == BatchGuess("per_gpu", 12, "source")


def test_explicit_name_found_in_the_namespace():
    assert find_batch("run(per_gpu)\n", {"per_gpu": 12}, name="per_gpu") == BatchGuess(
        "per_gpu", 12, "option"
    )


def test_no_batch_when_there_is_none():
    assert find_batch("x = torch.randn(1024, 1024, device='cuda')\n") is None
    assert find_batch("run(per_gpu)\n", {}, name="per_gpu") is None


def test_for_batch_in_loader_is_not_a_batch_size():
    assert find_batch("for batch in loader:\n    step(batch)\n", {"batch": "not an int"}) is None


def test_batch_found_in_a_cell_with_magics_and_shell_lines():
    guess = find_batch(LOOP_CELL)
    assert guess == BatchGuess("batch_size", 64, "source")


# --- rewrite_batch ------------------------------------------------------------------------------------


def test_rewrite_changes_only_the_literal():
    new = rewrite_batch(LOOP_CELL, find_batch(LOOP_CELL), 32, accumulate=1)
    assert new == LOOP_CELL.replace("batch_size = 64", "batch_size = 32")
    assert _outside(LOOP_CELL, new, "= 64", "= 32")[0] == _outside(LOOP_CELL, new, "= 64", "= 32")[1]


def test_magic_and_shell_lines_survive_a_rewrite():
    cell = "%time x = 1\n!nvidia-smi\nfiles = !ls\nbatch_size = 8\nmodel?\n%env FOO=1\ntrain(batch_size)\n"
    new = rewrite_batch(cell, BatchGuess("batch_size", 8), 4)
    assert new == cell.replace("batch_size = 8", "batch_size = 4")


def test_rewrite_keeps_non_ascii_text_and_comments_around_the_literal():
    cell = 'titre = "entraînement — café"; bs = 64  # 🚀 lot\ntrain(bs)\n'
    assert rewrite_batch(cell, BatchGuess("bs", 64), 16) == cell.replace("bs = 64", "bs = 16")


def test_rewrite_of_a_keyword_inside_a_multiline_call():
    new = rewrite_batch(TRAINER_CELL, find_batch(TRAINER_CELL), 8, accumulate=1)
    assert new == TRAINER_CELL.replace("per_device_train_batch_size=16", "per_device_train_batch_size=8")


def test_accumulation_added_to_training_arguments_on_its_own_line():
    new = rewrite_batch(TRAINER_CELL, find_batch(TRAINER_CELL), 8, accumulate=2)
    assert new == TRAINER_CELL.replace(
        "    per_device_train_batch_size=16,\n",
        "    per_device_train_batch_size=8,\n    gradient_accumulation_steps=2,\n",
    )


def test_accumulation_added_inline_in_a_one_line_call():
    cell = "args = TrainingArguments('out', per_device_train_batch_size=32, num_train_epochs=1)\n"
    new = rewrite_batch(cell, find_batch(cell), 16, accumulate=2)
    assert new == (
        "args = TrainingArguments('out', per_device_train_batch_size=16, gradient_accumulation_steps=2, "
        "num_train_epochs=1)\n"
    )


def test_existing_accumulation_is_multiplied():
    cell = "args = SFTConfig(per_device_train_batch_size=8, gradient_accumulation_steps=4)\n"
    new = rewrite_batch(cell, find_batch(cell), 2, accumulate=4)
    assert new == "args = SFTConfig(per_device_train_batch_size=2, gradient_accumulation_steps=16)\n"


def test_accumulation_set_from_a_variable_assigned_in_the_cell_is_multiplied():
    cell = (
        "ga = 2\nbs = 32\n"
        "args = TrainingArguments('o', per_device_train_batch_size=bs, gradient_accumulation_steps=ga)\n"
    )
    new = rewrite_batch(cell, find_batch(cell), 16, accumulate=2)
    assert new.startswith("ga = 4\nbs = 16\n")


def test_plain_training_loop_gets_no_invented_accumulation_code():
    new = rewrite_batch(LOOP_CELL, find_batch(LOOP_CELL), 32, accumulate=2)
    assert new == LOOP_CELL.replace("batch_size = 64", "batch_size = 32")
    assert not accumulates(LOOP_CELL)
    assert accumulates(TRAINER_CELL)


def test_every_literal_of_the_batch_is_rewritten():
    cell = "batch_size = 64\nloader = DataLoader(ds, batch_size=64)\n"
    new = rewrite_batch(cell, find_batch(cell), 32)
    assert new == "batch_size = 32\nloader = DataLoader(ds, batch_size=32)\n"


def test_rewrite_returns_none_when_the_batch_is_not_a_literal():
    cell = "loader = DataLoader(ds, batch_size=BATCH_SIZE)\n"
    guess = find_batch(cell, {"BATCH_SIZE": 48})
    assert rewrite_batch(cell, guess, 24, accumulate=2) is None


def test_rewrite_keeps_windows_line_endings():
    cell = "bs = 64\r\nargs = TrainingArguments(\r\n    per_device_train_batch_size=bs,\r\n)\r\n"
    new = rewrite_batch(cell, find_batch(cell), 32, accumulate=2)
    assert new == cell.replace("bs = 64", "bs = 32").replace(
        "batch_size=bs,\r\n", "batch_size=bs,\r\n    gradient_accumulation_steps=2,\r\n"
    )


# --- keywords, diffs, reads ----------------------------------------------------------------------------


def test_generate_keyword_replaced_where_passed():
    cell = "out = model.generate(**inputs, max_new_tokens=1024, num_beams=4)\nprint(out)\n"
    assert set_call_keyword(cell, "generate", "num_beams", 1) == cell.replace("num_beams=4", "num_beams=1")


def test_generate_keyword_added_where_missing():
    cell = "out = model.generate(**inputs)\n"
    assert set_call_keyword(cell, "generate", "max_new_tokens", 256) == (
        "out = model.generate(**inputs, max_new_tokens=256)\n"
    )


def test_keyword_added_to_a_call_without_arguments():
    assert set_call_keyword("x = f()\n", "f", "k", True) == "x = f(k=True)\n"


def test_truncation_added_to_the_tokenizer_call_and_existing_max_length_kept():
    cell = "enc = tokenizer(texts, max_length=128, return_tensors='pt')\n"
    with_trunc = set_call_keyword(cell, "tokenizer", "truncation", True)
    assert set_call_keyword(with_trunc, "tokenizer", "max_length", 512, replace=False) == (
        "enc = tokenizer(texts, max_length=128, return_tensors='pt', truncation=True)\n"
    )


def test_set_call_keyword_returns_none_without_such_a_call():
    assert set_call_keyword("x = 1\n", "generate", "num_beams", 1) is None


def test_tokenizer_calls_skip_str_encode():
    cell = "enc = tokenizer(texts)\nids = tok.batch_encode_plus(more)\nraw = 'abc'.encode()\n"
    assert tokenizer_calls(cell) == ("tokenizer", "tok.batch_encode_plus")


def test_calls_with_keyword_find_pipelines():
    assert calls_with_keyword("out = pipe(prompts, max_new_tokens=200)\n", "max_new_tokens") == ("pipe",)


def test_unified_diff_shows_the_change():
    diff = unified_diff("bs = 64\nrun(bs)\n", "bs = 32\nrun(bs)\n")
    assert "-bs = 64" in diff and "+bs = 32" in diff and " run(bs)" in diff


def test_changed_lines_are_what_to_copy():
    old = TRAINER_CELL
    new = rewrite_batch(old, find_batch(old), 8, accumulate=2)
    assert changed_lines(old, new) == "per_device_train_batch_size=8,\ngradient_accumulation_steps=2,"


def test_names_read_leave_out_what_the_cell_builds_afresh():
    cell = "model = AutoModel.from_pretrained('gpt2')\nout = model(x)\nopt = make(optimizer)\n"
    assert names_read(cell) == {"AutoModel", "x", "make", "optimizer"}


def test_names_read_count_a_rebinding_that_reads_first():
    assert "model" in names_read("model = model.to('cuda')\n")


def test_rewritten_cells_still_parse():
    new = rewrite_batch(TRAINER_CELL, find_batch(TRAINER_CELL), 4, accumulate=4)
    ast.parse(new)


def test_names_on_ipython_lines_count_as_read():
    assert "trainer" in names_read("%time trainer.train()\nx = 1\n")


def test_a_statement_goes_after_the_cells_own_assignment():
    from oommagic.diagnosis.rewrite import insert_after_assignment

    source = "%time x = 1\nmodel = Model(\n    width=4)\ntrain(model)"
    new = insert_after_assignment(source, "model", "model.gradient_checkpointing_enable()")
    assert new == (
        "%time x = 1\nmodel = Model(\n    width=4)\nmodel.gradient_checkpointing_enable()\ntrain(model)"
    )
    assert insert_after_assignment("train(model)", "model", "model.x()") is None


# --- Lightning's evaluation loaders ---------------------------------------------------------------------


def test_a_loader_passed_to_lightnings_validate_is_its_evaluation_batch():
    from oommagic.diagnosis.rewrite import set_literal
    from oommagic.diagnosis.source import eval_batch_literal, lightning_eval_batch

    inline = "trainer.validate(model, dataloaders=DataLoader(val_ds, batch_size=256))\n"
    found = lightning_eval_batch(inline, "val_dataloader")
    assert (found.name, found.value, found.owner) == ("batch_size", 256, "dataloaders")
    assert set_literal(inline, eval_batch_literal(inline, found), 128) == inline.replace("256", "128")
    named = "val_loader = DataLoader(val_ds, batch_size=64)\ntrainer.fit(model, val_dataloaders=val_loader)\n"
    assert lightning_eval_batch(named, "val_dataloader").owner == "val_loader"
    assert lightning_eval_batch(named, "test_dataloader") is None  # trainer.test reads another loader


def test_an_earlier_cells_val_dataloader_is_passed_by_the_cell_itself():
    from oommagic.diagnosis.rewrite import pass_hook_loader

    hook = (
        'def val_dataloader(self):\n    """Validation."""\n'
        "    return DataLoader(self.val_ds, batch_size=1024)\n"
    )
    assert pass_hook_loader("trainer.validate(model)\n", "val_dataloader", hook, 512) == (
        "trainer.validate(model, dataloaders=DataLoader(model.val_ds, batch_size=512))\n"
    )
    # A datamodule or loaders already passed, or a hook that does more than return: nothing to write.
    assert pass_hook_loader("trainer.validate(model, datamodule=dm)\n", "val_dataloader", hook, 512) is None
    busy = "def val_dataloader(self):\n    ds = self.ds\n    return DataLoader(ds, batch_size=8)\n"
    assert pass_hook_loader("trainer.validate(model)\n", "val_dataloader", busy, 4) is None


def test_last_position_logits_are_read_through_the_call_or_its_output():
    from oommagic.diagnosis.rewrite import keep_last_logits_source
    from oommagic.diagnosis.source import last_logits_calls

    direct = "nxt = model(ids).logits[:, -1].argmax(-1)\n"
    assert last_logits_calls(direct) == ("model",)
    assert keep_last_logits_source(direct, ("model",), "logits_to_keep") == direct.replace(
        "model(ids)", "model(ids, logits_to_keep=1)"
    )
    assert last_logits_calls("out = model(**enc)\np = out.logits[:, -1, :].softmax(-1)\n") == ("model",)
    assert last_logits_calls("out = model(**enc)\np = out.logits.softmax(-1)\n") == ()
    assert last_logits_calls("a = model(x).logits[:, -1]\nb = model(y).logits\n") == ()


KEPT_PREDICTIONS = """\
preds = []
with torch.no_grad():
    for xb, yb in loader:
        preds.append(net(xb).detach())
acc = (torch.argmax(torch.cat(preds), dim=-1) == labels).float().mean()
top = torch.cat(preds, dim=0)[:8].argmax(dim=-1)
"""


def test_kept_outputs_read_only_through_argmax_keep_the_argmax_each_step():
    new = keep_numbers_source(KEPT_PREDICTIONS, {"preds": 2})
    assert "preds.append(net(xb).argmax(-1))" in new
    assert "acc = (torch.cat(preds) == labels)" in new
    assert "top = torch.cat(preds, dim=0)[:8]\n" in new


def test_kept_outputs_keep_a_host_copy_when_the_reduction_cannot_move_into_the_loop():
    copied = "preds.append(net(xb).detach().cpu())"
    # Indexing that may reach the last dimension: unknown without the kept tensors' dimensions, and two
    # indices of a 2-D tensor do.
    indexed = KEPT_PREDICTIONS.replace("[:8]", "[:8, 1:]")
    assert copied in keep_numbers_source(indexed)
    assert copied in keep_numbers_source(indexed, {"preds": 2})
    assert "argmax(-1))" in keep_numbers_source(indexed, {"preds": 3})
    # Another read of the list, another reduction, or one along another dimension.
    # Without the kept tensors' dimensions nothing moves: 1-D pieces joined by `cat` are reduced along
    # the very dimension they are joined by.
    assert copied in keep_numbers_source(KEPT_PREDICTIONS)
    assert copied in keep_numbers_source(KEPT_PREDICTIONS, {"preds": 1})
    others = ("print(len(preds))", "m = torch.cat(preds).softmax(-1)", "m = torch.cat(preds).argmax(0)")
    for other in others:
        assert copied in keep_numbers_source(KEPT_PREDICTIONS + other + "\n", {"preds": 2}), other


def test_the_last_dimension_is_read_by_its_index_too_and_integer_indexing_drops_one():
    classify = (
        "probs = []\nfor xb in batches:\n    probs.append(net(xb))\nlabels = torch.cat(probs).argmax(dim=1)\n"
    )
    assert "probs.append(net(xb).argmax(-1))" in keep_numbers_source(classify, {"probs": 2})
    # The same index of 3-D logits is not their last dimension.
    assert "argmax(dim=1)" in keep_numbers_source(classify, {"probs": 3})
    # `[0]` drops the first dimension of 3-D pieces: dimension 1 is then the last.
    first = classify.replace("torch.cat(probs).argmax(dim=1)", "torch.cat(probs)[0].argmax(1)")
    assert "probs.append(net(xb).argmax(-1))" in keep_numbers_source(first, {"probs": 3})
    # Stacked pieces get a new first dimension: the reduction of 1-D pieces' only one moves in.
    stacked = classify.replace("torch.cat(probs)", "torch.stack(probs)")
    assert "probs.append(net(xb).argmax(-1))" in keep_numbers_source(stacked, {"probs": 1})


def test_a_model_called_on_a_whole_tensor_is_called_on_chunks_of_its_rows_and_joined():
    cell = (
        "with torch.no_grad():\n"
        "    out = net.encoder(X, mask=m)\n"
        "    again = net.encoder(X)\n"
        "print(out.shape)\n"
    )
    assert split_rows_source(cell, "net.encoder(X, mask=m)", "X", 512, "net.encoder") == (
        "with torch.no_grad():\n"
        "    out = torch.cat([net.encoder(rows, mask=m) for rows in X.split(512)])\n"
        "    again = torch.cat([net.encoder(rows) for rows in X.split(512)])\n"
        "print(out.shape)\n"
    ), "every call, keywords kept"
    plain = "y = model(X)\n"
    assert split_rows_source(plain, "model(X)", "X", 64, "model") == (
        "import torch\ny = torch.cat([model(rows) for rows in X.split(64)])\n"
    ), "torch imported where the cell does not name it"
    assert split_rows_source(plain, "model(Y)", "Y", 64, "model") is None
    assert split_rows_source("y = model(X, Z)\n", "model(X, Z)", "X", 64, "model") is None, "two inputs"


def test_a_row_wise_expression_runs_on_chunks_of_rows_and_its_results_are_joined():
    knn = "nearest = torch.cdist(Xq, Xdb).argmin(dim=1)\nprint(nearest[:3])\n"
    assert split_rows_source(knn, "torch.cdist(Xq, Xdb).argmin(dim=1)", "Xq", 500) == (
        "nearest = torch.cat([torch.cdist(rows, Xdb).argmin(dim=1) for rows in Xq.split(500)])\n"
        "print(nearest[:3])\n"
    )
    top = "best = (q @ db.T).topk(5, dim=1).indices\n"
    assert split_rows_source(top, "(q @ db.T).topk(5, dim=1).indices", "q", 64) == (
        "import torch\nbest = torch.cat([(rows @ db.T).topk(5, dim=1).indices for rows in q.split(64)])\n"
    )
    probs = "p = model(X).softmax(dim=-1).cpu()\n"
    assert split_rows_source(probs, "model(X).softmax(dim=-1).cpu()", "X", 8, "model") == (
        "import torch\np = torch.cat([model(rows).softmax(dim=-1).cpu() for rows in X.split(8)])\n"
    )


def test_only_expressions_that_keep_rows_apart_are_split():
    from oommagic.diagnosis.source import rows_expression

    def found(line, modules=frozenset()):
        node = rows_expression(line, 1, modules)
        return ast.get_source_segment(line, node) if node is not None else None

    assert found("d = torch.cdist(Xq, Xdb).argmin(dim=1)") == "torch.cdist(Xq, Xdb).argmin(dim=1)"
    assert found("m = (a @ b).max(dim=1).values") == "(a @ b).max(dim=1).values"
    assert found("m = (a @ b).max(dim=0).values") == "a @ b", "a reduction over the rows: the product only"
    assert found("m = (a @ b).topk(3, dim=1)") == "a @ b", "a (values, indices) pair is not joined"
    assert found("s = x.softmax(dim=1)") is None, "no product: nothing grows with the rows"
    assert found("y = f(X)") is None and found("y = f(X)", frozenset({"f"})) == "f(X)"
    assert found("y = (X @ W).sum()") == "X @ W", "a sum over everything is no row's"
    # A transformers model on its one input by keyword, read through a tensor field of its output.
    hf = frozenset({"enc"})
    assert found("f = enc(input_ids=ids).last_hidden_state.mean(dim=1)", hf) == (
        "enc(input_ids=ids).last_hidden_state.mean(dim=1)"
    )
    assert found("out = enc(input_ids=ids)", hf) is None, "its output object is no tensor to join"
    assert found("f = enc(input_ids=ids, attention_mask=m).logits", hf) is None, "two inputs"
    assert found("f = enc(input_ids=ids)[0].mean(dim=1)", hf) == "enc(input_ids=ids)[0].mean(dim=1)"
    assert found("f = enc(input_ids=ids).values", hf) is None, "a field of a pair, not of a model's output"
    assert found("m = (a @ b).max(dim=1)[1]") == "(a @ b).max(dim=1)[1]"


def test_a_product_on_the_failing_line_is_read_from_the_cell():
    cell = (
        "%time sims = emb @ emb.T\n"
        "scores = torch.einsum('ij,kj->ik', a, b)\n"
        "for i in range(3):\n"
        "    out = F.linear(x, w)\n"
        "total = a + b  # @ in a comment\n"
        "s = '@'\n"
    )
    assert [products_at(cell, n) for n in range(1, 8)] == [True, True, False, True, False, False, False]
    assert not products_at("x = (", 1) and not products_at(cell, None)


FULL_BATCH = """\
X, y = X.to(device), y.to(device)
for epoch in range(100):
    pred = model(X)
    loss = loss_fn(pred, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if epoch % 10 == 0:
        print(epoch, loss.item(), (pred.argmax(1) == y).float().mean().item())
"""


def test_a_training_step_on_whole_tensors_is_found_with_its_inputs_and_optimizer_calls():
    step = whole_step(FULL_BATCH)
    assert step is not None
    # `X` and `y` are rebound only to themselves moved; `model` and `loss_fn` are called, not read whole.
    assert step.inputs == ("X", "y") and step.fed == (("model", "X"),)
    first, before, after = step.span(("X", "y"))
    assert [ast.unparse(s) for s in step.block[first : step.last + 1]] == [
        "pred = model(X)",
        "loss = loss_fn(pred, y)",
        "optimizer.zero_grad()",
        "loss.backward()",
    ]
    assert [ast.unparse(s) for s in before] == ["optimizer.zero_grad()"] and after == ()


def test_a_step_on_whole_tensors_runs_on_micro_batches_with_one_optimizer_step():
    new = micro_batch_source(FULL_BATCH, ("X", "y"), 1000, 300)
    assert (
        new
        == """\
X, y = X.to(device), y.to(device)
for epoch in range(100):
    optimizer.zero_grad()
    for X_rows, y_rows in zip(X.tensor_split(4), y.tensor_split(4)):
        pred = model(X_rows)
        loss = loss_fn(pred, y_rows)
        (loss * len(X_rows) / len(X)).backward()
    optimizer.step()
    if epoch % 10 == 0:
        print(epoch, loss.item(), (pred.argmax(1) == y_rows).float().mean().item())
"""
    )
    # What comes before the first statement that reads the inputs stays outside the micro-batches.
    scale = "    scale = torch.tensor(0.9) ** epoch\n"
    scaled = FULL_BATCH.replace("    pred = model(X)", f"{scale}    pred = model(X)")
    new = micro_batch_source(scaled, ("X", "y"), 1000, 300)
    assert "    scale = torch.tensor(0.9) ** epoch\n    optimizer.zero_grad()\n    for X_rows" in new, new
    # Inputs kept on the host and moved in the step are read whole all the same.
    moved = FULL_BATCH.replace("X, y = X.to(device), y.to(device)\n", "").replace(
        "model(X)", "model(X.to(device))"
    )
    assert whole_step(moved).fed == (("model", "X"),)
    assert "        pred = model(X_rows.to(device))\n" in micro_batch_source(moved, ("X", "y"), 1000, 300)
    # A loss written as a sum is weighted whole.
    two = FULL_BATCH.replace(
        "    loss.backward()", "    (loss + 0.1 * model[0].weight.square().sum()).backward()"
    )
    assert "((loss + 0.1 * model[0].weight.square().sum()) * len(X_rows) / len(X)).backward()" in (
        micro_batch_source(two, ("X", "y"), 1000, 300)
    )
    # A summed loss is not weighted (its micro-batches' sums add up to it); a name taken stays taken.
    summed = FULL_BATCH.replace("loss_fn(pred, y)", 'loss_fn(pred, y, reduction="sum")')
    new = micro_batch_source(summed.replace("print(epoch, ", "X_rows = 0; print("), ("X",), 1000, 500)
    assert "for X_rows_ in X.tensor_split(2):" in new and "        loss.backward()" in new
    assert "model(X_rows_)" in new and "loss_fn(pred, y, reduction" in new


TRAIN_FUNCTION = """\
def train(model, X, y, epochs=20):
    opt = torch.optim.Adam(model.parameters())
    for epoch in range(epochs):
        opt.zero_grad()
        loss = F.cross_entropy(model(X), y)
        loss.backward()
        opt.step()
    return loss.item()

final = train(net, X_train.to(device), y=y_train)
"""


def test_a_training_function_the_cell_defines_and_calls_gets_micro_batches_of_its_parameters():
    step = whole_step(TRAIN_FUNCTION)
    assert step.function == "train" and step.inputs == ("X", "y") and step.fed == (("model", "X"),)
    assert [step.outside(n) for n in ("model", "X", "y", "F.cross_entropy")] == [
        "net",
        "X_train",
        "y_train",
        "F.cross_entropy",
    ]
    new = micro_batch_source(TRAIN_FUNCTION, ("X", "y"), 1000, 500)
    assert (
        """\
        opt.zero_grad()
        for X_rows, y_rows in zip(X.tensor_split(2), y.tensor_split(2)):
            loss = F.cross_entropy(model(X_rows), y_rows)
            (loss * len(X_rows) / len(X)).backward()
        opt.step()
"""
        in new
    ), new
    # Called twice, with other data each time: no one set of rows.
    assert whole_step(TRAIN_FUNCTION + "train(net, X_val, y_val)\n") is None


@pytest.mark.parametrize(
    "cell",
    [
        # sliced: a loop over batches already, its batch is found elsewhere
        "for i in range(0, len(X), 64):\n    loss_fn(model(X[i:i + 64]), y[i:i + 64]).backward()",
        # the backward pass inside a function of the cell
        "def step():\n    loss_fn(model(X), y).backward()\nstep()",
        # two backward passes
        "loss_fn(model(X), y).backward()\nloss_fn(model(X), y).backward()",
        # an optimizer step inside a block of the step would run once per micro-batch
        "for e in range(3):\n    loss = loss_fn(model(X), y)\n    if e:\n        opt.step()\n"
        "    loss.backward()",
        # the input made by the cell itself
        "X = torch.randn(64, 8)\nloss_fn(model(X), y).backward()",
    ],
    ids=["sliced", "in-function", "two-backward", "nested-step", "made-in-cell"],
)
def test_no_micro_batches_are_written_where_the_step_is_not_on_whole_tensors_of_the_namespace(cell):
    new = micro_batch_source(cell, ("X", "y"), 64, 16)
    assert new is None, new


def test_a_loop_bound_written_with_the_batch_keeps_the_samples_it_sees():
    cell = (
        "bs = 16\n"
        "for i in range(0, 3 * bs, bs):\n"
        "    xb = X[i:i + bs]\n"
        "    loss = model(xb).sum()\n"
        "    loss.backward()\n"
    )
    new = rewrite_batch(cell, BatchGuess("bs", 16), 4)
    assert new is not None
    assert "bs = 4\n" in new
    # The stop still reads 48 samples; the step and the slice follow the new batch.
    assert "range(0, 3 * 16, bs)" in new and "X[i:i + bs]" in new


def test_a_source_that_steps_an_optimizer_or_a_trainer_is_told_from_one_that_only_switches_modes():
    from oommagic.diagnosis.source import steps_optimizer

    assert steps_optimizer("loss.backward()\nopt.step()\n")
    assert steps_optimizer("scaler.step(optimizer)\nscaler.update()\n")
    assert steps_optimizer("trainer.train()\n")
    assert steps_optimizer("model.fit(X, y, epochs=2)\n")
    assert not steps_optimizer("model.train()\nloss = model(x).sum()\nloss.backward()\n")


def test_the_step_of_a_loop_over_slices_is_the_batch_whatever_its_name():
    cell = (
        "B = 32\n"
        "with torch.inference_mode():\n"
        "    for start in range(0, len(docs), B):\n"
        "        ids = collate(docs[start:start + B])\n"
        "        h = encoder(input_ids=ids).last_hidden_state\n"
    )
    assert find_batch(cell, {}) == BatchGuess("B", 32, "source")
    assert find_batch(cell.replace("B = 32\n", ""), {"B": 16}) == BatchGuess("B", 16, "namespace")
    assert "B = 8\n" in rewrite_batch(cell, BatchGuess("B", 32, "source"), 8)


def test_an_adam_family_optimizer_becomes_torchs_adafactor_with_what_both_mean_alike():
    from oommagic.diagnosis.rewrite import factored_optimizer_source

    cell = "opt = AdamW(model.parameters(), 2e-5, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-6)\n"
    new = factored_optimizer_source(cell)
    assert new == (
        "import torch\nopt = torch.optim.Adafactor(model.parameters(), lr=2e-5, weight_decay=0.01)\n"
    )
    assert factored_optimizer_source("opt = torch.optim.SGD(model.parameters(), lr=0.1)\n") is None


def test_calls_of_plain_modules_go_through_torchs_checkpoint_where_gradients_are_on():
    from oommagic.diagnosis.rewrite import checkpoint_calls_source

    cell = "z = tower(x.to(device), mask=m)\nwith torch.no_grad():\n    e = tower(y)\n"
    new = checkpoint_calls_source(cell, ["tower"])
    assert new == (
        "import torch.utils.checkpoint\n"
        "z = torch.utils.checkpoint.checkpoint(tower, x.to(device), mask=m, use_reentrant=False)\n"
        "with torch.no_grad():\n    e = tower(y)\n"
    )


def test_a_whole_product_read_once_by_a_row_wise_reduction_is_written_into_it():
    from oommagic.diagnosis.source import inlined_product

    cell = "dist = torch.cdist(Q, K)\nnearest = dist.topk(5, largest=False).indices\nprint(nearest.shape)\n"
    assert inlined_product(cell, 1) == (
        "nearest = torch.cdist(Q, K).topk(5, largest=False).indices\nprint(nearest.shape)\n",
        "dist",
        1,
    )
    # Inside a loop, by name (as the rewrite finds it again), the product a matrix product.
    loop = "for q in batches:\n    sims = q @ corpus.T\n    best.append(sims.argmax(dim=1))\n"
    assert inlined_product(loop, name="sims") == (
        "for q in batches:\n    best.append((q @ corpus.T).argmax(dim=1))\n",
        "sims",
        2,
    )
    # Read twice, bound again, read by nothing, or no product: the binding stays.
    assert inlined_product("d = torch.cdist(Q, K)\na = d.argmin(1)\nb = d.argmax(1)\n", 1) is None
    assert inlined_product("d = torch.cdist(Q, K)\na = d.argmin(1)\nd = 0\n", 1) is None
    assert inlined_product("d = torch.cdist(Q, K)\nprint(1)\n", 1) is None
    assert inlined_product("d = Q.sum(dim=1)\na = d.argmin(0)\n", 1) is None


def test_a_reduction_whose_dim_defaults_to_the_last_keeps_rows_apart():
    from oommagic.diagnosis.source import rows_expression

    line = "top = (a @ b).topk(3).indices"
    node = rows_expression(line, 1)
    assert ast.get_source_segment(line, node) == "(a @ b).topk(3).indices"
    line = "order = (a @ b).argsort()"
    assert ast.get_source_segment(line, rows_expression(line, 1)) == "(a @ b).argsort()"
    line = "m = (a @ b).argmax()"
    assert ast.get_source_segment(line, rows_expression(line, 1)) == "a @ b", "argmax of everything"


def _work_of(cell: str, loader: list) -> dict:
    """The optimizer steps and the rows a training cell's forward passes saw, run on stand-ins."""
    counted = {"steps": 0, "rows": 0}

    class Opt:
        def zero_grad(self):
            pass

        def step(self):
            counted["steps"] += 1

    class Loss:
        def __truediv__(self, _):
            return self

        def backward(self):
            pass

    def net(rows):
        counted["rows"] += len(rows)
        return Loss()

    exec(cell, {"loader": loader, "net": net, "opt": Opt()})
    return counted


def test_a_loop_that_stops_on_its_count_stops_after_as_many_whole_steps():
    from oommagic.diagnosis.rewrite import accumulate_loops

    loop = (
        "for i, (x, y) in enumerate(loader):\n"
        "    if i >= 5:\n"
        "        break\n"
        "    loss = crit(net(x), y)\n"
        "    opt.zero_grad()\n"
        "    loss.backward()\n"
        "    opt.step()\n"
        "    if i + 1 == max_steps:\n"
        "        break\n"
    )
    assert accumulate_loops(loop, 4) == (
        "micro_step = 0\n"
        "for i, (x, y) in enumerate(loader):\n"
        "    if i % 4 == 0 and (i // 4 >= 5):\n"
        "        break\n"
        "    loss = crit(net(x), y)\n"
        "    if micro_step % 4 == 0:\n"
        "        opt.zero_grad()\n"
        "    (loss / 4).backward()\n"
        "    micro_step += 1\n"
        "    if micro_step % 4 == 0:\n"
        "        opt.step()\n"
        "    if i % 4 == 3 and (i // 4 + 1 == max_steps):\n"
        "        break\n"
    )
    # Run on batches of 12 rows, and of 12 / k rows with k micro-batches a step: the same optimizer steps
    # and rows, whether the stop comes before the step or after it.
    body = "    loss = net(x)\n    opt.zero_grad()\n    loss.backward()\n    opt.step()\n"
    for stop, before, steps in (
        ("i == 2", True, 2),
        ("i + 1 == 3", False, 3),
        ("i >= 3", True, 3),
        ("i > 1", False, 3),
    ):
        check = f"    if {stop}:\n        break\n"
        cell = "for i, x in enumerate(loader):\n" + (check + body if before else body + check)
        for k in (1, 2, 3):
            written = accumulate_loops(cell, k) if k > 1 else cell
            assert _work_of(written, [list(range(12 // k))] * 40) == {"steps": steps, "rows": 12 * steps}, (
                written
            )


def test_a_dict_of_tensors_splatted_into_a_model_runs_on_chunks_of_every_value():
    from oommagic.diagnosis.source import inlined_product

    cell = "with torch.no_grad():\n    out = bert(**enc)\n    vecs = out.last_hidden_state.mean(dim=1)\n"
    inlined, name, line = inlined_product(cell, 2, modules=frozenset({"bert"}))
    assert (name, line) == ("out", 2)
    assert inlined == "with torch.no_grad():\n    vecs = bert(**enc).last_hidden_state.mean(dim=1)\n"
    new = split_rows_source(inlined, "bert(**enc).last_hidden_state.mean(dim=1)", "enc", 4, "bert")
    assert new == (
        "with torch.no_grad():\n    vecs = torch.cat([bert(**{key: value[rows:rows + 4] for key, value in "
        "enc.items()}).last_hidden_state.mean(dim=1) "
        "for rows in range(0, len(next(iter(enc.values()))), 4)])\n"
    )
    # Run on a stand-in model: the same rows, in order, from chunks of every value.
    import torch

    class Out:
        def __init__(self, h):
            self.last_hidden_state = h

    def bert(input_ids, attention_mask):
        return Out(input_ids[:, :, None].float() * attention_mask[:, :, None])

    enc = {"input_ids": torch.arange(30).reshape(10, 3), "attention_mask": torch.ones(10, 3)}
    ns = {"torch": torch, "bert": bert, "enc": enc}
    exec(new, ns)
    assert torch.equal(ns["vecs"], bert(**enc).last_hidden_state.mean(dim=1))
