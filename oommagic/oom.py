"""Out-of-memory errors: recognise them (``is_oom``) and read their figures (``parse_oom``).

Pure: imports neither torch nor IPython. The message formats, with the issue threads they were collected
from, are in ``tests/oom_corpus``.

How a text is read: ANSI colours, log prefixes and quote marks are stripped line by line, then the lines are
joined with nothing between them, so a message wrapped anywhere (even mid-word) reads as one line again; the
patterns allow optional whitespace wherever the original had a space. Every pattern starts with a keyword
and every repeat in it is bounded or stops at a character it cannot contain, so parsing is linear in the
length of the text.
"""

from __future__ import annotations

import bisect
import math
import re
from dataclasses import asdict, dataclass, field

from .sizes import REPORTED_UNITS, format_bytes, reported_bytes


@dataclass(frozen=True)
class OOMReport:
    """The figures of one out-of-memory message. Bytes as ``int``; ``None`` where the message does not say."""

    text: str
    device: str | None = None
    gpu_index: int | None = None
    requested: int | None = None
    capacity: int | None = None
    free: int | None = None
    allocated: int | None = None
    reserved: int | None = None
    reserved_unallocated: int | None = None
    process_used: int | None = None
    other_processes: tuple[tuple[int, int], ...] = field(default_factory=tuple)
    limit: int | None = None
    source: str = "allocator"
    emulated: bool = False

    def to_json(self) -> dict:
        data = asdict(self)
        data["other_processes"] = [list(p) for p in self.other_processes]
        return data

    @classmethod
    def from_json(cls, data: dict) -> OOMReport:
        data = dict(data)
        data["other_processes"] = tuple(tuple(p) for p in data.get("other_processes", ()))
        return cls(**data)


def parse_oom(text: str) -> OOMReport | None:
    """Read the out-of-memory message in ``text``; ``None`` when it holds none.

    ``text`` may be an exception's ``str()``, a whole traceback, a log, or a pasted and re-wrapped copy of
    any of them. Recognises the PyTorch caching allocator (CUDA, HIP, XPU; every format since 1.0), MPS,
    cudaMallocAsync, ``CUDA error: out of memory``, cuBLAS/cuDNN allocation failures, XLA/JAX, TensorFlow,
    PyTorch's CPU allocator and oommagic's own emulated message. Never raises for a ``str``.
    """
    if not isinstance(text, str) or not text:
        return None
    page = _Page(text)
    for reader in _READERS:
        report = reader(page)
        if report is not None:
            return report
    return None


def is_oom(exc: BaseException) -> bool:
    """True when ``exc`` is an out-of-memory error: a ``torch.OutOfMemoryError`` (matched by class name, so
    torch is not imported) or any exception whose message ``parse_oom`` reads as one. Never raises."""
    try:
        if any(getattr(cls, "__name__", "") == "OutOfMemoryError" for cls in type(exc).__mro__):
            return True
    except Exception:
        pass
    try:
        message = str(exc)
    except Exception:
        return False
    return isinstance(message, str) and parse_oom(message) is not None


def format_emulated_oom(
    requested: int, capacity: int, free: int, process_used: int, allocated: int, limit: int
) -> str:
    """The message oommagic raises when ``%%gpumem --limit`` emulates a device on the CPU.

    Shaped like PyTorch's own CUDA message so that readers of either see the same figures; ``parse_oom``
    reads it back with ``emulated=True``.
    """
    b = format_bytes
    return (
        f"CPU out of memory (emulated by oommagic: %%gpumem --limit {b(limit)}). "
        f"Tried to allocate {b(requested)}. "
        f"CPU 0 has a total capacity of {b(capacity)} of which {b(free)} is free. "
        f"Including non-PyTorch memory, this process has {b(process_used)} memory in use. "
        f"{b(limit)} allowed; "
        f"Of the allocated memory {b(allocated)} is allocated by PyTorch, "
        f"and 0 bytes is reserved by PyTorch but unallocated."
    )


# ---------------------------------------------------------------------------------------------------------
# Normalising the text


def _words(phrase: str) -> str:
    """A phrase as a pattern: literal words, any whitespace (or none, where a wrap ate the space) between."""
    return r"\s*".join(re.escape(word) for word in phrase.split())


