"""A trial leaves no trace, whatever the state and whenever an interrupt comes (issue #23), in a real IPython
shell, CPU mode. Hypothesis builds random user state (containers of several kinds nested, models at random
depth with their own optimizers, raw tensors with theirs, tensors updated in place, generator objects, a
file the cell appends to, a checkpoint it saves) and a failing cell that changes all of it: after a plan
of trials everything equals a run with ``--plan-budget 0``. Then 50 interrupts at spread moments inside
trials and their restores: nothing of a trial stays."""

from __future__ import annotations

import collections
import io
import os
import pathlib
import random
import signal
import sys
import tempfile
import threading
import time

import numpy as np
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import oommagic
from oommagic.run.fixes import spec_with
from oommagic.run.release import frozen_heap
from oommagic.run.runner import Bounds
from oommagic.run.session import session_for

BASE = """
import collections, random
import numpy as np
import torch
torch.manual_seed(0); np.random.seed(0); random.seed(0)
class Box:
    pass
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
"""

# The failing cell: its own changes (`{changes}`) come first in each step, so that the failed run and every
# trial make them; the forward pass at batch 256 does not fit 5 MiB.
CELL = """%%gpumem --limit 5MiB --quiet --no-raise --plan-budget {budget}
batch_size = 256
for step in range(2):
{changes}
    loss = model(torch.ones(batch_size, 16, 32)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
    draws = (torch.rand(1), np.random.rand(), random.random())
"""

WRAPPERS = {  # around an inner expression: (the wrapper, how to reach the inner one)
    "list": ("[{}]", "[0]"),
    "dict": ('{{"k": {}}}', '["k"]'),
    "defaultdict": ('collections.defaultdict(list, {{"k": {}}})', '["k"]'),
    "OrderedDict": ("collections.OrderedDict(k={})", '["k"]'),
    "deque": ("collections.deque([{}])", "[0]"),
    "tuple": ("({},)", "[0]"),
    "Box": ("_box(k={})", ".k"),
}
IN_PLACE = ("{n}.mul_(0.5).add_(1)", "{n}.data.add_(1)", "{n}[0] += 1", "{n}.copy_({n} * 2)")
GENERATORS = {
    "torch.Generator().manual_seed(3)": "torch.rand(2, generator={n})",
    "np.random.default_rng(3)": "{n}.random()",
    "np.random.RandomState(3)": "{n}.rand()",
    "random.Random(3)": "{n}.random()",
}

things = st.one_of(
    st.tuples(st.just("nested"), st.lists(st.sampled_from(sorted(WRAPPERS)), min_size=1, max_size=3)),
    st.tuples(st.just("module"), st.integers(0, 3)),
    st.tuples(st.just("raw"), st.sampled_from(["SGD", "Adam"])),
    st.tuples(st.just("in_place"), st.sampled_from(IN_PLACE)),
    st.tuples(st.just("array"), st.just("")),
    st.tuples(st.just("generator"), st.sampled_from(sorted(GENERATORS))),
    st.tuples(st.just("log"), st.booleans()),
    st.tuples(st.just("checkpoint"), st.booleans()),
    st.tuples(st.just("open_log"), st.just("")),
)


