"""A person's session in terminal IPython (the real ``ipython`` program under a pseudo-terminal, CPU
mode): a cell runs out of memory, the text report shows each fix's change and the command that runs it,
``%gpumem --fix`` runs the recommended one, the cell fits, and the report says what the kernel now holds
that the typed cell does not."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

pexpect = pytest.importorskip("pexpect")

ROOT = Path(__file__).resolve().parents[1]
PROMPT = r"In \[\d+\]: "


def test_a_fix_from_the_terminal(tmp_path, small_quickstart):
    (tmp_path / "setup.py").write_text(small_quickstart)
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "IPYTHONDIR": str(tmp_path / "ipython"),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
        "TERM": "dumb",
    }
    ipython = Path(sys.executable).with_name("ipython")
    term = pexpect.spawn(
        str(ipython),
        ["--simple-prompt", "--no-banner", "--colors=NoColor", "--HistoryManager.enabled=False"],
        cwd=str(tmp_path),
        env=env,
        encoding="utf-8",
        timeout=120,
        dimensions=(50, 100),
    )
    try:

        def cell(*lines: str) -> str:
            """Type a cell; what it printed up to the next prompt. A cell magic ends at an empty line (at
            two in --simple-prompt, whose input() drops the first one's newline)."""
            for line in lines:
                term.sendline(line)
            if lines[0].startswith("%%"):
                term.sendline("")
                term.sendline("")
            term.expect(PROMPT)
            return term.before.replace("\r", "")

        term.expect(PROMPT)
        cell("%load_ext oommagic")
        cell("%run -i setup.py")  # its functions' source is the file's, as a notebook's is its cell's
        cell("%%gpumem --device cpu --quiet -o fits", "model = make_model()", "loss = train(model, 8)")
        cell('LIMIT = f"{2 * fits.peak_reserved // 2**20 + 1}MiB"')
        failed = cell(
            "%%gpumem --device cpu --limit $LIMIT",
            "batch_size = 64",
            "model = make_model()",
            "loss = train(model, batch_size=batch_size)",
        )
        assert "[OUT OF MEMORY]" in failed, failed
        assert "%gpumem --fix 1 runs it:" in failed and "- batch_size = 64" in failed, failed
        assert "OutOfMemoryError" in failed, failed
        fixed = cell("%gpumem --fix")
        assert "%%gpumem [ok]" in fixed, fixed
        assert "`train` is the rewritten one" in fixed and "`batch_size` is now" in fixed, fixed
        assert "paste into the cell what ran" in fixed, fixed
        term.sendline("exit")
        term.expect(pexpect.EOF, timeout=30)
    finally:
        term.close(force=True)
