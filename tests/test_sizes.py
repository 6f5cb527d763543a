"""Sizes as people read them: one formatter, and no figure beyond what any device can hold."""

from __future__ import annotations

import pytest

from oommagic.sizes import MOST_BYTES, format_bytes, plausible_bytes


@pytest.mark.parametrize(
    ("n", "shown"),
    [
        (0, "0 bytes"),
        (1023, "1023 bytes"),
        (3 * 1024**3 // 2, "1.50 GiB"),
        (1023 * 1024**4, "1023.00 TiB"),
        (3 * 1024**5, "3.00 PiB"),
        (MOST_BYTES, "16.00 EiB"),
        (MOST_BYTES + 1, "more than 16.00 EiB"),
        (10**38, "more than 16.00 EiB"),
        (-(10**38), "less than -16.00 EiB"),
        (-2048, "-2.00 KiB"),
    ],
)
def test_sizes_read_as_sizes_however_large(n, shown):
    assert format_bytes(n) == shown


def test_a_size_beyond_any_device_is_not_known():
    assert plausible_bytes(80 * 1024**3) == 80 * 1024**3 and plausible_bytes(0) == 0
    assert plausible_bytes(10**38) is None and plausible_bytes(-1) is None and plausible_bytes(None) is None
