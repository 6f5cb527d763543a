"""What the namespace holds on a device: the storages behind its tensors, modules and optimizers and behind
the containers and objects that hold them (one level deep), and the models among them.

Read-only and silent: instance ``__dict__``s only (no property, no ``__getattr__``), ``.grad`` only of leaf
tensors, nothing moved or called on user objects. Built for notebooks of ten thousand objects: a
``Reader`` works out once per scan what each type is and what each module holds, so each object costs a
dict lookup (benchmarks/scan_cost.py).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .findings import ModelInfo, OptimizerInfo

# IPython's own names: output history (`_`, `__`, `_3`, `Out`), input history (`_i`, `_ii`, `_i3`, `In`).
IPYTHON_NAME = re.compile(r"_+|_i+|_i?\d+|_[oid]h|In|Out|exit|quit|get_ipython|__\w+__")
# Every IPYTHON_NAME starts with `_` or is one of these: the pattern runs only on names that might match.
_IPYTHON_WORDS = frozenset({"In", "Out", "exit", "quit", "get_ipython"})
# A list of a hundred thousand tensors is exactly the leak worth finding; beyond that, stop counting.
_CONTAINER_ITEMS = 100_000
SKIPPED_TYPES = (
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
# Optimizer state per trainable parameter byte, by class name; an optimizer not listed counts as Adam.
_MOMENTS = {"SGD": None, "Adagrad": 1.0, "RMSprop": 1.0, "Adadelta": 2.0, "Adafactor": 0.1, "Lion": 1.0}

Storages = dict[int, int]  # storage data_ptr -> bytes: views of one storage count once

# What a type is to the scan, decided once per type and scan.
_SKIP, _TENSOR, _MODULE, _OPTIMIZER, _MAPPING, _SEQUENCE, _OBJECT = range(7)
_ALWAYS_SKIPPED = (*SKIPPED_TYPES, bool, type(None))
_BUILTIN_SEQUENCES = frozenset({list, tuple, set, frozenset})
_HOLDERS = frozenset({_TENSOR, _MODULE, _OPTIMIZER})


def ipython_name(name: str) -> bool:
    """Whether ``name`` is one of IPython's own (``_``, ``_3``, ``_i3``, ``Out``, ...)."""
    return (name[:1] == "_" or name in _IPYTHON_WORDS) and IPYTHON_NAME.fullmatch(name) is not None


@dataclass
class ModuleWalk:
    """A module's submodules, parameters and buffers (each once), read from the instance dicts that
    ``Module.modules()``/``parameters()``/``buffers()`` iterate, without their generators."""

    modules: list
    params: list
    buffers: list


