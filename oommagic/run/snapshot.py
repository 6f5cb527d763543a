"""Take the user's state before a trial and put it back after: a trial or a search probe runs the cell
for real, and only the run the person accepts may keep its effects.

What is kept, in host memory: every model's parameters, buffers and gradients (and which submodules were
in training mode), every optimizer's, LR scheduler's and grad scaler's state, the RNG states (torch, CUDA,
numpy, random), the namespace's bindings, the contents of its lists, dicts and sets, and the attributes of
its other objects (a ``Trainer``'s ``state``, ``optimizer``, ...). Restoring writes the saved values back
into the same tensor and container objects, so references the user holds stay valid.
"""

from __future__ import annotations

import contextlib
import copy
import random
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..diagnosis.context import IPYTHON_NAME, held_by, instance_dict
from ..sizes import format_bytes

# Leave this share of the host's available memory free when deciding whether a snapshot fits.
HOST_RESERVE = 0.2


class SnapshotTooLarge(RuntimeError):
    """The user's state does not fit in host memory; trials would change it for good."""


@dataclass
class UserState:
    """A snapshot of the user's state (see the module docstring); ``nbytes`` of host memory it holds."""

    namespace: dict = field(default_factory=dict)
    contents: list = field(default_factory=list)
    attributes: list = field(default_factory=list)
    tensors: list = field(default_factory=list)
    slots: list = field(default_factory=list)
    modes: list = field(default_factory=list)
    stateful: list = field(default_factory=list)
    optimizers: list = field(default_factory=list)
    rng: dict = field(default_factory=dict)
    nbytes: int = 0

    @classmethod
    def take(cls, namespace: Mapping, device: str, check_host: bool = True) -> UserState:
        """Snapshot ``namespace`` and everything it reaches that a run can change. Raises
        ``SnapshotTooLarge`` (before copying anything) when the copies would not fit in host memory."""
        import torch

        modules: list = []
        optimizers: list = []
        for name, value in namespace.items():
            if not IPYTHON_NAME.fullmatch(name):
                with contextlib.suppress(Exception):
                    held_by(name, value, None, modules, optimizers)
        tensors = _model_tensors([m for _, m in modules])
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        nbytes += sum(_state_bytes(o) for o in optimizers)
        if check_host:
            available = host_available()
            if available is not None and nbytes > available * (1 - HOST_RESERVE):
                raise SnapshotTooLarge(
                    f"keeping the model and optimizer state for the trials needs {format_bytes(nbytes)} of "
                    f"host memory and {format_bytes(available)} is available; trials would change them "
                    "for good. Run with --no-snapshot to try anyway (the trials then leave their changes), "
                    "or --plan-budget 0 to skip trials."
                )
        state = cls(namespace=dict(namespace), nbytes=nbytes)
        seen: set[int] = set()
        for value in namespace.values():
            kind = type(value)
            if kind in (list, dict, set):
                state.contents.append((value, copy.copy(value)))
            elif not issubclass(kind, (torch.Tensor, torch.nn.Module)) and kind.__module__ != "builtins":
                # The object and the plain objects it holds (a Trainer's `args`, its `state`): two levels.
                for obj in [value, *instance_dict(value).values()]:
                    attrs = instance_dict(obj)
                    plain = not issubclass(type(obj), (torch.Tensor, torch.nn.Module))
                    if attrs and plain and id(obj) not in seen:
                        seen.add(id(obj))
                        state.attributes.append((obj, dict(attrs)))
        with torch.no_grad():
            for t in tensors:
                saved = t.detach().to("cpu", copy=True)
                grad = t.grad if t.is_leaf else None
                saved_grad = grad.detach().to("cpu", copy=True) if grad is not None else None
                state.tensors.append((t, saved, saved_grad))
        for _, module in modules:
            for m in module.modules():
                state.slots.append((m, dict(m._parameters), dict(m._buffers)))
                state.modes.append((m, m.training))
        for obj in _stateful(namespace, optimizers):
            if obj in optimizers:
                state.optimizers.append((obj, _optimizer_state(obj)))
            else:
                state.stateful.append((obj, _to_host(obj.state_dict())))
        state.rng = _rng_state()
        return state

    def restore(self, namespace: dict) -> None:
        """Put everything back as it was when the snapshot was taken."""
        import torch

        for key in [k for k in namespace if k not in self.namespace]:
            del namespace[key]
        for key, value in self.namespace.items():
            if namespace.get(key, _MISSING) is not value:
                namespace[key] = value
        for container, saved in self.contents:
            container.clear()
            container.update(saved) if not isinstance(container, list) else container.extend(saved)
        for obj, attrs in self.attributes:
            current = instance_dict(obj)
            current.clear()
            current.update(attrs)
        for module, params, buffers in self.slots:
            module._parameters.clear()
            module._parameters.update(params)
            module._buffers.clear()
            module._buffers.update(buffers)
        with torch.no_grad():
            for t, saved, saved_grad in self.tensors:
                if t.shape == saved.shape and t.dtype == saved.dtype:
                    t.copy_(saved)
                else:
                    t.data = saved.to(t.device)
                if t.is_leaf:
                    t.grad = None if saved_grad is None else saved_grad.to(t.device)
        for module, mode in self.modes:
            module.training = mode
        for obj, saved in self.stateful:
            obj.load_state_dict(copy.deepcopy(saved))
        for opt, saved in self.optimizers:
            _restore_optimizer(opt, saved)
        _set_rng_state(self.rng)


