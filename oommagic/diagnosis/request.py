"""Name the one allocation that failed: from the failing frames, the tensors an operation was making when
the error came (the output of a ``Linear``, a float copy of the logits in a loss, attention scores), matched
against the bytes the error says were requested; each dimension named where the model's inputs and config
give it (batch × sequence × vocabulary).

``read_computation`` is the effectful edge (read-only, like ``context``: frames' locals and instance dicts,
no property, no ``__getattr__``); ``match_request`` is pure.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

from .findings import Request
from .holdings import instance_dict

MIB = 1024**2
# "Tried to allocate" is the CUDA allocator's block: the request rounded up to 2 MiB for large tensors,
# then printed with two decimals in its unit (DESIGN.md).
_BLOCK = 2 * MIB
_PRINTED = 0.005
# Frames of the machinery between an operation and the allocator: not where the request was made.
_MACHINERY = ("oommagic.", "torch._dynamo", "torch._compile", "torch.utils._python_dispatch", "IPython.")
# Config keys of transformers models, by the name a person knows the dimension by.
_CONFIG_DIMS = (
    ("vocabulary", ("vocab_size",)),
    ("hidden", ("hidden_size", "n_embd", "d_model")),
    ("heads", ("num_attention_heads", "n_head")),
)
_KEEP_KEYWORDS = ("logits_to_keep", "num_logits_to_keep")  # transformers ≥4.50, 4.45–4.49
_LOGITS_NAMES = ("lm_head", "logits", "output_projection", "embed_out")


@dataclass(frozen=True)
class Candidate:
    """A tensor an operation in the failing frames was making: its shape, the dtypes it may have been
    made in (its own, or float32 for an upcast), the operation in words, and whether it is the logits."""

    shape: tuple[int, ...]
    dtypes: tuple[tuple[str, int], ...]
    op: str
    logits: bool = False


@dataclass(frozen=True)
class Computation:
    """What the failing frames were computing: the candidates (innermost first), the sizes the model's
    inputs and config name (``("batch", 8)``, ``("vocabulary", 50257)``), the keyword the model's forward
    takes to keep fewer logits, and the model's class."""

    candidates: tuple[Candidate, ...] = ()
    dims: tuple[tuple[str, int], ...] = ()
    keep_keyword: str | None = None
    model: str | None = None


def match_request(computation: Computation | None, requested: int | None) -> Request | None:
    """The candidate whose bytes are the ``requested`` ones (exactly, or within the allocator's rounding
    and the message's two decimals), with its dimensions named; None where none matches or two different
    shapes do (then the frames cannot tell)."""
    if computation is None or not requested:
        return None
    found: list[tuple[Candidate, str, int]] = []
    for cand in computation.candidates:
        for dtype, size in cand.dtypes:
            nbytes = math.prod(cand.shape) * size
            if _close(nbytes, requested):
                found.append((cand, dtype, nbytes))
                break
    # The innermost match is the operation that made it; views of it (a loss's flattened logits) have its
    # bytes too. Matches of different sizes (the allocator's rounding) leave it open.
    if not found or len({n for _, _, n in found}) > 1:
        return None
    cand, dtype, nbytes = found[0]
    return Request(
        shape=cand.shape,
        dtype=dtype,
        bytes=nbytes,
        op=cand.op,
        dims=name_dims(cand.shape, dict(computation.dims)),
        logits=cand.logits,
        keep_keyword=computation.keep_keyword if cand.logits else None,
        model=computation.model,
    )


