"""The report on hand-made runs: settings grouped over seeds, intervals,
sentences, time to target, scaling efficiency."""

from __future__ import annotations

import re

from PIL import Image

from distrepro.report import settings, write_report


def made_run(strategy: str, seed: int, rate: float, workers: int = 2, **extra) -> dict:
    history = [
        {"epoch": e, "val_top1": top1, "images_per_sec": rate, "epoch_time_s": 10.0}
        for e, top1 in enumerate((0.5, 0.9, 0.98), 1)
    ]
    return {
        "run_name": f"{strategy}-w{workers}-s{seed}",
        "setting": f"{strategy}-w{workers}-{extra.pop('digest', 'aaaaaaaa')}",
        "strategy": strategy,
        "seed": seed,
        "dataset": "digits",
        "model": "small_resnet",
        "precision": "fp32",
        "global_batch_size": 32 * workers,
        "num_workers": workers,
        "epochs": 3,
        "images_per_sec": rate,
        "total_time_s": 30.0 + seed,
        "top1": 0.98,
        "best_top1": 0.98 - seed / 1000,
        "target_top1": 0.97,
        "epochs_to_target": 3,
        "time_to_target_s": 30.0 + seed,
        "cores": 2,
        "history": history,
        **extra,
    }


def test_three_seeds_each_give_intervals_and_a_sentence_per_figure(tmp_path):
    runs = [made_run("parameter_server", s, r) for s, r in enumerate((500.0, 505.0, 495.0))]
    runs += [made_run("horovod", s, r) for s, r in enumerate((600.0, 606.0, 594.0))]
    write_report(runs, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert re.search(
        r"\| horovod \(b64, 2 workers\) \| 3 \| 600\.0 \(5\d\d\.\d to 6\d\d\.\d\) \|", report
    )
    assert "horovod is 20 % faster than parameter_server (95 % CI" in report
    assert "No difference in total time the runs can resolve" in report
    assert "(single runs)" in report and "4249" in report
    for png in ("throughput.png", "accuracy.png", "time_to_accuracy.png"):
        with Image.open(tmp_path / png) as image:
            image.load()


def test_three_strategies_each_against_the_baseline_and_horovod_against_tensorflow(tmp_path):
    rates = {"parameter_server": 500.0, "horovod": 600.0, "multi_worker_mirrored": 700.0}
    runs = [
        made_run(strategy, seed, rate + seed)
        for strategy, rate in rates.items()
        for seed in range(3)
    ]
    write_report(runs, tmp_path)
    report = (tmp_path / "report.md").read_text()
    for strategy in rates:
        assert f"| {strategy} (b64, 2 workers) | 3 |" in report
    findings = [line for line in report.splitlines() if " against " in line]
    pairs = [tuple(re.findall(r"(\w+) \(b64, 2 workers\)", line)) for line in findings]
    assert pairs == [
        ("horovod", "parameter_server"),
        ("multi_worker_mirrored", "parameter_server"),
        ("horovod", "multi_worker_mirrored"),
    ]
    assert "multi_worker_mirrored is 40 % faster than parameter_server" in report
    assert "horovod is 14 % slower than multi_worker_mirrored" in report
    assert report.startswith("# parameter_server vs horovod vs multi_worker_mirrored")


def test_settings_that_share_a_label_stay_apart():
    runs = [made_run("horovod", 0, 600.0), made_run("horovod", 0, 300.0, digest="bbbbbbbb")]
    assert sorted(settings(runs)) == [
        "horovod (b64, 2 workers) aaaaaaaa",
        "horovod (b64, 2 workers) bbbbbbbb",
    ]


def test_a_target_not_reached_is_said(tmp_path):
    runs = [made_run("parameter_server", s, 500.0 + s) for s in range(2)]
    runs += [made_run("horovod", s, 600.0 + s, time_to_target_s=None) for s in range(2)]
    for run in runs[2:]:
        run["epochs_to_target"] = None
    write_report(runs, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| not reached |" in report
    assert "reached by 0 of 2 horovod runs and 2 of 2 parameter_server runs" in report


def test_scaling_efficiency_table(tmp_path):
    runs = [made_run("horovod", 0, 100.0, workers=1), made_run("horovod", 0, 150.0, workers=2)]
    write_report(runs, tmp_path)
    report = (tmp_path / "report.md").read_text()
    assert "| horovod | 2 | 64 | 150.0 | 200.0 | 0.75 |" in report
    assert "The runs had 2 cores" in report
    with Image.open(tmp_path / "scaling.png") as image:
        image.load()
