"""Scenario suite: does an out-of-memory cell end one click from a run that fits?

Each scenario notebook (``scenarios.py``) runs in a real kernel (nbclient). Then, in the same kernel, the
runner follows the report widget's first button, ``w.click(w.fixes[0].kind)``, on each new report until a
run fits or 3 clicks, and records: clicks to a fitting run, wall time from the failing cell's start to
that run (the plan's trials included), for an unfittable scenario whether the plan says so and whether any
fix it marks "fits" fails when clicked, memory after each failure against the level before the cell, and
checksums of every model / optimizer before the cell and around the plan's trials.

    python benchmarks/scenarios/run.py --scale cpu            # every scenario, CPU sizes
    python benchmarks/scenarios/run.py --scale gpu            # real sizes on a CUDA machine
    python benchmarks/scenarios/run.py --only plain_loop --only leftovers
    python benchmarks/scenarios/run.py --scale cpu --suite holdout   # the hold-out (holdout.py, HOLDOUT.md)

Writes ``benchmarks/results/scenarios-<scale>.md`` and ``.json`` (and the executed notebooks under
``benchmarks/results/scenarios-<scale>/``). Needs oommagic on PYTHONPATH (the repository root is added).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(HERE))

import nbformat  # noqa: E402
from nbclient import NotebookClient  # noqa: E402

SUITES = {"main": "scenarios", "holdout": "holdout"}

MARK = "@@SC@@"
MAX_CLICKS = 3
SLACK = 2 * 2**20


def _h(call: str) -> str:
    return f"__import__('sys').modules['_scenario_harness'].{call}"


LOAD_HARNESS = f"""import sys as _sys, importlib.util as _ilu
_spec = _ilu.spec_from_file_location("_scenario_harness", {str(HERE / "harness.py")!r})
_m = _ilu.module_from_spec(_spec); _spec.loader.exec_module(_m); _sys.modules["_scenario_harness"] = _m
del _sys, _ilu, _spec, _m"""


def cell_text(cell) -> str:
    out = []
    for o in cell.get("outputs", []):
        if o.output_type == "stream":
            out.append(o.text)
        elif o.output_type == "error":
            out.append(f"{o.ename}: {o.evalue}")
        else:
            out.append(o.get("data", {}).get("text/plain", ""))
    return "\n".join(out)


def records(cell) -> list[dict]:
    return [json.loads(line[len(MARK) :]) for line in cell_text(cell).splitlines() if line.startswith(MARK)]


def error_of(cell):
    return next((o for o in cell.get("outputs", []) if o.output_type == "error"), None)


class Driver:
    """One kernel, one notebook: execute its cells and append the runner's own."""

    def __init__(self, nb, timeout: int) -> None:
        self.nb = nb
        self.client = NotebookClient(
            nb,
            timeout=timeout,
            kernel_name="python3",
            allow_errors=True,
            resources={"metadata": {"path": "/tmp"}},
        )

    def run(self, index: int):
        cell = self.nb.cells[index]
        t0 = time.perf_counter()
        self.client.execute_cell(cell, index)
        return cell, time.perf_counter() - t0

    def add(self, source: str):
        self.nb.cells.append(nbformat.v4.new_code_cell(source, metadata={"tags": ["scenario-runner"]}))
        return self.run(len(self.nb.cells) - 1)


def skip_reason(s, scale: str) -> str | None:
    if s.gpu_only and scale != "gpu":
        return "GPU only (a second process holding GPU memory)"
    for mod in s.needs:
        if importlib.util.find_spec(mod) is None:
            return f"{mod} not installed"
    if scale == "gpu":
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
    return None


def load_suite(suite: str):
    """The module of a suite: ``SCENARIOS``, ``BY_NAME``, ``notebook(name, scale)``, ``control_source``."""
    return importlib.import_module(SUITES[suite])


