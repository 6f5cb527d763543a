"""Out-of-memory errors: recognise them (``is_oom``) and read their figures (``parse_oom``).

Pure: imports neither torch nor IPython. The message formats, with the issue threads they were collected
from, are in ``tests/oom_corpus``. Where each part lives:

- ``oom_report``: ``OOMReport``, the record every reader returns (re-exported here).
- ``oom_text``: cleaning and re-joining the text (``Page``) and the pieces patterns are built from.
- ``oom_pytorch``: messages PyTorch writes (caching allocator old and new, also pasted from its middle; HIP,
  XPU, MPS, cudaMallocAsync, CPU allocator, bare ``OutOfMemoryError``).
- ``oom_runtimes``: everyone else's (XLA/TPU, TensorFlow, CuPy, vLLM, llama.cpp/ggml, ONNX Runtime, CUDA/HIP
  driver and managed memory, cuBLAS/cuDNN).

Every pattern starts with a keyword and every repeat in it is bounded or stops at a character it cannot
contain, so parsing is linear in the length of the text.
"""

from __future__ import annotations

from ..sizes import format_bytes
from .pytorch import read_allocator, read_async, read_class_name, read_cpu, read_mps
from .report import OOMReport
from .runtimes import (
    read_cupy,
    read_driver,
    read_ggml,
    read_library,
    read_onnxruntime,
    read_tensorflow,
    read_vllm,
    read_xla,
)
from .text import Page

__all__ = ["OOMReport", "format_emulated_oom", "is_oom", "is_runtime_oom", "parse_oom"]

# Packages whose own exception classes an out-of-memory error of theirs arrives in (torch.AcceleratorError,
# jaxlib's XlaRuntimeError, TensorFlow's ResourceExhaustedError, ...).
RUNTIMES = frozenset(
    {
        "torch", "jax", "jaxlib", "tensorflow", "keras", "cupy", "cupy_backends", "vllm", "llama_cpp",
        "onnxruntime", "triton", "numba", "mlx", "tensorrt", "tensorrt_llm", "pycuda", "cuda", "deepspeed",
        "xformers", "bitsandbytes", "flash_attn",
    }
)  # fmt: skip

# Richest first: when a log holds several messages, the one that says most about the failure wins.
_READERS = (
    read_allocator,
    read_mps,
    read_async,
    read_cupy,
    read_xla,
    read_tensorflow,
    read_vllm,
    read_ggml,
    read_onnxruntime,
    read_cpu,
    read_driver,
    read_library,
    read_class_name,
)


def parse_oom(text: str) -> OOMReport | None:
    """Read the out-of-memory message in ``text``; ``None`` when it holds none.

    ``text`` may be an exception's ``str()``, a whole traceback, a log, or a pasted and re-wrapped copy of
    any of them. Recognises the PyTorch caching allocator (CUDA, HIP, XPU; every format since 1.0; from 2.1 on
    also a message pasted from its middle), MPS, cudaMallocAsync, ``CUDA error: out of memory`` and managed
    (unified) memory failures, cuBLAS/cuDNN allocation failures, XLA/JAX (TPU memory spaces included),
    TensorFlow, CuPy, vLLM's KV-cache and start-up refusals (``ValueError``, with token figures in
    ``tokens_requested``/``tokens_capacity``), llama.cpp/ggml buffers, ONNX Runtime's arena, PyTorch's CPU
    allocator and oommagic's own emulated message. Never raises for a ``str``.
    """
    if not isinstance(text, str) or not text:
        return None
    page = Page(text)
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


def is_runtime_oom(exc: BaseException) -> bool:
    """True when ``exc`` is a runtime's own out-of-memory error, the kind ``%%gpumem`` turns into its report:
    its class says so (it or a base is named ``OutOfMemoryError``: PyTorch's, CuPy's, a cell's own), or its
    message reads as one (``parse_oom``) and its class is a built-in one (``RuntimeError`` from MPS and from
    CUDA before torch 2.8, ``ValueError`` from vLLM) or a runtime's (``torch.AcceleratorError``, JAX's
    ``XlaRuntimeError``, TensorFlow's ``ResourceExhaustedError``). A class of the cell's own whose text only
    reads like an out-of-memory message is not one: code that catches that class must still see it.
    Never raises."""
    try:
        mro = type(exc).__mro__
        if any(getattr(cls, "__name__", "") == "OutOfMemoryError" for cls in mro):
            return True
        package = (getattr(type(exc), "__module__", None) or "").partition(".")[0]
    except Exception:
        return False
    if package != "builtins" and package not in RUNTIMES:
        return False
    return is_oom(exc)


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