class Reader:
    """One scan's reader of device memory on ``device`` (any device where None): caches what each type is
    and what each module holds. Not thread-safe; make one per scan."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.on = _device_test(device)
        self._walks: dict[int, ModuleWalk] = {}

    @staticmethod
    def kind(tp: type) -> int:
        """What ``tp`` is to the scan (one of the ``_SKIP`` ... ``_OBJECT`` codes), cached per type."""
        kind = _KINDS.get(tp)
        if kind is None:
            if len(_KINDS) > _KINDS_KEPT:
                _KINDS.clear()
            kind = _KINDS[tp] = _classify(tp)
        return kind

    def skipped(self, value: Any) -> bool:
        """Whether ``value`` can hold no device memory (a number, a string, a function, a class...)."""
        return self.kind(type(value)) == _SKIP

    def tensor(self, t: Any, into: Storages) -> None:
        """Add the storages of ``t`` (and, for a leaf, its ``.grad``) on the device to ``into``."""
        _tensor_into(t, self.on, into)

    def held_by(
        self, name: str, value: Any, modules: list | None = None, optimizers: list | None = None
    ) -> tuple[str, Storages]:
        """(kind, storages on the device) of one namespace value; modules and optimizers met on the way go
        to ``modules`` (with their names) and ``optimizers``."""
        modules = [] if modules is None else modules
        optimizers = [] if optimizers is None else optimizers
        storages: Storages = {}
        kind = self.kind(type(value))
        if kind == _TENSOR:
            _tensor_into(value, self.on, storages)
            return "tensor", storages
        if kind == _MODULE:
            modules.append((name, value))
            walk = self.walk(value)
            _tensors_into(itertools.chain(walk.params, walk.buffers), self.on, storages)
            return "module", storages
        if kind == _OPTIMIZER:
            optimizers.append(value)
            return "optimizer", optimizer_storages(value, self.device, self)
        if kind == _MAPPING:
            values: Iterable = dict.values(value)
            sized = True
        elif kind == _SEQUENCE:
            values = value
            sized = type(value) in _BUILTIN_SEQUENCES  # a subclass's own __len__ is not called
        elif kind == _OBJECT:
            # A Trainer or a pipeline holds its model and optimizer as attributes.
            values = instance_dict(value).values()
            sized = True
        else:
            return "container", storages
        if not sized or len(values) > _CONTAINER_ITEMS:
            values = itertools.islice(values, _CONTAINER_ITEMS)
        kinds, classify = _KINDS, self.kind
        named = False
        tensors = []
        for inner in values:
            inner_kind = kinds.get(type(inner))
            if inner_kind is None:
                inner_kind = classify(type(inner))
            if inner_kind == _TENSOR:
                tensors.append(inner)
            elif inner_kind in (_MODULE, _OPTIMIZER):
                named = True
        _tensors_into(tensors, self.on, storages)
        if named:
            # Names are only built for what is listed by name (models, optimizers): a second pass.
            self._named_inside(name, value, kind, storages, modules, optimizers)
        return "container", storages

    def _named_inside(
        self, name: str, value: Any, kind: int, storages: Storages, modules: list, optimizers: list
    ) -> None:
        """The modules and optimizers inside a container or object, read with their names
        (``trainer.model``, ``models[0]``, ``parts['encoder']``)."""
        if kind == _MAPPING:
            pairs: Iterable = dict.items(value)
            label = "{}[{!r}]"
        elif kind == _SEQUENCE:
            pairs = enumerate(value)
            label = "{}[{}]"
        else:
            pairs = instance_dict(value).items()
            label = "{}.{}"
        for key, inner in itertools.islice(pairs, _CONTAINER_ITEMS):
            if self.kind(type(inner)) in (_MODULE, _OPTIMIZER):
                storages.update(self.held_by(label.format(name, key), inner, modules, optimizers)[1])

    def walk(self, module: Any) -> ModuleWalk:
        """``module``'s submodules, parameters and buffers, each once (cached for this scan)."""
        found = self._walks.get(id(module))
        if found is not None:
            return found
        modules, params, buffers = [], [], []
        seen_modules, seen_tensors = set(), set()
        stack = [module]
        while stack:
            m = stack.pop()
            if id(m) in seen_modules:
                continue
            seen_modules.add(id(m))
            modules.append(m)
            attrs = instance_dict(m)
            for key, out in (("_parameters", params), ("_buffers", buffers)):
                for t in (attrs.get(key) or {}).values():
                    if t is not None and id(t) not in seen_tensors:
                        seen_tensors.add(id(t))
                        out.append(t)
            children = [c for c in (attrs.get("_modules") or {}).values() if c is not None]
            stack.extend(reversed(children))
        found = self._walks[id(module)] = ModuleWalk(modules, params, buffers)
        return found

    def params(self, module: Any, on_device: bool) -> Storages:
        """The storages of ``module``'s parameters (on the device only with ``on_device``)."""
        storages: Storages = {}
        for p in self.walk(module).params:
            if not on_device or self.on(p):
                with contextlib.suppress(Exception):
                    storage = p.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
        return storages


# type -> what it is to the scan; types stay few (a notebook's classes), so the cache is global and capped.
_KINDS: dict[type, int] = {}
_KINDS_KEPT = 10_000
_TORCH_TYPES: tuple[type, type, type] | None = None  # Tensor, Module, Optimizer (torch imported lazily)


