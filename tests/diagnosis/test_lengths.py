from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import pytest

from oommagic.lengths import plot_lengths, summarize_lengths


def test_long_tail_is_found_and_the_cut_saves_memory():
    lengths = [100] * 980 + [120] * 15 + [2000, 3000, 4000, 5000, 8000]
    s = summarize_lengths(lengths)
    assert s.median == 100 and s.longest == 8000
    assert s.cutoff == 120  # the 99th percentile
    assert s.outliers == (995, 996, 997, 998, 999)
    assert s.saving == pytest.approx(1 - 120 / 8000)
    assert "max_length=120" in str(s)


def test_explicit_max_length_and_sample_forms():
    s = summarize_lengths([[1] * 5, {"input_ids": [1] * 50}, 7], max_length=10)
    assert s.outliers == (1,)


def test_plot_marks_cutoff_and_outliers():
    ax = plot_lengths([10] * 50 + [500], max_length=100)
    labels = ax.get_legend_handles_labels()[1]
    assert "max_length 100" in labels and "1 outliers" in labels


def test_no_samples_is_a_clear_error():
    with pytest.raises(ValueError, match="no samples"):
        summarize_lengths([])
