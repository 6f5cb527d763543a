"""parse_oom and is_oom against real messages from public issue threads (tests/oom_corpus), the same messages
as people paste them (wrapped, quoted, coloured, behind log prefixes, inside tracebacks), and oommagic's own
emulated message."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest
from hypothesis import given
from hypothesis import strategies as st

from oommagic.oom import OOMReport, format_emulated_oom, is_oom, parse_oom
from oommagic.sizes import format_bytes, parse_reported_size

CORPUS = pathlib.Path(__file__).parent / "oom_corpus"
ENTRIES = json.loads((CORPUS / "corpus.json").read_text(encoding="utf-8"))["messages"]
OOM_ENTRIES = [e for e in ENTRIES if e["expect"] is not None]
NOT_OOM_ENTRIES = [e for e in ENTRIES if e["expect"] is None]
DEFAULTS = {"other_processes": [], "source": "allocator", "emulated": False}
GiB = 1024**3
MiB = 1024**2


def message(entry: dict) -> str:
    return (CORPUS / entry["file"]).read_text(encoding="utf-8")


def figures(report: OOMReport) -> dict:
    data = report.to_json()
    del data["text"]
    return data


def expected(entry: dict) -> dict:
    return {key: entry["expect"].get(key, DEFAULTS.get(key)) for key in figures(OOMReport(text=""))}


def squeeze(text: str) -> str:
    return " ".join(text.split())


def test_corpus_covers_the_formats_the_issue_asks_for():
    assert len(OOM_ENTRIES) >= 40 and len(NOT_OOM_ENTRIES) >= 10
    sources = {e["expect"].get("source", "allocator") for e in OOM_ENTRIES}
    devices = {e["expect"].get("device") for e in OOM_ENTRIES}
    assert sources >= {"allocator", "async", "driver", "cublas", "cudnn", "xla", "tensorflow"}
    assert sources >= {"cupy", "vllm", "ggml", "onnxruntime"}
    assert devices >= {"cuda", "hip", "xpu", "mps", "cpu", "gpu", "tpu"}
    assert all(e["url"].startswith("https://github.com/") for e in ENTRIES)
    # Copied messages and messages written in a thread's format are told apart.
    assert all(e.get("written", False) in (True, False) for e in ENTRIES)


@pytest.mark.parametrize("entry", OOM_ENTRIES, ids=lambda e: e["file"])
def test_real_message_gives_the_figures_it_prints(entry):
    report = parse_oom(message(entry))
    assert report is not None
    assert figures(report) == expected(entry)
    # The text is the message itself, not its surroundings: each of its lines (a log prefix on every line
    # of a message spanning several, as docker compose writes, is not part of it).
    assert report.text and all(squeeze(line) in squeeze(message(entry)) for line in report.text.splitlines())


@pytest.mark.parametrize("entry", NOT_OOM_ENTRIES, ids=lambda e: e["file"])
def test_other_errors_and_prose_are_not_out_of_memory(entry):
    assert parse_oom(message(entry)) is None


# --- the same messages as people paste them -----------------------------------------------------------


def hard_wrap(text: str, width: int = 37) -> str:
    """Breaks each line every ``width`` characters, mid-word included, as a terminal or mail client does."""
    return "\n".join(
        line[i : i + width] for line in text.split("\n") for i in range(0, max(len(line), 1), width)
    )


def each_line(prefix: str):
    return lambda text: "\n".join(prefix + line for line in text.split("\n"))


TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/tmp/ipykernel_4242/1337.py", line 3, in <module>\n'
    "    trainer.train()\n"
    '  File "/usr/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1501, in _call_impl\n'
    "    return forward_call(*args, **kwargs)\n"
    "{}\n\n"
    "During handling of the above exception, another exception occurred:\n\n"
    "Traceback (most recent call last):\n"
    '  File "<stdin>", line 1, in <module>\n'
    "KeyboardInterrupt\n"
)

DISGUISES = {
    "wrapped mid-word": hard_wrap,
    "wrapped narrow": lambda t: hard_wrap(t, 11),
    "coloured": lambda t: "\x1b[1;31m" + t.replace(" ", " \x1b[0m", 3) + "\x1b[0m",
    "coloured and wrapped": lambda t: "\n".join(
        "\x1b[31m" + line + "\x1b[0m" for line in hard_wrap(t).split("\n")
    ),
    "markdown quote": lambda t: each_line("> ")(hard_wrap(t, 60)),
    "nested quote": lambda t: each_line("> > ")(t),
    "torchrun rank prefix": lambda t: each_line("[rank0]: ")(hard_wrap(t, 80)),
    "log prefix": lambda t: each_line("2024-01-01 12:00:00 ERROR ")(hard_wrap(t, 50)),
    "logging module prefix": lambda t: each_line("ERROR:root:")(t),
    "ray worker prefix": lambda t: each_line("(RayTrainWorker pid=1234, ip=10.0.0.1) ")(hard_wrap(t, 70)),
    "backticks": lambda t: "`" + t + "`",
    "code fence": lambda t: "```python-traceback\n" + t + "\n```",
    "traceback": lambda t: TRACEBACK.format(t),
    "windows line ends": lambda t: t.replace("\n", "\r\n"),
    "indented": each_line("    "),
}


@pytest.mark.parametrize("disguise", DISGUISES, ids=str)
@pytest.mark.parametrize("entry", OOM_ENTRIES, ids=lambda e: e["file"])
def test_pasted_message_gives_the_same_figures(entry, disguise):
    original = parse_oom(message(entry))
    pasted = parse_oom(DISGUISES[disguise](message(entry)))
    assert pasted is not None
    assert figures(pasted) == figures(original)
    # Same words; only the line breaks differ. A ">>" of PyTorch's advice ("reserved memory is >> allocated")
    # that a wrap puts at the start of a line reads as a quote mark and goes. A log prefix wider than a narrow
    # wrap is cut by it and reads as words of the message: the figures hold all the same.
    if not (disguise == "wrapped narrow" and entry["file"] in PREFIX_WIDER_THAN_NARROW_WRAP):
        assert glyphs(pasted.text) == glyphs(original.text)


# Messages whose every line carries a log prefix of more than 11 characters ("deep-seek-1  | ",
# "1.06.520.077 E ").
PREFIX_WIDER_THAN_NARROW_WRAP = {"oom/ggml-timestamped-device1.txt", "oom/ggml-compose-device1.txt"}


def glyphs(text: str) -> str:
    return "".join(text.split()).replace(">", "")


@pytest.mark.parametrize("entry", NOT_OOM_ENTRIES, ids=lambda e: e["file"])
def test_pasted_non_oom_stays_not_oom(entry):
    for disguise in DISGUISES.values():
        assert parse_oom(disguise(message(entry))) is None


def test_wrap_inside_a_word_of_the_issue_example():
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allo\ncate 2.00 GiB. GPU 0 has a total capac\n"
        "ity of 7.7\n9 GiB of which 1.2 GiB is fr\nee."
    )
    report = parse_oom(text)
    assert (report.requested, report.capacity, report.free) == (2 * GiB, round(7.79 * GiB), round(1.2 * GiB))
    assert report.text.startswith("CUDA out of memory. Tried to allo\ncate")


# --- formats composed from PyTorch's own format strings (no public copy found) --------------------------


def test_old_format_with_a_memory_fraction():
    # c10/cuda/CUDACachingAllocator.cpp before 2.1: "allowed" appears when a per-process fraction is set.
    report = parse_oom(
        "CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 11.91 GiB total capacity; 4.74 GiB already "
        "allocated; 6.61 GiB free; 4.77 GiB allowed; 4.74 GiB reserved in total by PyTorch)"
    )
    assert report.limit == round(4.77 * GiB)
    assert report.reserved == round(4.74 * GiB) and report.reserved_unallocated == 0
    assert report.free == round(6.61 * GiB)


def test_private_pools_count_as_allocated():
    # The allocator prints allocated including private pools, then what is left of the reserve.
    report = parse_oom(
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 270.00 MiB. GPU 0 has a total "
        "capacity of 21.67 GiB of which 255.75 MiB is free. Process 2109 has 344.00 MiB memory in use. "
        "Process 1448259 has 21.07 GiB memory in use. Of the allocated memory 20.08 GiB is allocated by "
        "PyTorch, with 328.00 MiB allocated in private pools (e.g., CUDA Graphs), and 56.49 MiB is reserved "
        "by PyTorch but unallocated."
    )
    assert report.allocated == round(20.08 * GiB)
    assert report.reserved_unallocated == round(56.49 * MiB)
    assert report.reserved == report.allocated + report.reserved_unallocated
    assert report.other_processes == ((2109, 344 * MiB), (1448259, round(21.07 * GiB)))
    assert report.process_used is None


def test_oversized_request_has_no_size():
    report = parse_oom("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate more than 1EB memory.")
    assert report.device == "cuda" and report.requested is None


def test_async_allocator_with_a_fraction_keeps_the_limit():
    report = parse_oom(
        "Allocation on device 0 would exceed allowed memory. (out of memory)\n"
        "Currently allocated     : 9.43 GiB\n"
        "Requested               : 640.00 MiB\nDevice limit            : 11.59 GiB\n"
        "Free (according to CUDA): 7.12 MiB\nPyTorch limit (set by user-supplied memory fraction)\n"
        "                        : 10.00 GiB"
    )
    assert (report.source, report.gpu_index, report.limit) == ("async", 0, 10 * GiB)


def test_a_log_with_several_messages_reads_the_first_in_full():
    first = (
        "CUDA out of memory. Tried to allocate 2.00 GiB. "
        "GPU 0 has a total capacity of 8.00 GiB of which 1.00 GiB is free."
    )
    second = (
        "CUDA out of memory. Tried to allocate 4.00 GiB. "
        "GPU 1 has a total capacity of 16.00 GiB of which 0 bytes is free."
    )
    report = parse_oom(first + "\n" + second)
    assert (report.requested, report.gpu_index, report.free) == (2 * GiB, 0, GiB)
    assert report.text == first


def test_tensorflow_prefers_the_printed_byte_count_to_the_shape():
    report = parse_oom(
        "W tensorflow/core/common_runtime/bfc_allocator.cc:501] Allocator (GPU_0_bfc) ran out of memory "
        "trying to allocate 1.00GiB (rounded to 1073741824)requested by op Mul\n"
        "ResourceExhaustedError: OOM when allocating tensor with shape[32,512,512] and type half on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc"
    )
    assert (report.requested, report.device, report.source) == (1073741824, "gpu", "tensorflow")


def test_tensorflow_shape_times_dtype_when_no_byte_count():
    report = parse_oom(
        "OOM when allocating tensor with shape[32,512,512] and type bfloat16 on "
        "/job:localhost/replica:0/task:0/device:GPU:0 by allocator GPU_0_bfc"
    )
    assert report.requested == 32 * 512 * 512 * 2


# --- messages pasted in part, and other runtimes' messages (written in each runtime's format) -------------

TAIL_SENTENCES = (
    "Tried to allocate 2.00 GiB. GPU 1 has a total capacity of 23.65 GiB of which 1.20 GiB is free. "
    "Including non-PyTorch memory, this process has 22.43 GiB memory in use. Of the allocated memory "
    "21.37 GiB is allocated by PyTorch, and 1.04 GiB is reserved by PyTorch but unallocated."
)


@pytest.mark.parametrize(
    "cut", ["GPU 1 has", "1.20 GiB is free", "Including", "Of the allocated", "1.04 GiB is"]
)
def test_pytorch_message_cut_anywhere_keeps_the_figures_that_are_left(cut):
    full = parse_oom("torch.OutOfMemoryError: CUDA out of memory. " + TAIL_SENTENCES)
    tail = TAIL_SENTENCES[TAIL_SENTENCES.index(cut) :]
    report = parse_oom("... " + tail)
    assert report is not None and report.text.startswith(cut)
    for name in ("capacity", "free", "process_used", "allocated", "reserved", "reserved_unallocated"):
        # Each figure is either what the whole message says or, where its sentence was cut off, absent.
        assert getattr(report, name) in (getattr(full, name), None), name
    assert report.reserved_unallocated == full.reserved_unallocated
    # The sentences up to "Including non-PyTorch memory" are the CUDA (or HIP) allocator's own wording; the
    # allocated/reserved sentence is XPU's too.
    assert report.device == ("gpu" if cut in ("Of the allocated", "1.04 GiB is") else "cuda")
    assert report.gpu_index == (1 if cut == "GPU 1 has" else None)


def test_pytorch_tail_tells_hip_and_xpu_by_their_advice():
    hip = parse_oom(
        "Of the allocated memory 8.08 GiB is allocated by PyTorch, and 321.96 MiB is reserved by PyTorch but "
        "unallocated. If reserved but unallocated memory is large try setting "
        "PYTORCH_HIP_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
    )
    xpu = parse_oom(
        "Of the allocated memory 195.50 KiB is allocated by PyTorch, and 1.81 MiB is reserved by PyTorch but "
        "unallocated. Please use `empty_cache` to release all unoccupied cached memory."
    )
    assert (hip.device, xpu.device) == ("hip", "xpu")
    assert xpu.allocated == round(195.5 * 1024)


@pytest.mark.parametrize(
    "text",
    [
        "nvidia-smi says 2.00 GiB is free. I don't understand why it fails.",
        "The GPU has 2.00 GiB free. Of the rest, most is used by Xorg.",
        "Process 1234 has 3.00 GiB memory in use. That is the notebook server.",
        "Including non-PyTorch memory in the budget is what the calculator does.",
        "Of the allocated memory, most goes to activations.",
    ],
)
def test_prose_about_free_memory_is_not_a_pytorch_tail(text):
    assert parse_oom(text) is None


def test_llama_cpp_prefers_the_exact_byte_count_and_names_the_device():
    report = parse_oom(
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1234.56 MiB on device 0: cudaMalloc failed: "
        "out of memory\nggml_gallocr_reserve_n: failed to allocate CUDA0 buffer of size 1294529987"
    )
    assert (report.source, report.device, report.gpu_index, report.requested) == (
        "ggml",
        "cuda",
        0,
        1294529987,
    )
    alone = parse_oom(
        "ggml_backend_cuda_buffer_type_alloc_buffer: allocating 1234.56 MiB on device 3: cudaMalloc failed: "
        "out of memory"
    )
    assert (alone.gpu_index, alone.requested) == (3, round(1234.56 * MiB))
    host = parse_oom("ggml_gallocr_reserve_n: failed to allocate CUDA_Host buffer of size 536870912")
    assert (host.device, host.gpu_index, host.requested) == ("cpu", None, 536870912)
    vulkan = parse_oom("llama_model_load: error loading model: unable to allocate Vulkan1 buffer")
    assert (vulkan.device, vulkan.gpu_index, vulkan.requested) == ("gpu", 1, None)


def test_onnxruntime_arena_and_cuda_call():
    report = parse_oom(
        "[ONNXRuntimeError] : 6 : RUNTIME_EXCEPTION : Non-zero status code returned while running Conv node. "
        "Status Message: bfc_arena.cc:376 onnxruntime::BFCArena::AllocateRawInternal Failed to allocate "
        "memory for requested buffer of size 123456789"
    )
    assert (report.source, report.requested, report.device) == ("onnxruntime", 123456789, None)
    limit = parse_oom(
        "BFCArena::AllocateRawInternal Available memory of 0 is smaller than requested bytes of 123456"
    )
    assert (limit.requested, limit.free) == (123456, 0)
    call = parse_oom(
        "CUDA failure 2: out of memory ; GPU=3 ; hostname=h ; expr=cudaMalloc((void**)&p, size);"
    )
    assert (call.device, call.gpu_index, call.source) == ("cuda", 3, "driver")


@pytest.mark.parametrize(
    ("text", "requested", "allocated", "limit"),
    [
        (
            "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 1,234,567,168 bytes "
            "(allocated so far: 9,876,543,488 bytes).",
            1234567168,
            9876543488,
            None,
        ),
        (
            "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 512 bytes "
            "(allocated so far: 1,024 bytes, limit set to: 2,048 bytes).",
            512,
            1024,
            2048,
        ),
        (
            "out of memory to allocate 1073741824 bytes (total 12373894656 bytes)",
            1073741824,
            12373894656,
            None,
        ),
    ],
    ids=["v7", "v7-limit", "old"],
)
def test_cupy_pool(text, requested, allocated, limit):
    report = parse_oom(text)
    assert (report.source, report.device) == ("cupy", "cuda")
    assert (report.requested, report.allocated, report.limit) == (requested, allocated, limit)


def test_cupy_pinned_pool_is_host_memory_and_other_runtime_errors_are_not_oom():
    frames = (
        '  File "cupy/cuda/pinned_memory.pyx", line 268, in cupy.cuda.pinned_memory.PinnedMemoryPool.malloc\n'
    )
    report = parse_oom(
        frames + "cupy.cuda.runtime.CUDARuntimeError: cudaErrorMemoryAllocation: out of memory"
    )
    assert (report.device, report.source) == ("cpu", "cupy")
    # Without the pinned pool in the traceback it is the device's runtime error.
    device = parse_oom("cupy.cuda.runtime.CUDARuntimeError: cudaErrorMemoryAllocation: out of memory")
    assert (device.device, device.source) == ("cuda", "driver")
    assert (
        parse_oom(frames + "cupy.cuda.runtime.CUDARuntimeError: cudaErrorInvalidValue: invalid argument")
        is None
    )


def test_vllm_reads_bytes_and_tokens():
    v1 = parse_oom(
        "ValueError: To serve at least one request with the models's max seq len (1048576), (24.00 GiB KV "
        "cache is needed, which is larger than the available KV cache memory (9.97 GiB). Try increasing "
        "`gpu_memory_utilization` or decreasing `max_model_len` when initializing the engine."
    )
    assert (v1.requested, v1.free, v1.tokens_requested, v1.tokens_capacity) == (
        24 * GiB,
        round(9.97 * GiB),
        1048576,
        None,
    )
    assert v1.text.startswith("To serve") and v1.text.endswith("initializing the engine.")
    old = parse_oom(
        "ValueError: The model's max seq len (4096) is larger than the maximum number of tokens that can be "
        "stored in KV cache (3664). Try increasing gpu_memory_utilization or decreasing max_model_len when "
        "initializing the engine."
    )
    assert (old.tokens_requested, old.tokens_capacity, old.requested) == (4096, 3664, None)
    startup = parse_oom(
        "ValueError: Free memory on device (3.22/4.0 GiB) on startup is less than desired GPU memory "
        "utilization (0.9, 3.6 GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
        "processes."
    )
    assert (startup.free, startup.capacity, startup.requested, startup.device) == (
        round(3.22 * GiB),
        4 * GiB,
        round(3.6 * GiB),
        None,
    )
    assert is_oom(
        ValueError("No available memory for the cache blocks. Try increasing `gpu_memory_utilization`")
    )


@pytest.mark.parametrize(
    "text",
    [
        "ValueError: The decoder prompt (length 322) is longer than the maximum model length of 256.",
        "Try increasing `gpu_memory_utilization` when initializing the engine.",
        "INFO 02-26 09:54:05 worker.py:267] the current vLLM instance can use total_gpu_memory (8.00GiB) x "
        "gpu_memory_utilization (0.70) = 5.60GiB",
        "Maximum concurrency for 4096 tokens per request: 0.00x",
        "llama_kv_cache_init:      CUDA0 KV buffer size =   379.23 MiB",
        "ggml_cuda_host_malloc: failed to allocate 1900.00 MiB of pinned memory: invalid argument",
        "CUDA failure 700: an illegal memory access was encountered ; GPU=0 ; hostname=h",
        "CUDA failure 20: out of range ; GPU=0",
        "onnx runtime error 2: not enough space: expected 318080, got 314240",
        "pycuda._driver.LogicError: cuMemAllocManaged failed: invalid argument",
        "Sorry, cudaMallocManaged() is not implemented in the current version.",
    ],
)
def test_near_misses_of_the_new_formats_are_not_oom(text):
    assert parse_oom(text) is None


@pytest.mark.parametrize(
    ("space", "requested", "capacity"),
    [("hbm", round(17.52 * GiB), round(15.48 * GiB)), ("vmem", None, None), ("smem", None, None)],
)
def test_tpu_memory_spaces(space, requested, capacity):
    used, total = ("17.52G", "15.48G") if space == "hbm" else ("1.00M", "1.00M")
    report = parse_oom(
        f"RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. Ran out of memory in memory space {space}. "
        f"Used {used} of {total} {space}. Exceeded {space} capacity by 2.04G."
    )
    # vmem and smem are the core's scratch memories: their sizes are not the device's.
    assert (report.device, report.requested, report.capacity) == ("tpu", requested, capacity)
    reserve = parse_oom(
        "Attempting to reserve 6.52G at the bottom of memory. That was not possible. There are 4.23G free, "
        "0B reserved, and 4.23G reservable."
    )
    assert (reserve.requested, reserve.free) == (round(6.52 * GiB), round(4.23 * GiB))


@pytest.mark.parametrize(
    ("text", "index"),
    [
        ("cudaMallocManaged failed: out of memory", None),
        (
            "RuntimeError: CUDA error: out of memory (cudaErrorMemoryAllocation) in cudaMallocManaged "
            "on device 1",
            1,
        ),
        ("cudaMallocManaged failed: out of memory (GPU 1)", 1),
        ("CUDA error: out of memory\n  current device: 1, in function ggml_cuda_pool_malloc", 1),
        ("Error on cuda:1: cudaMallocManaged failed: out of memory", 1),
        ("CUDA1: cudaMallocManaged(&p, 1 << 34) failed: out of memory", 1),
        ("cuMemAllocManaged failed: out of memory", None),
        # A version is not a device.
        ("CUDA error: out of memory (CUDA 12.1, driver 535)", None),
    ],
)
def test_managed_memory_failures_and_the_device_they_name(text, index):
    report = parse_oom(text)
    assert (report.device, report.source, report.gpu_index) == ("cuda", "driver", index)


# --- oommagic's own message ----------------------------------------------------------------------------

ISSUE_EXAMPLE = (
    "CPU out of memory (emulated by oommagic: %%gpumem --limit 24.00 GiB). Tried to allocate 2.00 GiB. "
    "CPU 0 has a total capacity of 24.00 GiB of which 1.50 GiB is free. Including non-PyTorch memory, "
    "this process has 22.50 GiB memory in use. 24.00 GiB allowed; Of the allocated memory 22.50 GiB is "
    "allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated."
)


def test_emulated_message_is_written_as_the_issue_shows():
    text = format_emulated_oom(
        requested=2 * GiB,
        capacity=24 * GiB,
        free=GiB + GiB // 2,
        process_used=22 * GiB + GiB // 2,
        allocated=22 * GiB + GiB // 2,
        limit=24 * GiB,
    )
    assert text == ISSUE_EXAMPLE


def test_emulated_message_reads_back():
    report = parse_oom("torch.OutOfMemoryError: " + ISSUE_EXAMPLE)
    assert report == OOMReport(
        text=ISSUE_EXAMPLE,
        device="cpu",
        gpu_index=0,
        requested=2 * GiB,
        capacity=24 * GiB,
        free=GiB + GiB // 2,
        allocated=22 * GiB + GiB // 2,
        reserved=22 * GiB + GiB // 2,
        reserved_unallocated=0,
        process_used=22 * GiB + GiB // 2,
        limit=24 * GiB,
        source="emulated",
        emulated=True,
    )


sizes = st.integers(min_value=0, max_value=2**50)


@given(requested=sizes, capacity=sizes, free=sizes, process_used=sizes, allocated=sizes, limit=sizes)
def test_emulated_message_round_trips(requested, capacity, free, process_used, allocated, limit):
    text = format_emulated_oom(requested, capacity, free, process_used, allocated, limit)
    report = parse_oom(text)

    def shown(n: int) -> int:
        return parse_reported_size(format_bytes(n))

    assert report.text == text and report.emulated and report.source == "emulated"
    assert (report.requested, report.capacity, report.free) == (
        shown(requested),
        shown(capacity),
        shown(free),
    )
    assert (report.process_used, report.allocated, report.limit) == (
        shown(process_used),
        shown(allocated),
        shown(limit),
    )
    assert report.reserved_unallocated == 0 and report.reserved == report.allocated


# --- is_oom --------------------------------------------------------------------------------------------


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError: same name, same base."""


