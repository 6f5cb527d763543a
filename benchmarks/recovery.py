"""Memory still held after a cell runs out of memory: plain IPython, plain IPython plus
``gc.collect(); empty_cache()``, an ipyexperiments-style clean-up (``traceback.clear_frames`` on
``sys.last_traceback``, gc, ``empty_cache``), and ``%%gpumem``.

The cell allocates a 20 GiB tensor local to a function, then asks for more than the card has. Each
approach runs twice, the order alternating; after each, everything is freed before the next.

    python benchmarks/recovery.py            # on a CUDA machine
    python benchmarks/recovery.py --smoke    # 20 MiB on CPU (%%gpumem under an emulated limit)
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report
import torch

CELL = """import weakref
def fill_and_fail():
    held = torch.empty({size}, dtype=torch.uint8, device={device!r})
    _recovery_refs.append(weakref.ref(held))
    more = torch.empty({huge}, dtype=torch.uint8, device={device!r})
fill_and_fail()
"""
APPROACHES = ("plain IPython", "plain + gc.collect() + empty_cache()", "ipyexperiments-style", "%%gpumem")
TOLERANCE = 2 * 1024**2


def empty_cache(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def ipyexperiments_style(device: str) -> None:
    """What ipyexperiments / fastai's gpu_mem_restore do after a failed cell: clear the frames of the
    last traceback, collect, empty the cache."""
    tb = getattr(sys, "last_traceback", None)
    if tb is not None:
        traceback.clear_frames(tb)
    del tb
    empty_cache(device)


def figures(device: str, base: tuple[int, int], size: int, ref) -> tuple[int, int, bool]:
    """(allocated, reserved) above ``base`` and whether the tensor is alive; on CPU the tensor's bytes."""
    alive = ref is not None and ref() is not None
    if device.startswith("cuda"):
        return torch.cuda.memory_allocated() - base[0], torch.cuda.memory_reserved() - base[1], alive
    return (size if alive else 0), (size if alive else 0), alive


def attempt(shell, approach: str, device: str, size: int, huge: int, limit: str) -> dict:
    from IPython.utils.capture import capture_output

    from oommagic.run.release import free_failed_cell

    empty_cache(device)
    base = (
        (torch.cuda.memory_allocated(), torch.cuda.memory_reserved()) if device.startswith("cuda") else (0, 0)
    )
    refs: list = []
    shell.user_ns["_recovery_refs"] = refs
    cell = CELL.format(size=size, huge=huge, device=device)
    if approach == "%%gpumem":
        cell = f"%%gpumem --quiet{limit}\n{cell}"
    with capture_output() as out:
        result = shell.run_cell(cell)
    error = result.error_in_exec
    failed = type(error).__name__ if error is not None else "no error"
    t0 = time.perf_counter()
    if approach.startswith("plain +"):
        empty_cache(device)
    elif approach == "ipyexperiments-style":
        ipyexperiments_style(device)
    cleanup_ms = (time.perf_counter() - t0) * 1e3
    held, reserved, alive = figures(device, base, size, refs[0] if refs else None)
    # Reset for the next attempt: give back whatever this approach left pinned.
    pinned = getattr(sys, "last_value", None)
    if pinned is not None and pinned is not error:
        free_failed_cell(shell, pinned, device)
    if error is not None:
        free_failed_cell(shell, error, device)
    del error, pinned, result
    empty_cache(device)
    after_reset, _, still = figures(device, base, size, refs[0] if refs else None)
    if after_reset > TOLERANCE or still:
        print(f"  warning: {after_reset} bytes still held after resetting {approach}")
    shown = "Traceback" in out.stdout + out.stderr
    return {
        "approach": approach,
        "held": held,
        "reserved": reserved,
        "alive": alive,
        "error": failed,
        "cleanup_ms": cleanup_ms,
        "traceback_shown": shown,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="20 MiB on CPU: check the logic only")
    parser.add_argument(
        "--gib", type=float, default=20.0, help="size of the tensor local to the failing function"
    )
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda:0" if cuda else "cpu"
    if cuda:
        size = int(args.gib * 1024**3)
        huge = 2 * torch.cuda.mem_get_info()[1]
        limit = ""
    else:
        size, huge, limit = 20 * 1024**2, 2**50, " --limit 1GiB"

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "oommagic")
    shell.run_cell("import torch")
    if cuda:
        torch.ones(1, device=device)  # the CUDA context exists before the first baseline
    env = report.environment(device)
    rows, held_by = [], {}
    for r in range(args.rounds):
        order = APPROACHES if r % 2 == 0 else tuple(reversed(APPROACHES))
        for approach in order:
            res = attempt(shell, approach, device, size, huge, limit)
            held_by.setdefault(approach, []).append(res["held"])
            rows.append(
                [
                    r + 1,
                    approach,
                    res["error"],
                    f"{res['held']:,d} B ({report.size(res['held'])})",
                    report.size(res["reserved"]),
                    "yes" if res["alive"] else "no",
                    f"{res['cleanup_ms']:.1f}",
                ]
            )
            print(f"  round {r + 1} {approach}: {report.size(res['held'])} still allocated", flush=True)
    rows.sort(key=lambda row: (APPROACHES.index(row[1]), row[0]))
    headers = [
        "round",
        "approach",
        "the cell raised",
        "still allocated",
        "still reserved",
        "tensor alive",
        "clean-up (ms)",
    ]
    what = f"{report.size(size)} tensor local to the failing function, then a request of {report.size(huge)}"
    body = (
        f"## Bytes still held after the failed cell\n\n{what}"
        + (f" (`%%gpumem{limit}`)" if limit else "")
        + ".\n\n"
        + report.table(headers, rows)
        + "\n\n*still allocated*: `torch.cuda.memory_allocated()` above the level before the cell, after the "
        "approach's own clean-up (CPU smoke: the tensor's bytes if it is alive). The plain variants keep the "
        "tensor because `sys.last_traceback` and `shell.last_execution_result` hold the failed frame; "
        "`traceback.clear_frames` does not release a frame whose `f_locals` IPython's traceback printer read "
        "(Python ≤ 3.12)."
    )
    report.write_markdown("recovery", "Recovery: memory still held after an out-of-memory cell", env, body)
    worst = {a: max(v) for a, v in held_by.items()}
    report.bar_chart(
        "recovery",
        [
            report.Panel(
                "still allocated after the failed cell",
                list(worst),
                [v / 1024**3 for v in worst.values()],
                "GiB (worst round)",
            )
        ],
        f"Recovery after OOM — {report.short_hardware(env)}",
    )
    ok = worst["%%gpumem"] <= TOLERANCE
    report.summary(
        "recovery: %%gpumem memory still held after OOM",
        report.size(worst["%%gpumem"]),
        "≤ 2 MiB",
        ok if cuda else None,
    )
    for a in APPROACHES[:-1]:
        report.summary(f"recovery: {a} still held", report.size(worst[a]), "(reference)", None)
    print(f"wrote {report.out_dir() / 'recovery.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
