"""Readers for the out-of-memory messages PyTorch writes itself.

The caching allocator on CUDA, HIP (ROCm builds) and XPU, in its format up to 2.0 and from 2.1 on, and
oommagic's emulated CPU device; Apple MPS; ``backend:cudaMallocAsync``; the CPU allocator; and, as a last
resort, a bare ``OutOfMemoryError:``. Each ``read_*`` takes a ``Page`` and returns an ``OOMReport`` or
``None``; ``oom.parse_oom`` decides the order they are tried in. Pure: no torch, no IPython.
"""

from __future__ import annotations

import re

from .report import OOMReport
from .text import LEAD, SIZE, Page, matched_bytes, words

# ---------------------------------------------------------------------------------------------------------
# The caching allocator: CUDA, HIP (ROCm builds), XPU, and oommagic's emulated CPU device


_DEVICE_NAMES = {"CUDA": "cuda", "HIP": "hip", "XPU": "xpu", "CPU": "cpu"}
_ALLOCATOR = re.compile(
    r"(CUDA|HIP|XPU|CPU)\s*"
    + words("out of memory")
    + r"\s*(?:\.|\(\s*"
    + words("emulated by oommagic")
    + ")"
)
# A message whose first words were cut off still shows the allocator's figures.
_ALLOCATOR_HEADLESS = re.compile(
    words("Tried to allocate") + r"\s*" + SIZE + r"\s*(?:\(\s*GPU\s*\d|\.\s*GPU\s*\d{1,5}\s*has)"
)
# A message pasted from its middle on: the first of the allocator's (>= 2.1) sentences that is left. Each
# names PyTorch, or is followed by a sentence that does, so that prose about free memory is not a message.
_PYTORCH_NEXT = r"(?=\s*(?:Including\s*non-PyTorch|Process\s*\d|Of\s*the\s*allocated|\d[^\n]{0,30}allowed))"
_ALLOCATOR_TAIL = (
    re.compile(r"(?:GPU|Device)\s*\d{1,5}\s*" + words("has a total") + r"\s*capaci?ty\s*of\s*" + SIZE),
    re.compile(LEAD + SIZE + r"\s*is\s*free\s*\." + _PYTORCH_NEXT),
    re.compile(words("Including non-PyTorch memory, this process has")),
    re.compile(r"Process\s*\d{1,10}\s*has\s*" + SIZE + r"\s*" + words("memory in use.") + _PYTORCH_NEXT),
    re.compile(words("Of the allocated memory") + r"\s*" + SIZE + r"\s*" + words("is allocated by PyTorch")),
    re.compile(LEAD + SIZE + r"\s*" + words("is reserved by PyTorch but unallocated")),
)
# A word each of those sentences holds whole, however it was wrapped: a cheap test before the pattern.
_TAIL_WORDS = ("capac", "free", "Including", "Process", "allocated", "unallocated")
# Wording only CUDA's (and HIP's, which is CUDA's hipified) allocator prints; XPU's has none of it.
_CUDA_WORDING = re.compile(
    r"of\s*which|is\s*free\s*\.|Including\s*non-PyTorch|Process\s*\d|PYTORCH_CUDA_ALLOC_CONF|"
    r"max_split_size_mb|expandable_segments"
)
_XPU_WORDING = re.compile(words("Please use `empty_cache` to release all unoccupied cached memory"))
_TAIL_FREE = re.compile(LEAD + SIZE + r"\s*is\s*free")
# Intel's extension refuses single blocks over 4 GB in the same words: a size limit, not a full device.
_BLOCK_LIMIT = re.compile(words("can NOT allocate memory block"))

