"""What the first ``%%gpumem`` cell of a kernel costs beyond the cell itself, in CPU mode.

A kernel's first cell pays for first uses inside torch whatever records it (an optimizer's first step
imports parts of torch), so each cell is timed in two fresh processes: one runs it as written, one under
``%%gpumem``; each loads the extension and imports torch as a notebook would, then runs the cell twice.
The first-cell overhead is the difference of the two first runs; the ratio is first under ``%%gpumem`` /
first as written. Two cells: a small training step (AdamW) and tensor ops without an optimizer (where any
first-use cost is the recorder's own).

    python benchmarks/first_cell.py
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

CELLS = {
    "training step": """
model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
opt = torch.optim.AdamW(model.parameters())
for _ in range(3):
    model(torch.randn(64, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
""",
    "tensor ops": """
a = torch.randn(256, 256)
for _ in range(20):
    a = (a @ a).tanh()
""",
}


def one_kernel(cell: str, magic: bool) -> list[float]:
    """Seconds of the cell's first and second run in this fresh shell (run in a child process)."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    shell.run_cell("%load_ext oommagic")
    shell.run_cell("import torch")
    source = ("%%gpumem --device cpu --quiet\n" if magic else "") + CELLS[cell]
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        result = shell.run_cell(source)
        times.append(time.perf_counter() - t0)
        assert result.success, result.error_in_exec
    return times


def child(cell: str, magic: bool) -> list[float]:
    args = [sys.executable, __file__, "--child", cell, "gpumem" if magic else "plain"]
    out = subprocess.run(args, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    if sys.argv[1:2] == ["--child"]:
        print(json.dumps(one_kernel(sys.argv[2], sys.argv[3] == "gpumem")))
        return
    print(f"{'cell':<14} {'as written':>18} {'under %%gpumem':>18}   first-cell overhead")
    for cell in CELLS:
        plain, magic = child(cell, False), child(cell, True)
        print(
            f"{cell:<14} {plain[0]:7.3f} s {plain[1]:7.3f} s {magic[0]:7.3f} s {magic[1]:7.3f} s   "
            f"{magic[0] - plain[0]:+.3f} s ({magic[0] / plain[0]:.2f}× the first run as written)"
        )


if __name__ == "__main__":
    main()
