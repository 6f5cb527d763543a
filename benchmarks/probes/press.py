"""Press the first fix of a notebook shape written as a new user would, in a real IPython shell (CPU mode).

Each ``*.cell`` file here is an earlier cell, a line ``# ---- failing``, then the ``%%gpumem --limit ...``
cell that runs out of memory. This runs both, prints the plan's first entries, runs ``%gpumem --fix`` (the
recommended entry, as the report's first button does), and counts the optimizer steps the fixed run took
(torch's global step hook):

    PYTHONPATH=$PWD python benchmarks/probes/press.py benchmarks/probes/cdist.cell "nearest.shape"

The optional second argument is evaluated in the namespace after the fix (the cell's result).
"""

from __future__ import annotations

import contextlib
import io
import sys
import time


def main(path: str, check: str | None = None) -> int:
    from IPython.testing.globalipapp import start_ipython

    shell = start_ipython()
    shell.run_cell("%load_ext oommagic")
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import oommagic

    with open(path) as fh:
        setup, failing = fh.read().split("# ---- failing\n")
    if not shell.run_cell(setup).success:
        print("the earlier cell failed")
        return 1
    started = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        shell.run_cell(failing)
    run = oommagic.history()[-1]
    print(f"failing cell: {run.outcome} in {time.perf_counter() - started:.1f} s")
    if run.outcome != "oom":
        return 1
    if run.plan is not None:
        print(f"plan: {run.plan.summary}")
        for i, entry in enumerate(run.plan.entries[:5], 1):
            print(f"  {i}. {entry.title} [{entry.verdict}]")
    steps = [0]
    handle = register_optimizer_step_post_hook(lambda *_: steps.__setitem__(0, steps[0] + 1))
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = shell.run_cell("%gpumem --fix")
    finally:
        handle.remove()
    fixed = oommagic.history()[-1]
    if fixed is run:
        print(f"no fix run: {result.error_in_exec}")
        return 1
    print(f"pressed: {fixed.outcome}, {steps[0]} optimizer steps\n--- the cell that ran ---\n{fixed.source}")
    if check:
        print(f"{check} = {shell.ev(check)}")
    return 0 if fixed.outcome == "ok" else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
