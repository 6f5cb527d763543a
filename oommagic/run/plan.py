"""Measure the fix plan after an out-of-memory error: run the cell with each candidate fix as a bounded
trial, search the micro-batch that fits where the batch is the knob, try combinations where no single
fix is enough, and order what was measured (``diagnosis.plan``).

A training trial stops once its steady-state peak is reached: after the optimizer has stepped twice (its
state exists) and past the step where the original run failed. Other cells run whole. Every trial runs
inside the time budget (``--plan-budget``; by default scaled from the failed run's own time), and leaves
what the namespace reaches and the files it wrote as they were (``Session.trial``).
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from typing import Any

from ..cellrun import CellRun
from ..diagnosis.findings import Remedy, figures
from ..diagnosis.kinds import kind_of, tier
from ..diagnosis.plan import (
    DOES_NOT_FIT,
    FITS,
    LIKELY_FITS,
    NOT_MEASURED,
    FixPlan,
    PlanEntry,
    ordered,
    with_time_ratios,
)
from ..diagnosis.rank_trials import trial_of_ranks
from ..diagnosis.ranks import unreached
from ..diagnosis.source import launch, steps_optimizer
from ..sizes import format_bytes
from .batch_search import Trial, next_batch
from .fixes import spec_with
from .release import frozen_heap
from .runner import Attempt, Bounds
from .snapshot import SnapshotTooLarge

# Fixes that run the prompts in chunks: a chunk that still runs out is halved until one fits.
_CHUNKED = ("split_generate", "split_calls")
# At most this many combinations (a fix that helped but not enough, plus a smaller batch).
_COMBINATIONS = 2


def default_budget(session: Any, run: CellRun) -> float:
    return session.settings.plan_budget(run.wall_s)


def candidates(run: CellRun) -> list[Remedy]:
    """The automatic fixes the findings offer, in the diagnosis's order, one per kind."""
    seen: dict[str, Remedy] = {}
    for finding in run.findings:
        for remedy in finding.remedies:
            if remedy.automatic and remedy.kind not in seen:
                seen[remedy.kind] = remedy
    return list(seen.values())


def unmeasured_plan(run: CellRun, why: str) -> FixPlan:
    entries = [PlanEntry((r,), NOT_MEASURED, budget=run.budget, method=why) for r in candidates(run)]
    return FixPlan(tuple(entries), summary=f"Not measured: {why}.", stopped=why == "stopped")


def measure_plan(session: Any, run: CellRun) -> FixPlan:
    """The plan for ``run`` (an out-of-memory run), measured within its time budget."""
    budget_s = run.options.plan_budget
    if budget_s is None:
        budget_s = default_budget(session, run)
    if budget_s <= 0 or not candidates(run):
        # A distributed cell's fixes are automatic where a relaunch puts them into every rank.
        none = "no fix a relaunch of the ranks can apply" if run.ranks is not None else "no automatic fix"
        if run.ranks is not None and launch(run.source) is not None:
            none += (
                " (the script it launches takes no batch option on its command line, an argparse "
                "--batch-size, which a fix could pass; the script's own text is not rewritten)"
            )
        plan = unmeasured_plan(run, "--plan-budget 0" if budget_s <= 0 else none)
        if run.ranks is not None:
            plan = replace(plan, summary=plan.summary + _unreached(run))
        return replace(plan, unfittable=_unfittable(plan, run)) if budget_s > 0 else plan
    measure = _Measure(session, run, budget_s)
    n = len(candidates(run))
    ranks = (
        f" and relaunches its {len(run.ranks)} ranks, each bounded as the trial is (what the ranks write "
        "to files is theirs: not put back)"
        if run.ranks is not None
        else ""
    )
    session.progress(
        f"%%gpumem: measuring {n} fix{'es' if n != 1 else ''} in at most {budget_s:.0f} s (--plan-budget): "
        f"each trial re-runs the cell (its prints too){ranks} and puts back what it changed"
        f"{' in this kernel' if ranks else ''} (tensors, containers, random generators, files); interrupt "
        "the kernel to stop."
    )
    try:
        with frozen_heap():
            entries = measure.all()
    except SnapshotTooLarge as err:
        return replace(unmeasured_plan(run, err.why), summary=str(err))
    entries = with_time_ratios(entries, _step_time(run.recording.timeline.steps))
    plan = FixPlan(
        entries=ordered(entries),
        budget_s=budget_s,
        spent_s=time.perf_counter() - measure.t0,
        trials=measure.trials,
        snapshot_bytes=measure.snapshot_bytes,
        cut_short=measure.ran_out and any(e.verdict == NOT_MEASURED for e in entries),
    )
    summary = _summary(plan, run, session.restored)
    if run.ranks is not None:
        summary += _unreached(run)
    return replace(plan, summary=summary, unfittable=_unfittable(plan, run))