_EMULATED_LIMIT = re.compile(r"%%gpumem\s*--limit\s*" + SIZE)
_REQUESTED = re.compile(words("Tried to allocate") + r"\s*" + SIZE)
# PyTorch <= 2.0: "Tried to allocate X (GPU 0; Y total capacity; Z already allocated; W free; V reserved ...)"
_OLD_FIGURES = re.compile(
    words("Tried to allocate") + r"\s*" + SIZE + r"\s*\(\s*GPU\s*(\d{1,5})\s*;([^()\n]{0,600})(\))?"
)
_OLD_ITEM = re.compile(
    r"\s*" + SIZE + r"\s*(total\s*capacity|already\s*allocated|free|allowed|reserved|cached)"
)
# PyTorch >= 2.1 ("capacty" in 2.1).
_GPU_INDEX = re.compile(r"(?:GPU|CPU|XPU|Device)\s*(\d{1,5})\s*" + words("has a total") + r"\s*capaci?ty")
_CAPACITY = re.compile(words("has a total") + r"\s*capaci?ty\s*of\s*" + SIZE)
_FREE = re.compile(words("of which") + r"\s*" + SIZE + r"\s*is\s*free")
_PROCESS_USED = re.compile(words("this process has") + r"\s*" + SIZE + r"\s*" + words("memory in use"))
_OTHER_PROCESS = re.compile(r"Process\s*(\d{1,10})\s*has\s*" + SIZE + r"\s*" + words("memory in use"))
_ALLOWED = re.compile(LEAD + SIZE + r"\s*allowed")
_ALLOCATED = re.compile(words("Of the allocated memory") + r"\s*" + SIZE + r"\s*" + words("is allocated by"))
_UNALLOCATED = re.compile(
    r"(?:and\s*)?" + LEAD + SIZE + r"\s*" + words("is reserved by PyTorch but unallocated")
)
_HINT = re.compile(
    r"[.)]?\s*(?:If\s*reserved|Please\s*use|Use\s*PYTORCH_MPS)[^\n]{0,600}?"
    r"(?:https?://[^\s()]{1,200}\)|PYTORCH_(?:CUDA|HIP)_ALLOC_CONF(?!\s*=)|cached\s*memory\.|failure\)\.?)"
)
_MESSAGE_SPAN = 4000


def _region(page: Page, start: int, anchor: re.Pattern) -> int:
    """Where the message that starts at ``start`` ends at the latest: the paragraph's end, the next message
    of the same kind, or a length no message reaches."""
    end = min(len(page.flat), start + _MESSAGE_SPAN)
    stop = page.flat.find("\n", start, end)
    if stop != -1:
        end = stop
    nxt = anchor.search(page.flat, start + 1, end)
    return nxt.start() if nxt else end


def _finish(page: Page, start: int, last: int, end: int) -> str:
    """The message text: from its anchor to its last figure, plus PyTorch's advice sentence if it follows."""
    hint = _HINT.match(page.flat, last, end)
    if hint:
        last = hint.end()
    elif last < end and page.flat[last] in ".)":
        last += 1
    return page.text(start, last)


def read_allocator(page: Page) -> OOMReport | None:
    """The caching allocator's message (CUDA, HIP, XPU, emulated; any format since 1.0), even headless."""
    flat = page.flat
    anchor = _ALLOCATOR.search(flat)
    device = None
    tail = False
    if anchor:
        device = _DEVICE_NAMES[anchor.group(1)]
        pattern = _ALLOCATOR
    else:
        anchor = _ALLOCATOR_HEADLESS.search(flat)
        while anchor and _BLOCK_LIMIT.search(flat, max(0, anchor.start() - 120), anchor.start()):
            anchor = _ALLOCATOR_HEADLESS.search(flat, anchor.end())
        device = "gpu"
        pattern = _ALLOCATOR_HEADLESS
        if not anchor:
            found = [
                (m.start(), i, m)
                for i, (r, word) in enumerate(zip(_ALLOCATOR_TAIL, _TAIL_WORDS, strict=True))
                if word in flat and (m := r.search(flat))
            ]
            if not found:
                return None
            _, which, anchor = min(found, key=lambda item: item[:2])
            pattern = _ALLOCATOR_TAIL[which]
            tail = True
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
            figures["limit"] = matched_bytes(match)

    if old := find(_OLD_FIGURES):
        figures["requested"] = matched_bytes(old)
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
            label, value = match.group(3)[:3], matched_bytes(match)
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
            figures["requested"] = matched_bytes(match)
        if match := find(_GPU_INDEX):
            figures["gpu_index"] = int(match.group(1))
        if match := find(_CAPACITY):
            figures["capacity"] = matched_bytes(match)
        if (match := find(_FREE)) or (tail and (match := _TAIL_FREE.match(flat, start))):
            figures["free"] = matched_bytes(match)
            last = max(last, match.end())
        if match := find(_PROCESS_USED):
            figures["process_used"] = matched_bytes(match)
        others = []
        for match in _OTHER_PROCESS.finditer(flat, start, end):
            others.append((int(match.group(1)), matched_bytes(match, 2)))
            last = max(last, match.end())
        figures["other_processes"] = tuple(others)
        if match := find(_ALLOWED):
            figures["limit"] = matched_bytes(match)
        allocated = find(_ALLOCATED)
        unallocated = find(_UNALLOCATED)
        if allocated:
            figures["allocated"] = matched_bytes(allocated)
        if unallocated:
            figures["reserved_unallocated"] = matched_bytes(unallocated)
        if allocated and unallocated:
            figures["reserved"] = figures["allocated"] + figures["reserved_unallocated"]
    text = _finish(page, start, last, end)
    if tail:
        # The device's name went with the first words; the wording still tells CUDA's allocator (or HIP's,
        # or XPU's). With only the last sentence, which all three print, it stays "gpu".
        if "PYTORCH_HIP_ALLOC_CONF" in flat[start:end]:
            figures["device"] = "hip"
        elif _CUDA_WORDING.search(flat, start, end):
            figures["device"] = "cuda"
        elif _XPU_WORDING.search(flat, start, end):
            figures["device"] = "xpu"
    return OOMReport(text=text, **figures)


