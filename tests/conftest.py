"""Shared fixtures: a real in-process IPython shell with the extension loaded. And the order the tests
start in, for pytest-xdist."""

from __future__ import annotations

import re

import pytest

# The modules whose tests run whole notebooks, kernels, servers or rank processes, longest first (pytest
# --durations on 2 cores: the finetune notebook about 3 minutes, the others 10 s to 1 minute each). They
# start first, so that under pytest-xdist (scripts/test.sh: `-n auto --dist worksteal`) the workers share
# them and the many quick tests fill in after; started last, the finetune notebook would run alone at the
# end. Every other module keeps its place, and every module the order of its own tests.
STARTED_FIRST = (
    "tests/test_notebooks.py",
    "tests/test_kernel.py",
    "tests/test_scenarios_cpu.py",
    "tests/run/test_trainer_settings.py",
    "tests/run/test_ranks.py",
    "tests/test_causes.py",
    "tests/test_scripts.py",
    "tests/test_without_lab.py",
    "tests/test_comm.py",
    "tests/view/test_protocol_fixture.py",
)


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(STARTED_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank)))


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
