"""Readers for out-of-memory messages written by something other than PyTorch's allocators.

XLA (JAX, PyTorch/XLA, TensorFlow with XLA) on GPU and TPU; TensorFlow; CuPy; vLLM; llama.cpp (ggml); ONNX
Runtime; the CUDA/HIP runtime or driver (managed memory included); and the libraries that allocate behind
PyTorch's back (cuBLAS, cuDNN, hipBLAS, rocBLAS). Each ``read_*`` takes a ``Page`` and returns an
``OOMReport`` or ``None``; ``oom.parse_oom`` decides the order they are tried in. Pure: no torch, no IPython.
"""

from __future__ import annotations

import bisect
import math
import re

from ..sizes import reported_bytes
from .report import OOMReport
from .text import SIZE, Page, matched_bytes, words

# ---------------------------------------------------------------------------------------------------------
# XLA (JAX, PyTorch/XLA, TensorFlow with XLA), on GPU and TPU

_XLA_BYTES = re.compile(
    words("Out of memory")
    + r"\s*(?:"
    + words("while trying to allocate")
    + r"|allocating)\s*(\d{1,30})\s*bytes"
)
_XLA_REQUEST = re.compile(
    words("Failed to allocate request for")
    + r"\s*"
    + SIZE
    + r"\s*\(\s*(\d{1,30})\s*B\s*\)\s*"
    + words("on device ordinal")
    + r"\s*(\d{1,5})"
)
_XLA_BUFFER = re.compile(
    words("Attempting to")
    + r"\s*(?:allocate|reserve)\s*"
    + SIZE
    + r"(?:\s*"
    + words("at the bottom of memory")
    + r")?\s*\.\s*"
    + words("That was not possible. There are")
    + r"\s*"
    + SIZE
    + r"\s*free"
)
# A program that does not fit at compile time. "vmem" and "smem" are the TPU core's small vector and scalar
# scratch memories, whose sizes say nothing about the device's memory, so only the HBM figures are kept. Older
# releases print no figures ("Ran out of memory in memory space smem. It should not be possible ...").
_XLA_COMPILE = re.compile(
    words("Ran out of memory in memory space")
    + r"\s*(hbm|vmem|smem)(?:\s*\.\s*Used\s*"
    + SIZE
    + r"\s*of\s*"
    + SIZE
    + r"\s*(?:hbm|vmem|smem))?"
)


def read_xla(page: Page) -> OOMReport | None:
    """XLA on GPU or TPU: a failed allocation, a buffer that did not fit, or a program too big for HBM."""
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
            requested=matched_bytes(match),
            free=matched_bytes(match, 3),
            source="xla",
        )
    if match := _XLA_COMPILE.search(flat):
        figures = {}
        if match.group(1) == "hbm" and match.group(2):
            # The whole program is what was asked for.
            figures = {"requested": matched_bytes(match, 2), "capacity": matched_bytes(match, 4)}
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
    words("Allocator (")
    + r"(\w{1,40})\s*\)\s*"
    + words("ran out of memory trying to allocate")
    + r"\s*"
    + SIZE
    + r"(?:\s*\(\s*rounded\s*to\s*(\d{1,30})\s*\))?"
)
_TF_NOT_FAILURE = re.compile(words("not a failure"))
_TF_GENERIC = re.compile(
    r"(?:ResourceExhaustedError|RESOURCE_EXHAUSTED|Resource\s*exhausted)\s*:\s*"
    + words("failed to allocate memory")
)
_TF_INDEX = re.compile(r"GPU_(\d{1,5})_")


def read_tensorflow(page: Page) -> OOMReport | None:
    """TensorFlow: ``OOM when allocating tensor``, the BFC allocator's log, ``ResourceExhaustedError``."""
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
            figures["requested"] = int(bfc.group(4)) if bfc.group(4) else matched_bytes(bfc, 2)
        return OOMReport(text=page.text(tensor.start(), tensor.end()), source="tensorflow", **figures)
    if bfc:
        gpu = _TF_INDEX.match(bfc.group(1).upper() + "_")
        return OOMReport(
            text=page.text(bfc.start(), bfc.end()),
            device="gpu" if gpu else None,
            gpu_index=int(gpu.group(1)) if gpu else None,
            requested=int(bfc.group(4)) if bfc.group(4) else matched_bytes(bfc, 2),
            source="tensorflow",
        )
    if match := _TF_GENERIC.search(flat):
        return OOMReport(text=page.text(match.start(), match.end()), source="tensorflow")
    return None


