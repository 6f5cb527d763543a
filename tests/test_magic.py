"""%%gpumem in a real IPython shell, CPU mode: recording, the emulated limit, giving memory back, options."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

import oommagic
from oommagic.run.capture import LEDGER

MiB = 1024**2


def last_run():
    return oommagic.history()[-1]


def test_import_and_load_ext_import_neither_torch_nor_nvml():
    code = (
        "import sys, oommagic\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "InteractiveShell.instance().run_line_magic('load_ext', 'oommagic')\n"
        "print(sorted(m for m in ('torch', 'pynvml', 'ipywidgets', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_cell_records_exact_tensor_bytes(run_cell):
    result, _ = run_cell("%%gpumem --quiet\nx1 = torch.empty(10_000_000, dtype=torch.uint8)\ny1 = x1[::2]")
    assert result.success
    run = last_run()
    assert run.outcome == "ok" and run.device == "cpu"
    assert run.peak_allocated - run.before_allocated == 10_000_000  # the view shares the storage
    assert run.after_allocated - run.before_allocated == 10_000_000
    assert run.timeline.peak_allocated == run.peak_allocated


def test_optimizer_steps_are_marked(run_cell):
    result, _ = run_cell(
        "%%gpumem --quiet\n"
        "m = torch.nn.Linear(64, 64)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n    m(torch.randn(8, 64)).sum().backward(); opt.step(); opt.zero_grad()\n"
    )
    assert result.success
    assert len(last_run().timeline.steps) == 3


def test_no_timeline_keeps_the_peak_exact_and_the_steps(run_cell):
    result, _ = run_cell(
        "%%gpumem --no-timeline --quiet\n"
        "m = torch.nn.Linear(64, 64)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "for _ in range(3):\n    m(torch.randn(8, 64)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "big = torch.empty(10_000_000, dtype=torch.uint8)\ndel big\n"
    )
    assert result.success
    run = last_run()
    assert run.options.no_timeline is True
    assert len(run.timeline.steps) == 3 and len(run.timeline.t) == 2  # the start and the end only
    assert run.peak_allocated - run.before_allocated >= 10_000_000  # the freed tensor still counts
    assert run.timeline.peak_allocated < run.peak_allocated
    from oommagic.view.plot import timeline_png
    from oommagic.view.text import render_text

    assert "--no-timeline: no timeline between the start and the end" in render_text(run)
    assert timeline_png(run).startswith(b"\x89PNG")


def test_no_timeline_still_reports_and_diagnoses_an_oom(run_cell):
    cell = "%%gpumem --no-timeline --limit 1MiB --no-raise --quiet\nz = torch.zeros(2 * 1024 * 1024)"
    result, _ = run_cell(cell)
    run = last_run()
    assert result.success and run.outcome == "oom"
    assert run.report.requested == 8 * MiB and run.report.limit == MiB
    keys = [f.key for f in run.findings]
    assert keys[0] == "too_large" and "limit" in keys


OVERRUN = """%%gpumem --limit 128MiB
import weakref
def fill():
    held = torch.ones(64 * 1024 * 1024, dtype=torch.uint8)
    refs.append(weakref.ref(held))
    more = torch.empty(200 * 1024 * 1024, dtype=torch.uint8)
    return held, more
fill()
"""


def test_oom_in_cell_gives_memory_back(shell, run_cell):
    shell.user_ns["refs"] = []
    before = LEDGER.allocated
    result, out = run_cell(OVERRUN)
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    run = last_run()
    assert run.outcome == "oom"
    assert shell.user_ns["refs"][0]() is None, "the failed cell's tensor is still alive"
    assert LEDGER.allocated == before
    assert run.freed == 64 * MiB
    rep = run.report
    assert rep.emulated and rep.device == "cpu"
    assert rep.requested == 200 * MiB
    assert rep.limit == 128 * MiB
    assert rep.allocated == before + 64 * MiB
    assert rep.free == 128 * MiB - before - 64 * MiB
    # The message rounds to two decimals like PyTorch's; the report keeps the tracker's exact bytes.
    parsed = oommagic.parse_oom(rep.text)
    for name in ("requested", "free", "allocated", "limit", "capacity"):
        assert abs(getattr(parsed, name) - getattr(rep, name)) <= 0.005 * getattr(rep, name) + 1, name
    assert "Traceback" not in out and "OutOfMemoryError" in out
    assert "needed" in out
    # The cell ends with PyTorch's own class and message: readable by parse_oom, known to is_oom.
    err = result.error_in_exec
    assert oommagic.is_oom(err) and oommagic.parse_oom(str(err)).requested == 200 * MiB


# A leak whose kept tensor is each step's first allocation: the error comes at that allocation, so the
# step it cut short kept nothing. The growth over the complete steps must still be found, and first.
LEAK_FIRST = """%%gpumem --limit 4GiB --no-raise --quiet
def slow_fill(steps):
    w = torch.nn.Parameter(torch.zeros(1024))
    opt = torch.optim.SGD([w], lr=0.1)
    kept = []
    for _ in range(steps):
        kept.append(torch.empty(256 * 1024**2, dtype=torch.uint8))  # never touched: no RAM used
        w.grad = torch.ones_like(w)
        opt.step()
