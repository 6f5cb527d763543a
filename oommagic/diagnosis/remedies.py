"""Remedies: what a fix is called, why it helps, the snippet to copy, and the rewrite a retry can run.

Pure: builds ``Remedy`` records from the figures and the cell context that ``diagnose`` worked out; it
decides nothing about *whether* a remedy applies (that is ``diagnose``'s job), only what it looks like and
what it is expected to save. ``retry`` turns an automatic remedy into a rerun.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from ..sizes import format_bytes as fmt
from .findings import BatchCall, DiagnosisContext, EvalLoader, Figures, Gathered, Remedy, RowsCall
from .rewrite import (
    accumulate_loops,
    accumulates,
    changed_lines,
    checkpoint_calls_source,
    default_dtype_source,
    eval_accumulation_source,
    factored_optimizer_source,
    fresh_name,
    fresh_words,
    insert_after_assignment,
    keep_last_logits_source,
    kept_source,
    load_source,
    no_grad_source,
    pass_hook_loader,
    quantized_cache_source,
    rebuild_loader,
    rewrite_batch,
    scale_accumulation,
    set_call_keyword,
    set_literal,
    skip_long_source,
    split_rows_source,
    truncate_source,
)
from .rewrite_generation import set_generation_setting, split_calls_source, split_generate_source
from .source import (
    BatchGuess,
    EvalBatch,
    arguments_calls,
    assigned_names,
    called_names,
    calls_only,
    calls_with_keyword,
    checkpoints,
    eval_batch_literal,
    inlined_product,
    kept_sites,
    last_logits_calls,
    loop_batches,
    names_read,
    tokenizer_calls,
    tree_of,
)
from .source.command import command_source

MIB = 1024**2
# Measured on GPT-2 124M on an H200 (DESIGN.md): bf16 autocast cut the peak 16%, three times faster;
# gradient checkpointing cut activations ~60% at +25% step time.
AUTOCAST_SAVING = 0.16
CHECKPOINTING_SAVING = 0.60
# The batch line under-predicts by up to 14% with checkpointing (DESIGN.md): aim 10% under the budget.
MARGIN = 0.10
# Bytes per parameter by dtype (float32 otherwise); 4-bit loading stores ~half a byte per weight.
ELEMENT_SIZE = {"float64": 8, "double": 8, "float16": 2, "half": 2, "bfloat16": 2, "int8": 1, "uint8": 1}


def _made(fig: Figures, kind: str, title: str, explanation: str, saving: int | None, **kw: Any) -> Remedy:
    # Every explanation ends by saying whether the saving covers what was missing.
    return Remedy(kind, title, explanation + fig.verdict(saving), saving=saving, **kw)


def _fp32(dtype: str) -> bool:
    return dtype in ("float32", "float")


# --- the allocator -------------------------------------------------------------------------------------


def expandable_segments(fig: Figures, unused: int) -> Remedy:
    return _made(
        fig,
        "expandable_segments",
        "Expandable segments",
        "New memory is mapped into segments that grow in place, so freed pieces join up instead of staying "
        "too small. Switched on live for the retry; the snippet keeps it.",
        unused,
        code='import torch\ntorch.cuda.memory._set_allocator_settings("expandable_segments:True")\n'
        "# or for good, before Python starts: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
        automatic=True,
        params={"setting": "expandable_segments:True"},
    )


def max_split_size(fig: Figures, requested: int | None, unused: int) -> Remedy:
    # Blocks above the threshold stay whole for requests of their size; 128–1024 MiB is the useful range.
    mb = 128
    while requested and mb * 2 <= min(requested // MIB, 1024):
        mb *= 2
    mb = mb if requested else 512
    return _made(
        fig,
        "max_split_size",
        f"max_split_size_mb:{mb} (restart)",
        f"Blocks over {mb} MiB are not carved up for small tensors, so large requests find them whole. "
        "Takes effect only when set before CUDA starts: restart the kernel.",
        unused,
        code=f'import os\nos.environ["PYTORCH_CUDA_ALLOC_CONF"] = "max_split_size_mb:{mb}"\n'
        "# after a kernel restart, before the first `import torch`",
    )


def empty_cache_every_step(fig: Figures, gap: int) -> Remedy:
    return Remedy(
        "empty_cache",
        "Empty the cache after every optimizer step",
        "Gives cached blocks back to the driver each step, for other processes and for requests that need "
        "one contiguous block, at the cost of slower steps. The allocator already empties its cache before "
        "it gives up, so on its own this rarely keeps this process from running out.",
        code="import torch\nfrom torch.optim.optimizer import register_optimizer_step_post_hook\n"
        "register_optimizer_step_post_hook(lambda *args: torch.cuda.empty_cache())",
        automatic=True,
        saving=gap,
        params={"every": "optimizer_step"},
    )


LAUNCH_BLOCKING = Remedy(
    "launch_blocking",
    "Find the real line: CUDA_LAUNCH_BLOCKING=1",
    "Makes every kernel launch wait for its result, so the error is raised on the line that ran out. It "
    "must be set before CUDA starts (restart the kernel, run it first) and slows everything: debugging only.",
    code="%env CUDA_LAUNCH_BLOCKING=1\n# first cell after a kernel restart, then run up to the failing cell",
)


# --- what the process holds ----------------------------------------------------------------------------


def free_leftovers(fig: Figures, names: list[str], freeable: int, device: str) -> Remedy:
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    code = [f"del {', '.join(names)}", "import gc", "gc.collect()"]
    if device.startswith("cuda"):
        code += ["import torch", "torch.cuda.empty_cache()"]
    return _made(
        fig,
        "free_leftovers",
        f"Free {shown} ({fmt(freeable)})",
        "These variables hold device memory and this cell does not read them (it rebuilds them or never "
        "uses them). Deleting them, then gc and empty_cache, gives it back; check nothing later needs them.",
        freeable,
        code="\n".join(code),
        automatic=True,
        params={"names": names},
    )


def other_gpu(ctx: DiagnosisContext, fig: Figures) -> Remedy | None:
    """Move to the GPU with the most free memory, if it has room for the whole demand plus the margin."""
    if not ctx.other_gpus or fig.demand is None:
        return None
    idx, free = max(ctx.other_gpus, key=lambda g: g[1])
    if free < fig.demand * (1 + MARGIN):
        return None
    available = fig.available
    return _made(
        fig,
        "other_gpu",
        f"Run on GPU {idx} ({fmt(free)} free)",
        f"GPU {idx} has {fmt(free)} free, more than the {fmt(fig.demand)} this cell needs.",
        free - available if available is not None else None,
        code=f"%env CUDA_VISIBLE_DEVICES={idx}\n"
        "# first cell after a kernel restart; or, without a restart, move the work there:\n"
        f"import torch\ntorch.cuda.set_device({idx})\nmodel.to('cuda:{idx}')",
        params={"index": idx},
    )


def stop_process(fig: Figures, pid: int, held: int, user: str | None, command: str | None) -> Remedy:
    """Stopping another process that holds memory on the card. Not run by the kernel: the sidebar calls
    the server's ``oommagic/kernels/shutdown`` route with ``pid`` after the person confirms, and that
    route stops only kernels of its own server."""
    who = command or f"PID {pid}"
    return _made(
        fig,
        "shutdown_kernel",
        f"Shut down PID {pid} ({fmt(held)})",
        f"PID {pid} ({who}{', user ' + user if user else ''}) holds {fmt(held)} of this card. If it is a "
        "kernel of this Jupyter server the sidebar shuts it down after asking, naming its notebook; "
        "otherwise its owner can stop it.",
        held,
        code=f"# a kernel of this server: the sidebar's 'Shut down the kernel of …' (asks first)\n"
        f"# any other process, by its owner:\nkill {pid}",
        params={"pid": pid, "bytes": held, "user": user, "command": command},
    )


# --- the model -----------------------------------------------------------------------------------------

_LOAD_4BIT = """import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig
quant = BitsAndBytesConfig(
    load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16
)
model = AutoModelForCausalLM.from_pretrained(MODEL_ID, quantization_config=quant, device_map={"": 0})"""

_QLORA = (
    _LOAD_4BIT
    + """
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
model = prepare_model_for_kbit_training(model)
lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")
model = get_peft_model(model, lora)"""
)

_FSDP = """# train.py, run with: torchrun --nproc_per_node=NUM_GPUS train.py
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl")
torch.cuda.set_device(dist.get_rank())
for block in model.model.layers:  # each transformer block
    fully_shard(block)