# Longest first, so that "GiB" is not read as XLA's one-letter "G". No word boundary after it: a wrap that
# ate the space glues the next word on ("10.51Gat the bottom").
_UNIT = "|".join(sorted(REPORTED_UNITS, key=len, reverse=True))
# A printed size. Digit runs are capped so that a number can neither blow up the arithmetic nor make a
# failed match re-scan a long run of digits.
_SIZE = r"(\d{1,30}(?:\.\d{1,30})?)\s*(" + _UNIT + r")"
# For patterns that start with the size: not in the middle of a number ("2.80" but not its "80").
_LEAD = r"(?<!\d)(?<!\d\.)"

_ANSI = re.compile(r"\x1b(?:\[[0-?]{0,40}[ -/]{0,5}[@-~]|\][^\x07\x1b\n]{0,300}(?:\x07|\x1b\\)|[@-Z\\-_])?")
# Colour codes whose escape character was lost on the way (GitHub, some CI logs): "[36m(pid=1)[0m".
_ANSI_ORPHAN = re.compile(r"\[\d{1,3}(?:;\d{1,3}){0,4}m")
# One leading decoration of a line; stripped repeatedly. Each alternative is anchored and bounded, and eats at
# most one space after itself, so that what is left shows whether the line had content, only spaces (a wrapped
# run of spaces: the message goes on) or nothing (a paragraph break).
_PREFIX = re.compile(
    r"""[ \t]*(?:
        >+                                                         # markdown or e-mail quote
      | \[\s*rank\s*\d{1,6}\s*\]:?                                 # torchrun: [rank0]:
      | \[?\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(?:[.,]\d{1,9})?(?:Z|[+-]\d\d:?\d\d)?\]?:?   # ISO time
      | \d\d-\d\d[ ]\d\d:\d\d:\d\d(?:\.\d{1,9})?                   # vLLM: 03-13 09:00:43
      | [IWEFD]\d{4}[ ]\d\d:\d\d:\d\d(?:\.\d{1,9})?(?:[ ]+\d{1,9})?   # glog: E0323 21:57:08.583 23
      | \d\d:\d\d:\d\d(?:[.,]\d{1,9})?:?                           # bare time
      | (?:ERROR|WARNING|WARN|INFO|DEBUG|CRITICAL|FATAL|TRACE)(?::[\w.]{0,40}:|:|\b)   # levels, ERROR:root:
      | \((?:\w{1,40}[ ]+)?[\w.-]{1,40}=[\w.:-]{1,40}(?:,?[ ]+[\w.-]{1,40}=[\w.:-]{1,40}){0,4}\)   # Ray, vLLM
      | \[?[\w./\\:-]{0,200}\.(?:py|cc|cpp|cu|c|h|hpp):\d{1,6}\]   # glog / vLLM source: [core.py:330]
      | [\w.-]{1,40}[ ]+\|(?=[ ])                                  # docker compose: sglang-1  |
    )[ \t]?""",
    re.VERBOSE,
)


class _Page:
    """The text, cleaned and with its lines joined; ``flat`` is what the patterns search.

    An empty line, or one that held only a log prefix, is a paragraph break and stays as "\\n", so a message
    never runs on into the next paragraph; a line of spaces is a wrapped run of spaces and is dropped.
    ``breaks`` remembers where line breaks were removed, to give them back in ``OOMReport.text``.
    """

    def __init__(self, text: str) -> None:
        text = _ANSI_ORPHAN.sub("", _ANSI.sub("", text))
        parts: list[str] = []
        self.breaks: list[int] = []
        size = 0
        for raw in text.splitlines():
            line = raw
            for _ in range(12):
                match = _PREFIX.match(line)
                if not match or not match.end():
                    break
                line = line[match.end() :]
            if not line:
                if parts and parts[-1] != "\n":
                    parts.append("\n")
                    size += 1
                continue
            line = line.strip()
            if not line:
                continue
            if parts and parts[-1] != "\n":
                self.breaks.append(size)
            parts.append(line)
            size += len(line)
        self.flat = "".join(parts)

    def text(self, start: int, end: int) -> str:
        """``flat[start:end]`` with its removed line breaks put back."""
        pieces = []
        at = start
        for cut in self.breaks[
            bisect.bisect_right(self.breaks, start) : bisect.bisect_left(self.breaks, end)
        ]:
            pieces.append(self.flat[at:cut])
            at = cut
        pieces.append(self.flat[at:end])
        return "\n".join(pieces).strip()


