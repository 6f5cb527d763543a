"""Gather what the diagnosis needs from the live kernel: the namespace's device memory and models, the
batch size, generation settings, and the machine (allocator settings, other GPUs, other processes).

The effectful edge of ``diagnose``: imports torch inside its functions, only reads the namespace
(``free_names`` is the one function that deletes, when asked), and never raises for a figure it cannot
read: it leaves that figure out.
"""

from __future__ import annotations

import ast
import contextlib
import os
import re
import sys
import types
import warnings
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from .cellrun import CellRun
from .diagnose import DiagnosisContext, Leftover, ModelInfo
from .oom import OOMReport
from .release import collect
from .remedies import CHECKPOINTING_IN_SOURCE
from .rewrite import ACCUMULATION_NAMES, find_batch, names_read

# IPython's own names: output history (`_`, `__`, `_3`, `Out`), input history (`_i`, `_ii`, `_i3`, `In`).
_IPYTHON_NAME = re.compile(r"_+|_i+|_i?\d+|_[oid]h|In|Out|exit|quit|get_ipython|__\w+__")
# A list of a hundred thousand tensors is exactly the leak worth finding; beyond that, stop counting.
_CONTAINER_ITEMS = 100_000
_SKIPPED_TYPES = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    str,
    bytes,
    int,
    float,
)
_TRAINS = re.compile(r"\.backward\(|\.train\(|\.step\(|\bTrainer\(|\bfit\(")
_GENERATES = re.compile(r"\.generate\(|\bpipeline\(")
_TRUNCATION = re.compile(r"\btruncation\s*=\s*(?!False\b|None\b)")
_AUTOCAST = re.compile(r"\bautocast\(|\b(bf16|fp16)\s*=\s*True\b")

Storages = dict[int, int]  # storage data_ptr -> bytes: views of one storage count once


def gather_context(
    run: CellRun, namespace: dict, report: OOMReport | None, batch_name: str | None = None
) -> DiagnosisContext:
    """Build the ``DiagnosisContext`` of ``run`` from the user namespace and the machine.

    Reads tensors, modules and optimizers in ``namespace`` (one level into containers and objects), asks
    NVML for other GPUs and processes, and reads the allocator settings. Does not initialise CUDA.
    """
    import torch

    device = torch.device(run.device)
    source = run.source
    change = (run.change or "").lower()
    checkpointing = "checkpointing" in change or bool(CHECKPOINTING_IN_SOURCE.search(source))
    leftovers, models = _holdings(namespace, device, source, checkpointing)
    ints = {k: v for k, v in namespace.items() if type(v) is int and not _IPYTHON_NAME.fullmatch(k)}
    other_gpus, processes = _machine(device, report)
    return DiagnosisContext(
        source=source,
        timeline=run.timeline,
        before_allocated=run.before_allocated,
        capacity=run.capacity,
        limit=run.limit,
        device=run.device,
        leftovers=leftovers,
        batch=find_batch(source, ints, batch_name),
        models=models,
        other_gpus=other_gpus,
        processes=processes,
        generation=_generates(source, namespace),
        max_new_tokens=_keyword_int(source, "max_new_tokens", ints),
        num_beams=_keyword_int(source, "num_beams", ints),
        prompt_tokens=prompt_tokens(source, namespace),
        has_truncation=bool(_TRUNCATION.search(source)),
        # A retry that ran under autocast or expandable segments has them switched off again by now.
        autocast_on="autocast" in change or bool(_AUTOCAST.search(source)),
        bf16_supported=_bf16_supported(device),
        async_error=report is not None and report.source == "driver",
        expandable_segments_on="expandable segments" in change or expandable_segments_on(),
        grad_accum_name=next((n for n in ACCUMULATION_NAMES if re.search(rf"\b{n}\b", source)), None),
    )