slow_fill(100)
"""


def test_a_leak_allocated_first_in_each_step_is_diagnosed_as_growth(run_cell):
    run_cell(LEAK_FIRST)
    run = last_run()
    assert run.outcome == "oom" and len(run.timeline.steps) == 15
    top = run.findings[0]
    assert top.key == "growth", [f.key for f in run.findings]
    assert "rose 256.00 MiB per step over the last 13 steps" in top.evidence


def test_huge_request_is_refused_before_it_is_allocated(run_cell):
    # 1 TiB would not fit in this machine: the emulated limit must refuse it from the factory's size.
    result, _ = run_cell("%%gpumem --limit 1GiB --quiet\nbig = torch.empty(1024**4, dtype=torch.uint8)")
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert last_run().report.requested == 1024**4


def test_no_raise_keeps_the_cell_green(run_cell):
    result, _ = run_cell("%%gpumem --limit 1MiB --no-raise --quiet\nz = torch.zeros(2 * 1024 * 1024)")
    assert result.success
    assert last_run().outcome == "oom"


def test_other_errors_keep_their_traceback(run_cell):
    result, out = run_cell("%%gpumem\ndef inner():\n    raise ValueError('boom 42')\ninner()")
    assert type(result.error_in_exec) is ValueError and str(result.error_in_exec) == "boom 42"
    assert out.count("ValueError: boom 42") == 1, "the traceback is shown once"
    assert "_finish" not in out and "oommagic" not in out, "the magic's own frames are hidden"
    assert "ValueError" in out and "boom 42" in out and "inner()" in out
    assert last_run().outcome == "error"


def test_the_run_can_be_kept_and_serialised(shell, run_cell):
    run_cell("%%gpumem --quiet -o kept\nw = torch.ones(1000)")
    kept = shell.user_ns["kept"]
    assert kept is last_run()
    data = json.loads(json.dumps(kept.to_json()))
    assert data["peak_allocated"] == kept.peak_allocated and data["outcome"] == "ok"


def test_ipython_syntax_keeps_working_inside(run_cell):
    result, out = run_cell(
        "%%gpumem --quiet\n%time t = torch.ones(10)\nr = !echo from-shell\nprint(r[0])\n"
        "import asyncio\nawait asyncio.sleep(0)\n"
    )
    assert result.success, out
    assert "from-shell" in out and "Wall time" in out


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--limit abc", "'abc'"),
        ("--limit 12XB", "24GiB"),
        ("--limit 3", "fraction"),
        ("--limit -1GiB", "expected one argument"),
        ("--limit=-1GiB", "24GiB"),
        ("--bogus", "unrecognized"),
        ("-o 1x", "Python name"),
        ("--device cuda:0", "CUDA is not available"),
        ("--device gpu7", "--device expects"),
    ],
)
def test_bad_options_say_what_is_accepted(shell, run_cell, line, message):
    count = len(oommagic.history())
    result, out = run_cell(f"%%gpumem {line}\nnever_defined_here = 1")
    assert message in out
    assert "never_defined_here" not in shell.user_ns
    assert len(oommagic.history()) == count
    assert not result.success


def test_limit_above_the_machine_warns_and_sets_none(run_cell):
    result, out = run_cell("%%gpumem --limit 1000TiB --quiet\nv = 1")
    assert result.success
    assert "no limit set" in out
    assert last_run().limit is None


def test_interrupt_restores_every_setting(shell, run_cell):
    from torch.optim.optimizer import _global_optimizer_post_hooks

    hooks = len(_global_optimizer_post_hooks)
    custom = shell.custom_exceptions
    result, _ = run_cell("%%gpumem --limit 1GiB\nq = torch.ones(10)\nraise KeyboardInterrupt")
    assert isinstance(result.error_in_exec, KeyboardInterrupt)
    assert last_run().outcome == "interrupted"
    assert torch._C._len_torch_dispatch_stack() == 0
    assert len(_global_optimizer_post_hooks) == hooks
    assert shell.custom_exceptions == custom
    assert LEDGER.listener is None


def test_help_is_the_docstring_and_the_options(shell):
    doc = shell.find_cell_magic("gpumem").__doc__
    assert "--limit" in doc and "--find-batch" in doc and "CPU mode" in doc


def test_line_magic_reports_devices_plainly(run_cell):
    result, out = run_cell("%gpumem")
    assert result.success
    assert "NVML" in out


def test_without_torch_the_magic_says_how_to_install_it():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from IPython.core.interactiveshell import InteractiveShell\n"
        "ip = InteractiveShell.instance(); ip.run_line_magic('load_ext', 'oommagic')\n"
        "ip.run_cell('%%gpumem\\nx = 1')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    out = out.stdout + out.stderr
    assert "pip install torch" in out


BINDS = (
    "%%gpumem --limit 48MiB --quiet {opt}\nkept_small = 7\n"
    "bound_big = torch.ones(32 * 2**20, dtype=torch.uint8)\nmore = torch.empty(32 * 2**20, dtype=torch.uint8)"
)


def test_names_the_failed_cell_bound_to_memory_are_dropped(shell, run_cell):
    for name in ("bound_big", "kept_small", "more"):
        shell.user_ns.pop(name, None)
    before = LEDGER.allocated
    result, _ = run_cell(BINDS.format(opt=""))
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    run = last_run()
    assert run.dropped == (("bound_big", 32 * MiB),)
    assert "bound_big" not in shell.user_ns and shell.user_ns["kept_small"] == 7
    assert LEDGER.allocated == before and run.freed == 32 * MiB


def test_keep_leaves_them_bound(shell, run_cell):
    result, _ = run_cell(BINDS.format(opt="--keep"))
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    assert last_run().dropped == () and shell.user_ns["bound_big"].numel() == 32 * MiB
    del shell.user_ns["bound_big"]


def test_an_oom_in_an_unknown_format_is_still_caught_and_kept(run_cell):
    result, out = run_cell(
        "%%gpumem\nclass OutOfMemoryError(RuntimeError):\n    pass\n"
        "raise OutOfMemoryError('accelerator said: no room (code 7)')"
    )
    assert isinstance(result.error_in_exec, torch.OutOfMemoryError)
    run = last_run()
    assert run.report.source == "unknown" and "no room (code 7)" in run.report.text
    assert run.report.requested is None
    assert "Traceback" not in out


# --- one path for a run: the options typed once, the cell parsed once, fixes read by kind ---------------

TRAIN_FOR_N = """%%gpumem --limit 24MiB --quiet --no-raise --plan-budget 0 {opts}
{prefix}model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(2):
    x = torch.randn(n, 64, 256)
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad()
"""


def findings_of(run) -> list[tuple[str, str]]:
    return [(f.key, f.evidence) for f in run.findings]


def test_batch_option_reaches_the_first_report(shell, run_cell):
    shell.user_ns["n"] = 64
    run_cell(TRAIN_FOR_N.format(opts="--batch n", prefix=""))
    run = last_run()
    assert run.context.batch.name == "n" and run.context.batch.value == 64
    batch = next(r for f in run.findings for r in f.remedies if r.kind == "batch")
    assert batch.params["name"] == "n" and "--batch NAME" not in " ".join(e for _, e in findings_of(run))


def test_ipython_lines_in_the_cell_change_no_finding(shell, run_cell):
    shell.user_ns["n"] = 64
    run_cell(TRAIN_FOR_N.format(opts="", prefix=""))
    plain = last_run()
    run_cell(TRAIN_FOR_N.format(opts="", prefix="!echo preparing\n%time 1 + 1\n"))
    with_magics = last_run()
    assert with_magics.outcome == plain.outcome == "oom"
    assert [k for k, _ in findings_of(with_magics)] == [k for k, _ in findings_of(plain)]
    assert with_magics.context.training and with_magics.context.batch == plain.context.batch


def test_renaming_a_fix_changes_no_finding(shell, run_cell):
    from dataclasses import replace

    from oommagic.diagnosis.findings import Remedy
    from oommagic.run.session import session_for

    shell.user_ns["n"] = 64
    run_cell(TRAIN_FOR_N.format(opts="", prefix=""))
    failed = last_run()
    session = session_for(shell)
    autocast = Remedy("autocast", "bfloat16 autocast", automatic=True, params={"dtype": "bfloat16"})
    one = session.retry(failed, autocast)
    two = session.retry(failed, replace(autocast, title="something else entirely"))
    assert one.outcome == two.outcome == "oom"
    assert findings_of(one) == findings_of(two) and one.context.autocast_on and two.context.autocast_on
    assert "Autocast is already on" in " ".join(e for _, e in findings_of(two))


def test_unknown_options_show_the_parsers_usage(shell, run_cell):
    result, out = run_cell("%%gpumem --bogus\nx = 1")
    assert "UsageError" in out or not result.success
    usage = shell.find_cell_magic("gpumem").__self__.gpumem.parser.format_usage()
    for flag in ("--keep", "--no-timeline", "--plan-budget", "--find-batch"):
        assert flag in usage and flag in out, flag


def test_knobs_are_traits_settable_with_config(shell, run_cell):
    from oommagic.run.session import session_for

    shell.run_line_magic("config", "GpuMemMagics.plan_margin = 0.2")
    try:
        run_cell("%%gpumem --quiet\nx = 1")
        assert session_for(shell).settings.plan_margin == 0.2
    finally:
        shell.run_line_magic("config", "GpuMemMagics.plan_margin = 0.05")


def test_an_oom_cell_ends_with_pytorchs_error_and_pins_nothing(shell, run_cell):
    shell.user_ns["refs"] = []
    result, _ = run_cell(OVERRUN)
    err = result.error_in_exec
    assert isinstance(err, torch.OutOfMemoryError) and oommagic.is_oom(err)
    assert oommagic.parse_oom(str(err)).requested == 200 * MiB
    assert shell.user_ns["refs"][0]() is None, "the error holds no frame of the failed cell"
    try:  # what a person's `except torch.OutOfMemoryError` around run_cell sees
        raise err
    except torch.OutOfMemoryError as caught:
        assert caught is err


# --- errors pass through as they would without the magic -----------------------------------------------

OWN_ERRORS = {
    "SystemExit": "raise SystemExit(3)",
    "a BaseException of the cell's own": (
        "class StopEverything(BaseException):\n    pass\nraise StopEverything('halt')"
    ),
    "an error of the cell's own whose text reads like an OOM": (
        "class LoaderError(Exception):\n    pass\n"
        "raise LoaderError('CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
        "8.00 GiB of which 1.00 GiB is free.')"
    ),
    "a syntax error": "x = (1,\ny = 2 +\n",
    "an indentation error": "if True:\nprint('x')\n",
    "a ValueError two frames deep": "def inner():\n    raise ValueError('boom 42')\ninner()",
    "a BdbQuit": "import bdb\nraise bdb.BdbQuit()",
}


def _shown(out: str) -> str:
    return re.sub(r"(Cell In\[|In\[|ipython-input-)\d+", r"\1N", out)


@pytest.mark.parametrize("source", OWN_ERRORS.values(), ids=OWN_ERRORS.keys())
def test_errors_end_the_cell_as_they_would_without_the_magic(shell, run_cell, source):
    plain, plain_out = run_cell(source)
    count = len(oommagic.history())
    result, out = run_cell("%%gpumem --device cpu\n" + source)
    expected = plain.error_before_exec or plain.error_in_exec
    err = result.error_before_exec or result.error_in_exec
    assert not plain.success and not result.success, "the cell fails (Run All stops)"
    assert type(err).__qualname__ == type(expected).__qualname__ and _shown(str(err)) == _shown(str(expected))
    assert _shown(out) == _shown(plain_out), "shown as IPython shows it, no frame of the magic"
    assert len(oommagic.history()) == count + 1 and last_run().outcome == "error"


RUNTIME_OOMS = {
    "torch.AcceleratorError": (
        "torch.AcceleratorError",
        "raise torch.AcceleratorError('CUDA error: out of memory\\nCUDA kernel errors might be "
        "asynchronously reported at some other API call, so the stacktrace below might be incorrect.')",
    ),
    "MPS RuntimeError": (
        "RuntimeError",
        "raise RuntimeError('MPS backend out of memory (MPS allocated: 17.00 GiB, other allocations: "
        "1.00 GiB, max allowed: 18.13 GiB). Tried to allocate 256.00 MiB on private pool.')",
    ),
}


@pytest.mark.parametrize(("kind", "source"), RUNTIME_OOMS.values(), ids=RUNTIME_OOMS.keys())
def test_a_runtimes_own_oom_becomes_the_tools_and_keeps_its_type(run_cell, kind, source):
    result, out = run_cell("%%gpumem --device cpu --quiet\n" + source)
    err = result.error_in_exec
    assert isinstance(err, torch.OutOfMemoryError), "the tool's OOM: PyTorch's class"
    assert isinstance(err, eval(kind)), "an `except` written for the runtime's own type still catches it"
    assert last_run().outcome == "oom" and oommagic.parse_oom(str(err)) is not None
    assert "Traceback" not in out


# --- the names a rewrite adds are its own ---------------------------------------------------------------

OWN_COUNTER = """%%gpumem --limit 24MiB --quiet --no-raise
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
micro_step = 0
for _ in range(2):
    x = torch.randn(n, 64, 256)
    model(x).square().mean().backward()
    {count}
    opt.step()
    opt.zero_grad()
