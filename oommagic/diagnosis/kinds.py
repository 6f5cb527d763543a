"""The fix kinds: one row each, the one place that says what a kind of fix is and how it behaves.

A row says what a kind changes beyond memory (its tier), whether a trial in this process can measure it,
whether a retry of a distributed cell reaches the ranks, how its rewrite is made again on a cell (a fix
removed from a stack: the others are re-applied to the cell as written), which setting of the process a
run holds while the fix is in force (by name: ``run.fixes.HOLDS`` has the context managers, since holding
is an effect), and what it frees once when it is applied. An unknown kind is rejected (``UnknownFixKind``).

Adding a kind of fix:

1. **Reader**: what the cell says (``source/<topic>.py``, pure ``ast``) or what the kernel holds
   (``context.py``, read-only, silent) that shows the knob.
2. **Finding**: the evidence in numbers, in ``rules.py`` (one rule, its ``Finding`` with the remedies).
3. **Builder**: the ``Remedy`` in ``remedies.py``: title, why, the snippet, ``params`` (JSON-able) and
   ``new_source`` (the whole cell rewritten, by a writer in ``rewrite.py``).
4. **Row**: ``FixKind(...)`` below: its tier, ``trial``, ``reaches_ranks`` (``ALWAYS``, ``REWRITTEN``,
   ``NEVER``: a setting held in this process never reaches the ranks a cell starts), ``rewrite`` (made
   again from ``params``), ``hold`` (a name in ``run.fixes.HOLDS``) and ``frees``.
5. **Tests**: the reader and the rewrite on text (``tests/diagnosis``), the finding on figures, and a real
   failing cell in CPU mode whose plan measures the fix and whose first click fits (``tests/run``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .findings import EvalLoader, Remedy
from .remedies import WRITTEN, batch_source, loader_source, step_per_tensor_source, taken_then
from .rewrite import (
    checkpoint_calls_source,
    default_dtype_source,
    eval_accumulation_source,
    factored_optimizer_source,
    keep_last_logits_source,
    keep_numbers_source,
    load_source,
    no_grad_source,
    quantized_cache_source,
    set_call_keyword,
    set_literal,
    skip_long_source,
    split_rows_source,
    truncate_source,
)
from .rewrite_generation import set_generation_setting, split_calls_source, split_generate_source
from .rewrite_shard import checkpoint_source, shard_source
from .source import BatchGuess, EvalBatch, calls_with_keyword, eval_batch_literal, inlined_product

# What a fix changes beyond memory, the plan's first order among fixes that fit.
SAME, NUMERICS, COMPUTED = 0, 1, 2
# Whether a fix reaches the ranks a distributed cell starts (``FixKind.reaches_ranks``).
ALWAYS, REWRITTEN, NEVER = "always", "rewritten", "never"
Helpers = tuple[tuple[str, str], ...]


class UnknownFixKind(ValueError):
    """A remedy names a kind of fix that has no row here."""


@dataclass(frozen=True)
class FixKind:
    """One kind of fix.

    ``tier``: ``SAME`` (a setting, recomputation, the same samples per step), ``NUMERICS`` (lower
    precision) or ``COMPUTED`` (less is computed: a smaller effective batch, shorter inputs or outputs);
    ``tier_of`` refines it from a remedy's params. ``trial``: a trial in this process can measure it (not a
    restart, another process or another GPU). ``reaches_ranks``: whether a retry of a distributed cell (and a
    trial, which relaunches its ranks) applies it in every rank: ``ALWAYS`` (a value the cell hands its
    ranks, the kernel's own leftovers), ``REWRITTEN`` (where its change is a rewrite of the cell: the rank
    functions the cell defines run the rewritten code; not where it is a setting held in this process) or
    ``NEVER`` (a setting of this kernel's process, or an act outside it: the ranks are other processes;
    ``reaches_ranks()`` decides for one remedy). ``rewrite``: the cell with the fix written again from
    its params (None: the fix is not in the source). ``hold``: the name of the setting a run holds while
    it is in force (``run.fixes.HOLDS``). ``frees``: what applying it frees once, ``"names"`` or ``"pinned"``.
    """

    name: str
    tier: int
    trial: bool = True
    reaches_ranks: str = REWRITTEN
    rewrite: Callable[[str, Remedy, Helpers], str] | None = None
    hold: str | None = None
    frees: str | None = None
    tier_of: Callable[[Remedy], int] | None = None


# --- rewrites made again from a remedy's params --------------------------------------------------------


def _batch(source: str, r: Remedy, helpers: Helpers) -> str:
    p = r.params
    if p.get("where") not in (*WRITTEN, "loader", "object"):
        return source
    guess = BatchGuess(p["name"], p["old"], p["where"], path=tuple(p.get("path", ())))
    taken = taken_then(r.new_source or "")
    return batch_source(source, helpers, guess, p["new"], p.get("accumulate", 1), taken)[0] or source


def _keyword(source: str, r: Remedy, helpers: Helpers) -> str:
    keyword, given = r.params["keyword"], r.params.get("given", ())
    for func in calls_with_keyword(source, keyword) or ("generate",):
        source = set_generation_setting(source, keyword, r.params["new"], given, func) or source
    return source


def _checkpointing(source: str, r: Remedy, helpers: Helpers) -> str:
    if r.params.get("wrap"):  # a distributed cell: the model its DDP wrap takes, checkpointed
        return checkpoint_source(source) or source
    if r.params.get("calls"):
        return checkpoint_calls_source(source, r.params["calls"]) or source
    for func in ("TrainingArguments", "Seq2SeqTrainingArguments", "SFTConfig"):
        source = set_call_keyword(source, func, "gradient_checkpointing", True) or source
    return source


def _quantize(source: str, r: Remedy, helpers: Helpers) -> str:
    p = r.params
    if p.get("loads") and p.get("dtype"):
        return load_source(source, {p.get("keyword", "dtype"): "torch.bfloat16"}, ("import torch",)) or source
    if p.get("loads"):
        quant = "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16)"
        imports = ("import torch", "from transformers import BitsAndBytesConfig")
        return load_source(source, {"quantization_config": quant}, imports) or source
    if p.get("statement"):
        return (
            default_dtype_source(source, statement=p["statement"], restore=p.get("restore", "float32"))
            or source
        )
    if p.get("models"):
        return "import torch\n" + "".join(f"{n}.to(torch.bfloat16)\n" for n in p["models"]) + source
    return source


def _offload(source: str, r: Remedy, helpers: Helpers) -> str:
    memory = f'{{0: "{r.params["max_memory_gib"]}GiB", "cpu": "64GiB"}}'
    return load_source(source, {"device_map": '"auto"', "max_memory": memory}) or source


def _split_rows(source: str, r: Remedy, helpers: Helpers) -> str:
    p = r.params
    expr = p.get("expr") or f"{p['func']}({p['arg']})"
    modules = frozenset({p.get("func", "")} - {""})
    inlined = inlined_product(source, name=p["inlined"], modules=modules) if p.get("inlined") else None
    if inlined is not None:
        source = inlined[0]
    return split_rows_source(source, expr, p["arg"], p["chunk"], p.get("func", "")) or source


def _eval_batch(source: str, r: Remedy, helpers: Helpers) -> str:
    p = r.params
    if p.get("loader"):
        return loader_source(source, EvalLoader(**p["loader"]), p["new"]) or source
    node = eval_batch_literal(source, EvalBatch(p["name"], p["old"], p["owner"]))
    return (set_literal(source, node, p["new"]) if node is not None else None) or source


def _no_grad(source: str, r: Remedy, helpers: Helpers) -> str:
    p = r.params
    return no_grad_source(source, set(p.get("models", ())), tuple(p.get("eval", ()))) or source


def _batch_tier(r: Remedy) -> int:
    # Accumulation keeps the samples per optimizer step: the same update from smaller pieces.
    return SAME if r.params.get("keeps_effective", False) else COMPUTED


def _outlier_tier(r: Remedy) -> int:
    # Cutting only the outlier samples that made one step fail changes less than a smaller batch.
    return SAME if r.params.get("outlier") else COMPUTED


KINDS: dict[str, FixKind] = {
    k.name: k
    for k in (
        FixKind("batch", COMPUTED, reaches_ranks=ALWAYS, rewrite=_batch, hold="batch", tier_of=_batch_tier),
        # Settings of this kernel's process: the ranks are other processes.
        FixKind("autocast", NUMERICS, reaches_ranks=NEVER, hold="autocast"),
        FixKind("expandable_segments", SAME, reaches_ranks=NEVER, hold="expandable_segments"),
        FixKind("max_split_size", SAME, trial=False, reaches_ranks=NEVER),
        FixKind("empty_cache", SAME, reaches_ranks=NEVER, hold="empty_cache"),
        # Rewritten (a block's forward under checkpoint, TrainingArguments) it reaches; switched on for a
        # model of this kernel's namespace (held), it does not.
        FixKind("checkpointing", SAME, rewrite=_checkpointing, hold="checkpointing"),
        FixKind("free_leftovers", SAME, reaches_ranks=ALWAYS, frees="names"),
        FixKind("free_pinned", SAME, reaches_ranks=NEVER, frees="pinned"),
        # Its rewrite needs the autocast held in this process beside it.
        FixKind("quantize", NUMERICS, reaches_ranks=NEVER, rewrite=_quantize, hold="autocast"),
        FixKind("offload", SAME, trial=False, reaches_ranks=NEVER, rewrite=_offload),
        FixKind(
            "truncate",
            COMPUTED,
            tier_of=_outlier_tier,
            rewrite=lambda s, r, h: (
                truncate_source(s, r.params["max_length"], taken_then(r.new_source or "")) or s
            ),
        ),
        FixKind(
            "skip_long",
            COMPUTED,
            tier_of=_outlier_tier,
            rewrite=lambda s, r, h: (
                skip_long_source(s, r.params["name"], r.params["max_length"], taken_then(r.new_source or ""))
                or s
            ),
        ),
        FixKind("max_new_tokens", COMPUTED, rewrite=_keyword),
        FixKind("num_beams", COMPUTED, rewrite=_keyword),
        FixKind(
            "keep_numbers", SAME, rewrite=lambda s, r, h: keep_numbers_source(s, r.params.get("ndims")) or s
        ),
        FixKind("no_grad", SAME, rewrite=_no_grad),
        FixKind("eval_batch", SAME, rewrite=_eval_batch),
        # Every prediction kept, moved to the host every few batches: the same results.
        FixKind(
            "eval_accumulation",
            SAME,
            rewrite=lambda s, r, h: eval_accumulation_source(s, r.params["steps"], r.params["target"]) or s,
        ),
        FixKind(
            "split_generate",
            SAME,
            rewrite=lambda s, r, h: (
                split_generate_source(s, r.params["chunk"], taken_then(r.new_source or "")) or s
            ),
        ),
        FixKind(
            "kv_cache",
            NUMERICS,
            rewrite=lambda s, r, h: set_call_keyword(s, "generate", "cache_implementation", "offloaded") or s,
        ),
        FixKind(
            "quantized_cache",
            NUMERICS,
            rewrite=lambda s, r, h: quantized_cache_source(s, r.params["cache_config"]) or s,
        ),
        FixKind(
            "logits_to_keep",
            SAME,
            rewrite=lambda s, r, h: (
                keep_last_logits_source(s, tuple(r.params["calls"]), r.params["keyword"]) or s
            ),
        ),
        FixKind(
            "step_per_tensor",
            SAME,
            rewrite=lambda s, r, h: step_per_tensor_source(
                s, list(r.params["optimizers"]), taken_then(r.new_source or "")
            ),
        ),
        FixKind("split_rows", SAME, rewrite=_split_rows),
        FixKind(
            "split_calls",
            SAME,
            rewrite=lambda s, r, h: (
                split_calls_source(s, r.params["func"], r.params["chunk"], taken_then(r.new_source or ""))
                or s
            ),
        ),
        # FSDP2 in place of DDP in the rank function the cell defines: the same batch, steps and update,
        # the state sharded across the ranks (a trial relaunches them with it).
        FixKind("shard", SAME, rewrite=lambda s, r, h: shard_source(s) or s),
        # A different update rule: what is computed changes, said in the entry.
        FixKind("optimizer", COMPUTED, rewrite=lambda s, r, h: factored_optimizer_source(s) or s),
        # Acting outside this process: another GPU, another process, a restart.
        FixKind("other_gpu", SAME, trial=False, reaches_ranks=NEVER),
        FixKind("multi_gpu", SAME, trial=False, reaches_ranks=NEVER),
        FixKind("launch_blocking", SAME, trial=False, reaches_ranks=NEVER),
        FixKind("shutdown_kernel", SAME, trial=False, reaches_ranks=NEVER),
    )
}


def kind_of(remedy: Remedy | str) -> FixKind:
    """The row of ``remedy``'s kind; ``UnknownFixKind`` for a kind with no row."""
    name = remedy if isinstance(remedy, str) else remedy.kind
    row = KINDS.get(name)
    if row is None:
        raise UnknownFixKind(
            f"{name!r} is not a kind of fix oommagic knows (known: {', '.join(sorted(KINDS))})"
        )
    return row


def reaches_ranks(remedy: Remedy) -> bool:
    """Whether a retry of a distributed cell applies ``remedy`` in every rank (its row's
    ``reaches_ranks``; ``REWRITTEN``: where the remedy rewrites the cell)."""
    row = kind_of(remedy)
    # A row written as a bool (the column's earlier form) reads as ALWAYS or NEVER.
    how = {True: ALWAYS, False: NEVER}.get(row.reaches_ranks, row.reaches_ranks)  # type: ignore[call-overload]
    return how == ALWAYS or (how == REWRITTEN and remedy.new_source is not None)


def tier(remedy: Remedy) -> int:
    """What ``remedy`` changes beyond memory: ``SAME``, ``NUMERICS`` or ``COMPUTED``."""
    row = kind_of(remedy)
    return row.tier_of(remedy) if row.tier_of is not None else row.tier


def rewrite_again(source: str, remedy: Remedy, helpers: Helpers = ()) -> str:
    """``source`` with ``remedy``'s rewrite made again from its params (a fix removed from a stack: the
    others are re-applied to the cell as written). A remedy without a rewrite leaves the source as it is."""
    row = kind_of(remedy)
    if remedy.new_source is None or row.rewrite is None:
        return source
    return row.rewrite(source, remedy, helpers)