def expected_work(s, scale: str) -> dict:
    """The scenario's declared steps / samples at this scale (expressions in its sizes ``S``)."""
    sizes = s.gpu if scale == "gpu" else s.cpu
    return {k: int(eval(v, {"S": sizes})) for k, v in s.work.items() if k in ("steps", "samples")}


def run_scenario(name: str, scale: str, timeout: int, keep: Path | None, suite: str = "main") -> dict:
    mod = load_suite(suite)
    s = mod.BY_NAME[name]
    res: dict = {"name": name, "fit_exists": s.fit, "expect": s.expect, "notes": []}
    reason = skip_reason(s, scale)
    if reason:
        res.update(status="skipped", reason=reason)
        return res
    res["work_expected"] = expected_work(s, scale)
    nb = mod.notebook(name, scale)
    drv = Driver(nb, timeout)
    t_start = time.perf_counter()
    oom_index = next(i for i, c in enumerate(nb.cells) if "oom-cell" in c.metadata.get("tags", []))
    teardown = [i for i, c in enumerate(nb.cells) if "teardown" in c.metadata.get("tags", [])]
    try:
        with drv.client.setup_kernel():
            drv.add(LOAD_HARNESS)
            for i in range(oom_index):
                if nb.cells[i].cell_type != "code":
                    continue
                cell, _ = drv.run(i)
                err = error_of(cell)
                if err is not None and "expected-error" not in nb.cells[i].metadata.get("tags", []):
                    res.update(status="setup error", reason=f"cell {i}: {err.ename}: {err.evalue}"[:400])
                    return res
            res["setup_s"] = round(time.perf_counter() - t_start, 1)
            before = records(drv.add(_h("before(get_ipython().user_ns)"))[0])[0]
            cell, oom_s = drv.run(oom_index)
            err = error_of(cell)
            res["oom_cell_s"] = round(oom_s, 1)
            res["ename"] = err.ename if err else None
            if err is None or err.ename != "OutOfMemoryError":
                res.update(status="no oom", reason=f"the cell ended with {err.ename if err else 'no error'}")
                res["evalue"] = (err.evalue if err else cell_text(cell))[-600:]
                if err is None:
                    return res
            after = records(drv.add(_h("after(get_ipython().user_ns)"))[0])[0]
            res["report"] = after["run"]
            res["fixes"] = after["fixes"]
            res["objects"] = before["objects"]
            res["mem_before"] = after["before_mem"]
            res["mem_after_failures"] = [after["after_mem"] - after["before_mem"]]
            if "after_mem_gc" in after:
                res["mem_after_gc"] = after["after_mem_gc"] - after["before_mem"]
            res["cell_changed"] = after["cell_changed"]
            res["trial_changed"] = after["trial_changed"]
            res["trials_hooked"] = after["trials_hooked"]
            res["plan_s"] = round(after["plan_s"], 1)
            res["work_original"] = after.get("work")
            if res.get("status") == "no oom":
                return res
            res["clicks"] = []
            wall = oom_s
            fitted_at = None
            fixes = after["fixes"]
            if not s.fit:
                # Every fix marked "fits" must fit: press each one that claims to.
                for fx in [f for f in fixes if f["verdict"] == "fits"]:
                    rec = records(drv.add(_h(f"click(get_ipython().user_ns, {fx['kind']!r})"))[0])
                    res["clicks"].append(rec[0] if rec else {"clicked": fx, "click_error": "no record"})
                    break  # the widget now shows the new run; one press tells whether the promise holds
            else:
                for n in range(1, MAX_CLICKS + 1):
                    if not fixes:
                        break
                    cell, s_click = drv.add(_h("click(get_ipython().user_ns)"))
                    rec = records(cell)
                    rec = rec[0] if rec else {"click_error": cell_text(cell)[-400:]}
                    rec["client_s"] = s_click
                    res["clicks"].append(rec)
                    wall += s_click
                    run = rec.get("run")
                    if run is None:
                        break
                    if run["outcome"] == "ok":
                        fitted_at = n
                        res["work_accepted"] = rec.get("work")
                        if s.work.get("check"):
                            chk = records(
                                drv.add(_h(f"check(get_ipython().user_ns, {s.work['check']!r})"))[0]
                            )
                            res["work_check"] = (
                                chk[0] if chk else {"check": False, "check_error": "no record"}
                            )
                        break
                    if run["outcome"] == "oom":
                        res["mem_after_failures"].append(rec["mem"] - rec["before_mem"])
                    fixes = rec.get("next_fixes", [])
            res["fitted_at"] = fitted_at
            res["wall_s"] = round(wall, 1) if fitted_at else None
            if s.fit and fitted_at is None and s.control:
                limit_flag = (
                    "--limit $LIMIT " if "$LIMIT" in nb.cells[oom_index].source.splitlines()[0] else ""
                )
                cell, _ = drv.add(
                    f"%%gpumem {limit_flag}--plan-budget 0 -o _control\n"
                    + mod.control_source(name, scale).strip("\n")
                )
                err = error_of(cell)
                res["control"] = "fits" if err is None else f"{err.ename}: {err.evalue[:200]}"
            res["status"] = "ran"
            for i in teardown:
                drv.run(i)
    except Exception as err:
        res.update(status="runner error", reason=f"{type(err).__name__}: {str(err)[:400]}")
    finally:
        res["total_s"] = round(time.perf_counter() - t_start, 1)
        if keep is not None:
            keep.mkdir(parents=True, exist_ok=True)
            nbformat.write(nb, keep / f"{name}.ipynb")
    return res