fully_shard(model)"""


def smaller_model(ctx: DiagnosisContext, fig: Figures, state: int) -> list[Remedy | None]:
    """bf16 weights, 4-bit loading (QLoRA when training), offload, several GPUs, another GPU."""
    hf = any(m.is_hf for m in ctx.models)
    name = max(ctx.models, key=lambda m: m.param_bytes).name if ctx.models else "model"
    out: list[Remedy | None] = []
    fp32 = sum(m.param_bytes for m in ctx.models if _fp32(m.dtype))
    fp32_state = sum(m.state_bytes for m in ctx.models if _fp32(m.dtype))
    if fp32:
        why = "bfloat16 takes half the bytes of float32"
        if fig.training:
            why += (
                " for weights, gradients and Adam moments. Pure bf16 training loses small updates; "
                "mixed precision (autocast) keeps float32 weights."
            )
        code = "model = AutoModelForCausalLM.from_pretrained(MODEL_ID, torch_dtype=torch.bfloat16)"
        code = code if hf else f"{name} = {name}.to(torch.bfloat16)"
        out.append(_made(fig, "quantize", "bfloat16 weights", why + ".", fp32_state // 2, code=code))
    if ctx.models:
        four_bit = sum(m.param_bytes // (2 * ELEMENT_SIZE.get(m.dtype, 4)) for m in ctx.models)
        if fig.training:
            title, code = "QLoRA: 4-bit weights, train small adapters", _QLORA
            why = "The frozen weights load in 4 bits; only the LoRA adapters get gradients and Adam moments."
        else:
            title, code = "Load the weights in 4-bit (or 8-bit)", _LOAD_4BIT
            why = "bitsandbytes stores each weight in about half a byte (8-bit: one byte)."
        out.append(_made(fig, "quantize", title, why, max(state - four_bit, 0), code=code))
    if hf and not fig.training and fig.budget:
        gib = max(int(fig.budget * (1 - MARGIN)) // 1024**3, 1)
        out.append(
            _made(
                fig,
                "offload",
                "Offload layers to CPU memory (device_map='auto')",
                "Accelerate keeps the layers that don't fit in CPU memory and moves each in when it runs: "
                "it fits, but runs much slower.",
                max(state - fig.budget, 0) or None,
                code="model = AutoModelForCausalLM.from_pretrained(\n"
                f'    MODEL_ID, device_map="auto", max_memory={{0: "{gib}GiB", "cpu": "64GiB"}}\n)',
            )
        )
    if ctx.other_gpus and state:
        n = 1 + len(ctx.other_gpus)
        spread = 'model = AutoModelForCausalLM.from_pretrained(MODEL_ID, device_map="auto")'
        out.append(
            _made(
                fig,
                "multi_gpu",
                f"Shard across the {n} GPUs",
                "FSDP splits weights, gradients and optimizer state across GPUs (a script run by torchrun, "
                "not a notebook cell)."
                if fig.training
                else "device_map='auto' spreads the layers over every visible GPU.",
                state * (n - 1) // n,
                code=_FSDP if fig.training else spread,
            )
        )
    out.append(other_gpu(ctx, fig))
    return out


# --- the batch and its activations ---------------------------------------------------------------------


def batch(ctx: DiagnosisContext, fig: Figures, guess: BatchGuess, new: int, acc: int) -> Remedy:
    """``guess.value`` → ``new`` with ``acc`` accumulation steps. The effective batch is kept where the
    accumulation can be written: a setting of the cell (TrainingArguments, Lightning's Trainer, a literal
    accumulation variable) or the micro-batch loop itself, in the cell or in the notebook function it
    calls (whose new version is put at the top of the cell). Otherwise the title says the effective batch
    changes."""
    if guess.where == "rows":
        # Micro-batches as even as the rows allow: the largest is what the memory sees.
        new = -(-guess.value // -(-guess.value // max(1, new)))
    saving = fig.activations * (guess.value - new) // guess.value if fig.activations else None
    new_source, keeps = batch_source(ctx.source, ctx.helpers, guess, new, acc, _taken(ctx))
    if guess.where == "rows":
        return _micro_batches(ctx, fig, guess, new, new_source, saving)
    if acc > 1 and keeps:
        title = f"Batch {guess.value} → {new}, accumulate {acc} steps"
        effective = new * acc
        if effective != guess.value:
            title += f" (effective batch {effective}, was {guess.value})"
    else:
        title = f"Batch {guess.value} → {new}"
        # Only an optimizer step has an effective batch: an evaluation's results do not depend on it.
        trains = fig.training or ctx.trains
        if new < guess.value and trains:
            title += f" (effective batch {new}, was {guess.value})"
    why = f"The per-batch memory scales with {guess.name}."
    if acc > 1 and keeps:
        why += (
            f" Gradients accumulate over {acc} micro-batches of {new} before each optimizer step, so each "
            f"step still sees {new * acc} samples (the loss is divided by {acc})."
        )
    elif new < guess.value and (fig.training or ctx.trains):
        why += (
            " The accumulation could not be written into this cell, so each optimizer step sees fewer "
            "samples; the snippet shows the loop with accumulation."
        )
    if new_source is not None and new_source != ctx.source:
        code = changed_lines(ctx.source, new_source)
    else:
        new_source = None
        code = f"{guess.name} = {new}"
        if guess.where == "loader":
            loader = guess.path[0]
            code = (
                f"{loader} = DataLoader({loader}.dataset, batch_size={new}, ...)  # as it was made, smaller"
            )
        if guess.accumulation is not None and acc > 1:
            code += f"\n{guess.accumulation[0]} = {guess.accumulation[1] * acc}"
    if new < guess.value and not (acc > 1 and keeps) and (fig.training or ctx.trains):
        code += "\n" + _accumulation_loop(max(acc, 2), "Accelerator" in ctx.source)
    return _made(
        fig,
        "batch",
        title,
        why,
        saving,
        code=code,
        automatic=new_source is not None or guess.where in ("namespace", "option", "attribute", "loader"),
        params={
            "name": guess.name,
            "old": guess.value,
            "new": new,
            "accumulate": acc if keeps else 1,
            "where": guess.where,
            **({"path": list(guess.path)} if guess.path else {}),
            "keeps_effective": bool(keeps) or new >= guess.value or not (fig.training or ctx.trains),
            **(
                {"accumulation": [guess.accumulation[0], guess.accumulation[1], guess.accumulation[1] * acc]}
                if guess.accumulation is not None and acc > 1 and keeps
                else {}
            ),
            **(
                {"mirrors": [[path, old, old * new // guess.value] for path, old in guess.mirrors]}
                if guess.mirrors
                else {}
            ),
        },
        new_source=new_source,
    )


def _micro_batches(
    ctx: DiagnosisContext,
    fig: Figures,
    guess: BatchGuess,
    new: int,
    new_source: str | None,
    saving: int | None,
) -> Remedy:
    """A training step on whole tensors (``guess.path``, ``guess.value`` rows) run on micro-batches of at
    most ``new`` rows: the step and its effective batch stay, only what one forward pass holds shrinks."""
    parts = -(-guess.value // new)
    inputs = ", ".join(guess.path)
    title = f"Each step on {parts} micro-batches of {new} rows ({inputs})"
    why = (
        f"The step reads all {guess.value} rows of {inputs} at once, and its activations scale with them. "
        f"Run on {parts} micro-batches, the backward passes add up the same gradients before the optimizer's "
        "one step (each micro-batch's loss weighted by its share of the rows), and only one micro-batch's "
        "activations are held at a time. After the loop, what the step computed (the loss, the outputs) is "
        "the last micro-batch's; batch norm layers, where the model has them, normalize over each "
        "micro-batch."
    )
    code = changed_lines(ctx.source, new_source) if new_source else ""
    return _made(
        fig,
        "batch",
        title,
        why,
        saving,
        code=code,
        automatic=new_source is not None,
        params={
            "name": guess.name,
            "old": guess.value,
            "new": new,
            "accumulate": parts,
            "where": "rows",
            "path": list(guess.path),
            "keeps_effective": True,
        },
        new_source=new_source,
    )


# Where a batch lives in the cell's own text (or a call of it): a rewrite writes the new number there.
WRITTEN = ("source", "expression", "step", "shape", "call", "rows")


def batch_source(
    source: str,
    helpers: tuple[tuple[str, str], ...],
    guess: BatchGuess,
    new: int,
    acc: int,
    taken: Iterable[str] = frozenset(),
) -> tuple[str | None, bool]:
    """(the cell with the batch set to ``new`` and ``acc``-step accumulation written, whether the
    accumulation was written). The cell's own setting or loop first, then the notebook functions that
    train, redefined at the top of the cell. The names the rewrite adds are fresh against the cell, those
    functions and ``taken`` (the namespace's names)."""
    if guess.where == "attribute":
        # A setting of an object: the retry sets it (and its accumulation beside it), the source stays.
        return None, guess.accumulation is not None or acc <= 1
    if guess.where in ("object", "loader"):
        return _set_first(source, helpers, guess, new, acc, taken)
    if guess.where == "command":
        # A script's option on the cell's launch line: the line passes the new values, the script stays.
        return command_source(source, guess, new, acc)
    written = guess.where in WRITTEN
    taken = {*taken, *(word for _, code in helpers for word in fresh_words(code))}
    rewritten = rewrite_batch(source, guess, new, acc, taken) if written else source
    for _, code in helpers if rewritten is None and guess.where == "rows" else ():
        # The full-batch step is in a notebook function the cell calls: redefined at the top of the cell.
        both = rewrite_batch(f"{code.rstrip()}\n\n{source}", guess, new, acc, taken)
        if both is not None:
            return f"# each step on micro-batches of the rows, written by %%gpumem\n{both}", True
    if rewritten is None:
        return None, False
    if acc <= 1 or guess.where == "rows":
        return rewritten, True
    return _accumulated(source, helpers, rewritten, acc, taken)


def _set_first(
    source: str,
    helpers: tuple[tuple[str, str], ...],
    guess: BatchGuess,
    new: int,
    acc: int,
    taken: Iterable[str],
) -> tuple[str, bool]:
    """The cell with the batch of an object an earlier cell made set at its top, so that the notebook says
    what the kernel runs and a second run of the cell does the same: a setting (``dm.batch_size = 256``)
    or a loader re-batched as a copy (``train_loader = oommagic.rebatched(train_loader, 256)``); the
    accumulation beside it (the trainer's own setting where a trainer iterates the loader, the cell's
    setting, or its loops)."""
    if guess.where == "loader":
        loader = guess.path[0]
        head = (
            f"import oommagic  # {loader}: the same data in batches of {new} (made with {guess.value})\n"
            f"{loader} = oommagic.rebatched({loader}, {new})\n"
        )
    else:
        owner, attr = guess.path
        head = f"{owner}.{attr} = {new}  # oommagic: the batch {owner} hands out (was {guess.value})\n"
    if guess.accumulation is not None and acc > 1:
        # A trainer that iterates the loader (Lightning's fit) accumulates over the smaller batches with its
        # own setting, which also divides the loss.
        path, steps = guess.accumulation
        return head + f"{path} = {steps * acc}\n" + source, True
    if acc > 1 and accumulates(source):
        body = scale_accumulation(source, acc)
        return head + (body or source), body is not None
    body, keeps = _accumulated(source, helpers, source, acc, taken)
    return head + (body or source), keeps


def _accumulated(
    source: str, helpers: tuple[tuple[str, str], ...], rewritten: str, acc: int, taken: Iterable[str]
) -> tuple[str | None, bool]:
    """``rewritten`` (the cell with its batch made smaller) with ``acc``-step accumulation written: its own
    setting where ``source`` has one, else into its training loops or the notebook functions it calls
    (redefined at the top of the cell); whether the accumulation was written."""
    taken = {*taken, *(word for _, code in helpers for word in fresh_words(code))}
    if acc <= 1 or accumulates(source):
        return rewritten, True
    # One counter for the cell and the functions redefined beside it.
    counter = fresh_name("micro_step", rewritten, taken=taken)
    looped = accumulate_loops(rewritten, acc, counter)
    if looped is not None:
        return looped, True
    defs = [accumulate_loops(code, acc, counter) for _, code in helpers]
    defs = [d.rstrip() for d in defs if d is not None]
    if defs:
        note = f"# gradient accumulation over {acc} micro-batches, written by %%gpumem"
        return "\n\n".join([note, *defs, rewritten]), True
    return rewritten, False


def _accumulation_loop(acc: int, accelerate: bool) -> str:
    if accelerate:
        return (
            f"accelerator = Accelerator(gradient_accumulation_steps={acc})\n"
            "for batch in loader:\n    with accelerator.accumulate(model):\n"
            "        loss = model(**batch).loss\n        accelerator.backward(loss)\n"
            "        optimizer.step()\n        optimizer.zero_grad()"
        )
    return (
        "for i, batch in enumerate(loader):\n"
        f"    loss = model(**batch).loss / {acc}\n    loss.backward()\n"
        f"    if (i + 1) % {acc} == 0:\n        optimizer.step()\n        optimizer.zero_grad()"
    )


def autocast(ctx: DiagnosisContext, fig: Figures) -> Remedy:
    dtype = "bfloat16" if ctx.bf16_supported else "float16"
    device_type = ctx.device.split(":")[0]
    why = (
        f"Matrix products run in {dtype} while the weights stay float32. Measured on GPT-2 training: "
        f"peak −{AUTOCAST_SAVING:.0%}, three times faster."
    )
    if dtype == "float16" and fig.training:
        why += (
            " This GPU has no bfloat16: float16 training needs a GradScaler (in the snippet), or small "
            "gradients underflow to zero."
        )
    if "TrainingArguments" in ctx.source:
        code = f"TrainingArguments(..., {'bf16' if dtype == 'bfloat16' else 'fp16'}=True)"
    elif dtype == "float16" and fig.training:
        code = (
            "scaler = torch.amp.GradScaler()\n"
            f'with torch.autocast("{device_type}", dtype=torch.float16):\n    loss = model(**batch).loss\n'
            "scaler.scale(loss).backward()\nscaler.step(optimizer)\nscaler.update()"
        )
    else:
        code = f'with torch.autocast("{device_type}", dtype=torch.{dtype}):\n    ...  # the cell'
    saving = int(fig.demand * AUTOCAST_SAVING) if fig.demand else None
    return _made(
        fig, "autocast", f"{dtype} autocast", why, saving, code=code, automatic=True, params={"dtype": dtype}
    )


def checkpointing(ctx: DiagnosisContext, fig: Figures) -> Remedy | None:
    """None when every training model already checkpoints."""
    todo = [m for m in ctx.models if m.is_training and not m.checkpointing_on]
    if (ctx.models and not todo) or checkpoints(ctx.source):
        return None
    saving = int(fig.activations * CHECKPOINTING_SAVING) if fig.activations else None
    why = (
        "Keeps only some activations and recomputes the rest during the backward pass. Measured on GPT-2: "
        f"activations −{CHECKPOINTING_SAVING:.0%}, steps about 25% slower."
    )
    new_source = None
    for func in ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig"):
        new_source = new_source or set_call_keyword(ctx.source, func, "gradient_checkpointing", True)
    new_source = new_source if new_source != ctx.source else None
    # The retry switches it on through the namespace, so only top-level names of HF models qualify.
    names = [m.name for m in todo if m.is_hf and m.supports_checkpointing and m.name.isidentifier()]
    for name in names:
        # The cell itself builds the model: the retry's model is a new one, so switch it on in the source.
        new_source = new_source or insert_after_assignment(
            ctx.source, name, f"{name}.gradient_checkpointing_enable()"
        )
    # Plain PyTorch modules the cell calls itself: each call made through torch's checkpoint.
    plain = [m.name for m in todo if not m.is_hf and m.name.isidentifier()] if not names else []
    calls = sorted(n for n in plain if n in called_names(ctx.source))
    if new_source is None and calls:
        new_source = checkpoint_calls_source(ctx.source, calls)
    calls = calls if new_source is not None else []
    able = [m.name for m in todo if m.supports_checkpointing]
    if new_source:
        code = changed_lines(ctx.source, new_source)
    elif able:
        code = "\n".join(f"{n}.gradient_checkpointing_enable()\n{n}.config.use_cache = False" for n in able)
    else:
        code = (
            "from torch.utils.checkpoint import checkpoint\n"
            "# in the model's forward(), for each block:\n"
            "x = checkpoint(block, x, use_reentrant=False)"
        )
    return _made(
        fig,
        "checkpointing",
        "Gradient checkpointing",
        why,
        saving,
        code=code,
        automatic=bool(names) or new_source is not None,
        params={"models": names, **({"calls": calls} if calls else {})},
        new_source=new_source,
    )


# --- what a loop keeps from step to step ----------------------------------------------------------------

_KEEP_GENERIC = """losses.append(loss.item())             # not losses.append(loss): that keeps the graph
running_loss += loss.item()            # not running_loss += loss
outputs.append(logits.detach().cpu())  # not outputs.append(logits)"""
_NO_GRAD = """model.eval()
with torch.no_grad():
    val_loss = model(**val_batch).loss.item()
model.train()"""


def kept_across_steps(ctx: DiagnosisContext, fig: Figures, kept: int) -> list[Remedy | None]:
    """Keep numbers or detached CPU copies across steps, evaluate without a graph: snippets, since only the
    person knows which list grows; lines of the cell that look like the culprit are shown rewritten."""
    sites = [(s.line, s.was, s.now) for s in kept_sites(ctx.source, ndims=kept_ndims(ctx))]
    why = (
        "A tensor kept across steps in a list or a running total keeps its device memory, and one that came "
        "out of the forward pass keeps the autograd graph with it (`total += loss` chains every step's "
        "graph). Keep a Python number (`loss.item()`) or a detached CPU copy (`.detach().cpu()`)."
    )
    if sites:
        why += " In this cell: " + "; ".join(f"line {n}, `{was}`" for n, was, _ in sites) + "."
        code = "\n".join(f"# line {n}, was: {was}\n{now}" for n, was, now in sites)
    else:
        code = _KEEP_GENERIC
    keep = keep_numbers(ctx, fig, kept, why, code)
    no_grad = Remedy(
        "no_grad",
        "Evaluate inside the loop under torch.no_grad()",
        "An evaluation or metric pass in the training loop records a graph for every batch when gradients "
        "are on, and outputs kept from it hold the activations of that graph. Under `torch.no_grad()` (or "
        "`torch.inference_mode()`) there is no graph to keep.",
        code=_NO_GRAD,
    )
    return [keep, no_grad]


def keep_numbers(ctx: DiagnosisContext, fig: Figures, saving: int | None, why: str, code: str) -> Remedy:
    """Each kept value of the cell's loops kept as ``.item()`` (a loss) or ``.detach().cpu()`` (an output):
    a button where the cell itself has such a statement, the snippet otherwise."""
    ndims = kept_ndims(ctx)
    sites = kept_sites(ctx.source, most=100, ndims=ndims)
    new_source = kept_source(ctx.source, sites)
    new_source = new_source if new_source != ctx.source else None
    return _made(
        fig,
        "keep_numbers",
        "Keep numbers, not tensors, across steps"
        if new_source is None
        else "Keep " + ", ".join(f"`{s.replacement}`" for s in sites[:3]) + " across iterations",
        why
        + "".join(
            f" `{s.holder}` is only read after the loop reduced along its last dimension, so each step keeps "
            "that reduction and the line after the loop no longer makes it."
            for s in sites
            if s.later
        ),
        saving,
        code=code,
        automatic=new_source is not None,
        new_source=new_source,
        params={"ndims": ndims} if ndims else {},
    )


def kept_ndims(ctx: DiagnosisContext) -> dict[str, int]:
    """The dimensions of what each list the cell's loops keep held at the failure, by its name."""
    return {k.name: k.ndim for k in ctx.kept if k.ndim}


def kept_in_loop(ctx: DiagnosisContext, fig: Figures, saving: int | None) -> Remedy:
    """``keep_numbers`` for a loop that keeps tensors with no optimizer step to measure growth by."""
    sites = kept_sites(ctx.source, ndims=kept_ndims(ctx))
    why = (
        "A tensor kept across iterations keeps its memory, and one that came out of a forward pass with "
        "autograd on keeps that pass's graph and activations too. A loss is kept as a Python number "
        "(`.item()`), an output as a detached copy in host memory (`.detach().cpu()`)."
    )
    code = "\n".join(f"# line {s.line}, was: {s.was}\n{s.now}" for s in sites) or _KEEP_GENERIC
    return keep_numbers(ctx, fig, saving, why, code)


def no_grad(ctx: DiagnosisContext, fig: Figures, saving: int | None) -> Remedy:
    """The cell's work under ``torch.inference_mode()``, with ``model.eval()`` for models in training mode
    that have dropout or batch norm."""
    names = {m.name.split(".", 1)[0] for m in ctx.models}
    # Only the models this cell runs: one of an earlier cell in training mode is not this cell's to switch.
    to_eval = tuple(
        m.name
        for m in ctx.models
        if m.train_mode and m.mode_layers and m.name.isidentifier() and m.name in names_read(ctx.source)
    )
    new_source = no_grad_source(ctx.source, names, to_eval)
    why = (
        "With autograd on, every forward pass records a graph and keeps the activations the backward pass "
        "would need; nothing here calls backward. Under `torch.inference_mode()` none is kept (use "
        "`torch.no_grad()` instead if these outputs later feed a backward pass)."
    )
    if to_eval:
        why += (
            f" {', '.join(to_eval)} {'is' if len(to_eval) == 1 else 'are'} in training mode with dropout or "
            "batch norm: `.eval()` gives evaluation results."
        )
    return _made(
        fig,
        "no_grad",
        "Run under torch.inference_mode()" + (f" with {', '.join(to_eval)}.eval()" if to_eval else ""),
        why,
        saving,
        code=changed_lines(ctx.source, new_source) if new_source else "with torch.inference_mode():\n    ...",
        automatic=new_source is not None,
        params={"models": sorted(names), "eval": list(to_eval)},
        new_source=new_source,
    )


def taken_then(new_source: str) -> frozenset[str]:
    """The names that were taken when a rewrite chose those of ``new_source``: where it added ``_`` to a
    name (``fresh_name``), the ones before were (by the namespace, then); taken again, the same rewrite
    comes out of the cell as written."""
    taken = set()
    for word in set(fresh_words(new_source)):
        stem = word.rstrip("_")
        taken.update(stem + "_" * i for i in range(len(word) - len(stem)))
    return frozenset(taken)


def _taken(ctx: DiagnosisContext) -> frozenset[str]:
    """The names a rewrite must not take for its own: those the namespace binds and those the notebook
    functions the cell calls read."""
    return ctx.names | {word for _, code in ctx.helpers for word in fresh_words(code)}


def split_rows(ctx: DiagnosisContext, fig: Figures, call: RowsCall, chunk: int) -> Remedy:
    """The expression on the failing line computed on ``chunk`` rows of its input at a time, the results
    joined; the saving is the share of what grows with the rows (the activations, or the one request
    where that was larger than the card) that the other chunks took."""
    source = ctx.source
    inlined = (
        inlined_product(source, name=call.inlined, modules=frozenset({call.func} - {""}))
        if call.inlined
        else None
    )
    if inlined is not None:
        source = inlined[0]
    new_source = split_rows_source(source, call.expression, call.arg, chunk, call.func)
    grows = max(fig.activations or 0, fig.requested or 0) or None
    saving = grows - grows * chunk // call.rows if grows else None
    what = call.func if call.func and calls_only(call.expression, call.func) else f"`{call.expression}`"
    title = f"Run {what} on {chunk} rows of {call.arg} at a time (of {call.rows})"
    if call.func:
        why = (
            f"{call.func}({call.arg}) computes all {call.rows} rows at once, and the activations of every "
            f"layer grow with them; {chunk} at a time holds one chunk's worth"
        )
    else:
        why = (
            f"`{call.expression}` computes all {call.rows} rows of {call.arg} at once; {chunk} at a time "
            "holds one chunk's worth of what grows with them"
        )
    return _made(
        fig,
        "split_rows",
        title,
        why
        + ", and the results are joined with `torch.cat`. Same results, a little slower."
        + (
            f" `{call.inlined}` is not kept: each chunk's part of it is reduced at once (whole, it is as "
            "large as the card could not hold)."
            if call.inlined
            else ""
        ),
        saving,
        code=changed_lines(ctx.source, new_source) if new_source else "",
        automatic=new_source is not None,
        params={
            "func": call.func,
            "arg": call.arg,
            "rows": call.rows,
            "chunk": chunk,
            "expr": call.expression,
            "inlined": call.inlined,
        },
        new_source=new_source,
    )


def step_per_tensor_source(source: str, optimizers: list[str], taken: Iterable[str] = frozenset()) -> str:
    """``source`` with the optimizers' foreach step switched off first, in every parameter group (the loop's
    variable fresh against the cell and ``taken``)."""
    group = fresh_name("param_group", source, taken=taken)
    lines = [
        f"for {group} in {name}.param_groups:  # oommagic: step one tensor at a time\n"
        f'    {group}["foreach"] = False\n'
        for name in optimizers
    ]
    return "".join(lines) + source


def step_per_tensor(ctx: DiagnosisContext, fig: Figures, optimizers: list[str], saving: int | None) -> Remedy:
    """The optimizers' step one parameter at a time (``foreach=False`` in every parameter group): the same
    update, without temporaries the size of all the parameters at once."""
    new_source = step_per_tensor_source(ctx.source, optimizers, _taken(ctx))
    return _made(
        fig,
        "step_per_tensor",
        f"Step {', '.join(optimizers)} one tensor at a time (foreach=False)",
        "The foreach step updates every parameter in one go, with temporaries the size of all of them; "
        "one tensor at a time, the temporaries are the size of the largest parameter. The update is the "
        "same; the step takes a little longer (more, smaller kernels).",
        saving,
        code=changed_lines(ctx.source, new_source),
        automatic=True,
        params={"optimizers": optimizers},
        new_source=new_source,
    )


def factored_optimizer(ctx: DiagnosisContext, fig: Figures, made: str, moments: int) -> Remedy:
    """The cell's Adam-family optimizer made as torch's Adafactor: the second moment factored into a row
    and a column statistic per matrix, no first moment. A different optimizer, said as such."""
    new_source = factored_optimizer_source(ctx.source)
    return _made(
        fig,
        "optimizer",
        f"Adafactor instead of {made}",
        f"{made}'s two moments take as much memory as two copies of the trainable weights; torch's "
        "Adafactor keeps one row and one column statistic per matrix and no first moment, a few MiB where "
        f"they took {fmt(moments)}. It is a different optimizer: its updates are relative to each weight's "
        "size, so the learning rate means something else; check the loss curve.",
        moments,
        code=changed_lines(ctx.source, new_source) if new_source else "",
        automatic=new_source is not None,
        params={"from": made},
        new_source=new_source,
    )


def accumulation_target(source: str, gathered: Gathered) -> str | None:
    """Where a Trainer's ``eval_accumulation_steps`` is written so that the run reads it: on the Trainer an
    earlier cell made (``trainer.args``), else into the cell's ``TrainingArguments(...)`` where the cell makes
    its Trainer (``"call"``; a setting on the object the cell makes anew would be lost), else on the
    arguments an earlier cell made (``args``). None where none of them is there."""
    made = assigned_names(source)
    if gathered.trainer is not None and gathered.trainer not in made:
        return f"{gathered.trainer}.args"
    if arguments_calls(source):
        return "call"
    if gathered.args is not None and gathered.args not in made:
        return gathered.args
    return None


def eval_accumulation(
    ctx: DiagnosisContext, fig: Figures, gathered: Gathered, steps: int, saving: int | None
) -> Remedy:
    """A Trainer's evaluation with ``eval_accumulation_steps=steps``: the gathered predictions go to the
    host every ``steps`` batches, so the device holds at most that many batches of them. Every prediction
    is kept."""
    target = accumulation_target(ctx.source, gathered)
    new_source = eval_accumulation_source(ctx.source, steps, target) if target is not None else None
    where = (
        "in the cell's TrainingArguments"
        if target == "call"
        else f"on {target}"
        if target is not None
        else "in the Trainer's TrainingArguments"
    )
    whole = gathered.whole
    host = f" ({fmt(whole)} for the whole evaluation)" if whole else ""
    return _made(
        fig,
        "eval_accumulation",
        f"eval_accumulation_steps={steps}: predictions to the host "
        + ("after every batch" if steps == 1 else f"every {steps} batches"),
        f"The Trainer keeps every batch's predictions and labels on the device until the evaluation ends; "
        f"with `eval_accumulation_steps={steps}` ({where}) it moves them to the host every {steps} batches, "
        f"so the device holds at most {steps} batches of them. Every prediction is kept: the metrics and "
        f"the returned predictions are the same; host memory holds them instead{host}, and each move waits "
        "for the device.",
        saving,
        code=changed_lines(ctx.source, new_source)
        if new_source
        else f"TrainingArguments(..., eval_accumulation_steps={steps})",
        automatic=new_source is not None,
        params={"steps": steps, "target": target},
        new_source=new_source,
    )


def eval_batch(ctx: DiagnosisContext, fig: Figures, batch: EvalBatch, new: int) -> Remedy:
    """The evaluation batch ``batch`` set to ``new``; the training batch stays as it is. Where the loader is
    made outside the cell (a Lightning hook or loader variable of an earlier cell), the cell passes the
    trainer one with the new batch size."""
    node = eval_batch_literal(ctx.source, batch)
    new_source = set_literal(ctx.source, node, new) if node is not None else None
    outside = _outside_loader(ctx, batch)
    if outside is not None:
        new_source = loader_source(ctx.source, outside, new)
    saving = fig.activations * (batch.value - new) // batch.value if fig.activations else None
    why = (
        f"The failure came in an evaluation, whose memory scales with its own batch ({batch.name} of "
        f"{batch.owner}); the training batch is left as it is. Evaluation results do not depend on its "
        "batch size."
    )
    if outside is not None:
        why += (
            f" {batch.owner} is made in an earlier cell: this cell passes the trainer a loader like it with "
            f"batch_size={new} (or change it there and run that cell again)."
        )
    if batch.name == "per_device_eval_batch_size":
        why += (
            " Where the predictions pile up on the GPU until the end of the evaluation, "
            "`eval_accumulation_steps=N` moves them to host memory every N steps."
        )
    return _made(
        fig,
        "eval_batch",
        f"Evaluation batch {batch.value} → {new}",
        why,
        saving,
        code=changed_lines(ctx.source, new_source) if new_source else f"{batch.name}={new}",
        automatic=new_source is not None,
        params={
            "name": batch.name,
            "owner": batch.owner,
            "old": batch.value,
            "new": new,
            **({"loader": asdict(outside)} if outside is not None else {}),
        },
        new_source=new_source,
    )


def _outside_loader(ctx: DiagnosisContext, batch: EvalBatch) -> EvalLoader | None:
    """The Lightning loader made outside the cell whose batch ``batch`` is, if it is one."""
    loader = ctx.eval_loader
    if loader is None:
        return None
    if loader.variable is not None and batch.owner == loader.variable:
        return loader
    if loader.source and batch.owner == f"{loader.owner}.{loader.hook}":
        return loader
    return None


def loader_source(source: str, loader: EvalLoader, batch_size: int) -> str | None:
    """The cell passing the trainer the loader of ``loader`` (made outside the cell) with ``batch_size``."""
    if loader.variable is not None and loader.keyword is not None:
        return rebuild_loader(source, loader.keyword, loader.variable, batch_size)
    return pass_hook_loader(source, loader.hook, loader.source, batch_size)


def free_pinned(fig: Figures, pinned: int, holders: list[str]) -> Remedy:
    shown = ", ".join(dict.fromkeys(holders[:4]))
    return _made(
        fig,
        "free_pinned",
        f"Give back the {fmt(pinned)} pinned by {shown}",
        "Clears the frames of earlier errors' tracebacks (the exceptions stay, without their locals), drops "
        "the output-history entries that hold device memory, and closes suspended generators that do; "
        "no kernel restart. The same as `%gpumem --free`.",
        pinned,
        code="%gpumem --free",
        automatic=True,
        params={"holders": list(dict.fromkeys(holders))},
    )


def _default_dtype() -> str:
    import torch

    return str(torch.get_default_dtype()).removeprefix("torch.")


def _statement_at(source: str, line: int) -> str | None:
    """The first line, stripped, of the simple statement of ``source`` that spans ``line``."""
    import ast

    tree = tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        simple = isinstance(node, ast.stmt) and not hasattr(node, "body")
        if simple and node.lineno <= line <= (node.end_lineno or node.lineno):
            return source.split("\n")[node.lineno - 1].strip()
    return None


def _dtype_keyword(version: str | None) -> str:
    """transformers 4.56 renamed ``torch_dtype=`` to ``dtype=``; older versions only know the first."""
    try:
        major, minor = (int(x) for x in (version or "5.0").split(".")[:2])
    except ValueError:
        return "dtype"
    return "dtype" if (major, minor) >= (4, 56) else "torch_dtype"


def weights_remedies(
    ctx: DiagnosisContext, fig: Figures, fp32_bytes: int, loads: bool, hf_names: list[str]
) -> list[Remedy | None]:
    """bfloat16 weights, 4-bit loading, offload: rewrites of the cell's ``from_pretrained`` call where it
    has one (``loads``), else bfloat16 for the Hugging Face models in the namespace (``hf_names``)."""
    out: list[Remedy | None] = []
    half = fp32_bytes // 2
    why = "bfloat16 stores each weight in 2 bytes instead of float32's 4; results differ only in rounding."
    keyword = _dtype_keyword(ctx.transformers_version)
    building = next((m for m in ctx.models if m.building), None)
    params: dict = {"dtype": "bfloat16", "loads": loads, "models": hf_names, "keyword": keyword}
    if loads:
        new = load_source(ctx.source, {keyword: "torch.bfloat16"}, ("import torch",))
    elif building is not None and ctx.failing_line:
        # The failing line builds the model: every weight made in bfloat16 from the start.
        new = default_dtype_source(ctx.source, ctx.failing_line, restore=_default_dtype())
        params.update(
            models=[], statement=_statement_at(ctx.source, ctx.failing_line), restore=_default_dtype()
        )
        if not building.is_hf:
            # A Hugging Face model casts what it embeds; a plain module's float32 inputs would meet
            # bfloat16 weights: autocast casts them where they meet (matrix products, convolutions).
            params["autocast"] = "bfloat16"
            why += (
                " The cell runs under bfloat16 autocast too, so float32 inputs meet the weights in bfloat16."
            )
    elif hf_names:
        lines = "\n".join(f"{n}.to(torch.bfloat16)" for n in hf_names)
        new = f"import torch\n{lines}\n{ctx.source}"
    else:
        new = None
    new = new if new != ctx.source else None
    code = changed_lines(ctx.source, new) if new else "model = model.to(torch.bfloat16)"
    out.append(
        _made(
            fig,
            "quantize",
            "bfloat16 weights",
            why,
            half,
            code=code,
            automatic=new is not None,
            params=params,
            new_source=new,
        )
    )
    if not loads:
        return out
    four = fp32_bytes * 7 // 8  # 4-bit: about half a byte per weight instead of 4
    has_bnb = "bitsandbytes" in ctx.installed
    quant = "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)"
    new = (
        load_source(
            ctx.source,
            {"quantization_config": quant},
            ("import torch", "from transformers import BitsAndBytesConfig"),
        )
        if has_bnb
        else None
    )
    title = "4-bit weights (bitsandbytes)" if has_bnb else "4-bit weights: first `pip install bitsandbytes`"
    out.append(
        _made(
            fig,
            "quantize",
            title,
            "bitsandbytes stores each weight in about half a byte and computes in bfloat16 (8-bit: "
            "`load_in_8bit=True`, one byte)."
            + ("" if has_bnb else " It is not installed in this kernel: install it, restart, then retry."),
            four,
            code=(changed_lines(ctx.source, new) if new else "%pip install bitsandbytes\n" + _LOAD_4BIT),
            automatic=new is not None,
            params={"bits": 4, "loads": True},
            new_source=new,
        )
    )
    if fig.budget and ctx.device.startswith("cuda"):
        gib = max(int(fig.budget * (1 - MARGIN)) // 1024**3, 1)
        has_acc = "accelerate" in ctx.installed
        keywords = {"device_map": '"auto"', "max_memory": f'{{0: "{gib}GiB", "cpu": "64GiB"}}'}
        new = load_source(ctx.source, keywords) if has_acc else None
        out.append(
            _made(
                fig,
                "offload",
                "Offload layers to CPU memory (device_map='auto')"
                + ("" if has_acc else ": first `pip install accelerate`"),
                f"Accelerate keeps at most {gib} GiB of layers on the GPU and the rest in CPU memory, moving "
                "each in when it runs: it fits, but runs much slower.",
                max(fp32_bytes - fig.budget, 0) or None,
                code=changed_lines(ctx.source, new) if new else "%pip install accelerate",
                automatic=new is not None,
                params={"device_map": "auto", "max_memory_gib": gib},
                new_source=new,
            )
        )
    return out


# --- generation and input length -----------------------------------------------------------------------


def generate_keyword(
    ctx: DiagnosisContext, fig: Figures, keyword: str, old: int | None, new: int, saving: int | None
) -> Remedy:
    """``max_new_tokens`` or ``num_beams`` set to ``new`` in the cell's generate/pipeline calls, written
    where each call takes it from (its keyword, or the dict it splats: never passed twice)."""
    given = ctx.generate_call.keywords if ctx.generate_call is not None else ()
    source = ctx.source
    for func in calls_with_keyword(ctx.source, keyword) or ("generate",):
        source = set_generation_setting(source, keyword, new, given, func) or source
    new_source = source if source != ctx.source else None
    if keyword == "num_beams" and new > 1:
        title = f"num_beams {old} → {new} (the {new} sequences returned need {new} beams)"
        why = f"Each beam keeps its own KV cache: {old} beams hold {old / new:g}× the cache of {new}."
    elif keyword == "num_beams":
        title = f"num_beams {old} → 1 (greedy)"
        why = f"Each beam keeps its own KV cache: {old} beams hold {old}× the cache of greedy decoding."
    elif old is None:
        title = f"Set max_new_tokens={new}"
        why = (
            "The cell does not set max_new_tokens, so the model's generation config decides how long it "
            "runs; the figures can't say what a cap saves."
        )
    else:
        title = f"max_new_tokens {old} → {new}"
        why = "The KV cache grows with every generated token; the saving is an upper bound."
    return _made(
        fig,
        keyword,
        title,
        why,
        saving,
        code=changed_lines(ctx.source, new_source) if new_source else f"model.generate(..., {keyword}={new})",
        automatic=new_source is not None,
        params={"keyword": keyword, "old": old, "new": new, "given": list(given)},
        new_source=new_source,
    )


def split_generate(ctx: DiagnosisContext, fig: Figures, batch: int, chunk: int, saving: int | None) -> Remedy:
    """The cell's ``generate`` calls run over ``chunk`` prompts at a time, one chunk after another."""
    new_source = split_generate_source(ctx.source, chunk, _taken(ctx))
    return _made(
        fig,
        "split_generate",
        f"Generate {chunk} prompts at a time (of {batch})",
        "The KV cache and the prefill's activations grow with the number of prompts generated together; "
        f"running them {chunk} at a time holds one chunk's worth, and the outputs are joined in order "
        "(right-padded to one length). Same results, a little slower.",
        saving,
        code=changed_lines(ctx.source, new_source) if new_source else "",
        automatic=new_source is not None,
        params={"chunk": chunk, "batch": batch},
        new_source=new_source,
    )


def split_calls(
    ctx: DiagnosisContext, fig: Figures, call: BatchCall, chunk: int, saving: int | None
) -> Remedy:
    """The cell's calls of the notebook function ``call.func`` run over ``chunk`` rows of their batch at a
    time, one chunk after another, the results joined in order."""
    new_source = split_calls_source(ctx.source, call.func, chunk, _taken(ctx))
    return _made(
        fig,
        "split_calls",
        f"Run {call.func}() on {chunk} prompts at a time (of {call.rows})",
        f"{call.func}() got all {call.rows} rows of its `{call.param}` at once, and "
        f"{call.model or 'the model'}'s forward got them as its batch: what it keeps per row (a KV cache, "
        f"logits) grows with them. {chunk} at a time hold one chunk's worth; the results are joined in "
        "order, every row kept. Same results, a little slower.",
        saving,
        code=changed_lines(ctx.source, new_source) if new_source else "",
        automatic=new_source is not None,
        params={"chunk": chunk, "batch": call.rows, "func": call.func},
        new_source=new_source,
    )


def kv_cache_offload(ctx: DiagnosisContext, fig: Figures, saving: int | None) -> Remedy:
    """transformers' offloaded KV cache: each layer's cache in host memory until that layer runs."""
    new_source = set_call_keyword(ctx.source, "generate", "cache_implementation", "offloaded")
    new_source = new_source if new_source != ctx.source else None
    return _made(
        fig,
        "kv_cache",
        'Offloaded KV cache (cache_implementation="offloaded")',
        "transformers keeps the KV cache of every layer but the running one in CPU memory and prefetches "
        "the next: the cache stops growing on the GPU, generation runs slower.",
        saving,
        code=changed_lines(ctx.source, new_source)
        if new_source
        else 'model.generate(..., cache_implementation="offloaded")',
        automatic=new_source is not None,
        params={"cache_implementation": "offloaded"},
        new_source=new_source,
    )


# Bytes of one cached value by backend: quanto and hqq store 4 bits (cache_config nbits=4), fp8 one byte.
_QUANTIZED_BYTES = {"quanto": 0.5, "hqq": 0.5, "fp8": 1.0}
_BACKEND_PACKAGE = {"quanto": "optimum-quanto", "hqq": "hqq"}


def quantized_cache_config(backend: str) -> str:
    """The ``cache_config`` of transformers' quantized cache for ``backend``, as source text."""
    return '{"backend": "fp8"}' if backend == "fp8" else f'{{"backend": "{backend}", "nbits": 4}}'


def kv_cache_quantized(ctx: DiagnosisContext, fig: Figures, activations: int | None) -> Remedy:
    """transformers' quantized KV cache in the cell's ``generate`` calls, with the best backend installed;
    where none is, the install line (and no button)."""
    backends = ctx.kv_backends or ()
    backend = backends[0] if backends else "quanto"
    config = quantized_cache_config(backend)
    new_source = quantized_cache_source(ctx.source, config) if backends else None
    dtype = next((m.dtype for m in ctx.models if m.is_hf), None) or (
        ctx.models[0].dtype if ctx.models else "float32"
    )
    element = ELEMENT_SIZE.get(dtype, 4)
    kept = _QUANTIZED_BYTES[backend] / element
    # An upper bound: the cache is part of what grew; the layer being run is dequantized in full.
    saving = int(activations * (1 - kept)) if activations else None
    what = "8-bit floats" if backend == "fp8" else "4-bit integers"
    why = (
        f"transformers keeps the KV cache in {what} ({kept:.0%} of the {dtype} values' bytes) and "
        "dequantizes one layer at a time as it runs: generation is slower and its numbers change slightly. "
        "The saving is an upper bound."
    )
    install = _BACKEND_PACKAGE.get(backend)
    if not backends:
        why += f" No backend is installed in this kernel: `pip install {install}`, restart, then retry."
    code = (
        changed_lines(ctx.source, new_source)
        if new_source
        else f"%pip install {install}\n# after a kernel restart:\n"
        f'model.generate(..., cache_implementation="quantized", cache_config={config})'
    )
    return _made(
        fig,
        "quantized_cache",
        f"Quantized KV cache ({backend})"
        if backends
        else f"Quantized KV cache: first `pip install {install}`",
        why,
        saving,
        code=code,
        automatic=new_source is not None,
        params={"backend": backend, "cache_config": config},
        new_source=new_source,
    )


def truncate(
    ctx: DiagnosisContext, fig: Figures, saving: int | None, max_length: int = 512, outlier: bool = False
) -> Remedy:
    """``truncation=True, max_length=N`` in the cell's tokenizer calls (an existing max_length stays), or
    where it has none, its collators wrapped to cut the samples before they are padded."""
    new_source = truncate_source(ctx.source, max_length, _taken(ctx))
    collators = new_source is not None and not tokenizer_calls(ctx.source)
    why = f"Inputs longer than {max_length} tokens are cut to that length: pick the length your task needs."
    if collators:
        why += (
            " The cell tokenizes nowhere, so its collator is wrapped to cut each sample before padding (a "
            "collator pads, it never cuts: `DataCollatorWithPadding(max_length=...)` only sets the padded "
            "length); better still, tokenize with `truncation=True` where the dataset is made."
        )
    return _made(
        fig,
        "truncate",
        f"Truncate inputs to {max_length} tokens",
        why,
        saving,
        code=changed_lines(ctx.source, new_source)
        if new_source
        else f"tokenizer(texts, truncation=True, max_length={max_length})",
        automatic=new_source is not None,
        params={"max_length": max_length, "outlier": outlier},
        new_source=new_source,
    )


def skip_long(ctx: DiagnosisContext, fig: Figures, saving: int | None, max_length: int) -> Remedy | None:
    """The cell's training loop skipping the batches longer than ``max_length`` tokens (where the loop
    binds its batch to a name); None where it has no such loop."""
    names = [ctx.batch_shape[0]] if ctx.batch_shape is not None else loop_batches(ctx.source)
    name, new_source = next(
        ((n, new) for n in names if (new := skip_long_source(ctx.source, n, max_length, _taken(ctx)))),
        (None, None),
    )
    if new_source is None:
        return None
    why = (
        f"Batches whose samples are longer than {max_length} tokens are left out of training, whole: the "
        "others train as before, on what they held. Truncating instead keeps the long samples' first "
        f"{max_length} tokens."
    )
    return _made(
        fig,
        "skip_long",
        f"Skip batches longer than {max_length} tokens",
        why,
        saving,
        code=changed_lines(ctx.source, new_source),
        automatic=True,
        params={"name": name, "max_length": max_length, "outlier": True},
        new_source=new_source,
    )


# --- one request larger than the budget ------------------------------------------------------------------


def logits_to_keep(ctx: DiagnosisContext, fig: Figures) -> Remedy | None:
    """``logits_to_keep=1`` in the cell's calls of the model whose logits it reads only at the last
    position, where the failed request is those logits and the model's forward takes the keyword; None
    otherwise."""
    req = ctx.request
    if req is None or not req.logits or req.keep_keyword is None:
        return None
    models = {m.name.split(".", 1)[0].split("[", 1)[0] for m in ctx.models}
    calls = tuple(c for c in last_logits_calls(ctx.source) if not models or c.split(".", 1)[0] in models)
    new_source = keep_last_logits_source(ctx.source, calls, req.keep_keyword) if calls else None
    if new_source is None:
        return None
    positions = dict(zip(req.dims, req.shape, strict=False)).get("sequence")
    saving = req.bytes - req.bytes // positions if positions else None
    return _made(
        fig,
        "logits_to_keep",
        f"Only the last position's logits ({req.keep_keyword}=1)",
        f"The cell reads the logits only at the last position (`[:, -1]`), yet {req.model or 'the model'} "
        f"computes them for all {positions or 'the'} positions; with `{req.keep_keyword}=1` it computes "
        "that one position's: the same values, a sequence-length fraction of the memory.",
        saving,
        code=changed_lines(ctx.source, new_source),
        automatic=True,
        params={"calls": list(calls), "keyword": req.keep_keyword},
        new_source=new_source,
    )
