"""GPU tests: the real CUDA path of ``%%gpumem`` in a real in-process IPython shell.

Every test here carries the ``gpu`` marker and is skipped where ``torch.cuda.is_available()`` is false.
Each prints the figures it measured (run with ``-s -v`` so the log quotes them). Fixtures: ``shell``
comes from ``tests/conftest.py``; this file adds a cell runner that prints, a clean card before each
test, and the rounding tolerance of PyTorch's two-decimal sizes.
"""

from __future__ import annotations

import gc
import re

import pytest
import torch

MiB, GiB = 1024**2, 1024**3


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def clean_card(request: pytest.FixtureRequest):
    """Start each GPU test from an empty cache and the whole card; say what the test left behind."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)
    before = torch.cuda.memory_allocated()
    yield
    gc.collect()
    torch.cuda.empty_cache()
    print(
        f"\n[{request.node.name}] allocated before {before:,d} B, after {torch.cuda.memory_allocated():,d} B"
    )


@pytest.fixture
def cell(shell):
    """Run a cell, print what it showed (ANSI colours stripped, long output cut), return the result."""
    from IPython.utils.capture import capture_output

    def run(source: str, show: int = 2500):
        with capture_output() as cap:
            result = shell.run_cell(source, store_history=True)
        text = re.sub(r"\x1b\[[0-9;]*m", "", cap.stdout + cap.stderr)
        if text.strip():
            print(text if len(text) <= show else text[: show // 2] + "\n[...]\n" + text[-show // 2 :])
        return result

    return run


@pytest.fixture
def rounding():
    """Largest error of a size PyTorch printed with two decimals in its unit (bytes/KiB/MiB/GiB)."""

    def tolerance(n: int) -> int:
        unit = 1 if n < 1024 else 1024 if n < MiB else MiB if n < GiB else GiB
        return unit // 200 + 1

    return tolerance


@pytest.fixture
def retry_with(shell):
    """Run the cell again with the remedy of ``kind`` the diagnosis offered, through the session the
    widget's buttons call, and return the widget showing it (its latest run is the retry). The diagnosis
    must offer it; only ``hand_made`` (a remedy the diagnosis does not offer for that scenario, said in the
    log) is used instead: such a test proves the retry mechanism, not the diagnosis."""
    from oommagic.run.session import session_for
    from oommagic.view.widget import ReportWidget

    def retry(run, kind: str, hand_made=None):
        offered = [r for f in run.findings for r in f.remedies if r.kind == kind and r.automatic]
        print(f"{kind}: findings {[f.key for f in run.findings]}; offered by the diagnosis: {bool(offered)}")
        if hand_made is None:
            assert offered, f"the diagnosis offered no {kind} fix: {[f.key for f in run.findings]}"
            print(f"{kind}: the diagnosis offers {offered[0].title!r} {offered[0].params}")
        else:
            assert not offered, f"the diagnosis offers {kind} now: drop the hand-made remedy"
            print(f"{kind}: not offered by the diagnosis for this scenario; Remedy built by hand")
        session = session_for(shell)
        widget = ReportWidget(run, session)
        new = session.retry(run, hand_made or offered[0])
        widget.runs.append(new)
        print(
            f"{kind} retry: outcome {new.outcome}; peak allocated {new.peak_allocated:,d} B, reserved "
            f"{new.peak_reserved:,d} B, limit {new.limit}; change {new.change!r}; {new.headline()}"
        )
        return widget

    return retry
