"""The diagnosis: each rule fires on its evidence, names its numbers, stays quiet without it; ranking."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from oommagic.diagnosis.findings import DiagnosisContext, Finding, Leftover, ModelInfo, Remedy, figures
from oommagic.diagnosis.rules import diagnose
from oommagic.diagnosis.source import BatchGuess
from oommagic.oom import OOMReport
from oommagic.timeline import Timeline

MiB = 1024**2
GiB = 1024**3
CARD_24 = 24 * GiB
H200 = int(139.80 * GiB)

LOOP = """\
batch_size = 64
loader = DataLoader(ds, batch_size=batch_size)
for batch in loader:
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def _report(**figures) -> OOMReport:
    return OOMReport(text="CUDA out of memory.", device="cuda", gpu_index=0, **figures)


def fragmented_24() -> OOMReport:
    """'needed 2.00 GiB more than the 24.00 GiB card had: 9.35 GiB of it reserved but unused'."""
    return _report(
        requested=2 * GiB,
        capacity=CARD_24,
        free=0,
        allocated=int(13.65 * GiB),
        reserved=int(23.00 * GiB),
        reserved_unallocated=int(9.35 * GiB),
        process_used=int(23.50 * GiB),
    )


def plain_24(requested: int = 2 * GiB, allocated: int = 22 * GiB) -> OOMReport:
    """Out of memory on a 24 GiB card with a tidy cache: 1.5 GiB short."""
    return _report(
        requested=requested,
        capacity=CARD_24,
        free=GiB // 2,
        allocated=allocated,
        reserved=allocated + GiB,
        reserved_unallocated=GiB,
        process_used=allocated + GiB + GiB // 2,
    )


def gpt2(**kw) -> ModelInfo:
    return ModelInfo("model", int(0.46 * GiB), "float32", **kw)


def keys(findings: list[Finding]) -> list[str]:
    return [f.key for f in findings]


def finding(findings: list[Finding], key: str) -> Finding:
    return next(f for f in findings if f.key == key)


def remedy(f: Finding, kind: str) -> Remedy:
    return next(r for r in f.remedies if r.kind == kind)


# --- fragmentation --------------------------------------------------------------------------------------


def test_fragmentation_offers_expandable_segments_live():
    found = diagnose(fragmented_24(), DiagnosisContext(capacity=CARD_24))
    frag = found[0]
    assert frag.key == "fragmentation"
    assert "9.35 GiB" in frag.evidence and "2.00 GiB" in frag.evidence and "23.00 GiB" in frag.evidence
    live = remedy(frag, "expandable_segments")
    assert live.automatic and live.saving == int(9.35 * GiB)
    assert "covers the 2.00 GiB the failed request lacked" in live.explanation
    split = remedy(frag, "max_split_size")
    assert not split.automatic and "max_split_size_mb:1024" in split.code


def test_fragmentation_quiet_when_little_is_cached():
    assert "fragmentation" not in keys(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24)))


def test_fragmentation_says_when_expandable_segments_are_already_on():
    found = diagnose(fragmented_24(), DiagnosisContext(capacity=CARD_24, expandable_segments_on=True))
    frag = finding(found, "fragmentation")
    assert "already on" in frag.evidence
    assert [r.kind for r in frag.remedies] == ["max_split_size"]


def test_fragmentation_says_plainly_when_it_is_not_enough():
    report = _report(
        requested=8 * GiB,
        capacity=CARD_24,
        free=0,
        allocated=18 * GiB,
        reserved=24 * GiB,
        reserved_unallocated=6 * GiB,
    )
    frag = finding(diagnose(report, DiagnosisContext(capacity=CARD_24)), "fragmentation")
    assert "not enough: the failed request lacked 8.00 GiB, 2.00 GiB more than this saves" in (
        remedy(frag, "expandable_segments").explanation
    )


# --- other processes ------------------------------------------------------------------------------------


def test_other_processes_named_with_their_memory_and_another_gpu_offered():
    report = _report(
        requested=40 * GiB,
        capacity=H200,
        free=int(3.29 * GiB),
        allocated=70 * GiB,
        reserved=72 * GiB,
        reserved_unallocated=2 * GiB,
        other_processes=((4242, 60 * GiB),),
    )
    ctx = DiagnosisContext(
        capacity=H200, processes=((4242, "python3", 60 * GiB),), other_gpus=((1, 130 * GiB), (2, 20 * GiB))
    )
    other = finding(diagnose(report, ctx), "other_processes")
    assert "PID 4242 (python3) holds 60.00 GiB" in other.evidence
    assert other.saving == 60 * GiB
    move = remedy(other, "other_gpu")
    assert move.params == {"index": 1} and "CUDA_VISIBLE_DEVICES=1" in move.code
    assert "130.00 GiB" in move.title


def test_other_processes_say_when_no_other_gpu_has_room():
    report = _report(requested=4 * GiB, capacity=CARD_24, free=0, allocated=10 * GiB, reserved=10 * GiB)
    ctx = DiagnosisContext(
        capacity=CARD_24, processes=((777, "jupyter-kernel", 12 * GiB),), other_gpus=((1, 8 * GiB),)
    )
    other = finding(diagnose(report, ctx), "other_processes")
    assert [r.kind for r in other.remedies] == ["shutdown_kernel"]
    assert "No other GPU has room for the 14.00 GiB" in other.evidence and "8.00 GiB free" in other.evidence


