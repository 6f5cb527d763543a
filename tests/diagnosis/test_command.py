"""A script the cell launches on ranks: the launch line, the script's argparse options, and the command line
a batch fix writes (the script itself is never rewritten)."""

from __future__ import annotations

from oommagic.diagnosis.source.command import command_batch, command_source, launch, parser_flags

SCRIPT = """
import argparse
p = argparse.ArgumentParser()
p.add_argument("--epochs", type=int, default=1)
p.add_argument("-b", "--batch-size", type=int, default=64)
p.add_argument("--accum", dest="gradient_accumulation_steps", type=int, default=1)
p.add_argument("--lr", type=float, default=3e-4)
args = p.parse_args()
"""


def test_the_launch_line_names_the_script_and_its_arguments():
    assert launch("x = 1\n!torchrun --nproc_per_node 2 train.py --epochs 3\n").script == "train.py"
    found = launch(
        "!{sys.executable} -m torch.distributed.run --nproc_per_node=2 {script} -b 8", {"script": "a/t.py"}
    )
    assert (found.line, found.script, found.arguments) == (0, "a/t.py", ("-b", "8"))
    assert launch("!accelerate launch --num_processes 2 run.py").script == "run.py"
    # Not a distributed launch, or a script that cannot be read without evaluating an expression.
    assert launch("!python train.py") is None
    assert launch("!torchrun --nproc_per_node 2 {Path('x') / 't.py'}") is None
    assert launch("import torchrun") is None


def test_the_scripts_options_are_read_from_its_parser():
    flags = {f.dest: f for f in parser_flags(SCRIPT)}
    assert flags["batch_size"].options == ("-b", "--batch-size") and flags["batch_size"].default == 64
    assert flags["batch_size"].written == "--batch-size"
    assert flags["gradient_accumulation_steps"].written == "--accum"
    assert flags["lr"].default is None  # not an int
    assert parser_flags("def broken(:\n") == ()


def test_the_batch_is_the_value_the_line_passes_else_the_scripts_default():
    guess = command_batch("!torchrun --nproc_per_node 2 train.py -b 32 --batch-size=48", SCRIPT)
    assert (guess.name, guess.value, guess.where) == ("--batch-size", 48, "command")  # the last one wins
    assert guess.accumulation == ("--accum", 1)
    assert command_batch("!torchrun --nproc_per_node 2 train.py", SCRIPT).value == 64
    assert command_batch("!torchrun --nproc_per_node 2 train.py", "import torch\nbatch_size = 8\n") is None


def test_a_fix_passes_the_batch_and_the_accumulation_on_the_launch_line():
    cell = "import os\n!torchrun --nproc_per_node=2 train.py --batch-size=64 --accum 2  # go\nprint(1)\n"
    guess = command_batch(cell, SCRIPT)
    new, keeps = command_source(cell, guess, 16, 4)
    assert keeps
    assert (
        new == "import os\n!torchrun --nproc_per_node=2 train.py --batch-size=16 --accum 8  # go\nprint(1)\n"
    )
    # Values the line does not pass are added where argparse reads them last, before a comment.
    cell = "!torchrun --nproc_per_node 2 train.py # run it\n"
    new, keeps = command_source(cell, command_batch(cell, SCRIPT), 16, 4)
    assert new == "!torchrun --nproc_per_node 2 train.py --batch-size 16 --accum 4 # run it\n" and keeps
    # A script with no accumulation option: the batch is passed, and the accumulation said not written.
    plain = SCRIPT.replace(
        'p.add_argument("--accum", dest="gradient_accumulation_steps", type=int, default=1)\n', ""
    )
    cell = "!torchrun --nproc_per_node 2 train.py -b 64"
    new, keeps = command_source(cell, command_batch(cell, plain), 16, 4)
    assert new == "!torchrun --nproc_per_node 2 train.py -b 16" and not keeps