def _size(match: re.Match, group: int = 1) -> int:
    return reported_bytes(match.group(group), match.group(group + 1))


# ---------------------------------------------------------------------------------------------------------
# PyTorch's caching allocator: CUDA, HIP (ROCm builds), XPU, and oommagic's emulated CPU device


_DEVICE_NAMES = {"CUDA": "cuda", "HIP": "hip", "XPU": "xpu", "CPU": "cpu"}
_ALLOCATOR = re.compile(
    r"(CUDA|HIP|XPU|CPU)\s*"
    + _words("out of memory")
    + r"\s*(?:\.|\(\s*"
    + _words("emulated by oommagic")
    + ")"
)
# A message whose first words were cut off still shows the allocator's figures.
_ALLOCATOR_HEADLESS = re.compile(
    _words("Tried to allocate") + r"\s*" + _SIZE + r"\s*(?:\(\s*GPU\s*\d|\.\s*GPU\s*\d{1,5}\s*has)"
)
# Intel's extension refuses single blocks over 4 GB in the same words: a size limit, not a full device.
_BLOCK_LIMIT = re.compile(_words("can NOT allocate memory block"))

_EMULATED_LIMIT = re.compile(r"%%gpumem\s*--limit\s*" + _SIZE)
_REQUESTED = re.compile(_words("Tried to allocate") + r"\s*" + _SIZE)
# PyTorch <= 2.0: "Tried to allocate X (GPU 0; Y total capacity; Z already allocated; W free; V reserved ...)"
_OLD_FIGURES = re.compile(
    _words("Tried to allocate") + r"\s*" + _SIZE + r"\s*\(\s*GPU\s*(\d{1,5})\s*;([^()\n]{0,600})(\))?"
)
_OLD_ITEM = re.compile(
    r"\s*" + _SIZE + r"\s*(total\s*capacity|already\s*allocated|free|allowed|reserved|cached)"
)
# PyTorch >= 2.1 ("capacty" in 2.1).
_GPU_INDEX = re.compile(r"(?:GPU|CPU|XPU|Device)\s*(\d{1,5})\s*" + _words("has a total") + r"\s*capaci?ty")
_CAPACITY = re.compile(_words("has a total") + r"\s*capaci?ty\s*of\s*" + _SIZE)
_FREE = re.compile(_words("of which") + r"\s*" + _SIZE + r"\s*is\s*free")
_PROCESS_USED = re.compile(_words("this process has") + r"\s*" + _SIZE + r"\s*" + _words("memory in use"))
_OTHER_PROCESS = re.compile(r"Process\s*(\d{1,10})\s*has\s*" + _SIZE + r"\s*" + _words("memory in use"))
_ALLOWED = re.compile(_LEAD + _SIZE + r"\s*allowed")
_ALLOCATED = re.compile(
    _words("Of the allocated memory") + r"\s*" + _SIZE + r"\s*" + _words("is allocated by")
)
_UNALLOCATED = re.compile(r"and\s*" + _SIZE + r"\s*" + _words("is reserved by PyTorch but unallocated"))
_HINT = re.compile(
    r"[.)]?\s*(?:If\s*reserved|Please\s*use|Use\s*PYTORCH_MPS)[^\n]{0,600}?"
    r"(?:https?://[^\s()]{1,200}\)|PYTORCH_(?:CUDA|HIP)_ALLOC_CONF(?!\s*=)|cached\s*memory\.|failure\)\.?)"
)
_MESSAGE_SPAN = 4000


def _region(page: _Page, start: int, anchor: re.Pattern) -> int:
    """Where the message that starts at ``start`` ends at the latest: the paragraph's end, the next message
    of the same kind, or a length no message reaches."""
    end = min(len(page.flat), start + _MESSAGE_SPAN)
    stop = page.flat.find("\n", start, end)
    if stop != -1:
        end = stop
    nxt = anchor.search(page.flat, start + 1, end)
    return nxt.start() if nxt else end


def _finish(page: _Page, start: int, last: int, end: int) -> str:
    """The message text: from its anchor to its last figure, plus PyTorch's advice sentence if it follows."""
    hint = _HINT.match(page.flat, last, end)
    if hint:
        last = hint.end()
    elif last < end and page.flat[last] in ".)":
        last += 1
    return page.text(start, last)


