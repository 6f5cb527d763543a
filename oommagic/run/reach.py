"""What the user's namespace reaches: every object, container, tensor, array and random generator a cell
can change, found by a breadth-first walk from the namespace's names (not by a list of known types), with
the path a person would write to reach each one (``exp.parts.head.weight``, ``stats['losses']``) and the
name it belongs to. ``snapshot.UserState`` keeps what this finds.
"""

from __future__ import annotations

import collections
import io
import random
import sys
import types
import weakref
from collections.abc import Mapping, MutableMapping, MutableSequence, MutableSet, Sequence, Set
from typing import Any

from ..diagnosis.context import IPYTHON_NAME, instance_dict

# The walk's bound: past this many objects it stops and says what it did not reach.
MAX_OBJECTS = 200_000
# A container this long is kept whole but not walked into (its items are counted against the bound).
MAX_ITEMS = 100_000
# Objects of these packages are the tool's and the kernel's own, not the user's work.
_NOT_USER = (
    "IPython",
    "ipykernel",
    "ipywidgets",
    "traitlets",
    "zmq",
    "tornado",
    "asyncio",
    "oommagic",
    "comm",
    # Threads, processes and progress bars live their own lives: rewinding their attributes breaks them.
    "threading",
    "multiprocessing",
    "concurrent",
    "queue",
    "subprocess",
    "tqdm",
)
# A NumPy array larger than this is named as not kept rather than compared after every trial.
MAX_ARRAY_BYTES = 256 * 2**20
_ITERATORS = (types.GeneratorType, types.AsyncGeneratorType, types.CoroutineType)
_LEAVES = (
    types.ModuleType,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.CodeType,
    types.FrameType,
    weakref.ref,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    range,
    type(None),
)


class Reach:
    """Everything ``namespace`` reaches, breadth first (so each object is named by its shortest path),
    sorted by what keeping it takes, each with its path and its owner: the name bound in the namespace
    (a model, an optimizer, an object) it belongs to, None for what a container holds. With ``stop_at``,
    only the objects outside that set of ids: what a restore missed."""

    def __init__(self, namespace: Mapping, stop_at: set | None = None) -> None:
        import torch

        numpy = sys.modules.get("numpy")
        self.tensors: list = []
        self.arrays: list = []
        self.containers: list = []
        self.objects: list = []
        self.generators: list = []
        self.files: list = []  # files open for writing: a trial's writes through them are put back too
        self.owners: list = []
        self.not_kept: list = []
        self.new: list = []
        self.seen: dict[int, Any] = {}
        self._owner: str | None = None
        queue = collections.deque(
            (value, name, None)
            for name, value in namespace.items()
            # Dunder names are the interpreter's and torch.compile's (`__builtins_dict___0`), not the user's.
            if not IPYTHON_NAME.fullmatch(name) and not name.startswith("__")
        )
        generator_types = _generator_types()
        while queue:
            obj, path, owner = queue.popleft()
            if isinstance(obj, _LEAVES) or (type(obj).__module__ or "").startswith(_NOT_USER):
                continue
            key = id(obj)
            if key in self.seen:
                continue
            if len(self.seen) >= MAX_OBJECTS:
                self.not_kept.append((path, f"past the first {MAX_OBJECTS:,} objects the walk keeps"))
                break
            self.seen[key] = obj
            if stop_at is not None and key not in stop_at:
                self.new.append(path)  # reached now, never kept: walked through, not into
                continue
            if isinstance(obj, io.IOBase):
                if _open_for_writing(obj):
                    self.files.append((obj, path))
                continue
            if isinstance(obj, torch.Tensor):
                self.tensors.append((obj, path, owner))  # with its .grad (``snapshot._Tensor``)
                continue
            if numpy is not None and isinstance(obj, numpy.ndarray):
                if obj.nbytes > MAX_ARRAY_BYTES:
                    # No version counter to skip an unchanged one: each trial would compare it whole.
                    self.not_kept.append((path, f"an array of {obj.nbytes / 2**20:,.0f} MiB"))
                else:
                    self.arrays.append((obj, path, owner))
                continue
            if isinstance(obj, generator_types):
                self.generators.append((obj, path, owner))
                continue
            if isinstance(obj, _ITERATORS) or type(obj).__name__.endswith("iterator"):
                self.not_kept.append((path, "an iterator: what a trial takes from it cannot be put back"))
                continue
            self._owner = owner
            items = self._items(obj, path)
            if items is None:
                continue
            if len(items) > MAX_ITEMS:
                self.not_kept.append((path, f"its {len(items):,} items were kept but not walked into"))
                continue
            queue.extend((value, where, self._owner) for value, where in items)

    def _items(self, obj: Any, path: str) -> list | None:
        """The objects ``obj`` holds with their paths, after noting what keeping ``obj`` takes."""
        owner = self._owner
        if isinstance(obj, Mapping):
            if isinstance(obj, (dict, MutableMapping)):
                self.containers.append((obj, path, owner))
            # A module's parameters, buffers and submodules are named as its attributes: model.0.weight.
            dotted = path.endswith(("._parameters", "._buffers", "._modules"))
            base = path.rsplit(".", 1)[0] if dotted else path
            out = []
            for k, v in list(obj.items()):
                out.append((v, f"{base}.{k}" if dotted else f"{path}[{k!r}]"))
                out.append((k, f"{path} key"))
            return out
        if isinstance(obj, (Sequence, Set, collections.deque)) and not isinstance(obj, (str, bytes)):
            if isinstance(obj, (list, collections.deque, bytearray, MutableSequence, set, MutableSet)):
                self.containers.append((obj, path, owner))
            return [(v, f"{path}[{i}]") for i, v in enumerate(list(obj))]
        attrs = instance_dict(obj)
        try:
            has_dict = object.__getattribute__(obj, "__dict__") is attrs
        except Exception:
            has_dict = False
        if not has_dict:
            return None
        if owner is None:
            # An object (a model, an optimizer, a trainer) owns what it holds: the summary names it.
            self.owners.append((obj, path))
            self._owner = path
        self.objects.append((obj, path, self._owner))
        return [(v, f"{path}.{k}") for k, v in list(attrs.items())]

    def names(self) -> tuple[str, ...]:
        """What the walk found, the way a person names it: the objects bound in the namespace by name
        (with their class where it is an optimizer or a scheduler), the rest counted by kind ("model",
        "opt (AdamW)", "2 tensors", "1 deque", "3 random generators")."""
        import torch

        out = []
        for obj, path in self.owners:
            plain = isinstance(obj, torch.nn.Module) or type(obj).__module__ == "__main__"
            out.append(path if plain else f"{path} ({type(obj).__name__})")
        counts: collections.Counter = collections.Counter()
        counts["tensor"] = sum(owner is None for _, _, owner in self.tensors)
        counts["NumPy array"] = sum(owner is None for _, _, owner in self.arrays)
        for c, _, owner in self.containers:
            if owner is None:
                counts[type(c).__name__] += 1
        counts["random generator"] = len(self.generators)
        out += [f"{n} {kind}{'s' if n != 1 else ''}" for kind, n in counts.items() if n]
        return tuple(out)


def _generator_types() -> tuple:
    import torch

    kinds: list = [torch.Generator, random.Random]
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        kinds += [numpy.random.Generator, numpy.random.RandomState, numpy.random.BitGenerator]
    return tuple(kinds)


def _open_for_writing(f: Any) -> bool:
    import os

    try:
        name = f.name
        return not f.closed and f.writable() and isinstance(name, str) and os.path.isfile(name)
    except Exception:
        return False
