"""Which tensors are parameters, gradients, optimizer state or a KV cache: read from the namespace and the
frames of a failed cell, and from each optimizer at its steps.

Read-only, like ``diagnosis.context``: instance ``__dict__``s only (no property, no ``__getattr__``),
``.grad`` of leaf tensors only. A ``key`` function maps a tensor to the recorder's key of its storage (the
CPU tracker's storage key, or the CUDA block address) and returns None for a tensor on another device.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Mapping
from types import TracebackType
from typing import Any

from ...categories import Observation

Key = Callable[[Any], "int | None"]
# Names a KV cache goes by where it is not a transformers ``Cache`` object.
_CACHE_NAMES = {"past_key_values", "past_key_value", "kv_cache", "layer_past", "present"}


def frames_of(tb: TracebackType | None) -> list[Mapping]:
    """The locals of every frame in ``tb`` (the failed cell's functions), innermost last."""
    found = []
    while tb is not None:
        with contextlib.suppress(Exception):
            found.append(tb.tb_frame.f_locals)
        tb = tb.tb_next
    return found


def observe(spaces: Iterable[Mapping], key: Key, clock: float) -> list[Observation]:
    """Every parameter, buffer, gradient, optimizer state tensor and KV cache tensor reachable from the
    mappings in ``spaces`` (the namespace, frame locals), one level into containers and objects."""
    from ...diagnosis.context import IPYTHON_NAME, SKIPPED_TYPES, held_by

    modules: list[tuple[str, Any]] = []
    optimizers: list[Any] = []
    caches: list[tuple[str, Any]] = []
    for space in spaces:
        for name, value in list(space.items()):
            if not isinstance(name, str) or IPYTHON_NAME.fullmatch(name) or isinstance(value, SKIPPED_TYPES):
                continue
            with contextlib.suppress(Exception):  # an exotic object must not stop the report
                held_by(name, value, None, modules, optimizers)
                caches.extend(_caches(name, value))
    seen: list[Observation] = []
    for name, module in _unique(modules):
        with contextlib.suppress(Exception):
            for pname, p in module.named_parameters():
                _add(seen, key, clock, p, "parameters", f"{name}.{pname}")
                if p.grad is not None:
                    _add(seen, key, clock, p.grad, "gradients", f"{name}.{pname}.grad")
            for bname, buf in module.named_buffers():
                _add(seen, key, clock, buf, "parameters", f"{name}.{bname}")
    for optimizer in _unique_values(optimizers):
        seen.extend(observe_optimizer(optimizer, key, clock, state=True))
    for name, cache in caches:
        for i, t in enumerate(_tensors_in(cache, depth=4)):
            _add(seen, key, clock, t, "kv_cache", f"{name}[{i}]")
    return seen


def observe_optimizer(optimizer: Any, key: Key, clock: float, state: bool) -> list[Observation]:
    """The gradients of ``optimizer``'s parameters (and, with ``state``, the parameters and the state)."""
    import torch

    seen: list[Observation] = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if state:
                _add(seen, key, clock, p, "parameters", None)
            if p.grad is not None:
                _add(seen, key, clock, p.grad, "gradients", None)
    if state:
        for slots in optimizer.state.values():
            for slot, value in slots.items() if isinstance(slots, dict) else ():
                if isinstance(value, torch.Tensor):
                    _add(seen, key, clock, value, "optimizer", f"optimizer state {slot}")
    return seen


class StepRoles:
    """Gradients seen at each optimizer step (and, at an optimizer's first step, its parameters and
    state): the roles of tensors that no longer exist when the cell ends, for the breakdown at the peak.
    A step's (gradient key, parameter key) pairs are kept as one tuple, shared between steps that reuse the
    same storages; the parameters' keys name the gradients once the namespace is read."""

    def __init__(self, key: Key, clock: Callable[[], float]) -> None:
        self.key = key
        self.clock = clock
        self.steps: list[tuple[float, tuple[tuple[int, int | None], ...]]] = []
        self.first: list[Observation] = []
        self._known: set[int] = set()
        self._interned: dict[tuple, tuple] = {}

    def __call__(self, optimizer: Any, *_: Any) -> None:
        now = self.clock()
        if id(optimizer) not in self._known:
            self._known.add(id(optimizer))
            self.first.extend(observe_optimizer(optimizer, self.key, now, state=True))
        keys = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                g = p.grad
                if g is not None:
                    k = self.key(g)
                    if k is not None:
                        keys.append((k, self.key(p)))
        grads = tuple(keys)
        self.steps.append((now, self._interned.setdefault(grads, grads)))

    def around(self, clock: float, names: Iterable[Observation] = ()) -> list[Observation]:
        """Observations of the last step before ``clock`` and the first after it: the only steps that can
        see a gradient alive at ``clock`` (zeroing the gradients ends them between two steps). ``names``:
        observations that name the parameters ("model.0.weight" names its gradient "model.0.weight.grad")."""
        named = {o.key: o.name for o in names if o.category == "parameters" and o.name}
        before = [s for s in self.steps if s[0] <= clock][-1:]
        after = [s for s in self.steps if s[0] > clock][:1]
        found = list(self.first)
        for when, pairs in before + after:
            for g, p in pairs:
                name = named.get(p) if p is not None else None
                found.append(Observation(when, g, "gradients", f"{name}.grad" if name else None))
        return found


def cpu_key(t: Any) -> int | None:
    """The CPU tracker's key of ``t``'s storage (None for a tensor not on the CPU)."""
    if t.device.type != "cpu" or t.is_meta:
        return None
    return t.untyped_storage()._cdata


def cuda_key(index: int) -> Key:
    """Block address of a tensor's storage on ``cuda:index`` (None elsewhere)."""

    def key(t: Any) -> int | None:
        if t.device.type != "cuda" or (t.device.index or 0) != index:
            return None
        return storage_address(t)

    return key


def storage_address(t: Any) -> int | None:
    """Where ``t``'s memory starts: its storage's address, a wrapper subclass's (FSDP2's ``DTensor``: its
    own storage is not valid memory, and reading its address raises) that of its first inner tensor, None
    where no address can be read. Read inside the person's optimizer step, so it never raises."""
    try:
        while hasattr(t, "__tensor_flatten__"):
            names, _ = t.__tensor_flatten__()
            if not names:
                break
            t = getattr(t, names[0])
        return t.untyped_storage().data_ptr()
    except Exception:
        return None


def now_us() -> float:
    return time.time() * 1e6


def _add(seen: list[Observation], key: Key, clock: float, t: Any, category: str, name: str | None) -> None:
    with contextlib.suppress(Exception):  # sparse and wrapper tensors have no plain storage
        k = key(t)
        if k is not None:
            seen.append(Observation(clock, k, category, name))


def _caches(name: str, value: Any) -> list[tuple[str, Any]]:
    """KV caches held by ``value``: a transformers ``Cache`` (any class named ``*Cache``), or a value under
    a name caches go by; one level into objects (a model's ``past_key_values`` attribute)."""
    found = []
    if type(value).__name__.endswith("Cache") or name in _CACHE_NAMES:
        found.append((name, value))
    elif not isinstance(value, (list, tuple, dict)):
        from ...diagnosis.context import instance_dict

        for attr, inner in list(instance_dict(value).items())[:200]:
            if isinstance(attr, str) and (type(inner).__name__.endswith("Cache") or attr in _CACHE_NAMES):
                found.append((f"{name}.{attr}", inner))
    return found


def _tensors_in(value: Any, depth: int) -> list[Any]:
    import torch

    from ...diagnosis.context import instance_dict

    if isinstance(value, torch.Tensor):
        return [value]
    if depth == 0:
        return []
    if isinstance(value, (list, tuple)):
        items = list(value)
    elif isinstance(value, dict):
        items = list(value.values())
    else:
        items = list(instance_dict(value).values())
    out: list[Any] = []
    for item in items[:10_000]:
        out.extend(_tensors_in(item, depth - 1))
    return out


def _unique(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    seen: dict[int, tuple[str, Any]] = {}
    for name, value in pairs:
        seen.setdefault(id(value), (name, value))
    return list(seen.values())


def _unique_values(values: list[Any]) -> list[Any]:
    return list({id(v): v for v in values}.values())
