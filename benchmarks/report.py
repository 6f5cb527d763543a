"""Where a benchmark writes, what it says about the machine, and how its table and chart look.

Every benchmark writes ``<name>.md`` (date, hardware, versions, the command, its tables) and ``<name>.png``
into ``$OUT`` when set (the GPU run collects that folder), else ``benchmarks/results/``. Goal lines are
printed as ``SUMMARY | goal | measured | target | pass/MISS`` for ``scripts/gpu_run.sh`` to collect.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent


def out_dir() -> Path:
    path = Path(os.environ["OUT"]) if os.environ.get("OUT") else HERE / "results"
    path.mkdir(parents=True, exist_ok=True)
    return path


def environment(device: str) -> dict[str, str]:
    """Date, hardware, driver, versions and the command that reproduces the run."""
    import torch

    env = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        env["hardware"] = f"{props.name}, {props.total_memory / 1024**3:.1f} GiB, {os.cpu_count()} CPU cores"
        env["driver"] = _driver()
        env["CUDA (torch build)"] = str(torch.version.cuda)
    else:
        env["hardware"] = f"CPU only ({platform.machine()}, {os.cpu_count()} cores): smoke run, not a result"
    env["torch"] = torch.__version__
    env["python"] = platform.python_version()
    env["command"] = "python " + " ".join([_relative(sys.argv[0]), *sys.argv[1:]])
    return env


def _relative(path: str) -> str:
    try:
        return str(Path(path).resolve().relative_to(HERE.parent))
    except ValueError:
        return path


def _driver() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
        return version.decode() if isinstance(version, bytes) else str(version)
    except Exception as err:
        return f"unknown ({type(err).__name__})"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def write_markdown(name: str, title: str, env: dict[str, str], body: str) -> Path:
    """Write ``<name>.md``; called again as results come in, so a run cut short still leaves a file."""
    head = [f"# {title}", ""] + [
        f"- **{k}**: `{v}`" if k == "command" else f"- **{k}**: {v}" for k, v in env.items()
    ]
    path = out_dir() / f"{name}.md"
    path.write_text("\n".join(head) + "\n\n" + body.strip() + "\n")
    return path


@dataclass
class Panel:
    """One bar chart: a bar per label; ``goal`` draws a dashed line."""

    title: str
    labels: Sequence[str]
    values: Sequence[float]
    ylabel: str
    goal: float | None = None
    log: bool = False
    notes: Sequence[str] | None = None  # bar labels; the values when None


def bar_chart(name: str, panels: Sequence[Panel], suptitle: str) -> Path | None:
    """``<name>.png`` with the panels side by side; None (and a line on stderr) if matplotlib fails."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
        for ax, p in zip(axes[0], panels, strict=True):
            bars = ax.bar(range(len(p.values)), p.values, color="#4C72B0")
            ax.set_xticks(range(len(p.labels)), p.labels, rotation=25, ha="right", fontsize=8)
            ax.set_title(p.title, fontsize=10)
            ax.set_ylabel(p.ylabel)
            if p.log:
                ax.set_yscale("log")
            if p.goal is not None:
                ax.axhline(p.goal, color="#C44E52", linestyle="--", linewidth=1, label=f"goal {p.goal:g}")
                ax.legend(fontsize=8)
            ax.bar_label(bars, labels=list(p.notes or [f"{v:.3g}" for v in p.values]), fontsize=7)
        fig.suptitle(suptitle, fontsize=11)
        fig.tight_layout()
        path = out_dir() / f"{name}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
    except Exception as err:
        print(f"chart {name}.png not written: {type(err).__name__}: {err}", file=sys.stderr)
        return None


def summary(goal: str, measured: str, target: str, ok: bool | None) -> None:
    """One goal line for the run's closing table (``ok`` None: informational, no goal judged)."""
    verdict = "n/a" if ok is None else ("pass" if ok else "MISS")
    print(f"SUMMARY | {goal} | {measured} | {target} | {verdict}", flush=True)


def short_hardware(env: dict[str, str]) -> str:
    return env["hardware"].split(",")[0].split(" (")[0]


def size(n: int | None) -> str:
    """Bytes for people, as PyTorch prints them (``oommagic.format_bytes``)."""
    from oommagic import format_bytes

    return "—" if n is None else format_bytes(n)