def judge(res: dict) -> dict:
    """Verdicts per scenario against the goals."""
    if res.get("status") != "ran":
        return res
    clicks = res["clicks"]
    fixes = res.get("fixes", [])
    res["first_fix"] = fixes[0] if fixes else None
    if res["fit_exists"]:
        res["first_click_fit"] = res["fitted_at"] == 1
        res["within_two"] = res["fitted_at"] is not None and res["fitted_at"] <= 2
        broken = [
            c
            for c in clicks
            if c.get("clicked", {})
            and c["clicked"].get("verdict") == "fits"
            and c.get("run", {}).get("outcome") != "ok"
        ]
        res["false_fits"] = len(broken)
    else:
        plan = (res.get("report") or {}).get("plan") or {}
        res["says_unfittable"] = bool(plan.get("unfittable"))
        res["false_fits"] = sum(1 for c in clicks if c.get("run", {}).get("outcome") != "ok")
        res["offers_fits"] = sum(1 for f in fixes if f["verdict"] == "fits")
    # Below the level before is not memory the failure left: the cell rebound names that held memory before
    # it (a `batch`, an `out` of an earlier cell), and what they held went with the rebinding.
    res["memory_ok"] = all(d <= SLACK for d in res["mem_after_failures"])
    res["checksums_equal"] = not res["trial_changed"] and not res["cell_changed"]
    res["work_kept"] = work_kept(res)
    return res


def work_kept(res: dict) -> bool | None:
    """Did the accepted run do the cell's work: its optimizer steps and training samples the
    declared ones (more is other work too: a second pass over the data), its check true? None where nothing was accepted or nothing is declared."""
    acc = res.get("work_accepted")
    if acc is None or not (res.get("work_expected") or "work_check" in res):
        return None
    ok = all(acc.get(k, 0) == v for k, v in res.get("work_expected", {}).items())
    return ok and res.get("work_check", {}).get("check", True)


def work_note(res: dict) -> str:
    acc, exp = res.get("work_accepted"), res.get("work_expected") or {}
    if acc is None or res.get("work_kept") is None:
        return ""
    parts = [f"{k} {acc.get(k, 0)}/{v}" for k, v in exp.items()]
    if "work_check" in res:
        chk = res["work_check"]
        parts.append(
            "check " + ("ok" if chk.get("check") else f"failed {chk.get('check_error', '')}".strip())
        )
    text = "work " + ", ".join(parts)
    return text if res["work_kept"] else f"**{text}**"