def test_other_processes_are_named_with_user_and_command_and_offered_to_stop_after_asking():
    report = _report(requested=4 * GiB, capacity=CARD_24, free=0, allocated=10 * GiB, reserved=10 * GiB)
    ctx = DiagnosisContext(
        capacity=CARD_24,
        processes=((777, "python", 12 * GiB), (778, "python", GiB)),
        owners=((777, "ada", "python -m ipykernel_launcher -f kernel-1.json"), (778, None, None)),
    )
    other = finding(diagnose(report, ctx), "other_processes")
    assert (
        "PID 777 (user ada, `python -m ipykernel_launcher -f kernel-1.json`) holds 12.00 GiB"
        in other.evidence
    )
    assert "PID 778 (python) holds 1.00 GiB" in other.evidence
    stop = remedy(other, "shutdown_kernel")
    assert stop.params["pid"] == 777 and stop.title == "Shut down PID 777 (12.00 GiB)"
    # Never stopped from the kernel: the sidebar asks and calls the server's route.
    assert not any(r.automatic for r in other.remedies if r.kind == "shutdown_kernel")


def test_the_owner_of_this_process_is_read_from_proc():
    import getpass
    import os

    from oommagic.diagnosis.context import process_owner

    user, command = process_owner(os.getpid())
    assert user == getpass.getuser() and "python" in command
    assert process_owner(2**22 + 12345) == (None, None)


def test_other_processes_quiet_when_the_card_is_ours():
    assert "other_processes" not in keys(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24)))


# --- leftovers ------------------------------------------------------------------------------------------


def test_leftovers_listed_by_bytes_and_freed_unless_the_cell_reads_them():
    ctx = DiagnosisContext(
        source="out = model(batch)\nloss = out.loss\n",
        capacity=CARD_24,
        before_allocated=18 * GiB,
        leftovers=(
            Leftover("acts", "tensor", 4 * GiB),
            Leftover("old_model", "module", 12 * GiB),
            Leftover("model", "module", int(1.5 * GiB)),
        ),
    )
    left = finding(diagnose(plain_24(), ctx), "leftovers")
    assert left.evidence.index("old_model (module) 12.00 GiB") < left.evidence.index("acts (tensor) 4.00 GiB")
    assert "18.00 GiB was allocated before the cell" in left.evidence
    assert "This cell uses model" in left.evidence
    free = remedy(left, "free_leftovers")
    assert free.automatic and free.params == {"names": ["old_model", "acts"]}
    assert free.saving == 16 * GiB and "del old_model, acts" in free.code


def test_a_variable_the_cell_rebuilds_is_a_leftover():
    ctx = DiagnosisContext(
        source="model = AutoModelForCausalLM.from_pretrained(name).to('cuda')\n",
        capacity=CARD_24,
        before_allocated=13 * GiB,
        leftovers=(Leftover("model", "module", 13 * GiB),),
    )
    free = remedy(finding(diagnose(plain_24(), ctx), "leftovers"), "free_leftovers")
    assert free.params == {"names": ["model"]}


def test_leftovers_quiet_without_memory_held_before():
    assert "leftovers" not in keys(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24)))


def test_memory_held_by_nothing_in_the_namespace_is_said_plainly():
    ctx = DiagnosisContext(capacity=CARD_24, before_allocated=10 * GiB)
    left = finding(diagnose(plain_24(), ctx), "leftovers")
    assert left.remedies == ()
    assert "10.00 GiB of it is held by nothing in the namespace" in left.evidence and "Out" in left.evidence


# --- too large ------------------------------------------------------------------------------------------