def _classify(tp: type) -> int:
    global _TORCH_TYPES
    if _TORCH_TYPES is None:
        import torch

        _TORCH_TYPES = (torch.Tensor, torch.nn.Module, torch.optim.Optimizer)
    tensor, module, optimizer = _TORCH_TYPES
    try:
        if issubclass(tp, _ALWAYS_SKIPPED):
            return _SKIP
        if issubclass(tp, tensor):
            return _TENSOR
        if issubclass(tp, module):
            return _MODULE
        if issubclass(tp, optimizer):
            return _OPTIMIZER
        if issubclass(tp, dict):
            return _MAPPING
        if issubclass(tp, (list, tuple, set, frozenset)):
            return _SEQUENCE
    except Exception:  # a type whose metaclass refuses issubclass: nothing to read in it
        return _SKIP
    return _OBJECT


def is_leaf(t: Any) -> bool:
    """``t.is_leaf``, never raising: a view of a multi-output op (``mu, logvar = h.chunk(2)``) whose base was
    written in place cannot rebuild its ``grad_fn`` and raises on ``is_leaf``; it has a graph, so it is no
    leaf (seen on an H100: a VAE's namespace refused every trial)."""
    try:
        return t.is_leaf
    except RuntimeError:
        return False


def has_graph(t: Any) -> bool:
    """Whether ``t`` carries an autograd graph, never raising (see ``is_leaf``)."""
    try:
        return t.grad_fn is not None
    except RuntimeError:
        return True


def _tensor_into(t: Any, on: Any, into: Storages) -> None:
    _tensors_into((t,), on, into)


def _tensors_into(tensors: Iterable, on: Any, into: Storages) -> None:
    """Add the storages of ``tensors`` (and, for leaves, their ``.grad``) that ``on`` accepts to ``into``."""
    for t in tensors:
        # `.grad` of a non-leaf tensor warns and is always None.
        grad = t.grad if is_leaf(t) else None
        if grad is not None:
            _tensors_into((grad,), on, into)
        if not on(t):
            continue
        try:
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
        except Exception:  # sparse and wrapper tensors have no plain storage: count their elements
            ptr, size = id(t), t.numel() * t.element_size()
        if size:
            into[ptr] = size


def _device_test(device: Any) -> Any:
    """A function telling whether a tensor is on ``device`` (every tensor where None)."""
    if device is None:
        return lambda t: True
    # `t.device` builds a device object (~1.6 us); these flags cost a tenth of that, and a scan of a big
    # namespace asks for every tensor (benchmarks/scan_cost.py).
    if device.type == "cpu":
        return lambda t: t.is_cpu
    if device.type == "cuda":
        index = device.index
        if index is None:
            return lambda t: t.is_cuda
        return lambda t: t.is_cuda and t.get_device() == index
    return lambda t: t.device.type == device.type and (device.index is None or t.device.index == device.index)


def held_by(
    name: str, value: Any, device: Any, modules: list | None = None, optimizers: list | None = None
) -> tuple[str, Storages]:
    """(kind, storages on ``device``) of one namespace value; modules and optimizers met on the way go to
    ``modules`` and ``optimizers``. Reads instance ``__dict__``s only: no property, no ``__getattr__``."""
    return Reader(device).held_by(name, value, modules, optimizers)


def namespace_holdings(
    namespace: Mapping, reader: Reader
) -> tuple[dict[str, tuple[str, Storages]], list[tuple[str, Any]], list[Any]]:
    """(name → (kind, storages) of each namespace value that holds memory on the reader's device, the
    modules met with their names, the optimizers met). IPython's own names are left out."""
    held: dict[str, tuple[str, Storages]] = {}
    modules: list[tuple[str, Any]] = []
    optimizers: list[Any] = []
    kinds, classify, on = _KINDS, reader.kind, reader.on
    for name, value in list(namespace.items()):
        kind = kinds.get(type(value))
        if kind is None:
            kind = classify(type(value))
        if kind == _SKIP or ((name[:1] == "_" or name in _IPYTHON_WORDS) and IPYTHON_NAME.fullmatch(name)):
            continue
        try:
            if kind == _TENSOR:  # the common cases first, without a call each
                storages: Storages = {}
                _tensor_into(value, on, storages)
                found_kind = "tensor"
            elif kind == _OBJECT and not _may_hold(instance_dict(value).values()):
                continue
            else:
                found_kind, storages = reader.held_by(name, value, modules, optimizers)
        except Exception:  # an exotic object must not stop the diagnosis
            continue
        if storages:
            held[name] = (found_kind, storages)
    return held, modules, optimizers


