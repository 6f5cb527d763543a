"""Read what the diagnosis needs from the live kernel: the namespace's device memory, models and
optimizers (through ``holdings``), the failing frames, the batch size, generation inputs, and the machine
(allocator settings, other GPUs and processes); then ``make_context`` puts it together with the run's
recording into a ``DiagnosisContext``.

The effectful edge of the diagnosis, and read-only: it imports torch inside its functions, never deletes
or moves anything (``run.release`` does), triggers no warning, calls no property or ``__getattr__`` of user
objects (instance ``__dict__``s only, ``.grad`` only of leaf tensors), and never raises for a figure it
cannot read: it leaves that figure out.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import itertools
import os
import re
import types
import warnings
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ..oom import OOMReport
from ..timeline import Recording
from . import source as cell
from .called import batch_call, generate_call
from .findings import (
    BatchCall,
    DiagnosisContext,
    EvalLoader,
    Frame,
    Gathered,
    GenerateCall,
    Kept,
    Leftover,
    Loading,
    ModelInfo,
    OptimizerInfo,
    Pin,
    RowsCall,
)
from .gathered import trainer_gathered
from .holdings import (
    IPYTHON_NAME,
    SKIPPED_TYPES,
    Reader,
    Storages,
    checkpointing_enabled,
    has_graph,
    held_by,
    instance_dict,
    model_infos,
    namespace_holdings,
    optimizer_infos,
    optimizer_params,
    tensor_storages,
)
from .holdings import model_info as _model_info
from .request import Computation, match_request, read_computation
from .source import BatchGuess, EvalBatch

# run/ (release, snapshot, roles, fixes) reads these from here, where they were before `holdings` existed.
__all__ = [
    "IPYTHON_NAME",
    "SKIPPED_TYPES",
    "NamespaceScan",
    "checkpointing_enabled",
    "held_by",
    "instance_dict",
    "make_context",
    "optimizer_params",
    "scan_namespace",
    "tensor_storages",
]

# A list of a hundred thousand tensors is exactly the leak worth finding; beyond that, stop counting.
_KEPT_ITEMS = 100_000


@dataclass(frozen=True)
class NamespaceScan:
    """What the namespace held when a run failed, read before anything was dropped."""

    leftovers: tuple[Leftover, ...] = ()
    models: tuple[ModelInfo, ...] = ()
    optimizers: tuple[OptimizerInfo, ...] = ()
    ints: tuple[tuple[str, int], ...] = ()
    generation: bool = False
    prompt_tokens: int | None = None
    prompt_batch: int | None = None
    trains: bool = False
    helpers: tuple[tuple[str, str], ...] = ()
    settings_batch: BatchGuess | None = None
    call_batch: BatchGuess | None = None
    rows_batch: BatchGuess | None = None
    object_batch: BatchGuess | None = None
    command_batch: BatchGuess | None = None
    sliced_batch: BatchGuess | None = None
    frames: tuple[Frame, ...] = ()
    kept: tuple[Kept, ...] = ()
    grad_enabled: bool | None = None
    pins: tuple[Pin, ...] = ()
    loading: tuple[Loading, ...] = ()
    installed: tuple[str, ...] = ()
    transformers_version: str | None = None
    computation: Computation | None = None
    eval_loader: EvalLoader | None = None
    gathered: Gathered | None = None
    kv_backends: tuple[str, ...] | None = None
    batch_shape: tuple[str, int, int] | None = None
    rows_call: RowsCall | None = None
    generate_call: GenerateCall | None = None
    batch_call: BatchCall | None = None
    names: frozenset[str] = frozenset()


def scan_namespace(
    namespace: Mapping,
    device: str,
    source: str,
    applied: Iterable[str] = (),
    error: BaseException | None = None,
    pins: tuple[Pin, ...] = (),
    grown: int | None = None,
) -> NamespaceScan:
    """Read tensors, modules and optimizers in ``namespace`` (one level into containers and objects) as
    they sit on ``device``, and from ``error``'s traceback the failing frames and what the cell's loops
    keep in them. Read-only and silent; does not initialise CUDA. ``pins``: what ``diagnosis.pins`` found
    pinned when the run started; ``grown``: the bytes the cell had allocated on the device when it failed."""
    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        where = torch.device(device)
        ints = tuple((k, v) for k, v in namespace.items() if type(v) is int and not IPYTHON_NAME.fullmatch(k))
        trains = cell.trains(source) or "backward" in _names_in_calls(source, namespace)
        launched = _quietly(launched_script, source, namespace)
        # A script the cell launches trains where its text does: the fix keeps its effective batch.
        trains = trains or (launched is not None and cell.trains(launched[0]))
        generation = _generates(source, namespace)
        checkpointing = "checkpointing" in applied or cell.checkpoints(source)
        leftovers, models, optimizers = _holdings(namespace, where, source, checkpointing, trains)
        models = models + _model_being_built(error, models, source, trains, checkpointing, grown)
        frames, scopes = failing_frames(error, namespace, source)
        line = next((f.line for f in reversed(frames) if f.in_cell), None)
        helpers = training_helpers(source, namespace)
        return NamespaceScan(
            leftovers=leftovers,
            models=models,
            optimizers=optimizers,
            ints=ints,
            generation=generation,
            prompt_tokens=prompt_tokens(source, namespace),
            prompt_batch=prompt_shape(source, namespace)[0],
            trains=trains,
            helpers=helpers,
            settings_batch=settings_batch(source, namespace)
            or expression_batch(source, namespace)
            or loader_batch(source, namespace, line),
            call_batch=default_batch(source, namespace),
            rows_batch=_quietly(rows_batch, source, namespace, helpers),
            object_batch=_quietly(object_batch, source, namespace),
            command_batch=cell.command_batch(source, *launched) if launched is not None else None,
            sliced_batch=_quietly(sliced_batch, source, namespace),
            rows_call=_quietly(rows_call, source, namespace, line),
            generate_call=_quietly(generate_call, error),
            batch_call=_quietly(batch_call, error, namespace, source),
            frames=frames,
            kept=kept_holdings(source, [*scopes, namespace], where),
            grad_enabled=bool(torch.is_grad_enabled()),
            pins=pins,
            loading=loadings(source, namespace),
            installed=installed(("bitsandbytes", "accelerate")),
            transformers_version=_version("transformers"),
            computation=_quietly(read_computation, error),
            eval_loader=_quietly(lightning_loader, error, namespace, source),
            gathered=_quietly(trainer_gathered, error, namespace, device),
            kv_backends=_quietly(quantized_cache_backends) if generation else None,
            batch_shape=_quietly(batch_shape, source, [*scopes, namespace]),
            names=frozenset(k for k in namespace if isinstance(k, str)),
        )


def batch_shape(source: str, scopes: list[Mapping]) -> tuple[str, int, int] | None:
    """(name, samples, tokens) of the batch a training loop of the cell held when it failed: the tensor of
    token ids (or the mapping with ``input_ids``) bound to one of ``cell.loop_batches``, found in the first
    of ``scopes`` that has it. None where no such 2-d tensor is there."""
    import torch

    for name in cell.loop_batches(source):
        value = next((sc[name] for sc in scopes if name in sc), None)
        if value is not None and not issubclass(type(value), torch.Tensor):
            data = tokens_dict(value)
            value = dict.get(data, "input_ids") if data is not None else None
        if issubclass(type(value), torch.Tensor) and value.dim() == 2:
            return name, int(value.shape[0]), int(value.shape[1])
    return None


def _quietly(read: Any, *args: Any) -> Any:
    """``read(*args)``, or None where it raises: an exotic frame or object must not stop the diagnosis."""
    with contextlib.suppress(Exception):
        return read(*args)
    return None


def failing_frames(
    error: BaseException | None, namespace: Mapping, source: str
) -> tuple[tuple[Frame, ...], list[Mapping]]:
    """(the frames of ``error``'s traceback, outermost first, those of the cell marked; the locals of the
    cell's function frames, innermost first). The cell's code is the file of the frame that runs with the
    namespace as its globals."""
    import linecache

    if error is None:
        return (), []
    raw = []
    tb = error.__traceback__
    while tb is not None:
        raw.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    # Functions of earlier cells run with the namespace as globals too: the cell is the module-level code.
    cell_files = {
        f.f_code.co_filename for f, _ in raw if f.f_globals is namespace and f.f_code.co_name == "<module>"
    }
    cell_files = cell_files or {f.f_code.co_filename for f, _ in raw if f.f_globals is namespace}
    lines = source.split("\n")
    frames, scopes = [], []
    for frame, lineno in raw:
        code = frame.f_code
        in_cell = code.co_filename in cell_files and 0 < lineno <= len(lines)
        if in_cell:
            # The cell as compiled may differ from `source` by IPython's transforms: trust matching text.
            text = linecache.getline(code.co_filename, lineno).strip()
            in_cell = not text or text == lines[lineno - 1].strip()
        if str(frame.f_globals.get("__name__", "")).startswith(("IPython.", "oommagic.")):
            continue
        frames.append(Frame(code.co_name, lineno, in_cell, code.co_filename))
        if in_cell and code.co_flags & 0x0002:
            with contextlib.suppress(Exception):
                scopes.append(dict(frame.f_locals))
    return tuple(frames), scopes[::-1]


def _model_being_built(
    error: BaseException | None,
    models: tuple[ModelInfo, ...],
    source: str,
    trains: bool,
    checkpointing: bool,
    grown: int | None = None,
) -> tuple[ModelInfo, ...]:
    """The model the failing line was building or moving (``model = Auto...(config).to(device)`` ran out
    inside ``Module.to``): not bound to a name yet, it is the outermost module a failing frame works on
    (its ``self``). Named after what the cell's failing line assigns, else ``model``."""
    import torch

    if error is None or models:  # a model bound already is the one the findings speak of
        return ()
    tb, found, seen, total, constructing = error.__traceback__, None, set(), 0, False
    while tb is not None:
        with contextlib.suppress(Exception):
            candidate = dict.get(tb.tb_frame.f_locals, "self")
            if issubclass(type(candidate), torch.nn.Module):
                constructing = constructing or tb.tb_frame.f_code.co_name in ("__init__", "reset_parameters")
                found = found if found is not None else candidate
                # A model that ran out while it was being constructed: its parts made so far are not
                # registered in the outer module yet, so each constructor's `self` adds its own.
                for p in candidate.parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        total += p.numel() * p.element_size()
        tb = tb.tb_next
    if constructing and grown and torch.get_default_dtype() == torch.float32:
        # Parts made so far that no module holds yet (a list of layers being built): what the cell had
        # allocated by then is those weights, made in the default dtype.
        total = max(total, grown)
    # Weights partly moved already count once: the whole model is what the line needs.
    if found is None or not total or any(m.param_bytes >= total for m in models):
        return ()
    name = next((n for n in cell.assigned_calls(source)), "model")
    return (replace(_model_info(name, found, total, trains, checkpointing, None), building=True),)


def kept_holdings(source: str, scopes: list[Mapping], device: Any) -> tuple[Kept, ...]:
    """For each list or total the cell's loops keep values in (``outs`` in ``outs.append(v)``), found in
    the first of ``scopes`` that has it: its tensors, their bytes on ``device``, how many carry a graph."""
    import torch

    found = []
    for holder in dict.fromkeys(s.holder for s in cell.kept_sites(source, most=100) if s.holder):
        value = next((sc[holder] for sc in scopes if holder in sc), None)
        if value is None:
            continue
        kind = type(value)
        if issubclass(kind, (list, tuple)):
            items = list(itertools.islice(value, _KEPT_ITEMS))
        elif issubclass(kind, dict):
            items = list(itertools.islice(dict.values(value), _KEPT_ITEMS))
        else:
            items = [value]
        tensors = [t for t in items if issubclass(type(t), torch.Tensor)]
        if not tensors:
            continue
        storages: Storages = {}
        for t in tensors:
            with contextlib.suppress(Exception):
                tensor_storages(t, device, storages)
        graphs = sum(1 for t in tensors if has_graph(t))
        found.append(Kept(holder, len(tensors), sum(storages.values()), graphs, tensors[0].dim()))
    return tuple(found)


@functools.lru_cache(maxsize=8)
def installed(names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of ``names`` can be imported in this kernel (found, not imported). Cached: a package installed
    later needs a kernel restart to be used anyway."""
    import importlib.util

    out = []
    for name in names:
        with contextlib.suppress(Exception):
            if importlib.util.find_spec(name) is not None:
                out.append(name)
    return tuple(out)


def quantized_cache_backends() -> tuple[str, ...] | None:
    """The backends transformers' quantized KV cache (``cache_implementation="quantized"``) can use in
    this kernel, best first: ``quanto`` (optimum-quanto, 4-bit), ``hqq``, ``fp8`` (built into newer
    transformers); () where it has none installed; None where the loaded transformers has no quantized
    cache. Reads the loaded modules and the installed packages; imports nothing."""
    import sys

    utils = sys.modules.get("transformers.cache_utils")
    if utils is None:
        return None
    names = vars(utils)
    if not any(n in names for n in ("QuantizedCache", "QuantoQuantizedCache", "HQQQuantizedCache")):
        return None
    found = []
    if _has_submodule("optimum", "quanto"):
        found.append("quanto")
    if installed(("hqq",)):
        found.append("hqq")
    if "Fp8QuantizedLayer" in names:
        found.append("fp8")
    return tuple(found)


def _has_submodule(package: str, name: str) -> bool:
    """Whether ``package.name`` is installed, without importing ``package``."""
    import importlib.machinery

    for folder in _search_paths(package):
        if importlib.machinery.PathFinder.find_spec(name, [folder]) is not None:
            return True
    return False


def _search_paths(package: str) -> list[str]:
    import importlib.machinery
    import sys

    spec = importlib.machinery.PathFinder.find_spec(package, sys.path)
    return list(spec.submodule_search_locations or []) if spec is not None else []


@functools.lru_cache(maxsize=8)
def _version(dist: str) -> str | None:
    module = __import__("sys").modules.get(dist)
    version = getattr(module, "__version__", None) if module is not None else None
    if version is None:
        with contextlib.suppress(Exception):
            from importlib.metadata import version as meta_version

            version = meta_version(dist)
    return version if isinstance(version, str) else None


def loadings(source: str, namespace: Mapping) -> tuple[Loading, ...]:
    """The ``from_pretrained`` calls of the cell, with the size and dtype of the checkpoint they load where
    its files are on disk (a local folder, or the Hugging Face cache)."""
    strings = {k: v for k, v in namespace.items() if type(v) is str and not IPYTHON_NAME.fullmatch(k)}
    out = []
    for call in cell.load_calls(source):
        what = cell.string_value(call.what, strings)
        size, dtype = checkpoint_size(what) if what else (None, None)
        out.append(Loading(call.func, what or call.what, call.line, size, dtype))
    return tuple(out)


_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64", "I8": "int8"}


def checkpoint_size(what: str) -> tuple[int | None, str | None]:
    """(bytes of the weight files, their main dtype) of a model folder or a Hub id in the local cache;
    (None, None) where no files are found. Reads file sizes and safetensors headers only."""
    import glob
    import json
    import struct

    folders = [what] if os.path.isdir(what) else []
    if not folders and "/" in what and not what.startswith((".", "/")):
        hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
            os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub"
        )
        snaps = sorted(glob.glob(os.path.join(hub, "models--" + what.replace("/", "--"), "snapshots", "*")))
        folders = snaps[-1:]
    for folder in folders:
        files = glob.glob(os.path.join(folder, "*.safetensors")) or glob.glob(os.path.join(folder, "*.bin"))
        if not files:
            continue
        size = sum(os.path.getsize(f) for f in files)
        dtypes: Counter[str] = Counter()
        with contextlib.suppress(Exception):
            for f in files[:1]:
                if f.endswith(".safetensors"):
                    with open(f, "rb") as fh:
                        (n,) = struct.unpack("<Q", fh.read(8))
                        header = json.loads(fh.read(min(n, 64 * 1024**2)))
                    for key, entry in header.items():
                        if key != "__metadata__":
                            start, end = entry["data_offsets"]
                            dtypes[_SAFETENSORS_DTYPES.get(entry["dtype"], entry["dtype"].lower())] += (
                                end - start
                            )
        return size, dtypes.most_common(1)[0][0] if dtypes else None
    return None, None


def _ran(scan: NamespaceScan, name: str) -> Any:
    """A figure of the ``generate`` call the failed run made (None where none was read)."""
    return getattr(scan.generate_call, name, None) if scan.generate_call is not None else None


def make_context(
    source: str,
    recording: Recording,
    report: OOMReport | None,
    scan: NamespaceScan,
    batch_name: str | None = None,
    applied: tuple[str, ...] = (),
    dropped: Iterable[str] = (),
) -> DiagnosisContext:
    """The one ``DiagnosisContext`` of a run: the cell, its recording, the namespace as it was at the
    failure (less the names the failed cell bound and that were dropped), the machine and the fixes in
    force."""
    ints = dict(scan.ints)
    gone = set(dropped)
    other_gpus, processes = read_machine(recording.device, report)
    frames = scan.frames
    line = next((f.line for f in reversed(frames) if f.in_cell), None)
    evaluating = _evaluating(source, frames, line)
    return DiagnosisContext(
        source=source,
        timeline=recording.timeline,
        before_allocated=recording.before_allocated,
        capacity=recording.capacity,
        limit=recording.limit,
        device=recording.device,
        leftovers=tuple(x for x in scan.leftovers if x.name not in gone),
        batch=sliced_first(
            source,
            cell.find_batch(source, ints, batch_name)
            or scan.settings_batch
            or cell.step_batch(source)
            or cell.shape_batch(source, ints)
            or scan.call_batch
            or scan.rows_batch
            or scan.object_batch
            or scan.command_batch,
            None if batch_name else scan.sliced_batch,
        ),
        models=scan.models,
        optimizers=scan.optimizers,
        other_gpus=other_gpus,
        processes=processes,
        owners=tuple((pid, *process_owner(pid)) for pid, _, _ in processes),
        generation=scan.generation,
        # What generate() really got (a splatted dict's settings too), else what the cell's text says.
        max_new_tokens=_ran(scan, "max_new_tokens") or cell.keyword_value(source, "max_new_tokens", ints),
        num_beams=_ran(scan, "num_beams") or cell.keyword_value(source, "num_beams", ints),
        num_return_sequences=_ran(scan, "num_return_sequences")
        or cell.keyword_value(source, "num_return_sequences", ints),
        prompt_tokens=_ran(scan, "tokens") or scan.prompt_tokens,
        prompt_batch=_ran(scan, "prompts") or scan.prompt_batch,
        generate_call=scan.generate_call,
        batch_call=scan.batch_call,
        has_truncation=cell.passes_true(source, "truncation"),
        autocast_on="autocast" in applied or cell.autocasts(source),
        bf16_supported=_bf16_supported(recording.device),
        async_error=report is not None and report.source == "driver",
        expandable_segments_on="expandable_segments" in applied or expandable_segments_on(),
        grad_accum_name=cell.accumulation_name(source),
        trains=scan.trains or bool(cell.accumulation_name(source)),
        helpers=scan.helpers,
        applied=applied,
        frames=frames,
        kept=scan.kept,
        grad_enabled=False if _library_evaluates(frames) else scan.grad_enabled,
        evaluating=evaluating,
        eval_batch=_eval_batch(source, line, scan.eval_loader) if evaluating else None,
        eval_loader=scan.eval_loader if evaluating else None,
        gathered=scan.gathered,
        kv_backends=scan.kv_backends,
        batch_shape=scan.batch_shape,
        rows_call=scan.rows_call,
        names=scan.names,
        pins=scan.pins,
        loading=scan.loading,
        installed=scan.installed,
        transformers_version=scan.transformers_version,
        request=match_request(scan.computation, report.requested if report else None),
    )


# Functions of transformers, Lightning and accelerate that evaluate (HF's Trainer.evaluate/predict run
# evaluation_loop; Lightning's validation and test loops call *_step hooks).
_EVAL_FRAMES = frozenset(
    {
        "evaluate",
        "evaluation_loop",
        "prediction_loop",
        "predict",
        "prediction_step",
        "validation_step",
        "test_step",
        "predict_step",
        "_evaluation_loop",
        "_run_evaluate",
        "run_evaluation",
    }
)


def _library_evaluates(frames: tuple[Frame, ...]) -> bool:
    """Whether the failure came inside the evaluation loop of transformers or Lightning, which run it with
    autograd off (``prediction_step`` under ``no_grad``, Lightning's loops under ``inference_mode``): what
    ``torch.is_grad_enabled()`` says after the error, outside those blocks, is not what it was."""
    return any(
        f.function in _EVAL_FRAMES
        and not f.in_cell
        and re.search(r"[/\\](transformers|lightning|pytorch_lightning)[/\\]", f.file)
        for f in frames
    )


def _eval_batch(source: str, line: int | None, loader: EvalLoader | None) -> EvalBatch | None:
    """The batch size of the evaluation that failed: set in the cell (``cell.eval_batch``), or for a
    Lightning evaluation, that of the loader passed to the trainer's call (made in this cell or an earlier
    one) or else returned by the hook (``val_dataloader``) of a class this cell or an earlier one defines."""
    found = cell.eval_batch(source, line)
    if found is not None or loader is None:
        return found
    found = cell.lightning_eval_batch(source, loader.hook)
    if found is not None:
        return found
    if loader.keyword is not None:  # the cell passes the loaders: the hooks are not read
        size = loader.batch_size
        return EvalBatch("batch_size", size, loader.variable) if size and loader.variable else None
    earlier = cell.hook_batch(loader.source, loader.hook) if loader.source else None
    return EvalBatch(earlier.name, earlier.value, f"{loader.owner}.{loader.hook}") if earlier else None


# Lightning's step hooks and the loader hooks that feed them.
_STEP_HOOKS = {
    "validation_step": "val_dataloader",
    "test_step": "test_dataloader",
    "predict_step": "predict_dataloader",
}


def lightning_loader(error: BaseException | None, namespace: Mapping, source: str) -> EvalLoader | None:
    """Where the Lightning evaluation a failure came in got its loader: the ``validation_step`` in the
    traceback names ``val_dataloader``; a loader variable the cell passes for it (its batch size read from
    its instance dict), else the hook of the DataModule the cell passes (``datamodule=dm``) or of the
    LightningModule. None outside a Lightning evaluation."""
    import inspect
    import textwrap

    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        hook = _STEP_HOOKS.get(tb.tb_frame.f_code.co_name)
        owner = tb.tb_frame.f_locals.get("self") if hook else None
        tb = tb.tb_next
        if owner is None or not any(hook in vars(c) for c in type(owner).__mro__[:-1]):
            continue
        passed = cell.passed_loader(source, hook)
        if passed is not None:
            keyword, variable = passed
            size = instance_dict(namespace.get(variable)).get("batch_size") if variable else None
            if type(size) is int and size > 0:
                return EvalLoader(hook, variable=variable, keyword=keyword, batch_size=size)
            return EvalLoader(hook, variable=variable, keyword=keyword)
        datamodule = cell.keyword_name(source, "datamodule")
        held = namespace.get(datamodule) if datamodule else None
        if held is not None and any(hook in vars(c) for c in type(held).__mro__[:-1]):
            owner = held
        func = next((vars(c)[hook] for c in type(owner).__mro__ if hook in vars(c)), None)
        hook_source = ""
        if isinstance(func, types.FunctionType) and func.__module__ == "__main__":
            with contextlib.suppress(Exception):  # no source (exec'd code): the cell's own reading only
                hook_source = textwrap.dedent(inspect.getsource(func))
        return EvalLoader(hook, type(owner).__name__, hook_source)
    return None


def _evaluating(source: str, frames: tuple[Frame, ...], line: int | None) -> bool:
    """Whether the failure came in an evaluation: through an evaluation function of a library, on a line
    of the cell that runs under ``no_grad``/``inference_mode``, or in a cell that only evaluates."""
    if any(f.function in _EVAL_FRAMES for f in frames):
        return True
    if line is not None and line in cell.grad_off_lines(source):
        return True
    return cell.evaluates(source)


# --- the namespace ------------------------------------------------------------------------------------


def _holdings(
    namespace: Mapping, device: Any, source: str, checkpointing: bool, trains: bool
) -> tuple[tuple[Leftover, ...], tuple[ModelInfo, ...], tuple[OptimizerInfo, ...]]:
    """Leftovers (largest first; a storage shared by several names counts for the largest holder only),
    the models and the optimizers bound to names in the namespace, read by one reader."""
    reader = Reader(device)
    held, modules, optimizers = namespace_holdings(namespace, reader)
    claimed: set[int] = set()
    leftovers = []
    in_use = _used_by_calls(source, namespace)
    totals = {name: sum(storages.values()) for name, (_, storages) in held.items()}
    for name in sorted(held, key=totals.__getitem__, reverse=True):
        kind, storages = held[name]
        if len(storages) == 1:  # most holders: one tensor
            ((ptr, mine),) = storages.items()
            if ptr in claimed:
                continue
            claimed.add(ptr)
        else:
            mine = sum(n for ptr, n in storages.items() if ptr not in claimed)
            claimed.update(storages)
        if mine:
            leftovers.append(Leftover(name, kind, mine, in_use=name in in_use))
    models = model_infos(modules, optimizers, reader, source, checkpointing, trains)
    return tuple(leftovers), models, optimizer_infos(namespace, reader)


def _used_by_calls(source: str, namespace: dict, depth: int = 3) -> set[str]:
    """Globals read by the notebook's own functions and classes that the cell uses, ``depth`` calls
    deep: ``train()`` defined in an earlier cell reads ``model`` although the cell never names it; and
    globals held by what the cell reads (``cmodel = torch.compile(model)`` holds ``model``, a trainer its
    model)."""
    used = {n for n in _names_in_calls(source, namespace, depth) if n in namespace}
    held = _held_by({n for n in cell.names_read(source) if n in namespace} | used, namespace)
    return used | {n for n, v in namespace.items() if id(v) in held}


def _held_by(names: set[str], namespace: Mapping, depth: int = 2) -> set[int]:
    """The ids of the objects that the objects bound to ``names`` hold in their instance dicts (a
    module's submodules included), ``depth`` levels down. Instance dicts only: no property runs."""
    found: set[int] = set()
    frontier = [namespace[n] for n in names]
    for _ in range(depth):
        nxt = []
        for obj in frontier:
            attrs = instance_dict(obj)
            values = list(attrs.values())
            if type(attrs.get("_modules")) is dict:
                values += list(attrs["_modules"].values())
            for value in values:
                if id(value) not in found and not isinstance(
                    value, (int, float, str, bytes, bool, type(None))
                ):
                    found.add(id(value))
                    nxt.append(value)
        frontier = nxt
    return found


def _names_in_calls(source: str, namespace: dict, depth: int = 3) -> set[str]:
    """Every name (globals and attributes) the notebook functions the cell calls use, ``depth`` deep:
    a ``train()`` from an earlier cell that calls ``loss.backward()`` makes the cell a training cell."""
    names: set[str] = set()
    frontier = [n for n in cell.names_read(source) if n in namespace]
    seen: set[str] = set()
    for _ in range(depth):
        found: set[str] = set()
        for name in frontier:
            for code in _code_of(namespace.get(name)):
                found |= _code_names(code)
        names |= found
        seen |= set(frontier)
        frontier = sorted(n for n in found - seen if n in namespace)
    return names


# An object whose `args` (HF Trainer, TRL's trainers) or `hparams` hold the batch setting its method reads.
_EVALUATES = ("evaluate", "predict", "validate", "test")


def settings_batch(source: str, namespace: Mapping) -> BatchGuess | None:
    """The batch setting of a trainer the cell drives (``trainer.train()`` with its TrainingArguments made
    in an earlier cell): ``trainer.args.per_device_train_batch_size``, or the evaluation batch when the cell
    evaluates; with the accumulation setting beside it. Read from instance dicts only."""
    tree = cell.tree_of(source)
    # A trainer the cell makes itself is made again by every run of it: its settings are the cell's text.
    made = {s.name for s in cell.binding_sites(tree) if s.keyword is None} if tree is not None else set()
    for dotted in cell.called_names(source):
        owner, _, method = dotted.rpartition(".")
        if "." in owner or owner not in namespace or owner in made:
            continue
        args = instance_dict(namespace[owner]).get("args")
        fields = instance_dict(args)
        evaluating = method in _EVALUATES
        key = "per_device_eval_batch_size" if evaluating else "per_device_train_batch_size"
        value = fields.get(key)
        if type(value) is not int or value < 1:
            continue
        acc_key = "eval_accumulation_steps" if evaluating else "gradient_accumulation_steps"
        acc = fields.get(acc_key)
        accumulation = (f"{owner}.args.{acc_key}", acc if type(acc) is int else 1) if not evaluating else None
        # HF's Trainer copies the training batch when it is made (`_train_batch_size`, per device x GPUs).
        copied = instance_dict(namespace[owner]).get("_train_batch_size")
        mirrors = ((f"{owner}._train_batch_size", copied),) if type(copied) is int and not evaluating else ()
        return BatchGuess(f"{owner}.args.{key}", value, "attribute", accumulation, mirrors)
    return None


def launched_script(source: str, namespace: Mapping, most: int = 2**20) -> tuple[str, dict[str, str]] | None:
    """(the text, the line's expansions) of a script the cell launches on ranks (``!torchrun train.py
    --batch-size 64``). The line's expansions (``{script}``, ``{sys.executable}``, ``$path``) are read where
    they name a string of the namespace or a module's string, nothing evaluated; the script is read, never
    written (at most ``most`` bytes)."""
    if "!" not in source:
        return None
    expand = {}
    for found in re.finditer(r"\{([\w.]+)\}|\$(\w+)", source):
        key = found.group(1) or found.group(2)
        head, *rest = key.split(".")
        value = namespace.get(head)
        for attr in rest:
            # A module's attribute (``sys.executable``) is a plain lookup; another object's may be a property.
            value = vars(value).get(attr) if isinstance(value, types.ModuleType) else None
        if isinstance(value, (str, os.PathLike)):
            expand[key] = os.fspath(value)
    started = cell.launch(source, expand)
    if started is None:
        return None
    path = os.path.join(os.getcwd(), os.path.expanduser(started.script))
    with open(path, encoding="utf-8", errors="replace") as f:
        return f.read(most), expand


def object_batch(source: str, namespace: Mapping) -> BatchGuess | None:
    """A batch setting of an object of the namespace that the cell hands to a call, read where the text
    does not say the batch: ``trainer.fit(model, datamodule=dm)`` with ``dm.batch_size`` (a
    LightningDataModule whose loader reads it), ``train(cfg)`` with ``cfg.batch_size`` read inside the
    function. An int attribute named like a batch, from the object's instance dict only (no property)."""
    import torch

    tree = cell.tree_of(source)
    if tree is None:
        return None
    made = {s.name for s in cell.binding_sites(tree)}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        for arg in [*node.args, *(k.value for k in node.keywords)]:
            if not isinstance(arg, ast.Name) or arg.id in made or arg.id not in namespace:
                continue
            obj = namespace[arg.id]
            if isinstance(obj, (*SKIPPED_TYPES, torch.Tensor, dict, list, tuple)):
                continue
            attrs = instance_dict(obj)
            for key in cell.BATCH_NAMES:
                value = attrs.get(key)
                if type(value) is int and value >= 2:
                    return BatchGuess(f"{arg.id}.{key}", value, "object", path=(arg.id, key))
    return None


def expression_batch(source: str, namespace: Mapping) -> BatchGuess | None:
    """The batch the cell reads from an object of the namespace (``cfg.batch_size``, ``S["batch"]``), its
    value read from plain dicts and instance dicts only (no property, no ``__getitem__`` of a user class)."""
    for path in cell.batch_expressions(source):
        value: Any = namespace.get(path[0])
        for part in path[1:]:
            value = value.get(part) if type(value) is dict else instance_dict(value).get(part)
        if type(value) is int and value >= 1:
            text = path[0] + "".join(f"[{p!r}]" if not p.isidentifier() else f".{p}" for p in path[1:])
            if type(namespace.get(path[0])) is dict:
                text = path[0] + "".join(f"[{p!r}]" for p in path[1:])
            return BatchGuess(text, value, "expression", path=path)
    return None


def rows_batch(
    source: str, namespace: Mapping, helpers: tuple[tuple[str, str], ...] = ()
) -> BatchGuess | None:
    """The batch of a training step on whole tensors of the namespace (``cell.whole_step``): the rows of
    the first input passed to a call (the model's), with every input of as many rows beside it (the
    targets), plain tensors only (no parameter, nothing that needs a gradient). The step is the cell's, or
    that of a notebook function it calls (``helpers``: its source read before the cell's). Reads tensors'
    shapes."""
    import torch

    step = cell.whole_step(source)
    for name, code in helpers if step is None else ():
        step = cell.whole_step(f"{code}\n\n{source}")
        if step is not None and step.function == name:
            break
        step = None
    if step is None:
        return None
    sliced = dict(step.sizes)  # bound by the step itself: `sliced_batch` reads those
    tensors = {
        name: value
        for name in step.inputs
        if name not in sliced
        and isinstance(value := namespace.get(step.outside(name)), torch.Tensor)
        and not isinstance(value, torch.nn.Parameter)
        and not value.requires_grad
        and value.dim() >= 1
    }

    def model(func: str) -> bool:
        # A loss module's first argument is the model's output, not the step's input.
        module = _module_at(namespace, step.outside(func))
        return module is not None and not isinstance(module, torch.nn.modules.loss._Loss)

    fed = next((n for func, n in step.fed if n in tensors and model(func)), None)
    if fed is None or tensors[fed].shape[0] < 2:
        return None
    rows = int(tensors[fed].shape[0])
    names = tuple(n for n in step.inputs if n in tensors and int(tensors[n].shape[0]) == rows)
    if step.span(names) is None:
        return None
    return BatchGuess("rows", rows, "rows", path=names)


def sliced_batch(source: str, namespace: Mapping) -> BatchGuess | None:
    """The batch of a training step that slices it off a tensor itself (``chunk = stream[it * mb:(it + 1)
    * mb]``, ``x, y = X[idx], Y[idx]`` with ``idx = torch.randperm(n)[:b]``): the rows of those slices,
    read from a literal of the cell or an int of the namespace (``mb``, ``cfg.b``, ``S["batch"]``), with
    the names bound to slices of as many rows. Read from plain dicts and instance dicts only."""
    step = cell.whole_step(source)
    if step is None or not step.sizes:
        return None
    text = ast.unparse(step.sizes[0][1])
    names = tuple(n for n, size in step.sizes if ast.unparse(size) == text)
    value = _count_of(step.sizes[0][1], source, namespace)
    if value is None or value < 2 or step.span(names) is None:
        return None
    return BatchGuess(text, value, "rows", path=names)


def _count_of(node: ast.expr, source: str, namespace: Mapping) -> int | None:
    """The int ``node`` (a literal, a name, an attribute or key chain) stands for: a name's one literal
    binding in the cell, else its value in the namespace; a chain read from dicts and instance dicts."""
    if isinstance(node, ast.Constant):
        return node.value if type(node.value) is int else None
    if isinstance(node, ast.Name):
        tree = cell.tree_of(source)
        bound = (
            [cell.int_literal(b.value) for b in cell.binding_sites(tree) if b.name == node.id] if tree else []
        )
        if bound:
            return bound[0] if len(bound) == 1 else None
        value = namespace.get(node.id)
        return value if type(value) is int else None
    if isinstance(node, ast.Attribute):
        owner, key = node.value, node.attr
    elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        owner, key = node.value, node.slice.value
    else:
        return None
    holder = _held_at(owner, namespace)
    value = holder.get(key) if type(holder) is dict else instance_dict(holder).get(key)
    return value if type(value) is int else None


def _held_at(node: ast.expr, namespace: Mapping) -> Any:
    """The object a name or attribute/key chain reaches, through dicts and instance dicts only."""
    if isinstance(node, ast.Name):
        return namespace.get(node.id)
    if isinstance(node, ast.Attribute):
        return instance_dict(_held_at(node.value, namespace)).get(node.attr)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        holder = _held_at(node.value, namespace)
        return holder.get(node.slice.value) if type(holder) is dict else None
    return None


def sliced_first(source: str, found: BatchGuess | None, sliced: BatchGuess | None) -> BatchGuess | None:
    """The batch guess to use: the step's own slices (``sliced``) before a batch found by its name or a
    setting of the cell (``found``), since a smaller number there would change the rows each slice takes
    and with them the samples of each optimizer step and of the whole loop; not before a setting of an
    object, a loader, a call's default, or a ``range`` loop stepping by that number (its rewrite keeps the
    samples already)."""
    if sliced is None:
        return found
    if found is None:
        return sliced
    if found.where in ("attribute", "object", "loader", "call", "option", "rows"):
        return found
    tree = cell.tree_of(source)
    steps = (
        {
            ast.unparse(n.iter.args[2])
            for n in ast.walk(tree)
            if isinstance(n, (ast.For, ast.AsyncFor))
            and isinstance(n.iter, ast.Call)
            and cell.dotted_name(n.iter.func) == "range"
            and len(n.iter.args) == 3
        }
        if tree is not None
        else set()
    )
    return found if sliced.name in steps else sliced


def _module_at(namespace: Mapping, dotted: str) -> Any:
    """The ``torch.nn.Module`` a dotted name of the cell calls (``model``, ``model.encoder``: submodules by
    attribute, read from ``_modules``, no property runs); None for anything else."""
    import torch

    first, *path = dotted.split(".")
    module = namespace.get(first)
    for attr in path:
        module = instance_dict(module).get("_modules", {}).get(attr) if module is not None else None
    return module if isinstance(module, torch.nn.Module) else None


def rows_call(source: str, namespace: Mapping, line: int | None) -> RowsCall | None:
    """The outermost expression on line ``line`` of the cell computed row by row from one tensor of the
    namespace with two rows or more, with a product in it: a model of the namespace (``model``, or a
    submodule by attribute: ``model.encoder``) called on it (``model(X_test)``), a matrix product or a
    distance (``torch.cdist(Xq, Xdb).argmin(dim=1)``), and the maps and reductions along other dimensions
    after them. Reads the modules' ``_modules`` and the tensor's shape only."""
    import torch

    tree = cell.tree_of(source)
    if tree is None or line is None:
        return None
    # A recurrent layer or attention returns a tuple, whose state a join along rows would get wrong.
    tuples = (torch.nn.RNNBase, torch.nn.MultiheadAttention)
    modules = set()
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and node.lineno <= line <= (node.end_lineno or node.lineno)):
            continue
        dotted = cell.dotted_name(node.func)
        module = _module_at(namespace, dotted)
        if module is not None and not isinstance(module, tuples):
            modules.add(dotted)
    expr = cell.rows_expression(source, line, frozenset(modules))
    inlined = (
        cell.inlined_product(source, line, modules=frozenset(modules))
        if expr is None or _bare(expr)
        else None
    )
    if inlined is not None:
        # The failing line binds a whole product that one later expression reduces row by row: that
        # expression, with the product written into it, runs on chunks (the rows call reads it there).
        source, _, read_line = inlined
        expr = cell.rows_expression(source, read_line, frozenset(modules))
    if expr is None:
        return None
    found = cell.row_wise(expr, frozenset(modules))
    assert found is not None
    value = namespace.get(found.spine.id)
    if found.splat:
        value = _rows_of_dict(value)
    if not isinstance(value, torch.Tensor) or value.dim() < 1 or value.shape[0] < 2:
        return None
    if found.module is None and value.requires_grad:
        return None  # each chunk's graph would stay with the joined output
    if found.module is None and _bare(expr):
        return None  # a product kept whole: the joined chunks are as large as it
    text = cell.SourceText(source)
    return RowsCall(
        found.module or "",
        found.spine.id,
        int(value.shape[0]),
        line if inlined is not None else expr.lineno,
        text.segment(expr),
        inlined[1] if inlined is not None else "",
    )


def tokens_dict(value: Any) -> dict | None:
    """The plain dict of a tokenizer's output: the value itself, or a ``BatchEncoding``'s own ``data``
    (read from its instance dict, no ``__getitem__``); None for anything else."""
    data = value if isinstance(value, dict) else instance_dict(value).get("data")
    return data if isinstance(data, dict) else None


def _rows_of_dict(value: Any) -> Any:
    """The first tensor of a dict of tensors with as many rows each (a tokenizer's output), read through
    ``dict.values`` (a ``BatchEncoding`` keeps its own dict in ``data``); None for anything else."""
    import torch

    data = tokens_dict(value)
    if not data:
        return None
    tensors = list(dict.values(data))
    if not all(type(t) is torch.Tensor and t.dim() >= 1 for t in tensors):
        return None
    return tensors[0] if len({t.shape[0] for t in tensors}) == 1 else None


def _bare(expr: ast.expr) -> bool:
    """Whether ``expr`` is a product and nothing after it (``X @ W``, ``torch.cdist(Q, K)``)."""
    return isinstance(expr, ast.BinOp) or (
        isinstance(expr, ast.Call) and cell.dotted_name(expr.func).rsplit(".", 1)[-1] in cell.ROW_PRODUCTS
    )


def default_batch(source: str, namespace: Mapping) -> BatchGuess | None:
    """The batch a notebook function takes by default where the cell calls it without passing it
    (``def train(model, epochs=1, bs=128)`` and ``train(enc)``): a parameter named like a batch with an int
    default. Read from the function's code object and defaults only (no call, no property)."""
    tree = cell.tree_of(source)
    if tree is None:
        return None
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name):
            continue
        func = namespace.get(call.func.id)
        if type(func) is not types.FunctionType or func.__module__ != "__main__":
            continue
        if any(isinstance(a, ast.Starred) for a in call.args) or any(k.arg is None for k in call.keywords):
            continue  # *args or **kwargs: which parameters they fill is not read from the source
        code = func.__code__
        positional = code.co_varnames[: code.co_argcount]
        given = func.__defaults__ or ()
        defaults = dict(zip(positional[len(positional) - len(given) :], given, strict=True))
        defaults.update(func.__kwdefaults__ or {})
        passed = set(positional[: len(call.args)]) | {k.arg for k in call.keywords}
        for name in cell.BATCH_NAMES:
            value = defaults.get(name)
            if name not in passed and type(value) is int and value >= 2:
                return BatchGuess(name, value, "call", path=(call.func.id, name))
    return None


def loader_batch(source: str, namespace: Mapping, line: int | None) -> BatchGuess | None:
    """The batch of a ``DataLoader`` made in an earlier cell that the cell's loop iterates over (the one
    around the failing line first): its ``batch_size``, read from its instance dict."""
    for name in cell.iterated_names(source, line):
        size = _sampler_batch(namespace.get(name))
        if size is not None:
            return BatchGuess(f"{name}.batch_size", size, "loader", path=(name,))
    return _handed_loader(source, namespace)


def _handed_loader(source: str, namespace: Mapping) -> BatchGuess | None:
    """The batch of a loader made earlier that the cell hands to a trainer's ``fit`` (Lightning's
    ``trainer.fit(model, train_loader)`` or ``train_dataloaders=``), which iterates it through its own
    wrappers: its ``batch_size``, with the trainer's ``accumulate_grad_batches`` beside it. Read from
    instance dicts only."""
    tree = cell.tree_of(source)
    if tree is None:
        return None
    # A trainer the cell makes itself is made again by every run: a setting of the old one is lost.
    made = {s.name for s in cell.binding_sites(tree) if s.keyword is None}
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "fit"
        ):
            continue
        owner = cell.dotted_name(node.func.value)
        held = namespace.get(owner) if owner not in made else None
        steps = instance_dict(held).get("accumulate_grad_batches")
        if type(steps) is not int or steps < 1:
            continue
        # The training loaders only: `val_dataloaders=` feeds the validation between epochs.
        for arg in [*node.args[1:2], *(k.value for k in node.keywords if k.arg == "train_dataloaders")]:
            if not isinstance(arg, ast.Name):
                continue
            size = _sampler_batch(namespace.get(arg.id))
            if size is not None:
                accumulation = (f"{owner}.accumulate_grad_batches", steps)
                return BatchGuess(f"{arg.id}.batch_size", size, "loader", accumulation, path=(arg.id,))
    return None


