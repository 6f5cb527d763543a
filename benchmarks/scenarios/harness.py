"""Kernel-side measurements for the scenario runner (loaded into the kernel as module ``_scenario_harness``;
nothing of it is bound in the user's namespace, so the product's trials never see it).

- ``before(ns)``: memory level and checksums of every model / optimizer in the namespace, before the
  failing cell; a hook around the plan's measurement records checksums at the start and end of its trials.
- ``after(ns)``: memory after the failure, checksums again, and the report (findings, plan, offered fixes).
- ``click(ns, kind)``: presses a fix on the report widget and records the new run.
Each prints one ``@@SC@@{json}`` line that the runner reads.
"""

from __future__ import annotations

import json
import os
import time
import weakref

import torch

MARK = "@@SC@@"
STATE: dict = {}
LIBS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


def emit(obj) -> None:
    print(MARK + json.dumps(obj, default=str), flush=True)


def gpu() -> bool:
    return os.environ.get("SCENARIO_SCALE") == "gpu" and torch.cuda.is_available()


def memory() -> int:
    if gpu():
        return torch.cuda.memory_allocated() if torch.cuda.is_initialized() else 0
    from oommagic.run.capture import LEDGER

    return LEDGER.allocated


def objects(ns) -> dict:
    """Models and optimizers bound in the namespace, also inside a HF / Lightning trainer."""
    out = {}
    for name, value in list(ns.items()):
        if name.startswith("_"):
            continue
        if isinstance(value, (torch.nn.Module, torch.optim.Optimizer)):
            out[name] = value
        elif type(value).__module__.split(".")[0] in LIBS:
            for attr in ("model", "optimizer", "lightning_module"):
                try:
                    inner = getattr(value, attr, None)
                except Exception:
                    inner = None
                if isinstance(inner, (torch.nn.Module, torch.optim.Optimizer)):
                    out[f"{name}.{attr}"] = inner
    return out


def checksum(obj) -> float:
    with torch.no_grad():
        total = 0.0
        if isinstance(obj, torch.nn.Module):
            tensors = list(obj.parameters()) + [b for b in obj.buffers() if b.is_floating_point()]
        else:
            tensors = [t for st in obj.state.values() for t in st.values() if torch.is_tensor(t)]
        for t in tensors:
            total += float(t.detach().double().sum().item())
        return total


def sums(objs: dict) -> dict:
    return {k: checksum(o) for k, o in objs.items()}


def install_hook() -> None:
    """Checksums at the start and the end of the plan's trials (the failed run itself may have stepped the
    optimizer before it ran out of memory: that is the cell's doing, not the trials')."""
    import oommagic.run.plan as plan

    if getattr(plan.measure_plan, "_scenario_hook", False):
        return
    original = plan.measure_plan

    def measure_plan(session, run):
        ns = session.shell.user_ns
        objs = objects(ns)
        start = sums(objs)
        t0 = time.perf_counter()
        try:
            return original(session, run)
        finally:
            STATE.setdefault("trials", []).append(
                {
                    "start": start,
                    "end": {k: checksum(o) for k, o in objs.items()},
                    "plan_s": time.perf_counter() - t0,
                }
            )

    measure_plan._scenario_hook = True
    plan.measure_plan = measure_plan


def before(ns) -> None:
    import gc

    install_hook()
    gc.collect()  # the level before: garbage of earlier cells (cycles) is not the failing cell's
    objs = objects(ns)
    STATE["before_mem"] = memory()
    STATE["before_refs"] = {k: weakref.ref(o) for k, o in objs.items()}
    STATE["before_sums"] = sums(objs)
    STATE["trials"] = []
    emit({"before_mem": STATE["before_mem"], "objects": sorted(objs)})


def fixes_of(w) -> list[dict]:
    return [{"kind": f.kind, "title": f.title, "verdict": f.verdict, "line": f.line} for f in w.fixes]


def describe(run) -> dict:
    plan = run.plan
    return {
        "outcome": run.outcome,
        "peak_allocated": run.peak_allocated,
        "peak_reserved": run.peak_reserved,
        "budget": run.budget,
        "applied": [{"kind": r.kind, "title": r.title, "params": r.params} for r in run.applied],
        "findings": [{"key": f.key, "title": f.title, "evidence": f.evidence} for f in run.findings],
        "plan": None
        if plan is None
        else {
            "summary": plan.summary,
            "unfittable": plan.unfittable,
            "entries": [{"kind": e.kind, "verdict": e.verdict, "line": e.line()} for e in plan.entries],
        },
        "error": run.error,
        "wall_s": run.wall_s,
    }


def after(ns) -> None:
    import gc

    import oommagic

    mem = memory()
    gc.collect()
    mem_gc = memory()
    still = {k: r() for k, r in STATE["before_refs"].items()}
    now = {k: checksum(o) for k, o in still.items() if o is not None}
    changed = [k for k, v in now.items() if v != STATE["before_sums"][k]]
    rebound = [k for k, o in still.items() if o is None or objects(ns).get(k) is not o]
    trials = STATE.get("trials", [])
    trial_changed = sorted({k for t in trials for k, v in t["end"].items() if t["start"].get(k) != v})
    runs = oommagic.history()
    record = {
        "after_mem": mem,
        "after_mem_gc": mem_gc,
        "before_mem": STATE["before_mem"],
        "cell_changed": changed,
        "rebound": rebound,
        "trial_changed": trial_changed,
        "trials_hooked": len(trials),
        "plan_s": sum(t["plan_s"] for t in trials),
        "run": describe(runs[-1]) if runs else None,
    }
    try:
        w = oommagic.report_widget()
        record["fixes"] = fixes_of(w)
    except Exception as err:
        record["fixes"] = []
        record["widget_error"] = f"{type(err).__name__}: {err}"
    emit(record)


def click(ns, kind: str | None = None) -> None:
    import oommagic

    w = oommagic.report_widget()
    fixes = fixes_of(w)
    if not fixes:
        emit({"clicked": None, "fixes": []})
        return
    chosen = next((f for f in fixes if f["kind"] == kind), fixes[0]) if kind else fixes[0]
    t0 = time.perf_counter()
    try:
        run = w.click(chosen["kind"])
    except Exception as err:
        emit(
            {"clicked": chosen, "click_error": f"{type(err).__name__}: {err}", "s": time.perf_counter() - t0}
        )
        return
    s = time.perf_counter() - t0
    emit(
        {
            "clicked": chosen,
            "s": s,
            "run": describe(run),
            "mem": memory(),
            "before_mem": STATE["before_mem"],
            "next_fixes": fixes_of(w) if run.outcome != "ok" else [],
        }
    )
