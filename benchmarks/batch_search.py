"""Find the largest batch that fits: oommagic vs accelerate vs Lightning-style vs bisection.

GPT-2 124M training (seq 512, AdamW) under a 24 GiB limit (``set_per_process_memory_fraction``), in
three set-ups: fp32, bf16 autocast, gradient checkpointing. Every trial is the same function: clean the
cache, run two optimizer steps with a fresh AdamW (step 1 creates Adam's state, so one step would
under-measure), and fail with the out-of-memory error when it does not fit. The methods:

- **oommagic**: ``%%gpumem --find-batch batch_size --limit 24GiB`` through a real IPython shell (its
  probes, affine fit and check; the magic sets the limit itself). Should the magic fail, the pure
  ``next_batch`` loop drives the same trial function instead, and the table says so.
- **accelerate**: ``accelerate.utils.find_executable_batch_size(starting_batch_size=128)`` (×0.9 per OOM).
- **Lightning-style**: power scaling from 2 (×2 while it fits), then binary search — written here after
  Lightning's ``BatchSizeFinder(mode="binsearch")``.
- **bisection**: 128, else binary search in [1, 128].

The true maximum is found afterwards by a linear walk up from the best batch any method found, until a
batch does not fit; its trials are counted separately. Methods run in this order within each set-up.

    python benchmarks/batch_search.py            # on a CUDA machine
    python benchmarks/batch_search.py --smoke    # tiny GPT-2 on CPU under an emulated limit
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import report
import torch

START = 128
MiB, GiB = 1024**2, 1024**3
METHODS = ("oommagic", "accelerate", "Lightning-style", "bisection")
SETUPS = (("fp32", None, False), ("bf16 autocast", torch.bfloat16, False), ("checkpointing", None, True))


class TrialCap(Exception):
    """Raised inside a method once it used its trials."""


@dataclass
class Trial:
    batch: int
    fits: bool
    seconds: float
    peak_reserved: int = 0
    peak_allocated: int = 0


@dataclass
class Outcome:
    method: str
    result: int | None = None
    trials: list[Trial] = field(default_factory=list)
    seconds: float = 0.0
    note: str = ""


class Bench:
    """The trial function of one set-up and the log of every trial it ran."""

    def __init__(
        self, model, device: str, limit: int, steps: int, seq: int, autocast, cap: int, deadline: float
    ) -> None:
        self.model, self.device, self.limit = model, device, limit
        self.steps, self.seq, self.autocast, self.cap = steps, seq, autocast, cap
        self.deadline = deadline
        self.log: list[Trial] = []

    def raw(self, batch: int, limited: bool = True) -> int:
        """Run one trial; raises the out-of-memory error when it does not fit; returns peak reserved."""
        from oommagic import is_oom

        if len(self.log) >= self.cap:
            raise TrialCap(f"{self.cap} trials used")
        if time.monotonic() > self.deadline:
            raise TrialCap("time budget used")
        models.clean(self.device)
        t0 = time.perf_counter()
        held = models.Held()
        try:
            if limited:
                with models.memory_limit(self.device, self.limit) as held:
                    self._steps(batch)
            else:
                self._steps(batch)
        except Exception as err:
            if is_oom(err):
                self.log.append(Trial(batch, False, time.perf_counter() - t0))
            raise
        self.log.append(Trial(batch, True, time.perf_counter() - t0, held.peak_reserved, held.peak_allocated))
        return held.peak_reserved

    def _steps(self, batch: int) -> None:
        models.train_trial(self.model, batch, self.steps, self.device, self.seq, self.autocast)

    def fits(self, batch: int) -> bool:
        from oommagic import is_oom

        try:
            self.raw(batch)
        except Exception as err:
            if not is_oom(err):
                raise
            return False
        return True


def run_method(method: str, bench: Bench, shell, limit_text: str) -> Outcome:
    bench.log = []
    out = Outcome(method)
    t0 = time.perf_counter()
    try:
        if method == "oommagic":
            out.result, out.note = oommagic_magic(bench, shell, limit_text)
        elif method == "accelerate":
            out.result = accelerate_search(bench)
        elif method == "Lightning-style":
            out.result = lightning_style(bench)
        else:
            out.result = bisection(bench)
    except TrialCap as cap:
        out.note = f"stopped: {cap}"
        fitting = [t.batch for t in bench.log if t.fits]
        out.result = max(fitting) if method != "accelerate" and fitting else None
    except Exception as err:  # one method failing must not cost the others
        out.note = f"failed: {type(err).__name__}: {str(err)[:200]}"
    out.seconds = time.perf_counter() - t0
    out.trials = list(bench.log)
    return out


def oommagic_magic(bench: Bench, shell, limit_text: str) -> tuple[int | None, str]:
    """``%%gpumem --find-batch`` through the shell; the pure ``next_batch`` loop if the magic fails."""
    from IPython.utils.capture import capture_output

    shell.user_ns["_trial"] = lambda b: bench.raw(b, limited=False)
    shell.user_ns["batch_size"] = START
    cell = f"%%gpumem --find-batch batch_size --limit {limit_text} --quiet\n_trial(batch_size)\n"
    with capture_output() as cap:
        result = shell.run_cell(cell)
    # The magic's return value: IPython's nested run_cell (each trial) clears the outer cell's
    # ExecutionResult hook, so it arrives through the displayhook's `_` rather than `result.result`.
    search = result.result if result.result is not None else shell.user_ns.get("_")
    if result.success and hasattr(search, "trials"):
        print("  " + search.summary().replace("\n", "\n  "))
        if len(search.trials) != len(bench.log):
            print(
                f"  note: the magic counted {len(search.trials)} trials, the trial function {len(bench.log)}"
            )
        return search.best, "%%gpumem --find-batch through the shell"
    if result.success and bench.log:
        return shell.user_ns.get(
            "batch_size"
        ), "%%gpumem --find-batch through the shell (result read from NAME)"
    why = result.error_in_exec or "no BatchSearch returned"
    if "TrialCap" in str(why):
        raise TrialCap(str(why))
    print(f"  %%gpumem --find-batch failed ({why!r}); output:\n{cap.stdout[-2000:]}{cap.stderr[-2000:]}")
    bench.log = []
    return pure_next_batch(bench), f"pure next_batch loop (the magic failed: {str(why)[:120]})"


def pure_next_batch(bench: Bench) -> int | None:
    """oommagic's decision function ``next_batch`` driving the trial function directly, the way
    ``find_batch_magic`` does: a quarter of the start, halved until it fits, then ``next_batch``."""
    from oommagic import batch_search as search
    from oommagic import is_oom

    trials: list = []

    def attempt(b: int, role: str) -> bool:
        try:
            bench.raw(b)
            t = search.Trial(
                b, True, bench.log[-1].peak_reserved, role=role, peak_allocated=bench.log[-1].peak_allocated
            )
        except Exception as err:
            if not is_oom(err):
                raise
            t = search.Trial(b, False, 0, role=role)
        trials.append(t)
        return t.fits

    b = max(1, START // 4)
    while not attempt(b, "probe") and b > 1:
        b = max(1, b // 2)
    while len(trials) < 12 and (b := search.next_batch(trials, bench.limit)) is not None:
        attempt(b, "check" if len(trials) >= 2 else "probe")
    return max((t.batch for t in trials if t.fits), default=None)


def accelerate_search(bench: Bench) -> int:
    from accelerate.utils import find_executable_batch_size, memory

    if bench.device == "cpu":
        # Smoke only: accelerate looks for " out of memory." and oommagic's CPU emulation says "CPU out of
        # memory (emulated ...". On CUDA the real message matches and nothing is patched.
        memory.should_reduce_batch_size = lambda err: isinstance(err, torch.OutOfMemoryError)

    @find_executable_batch_size(starting_batch_size=START)
    def inner(batch_size: int) -> int:
        bench.raw(batch_size)
        return batch_size

    return inner()


def lightning_style(bench: Bench, init: int = 2) -> int | None:
    """Double from ``init`` while it fits; after the first failure, binary search between the last fit
    and the failure (Lightning's binsearch mode)."""
    low, high, size = 0, None, init
    while True:
        if bench.fits(size):
            low = size
            if high is None:
                size *= 2
                continue
        else:
            high = size
        if high - low <= 1:
            return low or None
        size = (low + high) // 2


def bisection(bench: Bench) -> int | None:
    if bench.fits(START):
        return START
    lo, hi = 0, START
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if bench.fits(mid) else (lo, mid)
    return lo or None


def true_maximum(bench: Bench, best: int, walk_cap: int) -> tuple[int, bool, list[Trial]]:
    """(largest fitting batch, exact?, trials) walking up from ``best`` until a batch does not fit."""
    bench.log = []
    b = best
    while len(bench.log) < walk_cap:
        try:
            if not bench.fits(b + 1):
                return b, True, list(bench.log)
        except TrialCap:
            break
        b += 1
    return b, False, list(bench.log)


def switch_checkpointing(model, on: bool) -> None:
    """Gradient checkpointing on or off (transformers 5 renames it activation checkpointing)."""
    verb = "enable" if on else "disable"
    method = getattr(model, f"activation_checkpointing_{verb}", None)
    method = method or getattr(model, f"gradient_checkpointing_{verb}")
    method()


def smoke_limit(model, device: str, seq: int) -> int:
    """On CPU: a limit where about 40 samples fit, from the peaks of two unlimited trials."""
    peaks = []
    for b in (4, 8):
        with models.memory_limit(device, None) as held:
            models.train_trial(model, b, 2, device, seq)
        peaks.append(held.peak_reserved)
    slope = (peaks[1] - peaks[0]) / 4
    return int(peaks[0] + slope * 36.5)


def write(env: dict, rows: list, walk_rows: list, setup_names: list, oks: dict, limit_text: str) -> None:
    headers = ["set-up", "method", "result", "trials (fits/OOM)", "seconds", "fraction of true max", "how"]
    body = (
        f"## Largest batch under a {limit_text} limit\n\nStart 128 for oommagic, accelerate and bisection; "
        "Lightning-style starts at 2. Every trial runs 2 optimizer steps with a fresh AdamW.\n\n"
        + report.table(headers, rows)
        + "\n\n## True maximum (linear walk up from the best found, counted separately)\n\n"
        + report.table(["set-up", "true max", "walk trials", "walk seconds"], walk_rows)
    )
    report.write_markdown("batch_search", "Batch search: the largest batch that fits", env, body)
    panels = []
    for name in setup_names:
        if name in oks:
            methods = list(oks[name])
            notes = [
                f"{oks[name][m][0]} ({'—' if oks[name][m][1] is None else f'{oks[name][m][1]:.2f}'})"
                for m in methods
            ]
            panels.append(
                report.Panel(
                    f"{name}: trials (fraction of true max)",
                    methods,
                    [oks[name][m][0] for m in methods],
                    "trials",
                    notes=notes,
                )
            )
    if panels:
        report.bar_chart(
            "batch_search", panels, f"Batch search under {limit_text} — {report.short_hardware(env)}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny GPT-2 on CPU, emulated limit")
    parser.add_argument("--limit-gib", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=2, help="optimizer steps per trial (at least 2)")
    parser.add_argument("--cap", type=int, default=20, help="most trials per method")
    parser.add_argument("--walk-cap", type=int, default=8, help="most trials of the true-maximum walk")
    parser.add_argument(
        "--budget", type=float, default=None, help="seconds; later set-ups are skipped past it"
    )
    parser.add_argument("--setups", default="fp32,bf16 autocast,checkpointing")
    args = parser.parse_args()
    t_start = time.monotonic()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda:0" if cuda else "cpu"
    steps = max(2, args.steps)
    model = models.gpt2(device, tiny=not cuda)
    seq = models.SEQ if cuda else 16
    if args.smoke:
        args.cap, args.walk_cap = min(args.cap, 14), min(args.walk_cap, 4)
    if args.budget is None:
        args.budget = 140.0 if cuda else 400.0  # the CPU smoke is slow per trial, not a measurement
    if cuda:
        limit = int(args.limit_gib * GiB)
        limit_text = f"{args.limit_gib:g}GiB"
    else:
        limit = smoke_limit(model, device, seq)
        limit = -(-limit // MiB) * MiB
        limit_text = f"{limit // MiB}MiB"

    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_line_magic("load_ext", "oommagic")
    env = report.environment(device)
    env["limit"] = limit_text
    wanted = [s for s in SETUPS if s[0] in args.setups.split(",")]
    deadline = t_start + args.budget
    rows, walk_rows, oks = [], [], {}
    for name, autocast, checkpointing in wanted:
        if deadline - time.monotonic() < 20:
            rows.append([name, "—", "skipped: time budget", "", "", "", ""])
            report.summary(f"batch search {name}: oommagic", "skipped (time budget)", "", False)
            continue
        print(f"== {name} (limit {limit_text})", flush=True)
        if checkpointing:
            switch_checkpointing(model, True)
        bench = Bench(model, device, limit, steps, seq, autocast, args.cap, deadline)
        outcomes = {}
        for method in METHODS:
            out = run_method(method, bench, shell, limit_text)
            outcomes[method] = out
            fits = sum(t.fits for t in out.trials)
            print(
                f"  {method}: {out.result} in {len(out.trials)} trials ({fits} fit), {out.seconds:.1f} s "
                f"{out.note}",
                flush=True,
            )
        best = max((o.result for o in outcomes.values() if o.result), default=None)
        true_max, exact, walk = None, False, []
        if best:
            bench.deadline = deadline + 10  # the walk may use a little of the margin
            true_max, exact, walk = true_maximum(bench, best, args.walk_cap)
        if checkpointing:
            switch_checkpointing(model, False)
        shown_max = "—" if true_max is None else f"{true_max}{'' if exact else ' (at least: walk cap)'}"
        walk_rows.append([name, shown_max, len(walk), f"{sum(t.seconds for t in walk):.1f}"])
        oks[name] = {}
        for o in outcomes.values():
            fits = sum(t.fits for t in o.trials)
            frac = o.result / true_max if (o.result and true_max) else None
            oks[name][o.method] = (len(o.trials), frac)
            how = o.note or ("%%gpumem --find-batch through the shell" if o.method == "oommagic" else "")
            rows.append(
                [
                    name,
                    o.method,
                    o.result if o.result is not None else "—",
                    f"{len(o.trials)} ({fits}/{len(o.trials) - fits})",
                    f"{o.seconds:.1f}",
                    "—" if frac is None else f"{frac:.2f}",
                    how,
                ]
            )
        mine, theirs = oks[name]["oommagic"], oks[name]["accelerate"]
        shown = "—" if mine[1] is None else f"{mine[1]:.2f}"
        report.summary(
            f"batch search {name}: oommagic vs accelerate",
            f"{outcomes['oommagic'].result} = {shown} of max {true_max} in {mine[0]} trials "
            f"(accelerate {outcomes['accelerate'].result} in {theirs[0]})",
            "≥ 0.95 of max, fewer trials",
            (mine[1] is not None and mine[1] >= 0.95 and mine[0] < theirs[0]) if cuda else None,
        )
        write(env, rows, walk_rows, [s[0] for s in wanted], oks, limit_text)
        print(
            f"  true max {shown_max} ({len(walk)} walk trials); {time.monotonic() - t_start:.0f} s so far",
            flush=True,
        )
    write(env, rows, walk_rows, [s[0] for s in wanted], oks, limit_text)
    print(f"wrote {report.out_dir() / 'batch_search.md'} in {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