class _Measure:
    def __init__(self, session: Any, run: CellRun, budget_s: float) -> None:
        self.session = session
        self.run = run
        self.t0 = time.perf_counter()
        self.deadline = self.t0 + budget_s
        self.trials = 0
        self.snapshot_bytes = 0
        self.budget = run.budget
        # A distributed cell: every trial relaunches its ranks, and what they report is what is judged,
        # each rank against its own device's budget (the plan's is the tightest rank's).
        self.ranks = run.ranks is not None
        if run.ranks is not None and run.ranks.bottleneck is not None:
            self.budget = run.ranks.bottleneck.budget or self.budget
        self.margin = session.settings.plan_margin
        # Ranks that took optimizer steps train, whatever the cell's text says (a script it launches).
        stepped = run.ranks is not None and any(r.steps for r in run.ranks.results)
        self.training = bool(run.context and run.context.training) or stepped
        self.keeps = any(f.key in ("growth", "kept") for f in run.findings)

        self.budget_s = budget_s
        self.ran_out = False  # a trial was left out (or cut) because the time budget ran out

    def left(self) -> float:
        left = self.deadline - time.perf_counter()
        self.ran_out = self.ran_out or left <= 0
        return left

    def extend(self, seconds: float) -> bool:
        """Give a search that converges ``seconds`` more, up to twice the budget in all: its verifying
        trial is worth more than a plan cut short one trial before its answer."""
        most = self.t0 + 2 * self.budget_s
        if self.deadline >= most:
            return False
        self.deadline = min(most, max(self.deadline, time.perf_counter() + seconds))
        return True

    def micro(self, old: int, most: int) -> int:
        """The micro-batch the fix would write where at most ``most`` fits (a divisor of the batch)."""
        from ..diagnosis.rules import split_batch

        return split_batch(old, most, self.training)[0]

    def converging(self, trials: list[Trial], effective: int) -> None:
        """A search that found a batch that fits gets the time for its verifying trial where the budget
        left is short of it: two optimizer steps of the ``effective`` batch at the largest fitting
        probe's pace (a probe is one step and a backward pass), up to twice the budget in all."""
        fitting = [t for t in trials if t.fits]
        if not fitting:
            return
        top = max(fitting, key=lambda t: t.batch)
        need = 2.5 * top.wall_s * max(1.0, effective / top.batch) + 1.0
        if self.left() < need:
            self.extend(need)

    def all(self) -> list[PlanEntry]:
        found: list[PlanEntry] = []
        fig = figures(self.run.report, self.run.context) if self.run.context is not None else None
        batch = next((r for r in candidates(self.run) if r.kind == "batch"), None)
        # The likeliest fit first (by the figures, the share of the shortfall a fix saves), then the one
        # that changes least: a budget that runs out then leaves the unlikely ones unmeasured.
        order = sorted(
            candidates(self.run),
            key=lambda r: (-(fig.coverage(r.saving) if fig is not None else 0.0), tier(r)),
        )
        for remedy in order:
            try:
                if remedy.kind == "batch":
                    found.append(self.batch_entry(()) or self.entry((batch,)))
                    continue
                entry = self.entry((remedy,))
                if remedy.kind == "split_rows":
                    entry = self.smaller_chunks(entry)
                elif remedy.kind == "eval_batch":
                    entry = self.smaller_eval_batches(entry)
                elif remedy.kind == "eval_accumulation":
                    entry = self.sooner_to_host(entry)
            except SnapshotTooLarge:
                raise  # no trial can run: the whole plan says why
            except Exception as err:  # its setting could not be put in force (an object the cell dropped)
                entry = PlanEntry(
                    (remedy,),
                    NOT_MEASURED,
                    budget=self.budget,
                    note=f"its trial could not start: {type(err).__name__}: {err}",
                )
            found.append(entry)
        # Prompts in chunks that fell short are halved once every fix had its trial: each halving runs the
        # whole cell again, and a budget spent on it alone would leave every other fix unmeasured.
        found = [
            self.halved_chunks(e) if e.fixes[0].kind in _CHUNKED and len(e.fixes) == 1 else e for e in found
        ]
        # A fix that frees room (leftovers, checkpointing) can make a smaller batch fit where the batch
        # alone could not (its finding then offers none): combinations try the cell's batch either way.
        guess = self.run.context.batch if self.run.context is not None else None
        if not any(e.verdict == FITS for e in found) and (batch is not None or (guess and guess.value >= 2)):
            helped = [e for e in found if e.verdict == DOES_NOT_FIT and e.fixes[0].kind != "batch"]
            # The fix that got closest first: its combination needs the least from the batch.
            helped.sort(key=lambda e: e.peak if e.peak is not None else float("inf"))
            for e in helped[:_COMBINATIONS]:
                combo = self.batch_entry(e.fixes)
                if combo is not None:
                    found.append(combo)
                if combo is not None and combo.verdict == FITS:
                    break
        if not any(e.verdict == FITS for e in found):
            found += self.pairs(found)
        return found

    def smaller_chunks(self, entry: PlanEntry) -> PlanEntry:
        """A call on chunks of rows that still ran out, tried again on a quarter of the rows at a time,
        twice at most: the chunk came from the failed run's activations, a lower bound where the layers
        after the failing one were never reached."""
        from ..diagnosis import remedies as fix

        ctx = self.run.context
        call = ctx.rows_call if ctx is not None else None
        for _ in range(2):
            chunk = entry.fixes[0].params.get("chunk", 1) // 4
            if entry.verdict != DOES_NOT_FIT or entry.note or call is None or chunk < 1 or self.left() <= 0:
                break
            entry = self.entry((fix.split_rows(ctx, figures(self.run.report, ctx), call, chunk),))
        return entry

    def halved_chunks(self, entry: PlanEntry) -> PlanEntry:
        """Prompts in chunks that still ran out (or fitted with less than the margin to spare), tried again
        on half as many at a time, until a chunk fits or it is one prompt: the first chunk came from the
        failed run's figures, a lower bound where the run stopped early."""
        ctx = self.run.context
        while ctx is not None and _short(entry) and self.left() > 0:
            chunk = entry.fixes[0].params.get("chunk", 1) // 2
            if chunk < 1:
                break
            # A trial that ran out did so in its first chunk: the whole cell in chunks takes about that
            # long per chunk. A search that is converging gets that time where the budget is short of it.
            chunks = -(-entry.fixes[0].params.get("batch", chunk) // chunk)
            need = 1.2 * (entry.seconds_per_step or 1.0) * chunks + 1.0
            if self.left() < need:
                self.extend(need)
            halved = self.entry((_rechunked(ctx, figures(self.run.report, ctx), entry.fixes[0], chunk),))
            if entry.verdict == LIKELY_FITS and halved.verdict != FITS:
                break  # no better: the likely fit stays, said as such
            entry = halved
        return entry

    def smaller_eval_batches(self, entry: PlanEntry) -> PlanEntry:
        """An evaluation batch that still ran out, halved again until it fits or reaches 1: its first size
        came from halving once, and the failed run's figures are a lower bound (a Lightning ``validate``
        whose loader came from an earlier cell needed an eighth of the batch). Each trial runs the whole
        evaluation, every row of it."""
        from ..diagnosis import remedies as fix

        ctx = self.run.context
        found = ctx.eval_batch if ctx is not None else None
        while found is not None and entry.verdict == DOES_NOT_FIT and not entry.note and self.left() > 0:
            new = entry.fixes[0].params.get("new", 1) // 2
            if new < 1:
                break
            entry = self.entry((fix.eval_batch(ctx, figures(self.run.report, ctx), found, new),))
        return entry

    def sooner_to_host(self, entry: PlanEntry) -> PlanEntry:
        """An evaluation that still ran out with its predictions moved to the host every N batches, tried
        again moving them after every batch, the least the device can hold of them."""
        from ..diagnosis import remedies as fix

        ctx = self.run.context
        remedy = entry.fixes[0]
        gathered = ctx.gathered if ctx is not None else None
        if entry.verdict != DOES_NOT_FIT or remedy.params.get("steps", 1) <= 1 or gathered is None:
            return entry
        if self.left() <= 0:
            return entry
        fig = figures(self.run.report, ctx)
        return self.entry((fix.eval_accumulation(ctx, fig, gathered, 1, remedy.saving),))

    def pairs(self, found: list[PlanEntry]) -> list[PlanEntry]:
        """Two fixes that each fell short, together (fewer beams and shorter outputs, autocast and
        checkpointing): the closest first, until one fits or the budget ends."""
        helped = sorted(
            (
                e
                for e in found
                if e.verdict == DOES_NOT_FIT and len(e.fixes) == 1 and e.fixes[0].kind != "batch"
            ),
            key=lambda e: e.peak if e.peak is not None else float("inf"),
        )
        out: list[PlanEntry] = []
        for i, first in enumerate(helped[:_COMBINATIONS]):
            for second in helped[i + 1 : _COMBINATIONS + 1]:
                if self.left() <= 0 or first.fixes[0].kind == second.fixes[0].kind:
                    continue
                entry = self.entry((first.fixes[0], second.fixes[0]))
                out.append(entry)
                if entry.verdict == FITS:
                    return out
        return out

    # --- one trial ------------------------------------------------------------------------------------

    def entry(
        self, fixes: tuple[Remedy, ...], steps_scale: float = 1.0, bounds: Bounds | None = None
    ) -> PlanEntry:
        if not all(kind_of(r).trial for r in fixes):
            return PlanEntry(
                fixes, NOT_MEASURED, budget=self.budget, method="cannot be tried in this process"
            )
        if self.ranks and (changes := _global_batch_changed(fixes)):
            return PlanEntry(fixes, NOT_MEASURED, budget=self.budget, method=changes)
        if self.left() <= 0:
            return PlanEntry(fixes, NOT_MEASURED, budget=self.budget, method="the time budget ran out")
        method = ""
        if bounds is None:
            bounds, method = self.bounds(fixes, steps_scale)
        if bounds is None:
            return PlanEntry(fixes, NOT_MEASURED, budget=self.budget, method=method)
        self.session.progress(f"  trial {self.trials + 1}: {' + '.join(r.title for r in fixes)} …")
        attempt = self.try_(fixes, bounds)
        entry = self.judge(fixes, attempt, method)
        self.session.progress(ended(entry.verdict, entry.peak, entry.note))
        return entry

    def try_(self, fixes: tuple[Remedy, ...], bounds: Bounds) -> Attempt:
        self.trials += 1
        spec = spec_with(self.run, fixes)
        try:
            attempt = self.session.trial(spec, bounds)
        except KeyboardInterrupt:
            self.session.progress(" stopped")  # ends the trial's progress line
            raise
        self.snapshot_bytes = max(self.snapshot_bytes, self.session.last_snapshot_bytes)
        return attempt

    def bounds(self, fixes: tuple[Remedy, ...], steps_scale: float = 1.0) -> tuple[Bounds | None, str]:
        limit = None
        freed = sum(_freed(r, self.run) for r in fixes)
        if freed:
            # Freeing names cannot be undone after a trial: the trial keeps them and gets their bytes on
            # top of the limit instead, which is the same room.
            if self.run.limit is None:
                return None, "an estimate: freeing cannot be tried without a limit to raise"
            limit = self.run.limit + freed
        if not self.training or self.keeps:
            # A loop that keeps tensors grows to its end: only the whole cell shows whether it fits.
            return Bounds(steps=None, seconds=self.left(), limit=limit), "trial: the whole cell"
        # Through the second optimizer step (the optimizer's state exists from the first, and the second
        # step's temporaries come on top of it), and past the step where the original run failed: a later,
        # longer batch must be part of the trial.
        done = self.done()
        steps = max(2, math.ceil(done * steps_scale))
        return Bounds(steps=steps, seconds=self.left(), limit=limit), (
            f"trial: {steps} optimizer steps and a backward pass"
        )

    def done(self) -> int:
        """The optimizer steps the failed run took before it ran out (of its ranks, the most)."""
        if self.run.ranks is not None:
            return max((r.steps or 0 for r in self.run.ranks.results), default=0)
        return len(self.run.recording.timeline.steps)

    def judge(self, fixes: tuple[Remedy, ...], attempt: Attempt, method: str) -> PlanEntry:
        if self.ranks:
            return self.judge_ranks(fixes, attempt, method)
        rec = attempt.recording
        # A trial of a freeing fix ran with the freed bytes still held and the limit raised by as much:
        # its peak against the budget is what it reached less what the fix gives back.
        peak = max(rec.peak_reserved - sum(_freed(r, self.run) for r in fixes), 0)
        entry = PlanEntry(fixes, budget=self.budget, peak=peak, method=method)
        step = _step_time(rec.timeline.steps) or (attempt.wall_s if not self.training else None)
        if attempt.outcome == "oom":
            return replace(entry, verdict=DOES_NOT_FIT, seconds_per_step=step)
        if attempt.outcome == "error":
            return replace(entry, verdict=DOES_NOT_FIT, note=f"the cell failed with it: {attempt.error_text}")
        if attempt.outcome == "stopped" and "time" in (attempt.stopped_by or ""):
            done = f"after {attempt.steps} optimizer steps" if self.training else "before the cell ended"
            return replace(entry, verdict=NOT_MEASURED, note=f"the time budget ran out {done}")
        if attempt.outcome == "ok" and (changed := self.work_changed(fixes, attempt.steps)):
            return replace(entry, verdict=DOES_NOT_FIT, seconds_per_step=step, note=changed)
        room = self.budget - peak if self.budget else None
        if room is not None and peak > self.budget * (1 - self.margin):
            # The steps after a trial may allocate a little more than it saw: less than the margin to spare
            # is not a promise (pressed, two fixes "tight" by 124 and 434 MiB ran out).
            spare = f"{format_bytes(max(room, 0))} to spare" if room >= 0 else "over the budget"
            return replace(
                entry,
                verdict=LIKELY_FITS,
                seconds_per_step=step,
                note=f"{spare}, less than the {self.margin:.0%} margin a verified fit keeps",
            )
        return replace(entry, verdict=FITS, seconds_per_step=step)

    def judge_ranks(self, fixes: tuple[Remedy, ...], attempt: Attempt, method: str) -> PlanEntry:
        """A trial that relaunched the ranks: "fits" only where no rank ran out and every rank's peak keeps
        the margin against its own device's budget; the rank that decides is named (``PlanEntry.rank``)."""
        seen = trial_of_ranks(attempt.ranks)
        r = seen.rank
        budget = r.budget if r is not None and r.budget else self.budget
        peak = None if r is None else r.demand if r.status == "oom" else r.held
        entry = PlanEntry(fixes, budget=budget, peak=peak, method=method, rank=seen.note if r else "")
        if seen.verdict == NOT_MEASURED:
            return replace(entry, verdict=NOT_MEASURED, note=seen.note, rank="")
        if seen.verdict == DOES_NOT_FIT:
            # Out of memory is said by the rank; a note marks a cell that failed otherwise, which a smaller
            # batch would not mend.
            note = "" if r is not None and r.status == "oom" else seen.note
            return replace(entry, verdict=DOES_NOT_FIT, note=note, rank=entry.rank if not note else "")
        ran_whole = not any(x.trial_stop for x in attempt.ranks.results) if attempt.ranks else True
        if ran_whole and (changed := self.work_changed(fixes, seen.steps or 0)):
            return replace(entry, verdict=DOES_NOT_FIT, note=changed)
        if budget and peak is not None and peak > budget * (1 - self.margin):
            room = budget - peak
            spare = f"{format_bytes(max(room, 0))} to spare" if room >= 0 else "over the budget"
            return replace(
                entry,
                verdict=LIKELY_FITS,
                note=f"{spare}, less than the {self.margin:.0%} margin a verified fit keeps",
            )
        return replace(entry, verdict=FITS)

    def rank_probe(self, attempt: Attempt) -> tuple[bool, int, bool]:
        """A probe's (fits, peak, out of time) read from its ranks: the peak is the tightest rank's, or the
        failing rank's demand, as bytes of the plan's budget (ranks' budgets can differ)."""
        seen = trial_of_ranks(attempt.ranks)
        r = seen.rank
        if r is None:
            return False, 0, False
        used = r.demand if r.status == "oom" else r.held
        peak = used * self.budget // r.budget if r.budget and self.budget else used
        return seen.verdict is None, peak, seen.verdict == NOT_MEASURED and r.status == "timed_out"

    def work_changed(self, fixes: tuple[Remedy, ...], steps: int) -> str:
        """Why a trial that ran the whole cell did less work than the cell as written ('' when it did not):
        no optimizer step where the cell steps one, or fewer steps than the failed run had taken."""
        if not self.training:
            return ""
        done = self.done()
        if steps < done:
            return f"the rewritten cell took {steps} optimizer steps where the cell as written took {done}+"
        ctx = self.run.context
        texts = [self.run.source, *(code for _, code in (ctx.helpers if ctx is not None else ()))]
        rewrites = any(r.new_source is not None for r in fixes)
        if steps == 0 and rewrites and any(steps_optimizer(t) for t in texts):
            return "the rewritten cell took no optimizer step where the cell as written takes them"
        return ""

    # --- the batch: probes, a line, a check -----------------------------------------------------------

    def accumulated(self, base: tuple[Remedy, ...], remedy: Remedy) -> PlanEntry:
        """The rewritten cell with its accumulation, run through its second optimizer step and a backward
        pass after it: the steady state, where each backward pass adds to gradients kept beside the
        optimizer's state (a temporary per parameter as it adds), which neither a probe nor the first
        micro-batches hold. A cell that does not train runs two micro-batches."""
        if self.training:
            bounds = Bounds(steps=2, seconds=self.left())
        else:
            bounds = Bounds(steps=None, backwards=2, seconds=self.left())
        return self.entry((*base, remedy), bounds=bounds)

    def batch_entry(self, base: tuple[Remedy, ...]) -> PlanEntry | None:
        """The largest micro-batch that fits with ``base`` in force, with accumulation keeping the
        effective batch where it can be written, verified by a trial of exactly that cell."""
        from ..diagnosis import remedies as fix
        from ..diagnosis.rules import split_batch

        ctx = self.run.context
        guess = ctx.batch if ctx is not None else None
        if guess is None or guess.value < 2 or not self.budget:
            return None
        fig = figures(self.run.report, ctx)
        trials: list[Trial] = []
        freed = sum(_freed(r, self.run) for r in base)
        if freed and self.run.limit is None:
            return None  # freeing is tried by raising the limit by what it frees: no limit, no trial
        room = self.run.limit + freed if freed else None

        def probe(b: int) -> Trial:
            remedy = fix.batch(ctx, fig, guess, b, 1)
            bounds = Bounds(
                steps=1 if self.training and not self.keeps else None, seconds=self.left(), limit=room
            )
            if guess.where == "rows":
                # A step on micro-batches: the second one holds the first one's gradients beside its own
                # activations, the peak of every later one; the whole step is checked once, below.
                bounds = replace(bounds, steps=None, backwards=2)
            self.session.progress(
                f"  trial {self.trials + 1}: {' + '.join(r.title for r in base)}"
                f"{' + ' if base else ''}{guess.name}={b} (probe) …"
            )
            attempt = self.try_((*base, remedy), bounds)
            rec = attempt.recording
            timed_out = "time" in (attempt.stopped_by or "")
            fits = attempt.outcome in ("ok", "stopped") and not timed_out
            peak, allocated = rec.peak_reserved, rec.peak_allocated
            if self.ranks:
                fits, peak, timed_out = self.rank_probe(attempt)
                allocated = peak
            verdict = FITS if fits else NOT_MEASURED if timed_out else DOES_NOT_FIT
            self.session.progress(ended(verdict, peak, "the time budget ran out" if timed_out else ""))
            return Trial(b, fits, peak, attempt.wall_s, "probe", allocated)

        b = max(1, min(guess.value // 2, _first_probe(fig, guess.value)))
        while self.left() > 0:
            trials.append(probe(b))
            if trials[-1].fits or b == 1:
                break
            b = max(1, b // 2)
        while self.left() > 0 and len(trials) < 8:
            nxt = next_batch(trials, self.budget, margin=self.session.settings.search_margin)
            if nxt is None or nxt >= guess.value:
                break
            fitting = max((t.batch for t in trials if t.fits), default=None)
            if fitting is not None and self.micro(guess.value, nxt) <= self.micro(guess.value, fitting):
                break  # the micro-batch written would be the same: a closer probe changes nothing
            trials.append(probe(nxt))
        best = max((t.batch for t in trials if t.fits), default=None)
        if best is None:
            last = trials[-1] if trials else None
            if last is None and base:
                return None  # a combination the budget left no time to try: nothing to offer for it
            smallest = last.batch if last is not None else max(1, b)
            if last is not None and smallest > 1:
                # The budget ended with the knob not exhausted: a smaller batch was never tried, so this
                # says nothing of whether one fits.
                smaller, acc = split_batch(guess.value, max(1, smallest // 2), self.training)
                return PlanEntry(
                    (*base, fix.batch(ctx, fig, guess, smaller, acc)),
                    NOT_MEASURED,
                    peak=None,
                    budget=self.budget,
                    method=f"{len(trials)} probes",
                    note=f"{guess.name}={smallest} did not fit and the time budget ran out before {smaller}",
                )
            return PlanEntry(
                (*base, fix.batch(ctx, fig, guess, smallest, 1)),
                DOES_NOT_FIT if last is not None else NOT_MEASURED,
                peak=last.peak_reserved if last else None,
                budget=self.budget,
                method=f"{len(trials)} probes",
                note=f"not even {guess.name}={smallest} fits" if last is not None else "",
            )
        new, acc = split_batch(guess.value, best, self.training)
        if acc > 1:
            # Accumulating micro-batches keep the gradients between backward passes: room for them where
            # the probes' peaks did not hold them.
            grads = _grads_to_add(trials, ctx)
            safe = _largest_within(trials, self.budget * (1 - self.margin) - grads)
            if safe is not None and safe < 1:
                # The probes peaked where the batch hardly counts (the optimizer's step, with the
                # gradients already there): they say nothing of the micro-batches' own peak, which the
                # rewritten cell's run below measures from the largest probe that fit.
                safe = None
            new, acc = split_batch(guess.value, max(1, min(best, safe if safe is not None else best)), True)
        remedy = fix.batch(ctx, fig, guess, new, acc)
        probes = f"{len(trials)} probes"
        if remedy.params.get("accumulate", 1) > 1 and self.training and not self.keeps:
            # The rewritten cell itself runs through its second optimizer step with its accumulation: the
            # steady state the probes did not hold, and a rewrite that breaks the cell, show here.
            self.converging(trials, guess.value)
            entry = self.accumulated(base, remedy)
            while new > 1 and self.left() > 0 and _short(entry):
                # The gradients kept between micro-batches took more room than the probes left (or left
                # less than the margin): half the micro-batch, the effective batch kept.
                smaller, acc = split_batch(guess.value, max(1, new // 2), True)
                if smaller == new:
                    break
                halved = self.accumulated(base, fix.batch(ctx, fig, guess, smaller, acc))
                if entry.verdict == LIKELY_FITS and halved.verdict != FITS:
                    break  # no better: the likely fit stays, said as such
                new, entry = smaller, halved
            fitted = min(
                (t for t in trials if t.fits and t.batch >= new), key=lambda t: t.batch, default=None
            )
            how = f"{probes}: {guess.name}={fitted.batch if fitted else best} fit with room for the gradients"
            ran = "through its second optimizer step" if self.training else "2 micro-batches"
            if entry.verdict == NOT_MEASURED:
                return replace(entry, method=how)  # the rewritten cell did not run that far: not said
            return replace(entry, method=f"{how}; the rewritten cell ran {ran}")
        scale = 1.0 if remedy.params.get("keeps_effective") else guess.value / new
        self.converging(trials, new)
        entry = self.entry((*base, remedy), steps_scale=scale)
        if entry.verdict == LIKELY_FITS and new > 1 and self.left() > 0:
            # Less than the margin to spare: a smaller batch, verified, rather than a promise not kept.
            smaller = fix.batch(ctx, fig, guess, max(1, new // 2), 1)
            halved = self.entry((*base, smaller), steps_scale=guess.value / max(1, new // 2))
            entry = halved if halved.verdict == FITS else entry
        return replace(entry, method=f"{probes}, {entry.method}" if entry.method else probes)


def ended(verdict: str, peak: int | None, note: str = "") -> str:
    """The end of a trial's progress line: ' fits, peak 17.00 MiB', ' does not fit, peak at least …',
    ' stopped: the time budget ran out'."""
    if verdict == NOT_MEASURED:
        return f" {'stopped' if 'time' in note else NOT_MEASURED}{': ' + note if note else ''}"
    bound = "at least " if verdict == DOES_NOT_FIT else ""
    return f" {verdict}" + (f", peak {bound}{format_bytes(peak)}" if peak is not None else "")


def _rechunked(ctx: Any, fig: Any, remedy: Remedy, chunk: int) -> Remedy:
    """``remedy`` (prompts in chunks) made again for ``chunk`` prompts at a time, its saving the share of
    what grows with the prompts that the other chunks took."""
    from ..diagnosis import remedies as fix

    batch = remedy.params["batch"]
    saving = fig.activations * (batch - chunk) // batch if fig.activations else None
    if remedy.kind == "split_calls":
        return fix.split_calls(ctx, fig, ctx.batch_call, chunk, saving)
    return fix.split_generate(ctx, fig, batch, chunk, saving)


def _short(entry: PlanEntry) -> bool:
    """Whether a verifying trial of the batch fell short in a way a smaller micro-batch can mend: out of
    memory (not a rewrite that changed the work, which has a note), or a fit with less than the margin."""
    return (entry.verdict == DOES_NOT_FIT and not entry.note) or entry.verdict == LIKELY_FITS


def _grads_to_add(trials: list[Trial], ctx: Any) -> int:
    """The gradients' bytes a micro-batch's peak adds to a probe's when they accumulate: none where the
    probes' own peaks held them already (the fixed part of their line is at least the weights and their
    gradients: the peak came in the backward pass or the step, not in a forward after zero_grad)."""
    from .batch_search import fit_line

    training = [m for m in ctx.models if m.is_training]
    grads = sum(m.trainable_bytes if m.trainable_bytes is not None else m.param_bytes for m in training)
    weights = sum(m.param_bytes for m in training)
    line = fit_line(trials)
    if line is not None and grads and line[0] >= weights + 0.9 * grads:
        return 0
    return grads


def _largest_within(trials: list[Trial], room: float) -> int | None:
    """The largest batch whose peak the line through the fitting trials puts within ``room`` bytes; with
    one fitting trial, the same share of its batch (the fixed part counted as growing: on the safe side)."""
    from .batch_search import fit_line

    line = fit_line(trials)
    if line is not None and line[1] > 0:
        return math.floor((room - line[0]) / line[1])
    fitting = [t for t in trials if t.fits]
    if not fitting:
        return None
    top = max(fitting, key=lambda t: t.batch)
    return math.floor(top.batch * room / max(top.peak_reserved, 1))


def _first_probe(fig: Any, old: int) -> int:
    """A first micro-batch from the figures: what the room left by the fixed part holds at the per-sample
    rate read at the failure (a lower bound, so halved), at most half the batch."""
    if fig.activations and fig.available is not None and fig.available > fig.fixed:
        per_sample = fig.activations / old
        return max(1, int((fig.available - fig.fixed) / per_sample / 2))
    return max(1, old // 4)


def _freed(remedy: Remedy, run: CellRun) -> int:
    """The bytes applying ``remedy`` frees once (its kind's ``frees``)."""
    frees = kind_of(remedy).frees
    if frees == "pinned":
        return remedy.saving or 0
    if frees != "names" or run.context is None:
        return 0
    names = set(remedy.params.get("names", []))
    return sum(x.bytes for x in run.context.leftovers if x.name in names)


def _step_time(steps: tuple[float, ...]) -> float | None:
    """Seconds of the last full optimizer step of a recording (None with fewer than two steps)."""
    return steps[-1] - steps[-2] if len(steps) >= 2 else None


def _summary(plan: FixPlan, run: CellRun, restored: Any = None) -> str:
    # The first entry says what fits and by how much: the summary says how the plan was measured, and
    # where nothing was verified, why.
    untried = next((e for e in plan.entries if e.verdict == NOT_MEASURED), None)
    if plan.recommended is not None or any(e.verdict == LIKELY_FITS for e in plan.entries):
        head = ""
    elif plan.cut_short and untried is not None:
        # Not "nothing fits": the budget ended before a fix was verified.
        head = f"Stopped after {plan.spent_s:.0f} s (--plan-budget) before a fix was verified. "
    else:
        head = "No fix measured here fits. "
    trials = f"{plan.trials} trial{'s' if plan.trials != 1 else ''}"
    spent = f"{trials} in {plan.spent_s:.1f} s of {plan.budget_s:.0f} s"
    if plan.spent_s > plan.budget_s * 1.05:
        spent += " (extended for a search that was converging)"
    return head + spent + (f"; {restored.sentence()}" if restored is not None else ".")


def _unfittable(plan: FixPlan, run: CellRun) -> str:
    """Where nothing fits: how much the cell needs by the figures, and the budget it does not fit."""
    if plan.recommended is not None or any(e.verdict == NOT_MEASURED for e in plan.entries):
        return ""
    too_large = next((f for f in run.findings if f.key == "too_large"), None)
    if not plan.entries and too_large is None:
        return ""
    if too_large is not None:
        return f"No setting it knows makes this cell fit {format_bytes(run.budget)}: {too_large.evidence}"
    smallest = min((e.peak for e in plan.entries if e.peak), default=None)
    budget = format_bytes(run.budget) if run.budget else "the card"
    growth = next((f for f in run.findings if f.key == "growth"), None)
    if growth is not None and run.context is not None:
        return (
            f"The cell keeps growing ({growth.evidence.split(':')[0].lower()}); no setting it knows makes it "
            f"fit {budget}."
        )
    need = f"; with every fix tried it still needed more than {format_bytes(smallest)}" if smallest else ""
    return f"No fix it knows makes this cell fit {budget}{need}."


def _global_batch_changed(fixes: tuple[Remedy, ...]) -> str:
    """Why a fix is not tried on the ranks of a distributed cell ('' where it is): a smaller batch whose
    accumulation could not be written where the ranks run would change the global batch."""
    for r in fixes:
        if r.kind == "batch" and not r.params.get("keeps_effective", True):
            return (
                "not tried: each rank's batch would shrink without accumulation, changing the global batch "
                "(the accumulation could not be written where the ranks run)"
            )
    return ""


def _unreached(run: CellRun) -> str:
    """The fixes the findings offer that a relaunch cannot put into the ranks, said as such."""
    names = unreached(run.findings)
    if not names:
        return ""
    return (
        f" Not tried: {', '.join(names)}: a setting of this kernel's process, which does not reach the ranks "
        "(its snippet goes into the rank function)."
    )