# Where a loader keeps what batches it: a DataLoader's batch sampler, and the loader a wrapper holds
# (accelerate's prepared loaders keep the DataLoader as `base_dataloader`, a sharded batch sampler the
# user's one as `batch_sampler`).
LOADER_LINKS = ("base_dataloader", "batch_sampler")


def _sampler_batch(value: Any, depth: int = 0) -> int | None:
    """The ``batch_size`` of the batch sampler that ``value`` (a DataLoader, a wrapper of one, a batch
    sampler) batches by, read from instance dicts through ``LOADER_LINKS``; None for anything else."""
    if value is None or depth > 3:
        return None
    attrs = instance_dict(value)
    size = attrs.get("batch_size")
    inner = [attrs[k] for k in LOADER_LINKS if attrs.get(k) is not None]
    for link in inner:
        found = _sampler_batch(link, depth + 1)
        if found is not None:
            return found
    # A batch sampler itself: its own count, with the sampler it draws from beside it.
    if depth > 0 and type(size) is int and size >= 1 and attrs.get("sampler") is not None:
        return size
    return None


def training_helpers(source: str, namespace: Mapping, depth: int = 2) -> tuple[tuple[str, str], ...]:
    """(name, source) of the notebook functions the cell calls, ``depth`` calls deep, whose code calls
    ``backward``: where a batch fix can write gradient accumulation when the cell itself has no loop."""
    import inspect
    import textwrap

    found: dict[str, str] = {}
    frontier = [d for d in cell.called_names(source) if "." not in d]
    for _ in range(depth):
        nxt: list[str] = []
        for name in frontier:
            func = namespace.get(name)
            if name in found or not isinstance(func, types.FunctionType) or func.__module__ != "__main__":
                continue
            names = _code_names(func.__code__)
            if "backward" in names:
                with contextlib.suppress(Exception):  # no source (exec'd code): nothing to rewrite
                    found[name] = textwrap.dedent(inspect.getsource(func))
            nxt.extend(n for n in names if n in namespace and n not in found)
        frontier = nxt
    return tuple(found.items())


