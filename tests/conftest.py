"""Shared fixtures: a real in-process IPython shell with the extension loaded."""

from __future__ import annotations

import re

import pytest


@pytest.fixture(scope="session")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "oommagic")
    ip.run_cell("import torch")
    return ip


@pytest.fixture
def run_cell(shell):
    """Run a cell in the shell; return (ExecutionResult, captured stdout+stderr)."""
    from IPython.utils.capture import capture_output

    def run(source: str):
        with capture_output() as cap:
            result = shell.run_cell(source, store_history=True)
        return result, re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)

    return run
