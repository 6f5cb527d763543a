"""Readers for out-of-memory messages written by something other than PyTorch's allocators.

XLA (JAX, PyTorch/XLA, TensorFlow with XLA) on GPU and TPU; TensorFlow; CuPy; vLLM; llama.cpp (ggml); ONNX
Runtime; the CUDA/HIP runtime or driver (managed memory included); and the libraries that allocate behind
PyTorch's back (cuBLAS, cuDNN, hipBLAS, rocBLAS). Each ``read_*`` takes a ``Page`` and returns an
``OOMReport`` or ``None``; ``oom.parse_oom`` decides the order they are tried in. Pure: no torch, no IPython.
"""

from __future__ import annotations

import math
import re

from ..sizes import REPORTED_UNITS, reported_bytes
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
    + words("That was not possible.")
    # Loading a program says no more ("Error loading program 'jit__multi_slice': Attempting to reserve ...").
    + r"(?:\s*"
    + words("There are")
    + r"\s*"
    + SIZE
    + r"\s*free)?"
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
            free=matched_bytes(match, 3) if match.group(3) else None,
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
# The node a TF1 message names after it ("[[Node: name = Op[T=DT_FLOAT, _device=\"/job:.../gpu:0\"](...)]]",
# "[[{{node name}}]]"): where the message prints no type or device, the node's attributes may.
_TF_NODE = re.compile(r"\s*\[\[\s*(?:\{\{\s*)?(?i:node)\b[^\]]{0,2000}")
_TF_NODE_DTYPE = re.compile(r"\b(dtype|T)\s*=\s*DT_([A-Z0-9]{1,12})\b")
_TF_NODE_DEVICE = re.compile(
    r"_device\s*=\s*\"[^\"]{0,200}?(?:device:)?(GPU|gpu|CPU|cpu|TPU|tpu):(\d{1,5})\""
)


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
        node = _TF_NODE.match(flat, tensor.end())
        if node and not dtype:
            # An op's `dtype` is what it makes; `T` is its element type where it has no `dtype`.
            found = dict(m.groups() for m in _TF_NODE_DTYPE.finditer(node.group()))
            dtype = next((t.lower() for t in (found.get("dtype"), found.get("T")) if t), None)
            dtype = dtype if dtype in _TF_DTYPE_BYTES else None
        if node and not kind and (device := _TF_NODE_DEVICE.search(node.group())):
            kind, index = device.groups()
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
# TensorFlow's and XLA's stream executor with unified memory on (TF_FORCE_UNIFIED_MEMORY, JAX on GPU):
# "failed to alloc 2740606464 bytes unified memory; result: CUDA_ERROR_OUT_OF_MEMORY: out of memory".
_DRIVER_UNIFIED = re.compile(
    words("failed to alloc")
    + r"\s*(\d{1,30})\s*bytes\s*"
    + words("unified memory; result:")
    + r"\s*CUDA_ERROR_OUT_OF_MEMORY"
)
_DRIVER = (
    (re.compile(r"CUDA\s*(?:driver\s*)?error\s*:\s*" + words("out of memory")), "cuda"),
    (re.compile(r"HIP\s*error\s*:\s*" + words("out of memory")), "hip"),
    (re.compile(r"(?i:cuda\s*runtime\s*err(?:or)?\s*\(\s*2\s*\)\s*:\s*out\s*of\s*memory)"), "cuda"),
    (re.compile(r"THCudaCheck\s*FAIL[^\n]{0,300}?error\s*=\s*2\s*:\s*" + words("out of memory")), "cuda"),
    # Unified (managed) memory: cudaMallocManaged, or the driver API's cuMemAllocManaged (PyCUDA, Numba).
    (
        re.compile(
            r"(?:cudaMallocManaged|cuMemAllocManaged)\s*(?:\([^()\n]{0,200}\)\s*)?failed\s*:?\s*out\s*of\s*memory"
        ),
        "cuda",
    ),
    # ONNX Runtime's and CNTK's CUDA_CALL: "CUDA failure 2: out of memory ; GPU=0 ; hostname=... ; expr=..."
    (re.compile(r"CUDA\s*failure\s*2\s*:\s*" + words("out of memory")), "cuda"),
    (re.compile(r"CUDA_ERROR_OUT_OF_MEMORY|cudaErrorMemoryAllocation"), "cuda"),
    (re.compile(r"hipErrorOutOfMemory"), "hip"),
)
# The device a driver error names, in the words people and libraries use: "device 1", "current device: 1",
# "GPU 1", "GPU=1", "cuda:1", "CUDA1". A number followed by a dot or another digit is a version ("CUDA 12.1").
_DEVICE_INDEX = re.compile(
    r"(?<![_-])(?:(?i:device|gpu)(?:\s*[:=#]\s*|\s{0,3})|(?i:cuda|hip)\s*:\s*|(?:CUDA|ROCm)(?=\d))"
    r"(\d{1,3})(?![\d.]|\s*/)"
)
_INDEX_AFTER = 300
_INDEX_BEFORE = 80