def fmt_mib(d: int) -> str:
    return f"{d / 2**20:+.1f} MiB" if abs(d) >= 2**20 / 10 else f"{d:+d} B"


def row(res: dict) -> str:
    name = res["name"]
    if res.get("status") != "ran":
        why = res.get("reason", "")
        return f"| {name} | – | – | – | – | – | – | {res.get('status')}: {why} |"
    applied = []
    for c in res["clicks"]:
        if c.get("clicked"):
            verdict = c["clicked"].get("verdict")
            applied.append(
                f"{c['clicked']['kind']} [{verdict}]→{(c.get('run') or {}).get('outcome', 'error')}"
            )
    notes = []
    if res["fit_exists"]:
        clicks = str(res["fitted_at"]) if res["fitted_at"] else f"no fit in {len(res['clicks'])}"
        first = "yes" if res["first_click_fit"] else "**no**"
        if not res.get("fixes"):
            notes.append("no fix offered")
        if "control" in res:
            notes.append(
                "author's fix "
                + (
                    "fits (a fit exists)"
                    if res["control"] == "fits"
                    else f"failed too: {res['control'][:80]}"
                )
            )
    else:
        clicks = "n/a (unfittable)"
        first = "n/a"
        notes.append("says unfittable" if res["says_unfittable"] else "**does not say unfittable**")
        notes.append(
            f"{res['offers_fits']} fix(es) marked fits"
            + (f", {res['false_fits']} failed" if res["false_fits"] else "")
        )
    if res.get("false_fits") and res["fit_exists"]:
        notes.append(f"**{res['false_fits']} fix(es) marked fits failed**")
    mem = ", ".join(fmt_mib(d) for d in res["mem_after_failures"])
    if not res["memory_ok"]:
        mem = f"**{mem}**"
    if res["trial_changed"]:
        ck = f"**no: trials changed {', '.join(res['trial_changed'])}**"
    elif res["cell_changed"]:
        ck = f"trials yes; cell changed {', '.join(res['cell_changed'])}"
    else:
        ck = "yes"
    if not res["trials_hooked"]:
        ck += " (no trials ran)"
    if work_note(res):
        notes.append(work_note(res))
    wall = f"{res['wall_s']:.1f}" if res.get("wall_s") else "–"
    notes.append(f"fail {res['oom_cell_s']:.1f}s (plan {res['plan_s']:.1f}s)")
    return f"| {name} | {clicks} | {first} | {'; '.join(applied) or 'none'} | {wall} | {mem} | {ck} | {'; '.join(notes)} |"


HEADER = (
    "| scenario | clicks to fit | first click fits | fixes clicked → outcome | wall s (fail → fit) | "
    "memory left after failures | checksums equal | notes |\n| --- | --- | --- | --- | --- | --- | --- | --- |"
)


def summary(results: list[dict]) -> str:
    ran = [r for r in results if r.get("status") == "ran"]
    fit = [r for r in ran if r["fit_exists"]]
    unfit = [r for r in ran if not r["fit_exists"]]
    first = sum(r["first_click_fit"] for r in fit)
    two = sum(r["within_two"] for r in fit)
    kept_first = sum(r["first_click_fit"] and r.get("work_kept") is not False for r in fit)
    unf_ok = sum(r["says_unfittable"] and not r["false_fits"] for r in unfit)
    mem = sum(r["memory_ok"] for r in ran)
    ck = sum(r["checksums_equal"] for r in ran)
    trial_ck = sum(not r["trial_changed"] for r in ran)
    judged = [r for r in ran if r.get("work_kept") is not None]
    kept = sum(bool(r["work_kept"]) for r in judged)
    lines = [
        f"- first click fits: {first} of {len(fit)} fittable scenarios ({100 * first / max(len(fit), 1):.0f}%; goal ≥ 90%)",
        f"- first click fits and keeps the cell's work (no fewer or more optimizer steps or samples): {kept_first} "
        f"of {len(fit)}",
        f"- fit within two clicks: {two} of {len(fit)} (goal: all)",
        f"- unfittable said so and offered nothing that fails: {unf_ok} of {len(unfit)} (goal: all)",
        f"- memory back to at most 2 MiB above the level before after every failure: {mem} of {len(ran)} "
        "(goal: all; below it, the cell's rebinding let go of what its names held before)",
        f"- checksums equal before the cell and after the trials: {ck} of {len(ran)}; "
        f"unchanged by the trials themselves: {trial_ck} of {len(ran)} (goal: all)",
        f"- accepted runs that kept the cell's work (optimizer steps, samples, the scenario's check): {kept} of "
        f"{len(judged)} with work declared (goal: all)",
        f"- skipped or not run: {', '.join(r['name'] + ' (' + r.get('reason', r.get('status', '')) + ')' for r in results if r.get('status') != 'ran') or 'none'}",
    ]
    return "\n".join(lines)


