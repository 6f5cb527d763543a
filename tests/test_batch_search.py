"""The batch search decides from its trials alone: tested against simulated memory curves."""

from __future__ import annotations

import pytest

from oommagic.batch_search import Trial, first_probe, fit_line, next_batch

GiB = 1024**3


def search(peak_of, budget, start):
    """Drive next_batch the way find_batch_magic does, with a simulated peak-memory curve."""
    trials = []
    batch = first_probe(start)
    while True:
        trials.append(Trial(batch, peak_of(batch) <= budget, peak_of(batch), role="probe"))
        if trials[-1].fits or batch == 1:
            break
        batch //= 2
    while len(trials) < 12:
        batch = next_batch(trials, budget)
        if batch is None:
            break
        peak = peak_of(batch)
        trials.append(Trial(batch, peak <= budget, peak if peak <= budget else 0, role="check"))
    best = max((t.batch for t in trials if t.fits), default=None)
    return best, trials


def true_max(peak_of, budget):
    b = 1
    while peak_of(b + 1) <= budget:
        b += 1
    return b


def gpt2_fp32(b):
    # GPT-2 124M, seq 512, AdamW, fp32 on an H200 (DESIGN.md): 1.48 GiB + 0.827 GiB per sample.
    return int(1.48 * GiB + 0.827 * GiB * b)


def test_affine_peak_reaches_95_percent_in_four_trials():
    budget = 24 * GiB
    best, trials = search(gpt2_fp32, budget, start=64)
    assert best >= 0.95 * true_max(gpt2_fp32, budget)
    assert best <= true_max(gpt2_fp32, budget)
    assert len(trials) <= 4


def test_a_line_that_under_predicts_is_refined_and_never_overshoots():
    # Gradient checkpointing: peak grows faster than the probes' line (10-14% under-prediction).
    def curved(b):
        return int(2 * GiB + 0.25 * GiB * b + 0.004 * GiB * b * b)

    budget = 24 * GiB
    best, trials = search(curved, budget, start=64)
    assert curved(best) <= budget
    assert best >= 0.9 * true_max(curved, budget)
    assert all(t.fits == (curved(t.batch) <= budget) for t in trials)
    assert len(trials) <= 5


def test_nothing_fits_stops_at_batch_one():
    best, trials = search(lambda b: 30 * GiB, 24 * GiB, start=8)
    assert best is None
    assert [t.batch for t in trials] == [2, 1]


def test_fit_line_uses_the_two_largest_fitting_batches():
    trials = [Trial(4, True, 10), Trial(8, True, 18), Trial(16, False, 0), Trial(6, True, 14)]
    assert fit_line(trials) == pytest.approx((2.0, 2.0))


def test_done_when_bounds_meet():
    assert next_batch([Trial(10, True, 5), Trial(11, False, 0)], budget=100) is None