def _device_index(page: Page, start: int, end: int) -> int | None:
    """The device index that a message at ``flat[start:end]`` names: after it, in its paragraph and at most
    ``_INDEX_AFTER`` characters on, or else the nearest one just before it ("on GPU 2: ... failed")."""
    flat = page.flat
    stop = flat.find("\n", end, end + _INDEX_AFTER)
    match = _DEVICE_INDEX.search(flat, end, stop if stop != -1 else min(len(flat), end + _INDEX_AFTER))
    if match is None:
        before = max(flat.rfind("\n", max(0, start - _INDEX_BEFORE), start) + 1, start - _INDEX_BEFORE, 0)
        for match in _DEVICE_INDEX.finditer(flat, before, start):  # noqa: B007 - the last one is kept
            pass
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
    if match := _DRIVER_UNIFIED.search(flat):
        return OOMReport(
            text=page.text(match.start(), match.end()),
            device="cuda",
            requested=int(match.group(1)),
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
            return OOMReport(
                text=page.text(match.start(), end),
                device=device,
                gpu_index=_device_index(page, match.start(), end) if device != "cpu" else None,
                source=source,
            )
    return None


# ---------------------------------------------------------------------------------------------------------
# CuPy's memory pool, and its pinned (page-locked host) pool

# A byte count as CuPy prints it since v7 ("1,234,567,168") or before (no commas).
_COUNT = r"(\d{1,3}(?:,\d{3}){1,12}|\d{1,30})"
_CUPY = re.compile(
    words("Out of memory allocating")
    + r"\s*"
    + _COUNT
    + r"\s*bytes\s*\(\s*"
    + words("allocated so far:")
    + r"\s*"
    + _COUNT
    + r"\s*bytes(?:\s*,\s*"
    + words("limit set to:")
    + r"\s*"
    + _COUNT
    + r"\s*bytes)?\s*\)"
)
_CUPY_OLD = re.compile(
    words("out of memory to allocate")
    + r"\s*(\d{1,30})\s*bytes\s*\(\s*total\s*(\d{1,30})\s*bytes(?:\s*,\s*"
    + words("limit set to")
    + r"\s*(\d{1,30})\s*bytes)?\s*\)"
)
# The pinned pool lets the CUDA runtime's error through; only the traceback above it says it was host memory.
_CUPY_RUNTIME = re.compile(
    r"CUDARuntimeError\s*:\s*cudaErrorMemoryAllocation(?:\s*:\s*" + words("out of memory") + ")?"
)
_CUPY_PINNED = re.compile(r"pinned_memory|PinnedMemory|cudaHostAlloc|hostAlloc")
_PINNED_LOOKBACK = 3000


def _count(text: str | None) -> int | None:
    return int(text.replace(",", "")) if text else None


def read_cupy(page: Page) -> OOMReport | None:
    """CuPy: ``Out of memory allocating N bytes (allocated so far: M bytes)`` (and the wording before v7),
    and the pinned pool's ``cudaErrorMemoryAllocation``. "Allocated so far" is what the pool
    holds after it has given its free blocks back: the bytes in use."""
    flat = page.flat
    match = _CUPY.search(flat) or _CUPY_OLD.search(flat)
    if match:
        return OOMReport(
            text=page.text(match.start(), match.end()),
            device="cuda",
            requested=_count(match.group(1)),
            allocated=_count(match.group(2)),
            limit=_count(match.group(3)),
            source="cupy",
        )
    seen = 0
    for match in _CUPY_RUNTIME.finditer(flat):
        # Each stretch of text is looked at once: the lookback stops where the previous error ended.
        if _CUPY_PINNED.search(flat, max(seen, match.start() - _PINNED_LOOKBACK), match.start()):
            return OOMReport(text=page.text(match.start(), match.end()), device="cpu", source="cupy")
        seen = match.end()
    return None


# ---------------------------------------------------------------------------------------------------------
# vLLM: the engine refuses to start when the KV cache does not fit. A ValueError, but an out-of-memory one.

_VLLM_NO_BLOCKS = re.compile(
    words("No available memory for the cache blocks.")
    + r"(?:\s*"
    + words("Try increasing")
    + r"\s*`?gpu_memory_utilization`?\s*"
    + words("when initializing the engine.")
    + ")?"
)
# vLLM before V1: both figures are tokens.
_VLLM_TOKENS = re.compile(
    words("max seq len (")
    + r"\s*(\d{1,12})\s*\)\s*"
    + words("is larger than the maximum number of tokens that can be stored in KV cache (")
    + r"\s*(\d{1,12})\s*\)"
)
# V1: "To serve at least one request with the models's max seq len (N), (X GiB KV cache is needed, which is
# larger than the available KV cache memory (Y GiB). Based on the available memory, the estimated maximum
# model length is M."
_VLLM_KV_MEMORY = re.compile(
    words("max seq len (")
    + r"\s*(\d{1,12})\s*\)\s*,\s*\(?\s*"
    + SIZE
    + r"\s*"
    + words("KV cache is needed, which is larger than the available KV cache memory (")
    + r"\s*"
    + SIZE
    + r"\s*\)(?:\s*\.\s*"
    + words("Based on the available memory, the estimated maximum model length is")
    + r"\s*(\d{1,12}))?"
)
_VLLM_SERVE = re.compile(words("To serve at least one request with the"))
_VLLM_ADVICE = re.compile(
    r"\s*\.?\s*"
    + words("Try increasing")
    + r"\s*`?gpu_memory_utilization`?\s*"
    + words("or decreasing")
    + r"\s*`?max_model_len`?\s*"
    + words("when initializing the engine.")
)
# "Free memory on device (7.34/139.72 GiB) on startup is less than desired GPU memory utilization (0.9,
# 125.75 GiB)." Newer releases name the device: "Free memory on device cuda:0 (...)".
_VLLM_STARTUP = re.compile(
    r"(?i:f)ree\s*"
    + words("memory on device")
    + r"\s*(?:(cuda|hip|rocm|xpu|tpu)\s*:\s*(\d{1,5})\s*)?\(\s*(\d{1,30}(?:\.\d{1,30})?)\s*/\s*"
    + SIZE
    + r"\s*\)\s*"
    + words("on startup is less than desired GPU memory utilization (")
    + r"\s*\d{1,3}(?:\.\d{1,20})?\s*,\s*"
    + SIZE
    + r"\s*\)"
)


def read_vllm(page: Page) -> OOMReport | None:
    """vLLM: free memory below ``gpu_memory_utilization`` at start, or a KV cache too small for a request."""
    flat = page.flat
    if match := _VLLM_STARTUP.search(flat):
        kind, index = match.group(1), match.group(2)
        return OOMReport(
            text=page.text(match.start(), match.end()),
            device={"rocm": "hip"}.get(kind.lower(), kind.lower()) if kind else None,
            gpu_index=int(index) if index else None,
            free=reported_bytes(match.group(3), match.group(5)),
            capacity=matched_bytes(match, 4),
            requested=matched_bytes(match, 6),
            source="vllm",
        )
    if match := _VLLM_KV_MEMORY.search(flat):
        start = match.start()
        if serve := _VLLM_SERVE.search(flat, max(0, start - 80), start):
            start = serve.start()
        end = match.end()
        if advice := _VLLM_ADVICE.match(flat, end):
            end = advice.end()
        return OOMReport(
            text=page.text(start, end),
            requested=matched_bytes(match, 2),
            free=matched_bytes(match, 4),
            tokens_requested=int(match.group(1)),
            tokens_capacity=int(match.group(6)) if match.group(6) else None,
            source="vllm",
        )
    if match := _VLLM_TOKENS.search(flat):
        start = match.start()
        if model := re.compile(r"The\s*model\S{0,3}s\s*").search(flat, max(0, start - 20), start):
            start = model.start()
        end = match.end()
        if advice := _VLLM_ADVICE.match(flat, end):
            end = advice.end()
        return OOMReport(
            text=page.text(start, end),
            tokens_requested=int(match.group(1)),
            tokens_capacity=int(match.group(2)),
            source="vllm",
        )
    if match := _VLLM_NO_BLOCKS.search(flat):
        return OOMReport(text=page.text(match.start(), match.end()), source="vllm")
    return None


# ---------------------------------------------------------------------------------------------------------
# llama.cpp and the other ggml programs (whisper.cpp, ollama): a backend buffer that could not be allocated
#   ggml_backend_cuda_buffer_type_alloc_buffer: allocating 9866.00 MiB on device 1: cudaMalloc failed:
#       out of memory
#   ggml_gallocr_reserve_n: failed to allocate CUDA1 buffer of size 10345253120
#   llama_model_load: error loading model: unable to allocate CUDA0 buffer

# ggml's backend names: CUDA builds say CUDA0, ROCm builds ROCm0 (with the same "cudaMalloc failed" line).
_GGML_DEVICES = {
    "cuda": "cuda",
    "rocm": "hip",
    "sycl": "xpu",
    "vulkan": "gpu",
    "metal": "mps",
    "mtl": "mps",
    "cpu": "cpu",
}
_GGML_BACKEND = r"(CUDA|ROCm|SYCL|Vulkan|Metal|MTL|CPU)(_Host)?(\d{0,5})"
_GGML_MALLOC = re.compile(
    words("allocating")
    + r"\s*"
    + SIZE
    + r"\s*on\s*device\s*(\d{1,5})\s*:\s*"
    + r"(?:cudaMalloc|hipMalloc)\s*failed\s*:\s*"
    + words("out of memory")
)
_GGML_BUFFER = re.compile(
    words("failed to allocate") + r"\s*" + _GGML_BACKEND + r"\s*buffer\s*of\s*size\s*(\d{1,30})"
)
_GGML_UNABLE = re.compile(words("unable to allocate") + r"\s*(?:" + _GGML_BACKEND + r"\s*|backend\s*)buffer")
_GGML_SPAN = 1500


def read_ggml(page: Page) -> OOMReport | None:
    """llama.cpp / ggml: ``cudaMalloc failed: out of memory``, ``failed to allocate CUDA0 buffer of size N``,
    ``unable to allocate backend buffer``; the exact byte count wins over the rounded MiB."""
    flat = page.flat
    found = [m for m in (regex.search(flat) for regex in (_GGML_MALLOC, _GGML_BUFFER, _GGML_UNABLE)) if m]
    if not found:
        return None
    start = min(m.start() for m in found)
    stop = flat.find("\n", start, start + _GGML_SPAN)
    end = stop if stop != -1 else min(len(flat), start + _GGML_SPAN)
    malloc, buffer, unable = (
        regex.search(flat, start, end) for regex in (_GGML_MALLOC, _GGML_BUFFER, _GGML_UNABLE)
    )
    figures: dict = {}
    last = start
    if malloc:
        figures.update(device="cuda", requested=matched_bytes(malloc), gpu_index=int(malloc.group(3)))
        last = malloc.end()
    for match, size in ((unable, None), (buffer, 4)):
        if not match:
            continue
        last = max(last, match.end())
        if match.group(1):
            host = bool(match.group(2))
            figures["device"] = "cpu" if host else _GGML_DEVICES[match.group(1).lower()]
            if match.group(3) and not host:
                figures["gpu_index"] = int(match.group(3))
        if size:
            figures["requested"] = _exact(match.group(size), malloc)
    return OOMReport(text=page.text(start, last), source="ggml", **figures)


def _exact(digits: str, malloc: re.Match | None) -> int:
    """The exact byte count ``digits``; where the line break after it was removed and the next line began
    with digits (a timestamp), the longest part of it that the rounded size of ``malloc`` agrees with."""
    if malloc is None:
        return int(digits)
    rounded, half_step = matched_bytes(malloc), REPORTED_UNITS[malloc.group(2)] // 200 + 1
    for end in range(len(digits), 0, -1):
        if abs(int(digits[:end]) - rounded) <= half_step:
            return int(digits[:end])
    return int(digits)


# ---------------------------------------------------------------------------------------------------------
# ONNX Runtime's arena (BFCArena), on CPU or CUDA
#   ... bfc_arena.cc:376 ... Failed to allocate memory for requested buffer of size 8388608000
#   ... Available memory of 0 is smaller than requested bytes of 2048       (an arena with max_mem set)
# Its CUDA calls fail as "CUDA failure 2: out of memory ; GPU=0 ; ...", which read_driver reads.

_ORT_BUFFER = re.compile(words("Failed to allocate memory for requested buffer of size") + r"\s*(\d{1,30})")
_ORT_AVAILABLE = re.compile(
    words("Available memory of")
    + r"\s*(\d{1,30})\s*"
    + words("is smaller than requested bytes of")
    + r"\s*(\d{1,30})"
)


def read_onnxruntime(page: Page) -> OOMReport | None:
    """ONNX Runtime's BFCArena: a buffer the arena could not get, or one over the arena's limit."""
    if match := _ORT_AVAILABLE.search(page.flat):
        return OOMReport(
            text=page.text(match.start(), match.end()),
            requested=int(match.group(2)),
            free=int(match.group(1)),
            source="onnxruntime",
        )
    if match := _ORT_BUFFER.search(page.flat):
        return OOMReport(
            text=page.text(match.start(), match.end()), requested=int(match.group(1)), source="onnxruntime"
        )
    return None
