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
    assert devices >= {"cuda", "hip", "xpu", "mps", "cpu", "gpu", "tpu"}
    assert all(e["url"].startswith("https://github.com/") for e in ENTRIES)


@pytest.mark.parametrize("entry", OOM_ENTRIES, ids=lambda e: e["file"])
def test_real_message_gives_the_figures_it_prints(entry):
    report = parse_oom(message(entry))
    assert report is not None
    assert figures(report) == expected(entry)
    # The text is the message itself, not its surroundings.
    assert report.text and squeeze(report.text) in squeeze(message(entry))


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
    # that a wrap puts at the start of a line reads as a quote mark and goes.
    assert glyphs(pasted.text) == glyphs(original.text)


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
    for name in ("oom/__init__.py", "oom/report.py", "oom/text.py", "oom/pytorch.py", "oom/runtimes.py", "sizes.py"):
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