class AcceleratorError(RuntimeError):
    pass


class Unprintable(RuntimeError):
    def __str__(self):
        raise ValueError("no message for you")


class NotAString(RuntimeError):
    def __str__(self):
        return 42  # str() raises TypeError


def test_is_oom_by_class_name_even_with_an_empty_message():
    assert is_oom(OutOfMemoryError())
    assert is_oom(type("CudaOOM", (OutOfMemoryError,), {})("anything"))


@pytest.mark.parametrize(
    "exc",
    [
        AcceleratorError(
            "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at some other "
            "API call"
        ),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError(
            "MPS backend out of memory (MPS allocated: 1.00 GB, other allocations: 1.00 GB, "
            "max allowed: 2.00 GB)."
        ),
        RuntimeError(
            "[enforce fail at alloc_cpu.cpp:75] DefaultCPUAllocator: can't allocate memory: "
            "you tried to allocate 8 bytes."
        ),
        Exception("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."),
    ],
    ids=["accelerator", "cublas", "mps", "cpu", "xla"],
)
def test_is_oom_by_message(exc):
    assert is_oom(exc)


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError("CUDA error: device-side assert triggered"),
        AcceleratorError("CUDA error: an illegal memory access was encountered"),
        ValueError("expected a size like 24GiB"),
        KeyboardInterrupt(),
        Unprintable(),
        NotAString(),
    ],
    ids=["assert", "illegal-access", "value-error", "interrupt", "str-raises", "str-not-a-string"],
)
def test_is_oom_false_for_everything_else(exc):
    assert is_oom(exc) is False


