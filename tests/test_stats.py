"""The report's statistics on hand-made numbers."""

from __future__ import annotations

import math

import pytest

from distrepro.stats import (
    Interval,
    difference_interval,
    difference_sentence,
    mean_interval,
    ratio_interval,
    ratio_sentence,
    scaling_efficiency,
    time_to_target,
)

FASTER, SLOWER = "is {} faster than", "is {} slower than"


def test_mean_interval_is_students_t():
    interval = mean_interval([1.0, 2.0, 3.0])
    # t(0.975, 2 degrees of freedom) = 4.3027; standard error = 1 / sqrt(3)
    assert interval.estimate == 2.0
    assert interval.low == pytest.approx(2 - 4.3027 / math.sqrt(3), abs=1e-4)
    assert interval.high == pytest.approx(2 + 4.3027 / math.sqrt(3), abs=1e-4)


def test_one_run_has_no_interval_and_says_so():
    assert not mean_interval([5.0]).resolved
    ratio = ratio_interval([110.0], [100.0])
    assert ratio.estimate == pytest.approx(1.1) and not ratio.resolved
    assert "single runs: no interval" in ratio_sentence(
        "horovod", "ps", ratio, "faster", "slower", "img/s"
    )


def test_a_ratio_whose_interval_excludes_one_says_which_way():
    ratio = ratio_interval([110.0, 111.0, 109.0, 110.5], [100.0, 101.0, 99.0, 100.5])
    assert 1 < ratio.low < ratio.estimate < ratio.high
    assert ratio.estimate == pytest.approx(1.0995, abs=1e-3)
    sentence = ratio_sentence("horovod", "parameter_server", ratio, "img/s", FASTER, SLOWER)
    assert sentence.startswith("horovod is 10 % faster than parameter_server (95 % CI ")
    slower = ratio_interval([100.0, 101.0, 99.0, 100.5], [110.0, 111.0, 109.0, 110.5])
    assert slower.high < 1
    assert "horovod is 9 % slower than ps" in ratio_sentence(
        "horovod", "ps", slower, "img/s", FASTER, SLOWER
    )


def test_a_ratio_whose_interval_holds_one_is_no_resolvable_difference():
    ratio = ratio_interval([100.0, 120.0, 80.0], [100.0, 110.0, 90.0])
    assert ratio.low < 1 < ratio.high
    sentence = ratio_sentence("horovod", "ps", ratio, "img/s", FASTER, SLOWER)
    assert sentence.startswith("No difference in img/s the runs can resolve")


def test_a_difference_of_top1_in_points():
    higher = difference_interval([0.76, 0.761, 0.759], [0.75, 0.751, 0.749])
    assert higher.estimate == pytest.approx(0.01) and higher.low > 0
    assert "1.00 points higher" in difference_sentence("horovod", "ps", higher, "best top-1")
    same = difference_interval([0.75, 0.76, 0.74], [0.755, 0.745, 0.75])
    assert same.low < 0 < same.high
    assert difference_sentence("horovod", "ps", same, "best top-1").startswith("No difference")


def test_a_time_ratio_reads_as_time():
    ratio = ratio_interval([115.0, 116.0, 114.0], [100.0, 101.0, 99.0])
    sentence = ratio_sentence(
        "horovod", "ps", ratio, "total time", "takes {} longer than", "takes {} less time than"
    )
    assert sentence.startswith("horovod takes 15 % longer than ps (95 % CI ")


def test_identical_runs_give_an_exact_ratio():
    assert ratio_interval([2.0, 2.0], [1.0, 1.0]) == Interval(2.0, 2.0, 2.0)


def history(*top1s):
    return [{"epoch": i + 1, "val_top1": t, "epoch_time_s": 10.0} for i, t in enumerate(top1s)]


def test_time_to_target_on_a_history_that_reaches_it():
    assert time_to_target(history(0.5, 0.96, 0.98, 0.99), 0.97) == {
        "epochs_to_target": 3,
        "time_to_target_s": 30.0,
    }


def test_time_to_target_on_a_history_that_does_not():
    assert time_to_target(history(0.5, 0.96), 0.97) == {
        "epochs_to_target": None,
        "time_to_target_s": None,
    }


def test_scaling_efficiency_on_known_numbers():
    # 1 worker: 100 img/s; 4 workers: 300 img/s -> 300 / (4 x 100) = 0.75
    single = scaling_efficiency([300.0], 4, [100.0])
    assert single.estimate == pytest.approx(0.75) and not single.resolved
    # from 2 workers at 180 to 4 at 300: 300 / (2 x 180)
    assert scaling_efficiency([300.0], 4, [180.0], 2).estimate == pytest.approx(300 / 360)
    seeds = scaling_efficiency([290.0, 300.0, 310.0], 4, [98.0, 100.0, 102.0])
    assert seeds.low < seeds.estimate < seeds.high and seeds.estimate == pytest.approx(0.75, 0.01)
