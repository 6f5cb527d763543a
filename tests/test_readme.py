"""The README is the product's: its options table lists every option the magic's parser has, and its
sample output is what the quickstart's failing cell prints today (``scripts/readme_sample.py --check``)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def table_options() -> set[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    table = text[text.index("| option | meaning |") :].split("\n\n", 1)[0]
    return {m.group(1) for m in re.finditer(r"^\| `(-{1,2}[\w-]+)", table, re.MULTILINE)}


def test_the_options_table_lists_every_option_of_the_parser():
    from oommagic.magics import GpuMemMagics

    parser = {
        s for a in GpuMemMagics.gpumem.parser._actions for s in a.option_strings if s not in ("-h", "--help")
    }
    assert {"--fix", "--free", "--snapshot", "--no-snapshot"} <= parser
    assert table_options() == parser, (
        f"missing from the README: {sorted(parser - table_options())}; "
        f"not options of the magic: {sorted(table_options() - parser)}"
    )


def test_the_readme_sample_is_what_the_quickstart_prints():
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "readme_sample.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert check.returncode == 0, check.stdout + check.stderr
