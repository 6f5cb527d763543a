"""What a Hugging Face Trainer's evaluation had gathered on the device when a run failed, read from the
frame of its evaluation loop in the error's traceback.

``Trainer.evaluate()`` (with a ``compute_metrics``) and ``Trainer.predict()`` keep every batch's
predictions and labels on the device until the loop ends, unless ``eval_accumulation_steps`` moves them to
the host every so many batches: the gathered logits grow with the evaluation set, not with the batch.
Read-only: instance dicts and tensors' shapes, no property and no user code runs. torch is imported
lazily (the diagnosis stays importable without it).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from .findings import Gathered
from .holdings import Storages, instance_dict, tensor_storages

# The containers the loop gathers into: ``EvalLoopContainer``s (transformers >= 4.42) and the host
# buffers of older releases, predictions first (the shape the finding shows is theirs).
_GATHERED = ("all_preds", "preds_host", "all_labels", "labels_host", "all_inputs", "inputs_host")
_LOOPS = frozenset({"evaluation_loop", "prediction_loop"})


def trainer_gathered(error: BaseException | None, namespace: Mapping, device: str) -> Gathered | None:
    """What the innermost Trainer evaluation loop of ``error``'s traceback had gathered on ``device``, with
    the names the namespace binds to that Trainer and its arguments. None outside such a loop, or where
    it had gathered nothing there."""
    import torch

    where = torch.device(device)
    tb = error.__traceback__ if error is not None else None
    found = None
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in _LOOPS and "/transformers/" in frame.f_code.co_filename.replace("\\", "/"):
            found = frame
        tb = tb.tb_next
    if found is None:
        return None
    local = found.f_locals
    tensors = [t for name in _GATHERED for t in _tensors(_held(local.get(name)))]
    storages: Storages = {}
    for t in tensors:
        tensor_storages(t, where, storages)
    preds = next((t for t in _tensors(_held(local.get("all_preds") or local.get("preds_host")))), None)
    if not storages or preds is None or preds.dim() < 1:
        return None
    trainer = local.get("self")
    args = instance_dict(trainer).get("args")
    batch = local.get("batch_size")
    rows = int(preds.shape[0])
    steps = -(-rows // batch) if type(batch) is int and batch > 0 else int(local.get("step", 0)) + 1
    accumulation = instance_dict(args).get("eval_accumulation_steps")
    loader = local.get("dataloader")
    description = local.get("description")
    return Gathered(
        method="predict" if description == "Prediction" else "evaluate",
        bytes=sum(storages.values()),
        steps=max(steps, 1),
        rows=rows,
        total_steps=_length(loader),
        total_rows=_length(_dataset(loader)),
        shape=tuple(int(d) for d in preds.shape),
        element_size=preds.element_size(),
        accumulation=accumulation if type(accumulation) is int else None,
        trainer=_bound(namespace, trainer),
        args=_bound(namespace, args),
        labels=any(_tensors(_held(local.get(name))) for name in ("all_labels", "labels_host")),
    )


def _held(container: Any) -> Any:
    """The device tensors an ``EvalLoopContainer`` holds (its ``tensors``), or the old loop's buffer."""
    if container is not None and type(container).__name__ == "EvalLoopContainer":
        return instance_dict(container).get("tensors")
    return container


def _tensors(value: Any, depth: int = 0) -> list:
    """The tensors in ``value``: itself, or those in its (nested) tuples, lists and dicts."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if depth > 4:
        return []
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v, depth + 1)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v, depth + 1)]
    return []


def _dataset(loader: Any) -> Any:
    """The dataset of ``loader``, read from instance dicts through the wrappers accelerate puts around it
    (``DataLoaderShard.base_dataloader``)."""
    for _ in range(3):
        attrs = instance_dict(loader)
        if "dataset" in attrs:
            return attrs["dataset"]
        loader = attrs.get("base_dataloader")
    return None


def _length(value: Any) -> int | None:
    """``len(value)`` for a loader or a dataset that has one (a list, a ``Dataset``); None otherwise."""
    if value is None or not hasattr(type(value), "__len__"):
        return None
    with contextlib.suppress(Exception):
        n = len(value)
        return n if n > 0 else None
    return None


def _bound(namespace: Mapping, value: Any) -> str | None:
    """The name the namespace binds to ``value`` itself (None where none does)."""
    if value is None:
        return None
    return next(
        (k for k, v in namespace.items() if v is value and isinstance(k, str) and not k.startswith("_")), None
    )
