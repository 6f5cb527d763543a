"""What the allocator trace costs per allocation: the one per-operation cost %%gpumem adds.

%%gpumem turns on ``torch.cuda.memory._record_memory_history(enabled="all", context=None)`` for the
cell (no stacks are gathered with ``context=None``); every allocation and free then appends a trace
entry. This times a loop of small allocate-and-free pairs with the trace off and on, alternated round by
round, and reports the cost per trace entry. A loop whose steps are mostly allocations of tiny tensors
(the capture benchmark's small-op loop) pays that cost on every op; a training step does not notice.

    python benchmarks/trace_cost.py              # on a CUDA machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report
import torch

from oommagic.run.capture import CUDA_TRACE_ENTRIES


def loop(n: int, device: str) -> float:
    """Seconds for ``n`` allocate-and-free pairs of a 1 KiB tensor (two trace entries each)."""
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(n):
        x = torch.empty(256, device=device)
        del x
    torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("trace_cost: needs CUDA")
        return 0
    device = "cuda:0"
    loop(10_000, device)  # warm-up
    off, on = [], []
    for _ in range(args.rounds):
        off.append(loop(args.pairs, device))
        torch.cuda.memory._record_memory_history(
            enabled="all", context=None, stacks="python", max_entries=CUDA_TRACE_ENTRIES
        )
        try:
            on.append(loop(args.pairs, device))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)
    per_off = statistics.median(off) / args.pairs * 1e6
    per_on = statistics.median(on) / args.pairs * 1e6
    per_entry = (per_on - per_off) / 2
    rows = [
        ["trace off", f"{per_off:.3f}", "—", ", ".join(f"{t:.3f}" for t in off)],
        [
            "trace on (%%gpumem)",
            f"{per_on:.3f}",
            f"{per_on / per_off:.3f}",
            ", ".join(f"{t:.3f}" for t in on),
        ],
    ]
    env = report.environment(device)
    body = (
        f"{args.pairs:,d} allocate-and-free pairs of a 1 KiB CUDA tensor per round, {args.rounds} rounds, "
        "off and on alternated.\n\n"
        + report.table(["variant", "µs per pair (median)", "ratio", "seconds per round"], rows)
        + f"\n\nCost per trace entry: **{per_entry:.3f} µs** (two entries per pair)."
    )
    path = report.write_markdown("trace_cost", "The allocator trace's cost per allocation", env, body)
    print(body)
    report.summary("trace cost per entry", f"{per_entry:.3f} µs", "(reference)", None)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