def build(items: list, folder: str) -> tuple[str, str]:
    """(setup source, the cell's changes) for the drawn ``items``."""
    setup = [
        BASE,
        "def _box(**kw):\n    b = Box()\n    b.__dict__.update(kw)\n    return b",
    ]
    changes = []
    for i, (kind, arg) in enumerate(items):
        n = f"s{i}"
        if kind == "nested":
            expr, path = "[0]", ""
            for wrapper in reversed(arg):
                make, reach = WRAPPERS[wrapper]
                expr, path = make.format(expr), reach + path
            setup.append(f"{n} = {expr}")
            changes.append(f"{n}{path}.append(step)")
            if arg[0] in ("dict", "defaultdict", "OrderedDict"):
                changes.append(f"{n}['new'] = step" if arg[0] != "defaultdict" else f"{n}['more'].append(1)")
            elif arg[0] in ("list", "deque"):
                changes.append(f"{n}.append(None)")
            elif arg[0] == "Box":
                changes.append(f"{n}.added = step")
        elif kind == "module":
            holder = ".".join(f"a{d}" for d in range(arg))
            path = f"{n}.{holder}.head" if arg else n
            setup.append(f"{n} = Box()" if arg else "")
            for d in range(1, arg):
                setup.append(f"{n}.{'.'.join(f'a{j}' for j in range(d))} = Box()")
            if arg:
                setup.append(f"{n}.{holder} = Box()" if arg >= 1 else "")
            setup.append(f"{path} = torch.nn.Linear(4, 4)")
            setup.append(f"{n}_opt = torch.optim.SGD({path}.parameters(), lr=0.1, momentum=0.9)")
            changes.append(f"{path}(torch.ones(2, 4)).sum().backward(); {n}_opt.step(); {n}_opt.zero_grad()")
        elif kind == "raw":
            setup.append(
                f"{n} = torch.zeros(3, requires_grad=True)\n{n}_opt = torch.optim.{arg}([{n}], lr=0.1)"
            )
            changes.append(f"({n} * 2 + 1).square().sum().backward(); {n}_opt.step()")
        elif kind == "in_place":
            setup.append(f"{n} = torch.ones(4)")
            changes.append(f"with torch.no_grad(): {arg.format(n=n)}")
        elif kind == "array":
            setup.append(f"{n} = np.zeros(3)")
            changes.append(f"{n} += 1")
        elif kind == "generator":
            setup.append(f"{n} = {arg}")
            changes.append(f"_ = {GENERATORS[arg].format(n=n)}")
        elif kind == "log":
            log = os.path.join(folder, f"{n}.log")
            if arg:
                with open(log, "w") as f:
                    f.write("before\n")
            changes.append(f"with open({log!r}, 'a') as f: f.write(f'step {{step}}\\n')")
        elif kind == "open_log":
            setup.append(f"{n} = open({os.path.join(folder, n + '.held')!r}, 'a')")
            changes.append(f"{n}.write(f'step {{step}}\\n')")
        elif kind == "checkpoint":
            ckpt = os.path.join(folder, f"{n}.pt")
            if arg:
                torch.save({"before": torch.zeros(2)}, ckpt)
            changes.append(f"torch.save(model.state_dict(), {ckpt!r})")
    body = "\n".join(f"    {line}" for c in changes for line in c.split("\n")) or "    pass"
    return "\n".join(setup), body


def fingerprint(value, depth: int = 0):
    """A comparable picture of ``value`` and everything it holds (values, not identities)."""
    if depth > 12:
        return "deep"
    deeper = lambda v: fingerprint(v, depth + 1)  # noqa: E731
    if torch.is_tensor(value):
        grad = value.grad if value.is_leaf else None
        return (
            "tensor",
            value.dtype,
            tuple(value.shape),
            value.detach().tolist(),
            grad is not None and grad.tolist(),
        )
    if isinstance(value, np.ndarray):
        return ("array", value.tolist())
    if isinstance(value, torch.Generator):
        return ("generator", value.get_state().tolist())
    if isinstance(value, np.random.Generator):
        return ("generator", repr(value.bit_generator.state))
    if isinstance(value, np.random.RandomState):
        return ("generator", repr(value.get_state()))
    if isinstance(value, random.Random):
        return ("generator", value.getstate())
    if isinstance(value, torch.optim.Optimizer):
        return ("optimizer", deeper(value.state_dict()))
    if isinstance(value, torch.nn.Module):
        return (
            "module",
            [(k, deeper(v)) for k, v in value.state_dict(keep_vars=True).items()],
            value.training,
        )
    if isinstance(value, dict):
        factory = getattr(value, "default_factory", None)
        return (type(value).__name__, factory, [(repr(k), deeper(v)) for k, v in value.items()])
    if isinstance(value, (list, tuple, collections.deque)):
        return (type(value).__name__, [deeper(v) for v in value])
    if hasattr(value, "__dict__") and type(value).__module__ == "__main__":
        return ("object", deeper(vars(value)))
    if isinstance(value, io.IOBase):
        if value.closed:
            return ("closed file", os.path.basename(str(getattr(value, "name", ""))))
        value.flush()
        return ("file", os.path.basename(value.name), value.tell())
    if isinstance(value, (int, float, str, bool, type(None))):
        return value
    return type(value).__name__


def everything(shell, folder: str) -> dict:
    ns = shell.user_ns
    kept: dict = {
        k: fingerprint(v)
        for k, v in ns.items()
        if k[0] != "_" and k not in shell._oommagic_tests_started_with
    }
    kept["files"] = {f.name: f.read_bytes() for f in sorted(pathlib.Path(folder).iterdir())}
    kept["rngs"] = (torch.get_rng_state().tolist(), repr(np.random.get_state()), random.getstate())
    return kept


def clear(shell) -> None:
    for name in set(shell.user_ns) - shell._oommagic_tests_started_with:
        shell.user_ns.pop(name, None)