def _code_of(value: Any) -> list[types.CodeType]:
    """The code objects behind a function, a bound method, or a class defined in the notebook."""
    kind = type(value)
    func = value.__func__ if kind is types.MethodType else value  # no getattr: no __getattr__ runs
    if type(func) is types.FunctionType:
        return [func.__code__]
    if issubclass(kind, type) and value.__module__ == "__main__":
        return [f.__code__ for f in vars(value).values() if isinstance(f, types.FunctionType)]
    return []


def _code_names(code: types.CodeType) -> set[str]:
    # co_names also holds attribute names: a superset of the globals, which errs on the side of keeping.
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


# --- the source, with the namespace -------------------------------------------------------------------


def _generates(source: str, namespace: Mapping) -> bool:
    if cell.generates(source):
        return True
    called = {d.split(".", 1)[0] for d in cell.called_names(source)}
    for name in called:
        value = namespace.get(name)
        mro = type(value).__mro__
        if any(c.__name__.endswith("Pipeline") and c.__module__.startswith("transformers") for c in mro):
            return True
    return False


def prompt_tokens(source: str, namespace: Mapping) -> int | None:
    """The length of the inputs of the cell's first ``.generate(...)``, where they name a tensor (or a
    mapping with ``input_ids``) in the namespace. None where the cell builds them itself."""
    return prompt_shape(source, namespace)[1]