def free_names(namespace: dict, names: Iterable[str], measure: Callable[[], int] | None = None) -> int:
    """Delete ``names`` from ``namespace``, collect garbage, empty the CUDA cache (only if CUDA is already
    initialised) and return the bytes given back: ``measure()`` before minus after, never negative.

    ``measure`` defaults to ``torch.cuda.memory_allocated`` when CUDA is initialised, else 0. Memory that
    something else still references (IPython's ``Out``, another name) stays.
    """
    measure = measure or _cuda_allocated
    before = measure()
    for name in names:
        namespace.pop(name, None)
    collect()
    return max(0, before - measure())


def _cuda_allocated() -> int:
    torch = sys.modules.get("torch")
    return torch.cuda.memory_allocated() if torch is not None and torch.cuda.is_initialized() else 0


# --- the namespace ------------------------------------------------------------------------------------


def _holdings(
    namespace: dict, device: Any, source: str, checkpointing: bool = False
) -> tuple[tuple[Leftover, ...], tuple[ModelInfo, ...]]:
    """Leftovers (largest first; a storage shared by several names counts for the largest holder only)
    and the models in the namespace."""
    import torch

    held: dict[str, tuple[str, Storages]] = {}
    modules: list[tuple[str, torch.nn.Module]] = []
    for name, value in list(namespace.items()):
        if _IPYTHON_NAME.fullmatch(name) or isinstance(value, _SKIPPED_TYPES):
            continue
        with contextlib.suppress(Exception):  # an exotic object must not stop the diagnosis
            kind, storages = _held_by(name, value, device, modules)
            if storages:
                held[name] = (kind, storages)
    claimed: set[int] = set()
    leftovers = []
    in_use = _used_by_calls(source, namespace)
    for name, (kind, storages) in sorted(held.items(), key=lambda h: -sum(h[1][1].values())):
        mine = sum(n for ptr, n in storages.items() if ptr not in claimed)
        claimed.update(storages)
        if mine:
            leftovers.append(Leftover(name, kind, mine, in_use=name in in_use))
    trains = bool(_TRAINS.search(source)) or "backward" in _names_in_calls(source, namespace)
    return tuple(leftovers), _models(modules, device, source, checkpointing, trains)


def _used_by_calls(source: str, namespace: dict, depth: int = 3) -> set[str]:
    """Globals read by the notebook's own functions and classes that the cell uses, ``depth`` calls
    deep: ``train()`` defined in an earlier cell reads ``model`` although the cell never names it."""
    return {n for n in _names_in_calls(source, namespace, depth) if n in namespace}


def _names_in_calls(source: str, namespace: dict, depth: int = 3) -> set[str]:
    """Every name (globals and attributes) the notebook functions the cell calls use, ``depth`` deep:
    a ``train()`` from an earlier cell that calls ``loss.backward()`` makes the cell a training cell."""
    names: set[str] = set()
    frontier = [n for n in names_read(source) if n in namespace]
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


def _code_of(value: Any) -> list[types.CodeType]:
    """The code objects behind a function, a bound method, or a class defined in the notebook."""
    func = getattr(value, "__func__", value)
    if isinstance(func, types.FunctionType):
        return [func.__code__]
    if isinstance(value, type) and value.__module__ == "__main__":
        return [f.__code__ for f in vars(value).values() if isinstance(f, types.FunctionType)]
    return []


def _code_names(code: types.CodeType) -> set[str]:
    # co_names also holds attribute names: a superset of the globals, which errs on the side of keeping.
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _code_names(const)
    return names


def drop_bound_by_cell(namespace: dict, ids_before: dict[str, int], device: str) -> list[tuple[str, int]]:
    """Delete the names a failed cell bound (new, or bound to another object) to values that hold memory
    on ``device``; returns (name, bytes) of each. They are the failed attempt's memory as much as its
    frames are, and a retry binds them again."""
    import torch

    where = torch.device(device)
    dropped = []
    for name, value in list(namespace.items()):
        if (
            ids_before.get(name) == id(value)
            or _IPYTHON_NAME.fullmatch(name)
            or isinstance(value, _SKIPPED_TYPES)
        ):
            continue
        with contextlib.suppress(Exception):
            _, storages = _held_by(name, value, where, [])
            if isinstance(value, torch.optim.Optimizer):
                # An optimizer without state yet still keeps its model's parameters alive.
                storages = {**storages, **_tensor_storages_of(_optimizer_params(value), where)}
            if storages:
                del namespace[name]
                dropped.append((name, sum(storages.values())))
    return dropped