_MISSING = object()


def host_available() -> int | None:
    """Bytes of host memory available now (``MemAvailable``), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _model_tensors(modules: list) -> list:
    seen: dict[int, Any] = {}
    for module in modules:
        for t in [*module.parameters(), *module.buffers()]:
            seen.setdefault(id(t), t)
    return list(seen.values())


def _state_bytes(optimizer: Any) -> int:
    import torch

    total = 0
    for state in optimizer.state.values():
        for value in state.values() if isinstance(state, dict) else ():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total


def _stateful(namespace: Mapping, optimizers: list) -> list:
    """Optimizers, LR schedulers and grad scalers reachable from the namespace (one level deep)."""
    found = {id(o): o for o in optimizers}
    for value in namespace.values():
        for candidate in [value, *instance_dict(value).values()]:
            module = type(candidate).__module__ or ""
            if module.startswith(("torch.optim.lr_scheduler", "torch.amp.grad_scaler", "torch.cuda.amp")):
                found.setdefault(id(candidate), candidate)
    return list(found.values())


def _optimizer_state(opt: Any) -> tuple:
    """(per-parameter state: the same tensor objects with host copies of their values, the param groups'
    settings): restored in place, so the state tensors stay the objects the user's optimizer holds."""
    import torch

    per_param = {}
    for param, values in opt.state.items():
        kept = {}
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                kept[key] = (value, value.detach().to("cpu", copy=True))
            else:
                kept[key] = (None, copy.deepcopy(value))
        per_param[param] = kept
    groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return per_param, groups


def _restore_optimizer(opt: Any, saved: tuple) -> None:
    import torch

    per_param, groups = saved
    for param in [p for p in opt.state if p not in per_param]:
        del opt.state[param]  # state a trial created: the optimizer had none for this parameter
    with torch.no_grad():
        for param, kept in per_param.items():
            values = {}
            for key, (tensor, value) in kept.items():
                if tensor is not None:
                    tensor.copy_(value)
                    values[key] = tensor
                else:
                    values[key] = copy.deepcopy(value)
            opt.state[param] = values
    for group, settings in zip(opt.param_groups, groups, strict=False):
        group.update(copy.deepcopy(settings))


def _to_host(state: Any) -> Any:
    """A deep copy of a ``state_dict`` with every tensor copied to host memory."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: _to_host(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_to_host(v) for v in state)
    return copy.deepcopy(state)


def _rng_state() -> dict:
    import torch

    state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
    if torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: dict) -> None:
    import torch

    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        sys.modules["numpy"].random.set_state(state["numpy"])