def test_a_14b_model_in_float32_is_too_large_for_24_gib():
    model = ModelInfo("model", 56_000_000_000, "float32", is_hf=True)
    ctx = DiagnosisContext(capacity=CARD_24, models=(model,), generation=True)
    found = diagnose(plain_24(requested=GiB // 2), ctx)
    big = found[0]
    assert big.key == "too_large" and "weights" not in keys(found)
    assert "52.15 GiB of float32 weights" in big.evidence and "24.00 GiB card" in big.evidence
    kinds = [r.kind for r in big.remedies]
    assert kinds.count("quantize") == 2 and "offload" in kinds
    bf16 = next(r for r in big.remedies if r.title == "bfloat16 weights")
    assert bf16.saving == 28_000_000_000 and "torch_dtype=torch.bfloat16" in bf16.code
    assert not any(r.automatic for r in big.remedies)


def test_a_7b_model_in_float32_whose_bfloat16_weights_fit_gets_a_bfloat16_button():
    model = ModelInfo("model", 28_000_000_000, "float32", is_hf=True)
    ctx = DiagnosisContext(
        capacity=CARD_24, models=(model,), generation=True, source="out = model.generate(ids)\n"
    )
    found = diagnose(plain_24(requested=GiB // 2), ctx)
    assert "too_large" not in keys(found)
    weights = finding(found, "weights")
    assert "model holds 26.08 GiB of float32 weights on the device: 109% of the 24.00 GiB card" in (
        weights.evidence
    )
    bf16 = next(r for r in weights.remedies if r.params.get("dtype") == "bfloat16")
    assert bf16.automatic and bf16.saving == 14_000_000_000
    assert bf16.new_source == "import torch\nmodel.to(torch.bfloat16)\nout = model.generate(ids)\n"


def test_training_counts_gradients_and_adam_state():
    model = ModelInfo(
        "model", 12 * GiB, "bfloat16", is_hf=True, supports_checkpointing=True, is_training=True
    )
    ctx = DiagnosisContext(capacity=CARD_24, models=(model,), other_gpus=((1, 80 * GiB),))
    big = finding(diagnose(plain_24(), ctx), "too_large")
    assert "gradients + two Adam moments (no optimizer found yet: AdamW assumed)" in big.evidence
    assert "48.00 GiB" in big.evidence
    qlora = next(r for r in big.remedies if r.kind == "quantize")
    assert "get_peft_model" in qlora.code and qlora.saving == 45 * GiB
    shard = remedy(big, "multi_gpu")
    assert "torchrun" in shard.code and "fully_shard" in shard.code


def test_one_request_larger_than_the_card():
    found = diagnose(plain_24(requested=30 * GiB, allocated=GiB), DiagnosisContext(capacity=CARD_24))
    assert found[0].key == "too_large"
    assert "One request of 30.00 GiB is larger than the whole 24.00 GiB card" in found[0].evidence


def test_too_large_quiet_for_a_model_that_fits():
    ctx = DiagnosisContext(capacity=CARD_24, models=(gpt2(is_training=True),), source=LOOP)
    assert "too_large" not in keys(diagnose(plain_24(), ctx))


# --- activations ----------------------------------------------------------------------------------------


def training_ctx(**kw) -> DiagnosisContext:
    base = dict(
        source=LOOP,
        capacity=CARD_24,
        before_allocated=int(0.46 * GiB),
        models=(gpt2(is_training=True),),
        trains=True,
        batch=BatchGuess("batch_size", 64, "source"),
    )
    return DiagnosisContext(**{**base, **kw})


def test_training_batch_halved_with_accumulation_keeping_the_effective_batch():
    act = finding(diagnose(plain_24(), training_ctx()), "activations")
    assert "The cell needed 24.00 GiB at its peak: 1.84 GiB that does not grow with the batch" in act.evidence
    assert "about 22.16 GiB that does" in act.evidence and "per sample at batch_size=64" in act.evidence
    batch = remedy(act, "batch")
    assert batch.title == "Batch 64 → 32, accumulate 2 steps"
    assert batch.params == {
        "name": "batch_size",
        "old": 64,
        "new": 32,
        "accumulate": 2,
        "where": "source",
        "keeps_effective": True,
    }
    # The loop itself gets the accumulation: the loss divided, the optimizer stepped every 2 micro-batches.
    assert batch.automatic and batch.new_source == LOOP.replace("batch_size = 64", "batch_size = 32").replace(
        "for batch in loader:", "micro_step = 0\nfor batch in loader:"
    ).replace("    loss.backward()\n", "    (loss / 2).backward()\n    micro_step += 1\n").replace(
        "    optimizer.step()\n    optimizer.zero_grad()\n",
        "    if micro_step % 2 == 0:\n        optimizer.step()\n        optimizer.zero_grad()\n",
    )
    assert "so each step still sees 64 samples" in batch.explanation
    assert "(loss / 2).backward()" in batch.code and "if micro_step % 2 == 0:" in batch.code
    assert batch.saving == pytest.approx(22.16 * GiB / 2, rel=0.01)


def test_training_arguments_get_their_accumulation_in_the_rewrite():
    cell = "args = TrainingArguments('out', per_device_train_batch_size=16)\ntrainer.train()\n"
    ctx = training_ctx(source=cell, batch=BatchGuess("per_device_train_batch_size", 16, "source"))
    batch = remedy(finding(diagnose(plain_24(), ctx), "activations"), "batch")
    assert batch.new_source == (
        "args = TrainingArguments('out', per_device_train_batch_size=8, gradient_accumulation_steps=2)\n"
        "trainer.train()\n"
    )
    assert "accumulation setting" not in batch.explanation


def test_a_batch_held_in_the_namespace_is_rebound_not_rewritten():
    ctx = training_ctx(source="train(model, loader, BATCH)\n", batch=BatchGuess("BATCH", 48, "namespace"))
    batch = remedy(finding(diagnose(plain_24(), ctx), "activations"), "batch")
    assert batch.new_source is None and batch.automatic and batch.code.startswith("BATCH = 24")


def test_smaller_batch_follows_the_figures_when_half_is_not_enough():
    # 20 GiB short of a 44 GiB step: half the batch would still not fit.
    report = _report(requested=20 * GiB, capacity=CARD_24, free=0, allocated=24 * GiB, reserved=24 * GiB)
    batch = remedy(finding(diagnose(report, training_ctx()), "activations"), "batch")
    assert batch.params["new"] == 16 and batch.params["accumulate"] == 4


def test_a_smaller_batch_counts_the_reserve_left_unallocated_by_scattered_blocks():
    # 12 GiB requested beside 12.6 GiB held from before the cell, 23.6 GiB reserved of 24: the request
    # lacked 11.6 GiB, but 11 GiB of the reserve was free in scattered blocks, which a smaller batch's
    # smaller blocks can use.
    figures = dict(requested=12 * GiB, capacity=CARD_24, free=int(0.4 * GiB), allocated=int(12.6 * GiB))
    report = _report(**figures, reserved=int(23.6 * GiB), reserved_unallocated=11 * GiB)
    ctx = training_ctx(before_allocated=int(12.6 * GiB))
    batch = remedy(finding(diagnose(report, ctx), "activations"), "batch")
    assert (batch.params["new"], batch.params["accumulate"]) == (32, 2), batch.params
    # Read as if the reserve were all in use, the same failure leaves no room for any batch.
    packed = _report(**figures, reserved=int(23.6 * GiB), reserved_unallocated=0)
    act = finding(diagnose(packed, ctx), "activations")
    assert "batch" not in [r.kind for r in act.remedies] and "cannot fit" in act.evidence, act.evidence


def test_autocast_and_checkpointing_estimated_from_the_measurements():
    act = finding(diagnose(plain_24(), training_ctx()), "activations")
    auto = remedy(act, "autocast")
    assert auto.automatic and auto.params == {"dtype": "bfloat16"}
    assert auto.saving == int(24 * GiB * 0.16)
    ckpt = remedy(act, "checkpointing")
    assert ckpt.saving == pytest.approx(0.6 * 22.16 * GiB, rel=0.01)
    # Not a transformers model: a snippet, not a button.
    assert not ckpt.automatic and "torch.utils.checkpoint" in ckpt.code
    assert [r.saving for r in act.remedies] == sorted((r.saving for r in act.remedies), reverse=True)


def test_hf_model_checkpointing_is_a_button():
    model = gpt2(is_training=True, is_hf=True, supports_checkpointing=True)
    ckpt = remedy(
        finding(diagnose(plain_24(), training_ctx(models=(model,))), "activations"), "checkpointing"
    )
    assert ckpt.automatic and ckpt.params == {"models": ["model"]}
    assert "model.gradient_checkpointing_enable()" in ckpt.code


def test_float16_autocast_carries_the_gradscaler_note_without_bf16():
    auto = remedy(
        finding(diagnose(plain_24(), training_ctx(bf16_supported=False)), "activations"), "autocast"
    )
    assert (
        auto.params == {"dtype": "float16"} and "GradScaler" in auto.explanation and "GradScaler" in auto.code
    )


def test_activations_say_what_is_already_on():
    model = gpt2(is_training=True, is_hf=True, supports_checkpointing=True, checkpointing_on=True)
    act = finding(diagnose(plain_24(), training_ctx(models=(model,), autocast_on=True)), "activations")
    assert "Autocast is already on" in act.evidence and "already on for model" in act.evidence
    assert {r.kind for r in act.remedies} == {"batch"}


def test_batch_of_one_cannot_shrink():
    act = finding(diagnose(plain_24(), training_ctx(batch=BatchGuess("bs", 1, "source"))), "activations")
    assert "A smaller bs cannot fit: it is already 1" in act.evidence
    assert "batch" not in [r.kind for r in act.remedies]


def test_peaks_that_grow_over_a_flat_baseline_are_later_batches_needing_more():
    tl = training_loop(steps=5, activations=lambda i: 8 * GiB + i * GiB)
    act = finding(diagnose(plain_24(), training_ctx(timeline=tl)), "activations")
    assert "Each step's peak grew (14.00 GiB → 15.00 GiB → 16.00 GiB → 17.00 GiB)" in act.evidence
    assert "stayed near 4.00 GiB: later batches needed more" in act.evidence
    assert "growth" not in keys(diagnose(plain_24(), training_ctx(timeline=tl)))


def test_activations_quiet_for_a_cell_that_neither_trains_nor_batches():
    ctx = DiagnosisContext(source="x = torch.randn(8192, 8192, device='cuda') @ w\n", capacity=CARD_24)
    assert "activations" not in keys(diagnose(plain_24(), ctx))


# --- generation and long samples ------------------------------------------------------------------------

GENERATE = """\
inputs = tokenizer(prompts, return_tensors="pt", padding=True).to("cuda")
out = model.generate(**inputs, max_new_tokens=2048, num_beams=4)
"""


def generation_ctx(**kw) -> DiagnosisContext:
    base = dict(
        source=GENERATE,
        capacity=CARD_24,
        before_allocated=14 * GiB,
        models=(ModelInfo("model", 14 * GiB, "bfloat16", is_hf=True),),
        generation=True,
        max_new_tokens=2048,
        num_beams=4,
    )
    return DiagnosisContext(**{**base, **kw})


def test_generation_lowers_tokens_and_beams_and_truncates_prompts():
    gen = finding(diagnose(plain_24(), generation_ctx()), "generation")
    assert "max_new_tokens=2048" in gen.evidence and "num_beams=4" in gen.evidence
    assert "about 10.00 GiB that does" in gen.evidence
    beams = remedy(gen, "num_beams")
    assert beams.saving == int(10 * GiB * 3 / 4) and beams.automatic
    assert beams.new_source == GENERATE.replace("num_beams=4", "num_beams=1")
    tokens = remedy(gen, "max_new_tokens")
    assert tokens.title == "max_new_tokens 2048 → 1024" and "max_new_tokens=1024" in tokens.new_source
    cut = remedy(gen, "truncate")
    assert "padding=True, truncation=True, max_length=512)" in cut.new_source
    assert "activations" not in keys(diagnose(plain_24(), generation_ctx()))


def test_generation_with_short_prompts_offers_no_truncation_and_counts_them_in_the_cache():
    gen = finding(diagnose(plain_24(), generation_ctx(prompt_tokens=32)), "generation")
    assert "truncate" not in [r.kind for r in gen.remedies]
    assert "The prompts are 32 tokens long: truncating them to 512 would change nothing." in gen.evidence
    # The cache holds 32 + 2048 tokens per sequence; halving max_new_tokens drops 1024 of them.
    assert remedy(gen, "max_new_tokens").saving == 10 * GiB * 1024 // (32 + 2048)


def test_generation_with_long_prompts_estimates_what_truncation_saves():
    gen = finding(diagnose(plain_24(), generation_ctx(prompt_tokens=2048)), "generation")
    cut = remedy(gen, "truncate")
    assert cut.saving == 10 * GiB * (2048 - 512) // (2048 + 2048)
    assert "The prompts are 2048 tokens long." in gen.evidence


def test_generation_without_max_new_tokens_says_the_figures_cannot_tell():
    cell = "out = model.generate(**inputs)\n"
    gen = finding(
        diagnose(plain_24(), generation_ctx(source=cell, max_new_tokens=None, num_beams=None)), "generation"
    )
    tokens = remedy(gen, "max_new_tokens")
    assert tokens.saving is None and "can't say" in tokens.explanation
    assert tokens.new_source == "out = model.generate(**inputs, max_new_tokens=256)\n"


def test_generation_quiet_when_the_cell_does_not_generate():
    assert "generation" not in keys(diagnose(plain_24(), training_ctx()))


def steady_then_spike() -> Timeline:
    # Five steps at ~12 GiB, then a batch that needs 20 GiB.
    t, alloc = [], []
    for step in range(6):
        t += [step + 0.3, step + 0.6]
        alloc += [8 * GiB, 12 * GiB + step * MiB]
    return Timeline(
        t=tuple(t), allocated=tuple(alloc), reserved=tuple(a + GiB for a in alloc), steps=(1, 2, 3, 4, 5)
    )


def test_one_unusually_long_batch_suggests_truncation():
    source = "enc = tokenizer(batch_texts, padding=True)\nloss = model(**enc).loss\nloss.backward()\n"
    report = plain_24(requested=8 * GiB, allocated=12 * GiB)
    ctx = training_ctx(source=source, timeline=steady_then_spike(), batch=None)
    long = finding(diagnose(report, ctx), "long_samples")
    assert "The failing step needed 20.00 GiB, 1.7× the median" in long.evidence
    assert "12.00 GiB" in long.evidence
    cut = remedy(long, "truncate")
    assert cut.new_source.startswith(
        "enc = tokenizer(batch_texts, padding=True, truncation=True, max_length=512)"
    )


def test_long_samples_quiet_with_truncation_or_steady_steps():
    report = plain_24(requested=8 * GiB, allocated=12 * GiB)
    assert "long_samples" not in keys(
        diagnose(report, training_ctx(timeline=steady_then_spike(), has_truncation=True))
    )
    steady = plain_24(requested=GiB // 2, allocated=12 * GiB)
    assert "long_samples" not in keys(diagnose(steady, training_ctx(timeline=steady_then_spike())))


# --- memory that grows every step ----------------------------------------------------------------------

LEAKY_LOOP = """\
losses = []
for batch in loader:
    out = model(**batch)
    loss = out.loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    losses.append(loss)
    preds.append(out.logits)
    seen.append(len(batch))
"""


def training_loop(steps: int, kept=lambda i: 0, activations=lambda i: 12 * GiB) -> Timeline:
    """A loop whose last step runs out: weights (2 GiB), Adam's moments from step 1 on (2 GiB), step
    ``i``'s activations, gradients (1 GiB) until zero_grad, and ``kept(i)`` bytes that step ``i`` keeps for
    good. After the error the failed cell's memory is given back."""
    t, alloc, marks, held = [], [], [], 0
    for i in range(steps + 1):
        floor = (4 * GiB if i else 2 * GiB) + held
        t += [i + 0.1, i + 0.5]
        alloc += [floor, floor + activations(i)]
        if i < steps:
            held += kept(i)
            t.append(i + 0.8)
            alloc.append(floor + kept(i) + GiB)
            marks.append(i + 0.9)
    t.append(steps + 0.7)
    alloc.append(GiB // 2)
    return Timeline(
        t=tuple(t),
        allocated=tuple(alloc),
        reserved=tuple(a + GiB for a in alloc),
        steps=tuple(marks),
        oom_at=steps + 0.5,
    )


def leak() -> Timeline:
    """Each step keeps 512 MiB; after 24 steps the 6 GiB of activations no longer fit in 24 GiB."""
    return training_loop(steps=24, kept=lambda i: 512 * MiB, activations=lambda i: 6 * GiB)


def test_memory_kept_every_step_is_a_leak_not_a_long_batch():
    found = diagnose(plain_24(), training_ctx(source=LEAKY_LOOP, timeline=leak()))
    growth = finding(found, "growth")
    assert growth.title == "Memory grows every step"
    assert (
        "Allocated after each optimizer step rose 512.00 MiB per step over the last 23 steps: "
        "11.50 GiB kept across steps" in growth.evidence
    )
    assert "allocated, not cached: `torch.cuda.empty_cache()` gives none of it back" in growth.evidence
    assert growth.saving == 23 * 512 * MiB
    # The failing step needs 1.5x the median completed step, only because the baseline under it rose.
    assert "long_samples" not in keys(found)
    assert found[0].key == "growth"


def test_memory_kept_every_step_comes_with_a_button_that_rewrites_the_keeping_lines():
    growth = finding(diagnose(plain_24(), training_ctx(source=LEAKY_LOOP, timeline=leak())), "growth")
    keep = remedy(growth, "keep_numbers")
    assert keep.automatic
    assert keep.new_source == LEAKY_LOOP.replace("losses.append(loss)", "losses.append(loss.item())").replace(
        "preds.append(out.logits)", "preds.append(out.logits.detach().cpu())"
    )
    assert keep.title == "Keep `loss.item()`, `out.logits.detach().cpu()` across iterations"
    assert keep.saving == 23 * 512 * MiB
    assert "covers the 1.50 GiB the failed request lacked" in keep.explanation
    assert "line 8, `losses.append(loss)`" in keep.explanation
    assert keep.code == (
        "# line 8, was: losses.append(loss)\nlosses.append(loss.item())\n"
        "# line 9, was: preds.append(out.logits)\npreds.append(out.logits.detach().cpu())"
    )
    assert "torch.no_grad()" in remedy(growth, "no_grad").code


def test_the_rewritten_line_keeps_the_rest_of_the_line_as_written():
    cell = "for b in loader:\n    größe.append(model(b).logits)  # Größe\n    total_loss += out.loss\n"
    keep = remedy(
        finding(diagnose(plain_24(), training_ctx(source=cell, timeline=leak())), "growth"), "keep_numbers"
    )
    assert "größe.append(model(b).logits.detach().cpu())  # Größe" in keep.code
    assert "total_loss += out.loss.item()" in keep.code


def test_a_loop_outside_the_cell_gets_the_generic_snippet():
    ctx = training_ctx(source="trainer.train()\n", timeline=leak())
    keep = remedy(finding(diagnose(plain_24(), ctx), "growth"), "keep_numbers")
    assert "losses.append(loss.item())" in keep.code and ".detach().cpu()" in keep.code


def test_activations_point_at_the_memory_kept_across_steps():
    act = finding(diagnose(plain_24(), training_ctx(timeline=leak())), "activations")
    assert "Of that, 11.50 GiB is memory kept across steps, not the batch's activations" in act.evidence
    assert "“Memory grows every step”" in act.evidence and "loss.item()" not in act.evidence


def test_one_big_step_over_a_flat_baseline_is_a_long_batch_not_growth():
    tl = training_loop(steps=6, activations=lambda i: 20 * GiB if i == 6 else 12 * GiB)
    found = diagnose(plain_24(), training_ctx(timeline=tl))
    assert "growth" not in keys(found)
    assert "The failing step needed 24.00 GiB, 1.5× the median" in finding(found, "long_samples").evidence


def test_an_uneven_rise_of_what_stays_is_not_a_long_batch_either():
    # Odd steps keep 2 GiB, even ones 128 MiB: no steady leak, but no long batch either.
    tl = training_loop(steps=8, kept=lambda i: 128 * MiB if i % 2 else 2 * GiB, activations=lambda i: 6 * GiB)
    found = diagnose(plain_24(), training_ctx(timeline=tl))
    assert "growth" not in keys(found) and "long_samples" not in keys(found)
    assert "and so, unevenly, did the memory kept between steps" in finding(found, "activations").evidence


def test_growth_quiet_without_optimizer_steps():
    tl = leak()
    flat = Timeline(t=tl.t, allocated=tl.allocated, reserved=tl.reserved, oom_at=tl.oom_at)
    assert "growth" not in keys(diagnose(plain_24(), training_ctx(timeline=flat)))


def test_growth_quiet_when_too_few_steps_or_too_little_to_matter():
    three = training_loop(steps=3, kept=lambda i: GiB)  # two rises: not yet a trend
    assert "growth" not in keys(diagnose(plain_24(), training_ctx(timeline=three)))
    slow = training_loop(steps=16, kept=lambda i: 8 * MiB)  # 120 MiB: not why 1.50 GiB were missing
    assert "growth" not in keys(diagnose(plain_24(), training_ctx(timeline=slow)))


def test_growth_counts_only_the_steady_rise_up_to_the_failing_step():
    # Step 3 keeps a one-off 2 GiB buffer; from then on each step keeps 512 MiB.
    kept = [0, 0, 2 * GiB] + [512 * MiB] * 8
    floors = [4 * GiB + sum(kept[: i + 1]) for i in range(len(kept))]
    t = tuple(x for i in range(len(kept)) for x in (i + 1.1, i + 1.5))
    alloc = tuple(x for f in floors for x in (f, f + 8 * GiB))
    tl = Timeline(t=t, allocated=alloc, reserved=alloc, steps=tuple(i + 1.0 for i in range(len(kept))))
    growth = finding(diagnose(plain_24(), training_ctx(timeline=tl)), "growth")
    assert "rose 512.00 MiB per step over the last 8 steps: 4.00 GiB kept" in growth.evidence
    uneven = Timeline(t=t, allocated=alloc, reserved=alloc, steps=tl.steps[:5])
    assert "growth" not in keys(diagnose(plain_24(), training_ctx(timeline=uneven)))


# --- reserved churn, async errors, limits ---------------------------------------------------------------


def churning() -> Timeline:
    return Timeline(
        t=(0.1, 0.2, 0.3, 0.4),
        allocated=(2 * GiB, 8 * GiB, 3 * GiB, 6 * GiB),
        reserved=(4 * GiB, 20 * GiB, 20 * GiB, 20 * GiB),
    )


def test_reserved_far_above_allocated_offers_empty_cache_every_step():
    churn = finding(
        diagnose(plain_24(), DiagnosisContext(capacity=CARD_24, timeline=churning())), "reserved_churn"
    )
    assert "peaked at 20.00 GiB while allocated peaked at 8.00 GiB: 12.00 GiB" in churn.evidence
    assert "but only 1.00 GiB at the error" in churn.evidence
    empty = remedy(churn, "empty_cache")
    assert empty.automatic and "register_optimizer_step_post_hook" in empty.code
    assert "rarely keeps this process from running out" in empty.explanation


def test_reserved_churn_quiet_when_fragmentation_explains_it():
    found = diagnose(fragmented_24(), DiagnosisContext(capacity=CARD_24, timeline=churning()))
    assert "reserved_churn" not in keys(found)


def test_reserved_churn_quiet_when_reserved_follows_allocated():
    tl = Timeline(t=(0.1, 0.2), allocated=(8 * GiB, 10 * GiB), reserved=(9 * GiB, 11 * GiB))
    assert "reserved_churn" not in keys(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24, timeline=tl)))


def test_driver_out_of_memory_comes_first_with_launch_blocking():
    report = OOMReport(text="CUDA error: out of memory", device="cuda", source="driver")
    found = diagnose(report, training_ctx())
    assert found[0].key == "async_error"
    blocking = found[0].remedies[0]
    assert blocking.kind == "launch_blocking" and "CUDA_LAUNCH_BLOCKING=1" in blocking.code
    assert "async_error" not in keys(diagnose(plain_24(), training_ctx()))


def test_the_limit_ran_out_not_the_card():
    report = _report(
        requested=2 * GiB,
        capacity=H200,
        free=130 * GiB,
        allocated=22 * GiB,
        reserved=23 * GiB,
        limit=CARD_24,
        emulated=True,
    )
    found = diagnose(report, DiagnosisContext(capacity=H200, limit=CARD_24))
    lim = finding(found, "limit")
    assert (
        "The 24.00 GiB limit ran out, not the card: the card has 139.80 GiB, 115.80 GiB beyond"
        in lim.evidence
    )
    assert "--limit" in lim.evidence
    assert figures(report, DiagnosisContext(capacity=H200, limit=CARD_24)).shortfall == 1 * GiB


def test_limit_quiet_on_the_whole_card():
    assert "limit" not in keys(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24)))


# --- ranking and records --------------------------------------------------------------------------------


def test_findings_ranked_by_how_much_of_the_shortfall_they_cover():
    ctx = training_ctx(
        before_allocated=int(0.66 * GiB),
        leftovers=(Leftover("probe", "tensor", 200 * MiB),),
        timeline=churning(),
    )
    found = diagnose(fragmented_24(), ctx)
    assert keys(found)[:2] == ["fragmentation", "activations"]
    assert keys(found).index("leftovers") > keys(found).index("activations")
    assert [f.score for f in found] == sorted((f.score for f in found), reverse=True)


def test_a_finding_that_covers_the_shortfall_outranks_one_that_does_not():
    ctx = DiagnosisContext(
        capacity=CARD_24,
        before_allocated=3 * GiB,
        leftovers=(Leftover("cache", "tensor", 3 * GiB),),
        processes=((99, "python", GiB // 4),),
    )
    found = diagnose(plain_24(), ctx)
    assert keys(found) == ["leftovers", "other_processes"]
    assert found[0].score > found[1].score


def test_no_report_means_only_rules_that_need_none():
    found = diagnose(None, training_ctx())
    assert "fragmentation" not in keys(found)
    act = finding(found, "activations")
    assert "don't say" in act.evidence


def test_findings_round_trip_through_json():
    found = diagnose(fragmented_24(), training_ctx(timeline=churning()))
    assert found
    for f in found:
        data = json.loads(json.dumps(f.to_json()))
        assert Finding.from_json(data) == f


# --- one request larger than the budget ------------------------------------------------------------------

EVAL_LOGITS = """\
loader = DataLoader(ds, batch_size=64)
with torch.no_grad():
    for batch in loader:
        logits = model(**batch).logits
"""


def test_one_request_names_its_line_the_logits_and_shrinks_the_evaluation_batch():
    from oommagic.diagnosis.findings import Frame
    from oommagic.diagnosis.source import EvalBatch

    ctx = DiagnosisContext(
        capacity=CARD_24,
        source=EVAL_LOGITS,
        evaluating=True,
        eval_batch=EvalBatch("batch_size", 64, "loader"),
        batch=BatchGuess("batch_size", 8),
        frames=(
            Frame("<module>", 4, True),
            Frame("_wrapped_call_impl", 1, False),
            Frame("forward", 9, False),
        ),
    )
    big = finding(diagnose(plain_24(requested=30 * GiB, allocated=GiB), ctx), "too_large")
    assert (
        "One request of 30.00 GiB is larger than the whole 24.00 GiB card (line 4 of the cell, in forward())"
        in (big.evidence)
    )
    assert "batch × sequence × vocabulary" in big.evidence and "logits_to_keep=1" in big.evidence
    shrink = remedy(big, "eval_batch")
    assert shrink.new_source == EVAL_LOGITS.replace("batch_size=64", "batch_size=32")
    assert "batch" not in [r.kind for r in big.remedies]


def test_one_request_in_training_without_logits_offers_the_training_batch():
    ctx = DiagnosisContext(capacity=CARD_24, source=LOOP, trains=True, batch=BatchGuess("batch_size", 64))
    big = finding(diagnose(plain_24(requested=30 * GiB, allocated=GiB), ctx), "too_large")
    assert "shrink what makes it (batch, sequence length)" in big.evidence
    assert remedy(big, "batch").params["new"] < 64


def test_evaluation_by_hf_trainer_changes_per_device_eval_batch_size():
    from oommagic.diagnosis.findings import Frame
    from oommagic.diagnosis.source import eval_batch

    cell = (
        "args = TrainingArguments('out', per_device_train_batch_size=16, per_device_eval_batch_size=64)\n"
        "trainer = Trainer(model=model, args=args, eval_dataset=ds)\n"
        "trainer.evaluate()\n"
    )
    found = eval_batch(cell)
    ctx = DiagnosisContext(
        capacity=CARD_24,
        source=cell,
        trains=True,
        evaluating=True,
        eval_batch=found,
        batch=BatchGuess("per_device_train_batch_size", 16),
        frames=(Frame("<module>", 3, True), Frame("evaluate", 1), Frame("evaluation_loop", 2)),
        timeline=Timeline(t=(0.0, 1.0), allocated=(GiB, 20 * GiB), reserved=(GiB, 21 * GiB)),
    )
    act = finding(diagnose(plain_24(), ctx), "activations")
    kinds = [r.kind for r in act.remedies]
    assert "batch" not in kinds
    fix = remedy(act, "eval_batch")
    assert fix.new_source == cell.replace("per_device_eval_batch_size=64", "per_device_eval_batch_size=32")
    assert "eval_accumulation_steps" in fix.explanation


def test_pinned_memory_is_a_finding_only_when_it_matters():
    from oommagic.diagnosis.findings import Pin

    held = (
        Pin(
            "sys.last_value", "sys.last_value (OutOfMemoryError) → traceback → train() → local 'x'", 20 * GiB
        ),
    )
    found = finding(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24, pins=held)), "pinned")
    assert (
        "20.00 GiB by sys.last_value (OutOfMemoryError) → traceback → train() → local 'x'" in found.evidence
    )
    assert "before `%%gpumem` was in use" in found.evidence
    assert remedy(found, "free_pinned").automatic
    small = (Pin("_", "_ (IPython's last outputs)", MiB),)
    assert "pinned" not in keys(diagnose(plain_24(), DiagnosisContext(capacity=CARD_24, pins=small)))


def test_predictions_gathered_by_a_trainers_evaluation_are_moved_to_the_host_every_few_batches():
    from oommagic.diagnosis.findings import Gathered

    # predict() over 192 rows at 16 a batch, out of memory with 12 batches of float32 logits gathered.
    per_batch = 16 * 1024 * 32000 * 4
    gathered = Gathered(
        "predict", 12 * per_batch, 12, 192, 12, 192, (192, 1024, 32000), 4, trainer="scorer", args="eval_args"
    )
    cell = "scores = scorer.predict(test_ds)\n"
    ctx = DiagnosisContext(source=cell, evaluating=True, gathered=gathered)
    found = finding(diagnose(plain_24(requested=per_batch, allocated=22 * GiB), ctx), "gathered")
    assert "`scorer.predict()` keeps every batch's predictions" in found.evidence
    assert "192 × 1,024 × 32,000 × 4 bytes" in found.evidence
    fix = remedy(found, "eval_accumulation")
    # A quarter of the batches it held: joining the next one to them briefly takes twice their bytes.
    assert fix.params == {"steps": 3, "target": "scorer.args"}
    assert fix.new_source.startswith("scorer.args.eval_accumulation_steps = 3")
    assert fix.saving == 9 * per_batch
    # Already moved after every batch: nothing left to offer.
    again = DiagnosisContext(source=cell, evaluating=True, gathered=replace(gathered, accumulation=1))
    assert "gathered" not in keys(diagnose(plain_24(), again))
