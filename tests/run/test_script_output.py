"""The output of a script the cell launches on ranks: kept while it runs, and a rank's out-of-memory error
found in it (torchrun's ``[rankN]:`` prefix, or its summary's first failure)."""

from __future__ import annotations

import sys

from oommagic.run.script_output import OutputTail, rank_oom_in

MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
    "79.19 GiB of which 1.00 GiB is free."
)
SUMMARY = """Root Cause (first observed failure):
[0]:
  time      : 2026-11-28_07:54:37
  host      : localhost
  rank      : 3 (local_rank: 3)
  exitcode  : 1 (pid: 6687)
"""


def test_the_rank_comes_from_its_prefix_else_from_the_first_failure():
    rank, report = rank_oom_in(f"[rank2]: Traceback (most recent call last):\n[rank2]: {MESSAGE}\n")
    assert rank == 2 and report.requested == 2 * 1024**3 and report.gpu_index == 0
    rank, _ = rank_oom_in(f"Traceback (most recent call last):\n{MESSAGE}\n{SUMMARY}")
    assert rank == 3
    assert rank_oom_in(MESSAGE)[0] is None
    assert rank_oom_in("loss 0.31\nout of memory is what this line says, no figures\n") is None


def test_the_streams_are_kept_only_where_the_cell_launches_a_script(capsys):
    with OutputTail("x = 1\nprint(x)") as tail:
        print("plain")
    assert not tail.watching and tail.text == ""
    before = sys.stdout
    with OutputTail("!torchrun --nproc_per_node 2 train.py") as tail:
        print("from a rank")
        sys.stderr.write("on stderr\n")
    assert sys.stdout is before
    assert tail.text == "from a rank\non stderr\n"
    assert "from a rank" in capsys.readouterr().out, "written through as without the tool"
