"""Gamma inter-arrival times."""

from __future__ import annotations

import math
import statistics

import pytest

from services.client.bench.arrivals import inter_arrival_times, send_offsets


def test_infinite_rate_sends_everything_at_once() -> None:
    assert inter_arrival_times(5, math.inf, 1.0, seed=3) == [0.0] * 5
    assert inter_arrival_times(0, 4.0, 1.0, seed=3) == []


def test_mean_gap_is_one_over_rate() -> None:
    for burstiness in (0.5, 1.0, 4.0):
        gaps = inter_arrival_times(20_000, 8.0, burstiness, seed=1)
        assert len(gaps) == 20_000
        assert all(g >= 0 for g in gaps)
        assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.05)


def test_burstiness_sets_the_variance() -> None:
    # Gamma(k, 1/(rate*k)) has variance 1/(k*rate^2): Poisson at k=1, burstier below, steadier above.
    rate = 2.0
    variances = {}
    for k in (0.25, 1.0, 4.0):
        variances[k] = statistics.pvariance(inter_arrival_times(20_000, rate, k, seed=2))
        assert variances[k] == pytest.approx(1 / (k * rate**2), rel=0.15)
    assert variances[0.25] > variances[1.0] > variances[4.0]


def test_same_seed_same_gaps() -> None:
    assert inter_arrival_times(50, 3.0, 1.0, seed=7) == inter_arrival_times(50, 3.0, 1.0, seed=7)
    assert inter_arrival_times(50, 3.0, 1.0, seed=7) != inter_arrival_times(50, 3.0, 1.0, seed=8)


@pytest.mark.parametrize(
    ("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)]
)
def test_rejects_bad_parameters(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        inter_arrival_times(3, rate, burstiness, seed=0)


def test_send_offsets_start_at_zero() -> None:
    assert send_offsets([0.5, 0.25, 1.0]) == [0.0, 0.5, 0.75]
    assert send_offsets([]) == []