def _optimizer_params(optimizer: Any) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _tensor_storages_of(tensors: list, device: Any) -> Storages:
    storages: Storages = {}
    for t in tensors:
        _tensor_storages(t, device, storages)
    return storages


def _held_by(name: str, value: Any, device: Any, modules: list) -> tuple[str, Storages]:
    """(kind, storages on ``device``) of one namespace value; modules met on the way go to ``modules``."""
    import torch

    if isinstance(value, torch.Tensor):
        return "tensor", _tensor_storages(value, device)
    if isinstance(value, torch.nn.Module):
        modules.append((name, value))
        return "module", _module_storages(value, device)
    if isinstance(value, torch.optim.Optimizer):
        return "optimizer", _optimizer_storages(value, device)
    if isinstance(value, dict):
        items = [(f"{name}[{k!r}]", v) for k, v in _first(value.items())]
    elif isinstance(value, (list, tuple, set, frozenset)):
        items = [(f"{name}[{i}]", v) for i, v in enumerate(_first(value))]
    else:
        # A Trainer or a pipeline holds its model and optimizer as attributes.
        attrs = vars(value) if hasattr(value, "__dict__") and not isinstance(value, type) else {}
        items = [(f"{name}.{k}", v) for k, v in _first(attrs.items()) if isinstance(k, str)]
    storages: Storages = {}
    for inner_name, inner in items:
        if isinstance(inner, (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)):
            storages.update(_held_by(inner_name, inner, device, modules)[1])
    return "container", storages


def _first(items: Iterable) -> Iterable:
    for i, item in enumerate(items):
        if i >= _CONTAINER_ITEMS:
            return
        yield item


def _tensor_storages(t: Any, device: Any = None, into: Storages | None = None) -> Storages:
    """The storages behind ``t`` (and its ``.grad``) on ``device`` (any device when None)."""
    into = {} if into is None else into
    for tensor in (t, getattr(t, "grad", None)):
        if tensor is None or (device is not None and not _on(tensor, device)):
            continue
        try:
            storage = tensor.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
        except Exception:  # sparse and wrapper tensors have no plain storage: count their elements
            ptr, size = id(tensor), tensor.numel() * tensor.element_size()
        if size:
            into[ptr] = size
    return into


def _on(t: Any, device: Any) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _module_storages(module: Any, device: Any) -> Storages:
    storages: Storages = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        _tensor_storages(tensor, device, storages)
    return storages


def _optimizer_storages(optimizer: Any, device: Any) -> Storages:
    import torch

    storages: Storages = {}
    for state in optimizer.state.values():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor):
                _tensor_storages(value, device, storages)
    return storages


def _models(
    modules: list, device: Any, source: str, checkpointing: bool, trains: bool
) -> tuple[ModelInfo, ...]:
    """One ModelInfo per distinct model on ``device`` (or read by the cell); a submodule of a model
    already listed (``layer = model.layers[0]``) is not listed again."""
    seen: dict[int, str] = {}
    for name, module in sorted(modules, key=lambda m: (not m[0].isidentifier(), len(m[0]))):
        seen.setdefault(id(module), name)
    by_id = {id(m): m for _, m in modules}
    listed: list[ModelInfo] = []
    covered: set[int] = set()
    ranked = sorted(seen.items(), key=lambda s: -sum(_params(by_id[s[0]], None).values()))
    for key, name in ranked:
        module = by_id[key]
        params = _params(module, None)
        on_device = _params(module, device)
        top = re.split(r"[.\[]", name, maxsplit=1)[0]
        if (
            not params
            or set(params) <= covered
            or not (on_device or re.search(rf"\b{re.escape(top)}\b", source))
        ):
            continue
        covered.update(params)
        listed.append(_model_info(name, module, sum(params.values()), trains, checkpointing))
    return tuple(listed)


