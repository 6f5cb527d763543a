"""What gathering the diagnosis's context costs on a big namespace: ``scan_namespace`` (tensors, modules,
optimizers, containers, the failing frames) and ``find_pins`` (what pins memory outside the variables),
on a namespace of 10,000 objects of every kind a notebook holds. Goal: ≤ 50 ms for the two together.

The namespace: 2,000 small tensors, 500 lists of 10 tensors, 500 dicts of 5 tensors, 200 small models
(half in training mode with dropout), 50 optimizers with state, 1,000 objects with properties and a
``__getattr__`` that count their calls (the scan must call none), 750 ints, strings, floats and
functions, and 5,000 plain objects with attributes. The scan also must raise no warning and move no
tensor (every tensor's device and data pointer is compared before and after).

    python benchmarks/scan_cost.py            # prints the figure, writes scan_cost.md
"""

from __future__ import annotations

import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import report
import torch

from oommagic.diagnosis.context import scan_namespace
from oommagic.diagnosis.pins import find_pins

GOAL_MS = 50.0
SOURCE = """\
outs = []
for i, batch in enumerate(loader):
    with torch.no_grad():
        outs.append(model(batch))
"""


class Watched:
    """A user object whose property and __getattr__ count their calls."""

    calls = 0

    def __init__(self, i: int) -> None:
        self.i = i

    @property
    def expensive(self) -> int:
        Watched.calls += 1
        return self.i

    def __getattr__(self, name: str) -> int:
        Watched.calls += 1
        raise AttributeError(name)


class Plain:
    def __init__(self, i: int) -> None:
        self.i = i
        self.name = f"obj{i}"


def namespace() -> dict:
    ns: dict = {}
    for i in range(2000):
        ns[f"t{i}"] = torch.zeros(16)
    for i in range(500):
        ns[f"list{i}"] = [torch.zeros(4) for _ in range(10)]
        ns[f"dict{i}"] = {f"k{j}": torch.zeros(4) for j in range(5)}
    for i in range(200):
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.Linear(8, 2))
        model.train(i % 2 == 0)
        ns[f"model{i}"] = model
    for i in range(50):
        model = ns[f"model{i}"]
        opt = torch.optim.Adam(model.parameters())
        model(torch.zeros(1, 8)).sum().backward()
        opt.step()
        ns[f"opt{i}"] = opt
    for i in range(1000):
        ns[f"watched{i}"] = Watched(i)
    for i in range(250):
        ns[f"n{i}"], ns[f"s{i}"], ns[f"f{i}"] = i, str(i), float(i)
    for i in range(5000):
        ns[f"plain{i}"] = Plain(i)
    ns["model"], ns["loader"] = ns["model0"], [torch.zeros(1, 8)]
    ns["outs"] = [ns["model0"](torch.zeros(1, 8)) for _ in range(3)]
    return ns


class Shell:
    """What ``find_pins`` reads of an IPython shell: the namespace and the last execution result."""

    def __init__(self, ns: dict) -> None:
        self.user_ns = ns
        self.last_execution_result = None


def tensors_state(ns: dict) -> list:
    found = []
    for value in ns.values():
        items = value if isinstance(value, list) else value.values() if isinstance(value, dict) else [value]
        for t in items:
            if isinstance(t, torch.Tensor):
                found.append((id(t), t.device, t.data_ptr()))
    return found


def main() -> None:
    ns = namespace()
    count = len(ns)
    before = tensors_state(ns)
    shell = Shell(ns)
    times = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(7):
            t0 = time.perf_counter()
            scan_namespace(ns, "cpu", SOURCE)
            find_pins(shell, "cpu")
            times.append((time.perf_counter() - t0) * 1000)
    moved = before != tensors_state(ns)
    median = statistics.median(times[1:])  # the first call warms torch's lazy imports
    verdict = "met" if median <= GOAL_MS and not caught and not Watched.calls and not moved else "MISSED"
    line = (
        f"scan_namespace + find_pins on {count} objects: median {median:.1f} ms of {len(times) - 1} runs "
        f"(min {min(times[1:]):.1f}, first {times[0]:.1f}); warnings {len(caught)}, user properties or "
        f"__getattr__ called {Watched.calls}, tensors moved {moved}"
    )
    print(line)
    print(f"SUMMARY | context scan on {count} objects ≤ {GOAL_MS:.0f} ms | {median:.1f} ms | {verdict}")
    env = report.environment("cpu")
    body = report.table(
        ("objects", "median ms", "min ms", "first ms", "warnings", "user calls", "tensors moved", "goal"),
        [
            (
                count,
                f"{median:.1f}",
                f"{min(times[1:]):.1f}",
                f"{times[0]:.1f}",
                len(caught),
                Watched.calls,
                moved,
                verdict,
            )
        ],
    )
    path = report.write_markdown("scan_cost", "Cost of gathering the diagnosis's context", env, body)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