def test_is_oom_recognises_torchs_own_classes():
    torch = pytest.importorskip("torch")
    assert is_oom(torch.OutOfMemoryError("CUDA out of memory."))
    if hasattr(torch, "AcceleratorError"):
        assert not is_oom(torch.AcceleratorError(1, "CUDA error: device-side assert triggered"))


def test_reading_messages_needs_neither_torch_nor_ipython():
    package = pathlib.Path(__file__).parents[2] / "oommagic"
    for name in (
        "oom/__init__.py",
        "oom/report.py",
        "oom/text.py",
        "oom/pytorch.py",
        "oom/runtimes.py",
        "sizes.py",
    ):
        tree = ast.parse((package / name).read_text(encoding="utf-8"))
        imported = {
            alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not {m.split(".")[0] for m in imported} & {"torch", "IPython"}, name


# --- sizes as messages print them ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("8.00 GiB", 8 * GiB),
        ("0 bytes", 0),
        ("12.5 MB", round(12.5 * MiB)),
        ("1.95 GiB", 2093796557),
        ("129.50M", round(129.5 * MiB)),
        ("0B", 0),
        ("576.00 KiB", 576 * 1024),
        ("17179869184.00 GiB", 2**64),
    ],
)
def test_parse_reported_size(text, expected):
    assert parse_reported_size(text) == expected


@pytest.mark.parametrize("text", ["", "GiB", "8.00 GiBs", "1e3 B", "-1 GiB"])
def test_parse_reported_size_rejects_what_no_message_prints(text):
    with pytest.raises(ValueError):
        parse_reported_size(text)


def test_library_failures_read_the_device_they_name():
    report = parse_oom(
        "CUBLAS failure 3: CUBLAS_STATUS_ALLOC_FAILED ; GPU=1 ; hostname=h ; expr=cublasCreate(&handle);"
    )
    assert (report.source, report.device, report.gpu_index) == ("cublas", "cuda", 1)