# ---------------------------------------------------------------------------------------------------------
# The CUDA/HIP runtime or driver itself, and the libraries that allocate behind PyTorch's back

_DRIVER_BYTES = re.compile(
    words("failed to allocate")
    + r"\s*"
    + SIZE
    + r"\s*\(\s*(\d{1,30})\s*bytes\s*\)\s*"
    + words("from device:")
    + r"\s*CUDA_ERROR_OUT_OF_MEMORY"
)
_DRIVER = (
    (re.compile(r"CUDA\s*(?:driver\s*)?error\s*:\s*" + words("out of memory")), "cuda"),
    (re.compile(r"HIP\s*error\s*:\s*" + words("out of memory")), "hip"),
    (re.compile(r"(?i:cuda\s*runtime\s*err(?:or)?\s*\(\s*2\s*\)\s*:\s*out\s*of\s*memory)"), "cuda"),
    (re.compile(r"THCudaCheck\s*FAIL[^\n]{0,300}?error\s*=\s*2\s*:\s*" + words("out of memory")), "cuda"),
    # Unified (managed) memory: cudaMallocManaged, or the driver API's cuMemAllocManaged (PyCUDA, Numba).
    (re.compile(r"(?:cudaMallocManaged|cuMemAllocManaged)\s*(?:\([^()\n]{0,200}\)\s*)?failed\s*:?\s*out\s*of\s*memory"), "cuda"),
    # ONNX Runtime's and CNTK's CUDA_CALL: "CUDA failure 2: out of memory ; GPU=0 ; hostname=... ; expr=..."
    (re.compile(r"CUDA\s*failure\s*2\s*:\s*" + words("out of memory")), "cuda"),
    (re.compile(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"), "cuda"),
    (re.compile(r"hipErrorOutOfMemory"), "hip"),
)
# The device a driver error names, in the words people and libraries use: "device 1", "current device: 1",
# "GPU 1", "GPU=1", "cuda:1", "CUDA1". A number followed by a dot or another digit is a version ("CUDA 12.1").
_DEVICE_INDEX = re.compile(
    r"(?<![\w-])(?:(?i:device|gpu)(?:\s*[:=#]\s*|[ ]{1,3})|(?i:cuda|hip)\s*:\s*|(?:CUDA|ROCm)(?=\d))(\d{1,3})(?![\d.:]|\s*/)"
)
_INDEX_AFTER = 300


def _device_index(page: Page, start: int, end: int) -> int | None:
    """The device index that a message at ``flat[start:end]`` names: after it, in its paragraph and at most
    ``_INDEX_AFTER`` characters on, or before it on its own line."""
    flat = page.flat
    stop = flat.find("\n", end, end + _INDEX_AFTER)
    match = _DEVICE_INDEX.search(flat, end, stop if stop != -1 else min(len(flat), end + _INDEX_AFTER))
    if match is None:
        at = bisect.bisect_right(page.breaks, start) - 1
        line_start = page.breaks[at] if at >= 0 else 0
        line_start = max(line_start, flat.rfind("\n", 0, start) + 1)
        match = _DEVICE_INDEX.search(flat, line_start, start)
    return int(match.group(1)) if match else None


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
_CALL = re.compile(r"\s*" + words("when calling") + r"\s*`[^`\n]{0,300}`")


def read_driver(page: Page) -> OOMReport | None:
    """The CUDA/HIP runtime or driver: ``CUDA error: out of memory``, ``CUDA_ERROR_OUT_OF_MEMORY`` and kin."""
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
            return OOMReport(
                text=page.text(match.start(), match.end()),
                device=device,
                gpu_index=_device_index(page, match.start(), match.end()),
                source="driver",
            )
    return None


def read_library(page: Page) -> OOMReport | None:
    """cuBLAS, cuDNN, hipBLAS or rocBLAS failing to allocate their workspace."""
    for regex, device, source in _LIBRARIES:
        if match := regex.search(page.flat):
            end = match.end()
            if call := _CALL.match(page.flat, end):
                end = call.end()
            return OOMReport(text=page.text(match.start(), end), device=device, source=source)
    return None