def _read_allocator(page: _Page) -> OOMReport | None:
    flat = page.flat
    anchor = _ALLOCATOR.search(flat)
    device = None
    if anchor:
        device = _DEVICE_NAMES[anchor.group(1)]
        pattern = _ALLOCATOR
    else:
        anchor = _ALLOCATOR_HEADLESS.search(flat)
        while anchor and _BLOCK_LIMIT.search(flat, max(0, anchor.start() - 120), anchor.start()):
            anchor = _ALLOCATOR_HEADLESS.search(flat, anchor.end())
        if not anchor:
            return None
        device = "gpu"
        pattern = _ALLOCATOR_HEADLESS
    start = anchor.start()
    end = _region(page, start, pattern)
    last = anchor.end()
    figures: dict = {"device": device, "source": "allocator"}

    def find(regex: re.Pattern) -> re.Match | None:
        nonlocal last
        match = regex.search(flat, start, end)
        if match:
            last = max(last, match.end())
        return match

    if "emulated" in flat[anchor.start() : anchor.end()]:
        figures.update(emulated=True, source="emulated")
        if match := find(_EMULATED_LIMIT):
            figures["limit"] = _size(match)

    if old := find(_OLD_FIGURES):
        figures["requested"] = _size(old)
        figures["gpu_index"] = int(old.group(3))
        reserved = cached = None
        at = old.start(4)
        for item in old.group(4).split(";"):
            match = _OLD_ITEM.match(item)
            at += len(item) + 1
            if not match:
                continue
            if not old.group(5):
                # No closing parenthesis: the message was cut; it ends with its last figure.
                last = at - len(item) - 1 + match.end()
            label, value = match.group(3)[:3], _size(match)
            if label == "tot":
                figures["capacity"] = value
            elif label == "alr":
                figures["allocated"] = value
            elif label == "fre":
                figures["free"] = value
            elif label == "all":
                figures["limit"] = value
            elif label == "res":
                reserved = value
            else:
                cached = value
        allocated = figures.get("allocated")
        if reserved is not None:
            figures["reserved"] = reserved
            if allocated is not None:
                figures["reserved_unallocated"] = reserved - allocated
        elif cached is not None:
            # Before PyTorch 1.4 "cached" was the part of the reserve that held no tensor.
            figures["reserved_unallocated"] = cached
            if allocated is not None:
                figures["reserved"] = allocated + cached
    else:
        if match := find(_REQUESTED):
            figures["requested"] = _size(match)
        if match := find(_GPU_INDEX):
            figures["gpu_index"] = int(match.group(1))
        if match := find(_CAPACITY):
            figures["capacity"] = _size(match)
        if match := find(_FREE):
            figures["free"] = _size(match)
        if match := find(_PROCESS_USED):
            figures["process_used"] = _size(match)
        others = []
        for match in _OTHER_PROCESS.finditer(flat, start, end):
            others.append((int(match.group(1)), _size(match, 2)))
            last = max(last, match.end())
        figures["other_processes"] = tuple(others)
        if match := find(_ALLOWED):
            figures["limit"] = _size(match)
        allocated = find(_ALLOCATED)
        unallocated = find(_UNALLOCATED)
        if allocated:
            figures["allocated"] = _size(allocated)
        if unallocated:
            figures["reserved_unallocated"] = _size(unallocated)
        if allocated and unallocated:
            figures["reserved"] = figures["allocated"] + figures["reserved_unallocated"]
    return OOMReport(text=_finish(page, start, last, end), **figures)


# ---------------------------------------------------------------------------------------------------------
# Apple MPS: "MPS backend out of memory (MPS allocated: X, other allocations: Y, max allowed: Z). Tried ..."

_MPS = re.compile(_words("MPS backend out of memory"))
_MPS_ALLOCATED = re.compile(_words("MPS allocated:") + r"\s*" + _SIZE)
_MPS_OTHER = re.compile(_words("other allocations:") + r"\s*" + _SIZE)
_MPS_LIMIT = re.compile(_words("max allowed:") + r"\s*" + _SIZE)
_MPS_REQUESTED = re.compile(_REQUESTED.pattern + r"(?:\s*on\s*(?:private|shared)\s*pool)?")