def _may_hold(values: Iterable) -> bool:
    """Whether an object's attribute values include a tensor, a module or an optimizer."""
    kinds = _KINDS
    for inner in values:
        kind = kinds.get(type(inner))
        if kind is None or kind in _HOLDERS:
            return True
    return False


def instance_dict(value: Any) -> dict:
    """``value.__dict__`` read without calling ``__getattr__`` or a property; {} where there is none."""
    try:
        attrs = object.__getattribute__(value, "__dict__")
    except Exception:
        return {}
    return attrs if type(attrs) is dict else {}


def tensor_storages(t: Any, device: Any = None, into: Storages | None = None) -> Storages:
    """The storages behind ``t`` (and, for a leaf, its ``.grad``) on ``device`` (any device when None)."""
    into = {} if into is None else into
    _tensor_into(t, _device_test(device), into)
    return into


def optimizer_storages(optimizer: Any, device: Any, reader: Reader | None = None) -> Storages:
    """The storages of ``optimizer``'s state tensors on ``device``."""
    reader = reader or Reader(device)
    storages: Storages = {}
    for state in optimizer.state.values():
        for value in state.values() if isinstance(state, dict) else ():
            if reader.kind(type(value)) == _TENSOR:
                reader.tensor(value, storages)
    return storages


def optimizer_infos(namespace: Mapping, reader: Reader) -> tuple[OptimizerInfo, ...]:
    """The optimizers bound to names in ``namespace``, with what their step allocates on the reader's
    device. Reads their ``param_groups`` (a plain attribute) and the parameters' sizes only."""
    found = []
    for name, value in list(namespace.items()):
        if reader.kind(type(value)) != _OPTIMIZER or IPYTHON_NAME.fullmatch(name):
            continue
        with contextlib.suppress(Exception):
            groups, kind = _param_groups(value, reader)
            sizes = [
                p.numel() * p.element_size() for g in groups for p in g.get("params", ()) if reader.on(p)
            ]
            if sizes:
                foreach = any(_steps_foreach(g, reader) for g in groups)
                found.append(OptimizerInfo(name, kind, foreach, sum(sizes), max(sizes)))
    return tuple(found)


def _param_groups(optimizer: Any, reader: Reader) -> tuple[list, str]:
    """(an optimizer's parameter groups, from its instance dict, and its class name); for a wrapper that
    serves them through a property (accelerate's ``AcceleratedOptimizer``, Lightning's
    ``LightningOptimizer``), the wrapped optimizer's."""
    found = instance_dict(optimizer)
    if "param_groups" in found:
        return found["param_groups"] or [], type(optimizer).__name__
    for key in ("optimizer", "_optimizer"):
        inner = found.get(key)
        if inner is not None and reader.kind(type(inner)) == _OPTIMIZER:
            return instance_dict(inner).get("param_groups") or [], type(inner).__name__
    return [], type(optimizer).__name__


def _steps_foreach(group: Mapping, reader: Reader) -> bool:
    """Whether a parameter group's step runs torch's foreach implementation: asked for, or left to torch
    (None), which picks it where every parameter is a tensor on a GPU; never beside ``fused`` or
    ``differentiable``, nor for an optimizer without the setting."""
    if "foreach" not in group or group.get("fused") or group.get("differentiable"):
        return False
    if group["foreach"] is not None:
        return bool(group["foreach"])
    params = group.get("params", ())
    return bool(params) and all(getattr(p, "is_cuda", False) for p in params if reader.on(p))


def optimizer_params(optimizer: Any) -> list:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _moments(optimizer: Any) -> float:
    """Optimizer state per trainable parameter byte: Adam's two moments, SGD's momentum buffer or none."""
    name = type(optimizer).__name__
    if name == "SGD":
        group = optimizer.param_groups[0] if optimizer.param_groups else {}
        return 1.0 if group.get("momentum", 0) else 0.0
    return _MOMENTS.get(name) or 2.0