@settings(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))
@given(items=st.lists(things, min_size=3, max_size=8))
def test_trials_leave_everything_as_a_run_without_trials(shell, items):
    results = []
    for budget in (0, 3):
        with tempfile.TemporaryDirectory() as folder, frozen_heap():
            clear(shell)
            setup, changes = build(items, folder)
            assert shell.run_cell(setup).success, setup
            shell.run_cell(CELL.format(budget=budget, changes=changes))
            run = oommagic.history()[-1]
            assert run.outcome == "oom", (budget, run.headline())
            results.append((everything(shell, folder), run.plan.trials, run.plan.summary))
    clear(shell)
    (without, none, _), (with_trials, trials, summary) = results
    assert none == 0 and trials >= 1, summary
    assert without.keys() == with_trials.keys()
    assert [k for k in without if without[k] != with_trials[k]] == [], f"{setup}\n{changes}"


SWEEP_SETUP = """
import collections, random
import numpy as np
import torch
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
many = [torch.zeros(16) for _ in range(2000)]  # enough tensors that a restore takes a while
seen = collections.defaultdict(list)
rng = np.random.default_rng(0)
"""
SWEEP_CELL = """%%gpumem --limit 5MiB --quiet --no-raise --plan-budget 0
batch_size = 256
for step in range(2):
    torch._foreach_add_(many, 1.0)
    seen["steps"].append(rng.random())
    with open(LOG, "a") as f:
        f.write("step\\n")
    loss = model(torch.ones(batch_size, 16, 32)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""


def test_fifty_interrupts_inside_trials_and_restores_leave_nothing(shell, tmp_path, monkeypatch):
    from oommagic.run.snapshot import UserState

    clear(shell)
    log = tmp_path / "train.log"
    log.write_text("before\n")
    shell.run_cell(SWEEP_SETUP)
    shell.user_ns["LOG"] = str(log)
    shell.run_cell(SWEEP_CELL)
    failed = oommagic.history()[-1]
    batch = next(e for e in failed.plan.entries if e.fixes[0].kind == "batch")
    spec = spec_with(failed, batch.fixes)
    session = session_for(shell)
    before = everything(shell, str(tmp_path))

    # Trials timed, to spread the interrupts over one: its whole length, and its restore (the real restore,
    # timed from around it). As in a plan, each trial's collection walks only what it made.
    spans: list[tuple[float, float]] = []
    restore = UserState.restore

    def timed(self, ns):
        t0 = time.perf_counter()
        restore(self, ns)
        spans.append((t0, time.perf_counter()))

    monkeypatch.setattr(UserState, "restore", timed)
    heap = frozen_heap()
    heap.__enter__()
    timings = []
    for _ in range(3):
        t0 = time.perf_counter()
        session.trial(spec, Bounds(steps=1, seconds=10))
        timings.append((time.perf_counter() - t0, spans[-1][0] - t0, spans[-1][1] - t0))
    whole, start, end = min(timings)
    assert everything(shell, str(tmp_path)) == before

    main = threading.main_thread().ident
    leaks, from_trial, honoured, sent = [], 0, 0, []
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)  # the interrupting thread wakes on time, not 5 ms into a restore
    for i in range(50):
        # 25 spread over a whole trial, then 25 over its restore, placed where the last restore fell.
        delay = whole * i / 25 if i < 25 else start + (end - start) * (i - 25) / 25
        fired = threading.Event()

        def interrupt(delay=delay, fired=fired):
            time.sleep(delay)
            sent.append(time.perf_counter())
            signal.pthread_kill(main, signal.SIGINT)
            fired.set()

        thread = threading.Thread(target=interrupt)
        try:
            t0 = time.perf_counter()
            thread.start()
            try:
                session.trial(spec, Bounds(steps=1, seconds=10))
            except KeyboardInterrupt:
                from_trial += 1
                honoured += 1
            else:
                fired.wait()
                for _ in range(50):  # the interrupt lands after the trial: it is honoured here
                    time.sleep(0.001)
        except KeyboardInterrupt:
            honoured += 1
        thread.join()
        if i >= 25 and spans[-1][0] > t0:
            start, end = spans[-1][0] - t0, spans[-1][1] - t0
        after = everything(shell, str(tmp_path))
        if after != before:
            leaks.append((delay, [k for k in before if before[k] != after.get(k)]))
    sys.setswitchinterval(switch)
    heap.__exit__(None, None, None)
    clear(shell)
    assert leaks == [], leaks
    assert honoured == 50, "every interrupt ends something: none is swallowed"
    # Most land inside a trial, some inside its restore (the rest, on a busy machine, just after it).
    in_restore = sum(any(a <= t <= b for a, b in spans) for t in sent)
    assert from_trial >= 10 and in_restore >= 3, (from_trial, in_restore, timings)