def _read_mps(page: _Page) -> OOMReport | None:
    anchor = _MPS.search(page.flat)
    if not anchor:
        return None
    start = anchor.start()
    end = _region(page, start, _MPS)
    last = anchor.end()
    figures: dict = {}
    for name, regex in (("allocated", _MPS_ALLOCATED), ("other", _MPS_OTHER), ("limit", _MPS_LIMIT)):
        if match := regex.search(page.flat, start, end):
            figures[name] = _size(match)
            last = max(last, match.end())
    if match := _MPS_REQUESTED.search(page.flat, start, end):
        figures["requested"] = _size(match)
        last = max(last, match.end())
    other = figures.pop("other", None)
    if other is not None and "allocated" in figures:
        # "other allocations" is what the driver holds for this process beyond MPS's own tensors.
        figures["process_used"] = figures["allocated"] + other
    return OOMReport(text=_finish(page, start, last, end), device="mps", **figures)


# ---------------------------------------------------------------------------------------------------------
# PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync, a multi-line message:
#   Allocation on device 0 would exceed allowed memory. (out of memory)
#   Currently allocated     : 54.14 GiB
#   Requested               : 686.41 MiB
#   Device limit            : 79.35 GiB
#   Free (according to CUDA): 27.19 MiB
#   PyTorch limit (set by user-supplied memory fraction)
#                           : 17179869184.00 GiB

_ASYNC = re.compile(
    _words("Allocation on device") + r"\s*(\d{1,5})\s*" + _words("would exceed allowed memory")
)
_ASYNC_FIGURES = {
    "allocated": re.compile(_words("Currently allocated") + r"\s*:\s*" + _SIZE),
    "requested": re.compile(r"Requested\s*:\s*" + _SIZE),
    "capacity": re.compile(_words("Device limit") + r"\s*:\s*" + _SIZE),
    "free": re.compile(_words("Free (according to CUDA):") + r"\s*" + _SIZE),
    "limit": re.compile(_words("PyTorch limit (set by user-supplied memory fraction)") + r"\s*:\s*" + _SIZE),
}
# With no fraction set the limit prints as SIZE_MAX (17179869184.00 GiB): no limit at all.
_NO_LIMIT = 2**60


def _read_async(page: _Page) -> OOMReport | None:
    anchor = _ASYNC.search(page.flat)
    if not anchor:
        return None
    start = anchor.start()
    end = _region(page, start, _ASYNC)
    last = anchor.end()
    figures: dict = {"gpu_index": int(anchor.group(1))}
    for name, regex in _ASYNC_FIGURES.items():
        if match := regex.search(page.flat, start, end):
            figures[name] = _size(match)
            last = max(last, match.end())
    if figures.get("limit", 0) >= _NO_LIMIT:
        del figures["limit"]
    return OOMReport(text=page.text(start, last), device="cuda", source="async", **figures)


# ---------------------------------------------------------------------------------------------------------
# XLA (JAX, PyTorch/XLA, TensorFlow with XLA), on GPU and TPU

_XLA_BYTES = re.compile(
    _words("Out of memory")
    + r"\s*(?:"
    + _words("while trying to allocate")
    + r"|allocating)\s*(\d{1,30})\s*bytes"
)
_XLA_REQUEST = re.compile(
    _words("Failed to allocate request for")
    + r"\s*"
    + _SIZE
    + r"\s*\(\s*(\d{1,30})\s*B\s*\)\s*"
    + _words("on device ordinal")
    + r"\s*(\d{1,5})"
)
_XLA_BUFFER = re.compile(
    _words("Attempting to")
    + r"\s*(?:allocate|reserve)\s*"
    + _SIZE
    + r"(?:\s*"
    + _words("at the bottom of memory")
    + r")?\s*\.\s*"
    + _words("That was not possible. There are")
    + r"\s*"
    + _SIZE
    + r"\s*free"
)
# A program that does not fit at compile time. "vmem" is the TPU core's small scratch memory, whose size says
# nothing about the device's memory, so only the HBM figures are kept.
_XLA_COMPILE = re.compile(
    _words("Ran out of memory in memory space")
    + r"\s*(hbm|vmem)\s*\.\s*Used\s*"
    + _SIZE
    + r"\s*of\s*"
    + _SIZE
    + r"\s*(?:hbm|vmem)"
)


