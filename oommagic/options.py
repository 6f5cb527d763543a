"""``Options``: the ``%%gpumem`` options as typed data, built once from the parsed argument line.

Nothing downstream reads a dict or a string of options: the runner, the session, the plan and the views
all read this record. Pure: imports neither torch nor IPython.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Any

from .sizes import MOST_BYTES, parse_size

LIMIT_HELP = "--limit expects a size like 24GiB, 8GB, 512MiB or a fraction like 0.5"


class OptionError(ValueError):
    """An option value a person has to correct; the message says how."""


@dataclass(frozen=True)
class Options:
    """One ``%%gpumem`` line, parsed. ``limit`` is a fraction in (0, 1] (``float``) or bytes (``int``);
    ``plan_budget`` seconds for the fix plan's trials (None: scaled from the failed run's own time,
    0: no trials)."""

    limit: float | int | None = None
    device: str | None = None
    quiet: bool = False
    no_raise: bool = False
    text: bool = False
    keep: bool = False
    no_timeline: bool = False
    batch: str | None = None
    find_batch: str | None = None
    output: str | None = None
    plan_budget: float | None = None
    report_errors: bool = False
    stacks: bool = False
    no_snapshot: bool = False

    @classmethod
    def from_args(cls, args: Any) -> Options:
        """From ``parse_argstring``'s namespace; raises ``OptionError`` for a value that cannot be used."""
        if args.output is not None and not args.output.isidentifier():
            raise OptionError(f"-o expects a Python name, got {args.output!r}")
        for flag, name in (("--batch", args.batch), ("--find-batch", args.find_batch)):
            if name is not None and not name.isidentifier():
                raise OptionError(f"{flag} expects a Python name, got {name!r}")
        return cls(
            limit=parse_limit(args.limit),
            device=args.device,
            quiet=args.quiet,
            no_raise=args.no_raise,
            text=args.text,
            keep=args.keep,
            no_timeline=args.no_timeline,
            batch=args.batch,
            find_batch=args.find_batch,
            output=args.output,
            plan_budget=parse_seconds(args.plan_budget),
            report_errors=args.report_errors,
            stacks=args.stacks,
            no_snapshot=args.no_snapshot,
        )

    @property
    def timeline(self) -> bool:
        return not self.no_timeline

    def to_json(self) -> dict:
        """The options a person set (defaults left out), for the comm message."""
        defaults = Options()
        return {k: v for k, v in asdict(self).items() if v != getattr(defaults, k)}


def parse_limit(text: str | None) -> float | int | None:
    """``--limit`` value: a fraction in (0, 1] as ``float`` or a size as ``int`` bytes."""
    if text is None:
        return None
    cleaned = text.strip()
    try:
        value = float(cleaned)
    except ValueError:
        value = None
    if value is not None:
        if 0 < value <= 1:
            return value
        raise OptionError(
            f"{LIMIT_HELP}, got {text!r} "
            "(a bare number must be a fraction between 0 and 1; give sizes a unit)"
        )
    try:
        nbytes = parse_size(cleaned)
    except ValueError:
        raise OptionError(f"{LIMIT_HELP}, got {text!r}") from None
    if nbytes <= 0:
        raise OptionError(f"--limit must be above zero, got {text!r}")
    if nbytes > MOST_BYTES:
        raise OptionError(
            f"--limit {text.strip()!r} is more than any device holds (at most 16 EiB): give a size like "
            "24GiB or a fraction like 0.5"
        )
    return nbytes


def parse_seconds(text: str | None) -> float | None:
    """``--plan-budget`` value: seconds (``90``, ``90s``, ``2min``); ``0`` means no trials."""
    if text is None:
        return None
    cleaned = text.strip().lower()
    scale = 1.0
    for unit, factor in (("min", 60.0), ("m", 60.0), ("s", 1.0)):
        if cleaned.endswith(unit):
            cleaned, scale = cleaned[: -len(unit)].strip(), factor
            break
    try:
        value = float(cleaned) * scale
    except ValueError:
        raise OptionError(
            f"--plan-budget expects seconds like 60, 90s or 2min (0: no trials), got {text!r}"
        ) from None
    if not math.isfinite(value):
        raise OptionError(
            f"--plan-budget expects a number of seconds like 60, 90s or 2min (0: no trials), got {text!r}"
        )
    if value < 0:
        raise OptionError(f"--plan-budget cannot be negative, got {text!r}")
    return value


@dataclass(frozen=True)
class Settings:
    """The knobs of ``GpuMemMagics`` (``%config GpuMemMagics.<name> = value``), read once per magic call
    into one record that the session hands to every part that uses one: the recorder (``trace_entries``),
    the fix plan (``plan_margin``, ``plan_budget_*``) and the batch searches (``search_margin``)."""

    trace_entries: int = 500_000
    plan_margin: float = 0.05
    search_margin: float = 0.02
    plan_budget_factor: float = 8.0
    plan_budget_min: float = 30.0
    plan_budget_max: float = 300.0

    def plan_budget(self, wall_s: float) -> float:
        """The default time budget of the fix plan, in seconds, for a failed run that took ``wall_s``."""
        return min(max(self.plan_budget_factor * wall_s, self.plan_budget_min), self.plan_budget_max)

    @classmethod
    def names(cls) -> tuple[str, ...]:
        """The knobs' names, as ``%config`` spells them."""
        return tuple(f.name for f in fields(cls))