def prompt_shape(source: str, namespace: Mapping) -> tuple[int | None, int | None]:
    """(prompts, tokens per prompt) of the inputs of the cell's first ``.generate(...)``, read like
    ``prompt_tokens``; (None, None) where not readable."""
    import torch

    for name, key in cell.generate_inputs(source):
        value = namespace.get(name)
        with contextlib.suppress(Exception):  # a mapping without the key, an object without a shape
            if key is not None:
                value = dict.get(value, key) if isinstance(value, dict) else value.data[key]
            if issubclass(type(value), torch.Tensor) and value.dim() >= 1:
                batch = int(value.shape[0]) if value.dim() >= 2 else 1
                return batch, int(value.shape[-1])
    return None, None


# --- the machine --------------------------------------------------------------------------------------


def _bf16_supported(device: str) -> bool:
    if not device.startswith("cuda"):
        return True
    import torch

    try:
        if not torch.cuda.is_initialized():
            return True
        # Emulated bf16 (pre-Ampere) saves memory but runs far slower: suggest fp16 there.
        return bool(torch.cuda.is_bf16_supported(including_emulation=False))
    except Exception:
        return True


def expandable_segments_on() -> bool:
    """Whether the caching allocator hands out expandable segments, from its live settings or the
    environment. Best effort, never raises."""
    settings = ""
    with contextlib.suppress(Exception):
        import torch

        getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        settings = getter() if getter is not None else ""
    for text in (settings, os.environ.get("PYTORCH_ALLOC_CONF"), os.environ.get("PYTORCH_CUDA_ALLOC_CONF")):
        match = re.search(r"expandable_segments\s*:\s*(\w+)", text or "")
        if match:
            return match.group(1).lower() == "true"
    return False