def _read_xla(page: _Page) -> OOMReport | None:
    flat = page.flat
    if match := _XLA_BYTES.search(flat):
        return OOMReport(
            text=page.text(match.start(), match.end()), requested=int(match.group(1)), source="xla"
        )
    if match := _XLA_REQUEST.search(flat):
        return OOMReport(
            text=page.text(match.start(), match.end()),
            requested=int(match.group(3)),
            gpu_index=int(match.group(4)),
            source="xla",
        )
    if match := _XLA_BUFFER.search(flat):
        return OOMReport(
            text=page.text(match.start(), match.end()),
            device="tpu",
            requested=_size(match),
            free=_size(match, 3),
            source="xla",
        )
    if match := _XLA_COMPILE.search(flat):
        figures = {}
        if match.group(1) == "hbm":
            # The whole program is what was asked for.
            figures = {"requested": _size(match, 2), "capacity": _size(match, 4)}
        return OOMReport(text=page.text(match.start(), match.end()), device="tpu", source="xla", **figures)
    return None


# ---------------------------------------------------------------------------------------------------------
# TensorFlow

_TF_DTYPE_BYTES = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "qint8": 1,
    "quint8": 1,
    "half": 2,
    "float16": 2,
    "bfloat16": 2,
    "int16": 2,
    "uint16": 2,
    "qint16": 2,
    "quint16": 2,
    "float": 4,
    "float32": 4,
    "int32": 4,
    "uint32": 4,
    "qint32": 4,
    "double": 8,
    "float64": 8,
    "int64": 8,
    "uint64": 8,
    "complex64": 8,
    "complex128": 16,
}
_TF_TENSOR = re.compile(
    r"(?i:OOM\s*when\s*allocating\s*tensor)\s*(?:with|of)\s*shape\s*\[([\d,\s]{0,200})\]"
    r"(?:\s*and\s*type\s*(" + "|".join(sorted(_TF_DTYPE_BYTES, key=len, reverse=True)) + "))?"
    r"(?:\s*on\s*[^\s]{0,200}?device:([A-Za-z_]{1,10}):(\d{1,5}))?"
    r"(?:\s*by\s*allocator\s*(\w{1,40}))?"
)
# "ran out of memory" is also logged for allocations TensorFlow retries; those say they are not a failure.
_TF_BFC = re.compile(
    _words("Allocator (")
    + r"(\w{1,40})\s*\)\s*"
    + _words("ran out of memory trying to allocate")
    + r"\s*"
    + _SIZE
    + r"(?:\s*\(\s*rounded\s*to\s*(\d{1,30})\s*\))?"
)
_TF_NOT_FAILURE = re.compile(_words("not a failure"))
_TF_GENERIC = re.compile(
    r"(?:ResourceExhaustedError|RESOURCE_EXHAUSTED|Resource\s*exhausted)\s*:\s*"
    + _words("failed to allocate memory")
)
_TF_INDEX = re.compile(r"GPU_(\d{1,5})_")


