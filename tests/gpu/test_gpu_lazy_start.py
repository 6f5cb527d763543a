"""GPU: the first ``%%gpumem`` cell of a fresh kernel, where the cell itself starts CUDA.

The magic starts no CUDA on the cell's behalf (a notebook about to fork its ranks must not have it started):
its recording starts from torch's lazy initialisation, when the cell's code starts CUDA. These tests show
that recording is whole all the same: the ``--limit`` holds from the cell's first allocation, the peak is
exact and the timeline has the cell's allocations. Each runs in a fresh kernel (nbclient). Skipped without
CUDA. Run with ``-s``: each test prints what it measured.
"""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

GiB = 1024**3

REPORT = (
    "import json, oommagic\nrun = oommagic.history()[-1]\n"
    "print('RUN ' + json.dumps({'outcome': run.outcome, 'headline': run.headline(),"
    " 'peak_allocated': run.peak_allocated, 'limit': run.limit, 'capacity': run.capacity,"
    " 'requested': run.report.requested if run.report else None, 'events': run.timeline.events,"
    " 'cuda': torch.cuda.is_initialized()}))"
)


def fresh_kernel(*cells: str) -> dict:
    pytest.importorskip("nbclient")
    from tests.test_kernel import execute, notebook, texts

    nb = notebook(
        "%load_ext oommagic\nimport torch\nprint('before', torch.cuda.is_initialized())", *cells, REPORT
    )
    execute(nb, allow_errors=True, timeout=120)
    for cell in nb.cells:
        print(texts(cell)[-2000:])
    assert texts(nb.cells[0]).strip() == "before False"
    (line,) = [x for x in texts(nb.cells[-1]).splitlines() if x.startswith("RUN ")]
    record = json.loads(line[4:])
    print(record)
    return record


def test_limit_holds_from_the_cells_first_allocation():
    record = fresh_kernel(
        "%%gpumem --limit 2GiB --no-raise --text\n"
        "x = torch.empty(3 * 1024**3, dtype=torch.uint8, device='cuda')"
    )
    assert record["outcome"] == "oom" and record["limit"] == 2 * GiB
    assert record["requested"] == 3 * GiB and record["cuda"]


def test_peak_and_timeline_of_the_cell_that_starts_cuda():
    record = fresh_kernel(
        "%%gpumem --text\nx = torch.ones(256 * 1024**2, device='cuda')\ny = x * 2\ndel x, y",
    )
    assert record["outcome"] == "ok" and record["cuda"]
    assert record["peak_allocated"] == 2 * GiB, "both tensors, exactly"
    assert record["events"] >= 2 and record["capacity"] > 0