def read_machine(
    device: str, report: OOMReport | None
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, str, int], ...]]:
    """(other GPUs' free bytes, other processes on this GPU) through NVML; without NVML, free bytes by
    ``mem_get_info`` where CUDA is already initialised."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return (), ()

    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    other_gpus: list[tuple[int, int]] = []
    processes: list[tuple[int, str, int]] = []
    nvml = None
    with contextlib.suppress(Exception):
        from ..devices import read_devices

        nvml = read_devices()
    if nvml is not None and nvml.available:
        for gpu in nvml.devices:
            if gpu.cuda_index == index:
                processes = [(p.pid, p.name or "?", p.used) for p in gpu.processes if p.used]
            elif gpu.cuda_index is not None and gpu.free is not None:
                other_gpus.append((gpu.cuda_index, gpu.free))
    elif torch.cuda.is_initialized():
        with contextlib.suppress(Exception):
            for i in range(torch.cuda.device_count()):
                if i != index:
                    other_gpus.append((i, torch.cuda.mem_get_info(i)[0]))
    return tuple(other_gpus), _without_self(processes, report)


def process_owner(pid: int) -> tuple[str | None, str | None]:
    """(user, command line) of ``pid`` from ``/proc`` (Linux); None where it cannot be read, as for a host
    PID seen from inside a container."""
    import pwd

    user = command = None
    with contextlib.suppress(Exception):
        with open(f"/proc/{pid}/status") as f:
            uid = next(int(line.split()[1]) for line in f if line.startswith("Uid:"))
        user = pwd.getpwuid(uid).pw_name
    with contextlib.suppress(Exception), open(f"/proc/{pid}/cmdline", "rb") as f:
        command = f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:200] or None
    return user, command


def _without_self(processes: list[tuple[int, str, int]], report: OOMReport | None) -> tuple:
    own = os.getpid()
    if any(pid == own for pid, _, _ in processes):
        return tuple(p for p in processes if p[0] != own)
    # In a container NVML shows host PIDs: recognise this process by the memory the error says it uses.
    used = report.process_used if report else None
    if used:
        close = [p for p in processes if abs(p[2] - used) <= max(64 * 1024**2, used // 50)]
        if len(close) == 1:
            return tuple(p for p in processes if p is not close[0])
    return tuple(processes)
