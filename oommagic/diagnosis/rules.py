"""Diagnose an out-of-memory error: which known causes the figures support, and what each fix would save.

Pure: reads an ``OOMReport``, the run's ``Timeline`` and a ``DiagnosisContext`` (what ``context`` gathered
from the namespace); imports neither torch nor IPython. Each rule fires on its evidence, names that evidence
in numbers, and says plainly when the figures do not support a remedy. What a remedy looks like (title,
snippet, rewrite) is ``remedies``' job; this module decides which apply and ranks them. The records it
reads and writes (``DiagnosisContext``, ``Figures``, ``Finding``) live in ``findings`` and are re-exported
here.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from ..oom import OOMReport
from ..sizes import format_bytes as fmt
from ..timeline import Timeline
from . import remedies as fix
from .findings import DiagnosisContext, Figures, Finding, Leftover, ModelInfo, Remedy, Request, figures
from .remedies import MARGIN
from .source import (
    BatchGuess,
    adam_constructions,
    calls_only,
    disables_grad,
    grad_off_lines,
    kept_sites,
    names_read,
    products_at,
    tokenizer_calls,
)

__all__ = [
    "BatchGuess",
    "DiagnosisContext",
    "Figures",
    "Finding",
    "Leftover",
    "ModelInfo",
    "Remedy",
    "diagnose",
    "figures",
]

MIB = 1024**2
# Below this a cause is noise next to the CUDA context and the allocator's rounding.
NOTICEABLE = 64 * MIB
# Reserved-but-unallocated at or above this share of reserved (or above the request) is fragmentation;
# the same share of the budget held by nothing we can name is worth saying.
FRAGMENTED_SHARE = 0.25
# A step that needs this much more than the median step ran on unusually long samples.
LONG_STEP = 1.3
# Memory kept across optimizer steps grows "steadily" when the lowest allocated level between steps rose
# at least this many steps in a row, each rise within this factor of their median (a leak keeps about
# the same tensors every step; an uneven rise is something else), and the rise makes up at least this
# share of the shortfall (a slow leak is not why this step ran out).
GROWTH_STEPS = 3
# The input length the truncation remedy offers.
TRUNCATE_TO = 512
GROWTH_SPREAD = 2.0
GROWTH_SHARE = 0.5
# How firmly the figures back a finding's saving: measured bytes over estimates over hopes.
WEIGHT = {
    "async_error": 2.0,  # the figures may point at the wrong line: find the real one first
    "too_large": 1.5,  # nothing short of a smaller model or another card makes it fit
    "weights": 1.2,  # the weights' own bytes, from the checkpoint on disk or the model in the namespace
    "growth": 1.0,  # measured: the bytes kept across steps
    "kept": 1.0,  # read from the namespace at the failure: what the loop's list or total held
    "gathered": 1.0,  # read from the evaluation loop's frame: the predictions it had gathered
    "autograd": 1.0,
    "pinned": 1.0,  # measured: bytes held by an earlier error's traceback, the output history, ...
    "fragmentation": 1.0,
    "leftovers": 1.0,
    "other_processes": 0.9,
    "activations": 0.9,
    "generation": 0.9,
    # Only fires on an outlier step, and the fix cuts only the outliers: put it before the batch.
    "long_samples": 1.2,
    "reserved_churn": 0.3,
    "limit": 0.1,  # context, not a fix: the limit was chosen on purpose
    "optimizer_step": 1.0,  # the parameters' bytes, read from the optimizer
    "optimizer_state": 1.0,  # the trainable weights' bytes, read from the models
}
# The optimizer's state is worth a finding from this share of the budget on.
OPTIMIZER_SHARE = 0.25
# Optimizers whose foreach step makes a temporary the size of all their parameters (the square root of
# the second moments, or of the sums of squares): what stepping one tensor at a time saves, less the
# largest parameter's.
ADAPTIVE = frozenset({"Adam", "AdamW", "NAdam", "RAdam", "Adamax", "Adagrad", "RMSprop", "Adadelta"})
_FIXED_SCORE = ("async_error", "too_large", "limit")


def diagnose(report: OOMReport | None, ctx: DiagnosisContext) -> list[Finding]:
    """Every finding the figures support, most useful first: by how much of the shortfall its best remedy
    would cover, weighted by how firmly the figures back it. ``report`` None means the error gave no
    figures; the rules that need them stay quiet."""
    fig = figures(report, ctx)
    found = [f for rule in RULES if (f := rule(report, ctx, fig)) is not None]
    return sorted(found, key=lambda f: (f.score, f.saving or 0), reverse=True)


def _finding(
    key: str,
    title: str,
    evidence: str,
    remedies: list[Remedy | None],
    fig: Figures,
    saving: int | None = None,
) -> Finding:
    kept = sorted((r for r in remedies if r is not None), key=lambda r: r.saving or 0, reverse=True)
    if saving is None:
        saving = max((r.saving for r in kept if r.saving is not None), default=None)
    score = WEIGHT[key] * (1.0 if key in _FIXED_SCORE else fig.coverage(saving))
    return Finding(key, title, evidence, saving, tuple(kept), round(score, 4))


# --- rules: each returns a Finding on its evidence, None without it ------------------------------------

Rule = Callable[[OOMReport | None, DiagnosisContext, Figures], "Finding | None"]


def _fragmentation(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    unused = report.reserved_unallocated if report else None
    if not unused or unused < NOTICEABLE:
        return None
    reserved = report.reserved or (report.allocated + unused if report.allocated is not None else None)
    req = report.requested
    if not ((req is not None and unused >= req) or (reserved and unused >= FRAGMENTED_SHARE * reserved)):
        return None
    evidence = (
        f"{fmt(unused)} was reserved by PyTorch but unallocated"
        + (f" (of {fmt(reserved)} reserved)" if reserved else "")
        + (f" when {fmt(req)} was requested" if req is not None else "")
        + ": the free blocks were too scattered to hold the request."
    )
    remedies = []
    if ctx.expandable_segments_on:
        evidence += " Expandable segments are already on."
    elif ctx.device.startswith("cuda"):
        remedies.append(fix.expandable_segments(fig, unused))
    remedies.append(fix.max_split_size(fig, req, unused))
    return _finding("fragmentation", "Fragmented cache", evidence, remedies, fig)


def _other_processes(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    held = {pid: ("?", b) for pid, b in (report.other_processes if report else ())}
    held.update({pid: (name, b) for pid, name, b in ctx.processes})
    total = sum(b for _, b in held.values())
    if total < NOTICEABLE:
        return None
    ranked = sorted(held.items(), key=lambda p: -p[1][1])
    owners = {pid: (user, command) for pid, user, command in ctx.owners}

    def who_is(pid: int, name: str) -> str:
        user, command = owners.get(pid, (None, None))
        parts = [f"user {user}" if user else "", f"`{command}`" if command else name]
        return ", ".join(p for p in parts if p)

    who = "; ".join(f"PID {pid} ({who_is(pid, name)}) holds {fmt(b)}" for pid, (name, b) in ranked)
    evidence = (
        f"Other processes hold {fmt(total)} of this card: {who}. Stopping them gives it back: a kernel of "
        "this Jupyter server from the sidebar (it names the notebook and asks first), any other with "
        "`kill PID` by its owner."
    )
    gpu = fix.other_gpu(ctx, fig)
    if gpu is None and ctx.other_gpus and fig.demand is not None:
        idx, free = max(ctx.other_gpus, key=lambda g: g[1])
        evidence += (
            f" No other GPU has room for the {fmt(fig.demand)} this cell needs (GPU {idx}: {fmt(free)} free)."
        )
    stops = [fix.stop_process(fig, pid, b, *owners.get(pid, (None, None))) for pid, (_, b) in ranked[:4]]
    return _finding(
        "other_processes", "Other processes share the card", evidence, [gpu, *stops], fig, saving=total
    )


def _leftovers(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    held = sorted(ctx.leftovers, key=lambda lo: lo.bytes, reverse=True)
    read = names_read(ctx.source) | {lo.name for lo in held if lo.in_use}
    free = [lo for lo in held if lo.name not in read and lo.bytes > 0]
    freeable = sum(lo.bytes for lo in free)
    # Models are leftovers too when gathered from a namespace; a hand-built context may list them only once.
    named = max(sum(lo.bytes for lo in held), sum(m.param_bytes for m in ctx.models))
    unaccounted = ctx.before_allocated - named - sum(p.bytes for p in ctx.pins)
    big_unaccounted = fig.budget is not None and unaccounted >= FRAGMENTED_SHARE * fig.budget
    # 64 MiB on a card; on a small budget (an emulated one, a slice of a card) a twentieth of it.
    noticeable = min(NOTICEABLE, 0.05 * fig.budget) if fig.budget else NOTICEABLE
    if freeable < noticeable and not big_unaccounted:
        return None
    evidence = f"{fmt(ctx.before_allocated)} was allocated before the cell started"
    if held:
        evidence += "; the namespace holds " + ", ".join(
            f"{lo.name} ({lo.kind}) {fmt(lo.bytes)}" for lo in held[:8]
        )
    used = [lo.name for lo in held if lo.name in read]
    if used:
        evidence += f". This cell uses {', '.join(used)}, so those stay"
    if big_unaccounted:
        evidence += (
            f". {fmt(unaccounted)} of it is held by nothing in the namespace: closures, library caches, or "
            "IPython's output history (`Out`, `_`; `%reset -f out` clears it)"
        )
    remedies = []
    if freeable >= noticeable:
        remedies.append(fix.free_leftovers(fig, [lo.name for lo in free], freeable, ctx.device))
    return _finding("leftovers", "Memory held before the cell", evidence + ".", remedies, fig)


def _too_large(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    if fig.budget is None:
        return None
    req = fig.requested
    what = "limit" if (ctx.limit or (report and (report.limit or report.emulated))) else "card"
    single = req is not None and req > fig.budget
    state_too_large = fig.state > fig.budget and not _halving_fits(ctx, fig)
    if not single and not state_too_large:
        return None
    parts = []
    if single:
        parts.append(
            f"One request of {fmt(req)} is larger than the whole {fmt(fig.budget)} {what}{_where(ctx)}: "
            + (_request_words(ctx, ctx.request) if ctx.request is not None else _request_knob(ctx))
        )
    if state_too_large:
        each = ", ".join(_state_words(m) for m in ctx.models)
        parts.append(f"{each}: {fmt(fig.state)}, more than the {fmt(fig.budget)} {what}")
    evidence = "; ".join(parts) + ". No allocator setting or cache clear makes this fit."
    remedies = fix.smaller_model(ctx, fig, fig.state) if state_too_large else []
    if single:
        # The one request scales with the batch that made it: the evaluation's where it failed there.
        shrink, _ = _eval_batch_remedy(ctx, fig) if ctx.evaluating else _batch_remedy(ctx, fig, fig.training)
        remedies.append(shrink)
        remedies.extend(_request_remedies(ctx, fig))
        if _splits_rows(ctx, fig):
            remedies.append(_split_rows_remedy(ctx, fig))
        if not ctx.autocast_on and ctx.request is None and products_at(ctx.source, ctx.failing_line):
            # A product written in the cell (``emb @ emb.T``), no model's layer: in half precision its
            # output is half the size.
            remedies.append(fix.autocast(ctx, fig))
    return _finding("too_large", f"Too large for this {what}", evidence, remedies, fig)


# Weights are "the bulk of the budget" from this share on: halving them is then the fix that matters.
WEIGHTS_SHARE = 0.5


def _weights(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """float32 weights that are the bulk of the budget: loaded by the cell (the checkpoint's size on disk)
    or held by a model in the namespace, when the run does not train."""
    if fig.budget is None or fig.training or (fig.state > fig.budget and not _halving_fits(ctx, fig)):
        return None  # training state, and weights beyond even halving, are the too-large finding's
    bulk = WEIGHTS_SHARE * fig.budget
    loads = [x for x in ctx.loading if x.bytes and x.bytes >= bulk and x.dtype in (None, "float32")]
    models = [m for m in ctx.models if m.dtype in ("float32", "float") and m.param_bytes >= bulk]
    if not (loads or models):
        return None
    what = "limit" if (ctx.limit or (report and (report.limit or report.emulated))) else "card"
    parts = [
        f"line {x.line} `{x.func}({x.what!r})` loads {fmt(x.bytes)} of {x.dtype or 'float32'} weights"
        for x in loads
    ]
    parts += [
        f"{m.name}, built on the failing line, had {fmt(m.param_bytes)} of {m.dtype} weights on the device "
        "when the memory ran out"
        if m.building
        else f"{m.name} holds {fmt(m.param_bytes)} of {m.dtype} weights on the device"
        for m in models
    ]
    fp32 = max(sum(x.bytes for x in loads), sum(m.param_bytes for m in models))
    evidence = (
        "; ".join(parts) + f": {fp32 / fig.budget:.0%} of the {fmt(fig.budget)} {what}, leaving "
        f"{fmt(max(fig.budget - fp32, 0))} for everything else. In bfloat16 they take {fmt(fp32 // 2)}."
    )
    hf = [m.name for m in models if m.is_hf and m.name.isidentifier() and not m.building]
    remedies = fix.weights_remedies(ctx, fig, fp32, bool(loads), hf)
    return _finding("weights", "Weights take most of the budget", evidence, remedies, fig)


def _halving_fits(ctx: DiagnosisContext, fig: Figures) -> bool:
    """Whether the run does not train and its float32 weights, halved to bfloat16, fit the budget: then
    the weights finding offers that, not the too-large one."""
    fp32 = [m for m in ctx.models if m.dtype in ("float32", "float")]
    return bool(fp32) and not fig.training and fig.budget is not None and fig.state // 2 < fig.budget


_LOGITS_NAMES = ("logits", "lm_head")
_LOGITS_CALLS = ("cross_entropy", "log_softmax", "softmax")


def _request_knob(ctx: DiagnosisContext) -> str:
    """What makes a single request smaller, read from the failing line and frames: the logits (batch ×
    sequence × vocabulary) of a language model, else the batch and the sequence length."""
    line = ctx.failing_line
    lines = ctx.source.split("\n")
    text = lines[line - 1].strip() if line and line <= len(lines) else ""
    last = max((i for i, f in enumerate(ctx.frames) if f.in_cell), default=None)
    called = " ".join(f.function for f in (ctx.frames[last + 1 :] if last is not None else ctx.frames))
    # A loss the line calls counts where the failure went into it: `cross_entropy(model(x), y)` that
    # fails in the model's forward made no logits of the loss.
    named = any(w in text or w in called for w in _LOGITS_NAMES)
    if named or any(w in (called or text) for w in _LOGITS_CALLS):
        return (
            "it looks like the logits, batch × sequence × vocabulary values at once. Fewer samples at a time "
            "(the evaluation batch when evaluating), `logits_to_keep=1` where only the last position is "
            "needed (generation, scoring), shorter sequences, or a chunked loss make it smaller"
        )
    return "shrink what makes it (batch, sequence length) or compute it in chunks"


def _request_words(ctx: DiagnosisContext, r: Request) -> str:
    """What the failing frames say the one request ``r`` was (its operation, shape and dtype) and the
    knobs that shrink it, from the dimensions they name."""
    text = ("the logits, " if r.logits else "") + r.op
    text += f" of {r.model}" if r.model and r.model not in r.op else ""
    text += f": {r.shape_words()}, {fmt(r.bytes)}. Made smaller by "
    sizes = dict(zip(r.dims, r.shape, strict=False))
    knobs = []
    if r.logits and r.keep_keyword:
        knobs.append(
            f"`{r.keep_keyword}=1` where only the last position's logits are read (scoring, the next token)"
        )
    if "batch" in sizes or "batch·sequence" in sizes:
        batch = "the evaluation batch" if ctx.evaluating else "fewer samples at a time"
        knobs.append(batch + (f" (now {sizes['batch']:,})" if "batch" in sizes else ""))
    if "sequence" in sizes or "batch·sequence" in sizes:
        knobs.append(
            "shorter sequences" + (f" (now {sizes['sequence']:,} tokens)" if "sequence" in sizes else "")
        )
    if r.logits and ctx.training:
        knobs.append("a chunked loss (a fused linear cross-entropy computes the logits a slice at a time)")
    if not knobs:
        knobs.append("computing it in chunks")
    return text + (", ".join(knobs[:-1]) + " or " + knobs[-1] if len(knobs) > 1 else knobs[0])


def _request_remedies(ctx: DiagnosisContext, fig: Figures) -> list[Remedy | None]:
    """The fixes that shrink the one request the failing frames name: its logits kept at the last
    position only, its sequences truncated by the cell's tokenizer calls."""
    r = ctx.request
    if r is None:
        return []
    out = [fix.logits_to_keep(ctx, fig)]
    positions = dict(zip(r.dims, r.shape, strict=False)).get("sequence")
    if positions and positions > TRUNCATE_TO and not ctx.has_truncation and tokenizer_calls(ctx.source):
        out.append(fix.truncate(ctx, fig, r.bytes * (positions - TRUNCATE_TO) // positions, TRUNCATE_TO))
    return out


def _state_words(m: ModelInfo) -> str:
    """'model 12.00 GiB of bfloat16 weights + gradients + two Adam moments (48.00 GiB)'."""
    line = f"{m.name} {fmt(m.param_bytes)} of {m.dtype} weights"
    if not m.is_training:
        return line
    frozen = m.trainable_bytes is not None and m.trainable_bytes < m.param_bytes
    grads = f"gradients of the {fmt(m.trainable_bytes)} trainable" if frozen else "gradients"
    if m.moments is None:
        state = "two Adam moments (no optimizer found yet: AdamW assumed)"
    elif m.moments == 0:
        state = "no optimizer state (SGD without momentum)"
    else:
        state = f"optimizer state ({m.moments:g}× the trainable weights)"
    return f"{line} + {grads} + {state} ({fmt(m.state_bytes)})"


def _activations(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    growth = _step_growth(ctx.timeline, fig)
    # A whole tensor run through a model at once (`bert(**enc)` on every row): its activations grow with
    # the rows, and chunks of them are the knob.
    rows = ctx.rows_call is not None and _splits_rows(ctx, fig)
    if ctx.generation or not (fig.training or ctx.batch or growth or ctx.evaluating or rows):
        return None
    if ctx.evaluating:
        batch, note = _eval_batch_remedy(ctx, fig)
    else:
        batch, note = _batch_remedy(ctx, fig, fig.training)
    evidence = _split_evidence(ctx, fig) + growth + note
    remedies = [batch]
    call = ctx.rows_call
    if _splits_rows(ctx, fig):
        evidence += f" Line {call.line} computes all {call.rows} rows of {call.arg} at once."
        remedies.append(_split_rows_remedy(ctx, fig))
    if ctx.autocast_on:
        evidence += " Autocast is already on."
    elif any(m.dtype in ("float32", "float") for m in ctx.models) and fig.demand is not None:
        remedies.append(fix.autocast(ctx, fig))
    if fig.training:
        remedies.append(fix.checkpointing(ctx, fig))
        on = [m.name for m in ctx.models if m.checkpointing_on]
        evidence += f" Gradient checkpointing is already on for {', '.join(on)}." if on else ""
    title = "Activations of the batch" + (
        " in training" if fig.training else " in evaluation" if ctx.evaluating else ""
    )
    return _finding("activations", title, evidence, remedies, fig)


def _splits_rows(ctx: DiagnosisContext, fig: Figures) -> bool:
    """Whether the failing line's row-by-row expression (``ctx.rows_call``) can run on chunks of rows:
    not in training; a model called with autograd on would keep every chunk's graph with the joined
    output (nothing saved), and a transformers model returns a ModelOutput, which torch.cat cannot join."""
    call = ctx.rows_call
    if fig.training or call is None:
        return False
    if not call.func:
        return True  # tensors without autograd (the context checked): no graph to keep
    hf = {m.name for m in ctx.models if m.is_hf}
    grad_off = ctx.grad_enabled is False or call.line in grad_off_lines(ctx.source)
    return grad_off and not (_top(call.func) in hf and calls_only(call.expression, call.func))


def _split_rows_remedy(ctx: DiagnosisContext, fig: Figures) -> Remedy:
    """The failing line's expression computed on fewer rows of its input at a time: halved until what
    grows with the rows (the activations, or the one request larger than the card) takes at most half of
    what the budget leaves (the failed run's demand is a lower bound: the layers after the one that
    failed were never reached)."""
    call = ctx.rows_call
    assert call is not None
    chunk = max(call.rows // 2, 1)
    grows = max(fig.activations or 0, fig.requested or 0)
    if grows and fig.budget is not None:
        room = (fig.budget * (1 - MARGIN) - fig.fixed) / 2
        while chunk > 1 and grows * chunk / call.rows > room:
            chunk //= 2
    return fix.split_rows(ctx, fig, call, chunk)


def _eval_batch_remedy(ctx: DiagnosisContext, fig: Figures) -> tuple[Remedy | None, str]:
    """The evaluation batch halved (never the training batch: the failure came in an evaluation)."""
    where = _where(ctx)
    note = f" The failure came in an evaluation{where}, so the training batch is not the knob."
    found = ctx.eval_batch
    if found is None and _batch_is_the_evaluations(ctx, fig):
        # The cell's own batch (a loop over slices, a setting of the trainer it evaluates with) is the
        # evaluation's batch: the cell trains nothing, or the setting is the evaluation one.
        batch, why = _batch_remedy(ctx, fig, training=False)
        return batch, f" The failure came in an evaluation{where}, whose batch is {ctx.batch.name}." + why
    if found is None:
        return None, note + (
            " No evaluation batch size is set in the cell (`per_device_eval_batch_size=`, or `batch_size=` "
            "of the loader the failing loop reads)."
        )
    if found.value < 2:
        return None, note + f" Its {found.name} is already 1."
    return fix.eval_batch(ctx, fig, found, found.value // 2), note


def _batch_is_the_evaluations(ctx: DiagnosisContext, fig: Figures) -> bool:
    guess = ctx.batch
    if guess is None:
        return False
    if guess.where == "attribute":
        return "eval" in guess.name.rsplit(".", 1)[-1]
    return not (fig.training or ctx.trains)


def _where(ctx: DiagnosisContext) -> str:
    """' (line 7 of the cell, in evaluation_loop())' from the failing frames."""
    line = ctx.failing_line
    last = max((i for i, f in enumerate(ctx.frames) if f.in_cell), default=None)
    # The first library function the cell called there: the one a person recognises.
    after = ctx.frames[last + 1 :] if last is not None else ()
    inner = next((f.function for f in after if not _plumbing(f.function)), None)
    parts = [f"line {line} of the cell" if line else "", f"in {inner}()" if inner else ""]
    text = ", ".join(p for p in parts if p)
    return f" ({text})" if text else ""


# Decorators' inner functions (transformers' `can_return_tuple`, `deprecate_kwarg`, torch's no_grad):
# not what a person called.
_WRAPPERS = frozenset({"wrapper", "wrapped_func", "wrapped", "inner", "decorate_context"})


def _plumbing(function: str) -> bool:
    return function.startswith(("_", "<")) or function in _WRAPPERS


def _split_evidence(ctx: DiagnosisContext, fig: Figures) -> str:
    if fig.demand is None:
        return "The figures don't say how much the cell needed at its peak."
    line = f"The cell needed {fmt(fig.demand)} at its peak"
    if fig.activations is None:
        return line + f", no more than the {fmt(fig.fixed)} that does not grow with the batch."
    what = ["memory held before the cell"] if ctx.before_allocated else []
    if ctx.models:
        what.append("weights, gradients and optimizer state" if fig.training else "weights")
    line += f": {fmt(fig.fixed)} that does not grow with the batch"
    line += f" ({', '.join(what)})" if what else ""
    line += f", about {fmt(fig.activations)} that does"
    batch = ctx.eval_batch if ctx.evaluating else ctx.batch
    if batch:
        line += f" ({fmt(fig.activations // batch.value)} per sample at {batch.name}={batch.value})"
    return line + "."


def _step_growth(tl: Timeline, fig: Figures) -> str:
    """What the activations finding says about steps that grew: memory kept across steps (the growth
    finding's evidence, pointed at, not repeated) or peaks that grew over a flat baseline."""
    growth = _retained_growth(tl, fig)
    if growth is not None:
        return (
            f" Of that, {fmt(growth.kept)} is memory kept across steps, not the batch's activations: "
            f"allocated after each optimizer step rose {fmt(growth.per_step)} per step (see “Memory grows "
            "every step”)."
        )
    # Skip the interval before the first step: Adam's moments appear at step 1, which is no leak.
    peaks = tl.step_peaks()[1:]
    rising = all(b > a for a, b in itertools.pairwise(peaks))
    if len(peaks) < 3 or not rising or peaks[-1] < peaks[0] * 1.05:
        return ""
    grew = f" Each step's peak grew ({' → '.join(fmt(p) for p in peaks[-4:])})"
    floors = tl.step_floors()
    if not floors:
        return grew + "."
    if floors[-1] - floors[0] < (peaks[-1] - peaks[0]) / 4:
        return grew + (
            f" while the memory kept between steps stayed near {fmt(floors[0])}: later batches needed "
            "more, e.g. longer inputs."
        )
    return grew + (
        f" and so, unevenly, did the memory kept between steps ({fmt(floors[0])} → {fmt(floors[-1])}): "
        "something may keep tensors across steps, e.g. `losses.append(loss)` keeps each step's graph; "
        "append `loss.item()` instead."
    )


@dataclass(frozen=True)
class _Growth:
    """Memory kept across the last ``steps`` optimizer steps before the failing one: ``kept`` bytes."""

    kept: int
    steps: int

    @property
    def per_step(self) -> int:
        return self.kept // self.steps


def _retained_growth(tl: Timeline, fig: Figures) -> _Growth | None:
    """The steady rise of what stays between steps, up to the failing step, where it matters."""
    rises = [b - a for a, b in itertools.pairwise(tl.step_floors())]
    # The interval the error ended is cut short: where the failing allocation was the one the step would
    # have kept, nothing was kept yet and its floor repeats the one before.
    if tl.oom_at is not None and rises and rises[-1] <= 0:
        rises.pop()
    rising = list(itertools.takewhile(lambda d: d > 0, reversed(rises)))
    if len(rising) < GROWTH_STEPS:
        return None
    # An earlier odd step (a one-off buffer, a first evaluation) shortens the streak rather than hiding it.
    median = sorted(rising)[len(rising) // 2]
    steady = list(
        itertools.takewhile(lambda d: median / GROWTH_SPREAD <= d <= median * GROWTH_SPREAD, rising)
    )
    kept = sum(steady)
    short = fig.shortfall if fig.shortfall and fig.shortfall > 0 else 0
    if len(steady) < GROWTH_STEPS or kept < max(NOTICEABLE, GROWTH_SHARE * short):
        return None
    return _Growth(kept, len(steady))


def smaller_batch(old: int, fig: Figures, training: bool) -> tuple[int, int] | None:
    """(new batch, accumulation steps): at most half the old batch, less where the figures predict only
    less fits (with a 10% margin); None when not even one sample would. In training the new batch divides
    the old one where that wastes less than half, so accumulation keeps the effective batch exact."""
    if old < 2:
        return None
    # The demand is what was in use when the allocation failed: the step would have needed more, so the
    # figures can say "less than half" but never "more than half".
    target = old // 2
    if fig.activations and fig.available is not None:
        per_sample = fig.activations / old
        # The failed request lacked room beside blocks reserved but unallocated (scattered): smaller
        # blocks of a smaller batch can use them.
        room = (fig.available + fig.unused) * (1 - MARGIN) - fig.fixed
        if room < per_sample:
            return None
        target = min(target, int(room // per_sample))
    return split_batch(old, target, training)


def split_batch(old: int, most: int, training: bool) -> tuple[int, int]:
    """(micro-batch, accumulation steps) for a batch of ``old`` when at most ``most`` fits: in training a
    divisor of ``old`` where that wastes less than half of ``most`` (accumulation then keeps the effective
    batch exactly), else ``most`` with enough steps to reach ``old``."""
    most = max(1, min(most, old))
    if not training or most == old:
        return most, 1
    divisor = max(d for d in range(1, most + 1) if old % d == 0)
    if 2 * divisor >= most:
        return divisor, old // divisor
    return most, -(-old // most)


def _batch_remedy(ctx: DiagnosisContext, fig: Figures, training: bool) -> tuple[Remedy | None, str]:
    """The smaller-batch remedy, or a note for the evidence saying why there is none."""
    guess = ctx.batch
    if guess is None:
        return None, " No batch size found in the cell: name it with `%%gpumem --batch NAME`."
    picked = smaller_batch(guess.value, fig, training)
    if picked is None:
        why = "it is already 1" if guess.value < 2 else f"the {fmt(fig.fixed)} that stays leaves no room"
        return None, f" A smaller {guess.name} cannot fit: {why}."
    return fix.batch(ctx, fig, guess, *picked), ""


def _generation(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    if not ctx.generation:
        return None
    act = fig.activations
    # The KV cache holds every token, the prompt's and the generated ones: where the prompt length is
    # known, halving max_new_tokens saves that share of it; where not, as if the generated were all.
    prompt = ctx.prompt_tokens or 0
    remedies = []
    # The error came in transformers' `_prefill` (no new token existed yet, nor any cache beyond the
    # prompts'), or the prompts outweigh what is generated: their prefill, every prompt at once, is the
    # peak, and fewer new tokens shorten only the smaller part of the cache.
    in_prefill = any(f.function == "_prefill" and not f.in_cell for f in ctx.frames)
    prefill = in_prefill or bool(
        ctx.prompt_tokens and ctx.max_new_tokens and ctx.prompt_tokens >= ctx.max_new_tokens
    )
    if ctx.prompt_batch and ctx.prompt_batch >= 2:
        chunk = ctx.prompt_batch // 2
        saving = act * (ctx.prompt_batch - chunk) // ctx.prompt_batch if act else None
        remedies.append(fix.split_generate(ctx, fig, ctx.prompt_batch, chunk, saving))
    cache = act * ctx.max_new_tokens // (prompt + ctx.max_new_tokens) if act and ctx.max_new_tokens else None
    if (
        not in_prefill
        and ctx.device.startswith("cuda")
        and _version_at_least(ctx.transformers_version, (4, 45))
    ):
        remedies.append(fix.kv_cache_offload(ctx, fig, cache))
    if not in_prefill and ctx.kv_backends is not None:
        remedies.append(fix.kv_cache_quantized(ctx, fig, act))
    if ctx.max_new_tokens and ctx.max_new_tokens >= 2 and not prefill:
        old, new = ctx.max_new_tokens, ctx.max_new_tokens // 2
        saving = act * (old - new) // (prompt + old) if act else None
        remedies.append(fix.generate_keyword(ctx, fig, "max_new_tokens", old, new, saving))
    elif ctx.max_new_tokens is None and not in_prefill:
        remedies.append(fix.generate_keyword(ctx, fig, "max_new_tokens", None, 256, None))
    if ctx.num_beams and ctx.num_beams > 1:
        saving = act * (ctx.num_beams - 1) // ctx.num_beams if act else None
        remedies.append(fix.generate_keyword(ctx, fig, "num_beams", ctx.num_beams, 1, saving))
    batch, note = _batch_remedy(ctx, fig, training=False)
    remedies.append(batch)
    if batch is None and ctx.prompt_batch:
        note = ""  # the split above is the batch's knob here
    short = ctx.prompt_tokens is not None and ctx.prompt_tokens <= TRUNCATE_TO
    if ctx.prompt_tokens is not None:
        why = f": truncating them to {TRUNCATE_TO} would change nothing" if short else ""
        note += f" The prompts are {ctx.prompt_tokens} tokens long{why}."
    if not (ctx.has_truncation or short):
        cut = prompt - TRUNCATE_TO  # unknown prompts (0): no saving to promise
        saving = act * cut // (prompt + (ctx.max_new_tokens or 0)) if act and cut > 0 else None
        remedies.append(fix.truncate(ctx, fig, saving, TRUNCATE_TO))
    if in_prefill:
        prompts = f"all {ctx.prompt_batch} prompts" if ctx.prompt_batch else "the prompts"
        tokens = f" of {ctx.prompt_tokens} tokens" if ctx.prompt_tokens else ""
        several = bool(ctx.prompt_batch and ctx.prompt_batch >= 2)
        knob = (
            "generating fewer prompts at a time does, as do shorter prompts"
            if several
            else "shorter prompts do"
        )
        note += (
            f" The error came in the prefill (`_prefill` in the traceback), where {prompts}{tokens} go "
            "through the model at once before any new token exists: fewer new tokens or a smaller KV cache "
            f"cannot make it fit; {knob}."
        )
    elif prefill:
        note += (
            f" The {ctx.prompt_tokens}-token prompts are longer than the {ctx.max_new_tokens} new tokens: "
            f"the prefill of all {ctx.prompt_batch or 'the'} prompts at once is the peak, so fewer new "
            "tokens cannot make it fit; generating fewer prompts at a time does."
        )
    evidence = (
        _split_evidence(ctx, fig)
        + " In generation that is mostly the KV cache and logits, which grow with batch × beams × tokens"
        + (f" (max_new_tokens={ctx.max_new_tokens}" if ctx.max_new_tokens else " (max_new_tokens not set")
        + (f", num_beams={ctx.num_beams})." if ctx.num_beams else ").")
        + note
    )
    return _finding("generation", "Generation memory", evidence, remedies, fig)


def _version_at_least(version: str | None, least: tuple[int, int]) -> bool:
    try:
        return tuple(int(x) for x in (version or "").split(".")[:2]) >= least
    except ValueError:
        return False


def _growth(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    growth = _retained_growth(ctx.timeline, fig)
    if growth is None:
        return None
    evidence = (
        f"Allocated after each optimizer step rose {fmt(growth.per_step)} per step over the last "
        f"{growth.steps} steps: {fmt(growth.kept)} kept across steps. The loop keeps something of every "
        "step — a tensor in a list or a running total, often with its graph. That memory is allocated, "
        "not cached: `torch.cuda.empty_cache()` gives none of it back, and a smaller batch only puts the "
        "error off by some steps."
    )
    remedies = fix.kept_across_steps(ctx, fig, growth.kept)
    return _finding("growth", "Memory grows every step", evidence, remedies, fig, saving=growth.kept)


def _kept(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """A loop of the cell keeps tensors (often with their graphs) from every iteration: read from what its
    lists and totals held at the failure, where no optimizer steps show the growth."""
    sites = kept_sites(ctx.source)
    if not sites or _retained_growth(ctx.timeline, fig) is not None:
        return None
    held = [k for k in ctx.kept if k.items >= 2 or k.graphs]
    kept_bytes = sum(k.bytes for k in held)
    graphs = sum(k.graphs for k in held)
    grown = fig.demand - ctx.before_allocated if fig.demand is not None else None
    if not held or not (_matters(kept_bytes, fig) or (graphs >= 2 and grown and _matters(grown, fig))):
        return None
    what = "; ".join(
        f"`{k.name}` held {k.items} tensors, {fmt(k.bytes)} on the device"
        + (f", {k.graphs} of them with their autograd graph" if k.graphs else "")
        for k in held
    )
    lines = ", ".join(f"line {s.line} `{s.was}`" for s in sites)
    evidence = f"The cell's loop keeps a value of every iteration ({lines}). At the failure {what}."
    if grown:
        evidence += f" The cell had allocated {fmt(grown)} more than before it started."
    if graphs:
        evidence += (
            " Each graph keeps the activations of its forward pass alive, which is more than the kept "
            "tensors' own bytes."
        )
    items = max(k.items for k in held)
    # What stays is one iteration's worth; the rest of what grew was kept for nothing.
    saving = grown * (items - 1) // items if grown and graphs else kept_bytes
    remedies = [fix.kept_in_loop(ctx, fig, saving)]
    if graphs and _autograd_wasted(ctx):
        remedies.append(fix.no_grad(ctx, fig, saving))
    return _finding("kept", "Tensors kept across iterations", evidence, remedies, fig)


# Batches of predictions an evaluation may hold on the device with eval_accumulation_steps: a quarter of
# those it held when it failed, since joining the next batch to them briefly takes twice their bytes.
GATHERED_SHARE = 4


def _gathered(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """A Hugging Face Trainer's evaluation gathered every batch's predictions on the device, read from its
    loop's frame: they grow with the evaluation set, so no smaller evaluation batch makes them fit; moving
    them to the host every few batches does, keeping every prediction."""
    g = ctx.gathered
    if g is None or not (_matters(g.bytes, fig) or (g.whole and _matters(g.whole, fig))):
        return None
    if g.accumulation is not None and g.accumulation <= 1:
        return None  # already moved to the host after every batch: what is left is one batch's
    steps = max(1, g.steps // GATHERED_SHARE)
    call = f"`{g.trainer}.{g.method}()`" if g.trainer else f"The Trainer's `{g.method}()`"
    setting = (
        f"every {g.accumulation} batches (`eval_accumulation_steps={g.accumulation}`)"
        if g.accumulation
        else "until the evaluation ends (`eval_accumulation_steps` is not set)"
    )
    what = "predictions and labels" if g.labels else "predictions"
    evidence = (
        f"{call} keeps every batch's {what} on the device {setting}: at the failure they "
        f"held {fmt(g.bytes)} after {g.steps} batch{'es' if g.steps != 1 else ''}, predictions of "
        f"{g.shape_words()}."
    )
    whole = g.whole
    if whole and g.total_rows and g.total_rows > g.rows:
        shape = g.shape_words(g.total_rows)
        evidence += (
            f" The whole evaluation gathers about {fmt(whole)} ({shape}{' and the labels' * g.labels})."
        )
    evidence += (
        " A smaller evaluation batch does not shrink them: they grow with the number of rows evaluated, not "
        "with the batch."
    )
    saving = max((whole or g.bytes) - steps * g.per_step, 0) or None
    remedy = fix.eval_accumulation(ctx, fig, g, steps, saving)
    return _finding(
        "gathered", "The evaluation gathers its predictions on the device", evidence, [remedy], fig
    )


def _top(name: str) -> str:
    """``model`` of ``model``, ``trainer.model`` and ``models[0]``."""
    return name.split(".", 1)[0].split("[", 1)[0]


def _matters(nbytes: int, fig: Figures) -> bool:
    """Large enough to be a cause: above the noise, or a quarter of the budget on a small (emulated) one."""
    return nbytes >= NOTICEABLE or bool(fig.budget and nbytes >= FRAGMENTED_SHARE * fig.budget)


def _autograd_wasted(ctx: DiagnosisContext) -> bool:
    """Autograd was on where the error came, in a run that neither trains nor generates."""
    if ctx.generation or ctx.training or ctx.grad_enabled is not True:
        return False
    line = ctx.failing_line
    return line not in grad_off_lines(ctx.source) if line is not None else not disables_grad(ctx.source)


def _autograd(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """Inference or evaluation with autograd on: graphs recorded that no backward pass will use."""
    if not _autograd_wasted(ctx):
        return None
    # Only the models the cell runs: itself, or through a notebook function it calls.
    used = names_read(ctx.source) | {lo.name for lo in ctx.leftovers if lo.in_use}
    grad_models = [m for m in ctx.models if m.trainable_bytes and _top(m.name) in used]
    graphs = sum(k.graphs for k in ctx.kept)
    if not grad_models and not graphs:
        return None
    parts = []
    if grad_models:
        parts.append(
            ", ".join(
                f"{m.name} has {fmt(m.trainable_bytes)} of parameters that require grad" for m in grad_models
            )
        )
    if graphs:
        parts.append(f"{graphs} outputs kept by the cell carry their autograd graph")
    line = ctx.failing_line
    evidence = (
        "Autograd was on where the error came"
        + (f" (line {line} of the cell)" if line else "")
        + ": "
        + "; ".join(parts)
        + ", and the cell runs no backward pass, so every forward pass kept the activations a backward "
        "pass would need."
    )
    if fig.demand is not None:
        evidence += f" The cell needed {fmt(fig.demand)} at its peak"
        if fig.activations:
            evidence += f", {fmt(fig.activations)} beyond the {fmt(fig.fixed)} of weights and earlier memory"
        evidence += "."
    saving = fig.activations
    return _finding("autograd", "Autograd on in inference", evidence, [fix.no_grad(ctx, fig, saving)], fig)


def _optimizer_step(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """The memory ran out inside an optimizer's step that runs torch's foreach implementation."""
    if not any("/torch/optim/" in f.file.replace("\\", "/") for f in ctx.frames):
        return None
    stepping = [o for o in ctx.optimizers if o.foreach and o.name.isidentifier()]
    if not stepping:
        return None
    saving = sum(o.param_bytes - o.largest for o in stepping if o.kind in ADAPTIVE) or None
    parts = [f"{o.name} ({o.kind}, {fmt(o.param_bytes)} of parameters)" for o in stepping]
    evidence = (
        f"The memory ran out inside the optimizer's step: {', '.join(parts)} "
        f"{'steps' if len(stepping) == 1 else 'step'} with torch's foreach implementation (its default "
        "where the parameters are on a GPU), which updates every parameter at once"
    )
    if saving:
        largest = max(o.largest for o in stepping)
        evidence += (
            f", with temporaries the size of all of them; one tensor at a time they are at most "
            f"{fmt(largest)}, the largest parameter."
        )
    else:
        evidence += "."
    remedy = fix.step_per_tensor(ctx, fig, [o.name for o in stepping], saving)
    return _finding("optimizer_step", "The optimizer's step", evidence, [remedy], fig)


def _optimizer_state(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """An Adam-family optimizer the cell makes, whose two moments per trainable weight are a large share
    of the budget: full fine-tuning, where weights, gradients and the moments pass the budget whatever the
    batch. A factored optimizer keeps a row and a column statistic per matrix instead."""
    made = adam_constructions(ctx.source)
    training = [m for m in ctx.models if m.is_training]
    if not (made and training and fig.training and fig.budget):
        return None
    trainable = sum(m.param_bytes if m.trainable_bytes is None else m.trainable_bytes for m in training)
    moments = 2 * trainable
    if moments < OPTIMIZER_SHARE * fig.budget:
        return None
    evidence = (
        f"{made[0]} keeps two moments per trainable weight: {fmt(moments)} for {fmt(trainable)} of trainable "
        f"weights, {moments / fig.budget:.0%} of the {fmt(fig.budget)} budget, whatever the batch."
    )
    return _finding(
        "optimizer_state",
        "The optimizer's state",
        evidence,
        [fix.factored_optimizer(ctx, fig, made[0], moments)],
        fig,
    )


def _pinned(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    """Device memory held outside the namespace's variables while the cell ran."""
    pinned = sum(p.bytes for p in ctx.pins)
    if not _matters(pinned, fig):
        return None
    shown = "; ".join(f"{fmt(p.bytes)} by {p.chain}" for p in ctx.pins[:6])
    evidence = (
        f"{fmt(pinned)} of device memory was held outside the namespace's variables when the cell ran: "
        f"{shown}. No variable you can `del` holds it; `%gpumem --free` gives it back without a restart."
    )
    if any(p.holder.startswith("sys.last") for p in ctx.pins):
        evidence += (
            " An earlier error's traceback keeps the frames (and tensors) of the cell that failed: common "
            "when a cell ran out of memory before `%%gpumem` was in use."
        )
    remedy = fix.free_pinned(fig, pinned, [p.holder for p in ctx.pins])
    return _finding("pinned", "Memory pinned by earlier cells", evidence, [remedy], fig, saving=pinned)


def _long_samples(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    tl = ctx.timeline
    done = tl.step_peaks()[1:-1]  # full steps: not the first (no Adam state), not the failing one
    if len(done) < 2 or fig.demand is None or ctx.has_truncation or ctx.evaluating:
        return None
    median = sorted(done)[len(done) // 2]
    # Against what each step added above the memory held before the cell: a large baseline (an earlier
    # cell's model, a cache) would otherwise hide any step's excess.
    base = min(ctx.before_allocated, median)
    if fig.demand - base < LONG_STEP * (median - base):
        return None
    # A long batch is one step far above the others over a flat baseline; where what stays between steps
    # rose steadily, or by half the excess, the step is big because memory was kept: the growth finding.
    floors = tl.step_floors()
    if _retained_growth(tl, fig) or (floors and floors[-1] - min(floors) >= (fig.demand - median) / 2):
        return None
    evidence = (
        f"The failing step needed {fmt(fig.demand)}, {(fig.demand - base) / max(median - base, 1):.1f}× "
        f"the median of the {len(done)} completed steps ({fmt(median)}) above the {fmt(base)} held before "
        "the cell: its batch held unusually long samples."
    )
    if ctx.batch_shape is not None:
        name, samples, tokens = ctx.batch_shape
        evidence += f" The batch it failed on, `{name}`, is {samples} × {tokens:,} tokens."
    evidence += (
        " `oommagic.lengths.plot_lengths(texts_or_token_ids)` draws the lengths with the cut-off and the "
        "outliers marked; `summarize_lengths` says what truncating there saves."
    )
    cut = _length_cut(ctx)
    # Leaving the long batches out, or cutting them, saves what the failing step needed beyond the others.
    saving = fig.demand - median
    remedies = [fix.skip_long(ctx, fig, saving, cut), fix.truncate(ctx, fig, saving, cut, outlier=True)]
    return _finding("long_samples", "An unusually long batch", evidence, remedies, fig)


def _length_cut(ctx: DiagnosisContext) -> int:
    """The length long samples are cut to or left out above: ``TRUNCATE_TO``, or where the failing batch
    was no longer than that, half its length (in multiples of 64 tokens)."""
    tokens = ctx.batch_shape[2] if ctx.batch_shape is not None else None
    if tokens is None or tokens > TRUNCATE_TO:
        return TRUNCATE_TO
    return max(tokens // 2 // 64 * 64, 64) if tokens >= 128 else max(tokens // 2, 1)


def _reserved_churn(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    tl = ctx.timeline
    gap = tl.peak_reserved - tl.peak_allocated
    if len(tl.t) < 2 or gap < max(4 * NOTICEABLE, FRAGMENTED_SHARE * tl.peak_reserved):
        return None
    unused = report.reserved_unallocated if report else None
    if unused and report.reserved and unused >= FRAGMENTED_SHARE * report.reserved:
        return None  # still cached at the error: the fragmentation finding covers it
    evidence = (
        f"Reserved memory peaked at {fmt(tl.peak_reserved)} while allocated peaked at "
        f"{fmt(tl.peak_allocated)}: {fmt(gap)} sat cached and unused during the run"
        + (f", but only {fmt(unused or 0)} at the error." if report else ".")
    )
    remedy = fix.empty_cache_every_step(fig, gap)
    return _finding("reserved_churn", "Cache held far above use", evidence, [remedy], fig)


def _async_error(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    if not (ctx.async_error or (report is not None and report.source == "driver")):
        return None
    evidence = (
        "`CUDA error: out of memory` came from the driver, not from PyTorch's allocator: a library "
        "workspace (cuBLAS, cuDNN, NCCL) or a kernel ran out, possibly on an earlier line than the "
        "traceback shows, and the allocator's figures don't describe it."
    )
    return _finding(
        "async_error", "Out of memory outside the allocator", evidence, [fix.LAUNCH_BLOCKING], fig
    )


def _limit(report: OOMReport | None, ctx: DiagnosisContext, fig: Figures) -> Finding | None:
    limit = ctx.limit or (report.limit if report else None)
    capacity = ctx.capacity or (report.capacity if report else None)
    emulated = bool(report and report.emulated)
    if not (emulated or (limit and capacity and limit < capacity)):
        return None
    evidence = f"The {fmt(limit)} limit ran out, not the card" if limit else "An emulated card ran out"
    if capacity and limit and limit < capacity:
        evidence += f": the card has {fmt(capacity)}, {fmt(capacity - limit)} beyond the limit"
    evidence += ". Drop or raise `--limit` to use the whole card." if emulated else "."
    return _finding("limit", "The limit ran out, not the card", evidence, [], fig)


RULES: tuple[Rule, ...] = (
    _async_error,
    _too_large,
    _weights,
    _fragmentation,
    _leftovers,
    _other_processes,
    _activations,
    _generation,
    _growth,
    _kept,
    _gathered,
    _autograd,
    _optimizer_step,
    _optimizer_state,
    _pinned,
    _long_samples,
    _reserved_churn,
    _limit,
)
