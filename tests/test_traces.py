"""Horovod timeline shares on a hand-made timeline."""

from __future__ import annotations

import json

import pytest

from distrepro.traces import covered, exchange_shares, gradients_ready_within_s


def test_union_of_intervals():
    assert covered([(0, 10), (5, 15), (20, 30)]) == 25
    assert covered([]) == 0


def test_shares_of_a_window_with_two_tensors(tmp_path):
    events = [
        {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "grad_a"}},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 0, "pid": 1},
        {"ph": "E", "ts": 20, "pid": 1},
        {"ph": "B", "name": "ALLREDUCE", "ts": 20, "pid": 1},
        {"ph": "B", "name": "GLOO_ALLREDUCE", "ts": 21, "pid": 1},
        {"ph": "E", "ts": 39, "pid": 1},
        {"ph": "E", "ts": 40, "pid": 1},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 10, "pid": 2},
        {"ph": "E", "ts": 30, "pid": 2},
        {"ph": "B", "name": "ALLREDUCE", "ts": 30, "pid": 2},
        {"ph": "E", "ts": 50, "pid": 2},
        {"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": 90, "pid": 1},
        {"ph": "E", "ts": 100, "pid": 1},
    ]
    path = tmp_path / "timeline.json"
    # Horovod leaves the array open when the recording stops
    path.write_text("[\n" + ",\n".join(json.dumps(e) for e in events) + ",")
    shares = exchange_shares(path)
    assert shares["allreduce_share"] == pytest.approx(30 / 100)  # 20-50
    assert shares["negotiate_share"] == pytest.approx((30 + 10) / 100)  # 0-30, 90-100


def test_how_spread_out_a_steps_gradients_become_ready(tmp_path):
    # two tensors a step; the steps' spreads: 5, 30 and 10 us
    ready = [(0, 1), (5, 2), (1000, 2), (1030, 1), (2000, 1), (2010, 2)]
    events = [{"ph": "B", "name": "NEGOTIATE_ALLREDUCE", "ts": t, "pid": p} for t, p in ready]
    path = tmp_path / "timeline.json"
    path.write_text(json.dumps(events))
    assert gradients_ready_within_s(path) == pytest.approx(10e-6)  # the median