def _one(name: str, scale: str, timeout: int, keep: Path, suite: str = "main") -> dict:
    return judge(run_scenario(name, scale, timeout, keep, suite))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scale", choices=("cpu", "gpu"), default="cpu")
    ap.add_argument("--only", action="append", help="a scenario name (repeatable)")
    ap.add_argument(
        "--suite",
        choices=tuple(SUITES),
        default="main",
        help="main: scenarios.py; holdout: holdout.py, the notebooks written before the fixes (HOLDOUT.md)",
    )
    ap.add_argument("--timeout", type=int, default=300, help="seconds per cell")
    ap.add_argument(
        "--plan-budget",
        default=None,
        help="--plan-budget of the failing cells (default: 30 s on cpu, 20 s on gpu)",
    )
    ap.add_argument(
        "--jobs",
        type=int,
        default=0,
        help="scenarios run at once, each in its own kernel (default: 1 on cpu, 4 on gpu; "
        "GPU-only scenarios that fill the device always run alone, last)",
    )
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args(argv)
    mod = load_suite(args.suite)
    BY_NAME = mod.BY_NAME
    names = args.only or [s.name for s in mod.SCENARIOS]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        ap.error(f"unknown scenario(s): {', '.join(unknown)}; known: {', '.join(BY_NAME)}")
    os.environ["SCENARIO_SCALE"] = args.scale
    os.environ["SCENARIO_PLAN_BUDGET"] = args.plan_budget or ("20" if args.scale == "gpu" else "30")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    jobs = args.jobs or (4 if args.scale == "gpu" else 1)
    prefix = "scenarios" if args.suite == "main" else args.suite
    keep = out / f"{prefix}-{args.scale}"
    t0 = time.perf_counter()
    done: dict[str, dict] = {}

    def finished(res: dict) -> None:
        done[res["name"]] = res
        print(f"[{time.perf_counter() - t0:6.1f}s] {row(res)}", file=sys.stderr, flush=True)

    # Scenarios that fill the whole device run alone, after the others.
    alone = [n for n in names if BY_NAME[n].gpu_only]
    shared = [n for n in names if n not in alone]
    if jobs > 1 and len(shared) > 1:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as pool:
            futures = [pool.submit(_one, n, args.scale, args.timeout, keep, args.suite) for n in shared]
            for f in as_completed(futures):
                finished(f.result())
    else:
        for name in shared:
            finished(_one(name, args.scale, args.timeout, keep, args.suite))
    for name in alone:
        finished(_one(name, args.scale, args.timeout, keep, args.suite))
    results = [done[n] for n in names]
    total = time.perf_counter() - t0
    table = "\n".join([HEADER] + [row(r) for r in results])
    text = f"{table}\n\n{summary(results)}\n- total {total:.0f} s\n"
    print(text)
    stem = f"{prefix}-{args.scale}" + ("" if not args.only else "-" + "-".join(args.only)[:60])
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(
        json.dumps({"scale": args.scale, "total_s": total, "results": results}, indent=1, default=str)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