def model_infos(
    modules: list,
    optimizers: list,
    reader: Reader,
    source: str,
    checkpointing: bool,
    trains: bool,
) -> tuple[ModelInfo, ...]:
    """One ModelInfo per distinct model on the reader's device (or read by ``source``); a submodule of a
    model already listed (``layer = model.layers[0]``) is not listed again."""
    seen: dict[int, str] = {}
    for name, module in sorted(modules, key=lambda m: (not m[0].isidentifier(), len(m[0]))):
        seen.setdefault(id(module), name)
    by_id = {id(m): m for _, m in modules}
    moments: dict[int, float] = {}
    for opt in optimizers:
        with contextlib.suppress(Exception):
            factor = _moments(opt)
            for p in optimizer_params(opt):
                moments[p.untyped_storage().data_ptr()] = factor
    listed: list[ModelInfo] = []
    covered: set[int] = set()
    every = {key: reader.params(by_id[key], on_device=False) for key in seen}
    totals = {key: sum(params.values()) for key, params in every.items()}
    for key, name in sorted(seen.items(), key=lambda s: -totals[s[0]]):
        module = by_id[key]
        params = every[key]
        if not params or set(params) <= covered:
            continue
        top = re.split(r"[.\[]", name, maxsplit=1)[0]
        on_device = any(map(reader.on, reader.walk(module).params))
        if not (on_device or re.search(rf"\b{re.escape(top)}\b", source)):
            continue
        covered.update(params)
        found = [moments[p] for p in params if p in moments]
        listed.append(
            model_info(name, module, totals[key], trains, checkpointing, max(found, default=None), reader)
        )
    return tuple(listed)


_MODE_LAYERS: tuple[type, ...] = ()  # dropout and batch norm, set on first use (torch imported lazily)


def model_info(
    name: str,
    module: Any,
    param_bytes: int,
    trains: bool,
    checkpointing: bool,
    moments: float | None,
    reader: Reader | None = None,
) -> ModelInfo:
    """What the findings need of one model: its weights' bytes and dtype, whether it trains, checkpoints,
    has dropout or batch norm."""
    global _MODE_LAYERS
    _MODE_LAYERS = _MODE_LAYERS or _mode_layers()
    walk = (reader or Reader()).walk(module)
    dtypes: dict[Any, int] = {}
    trainable = 0
    for p in walk.params:
        size = p.numel() * p.element_size()
        dtypes[p.dtype] = dtypes.get(p.dtype, 0) + size
        trainable += size if p.requires_grad else 0
    hf, supports = _model_type_facts(type(module))
    attrs = instance_dict(module)
    dtype = max(dtypes, key=dtypes.__getitem__) if dtypes else None
    return ModelInfo(
        name=name,
        param_bytes=param_bytes,
        dtype=str(dtype).removeprefix("torch.") if dtype is not None else "float32",
        is_hf=hf,
        supports_checkpointing=supports,
        checkpointing_on=checkpointing or _checkpointing_on(walk.modules),
        is_training=bool(attrs.get("training", False) and trainable and trains),
        trainable_bytes=trainable,
        moments=moments,
        train_mode=bool(attrs.get("training", False)),
        mode_layers=any(issubclass(type(m), _MODE_LAYERS) for m in walk.modules[:_CONTAINER_ITEMS]),
    )


@functools.lru_cache(maxsize=1024)
def _model_type_facts(tp: type) -> tuple[bool, bool]:
    """(a transformers or peft model, supports gradient checkpointing) of a model class."""
    hf = any(c.__module__.startswith(("transformers.", "peft.")) for c in tp.__mro__)
    supports = any("gradient_checkpointing_enable" in vars(c) for c in tp.__mro__) and bool(
        tp.__dict__.get("supports_gradient_checkpointing", True)
    )
    return hf, supports


def _mode_layers() -> tuple[type, ...]:
    import torch

    nn = torch.nn
    return (nn.modules.dropout._DropoutNd, nn.modules.batchnorm._BatchNorm)


def _checkpointing_on(modules: Iterable) -> bool:
    # transformers marks each block that checkpoints with `gradient_checkpointing = True`.
    return any(instance_dict(m).get("gradient_checkpointing") is True for m in modules)


def checkpointing_enabled(module: Any) -> bool:
    """Whether a model checkpoints its blocks: transformers marks each block that does with
    ``gradient_checkpointing = True`` (read from instance dicts: no property runs)."""
    with contextlib.suppress(Exception):
        return _checkpointing_on(Reader().walk(module).modules)
    return False
