"""What the report's new parts cost per cell: the allocator snapshot taken at an out-of-memory error (goal
≤ 50 ms with the default settings) and the fixed cost of a ``%%gpumem`` cell at 20,000 allocation events
(goal ≤ 30 ms over the plain cell: the snapshot, the timeline replay, the breakdown by category at the
peak), each with the default capture and with ``--stacks``, split into its parts (``cell_parts``).

    python benchmarks/failure_snapshot.py            # on a CUDA machine
    python benchmarks/failure_snapshot.py --smoke    # on CPU: checks the logic, measures nothing
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import cell_parts
import report
import torch

EVENTS = 20_000
# 10,000 tiny tensors made and dropped: 20,000 allocator events (an alloc and a free each).
WORK = """_x = torch.ones(256, device=_dev)
for _ in range({n}):
    _x = _x * 1.0001
"""


def timed_cell(shell, source: str) -> float:
    t0 = time.perf_counter()
    result = shell.run_cell(source)
    wall = time.perf_counter() - t0
    if not result.success and "OutOfMemory" not in type(result.error_in_exec).__name__:
        raise RuntimeError(f"the cell failed: {result.error_in_exec!r}")
    return wall


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny, on CPU: check the logic only")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument(
        "--default-only", action="store_true", help="measure the default capture only, not --stacks too"
    )
    parser.add_argument(
        "--with-transformers",
        action="store_true",
        help="import transformers and build a GPT-2 first, as a fine-tuning notebook has: a process with "
        "more objects, where each garbage collection costs more",
    )
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda:0" if cuda else "cpu"
    n = EVENTS // 2 if cuda else 200
    if args.smoke:
        args.rounds = 2

    from IPython.core.interactiveshell import InteractiveShell

    import oommagic

    shell = InteractiveShell.instance()
    if args.with_transformers:
        shell.run_cell(
            "from transformers import GPT2Config, GPT2LMHeadModel\n"
            "_gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=4, n_embd=256, n_head=4))"
        )
    shell.run_line_magic("load_ext", "oommagic")
    shell.run_cell("import torch")
    shell.user_ns["_dev"] = device
    work = WORK.format(n=n)
    limit = "1GiB" if cuda else "8MiB"
    huge = "_huge = torch.empty(2 * 1024**3, dtype=torch.uint8, device=_dev)\n"
    rows, summary, breakdowns = [], {}, []
    for variant in ("",) if args.default_only else ("", "--stacks"):
        plain, fitted, failed, snap_ms, cat_at, parts = [], [], [], [], [], []
        for r in range(args.rounds + 1):
            p = timed_cell(shell, work)
            timings: dict[str, float] = {}
            with cell_parts.timed(timings):
                f = timed_cell(shell, f"%%gpumem --quiet {variant}\n{work}")
            run_ok = oommagic.history()[-1]
            o = timed_cell(
                shell, f"%%gpumem --quiet --no-raise --plan-budget 0 --limit {limit} {variant}\n{work}{huge}"
            )
            run_oom = oommagic.history()[-1]
            if r == 0:
                continue  # warm-up
            plain.append(p)
            fitted.append(f)
            failed.append(o)
            parts.append(timings)
            if run_oom.snapshot_ms is not None:
                snap_ms.append(run_oom.snapshot_ms)
            cat_at.append(
                f"{run_ok.categories.at if run_ok.categories else '—'}/{run_oom.timeline.events} events"
            )
        fixed = (statistics.median(fitted) - statistics.median(plain)) * 1e3
        # The mean counts the garbage collections a cell sets off, which a median of few rounds can miss.
        fixed_mean = (statistics.mean(fitted) - statistics.mean(plain)) * 1e3
        snap = statistics.median(snap_ms) if snap_ms else None
        name = variant or "default"
        if cuda:
            table = report.table(cell_parts.HEADERS, cell_parts.rows(parts, fixed))
            breakdowns.append(f"Fixed cost of the `%%gpumem --quiet {variant}` cell by part:\n\n{table}")
            print(breakdowns[-1], flush=True)
        summary[name] = (fixed, snap)
        rows.append(
            [
                name,
                len(plain),
                f"{statistics.median(plain) * 1e3:.1f}",
                f"{statistics.median(fitted) * 1e3:.1f}",
                f"{fixed:+.1f}",
                f"{fixed_mean:+.1f}",
                f"{snap:.1f}" if snap is not None else "— (CPU: no allocator)",
                cat_at[-1] if cat_at else "—",
            ]
        )
    judged = cuda
    fixed, snap = summary["default"]
    report.summary(
        "report: fixed cost per %%gpumem cell at 20k events",
        f"{fixed:+.1f} ms",
        "≤ 30 ms",
        fixed <= 30 if judged else None,
    )
    if snap is not None:
        report.summary(
            "report: allocator snapshot at the failure",
            f"{snap:.1f} ms",
            "≤ 50 ms",
            snap <= 50 if judged else None,
        )
    stacks_fixed, stacks_snap = summary.get("--stacks", (None, None))
    if stacks_fixed is not None:
        report.summary("report: --stacks fixed cost per cell", f"{stacks_fixed:+.1f} ms", "(reference)", None)
    if stacks_snap is not None:
        report.summary(
            "report: --stacks snapshot at the failure", f"{stacks_snap:.1f} ms", "(reference)", None
        )
    headers = [
        "capture",
        "rounds",
        "plain cell (ms)",
        "%%gpumem cell (ms)",
        "fixed cost (ms)",
        "fixed cost, mean (ms)",
        "snapshot at the failure (ms)",
        "categories at / trace events of the failed cell",
    ]
    body = (
        f"A cell of {n:,d} tiny ops ({2 * n:,d} allocator events) run plain and under `%%gpumem`; the same "
        "cell "
        f"then allocating 2 GiB under `--limit {limit}` for the snapshot at the failure. Medians of "
        f"{args.rounds} rounds after a warm-up, and the mean of the fixed cost"
        f"{' (transformers imported, a GPT-2 built)' if args.with_transformers else ''}.\n\n"
        + report.table(headers, rows)
        + "".join(f"\n\n{b}" for b in breakdowns)
    )
    name = "failure_snapshot" + ("-transformers" if args.with_transformers else "")
    report.write_markdown(
        name,
        "What the report costs per cell",
        report.environment(device),
        body,
    )
    print(f"wrote {report.out_dir() / f'{name}.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
