"""The ``%%gpumem`` cell magic and the ``%gpumem`` line magic."""

from __future__ import annotations

import warnings
from typing import Any

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from .cellrun import CellRun
from .sizes import format_bytes, parse_size

TORCH_MISSING = (
    "%%gpumem needs PyTorch, which is not installed in this kernel's environment. "
    "Install it with `pip install torch` (see https://pytorch.org/get-started/ for the build that "
    "matches your CUDA), then restart the kernel."
)


class CellFailed(Exception):
    """Fails the ``%%gpumem`` cell (so Run All stops) with one line instead of a second traceback.

    IPython prints ``_render_traceback_``'s lines in place of a traceback; the exception holds no frame
    of the failed cell, so it pins no memory.
    """

    def __init__(self, line: str) -> None:
        super().__init__(line)
        self.line = line

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self.line}"]


class CellOutOfMemory(CellFailed):
    """The cell ran out of memory; its memory was given back and the report is shown above."""


def parse_limit(text: str | None) -> float | int | None:
    """``--limit`` value: a fraction in (0, 1] as ``float`` or a size as ``int`` bytes."""
    if text is None:
        return None
    cleaned = text.strip()
    try:
        value = float(cleaned)
    except ValueError:
        value = None
    if value is not None:
        if 0 < value <= 1:
            return value
        raise UsageError(
            f"--limit expects a size like 24GiB, 8GB, 512MiB or a fraction like 0.5, got {text!r}"
            " (a bare number must be a fraction between 0 and 1; give sizes a unit)"
        )
    try:
        nbytes = parse_size(cleaned)
    except ValueError:
        raise UsageError(
            f"--limit expects a size like 24GiB, 8GB, 512MiB or a fraction like 0.5, got {text!r}"
        ) from None
    if nbytes <= 0:
        raise UsageError(f"--limit must be above zero, got {text!r}")
    return nbytes


def _import_torch() -> Any:
    try:
        import torch
    except ImportError:
        raise UsageError(TORCH_MISSING) from None
    return torch


@magics_class
class GpuMemMagics(Magics):
    @magic_arguments()
    @argument(
        "--limit",
        metavar="SIZE|FRACTION",
        help="emulate a smaller card: 24GiB, 8GB, 512MiB or a fraction like 0.5 of the device. On CUDA "
        "through set_per_process_memory_fraction; on CPU the tracker raises torch.OutOfMemoryError.",
    )
    @argument("--device", metavar="N|cpu", help="device to record: N or cuda:N, or cpu for CPU mode")
    @argument("--quiet", action="store_true", help="record, print nothing")
    @argument("--no-raise", action="store_true", help="an out-of-memory error does not fail the cell")
    @argument("--text", action="store_true", help="plain-text report instead of the widget")
    @argument(
        "--keep",
        action="store_true",
        help="after an out-of-memory error keep the names the failed cell bound to device memory (by "
        "default they are dropped with the rest of the failed attempt's memory)",
    )
    @argument(
        "--no-timeline",
        action="store_true",
        help="record no timeline: on CUDA the allocator trace stays off (it costs about 0.3 us per "
        "allocation, felt in loops of thousands of tiny ops); the peak stays exact, the plot and the "
        "findings read from it go",
    )
    @argument("--batch", metavar="NAME", help="the variable that holds the batch size, for retries")
    @argument(
        "--find-batch",
        metavar="NAME",
        help="search the largest batch size NAME that fits (probes, a fit, a check) instead of one run",
    )
    @argument("-o", dest="output", metavar="NAME", help="store the CellRun in the user namespace as NAME")
    @line_cell_magic
    def gpumem(self, line: str = "", cell: str | None = None) -> CellRun | None:
        """Record a cell's GPU memory; on out-of-memory, give it back, diagnose, offer fixes.

        As a cell magic (``%%gpumem [options]``) the cell runs as usual through IPython; afterwards its
        wall time, peak allocated and reserved memory, memory held after vs before, headroom and a
        timeline of allocated/reserved memory (optimizer steps marked) are shown. When the cell runs out
        of memory, its memory is given back at once, the error's figures are laid out with a diagnosis
        and buttons that retry the cell with a fix, and the cell still fails so that Run All stops.

        Without CUDA (or with ``--device cpu``) it runs in CPU mode: tensor storage bytes are tracked
        exactly and ``--limit`` emulates a card of that size.

        As a line magic (``%gpumem``) it prints each visible GPU: used/total, this process's
        allocated/reserved memory and the other processes on it (NVML).

        Examples::

            %%gpumem --limit 24GiB
            train(model, batch_size=64)

            %%gpumem --find-batch batch_size --limit 0.5
            train(model, batch_size=batch_size)
        """
        if cell is None:
            if line.strip():
                raise UsageError(
                    f"%gpumem takes no options (got {line.strip()!r}); %%gpumem is the cell magic"
                )
            print(device_status())
            return None
        try:
            args = parse_argstring(self.gpumem, line)
        except UsageError as err:
            raise UsageError(
                f"{err}. Options: --limit, --device, --quiet, --no-raise, --text, --batch, "
                "--find-batch, -o NAME (see %%gpumem?)"
            ) from None
        if args.output is not None and not args.output.isidentifier():
            raise UsageError(f"-o expects a Python name, got {args.output!r}")
        limit = parse_limit(args.limit)
        _import_torch()
        from .runner import RunSpec, execute

        options = {k: v for k, v in vars(args).items() if v not in (None, False)}
        spec = RunSpec(
            source=cell, device=args.device, limit=limit, options=options, drop_bound=not args.keep
        )
        if args.find_batch:
            from .batch_search import find_batch_magic

            return find_batch_magic(self.shell, spec, args.find_batch)
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                run = execute(self.shell, spec)
        except ValueError as err:
            raise UsageError(str(err)) from None
        for w in caught:
            print(f"%%gpumem: {w.message}")
        return self._finish(run, args)

    def _finish(self, run: CellRun, args: Any) -> CellRun | None:
        from . import comm

        if args.output:
            self.shell.user_ns[args.output] = run
        comm.publish(run)
        if not args.quiet:
            from .view import show

            show(run, self.shell, text=args.text)
        if run.outcome == "oom" and not args.no_raise:
            freed = f"; {format_bytes(run.freed)} given back" if run.freed else ""
            raise CellOutOfMemory(f"{run.headline()}{freed} (report above)")
        if run.outcome == "error":
            raise CellFailed(f"the cell raised {run.error} (traceback above)")
        return None


def device_status() -> str:
    """Text table of the visible GPUs (NVML) with this process's torch figures where CUDA is up."""
    from .devices import read_devices, render_devices_text

    mine: dict[int, tuple[int, int]] = {}
    try:
        import torch

        if torch.cuda.is_initialized():
            for i in range(torch.cuda.device_count()):
                mine[i] = (torch.cuda.memory_allocated(i), torch.cuda.memory_reserved(i))
    except ImportError:
        pass
    return render_devices_text(read_devices(), this_process=mine)