def _read_tensorflow(page: _Page) -> OOMReport | None:
    flat = page.flat
    bfc = _TF_BFC.search(flat)
    while bfc and bfc.group(4) is None and _TF_NOT_FAILURE.search(flat, bfc.end(), bfc.end() + 300):
        bfc = _TF_BFC.search(flat, bfc.end())
    tensor = _TF_TENSOR.search(flat)
    if tensor:
        figures: dict = {}
        dims, dtype, kind, index, allocator = tensor.groups()
        if dtype:
            numbers = [int(d) for d in re.findall(r"\d{1,18}", dims)]
            figures["requested"] = math.prod(numbers) * _TF_DTYPE_BYTES[dtype]
        if kind:
            figures["device"] = {"gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}.get(kind.lower().split("_")[-1])
            figures["gpu_index"] = int(index)
        elif allocator:
            if gpu := _TF_INDEX.match(allocator.upper() + "_"):
                figures.update(device="gpu", gpu_index=int(gpu.group(1)))
            elif allocator.lower() == "cpu":
                figures["device"] = "cpu"
        if bfc:
            # The allocator prints the exact byte count; the tensor's shape only gives its size.
            figures["requested"] = int(bfc.group(4)) if bfc.group(4) else _size(bfc, 2)
        return OOMReport(text=page.text(tensor.start(), tensor.end()), source="tensorflow", **figures)
    if bfc:
        gpu = _TF_INDEX.match(bfc.group(1).upper() + "_")
        return OOMReport(
            text=page.text(bfc.start(), bfc.end()),
            device="gpu" if gpu else None,
            gpu_index=int(gpu.group(1)) if gpu else None,
            requested=int(bfc.group(4)) if bfc.group(4) else _size(bfc, 2),
            source="tensorflow",
        )
    if match := _TF_GENERIC.search(flat):
        return OOMReport(text=page.text(match.start(), match.end()), source="tensorflow")
    return None


# ---------------------------------------------------------------------------------------------------------
# PyTorch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes."

_CPU = re.compile(
    _words("DefaultCPUAllocator:")
    + r"\s*(?:"
    + _words("can't allocate memory")
    + "|"
    + _words("not enough memory")
    + r")\s*:\s*"
    + _words("you tried to allocate")
    + r"\s*(\d{1,30})\s*bytes"
)


def _read_cpu(page: _Page) -> OOMReport | None:
    if match := _CPU.search(page.flat):
        return OOMReport(
            text=page.text(match.start(), match.end()), device="cpu", requested=int(match.group(1))
        )
    return None


# ---------------------------------------------------------------------------------------------------------
# The CUDA/HIP runtime or driver itself, and the libraries that allocate behind PyTorch's back

_DRIVER_BYTES = re.compile(
    _words("failed to allocate")
    + r"\s*"
    + _SIZE
    + r"\s*\(\s*(\d{1,30})\s*bytes\s*\)\s*"
    + _words("from device:")
    + r"\s*CUDA_ERROR_OUT_OF_MEMORY"
)
_DRIVER = (
    (re.compile(r"CUDA\s*(?:driver\s*)?error\s*:\s*" + _words("out of memory")), "cuda"),
    (re.compile(r"HIP\s*error\s*:\s*" + _words("out of memory")), "hip"),
    (re.compile(r"(?i:cuda\s*runtime\s*err(?:or)?\s*\(\s*2\s*\)\s*:\s*out\s*of\s*memory)"), "cuda"),
    (re.compile(r"THCudaCheck\s*FAIL[^\n]{0,300}?error\s*=\s*2\s*:\s*" + _words("out of memory")), "cuda"),
    (re.compile(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"), "cuda"),
    (re.compile(r"hipErrorOutOfMemory"), "hip"),
)
_LIBRARIES = (
    (
        re.compile(r"(?i:CUDNN_STATUS_(?:ALLOC_FAILED|INTERNAL_ERROR_DEVICE_ALLOCATION_FAILED))"),
        "cuda",
        "cudnn",
    ),
    (re.compile(r"(?i:CUDNN_STATUS_INTERNAL_ERROR_HOST_ALLOCATION_FAILED)"), "cpu", "cudnn"),
    (re.compile(r"(?i:CUBLAS_STATUS_ALLOC_FAILED)"), "cuda", "cublas"),
    (re.compile(r"(?i:HIPBLAS_STATUS_ALLOC_FAILED|rocblas_status_memory_error)"), "hip", "cublas"),
)
_CALL = re.compile(r"\s*" + _words("when calling") + r"\s*`[^`\n]{0,300}`")


def _read_driver(page: _Page) -> OOMReport | None:
    flat = page.flat
    if match := _DRIVER_BYTES.search(flat):
        return OOMReport(
            text=page.text(match.start(), match.end()),
            device="cuda",
            requested=int(match.group(3)),
            source="driver",
        )
    for regex, device in _DRIVER:
        if match := regex.search(flat):
            return OOMReport(text=page.text(match.start(), match.end()), device=device, source="driver")
    return None


def _read_library(page: _Page) -> OOMReport | None:
    for regex, device, source in _LIBRARIES:
        if match := regex.search(page.flat):
            end = match.end()
            if call := _CALL.match(page.flat, end):
                end = call.end()
            return OOMReport(text=page.text(match.start(), end), device=device, source=source)
    return None


# ---------------------------------------------------------------------------------------------------------
# Last resort: the exception's class name, as a traceback or log prints it, with a message we do not know.

_CLASS_NAME = re.compile(r"(?:torch\.(?:cuda\.)?)?OutOfMemoryError\s*:")


def _read_class_name(page: _Page) -> OOMReport | None:
    if match := _CLASS_NAME.search(page.flat):
        end = page.flat.find("\n", match.end(), match.end() + 500)
        end = end if end != -1 else min(len(page.flat), match.end() + 500)
        return OOMReport(text=page.text(match.start(), end))
    return None


# Richest first: when a log holds several messages, the one that says most about the failure wins.
_READERS = (
    _read_allocator,
    _read_mps,
    _read_async,
    _read_xla,
    _read_tensorflow,
    _read_cpu,
    _read_driver,
    _read_library,
    _read_class_name,
)
