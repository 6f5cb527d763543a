"""Shared fixtures: a real in-process IPython shell with the extension loaded. And the order the tests
start in, for pytest-xdist."""

from __future__ import annotations

import re

import pytest

# The modules whose tests run notebooks, kernels or scripts in processes of their own, longest first
# (pytest --durations on 2 cores: the finetune notebook about 3 minutes, the others 10 s to 1 minute each).
# Under pytest-xdist (scripts/test.sh: `-n auto --dist loadfile`) they start first, so that the workers
# share them and the quick modules fill in after; started last, they would leave one worker running them
# while the other waits. None of them touches this process's shell: the modules that do keep their order,
# since each may hold to a namespace that only the modules before it have used.
STARTED_FIRST = (
    "tests/test_notebooks.py",
    "tests/test_kernel.py",
    "tests/test_scenarios_cpu.py",
    "tests/test_scripts.py",
    "tests/test_without_lab.py",
    "tests/view/test_protocol_fixture.py",
    "tests/test_readme.py",
    "tests/test_terminal.py",
)
# Modules whose tests share nothing (each runs a notebook of its own in a kernel of its own): their tests
# go to the workers one by one, so that the four notebooks do not queue on one worker. Every other module
# goes to one worker whole, its tests in their order.
ONE_BY_ONE = ("tests/test_notebooks.py", "tests/test_kernel.py", "tests/test_scenarios_cpu.py")


def pytest_collection_modifyitems(config, items):
    rank = {path: i for i, path in enumerate(STARTED_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(config.rootpath).as_posix(), len(rank)))


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: without xdist (tests/gpu on a GPU box) unused
def pytest_xdist_make_scheduler(config, log):
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByModule(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = super()._split_scope(nodeid)
            return nodeid if module in ONE_BY_ONE else module

    return ByModule(config, log)


@pytest.fixture(scope="session")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "oommagic")
    ip.run_cell("import torch")
    ip._oommagic_tests_started_with = set(ip.user_ns)
    return ip


@pytest.fixture(scope="module", autouse=True)
def shell_as_started(shell):
    """Every module starts from the shared shell as the session made it: the names earlier modules left
    (on whichever worker it runs, after whichever modules) dropped and what their outputs and errors pin
    given back, so that limits sized from the memory held now hold for its cells, in any order."""
    import gc

    from oommagic.run.release import free_pinned

    for name in set(shell.user_ns) - shell._oommagic_tests_started_with:
        shell.user_ns.pop(name, None)
    free_pinned(shell, "cpu")
    shell.run_line_magic("reset", "-f out")
    gc.collect()
    return shell


# The quickstart's model and training function, smaller (its trials take seconds, not half a minute).
SMALL_QUICKSTART = """
import torch
from torch import nn
torch.manual_seed(0)
VOCAB, SEQ = 300, 16

def make_model():
    layer = nn.TransformerEncoderLayer(32, 2, 64, batch_first=True)
    return nn.Sequential(nn.Embedding(VOCAB, 32), nn.TransformerEncoder(layer, 1), nn.Linear(32, VOCAB))

def train(model, batch_size, steps=2):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch_size, SEQ))
        loss = nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return loss.item()
"""


@pytest.fixture(scope="session")
def small_quickstart() -> str:
    """The source of a setup cell like the quickstart's, smaller: ``make_model()`` and ``train()``."""
    return SMALL_QUICKSTART


@pytest.fixture
def run_cell(shell):
    """Run a cell in the shell; return (ExecutionResult, captured stdout+stderr)."""
    from IPython.utils.capture import capture_output

    def run(source: str):
        with capture_output() as cap:
            result = shell.run_cell(source, store_history=True)
        return result, re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)

    return run


@pytest.fixture
def fresh_names(shell):
    """Names a test's cells add to the shared shell are dropped after it (``pytestmark =
    pytest.mark.usefixtures("fresh_names")`` in a module whose every test wants it)."""
    before = set(shell.user_ns)
    yield
    for name in set(shell.user_ns) - before:
        shell.user_ns.pop(name, None)
