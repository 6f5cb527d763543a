"""What the failed run's calls really got, read from its traceback where the cell's text is silent: the
settings and prompts of ``generate`` (a dict splatted into the call, made in an earlier cell, shows only
here), and the notebook function on the failing line whose argument was the batch a model's forward got.

Read-only and silent like ``context``: frames' locals and instance dicts only (no property, no call of a
user object); a figure that cannot be read is left out.
"""

from __future__ import annotations

import ast
import contextlib
import types
from collections.abc import Mapping
from typing import Any

from . import source as cell
from .findings import BatchCall, GenerateCall
from .holdings import instance_dict

# The generate() settings a plan reads and changes.
SETTINGS = ("num_beams", "num_return_sequences", "max_new_tokens", "do_sample")
# Names a function that decodes prompts reads: it keeps a cache or generates. A function that reduces over
# the rows (a mean, a loss) is no batch of prompts to run in chunks.
DECODES = frozenset({"past_key_values", "use_cache", "generate", "past", "cache_position"})


def _frames(error: BaseException | None) -> list[tuple[types.FrameType, int]]:
    out = []
    tb = error.__traceback__ if error is not None else None
    while tb is not None:
        out.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    return out


def _is_module(value: Any) -> bool:
    import torch

    return issubclass(type(value), torch.nn.Module)


def _rows(value: Any) -> int | None:
    """The leading dimension of a tensor of at least two dimensions (a batch of rows), else None."""
    import torch

    if issubclass(type(value), torch.Tensor) and value.dim() >= 2:
        return int(value.shape[0])
    return None


def generate_call(error: BaseException | None) -> GenerateCall | None:
    """What the outermost ``generate`` of ``error``'s traceback (a model's method) received: its prompts'
    rows and tokens, and each of ``SETTINGS`` as in force (the keywords it got, else its prepared
    generation config, else the model's). None where no such frame is in the traceback."""
    for frame, _ in _frames(error):
        if frame.f_code.co_name == "generate":
            local = dict(frame.f_locals)
            if _is_module(local.get("self")):
                return _generate_call(local)
    return None


def _generate_call(local: dict) -> GenerateCall:
    kwargs = local.get("kwargs") if type(local.get("kwargs")) is dict else {}
    # The config generate() prepared from the keywords, then the model's own.
    configs = [
        instance_dict(local.get("generation_config")),
        instance_dict(instance_dict(local["self"]).get("generation_config")),
    ]

    def setting(name: str) -> Any:
        if kwargs.get(name) is not None:
            return kwargs[name]
        return next((c[name] for c in configs if c.get(name) is not None), None)

    candidates = (local.get("inputs_tensor"), local.get("inputs"), kwargs.get("input_ids"))
    inputs = next((v for v in candidates if _rows(v) is not None), None)
    ints = {k: v for k in SETTINGS[:3] if type(v := setting(k)) is int}
    sample = setting("do_sample")
    return GenerateCall(
        prompts=_rows(inputs),
        tokens=int(inputs.shape[1]) if inputs is not None else None,
        num_beams=ints.get("num_beams"),
        num_return_sequences=ints.get("num_return_sequences"),
        max_new_tokens=ints.get("max_new_tokens"),
        do_sample=sample if type(sample) is bool else None,
        keywords=tuple(k for k in kwargs if isinstance(k, str)),
    )


def batch_call(error: BaseException | None, namespace: Mapping, source: str) -> BatchCall | None:
    """The call on the cell's failing line to a notebook function whose first tensor argument had as many
    rows as the leading dimension of the top model's forward below it: the prompts of a hand-written
    decoding loop, ``decode(lm, prompts, 64)``. None where the frames show no such call."""
    frames = _frames(error)
    cell_at = [
        i for i, (f, _) in enumerate(frames) if f.f_globals is namespace and f.f_code.co_name == "<module>"
    ]
    if not cell_at or cell_at[-1] + 1 >= len(frames):
        return None
    at = cell_at[-1]
    line = frames[at][1]
    # The function itself, past the wrappers of a decorator (``@torch.no_grad()``) around it.
    inner = next((i for i in range(at + 1, len(frames)) if frames[i][0].f_globals is namespace), None)
    if inner is None or _forward_rows(frames[at + 1 : inner]) is not None:
        return None
    called, _ = frames[inner]
    if called.f_code.co_name.startswith("<") or not _names(called.f_code) & DECODES:
        return None
    rows = _forward_rows(frames[inner + 1 :])
    if rows is None or rows[0] < 2:
        return None
    code = called.f_code
    local = dict(called.f_locals)
    params = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
    tensors = [(p, _rows(local.get(p))) for p in params if _rows(local.get(p)) is not None]
    # The rewrite splits the function's first tensor argument and those of its rows: it must be the batch.
    if not tensors or tensors[0][1] != rows[0]:
        return None
    func = _callee(source, line, namespace, code)
    if func is None:
        return None
    return BatchCall(func, tensors[0][0], rows[0], line, rows[1])


def _forward_rows(frames: list[tuple[types.FrameType, int]]) -> tuple[int, str] | None:
    """(leading dimension, class name) of the outermost model ``forward`` among ``frames``: its first
    tensor argument's rows."""
    for frame, _ in frames:
        if frame.f_code.co_name != "forward":
            continue
        with contextlib.suppress(Exception):
            local = dict(frame.f_locals)
            model = local.get("self")
            if not _is_module(model):
                continue
            code = frame.f_code
            for p in code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]:
                rows = _rows(local.get(p))
                if rows is not None:
                    return rows, type(model).__name__
            return None
    return None


def _callee(source: str, line: int, namespace: Mapping, code: types.CodeType) -> str | None:
    """The name, as the cell writes it on ``line``, of the notebook function whose code is ``code``; None
    where the call spreads ``*args``/``**kwargs`` (which argument is the batch is not written)."""
    tree = cell.tree_of(source)
    if tree is None:
        return None
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        if not node.lineno <= line <= (node.end_lineno or node.lineno):
            continue
        if not _runs(namespace.get(node.func.id), code):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords):
            return None
        return node.func.id
    return None


def _runs(func: Any, code: types.CodeType, depth: int = 0) -> bool:
    """Whether calling ``func`` runs ``code``: its own, or that of the function a decorator wraps
    (``__wrapped__``, as ``functools.wraps`` keeps it)."""
    if type(func) is not types.FunctionType or depth > 3:
        return False
    return func.__code__ is code or _runs(instance_dict(func).get("__wrapped__"), code, depth + 1)


def _names(code: types.CodeType) -> set[str]:
    """The names and attributes ``code`` (and the code nested in it) reads, its variables too."""
    names = set(code.co_names) | set(code.co_varnames)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names
