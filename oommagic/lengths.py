"""Sample lengths of a dataset: where the long tail is, and what truncating it would save.

Padded batches cost memory by their longest sample, so a few outliers set the activation memory of every
batch they land in. ``summarize_lengths`` is pure; ``plot_lengths`` draws the distribution.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthSummary:
    """Quantiles of the lengths, the suggested ``max_length`` and the samples above it."""

    count: int
    median: int
    p90: int
    p99: int
    longest: int
    cutoff: int
    outliers: tuple[int, ...]

    @property
    def saving(self) -> float:
        """Share of a padded batch's activation memory saved by truncating at ``cutoff`` when the batch
        holds the longest sample (activations grow at least linearly with sequence length)."""
        return 1 - self.cutoff / self.longest if self.longest else 0.0

    def __str__(self) -> str:
        return (
            f"{self.count} samples: median {self.median}, 90% {self.p90}, 99% {self.p99}, longest "
            f"{self.longest}; {len(self.outliers)} above {self.cutoff} — truncating there "
            f"(truncation=True, max_length={self.cutoff}) cuts the worst batch's activations by "
            f"{self.saving:.0%} or more"
        )


def lengths_of(samples: Iterable) -> list[int]:
    """Lengths of samples given as ints, sequences, or dicts with ``input_ids``."""
    out = []
    for s in samples:
        if isinstance(s, int):
            out.append(s)
        elif isinstance(s, dict):
            out.append(len(s["input_ids"]))
        else:
            out.append(len(s))
    return out


def _quantile(sorted_values: Sequence[int], q: float) -> int:
    idx = min(len(sorted_values) - 1, max(0, round(q * (len(sorted_values) - 1))))
    return sorted_values[idx]


def summarize_lengths(
    samples: Iterable, quantile: float = 0.99, max_length: int | None = None
) -> LengthSummary:
    """Quantiles and outliers; the cutoff is ``max_length`` if given, else the ``quantile`` length."""
    lengths = lengths_of(samples)
    if not lengths:
        raise ValueError("no samples to summarize")
    ordered = sorted(lengths)
    cutoff = max_length if max_length is not None else _quantile(ordered, quantile)
    return LengthSummary(
        count=len(lengths),
        median=_quantile(ordered, 0.5),
        p90=_quantile(ordered, 0.9),
        p99=_quantile(ordered, 0.99),
        longest=ordered[-1],
        cutoff=cutoff,
        outliers=tuple(i for i, n in enumerate(lengths) if n > cutoff),
    )


def plot_lengths(samples: Iterable, quantile: float = 0.99, max_length: int | None = None, ax=None):
    """Histogram of the lengths with the cutoff and the outliers marked; returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    lengths = lengths_of(samples)
    summary = summarize_lengths(lengths, quantile, max_length)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 2.6))
    ax.hist(lengths, bins=min(80, max(10, len(set(lengths)))), color="#3b75af", alpha=0.8)
    ax.set_yscale("log")
    ax.axvline(summary.cutoff, color="#c0392b", ls="--", label=f"max_length {summary.cutoff}")
    out = [lengths[i] for i in summary.outliers]
    if out:
        ax.plot(out, [1] * len(out), "v", color="#c0392b", label=f"{len(out)} outliers")
    ax.set_xlabel("tokens per sample")
    ax.set_ylabel("samples")
    ax.set_title(str(summary).split(";")[0], fontsize=9)
    ax.legend(fontsize=8, frameon=False)
    return ax