def _close(nbytes: int, requested: int) -> bool:
    if nbytes == requested:
        return True
    slack = int(requested * _PRINTED)
    return nbytes - slack <= requested <= -(-nbytes // _BLOCK) * _BLOCK + slack and nbytes > _BLOCK


def name_dims(shape: tuple[int, ...], dims: dict[str, int]) -> tuple[str, ...]:
    """One name per dimension of ``shape`` (batch first, then sequence, vocabulary, heads, hidden), or
    () where a dimension has none: a shape named in part says nothing sure."""
    names = []
    flat = dims["batch"] * dims["sequence"] if "batch" in dims and "sequence" in dims else None
    for i, d in enumerate(shape):
        if i == 0 and dims.get("batch") == d:
            names.append("batch")
            continue
        if i == 0 and d == flat:
            names.append("batch·sequence")
            continue
        name = next((n for n in ("sequence", "vocabulary", "heads", "hidden") if dims.get(n) == d), None)
        if name is None:
            return ()
        names.append(name)
    return tuple(names)


# --- reading the frames (effectful, read-only) --------------------------------------------------------


def read_computation(error: BaseException | None) -> Computation | None:
    """What the frames of ``error``'s traceback were computing; None without a traceback or tensors."""
    if error is None:
        return None
    import torch

    frames = []
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if not str(frame.f_globals.get("__name__", "")).startswith(_MACHINERY):
            frames.append(frame)
        tb = tb.tb_next
    module_type, tensor_type = torch.nn.Module, torch.Tensor
    # (frame, module) of each module's forward, outermost first: the outermost is the model.
    forwards = []
    for frame in frames:
        with contextlib.suppress(Exception):
            owner = frame.f_locals.get("self")
            if frame.f_code.co_name == "forward" and issubclass(type(owner), module_type):
                forwards.append((frame, owner))
    if not forwards:
        return None
    model = forwards[0][1]
    innermost = forwards[-1][0]
    deeper = frames[frames.index(innermost) :]
    candidates: list[Candidate] = []
    for frame in reversed(deeper):
        with contextlib.suppress(Exception):
            candidates.extend(_made_in(frame, model, module_type, tensor_type))
    return Computation(
        candidates=tuple(candidates),
        dims=_named_sizes(model, [f for f, _ in forwards], tensor_type),
        keep_keyword=_keep_keyword(type(model)),
        model=type(model).__name__,
    )


def _made_in(frame: Any, model: Any, module_type: type, tensor_type: type) -> list[Candidate]:
    """The tensors the operation of ``frame`` may have been making."""
    found = []
    local = dict(frame.f_locals)
    owner = local.get("self")
    function = frame.f_code.co_name
    attrs = instance_dict(owner) if issubclass(type(owner), module_type) else {}
    out_features = attrs.get("out_features")
    if function == "forward" and type(out_features) is int:
        # A Linear (or a subclass): its output is the input with the last dimension replaced.
        first = frame.f_code.co_varnames[1] if frame.f_code.co_argcount > 1 else "input"
        x = local.get(first)
        if issubclass(type(x), tensor_type) and x.dim() >= 1:
            path = _path_in(model, owner) or type(owner).__name__
            vocabulary = _config_int(model, "vocab_size")
            logits = path.rsplit(".", 1)[-1] in _LOGITS_NAMES or out_features == vocabulary
            layer = f"{type(owner).__name__} {attrs.get('in_features')} → {out_features:,}"
            op = f"the output of `{path}` ({layer})"
            shape = (*tuple(x.shape[:-1]), out_features)
            found.append(Candidate(shape, _dtypes(x), op, logits))
    query, key = local.get("query"), local.get("key")
    if issubclass(type(query), tensor_type) and issubclass(type(key), tensor_type) and query.dim() == 4:
        shape = (*tuple(query.shape[:-1]), int(key.shape[-2]))
        found.append(Candidate(shape, _dtypes(query), f"the attention scores in {function}()"))
    for name, value in local.items():
        if issubclass(type(value), tensor_type) and value.dim() >= 2 and value.is_floating_point():
            logits = "logits" in name or value.shape[-1] == _config_int(model, "vocab_size")
            op = f"a copy of `{name}` in {function}()" if function != "forward" else f"`{name}` in forward()"
            found.append(Candidate(tuple(value.shape), _dtypes(value), op, logits))
    return found


def _dtypes(t: Any) -> tuple[tuple[str, int], ...]:
    own = (str(t.dtype).removeprefix("torch."), t.element_size())
    # Half-precision values are often made in float32 by a loss or a softmax (`logits.float()`).
    return (own, ("float32", 4)) if own[1] < 4 else (own,)


def _path_in(model: Any, target: Any) -> str | None:
    """``lm_head`` or ``transformer.h.0.attn``: where ``target`` sits in ``model``, read from the
    instance dicts' ``_modules``."""
    if model is target:
        return None
    stack: list[tuple[str, Any]] = [("", model)]
    seen = set()
    while stack and len(seen) < 100_000:
        prefix, module = stack.pop()
        if id(module) in seen:
            continue
        seen.add(id(module))
        for name, child in (instance_dict(module).get("_modules") or {}).items():
            path = f"{prefix}.{name}" if prefix else name
            if child is target:
                return path
            if child is not None:
                stack.append((path, child))
    return None


def _config_int(model: Any, key: str) -> int | None:
    value = instance_dict(instance_dict(model).get("config")).get(key)
    return value if type(value) is int else None


def _named_sizes(model: Any, frames: list, tensor_type: type) -> tuple[tuple[str, int], ...]:
    """(name, size) of what the model's config and inputs name: batch and sequence from the ``input_ids``
    (or ``inputs_embeds``, ``labels``) of the outermost forward that has them, the rest from the config."""
    dims: dict[str, int] = {}
    for frame in frames:
        local = dict(frame.f_locals)
        ids = next(
            (
                local[k]
                for k in ("input_ids", "inputs_embeds", "labels")
                if issubclass(type(local.get(k)), tensor_type) and local[k].dim() >= 2
            ),
            None,
        )
        if ids is not None:
            dims["batch"], dims["sequence"] = int(ids.shape[0]), int(ids.shape[1])
            break
    for name, keys in _CONFIG_DIMS:
        value = next((v for k in keys if (v := _config_int(model, k)) is not None), None)
        if value is not None:
            dims[name] = value
    return tuple(dims.items())


def _keep_keyword(model_type: type) -> str | None:
    """The keyword the model's forward takes to compute only the last positions' logits, if any."""
    import inspect

    with contextlib.suppress(Exception):
        params = inspect.signature(model_type.forward).parameters
        return next((k for k in _KEEP_KEYWORDS if k in params), None)
    return None
