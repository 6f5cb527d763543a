"""Kernel-side measurements for the scenario runner (loaded into the kernel as module ``_scenario_harness``;
nothing of it is bound in the user's namespace, so the product's trials never see it).

- ``before(ns)``: memory level and checksums of every model / optimizer in the namespace, before the
  failing cell; a hook around the plan's measurement records checksums at the start and end of its trials.
- ``after(ns)``: memory after the failure, checksums again, and the report (findings, plan, offered fixes).
- ``click(ns, kind)``: presses a fix on the report widget and records the new run.
- The work a run did: optimizer steps (a global optimizer step hook) and training samples (a forward
  pre-hook on the namespace's outermost models, loss modules left out, counting the leading dimension of the first tensor argument
  of calls made in training mode with autograd on), counted from the failing cell's start to its plan's
  first trial, and over each click; ``check(ns, expr)`` evaluates a scenario's own check after a click.
Each prints one ``@@SC@@{json}`` line that the runner reads.
"""

from __future__ import annotations

import json
import os
import time
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

MARK = "@@SC@@"
STATE: dict = {}
LIBS = ("transformers", "lightning", "pytorch_lightning", "accelerate")


WORK = {"on": False, "steps": 0, "samples": 0}
HOOKED: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def _count_step(optimizer, args, kwargs) -> None:
    if WORK["on"]:
        WORK["steps"] += 1


def _rows(args, kwargs) -> int:
    for v in list(args) + list(kwargs.values()):
        if torch.is_tensor(v) and v.dim() > 0:
            return int(v.shape[0])
    return 0


def _count_samples(module, args, kwargs) -> None:
    # A forward run again inside the backward pass (activation checkpointing's recomputation) sees the
    # same samples a second time: it is not more work.
    recomputing = torch._C._current_graph_task_id() != -1
    if WORK["on"] and module.training and torch.is_grad_enabled() and not recomputing:
        WORK["samples"] += _rows(args, kwargs)


def count_work(ns) -> None:
    """Hook the optimizer steps (once) and the outermost models of the namespace; zero the counts."""
    if not STATE.get("step_hook"):
        STATE["step_hook"] = register_optimizer_step_post_hook(_count_step)
    # A loss module (`criterion = nn.CrossEntropyLoss()`) is called on the model's output: counting its
    # rows too counted every sample twice (user_micro_step's 1024 of 512, the cell as written included).
    models = [
        o
        for o in objects(ns).values()
        if isinstance(o, torch.nn.Module) and not isinstance(o, torch.nn.modules.loss._Loss)
    ]
    inner = {id(m) for o in models for m in o.modules() if m is not o}
    for m in models:
        if id(m) not in inner and m not in HOOKED:
            m.register_forward_pre_hook(_count_samples, with_kwargs=True)
            HOOKED.add(m)
    WORK.update(on=True, steps=0, samples=0)


def pause_work() -> dict:
    WORK["on"] = False
    return {"steps": WORK["steps"], "samples": WORK["samples"]}


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
        # The trials' steps are not the run's: the run's count stops where the plan starts.
        if WORK["on"]:
            STATE["work"] = pause_work()
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
    STATE.pop("work", None)
    count_work(ns)
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
        "work": STATE.get("work") or pause_work(),
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
    STATE.pop("work", None)
    count_work(ns)
    t0 = time.perf_counter()
    try:
        run = w.click(chosen["kind"])
    except Exception as err:
        pause_work()
        emit(
            {"clicked": chosen, "click_error": f"{type(err).__name__}: {err}", "s": time.perf_counter() - t0}
        )
        return
    s = time.perf_counter() - t0
    work = STATE.get("work") or pause_work()
    emit(
        {
            "clicked": chosen,
            "s": s,
            "run": describe(run),
            "mem": memory(),
            "before_mem": STATE["before_mem"],
            "next_fixes": fixes_of(w) if run.outcome != "ok" else [],
            "work": work,
        }
    )


def check(ns, expr: str) -> None:
    """A scenario's check of the work done (an expression over the notebook's names), after a run."""
    try:
        emit({"check": bool(eval(expr, {"torch": torch}, dict(ns)))})
    except Exception as err:
        emit({"check": False, "check_error": f"{type(err).__name__}: {err}"})