def _params(module: Any, device: Any) -> Storages:
    storages: Storages = {}
    for p in module.parameters():
        if device is None or _on(p, device):
            with contextlib.suppress(Exception):
                storages[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return storages


def _model_info(name: str, module: Any, param_bytes: int, trains: bool, checkpointing: bool) -> ModelInfo:
    dtypes: Counter[str] = Counter()
    requires_grad = False
    for p in module.parameters():
        dtypes[str(p.dtype).removeprefix("torch.")] += p.numel() * p.element_size()
        requires_grad = requires_grad or p.requires_grad
    hf = any(c.__module__.startswith(("transformers.", "peft.")) for c in type(module).__mro__)
    return ModelInfo(
        name=name,
        param_bytes=param_bytes,
        dtype=dtypes.most_common(1)[0][0] if dtypes else "float32",
        is_hf=hf,
        supports_checkpointing=hasattr(module, "gradient_checkpointing_enable")
        and bool(getattr(module, "supports_gradient_checkpointing", True)),
        checkpointing_on=checkpointing or checkpointing_enabled(module),
        is_training=bool(module.training and requires_grad and trains),
    )


# --- the source ---------------------------------------------------------------------------------------


def _generates(source: str, namespace: dict) -> bool:
    if _GENERATES.search(source):
        return True
    for name, value in namespace.items():
        mro = type(value).__mro__
        is_pipeline = any(
            c.__name__.endswith("Pipeline") and c.__module__.startswith("transformers") for c in mro
        )
        if is_pipeline and name.isidentifier() and re.search(rf"\b{name}\s*\(", source):
            return True
    return False


def _keyword_int(source: str, keyword: str, ints: dict[str, int]) -> int | None:
    """The value of ``keyword=`` in the cell: a literal, or a variable holding an int."""
    match = re.search(rf"\b{keyword}\s*=\s*(\w+)", source)
    if not match:
        return None
    value = match.group(1)
    return int(value) if value.isdigit() else ints.get(value)


def prompt_tokens(source: str, namespace: dict) -> int | None:
    """The length of the inputs of the cell's first ``.generate(...)``: its first argument or its
    ``input_ids=`` / ``inputs=``, or the ``input_ids`` of ``**encoding``, where that names a tensor in the
    namespace. None where the cell builds them itself or does not parse."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "generate":
            continue
        given = [*node.args[:1], *(k.value for k in node.keywords if k.arg in ("input_ids", "inputs"))]
        spread = [k.value for k in node.keywords if k.arg is None]
        for expr, key in [(e, None) for e in given] + [(e, "input_ids") for e in spread]:
            if not isinstance(expr, ast.Name):
                continue
            value = namespace.get(expr.id)
            with contextlib.suppress(Exception):  # a mapping without the key, an object without a shape
                value = value[key] if key else value
                shape = value.shape
                if len(shape) >= 1:
                    return int(shape[-1])
        return None
    return None


# --- the machine --------------------------------------------------------------------------------------


def checkpointing_enabled(module: Any) -> bool:
    """Whether an HF model checkpoints; transformers 5 renamed the flag (the old one warns)."""
    for flag in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if flag in dir(type(module)):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return bool(getattr(module, flag, False))
    return False


def _bf16_supported(device: Any) -> bool:
    if device.type != "cuda":
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


def _machine(
    device: Any, report: OOMReport | None
) -> tuple[tuple[tuple[int, int], ...], tuple[tuple[int, str, int], ...]]:
    """(other GPUs' free bytes, other processes on this GPU) through NVML; without NVML, free bytes by
    ``mem_get_info`` where CUDA is already initialised."""
    if device.type != "cuda":
        return (), ()
    import torch

    index = device.index
    if index is None:
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    other_gpus: list[tuple[int, int]] = []
    processes: list[tuple[int, str, int]] = []
    nvml = None
    with contextlib.suppress(Exception):
        from .devices import read_devices

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
