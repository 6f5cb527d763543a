"""Peak memory of a training step against batch size: what the batch search has to predict.

GPT-2 124M training (seq 512, AdamW, two steps per trial, the cache emptied before each) in the batch
search's three set-ups. For each batch: peak allocated and peak reserved without a limit, then whether it
fits under the limit and the peak reserved there. Under a limit the allocator hands cached blocks back
only when it reaches the limit, so a batch far below the maximum can show a peak reserved near the limit
(checkpointing's many odd-sized blocks do that): that reserved figure says "fits", not how much was
needed.

    python benchmarks/memory_curve.py            # on a CUDA machine
    python benchmarks/memory_curve.py --smoke    # tiny GPT-2 on CPU: the logic only
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import models
import report
import torch

GiB = 1024**3
# The batches of each set-up: around the earlier runs' maxima under 24 GiB (26, 32, 67-70).
BATCHES = {
    "fp32": (8, 16, 24, 26, 27),
    "bf16 autocast": (8, 16, 32, 33),
    "checkpointing": (16, 32, 48, 64, 68, 70, 71, 72),
}
SETUPS = {"fp32": (None, False), "bf16 autocast": (torch.bfloat16, False), "checkpointing": (None, True)}


def peaks(model, batch: int, device: str, seq: int, autocast, limit: int | None) -> tuple[bool, int, int]:
    """(fits, peak allocated, peak reserved) of one trial, under ``limit`` bytes when given."""
    from oommagic import is_oom

    models.clean(device)
    try:
        with models.memory_limit(device, limit) as held:
            models.train_trial(model, batch, 2, device, seq, autocast)
    except Exception as err:
        if not is_oom(err):
            raise
        return False, 0, 0
    return True, held.peak_allocated, held.peak_reserved


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="tiny GPT-2 on CPU")
    parser.add_argument("--limit-gib", type=float, default=24.0)
    args = parser.parse_args()
    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda:0" if cuda else "cpu"
    model = models.gpt2(device, tiny=not cuda)
    seq = models.SEQ if cuda else 16
    limit = int(args.limit_gib * GiB) if cuda else 64 * 1024**2
    from batch_search import switch_checkpointing

    t0 = time.monotonic()
    rows = []
    for name, batches in BATCHES.items():
        autocast, checkpointing = SETUPS[name]
        if checkpointing:
            switch_checkpointing(model, True)
        for batch in batches:
            _, alloc, free_reserved = peaks(model, batch, device, seq, autocast, None)
            fits, _, limited_reserved = peaks(model, batch, device, seq, autocast, limit)
            row = [
                name,
                batch,
                f"{alloc / GiB:.3f}",
                f"{free_reserved / GiB:.3f}",
                "yes" if fits else "no",
                f"{limited_reserved / GiB:.3f}" if fits else "—",
            ]
            rows.append(row)
            print("  " + " | ".join(map(str, row)), flush=True)
            if not fits:
                break
        if checkpointing:
            switch_checkpointing(model, False)
    env = report.environment(device)
    env["limit"] = f"{args.limit_gib:g}GiB" if cuda else "64MiB"
    heads = [
        "set-up",
        "batch",
        "peak allocated (GiB)",
        "peak reserved, no limit (GiB)",
        f"fits under {env['limit']}",
        "peak reserved under the limit (GiB)",
    ]
    path = report.write_markdown(
        "memory_curve", "Peak memory against batch size", env, report.table(heads, rows)
    )
    print(f"wrote {path} in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