"""


@pytest.mark.parametrize(
    ("count", "expected"),
    [("micro_step += 1", lambda acc: 2 * acc), ("micro_step += len(x)", lambda acc: 128)],
    ids=["micro-batches", "samples"],
)
def test_a_cell_counting_with_micro_step_keeps_its_steps_and_its_count(shell, run_cell, count, expected):
    from oommagic.run.session import session_for
    from oommagic.view.widget import ReportWidget

    shell.user_ns["n"] = 64
    shell.user_ns["micro_step_"] = "a name of the person's"
    run_cell(OWN_COUNTER.format(count=count))
    failed = last_run()
    assert failed.outcome == "oom"
    widget = ReportWidget(failed, session_for(shell))
    (batch,) = next(f for f in widget.fixes if f.kind == "batch").fixes
    acc = batch.params["accumulate"]
    assert acc > 1 and batch.params["new"] * acc == 64, batch.title
    retry = widget.click("batch")
    assert retry.outcome == "ok", retry.headline()
    assert len(retry.timeline.steps) == 2, "two optimizer steps of 64 samples, as the cell was written"
    # The cell's own counter counts what its own line says (each micro-batch, or the 128 samples), neither
    # reset nor stepped by the accumulation; the namespace's names are left alone.
    assert shell.user_ns["micro_step"] == expected(acc), retry.source
    assert shell.user_ns["micro_step_"] == "a name of the person's"


# --- options and figures that cannot be used -------------------------------------------------------------


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("--plan-budget nan", "--plan-budget expects a number of seconds"),
        ("--plan-budget inf", "--plan-budget expects a number of seconds"),
        ("--plan-budget 1e400", "--plan-budget expects a number of seconds"),
        ("--limit 100000000000000000000000000TiB", "more than any device holds"),
    ],
)
def test_a_budget_or_limit_that_is_no_number_is_refused(shell, run_cell, line, message):
    count = len(oommagic.history())
    result, out = run_cell(f"%%gpumem {line}\nnever_run_here = 1")
    assert "UsageError" in out and message in out, out
    assert not result.success and "never_run_here" not in shell.user_ns
    assert len(oommagic.history()) == count


def test_a_figure_beyond_any_device_stays_out_of_the_headline(run_cell):
    _, out = run_cell(
        "%%gpumem --device cpu --text --no-raise\n"
        "raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 99999999999999999999999999.00 "
        "GiB. GPU 0 has a total capacity of 8.00 GiB of which 1.00 GiB is free.')"
    )
    run = last_run()
    assert run.outcome == "oom" and run.report.requested is None and run.report.capacity == 8 * 1024**3
    assert re.search(r"\d{10}", run.headline()) is None and re.search(r"\d{10}", out) is None, out


def test_an_error_in_a_repr_fails_no_cell_as_without_the_magic(run_cell):
    source = "class Odd:\n    def __repr__(self):\n        raise ValueError('no repr')\nOdd()"
    plain, _ = run_cell(source)
    result, out = run_cell("%%gpumem --device cpu\n" + source)
    assert plain.success and result.success and "no repr" in out
    assert last_run().outcome == "ok"


def test_a_trial_whose_time_runs_out_inside_no_grad_leaves_autograd_on(shell):
    from oommagic.options import Options
    from oommagic.run.runner import Bounds, RunSpec, execute

    # The budget runs out while the block sleeps: the next torch call is no_grad's own switch back.
    cell = "import time\nwith torch.no_grad():\n    time.sleep(1.5)\nv = torch.ones(2) * 2\n"
    spec = RunSpec(source=cell, options=Options(device="cpu"))
    attempt = execute(shell, spec, bounds=Bounds(steps=None, seconds=0.5), scan=False)
    assert attempt.outcome == "stopped" and "time budget" in attempt.stopped_by
    # The budget ends the trial at an operation on tensors, never inside the switch of a mode that the
    # `with` around it would then not switch back.
    assert torch.is_grad_enabled()
    shell.user_ns.pop("v", None)
