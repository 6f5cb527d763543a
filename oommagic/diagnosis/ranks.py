"""Ranks of a distributed run: what each rank reported, which failed first, which is the bottleneck, which
left a CUDA context on a GPU that is not its own, and what to try where a rank ran out of memory.

Pure: imports neither torch nor IPython. ``run.ranks`` gathers ``RankResult`` records from the rank
processes; this module decides what they say, and the views render ``Ranks.rows()``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field, fields, replace

from ..oom import OOMReport, parse_oom
from ..sizes import format_bytes as fmt
from .findings import Finding, Remedy
from .kinds import reaches_ranks
from .rewrite_shard import checkpoint_source, shard_source
from .source import BatchGuess

# A rank whose weights, gradients and optimizer state are at least this share of its peak gains most from
# sharding them (FSDP2 / ZeRO) rather than from a smaller batch.
STATE_BULK = 0.5
# A CUDA context costs ~0.5 GiB of device memory (DESIGN.md); NVML lists smaller entries for processes
# that merely opened the device (a few MiB), which are not worth a warning.
STRAY_MIN = 64 * 1024**2

STATUSES = ("ok", "oom", "error", "stopped", "lost", "running", "timed_out")


@dataclass(frozen=True)
class RankResult:
    """What one rank process reported (bytes as ``int``, times as epoch seconds).

    ``status``: ``ok``; ``oom`` (it ran out: ``requested`` and ``message`` say what it asked for);
    ``error`` (another exception); ``stopped`` (stopped by oommagic because rank ``stopped_by`` failed);
    ``lost`` (it started but wrote no report: killed); ``running`` (still working when the cell ended,
    started with ``join=False``); ``left_running`` marks a rank oommagic killed after a failure.
    ``outside`` is the memory the process held on its GPU beyond PyTorch's reserved bytes (NVML used −
    reserved: CUDA context, NCCL buffers);
    ``contexts`` the ``(cuda index, bytes)`` NVML lists for this PID on every GPU. ``state`` is the bytes of
    the weights, gradients and optimizer state the rank's frames held, where they could be read.
    ``ended_at`` is when the rank wrote its report (its last act: it ends right after). ``steps`` is the
    optimizer steps the rank took; in a trial of the fix plan, ``trial_stop`` says where its bounds ended
    it (status ``ok`` at the steady state, ``timed_out`` when the trial's time ran out first).
    """

    rank: int
    pid: int
    device: str = "cpu"
    status: str = "ok"
    peak_allocated: int = 0
    peak_reserved: int = 0
    outside: int | None = None
    limit: int | None = None
    capacity: int | None = None
    requested: int | None = None
    failed_at: float | None = None
    message: str | None = None
    stopped_by: int | None = None
    contexts: tuple[tuple[int, int], ...] = ()
    params: int | None = None
    grads: int | None = None
    optimizer_state: int | None = None
    left_running: bool = False
    ended_at: float | None = None
    steps: int | None = None
    trial_stop: str | None = None

    @property
    def budget(self) -> int | None:
        return self.limit if self.limit is not None else self.capacity

    @property
    def demand(self) -> int:
        """Bytes the rank needed: its peak reserved, plus the memory outside PyTorch, plus the request
        that failed (a lower bound after an out-of-memory error: the step would have gone on)."""
        return self.peak_reserved + (self.outside or 0) + (self.requested or 0 if self.status == "oom" else 0)

    @property
    def held(self) -> int:
        """Bytes held against the budget: the peak reserved, and where the budget is the card's (no
        limit) the memory outside PyTorch too (a per-process limit bounds PyTorch's allocator alone)."""
        return self.peak_reserved + (self.outside or 0 if self.limit is None else 0)

    @property
    def share(self) -> float | None:
        """``demand`` over the budget (above 1: it did not fit)."""
        return self.demand / self.budget if self.budget else None

    @property
    def state(self) -> int | None:
        parts = [x for x in (self.params, self.grads, self.optimizer_state) if x is not None]
        return sum(parts) if parts else None

    @property
    def cuda_index(self) -> int | None:
        found = re.fullmatch(r"cuda:(\d+)", self.device)
        return int(found.group(1)) if found else None

    def to_json(self) -> dict:
        data = asdict(self)
        data["contexts"] = [list(c) for c in self.contexts]
        return data

    @classmethod
    def from_json(cls, data: dict) -> RankResult:
        known = {f.name: data[f.name] for f in fields(cls) if f.name in data}
        known["contexts"] = tuple(tuple(c) for c in known.get("contexts", ()))
        return cls(**known)


@dataclass(frozen=True)
class StrayContext:
    """Rank ``rank`` (PID ``pid``) holds ``used`` bytes on ``cuda:{index}``, a GPU that is not its own:
    usually a CUDA call made before ``torch.cuda.set_device(rank)``, which puts a context on GPU 0."""

    rank: int
    pid: int
    index: int
    used: int

    def line(self) -> str:
        return (
            f"rank {self.rank} (PID {self.pid}) holds {fmt(self.used)} on cuda:{self.index}, not its own "
            "GPU: a stray CUDA context"
        )


def stray_contexts(results: tuple[RankResult, ...], least: int = STRAY_MIN) -> tuple[StrayContext, ...]:
    """Every (rank, GPU) where NVML lists the rank's PID on a GPU other than the rank's device."""
    strays = []
    for r in results:
        own = r.cuda_index
        for index, used in r.contexts:
            if index != own and used >= least:
                strays.append(StrayContext(r.rank, r.pid, index, used))
    return tuple(strays)


@dataclass(frozen=True)
class Ranks:
    """The ranks one ``%%gpumem`` cell started, in rank order."""

    results: tuple[RankResult, ...] = ()
    strays: tuple[StrayContext, ...] = field(default=())

    @classmethod
    def of(cls, results: list[RankResult] | tuple[RankResult, ...]) -> Ranks:
        ordered = tuple(sorted(results, key=lambda r: (r.rank, r.pid)))
        return cls(ordered, stray_contexts(ordered))

    def __len__(self) -> int:
        return len(self.results)

    @property
    def failed_first(self) -> RankResult | None:
        """The rank whose out-of-memory error (or other error) came first, by its time of failure."""
        failed = [r for r in self.results if r.status in ("oom", "error") and r.failed_at is not None]
        return min(failed, key=lambda r: (r.failed_at, r.rank)) if failed else None

    @property
    def out_of_memory(self) -> RankResult | None:
        """The first rank that ran out of memory (None: none did)."""
        failed = [r for r in self.results if r.status == "oom"]
        return min(failed, key=lambda r: (r.failed_at or 0.0, r.rank)) if failed else None

    @property
    def bottleneck(self) -> RankResult | None:
        """The rank with the least room: the largest share of its budget needed (the largest demand
        where no budget is known)."""
        if not self.results:
            return None
        return max(self.results, key=lambda r: (r.share or 0.0, r.demand, -r.rank))

    @property
    def left_running(self) -> tuple[int, ...]:
        """PIDs of ranks still alive after the cell, killed by oommagic."""
        return tuple(r.pid for r in self.results if r.left_running)

    def report(self) -> OOMReport | None:
        """The first out-of-memory rank's error, parsed; its exact request where the message rounds."""
        failed = self.out_of_memory
        if failed is None or not failed.message:
            return None
        report = parse_oom(failed.message) or OOMReport(text=failed.message, source="unknown")
        if failed.requested is not None and report.emulated:
            report = replace(report, requested=failed.requested)
        return report

    def headline(self) -> str:
        """The cell's one line, said of its ranks: which ran out, on which device, asking for what, under
        which budget; else the largest peak and whose it was."""
        failed = self.out_of_memory
        if failed is not None:
            line = f"rank {failed.rank} ({failed.device}) ran out of memory"
            if failed.requested:
                line += f" asking for {fmt(failed.requested)}"
            if failed.budget:
                kind = "limit" if failed.limit is not None else "card"
                line += f" with {fmt(failed.peak_reserved)} reserved of its {fmt(failed.budget)} {kind}"
            return line + self._stopped()
        if not self.results:
            return "no rank reported"
        top = max(self.results, key=lambda r: (r.peak_reserved, -r.rank))
        what = "rank" if len(self.results) == 1 else f"{len(self.results)} ranks"
        budget = f" of {fmt(top.budget)}" if top.budget else ""
        return (
            f"{what}: peak {fmt(top.peak_allocated)} allocated, {fmt(top.peak_reserved)} reserved{budget} "
            f"on rank {top.rank} ({top.device})"
        )

    def _stopped(self) -> str:
        stopped = [r.rank for r in self.results if r.status == "stopped"]
        if not stopped:
            return ""
        names = ", ".join(map(str, stopped))
        return f"; rank {names} was stopped" if len(stopped) == 1 else f"; ranks {names} were stopped"

    def summary(self) -> list[str]:
        """Sentences a person reads above the table."""
        lines = []
        first = self.failed_first
        if first is not None:
            what = "ran out of memory" if first.status == "oom" else "failed"
            need = f" asking for {fmt(first.requested)}" if first.requested else ""
            lines.append(f"rank {first.rank} ({first.device}) {what} first{need}{self._stopped()}")
        neck = self.bottleneck
        if neck is not None and len(self.results) > 1 and neck.share is not None:
            lines.append(f"bottleneck: rank {neck.rank}, needing {neck.share:.0%} of its {fmt(neck.budget)}")
        lines += [s.line() for s in self.strays]
        if self.left_running:
            lines.append(
                f"still running after the cell, killed: PIDs {', '.join(map(str, self.left_running))}"
            )
        return lines

    def rows(self) -> list[tuple[str, ...]]:
        """The per-rank table: a header row, then one row per rank."""
        rows = [("rank", "device", "PID", "peak allocated", "peak reserved", "outside PyTorch", "status")]
        for r in self.results:
            rows.append(
                (
                    str(r.rank),
                    r.device,
                    str(r.pid),
                    fmt(r.peak_allocated),
                    fmt(r.peak_reserved),
                    fmt(r.outside) if r.outside is not None else "–",
                    _status(r),
                )
            )
        return rows

    def pids(self) -> dict[int, int]:
        """PID → rank, for ``%gpumem``'s process list."""
        return {r.pid: r.rank for r in self.results}

    def to_json(self) -> dict:
        first, neck = self.failed_first, self.bottleneck
        return {
            "ranks": [r.to_json() for r in self.results],
            "failed_first": first.rank if first is not None else None,
            "bottleneck": neck.rank if neck is not None else None,
            "stray_contexts": [asdict(s) for s in self.strays],
            "left_running": list(self.left_running),
            "summary": self.summary(),
        }


def _status(r: RankResult) -> str:
    if r.status == "oom":
        return f"OUT OF MEMORY (asked {fmt(r.requested)})" if r.requested else "OUT OF MEMORY"
    if r.status == "stopped":
        return f"stopped (rank {r.stopped_by} failed)" if r.stopped_by is not None else "stopped"
    if r.status == "lost":
        return "no report (killed)"
    if r.status == "running":
        return "still running"
    if r.status == "timed_out":
        return "out of time (trial)"
    return r.status


# --- what to try ---------------------------------------------------------------------------------------


def batch_across_ranks(ranks: Ranks, value: int) -> int | None:
    """The batch every rank can take: ``value`` scaled by the tightest rank's budget over demand, the
    minimum across ranks (every rank runs the same per-rank batch). An upper bound: the demand of a rank
    that failed or was stopped is a lower bound, and only the activations shrink with the batch."""
    shares = [1 / r.share for r in ranks.results if r.share]
    if not shares or min(shares) >= 1:
        return None
    return max(int(value * min(shares)), 1)


_FSDP2 = """from torch.distributed.fsdp import fully_shard
for block in model.{blocks}:  # each transformer block (or layer) on its own
    fully_shard(block)
fully_shard(model)  # replaces DistributedDataParallel: weights, gradients, optimizer state sharded"""

_ZERO_ACCELERATE = """# `accelerate config` (DeepSpeed) or in code: ZeRO stage 2 shards gradients and
# optimizer state across ranks, stage 3 the weights too
from accelerate import Accelerator
from accelerate.utils import DeepSpeedPlugin
accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2))
model, optimizer = accelerator.prepare(model, optimizer)"""

_CHECKPOINT_BLOCKS = """from torch.utils.checkpoint import checkpoint
# in forward(): recompute each block in the backward pass instead of keeping its activations
for block in self.blocks:
    x = checkpoint(block, x, use_reentrant=False)"""


def rank_findings(ranks: Ranks, source: str, batch: BatchGuess | None = None) -> tuple[Finding, ...]:
    """What the ranks' figures say: the rank that ran out and what fills it (sharding where weights,
    gradients and optimizer state are the bulk; a batch every rank can take, and activation checkpointing,
    otherwise), and stray CUDA contexts."""
    found: list[Finding] = []
    failed = ranks.out_of_memory
    if failed is not None:
        found.append(_out_of_memory(ranks, failed, source, batch))
    if ranks.strays:
        stray_bytes = sum(s.used for s in ranks.strays)
        found.append(
            Finding(
                "stray_context",
                "Stray CUDA contexts on another rank's GPU",
                "; ".join(s.line() for s in ranks.strays) + ".",
                saving=stray_bytes,
                remedies=(
                    Remedy(
                        "multi_gpu",
                        "Set each rank's device before any CUDA call",
                        "A CUDA call made before torch.cuda.set_device opens a context on GPU 0 in every "
                        "rank; setting the device first keeps each rank on its own GPU.",
                        code="def train(rank, world_size):\n    torch.cuda.set_device(rank)  # first line\n"
                        '    dist.init_process_group("nccl", rank=rank, world_size=world_size, '
                        'device_id=torch.device("cuda", rank))',
                        saving=stray_bytes,
                    ),
                ),
                score=2.0,
            )
        )
    return tuple(found)


# A remedy of a distributed cell that the ranks cannot get from a retry: a snippet for the rank function.
NOT_IN_RANKS = "not_in_ranks"


def in_every_rank(findings: tuple[Finding, ...]) -> tuple[Finding, ...]:
    """``findings`` of a distributed cell: a retry that only changes a setting of the kernel's process
    (autocast, the allocator, a hook) does not reach the ranks (``kinds.reaches_ranks``), so it becomes a
    snippet to put into the rank function instead of a button, marked ``NOT_IN_RANKS`` in its params."""
    out = []
    for finding in findings:
        remedies = tuple(
            r
            if not r.automatic or reaches_ranks(r)
            else replace(
                r,
                automatic=False,
                explanation=r.explanation + " In a distributed cell: put the snippet into the rank function.",
                params={**r.params, NOT_IN_RANKS: True},
            )
            for r in finding.remedies
        )
        out.append(replace(finding, remedies=remedies))
    return tuple(out)


def unreached(findings: tuple[Finding, ...]) -> tuple[str, ...]:
    """The titles of the fixes ``in_every_rank`` turned into snippets: a relaunch of the ranks cannot try
    them (each once)."""
    titles = [r.title for f in findings for r in f.remedies if r.params.get(NOT_IN_RANKS)]
    return tuple(dict.fromkeys(titles))


def _out_of_memory(ranks: Ranks, failed: RankResult, source: str, batch: BatchGuess | None) -> Finding:
    neck = ranks.bottleneck or failed
    others = [r.peak_reserved for r in ranks.results if r.rank != failed.rank]
    evidence = f"rank {failed.rank} ran out first"
    if failed.requested:
        evidence += f", asking for {fmt(failed.requested)} with {fmt(failed.peak_reserved)} reserved"
    if failed.budget:
        evidence += f" under its {fmt(failed.budget)}"
    if others:
        evidence += f"; the other ranks peaked at up to {fmt(max(others))}"
    if neck.rank != failed.rank:
        evidence += f"; rank {neck.rank} is the tightest"
    remedies: list[Remedy] = []
    state = neck.state
    if state is not None and neck.peak_reserved and state >= STATE_BULK * neck.peak_reserved:
        evidence += (
            f". Weights, gradients and optimizer state are {fmt(state)} of rank {neck.rank}'s "
            f"{fmt(neck.peak_reserved)}: each rank holds a full copy"
        )
        saving = state * (len(ranks) - 1) // max(len(ranks), 1)
        new_source = shard_source(source)
        remedies.append(
            Remedy(
                "shard",
                f"Shard with FSDP2 (fully_shard) across the {len(ranks)} ranks",
                "FSDP2 keeps 1/N of the weights, gradients and optimizer state on each rank and gathers a "
                "block's weights only while it runs; each rank takes the same batch and steps as before.",
                code=_FSDP2.format(blocks="layers")
                if new_source is None
                else _diff_lines(source, new_source),
                # Measured by a relaunch of the ranks where the cell's own wrap can be rewritten.
                automatic=new_source is not None,
                saving=saving,
                params={"ranks": len(ranks)},
                new_source=new_source,
            )
        )
        remedies.append(
            Remedy(
                "multi_gpu",
                "ZeRO through DeepSpeed or Accelerate's config",
                "ZeRO stage 2 shards gradients and optimizer state across ranks, stage 3 the weights too.",
                code=_ZERO_ACCELERATE,
                saving=(neck.optimizer_state or 0) * (len(ranks) - 1) // max(len(ranks), 1) or None,
            )
        )
    checkpointed = checkpoint_source(source)
    remedies.append(
        Remedy(
            "checkpointing",
            "Activation checkpointing per block",
            "Each block's activations are recomputed in the backward pass instead of kept (measured: peak "
            "−61% at +25% time on GPT-2); each rank takes the same batch and steps as before.",
            code=_CHECKPOINT_BLOCKS if checkpointed is None else _diff_lines(source, checkpointed),
            # Measured by a relaunch of the ranks where the cell's own wrap takes the model.
            automatic=checkpointed is not None,
            params={"wrap": True} if checkpointed is not None else {},
            new_source=checkpointed,
        )
    )
    if batch is not None:
        new = batch_across_ranks(ranks, batch.value)
        if new is not None and new < batch.value:
            remedies.insert(
                0,
                Remedy(
                    "batch",
                    f"Batch {batch.value} → {new} on every rank",
                    "Every rank runs the same per-rank batch, so the tightest rank decides: this is its "
                    "budget over what it needed (an upper bound: the failed step would have gone on).",
                    code=f"{batch.name} = {new}",
                    params={"name": batch.name, "old": batch.value, "new": new, "where": batch.where},
                ),
            )
    return Finding(
        "rank_out_of_memory",
        f"Rank {failed.rank} of {len(ranks)} ran out of memory",
        evidence + ".",
        saving=None,
        remedies=tuple(remedies),
        score=3.0,
    )


def _diff_lines(old: str, new: str) -> str:
    from .rewrite import changed_lines

    return changed_lines(old, new)
