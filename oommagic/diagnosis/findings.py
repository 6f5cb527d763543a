"""What the diagnosis reads and writes: the records ``diagnose`` works from and hands back.

``DiagnosisContext`` (with its ``Leftover`` and ``ModelInfo``) is what ``context`` gathers from the kernel;
``Figures`` are the sums every rule shares, worked out by ``figures`` from the ``OOMReport`` and the
context; ``Finding`` is one cause a rule found, with its remedies. Pure records and arithmetic: no rules,
no torch, no IPython.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields

from ..oom import OOMReport
from ..sizes import format_bytes as fmt
from ..timeline import Timeline
from .source import BatchGuess, EvalBatch

__all__ = [
    "TRAINING_STATE",
    "DiagnosisContext",
    "EvalLoader",
    "Figures",
    "Finding",
    "Frame",
    "Gathered",
    "Kept",
    "Leftover",
    "Loading",
    "ModelInfo",
    "OptimizerInfo",
    "Pin",
    "Remedy",
    "Request",
    "RowsCall",
    "figures",
]

# Weights + gradients + two Adam moments: full training with Adam holds ~4x the parameters.
TRAINING_STATE = 4


@dataclass(frozen=True)
class Remedy:
    """One fix: a button label, why it helps, a snippet to copy, and whether a retry can apply it.

    ``kind`` names a row of ``kinds.KINDS``; ``saving`` the bytes it is expected to save (None: the
    figures don't say); ``params`` what the retry needs (JSON-able); ``new_source`` the whole cell with
    the change applied, for source rewrites (the JupyterLab panel writes it into the cell).
    """

    kind: str
    title: str
    explanation: str = ""
    code: str = ""
    automatic: bool = False
    saving: int | None = None
    params: dict = field(default_factory=dict)
    new_source: str | None = None

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> Remedy:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})


@dataclass(frozen=True)
class Finding:
    """One cause the figures support: ``evidence`` in numbers, its remedies (largest saving first), the
    bytes the best of them would save, and ``score`` (higher ranks first)."""

    key: str
    title: str
    evidence: str
    saving: int | None = None
    remedies: tuple[Remedy, ...] = ()
    score: float = 0.0

    def to_json(self) -> dict:
        data = asdict(self)
        data["remedies"] = [r.to_json() for r in self.remedies]
        return data

    @classmethod
    def from_json(cls, data: dict) -> Finding:
        data = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        data["remedies"] = tuple(Remedy.from_json(r) for r in data.get("remedies", ()))
        return cls(**data)


@dataclass(frozen=True)
class Leftover:
    """A user-namespace variable holding device memory; ``kind`` is tensor/module/optimizer/container.
    ``in_use``: a function the cell calls reads it (the cell's own source is checked by ``diagnose``)."""

    name: str
    kind: str
    bytes: int
    in_use: bool = False


@dataclass(frozen=True)
class Kept:
    """What a list or running total the cell's loop keeps held at the failure: ``items`` tensors,
    ``bytes`` on the device, ``graphs`` of them carrying an autograd graph (``grad_fn``)."""

    name: str
    items: int
    bytes: int
    graphs: int
    ndim: int | None = None  # of the first kept tensor


@dataclass(frozen=True)
class Frame:
    """One frame of the failing traceback, outermost first: the function, its line, whether it is the
    cell's own code (``line`` is then a line of the cell), and the file."""

    function: str
    line: int
    in_cell: bool = False
    file: str = ""


@dataclass(frozen=True)
class Pin:
    """Device memory held outside the namespace's variables: ``holder`` is where it hangs (``sys.last_value``,
    ``Out[3]``, ``_``, a generator or exception in the namespace), ``chain`` the path to the tensors
    (``sys.last_value → traceback → train() → local 'x'``), ``bytes`` what it holds."""

    holder: str
    chain: str
    bytes: int


@dataclass(frozen=True)
class Loading:
    """Weights the cell loads with ``from_pretrained``: ``func`` and the model ``what`` as written, the bytes
    of the checkpoint files found on disk (None: not found) and their dtype (None: not read)."""

    func: str
    what: str
    line: int
    bytes: int | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class Request:
    """The one allocation that failed, where the failing frames show what made it: its ``shape``, dtype and
    ``bytes``, the operation in words (``the output of `lm_head` (Linear 64 → 50,257)``), a name per
    dimension where the model's inputs and config give them (``("batch", "sequence", "vocabulary")``,
    else ()), whether it is a language model's logits, the keyword the model's forward takes to keep only
    the last positions' logits (``logits_to_keep``), and the model's class."""

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    op: str
    dims: tuple[str, ...] = ()
    logits: bool = False
    keep_keyword: str | None = None
    model: str | None = None

    def shape_words(self) -> str:
        """'8 × 512 × 50,257 (batch × sequence × vocabulary) float32 values'."""
        text = " × ".join(f"{d:,}" for d in self.shape)
        if self.dims:
            text += f" ({' × '.join(self.dims)})"
        return f"{text} {self.dtype} values"


@dataclass(frozen=True)
class EvalLoader:
    """Where a Lightning evaluation got its loader, read outside the cell: ``hook`` is the method that makes
    it (``val_dataloader``), ``owner`` the class whose hook it is (``source``: the hook's code, where an
    earlier cell defined it); or, where the cell passes a loader made in an earlier cell
    (``trainer.validate(model, dataloaders=val_loader)``), ``variable`` is its name, ``keyword`` the
    keyword it is passed by and ``batch_size`` its batch size."""

    hook: str
    owner: str = ""
    source: str = ""
    variable: str | None = None
    keyword: str | None = None
    batch_size: int | None = None


@dataclass(frozen=True)
class Gathered:
    """What a Hugging Face Trainer's evaluation loop had gathered on the device when the run failed, read
    from its frame: it keeps every batch's predictions (and labels) there until the loop ends, or until
    ``eval_accumulation_steps`` batches moved them to the host.

    ``method``: ``"evaluate"`` or ``"predict"``; ``bytes``: the gathered tensors on the device;
    ``steps``/``rows``: batches and rows gathered; ``total_steps``/``total_rows``: the whole evaluation's
    (None where the loader has no length); ``shape``/``element_size``: the gathered predictions' (the
    first tensor where there are several); ``accumulation``: ``args.eval_accumulation_steps``;
    ``trainer``/``args``: the names the namespace binds to the Trainer and to its arguments (None where it
    binds none: the cell made them); ``labels``: the labels are gathered too."""

    method: str
    bytes: int
    steps: int
    rows: int
    total_steps: int | None = None
    total_rows: int | None = None
    shape: tuple[int, ...] = ()
    element_size: int = 4
    accumulation: int | None = None
    trainer: str | None = None
    args: str | None = None
    labels: bool = True  # the labels are gathered beside the predictions

    @property
    def per_step(self) -> int:
        return self.bytes // max(self.steps, 1)

    @property
    def whole(self) -> int | None:
        """What the whole evaluation would gather at the same bytes per row."""
        if self.total_rows and self.rows:
            return self.bytes * self.total_rows // self.rows
        if self.total_steps:
            return self.per_step * self.total_steps
        return None

    def shape_words(self, rows: int | None = None) -> str:
        """'96 × 64 × 3,000 × 4 bytes' (rows × the rest × bytes per value) for ``rows`` rows."""
        dims = (rows if rows is not None else self.rows, *self.shape[1:])
        return " × ".join(f"{d:,}" for d in dims) + f" × {self.element_size} bytes"


@dataclass(frozen=True)
class ModelInfo:
    """A model in the namespace; ``dtype`` as torch spells it without ``torch.`` (``"float32"``)."""

    name: str
    param_bytes: int
    dtype: str = "float32"
    is_hf: bool = False
    supports_checkpointing: bool = False
    checkpointing_on: bool = False
    is_training: bool = False
    trainable_bytes: int | None = None  # parameters that get gradients (None: all of them)
    moments: float | None = (
        None  # optimizer state per trainable byte (Adam 2, SGD 0-1); None: no optimizer seen
    )
    train_mode: bool = False  # module.training, whatever the cell does
    mode_layers: bool = False  # has dropout or batch-norm layers, whose results depend on train()/eval()
    building: bool = False  # the failing line was building or moving it: not bound to its name yet

    @property
    def state_bytes(self) -> int:
        """What the model holds whatever the batch: its weights, and in training their gradients and the
        optimizer's state (two Adam moments where no optimizer was found)."""
        if not self.is_training:
            return self.param_bytes
        trainable = self.param_bytes if self.trainable_bytes is None else self.trainable_bytes
        moments = 2.0 if self.moments is None else self.moments
        return self.param_bytes + int(trainable * (1 + moments))


@dataclass(frozen=True)
class RowsCall:
    """An expression on the cell's failing line computed row by row from one tensor of the namespace:
    a model of the namespace called on it (``model(X_test)``), a product or a distance and what reduces
    it along other dimensions (``torch.cdist(Xq, Xdb).argmin(dim=1)``). ``func`` is the model's callee
    as written ("" where no model is called), ``arg`` the tensor's name, ``rows`` its first dimension,
    ``expr`` the expression as written ("" for ``func(arg)``)."""

    func: str
    arg: str
    rows: int
    line: int
    expr: str = ""
    # A whole product bound to a name the expression reads once (``dist = torch.cdist(Q, K)``), written
    # into it by the rewrite (``source.inlined_product``); "" where the expression is on the failing line.
    inlined: str = ""

    @property
    def expression(self) -> str:
        return self.expr or f"{self.func}({self.arg})"


@dataclass(frozen=True)
class OptimizerInfo:
    """An optimizer bound to a name in the namespace: its class, whether its step runs the foreach
    implementation (one kernel over every parameter at a time, with temporaries the size of all of them;
    torch's default where the parameters are on a GPU), and the bytes of its parameters on the device and
    of the largest one."""

    name: str
    kind: str
    foreach: bool
    param_bytes: int
    largest: int


@dataclass(frozen=True)
class DiagnosisContext:
    """What the rules need beyond the report: the cell, its timeline, the namespace and the machine."""

    source: str = ""
    timeline: Timeline = field(default_factory=Timeline)
    before_allocated: int = 0
    capacity: int | None = None
    limit: int | None = None
    device: str = "cuda:0"
    leftovers: tuple[Leftover, ...] = ()
    batch: BatchGuess | None = None
    models: tuple[ModelInfo, ...] = ()
    optimizers: tuple[OptimizerInfo, ...] = ()  # those bound to names in the namespace
    other_gpus: tuple[tuple[int, int], ...] = ()  # (cuda index, free bytes)
    processes: tuple[tuple[int, str, int], ...] = ()  # (pid, name, bytes) of other processes, from NVML
    owners: tuple[tuple[int, str | None, str | None], ...] = ()  # (pid, user, command line), from /proc
    generation: bool = False
    max_new_tokens: int | None = None
    num_beams: int | None = None
    prompt_tokens: int | None = None  # the length of the inputs handed to generate(), where readable
    prompt_batch: int | None = None  # how many prompts generate() got at once, where readable
    has_truncation: bool = False
    autocast_on: bool = False
    bf16_supported: bool = True
    async_error: bool = False
    expandable_segments_on: bool = False
    grad_accum_name: str | None = None
    trains: bool = False  # the cell trains itself or through the notebook functions it calls
    helpers: tuple[
        tuple[str, str], ...
    ] = ()  # (name, source) of notebook functions the cell calls that train
    applied: tuple[str, ...] = ()  # kinds of the fixes in force for this run, in the order applied
    frames: tuple[Frame, ...] = ()  # the failing traceback, outermost first
    kept: tuple[Kept, ...] = ()  # what the lists and totals the cell's loops keep held at the failure
    grad_enabled: bool | None = None  # autograd on where the error came (None: not known)
    evaluating: bool = False  # the failure came in an evaluation (frames, no_grad block, evaluate())
    eval_batch: EvalBatch | None = None
    pins: tuple[Pin, ...] = ()  # device memory held outside the namespace's variables
    loading: tuple[Loading, ...] = ()
    installed: tuple[str, ...] = ()  # of bitsandbytes, accelerate: those importable in this kernel
    transformers_version: str | None = None
    request: Request | None = None  # the one allocation that failed, where the failing frames name it
    eval_loader: EvalLoader | None = None  # where a Lightning evaluation that failed got its loader
    gathered: Gathered | None = None  # what a Trainer's evaluation loop gathered on the device
    # backends of transformers' quantized KV cache usable here, best first (None: no quantized cache)
    kv_backends: tuple[str, ...] | None = None
    # (name, samples, tokens) of the batch a training loop of the cell held when it failed
    batch_shape: tuple[str, int, int] | None = None
    rows_call: RowsCall | None = None  # a model called on a whole tensor on the failing line
    names: frozenset[str] = frozenset()  # the names the namespace binds: a rewrite takes none for its own

    @property
    def failing_line(self) -> int | None:
        """The line of the cell the error came through (its innermost frame in the cell)."""
        return next((f.line for f in reversed(self.frames) if f.in_cell), None)

    @property
    def training(self) -> bool:
        """Whether this run trains: the cell says so, or a model in it is in training mode with trainable
        parameters; not when the failure came in an evaluation (its trials run it whole). The one rule
        every reader uses."""
        return not self.evaluating and (self.trains or any(m.is_training for m in self.models))


@dataclass(frozen=True)
class Figures:
    """The sums every rule shares. ``demand``: allocated bytes the cell wanted at its peak;
    ``shortfall``: how many of them were missing; ``fixed``: what does not scale with the batch;
    ``activations``: the rest."""

    budget: int | None = None
    requested: int | None = None
    demand: int | None = None
    shortfall: int | None = None
    fixed: int = 0
    activations: int | None = None
    training: bool = False
    state: int = 0  # weights, and in training gradients and optimizer state (``ModelInfo.state_bytes``)
    unused: int = 0  # reserved but unallocated at the failure: room a different pattern of blocks can use

    @property
    def available(self) -> int | None:
        """What PyTorch could have held at best: what it wanted minus what was missing."""
        if self.demand is not None and self.shortfall is not None:
            return self.demand - self.shortfall
        return self.budget

    def verdict(self, saving: int | None) -> str:
        """A sentence saying whether ``saving`` covers the shortfall."""
        if saving is None or self.shortfall is None:
            return ""
        # The shortfall is that of the request that failed: later allocations of the step may want more.
        if saving >= self.shortfall:
            return f" By these figures that covers the {fmt(self.shortfall)} the failed request lacked."
        return (
            f" By these figures that alone is not enough: the failed request lacked "
            f"{fmt(self.shortfall)}, {fmt(self.shortfall - saving)} more than this saves."
        )

    def coverage(self, saving: int | None) -> float:
        """Share of the shortfall (else of the request or budget) that ``saving`` covers, at most 1."""
        if not saving or saving <= 0:
            return 0.0
        ref = self.shortfall or self.requested or self.budget
        return min(saving / ref, 1.0) if ref else 0.5


def figures(report: OOMReport | None, ctx: DiagnosisContext) -> Figures:
    """Budget, demand, shortfall and the batch-independent share, from the report and the context."""
    limit = ctx.limit or (report.limit if report else None)
    capacity = ctx.capacity or (report.capacity if report else None)
    budget = min(b for b in (limit, capacity) if b) if (limit or capacity) else None
    req = report.requested if report else None
    tl = ctx.timeline
    demands = [tl.peak_allocated] if tl.allocated else []
    if req is not None and report is not None and report.allocated is not None:
        demands.append(report.allocated + req)
    elif req is not None and tl.allocated:
        demands.append(tl.allocated[-1] + req)
    demand = max(demands) if demands else None

    shortfall = None
    if req is not None and report is not None:
        held = report.reserved if report.reserved is not None else report.allocated
        # Under a per-process limit the allocator weighs its reserved total against the limit, not free
        # device memory.
        room = (limit - held) if limit and held is not None else report.free
        shortfall = req - max(room, 0) if room is not None else None
    if (shortfall is None or shortfall <= 0) and demand and budget:
        shortfall = demand - budget if demand > budget else None

    state = sum(m.state_bytes for m in ctx.models)
    # The model's state is either already in before_allocated (loaded earlier) or built by the cell: the
    # larger of the two is a floor for what stays whatever the batch.
    fixed = max(ctx.before_allocated, state)
    activations = demand - fixed if demand is not None and demand > fixed else None
    unused = 0
    if report is not None and report.reserved_unallocated is not None:
        unused = report.reserved_unallocated
    elif report is not None and report.reserved is not None and report.allocated is not None:
        unused = max(0, report.reserved - report.allocated)
    return Figures(budget, req, demand, shortfall, fixed, activations, ctx.training, state, unused)