# ---------------------------------------------------------------------------------------------------------
# Apple MPS: "MPS backend out of memory (MPS allocated: X, other allocations: Y, max allowed: Z). Tried ..."

_MPS = re.compile(words("MPS backend out of memory"))
_MPS_ALLOCATED = re.compile(words("MPS allocated:") + r"\s*" + SIZE)
_MPS_OTHER = re.compile(words("other allocations:") + r"\s*" + SIZE)
_MPS_LIMIT = re.compile(words("max allowed:") + r"\s*" + SIZE)
_MPS_REQUESTED = re.compile(_REQUESTED.pattern + r"(?:\s*on\s*(?:private|shared)\s*pool)?")


def read_mps(page: Page) -> OOMReport | None:
    """Apple MPS: ``MPS backend out of memory (MPS allocated: ...)``."""
    anchor = _MPS.search(page.flat)
    if not anchor:
        return None
    start = anchor.start()
    end = _region(page, start, _MPS)
    last = anchor.end()
    figures: dict = {}
    for name, regex in (("allocated", _MPS_ALLOCATED), ("other", _MPS_OTHER), ("limit", _MPS_LIMIT)):
        if match := regex.search(page.flat, start, end):
            figures[name] = matched_bytes(match)
            last = max(last, match.end())
    if match := _MPS_REQUESTED.search(page.flat, start, end):
        figures["requested"] = matched_bytes(match)
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

_ASYNC = re.compile(words("Allocation on device") + r"\s*(\d{1,5})\s*" + words("would exceed allowed memory"))
_ASYNC_FIGURES = {
    "allocated": re.compile(words("Currently allocated") + r"\s*:\s*" + SIZE),
    "requested": re.compile(r"Requested\s*:\s*" + SIZE),
    "capacity": re.compile(words("Device limit") + r"\s*:\s*" + SIZE),
    "free": re.compile(words("Free (according to CUDA):") + r"\s*" + SIZE),
    "limit": re.compile(words("PyTorch limit (set by user-supplied memory fraction)") + r"\s*:\s*" + SIZE),
}
# With no fraction set the limit prints as SIZE_MAX (17179869184.00 GiB): no limit at all.
_NO_LIMIT = 2**60


def read_async(page: Page) -> OOMReport | None:
    """``backend:cudaMallocAsync``: ``Allocation on device N would exceed allowed memory``."""
    anchor = _ASYNC.search(page.flat)
    if not anchor:
        return None
    start = anchor.start()
    end = _region(page, start, _ASYNC)
    last = anchor.end()
    figures: dict = {"gpu_index": int(anchor.group(1))}
    for name, regex in _ASYNC_FIGURES.items():
        if match := regex.search(page.flat, start, end):
            figures[name] = matched_bytes(match)
            last = max(last, match.end())
    if figures.get("limit", 0) >= _NO_LIMIT:
        del figures["limit"]
    return OOMReport(text=page.text(start, last), device="cuda", source="async", **figures)


# ---------------------------------------------------------------------------------------------------------
# PyTorch's CPU allocator: "DefaultCPUAllocator: can't allocate memory: you tried to allocate N bytes."

_CPU = re.compile(
    words("DefaultCPUAllocator:")
    + r"\s*(?:"
    + words("can't allocate memory")
    + "|"
    + words("not enough memory")
    + r")\s*:\s*"
    + words("you tried to allocate")
    + r"\s*(\d{1,30})\s*bytes"
)


def read_cpu(page: Page) -> OOMReport | None:
    """PyTorch's CPU allocator: ``DefaultCPUAllocator: can't allocate memory``."""
    if match := _CPU.search(page.flat):
        return OOMReport(
            text=page.text(match.start(), match.end()), device="cpu", requested=int(match.group(1))
        )
    return None


# ---------------------------------------------------------------------------------------------------------
# Last resort: the exception's class name, as a traceback or log prints it, with a message we do not know.

_CLASS_NAME = re.compile(r"(?:torch\.(?:cuda\.)?)?OutOfMemoryError\s*:")


def read_class_name(page: Page) -> OOMReport | None:
    """A bare ``OutOfMemoryError:`` whose message no other reader knows; no figures."""
    if match := _CLASS_NAME.search(page.flat):
        end = page.flat.find("\n", match.end(), match.end() + 500)
        end = end if end != -1 else min(len(page.flat), match.end() + 500)
        return OOMReport(text=page.text(match.start(), end))
    return None
