"""Which exceptions are a runtime's own out-of-memory error (the tool's report) and which pass through."""

from __future__ import annotations

from oommagic.oom import is_oom, is_runtime_oom

TEXT = "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 8.00 GiB."


def a_class(name: str, module: str, base: type = Exception) -> type:
    return type(name, (base,), {"__module__": module})


def test_a_class_of_the_users_own_with_oom_text_is_not_the_runtimes():
    mine = a_class("LoaderError", "__main__")(TEXT)
    assert is_oom(mine) and not is_runtime_oom(mine)
    assert not is_runtime_oom(a_class("DataError", "mylab.data", RuntimeError)(TEXT))


def test_builtin_and_runtime_classes_with_oom_text_are_the_runtimes():
    assert is_runtime_oom(
        RuntimeError("MPS backend out of memory (MPS allocated: 1.00 GiB, max allowed: 2.00 GiB)")
    )
    assert is_runtime_oom(
        ValueError(
            "No available memory for the cache blocks. Try increasing "
            "`gpu_memory_utilization` when initializing the engine."
        )
    )
    assert is_runtime_oom(a_class("AcceleratorError", "torch", RuntimeError)("CUDA error: out of memory"))
    assert is_runtime_oom(
        a_class("XlaRuntimeError", "jaxlib.xla_extension", RuntimeError)(
            "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 17179869184 bytes."
        )
    )


def test_a_class_named_out_of_memory_is_one_whatever_its_text():
    assert is_runtime_oom(a_class("OutOfMemoryError", "__main__", RuntimeError)("no room (code 7)"))
    assert is_runtime_oom(a_class("OutOfMemoryError", "cupy.cuda.memory", MemoryError)("Out of memory"))


def test_text_that_is_no_oom_is_not_one():
    assert not is_runtime_oom(RuntimeError("shape mismatch"))
    assert not is_runtime_oom(
        a_class("AcceleratorError", "torch", RuntimeError)("CUDA error: device-side assert")
    )


def test_a_figure_no_device_can_hold_is_not_known():
    from oommagic.oom import parse_oom

    text = (
        "CUDA out of memory. Tried to allocate 99999999999999999999999999.00 GiB. GPU 0 has a total capacity "
        "of 79.19 GiB of which 100000000000000000000.00 GiB is free. Process 7 has 900000000000000000.00 GiB "
        "memory in use. Process 8 has 2.00 GiB memory in use."
    )
    report = parse_oom(text)
    assert report.requested is None and report.free is None, "10^38 bytes is a misreading, not a size"
    assert report.capacity == round(79.19 * 1024**3)
    assert report.other_processes == ((8, 2 * 1024**3),)
