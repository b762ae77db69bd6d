"""What repeated runs support: means with 95 % intervals (Student's t), the
ratio of two strategies' means with its interval (Welch's t on the logs, so
the interval of a ratio stays positive), and one sentence for each."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import stats

CONFIDENCE = 0.95


@dataclass(frozen=True)
class Interval:
    """An estimate and its 95 % interval (nan when there are too few runs)."""

    estimate: float
    low: float
    high: float

    @property
    def resolved(self) -> bool:
        return not math.isnan(self.low)


def mean_interval(values: list[float]) -> Interval:
    values = np.asarray(values, dtype=float)
    mean = float(values.mean())
    if len(values) < 2:
        return Interval(mean, math.nan, math.nan)
    half = stats.t.ppf((1 + CONFIDENCE) / 2, len(values) - 1) * stats.sem(values)
    return Interval(mean, mean - half, mean + half)


def welch(a, b) -> tuple[float, float]:
    """Welch's interval of mean(a) - mean(b); exact when neither has any spread."""
    if not (np.ptp(a) or np.ptp(b)):
        difference = float(np.mean(a) - np.mean(b))
        return difference, difference
    low, high = stats.ttest_ind(a, b, equal_var=False).confidence_interval(CONFIDENCE)
    return float(low), float(high)


def ratio_interval(a: list[float], b: list[float]) -> Interval:
    """a's mean over b's (geometric means), with Welch's interval."""
    log_a, log_b = np.log(a), np.log(b)
    ratio = math.exp(log_a.mean() - log_b.mean())
    if min(len(a), len(b)) < 2:
        return Interval(ratio, math.nan, math.nan)
    low, high = welch(log_a, log_b)
    return Interval(ratio, math.exp(low), math.exp(high))


def difference_interval(a: list[float], b: list[float]) -> Interval:
    """a's mean minus b's, with Welch's interval."""
    difference = float(np.mean(a) - np.mean(b))
    if min(len(a), len(b)) < 2:
        return Interval(difference, math.nan, math.nan)
    return Interval(difference, *welch(a, b))


def ratio_sentence(a: str, b: str, ratio: Interval, what: str, more: str, less: str) -> str:
    """E.g. "horovod is 4 % faster than ps (95 % CI 1 to 7 %).": `more` and
    `less` say how a is when the ratio is above or below 1."""
    if not ratio.resolved:
        return f"{a}/{b} {what}: {ratio.estimate:.2f}x from single runs: no interval."
    if ratio.low > 1:
        low, high, word = ratio.low - 1, ratio.high - 1, more
    elif ratio.high < 1:
        low, high, word = 1 - ratio.high, 1 - ratio.low, less
    else:
        return (
            f"No difference in {what} the runs can resolve: {a}/{b} {ratio.estimate:.2f}x "
            f"(95 % CI {ratio.low:.2f} to {ratio.high:.2f})."
        )
    change = abs(ratio.estimate - 1)
    return (
        f"{a} {word.format(f'{100 * change:.0f} %')} {b} "
        f"(95 % CI {100 * low:.0f} to {100 * high:.0f} %)."
    )


def difference_sentence(a: str, b: str, difference: Interval, what: str) -> str:
    """A difference of fractions (such as top-1) in percentage points."""
    points = 100 * difference.estimate
    if not difference.resolved:
        return f"{a} - {b} {what}: {points:+.2f} points from single runs: no interval."
    low, high = 100 * difference.low, 100 * difference.high
    if low <= 0 <= high:
        return (
            f"No difference in {what} the runs can resolve: {a} - {b} {points:+.2f} points "
            f"(95 % CI {low:+.2f} to {high:+.2f})."
        )
    word = "higher" if points > 0 else "lower"
    return (
        f"{a}'s {what} is {abs(points):.2f} points {word} than {b}'s "
        f"(95 % CI {low:+.2f} to {high:+.2f})."
    )


def time_to_target(history: list[dict], target: float) -> dict:
    """The first epoch whose validation top-1 reaches target, and the training
    time up to its end; None for both if no epoch did (MLPerf's measure)."""
    elapsed = 0.0
    for record in history:
        elapsed += record["epoch_time_s"]
        if record["val_top1"] >= target:
            return {"epochs_to_target": record["epoch"], "time_to_target_s": elapsed}
    return {"epochs_to_target": None, "time_to_target_s": None}


def scaling_efficiency(
    rates: list[float], workers: int, base_rates: list[float], base_workers: int = 1
) -> Interval:
    """img/s(N) / (N/N0 x img/s(N0)) with its interval: 1 is linear scaling."""
    ratio = ratio_interval(rates, base_rates)
    factor = workers / base_workers
    return Interval(ratio.estimate / factor, ratio.low / factor, ratio.high / factor)
