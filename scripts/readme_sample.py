"""Write the README's sample output from the product: the quickstart notebook's cells run in terminal
IPython's way (an in-process shell, CPU mode, ``--text``) up to its cell that runs out of memory, and what
that cell prints — the trials' progress, the text report, the error — goes between the README's markers.

Usage: python scripts/readme_sample.py [--check] [--unhurried]

``--check`` changes nothing and exits 1 when the README's sample is not what the quickstart prints today,
figures aside: every number (sizes, seconds, batches) may differ from run to run and machine to machine,
the words and the layout may not. CI runs the check; a release runs the script.

The sample is written with the plan's default time budget, as a person's first run has it; on a machine
too busy for the plan to finish in it the script writes nothing and says so. ``--unhurried`` gives the plan
all the time it needs (the sample then shows that budget); ``--check`` is always unhurried.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
QUICKSTART = ROOT / "notebooks" / "quickstart.ipynb"
BEGIN = "<!-- sample: written by scripts/readme_sample.py from notebooks/quickstart.ipynb -->"
END = "<!-- end of sample -->"
# The cell magic line the sample shows: the quickstart's, with the plain-text report asked for.
FAILING = "%%gpumem --limit $LIMIT"


def quickstart_cells() -> list[str]:
    """The quickstart's code cells up to and including the one that runs out of memory."""
    cells = json.loads(QUICKSTART.read_text(encoding="utf-8"))["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    last = next(i for i, source in enumerate(code) if source.startswith(FAILING))
    return code[: last + 1]


def sample(unhurried: bool = False) -> str:
    """What the quickstart's failing cell prints in terminal IPython on a CPU (``--text``). ``unhurried``
    gives the fix plan all the time it needs (a busy machine's trials would run out of the default
    budget and measure less): for a check of the words, whose figures are not compared."""
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU mode wherever this runs: the sample is the same
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.utils.capture import capture_output

    shell = InteractiveShell.instance()
    if unhurried:
        shell.run_line_magic("config", "GpuMemMagics.plan_budget_max = 600.0")
        shell.run_line_magic("config", "GpuMemMagics.plan_budget_min = 600.0")
    *setup, failing = quickstart_cells()
    with capture_output():
        for source in setup:
            shell.run_cell(source)
    with capture_output() as cap:
        shell.run_cell(failing.replace(FAILING, f"{FAILING} --text", 1))
    text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    return "\n".join(["%%gpumem --limit $LIMIT --text", *failing.splitlines()[1:], "", *lines])


def block(text: str) -> str:
    return f"{BEGIN}\n```\n{text}\n```\n{END}"


def readme_sample(readme: str) -> str:
    """The sample the README holds now (between the markers)."""
    start, end = readme.index(BEGIN), readme.index(END)
    return readme[start + len(BEGIN) : end].strip().removeprefix("```").removesuffix("```").strip("\n")


def figures_masked(text: str) -> str:
    """The text with every number written as '#': the words and the layout, not this run's figures."""
    return re.sub(r"\d+(?:[.,]\d+)*", "#", text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the README's sample is stale")
    parser.add_argument("--unhurried", action="store_true", help="give the fix plan all the time it needs")
    args = parser.parse_args()
    readme = README.read_text(encoding="utf-8")
    fresh = sample(unhurried=args.check or args.unhurried)
    if args.check:
        old, new = figures_masked(readme_sample(readme)), figures_masked(fresh)
        if old != new:
            diff = difflib.unified_diff(
                old.splitlines(), new.splitlines(), "README", "quickstart", lineterm=""
            )
            print("\n".join(diff))
            print("README.md's sample is stale: run python scripts/readme_sample.py", file=sys.stderr)
            return 1
        print("README.md's sample is what the quickstart prints (figures aside)")
        return 0
    if "time budget ran out" in fresh:
        print(
            "the fix plan ran out of its time budget (a busy machine): nothing written; run this again on a "
            "quieter one, or with --unhurried",
            file=sys.stderr,
        )
        return 1
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    README.write_text(readme[:start] + block(fresh) + readme[end:], encoding="utf-8")
    print(f"README.md's sample written ({len(fresh.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
