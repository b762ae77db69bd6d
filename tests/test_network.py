"""The network experiment: the cost model's formulas on hand-made numbers,
the bytes a known model implies, the counters' arithmetic, the refusals, the
predictions for the seed, and (as root) a two-bandwidth run of the workflow
on shaped hosts."""

from __future__ import annotations

import json
import subprocess
import sys

import mlflow
import pytest
from conftest import REPO, copy_repo, project_env, run

from distrepro import costmodel, network, predict
from distrepro.config import compose_config
from distrepro.strategies import REGISTRY

RESNET50 = 25_557_032  # conf/model/resnet50.yaml


def test_bytes_per_step_follow_the_formulas_on_hand_made_numbers():
    assert costmodel.ring_bytes(4, 100) == 150  # 2 x 3/4 x 100
    ring = costmodel.expected_bytes("all-reduce", 4, 1, gradients=100, variables=200)
    assert ring == {"worker": {"sent": 150, "received": 150}}
    ps = costmodel.expected_bytes("parameter server", 4, 2, gradients=100, variables=200)
    # a worker reads the 200 bytes twice; two ps links share four workers' traffic
    assert ps == {
        "worker": {"sent": 100, "received": 400},
        "ps": {"sent": 800, "received": 200},
    }


def test_step_times_follow_the_formulas_on_hand_made_numbers():
    one_per_host = costmodel.Setting(
        workers=4, workers_per_host=1, num_ps=1, global_batch=64, compute_s=1.0
    )
    links = costmodel.Links(hosts=150.0, devices=1500.0, worker_ps=500.0, ps=1000.0)
    step = costmodel.step_time
    # ring: 150 bytes over a 150 B/s link, after the compute or beside 2/3 of it
    assert step("all-reduce", 0.0, one_per_host, links, 100, 200) == pytest.approx(2.0)
    assert step("all-reduce", 1.0, one_per_host, links, 100, 200) == pytest.approx(4 / 3)
    one_host = costmodel.Setting(4, 4, 1, 64, 1.0)  # the ring stays on the device links
    assert step("all-reduce", 0.0, one_host, links, 100, 200) == pytest.approx(1.1)
    # parameter server: a worker's own 1 + (400 + 100) / 500 = 2 s against the
    # ps link's 4 x 400 / 1000 = 1.6 s; a slower ps link decides instead
    assert step("parameter server", 0.0, one_per_host, links, 100, 200) == pytest.approx(2.0)
    slow_ps = costmodel.Links(150.0, 1500.0, 500.0, 400.0)
    assert step("parameter server", 0.0, one_per_host, slow_ps, 100, 200) == pytest.approx(4.0)
    # img/s: the global batch over the step
    assert 64 / step("parameter server", 0.0, one_per_host, links, 100, 200) == pytest.approx(32.0)


def test_the_bytes_expected_of_resnet50_in_the_seeds_setting():
    counts = {"parameters": RESNET50, "trainable_parameters": RESNET50}
    horovod = compose_config(["experiment=aws_blog_8gpu", "strategy=horovod"])
    assert network.expected(horovod, counts)["worker"]["sent"] == 2 * 7 / 8 * 4 * RESNET50
    halved = compose_config(["experiment=aws_blog_8gpu", "strategy.fp16_allreduce=true"])
    assert network.expected(halved, counts)["worker"]["sent"] == 2 * 7 / 8 * 2 * RESNET50
    ps = network.expected(
        compose_config(["experiment=aws_blog_8gpu", "strategy=parameter_server"]), counts
    )
    assert ps["worker"] == {"sent": 4 * RESNET50, "received": 2 * 4 * RESNET50}
    assert ps["ps"]["sent"] == 8 * 2 * 4 * RESNET50  # one ps task carries all eight workers'


class Sampled(network.Counters):
    """Counters with hand-made samples, for the arithmetic alone."""

    def __init__(self, samples):
        self.samples = samples


def test_bytes_per_step_come_from_the_counters_over_the_timed_windows():
    # node2 sends 1000 B/s and receives 500 B/s from t=0 to t=100
    samples = [(t, {"node2": [1000 * t, 500 * t]}) for t in range(0, 101, 10)]
    history = [
        {"timed_window": [1.0, 9.0], "images_per_sec": 64.0},  # the first epoch: left out
        {"timed_window": [15.0, 35.0], "images_per_sec": 32.0},  # 20 s: 640 images, 10 steps
        {"timed_window": [40.0, 45.0], "images_per_sec": 128.0},  # 5 s: 640 images, 10 steps
        {"timed_window": [95.0, 120.0], "images_per_sec": 64.0},  # beyond the samples: left out
    ]
    moved = network.bytes_per_step(Sampled(samples), history, global_batch=64)
    assert moved["steps"] == pytest.approx(20)
    assert moved["per_step"]["node2"]["sent"] == pytest.approx(1000 * 25 / 20)
    assert moved["per_step"]["node2"]["received"] == pytest.approx(500 * 25 / 20)


@pytest.mark.parametrize(
    "override, refusal",
    [
        ("network.bandwidth=fast", "'fast' is not a rate in tc's units"),
        ("strategy.hosts='a:1,b:1'", "the network experiment places the processes itself"),
    ],
)
def test_bad_network_settings_are_refused_naming_them(override, refusal):
    cfg = compose_config(["network.bandwidth=10mbit", override])
    if cfg.strategy.hosts is None:
        cfg.strategy.hosts = network.layout(cfg.strategy.num_workers)
    with pytest.raises(network.NetworkError, match=refusal):
        network.validate(cfg)


def test_without_root_the_network_target_refuses_saying_so():
    as_user = ["unshare", "--user", "--map-user=1000"]
    dry = subprocess.run(
        [*as_user, "snakemake", "-n", "network"],
        cwd=REPO,
        env=project_env(REPO),
        capture_output=True,
        text=True,
    )
    assert dry.returncode != 0
    assert "network target" in dry.stdout + dry.stderr and "as root" in dry.stdout + dry.stderr


def test_a_launcher_outside_the_experiments_hosts_refuses_a_bandwidth(tmp_path):
    launched = subprocess.run(
        [sys.executable, "-m", "distrepro.launch", "network.bandwidth=10mbit"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert launched.returncode != 0 and "python -m distrepro.network" in launched.stderr


def test_predict_prints_the_seeds_figures_beside_its_predictions():
    printed = run([sys.executable, "-m", "distrepro.predict", "experiment=aws_blog_8gpu"], REPO)
    predicted = predict.predictions(compose_config(["experiment=aws_blog_8gpu"]))
    for strategy, published in (("parameter_server", 4249), ("horovod", 5058)):
        line = next(line for line in printed.stdout.splitlines() if line.startswith(strategy))
        error = (predicted[strategy] - published) / published
        assert f"{predicted[strategy]:,.0f}" in line and f"{error:+.0%}" in line, line
    assert "NVIDIA DeepLearningExamples" in printed.stdout  # the sources, printed
    elsewhere = [sys.executable, "-m", "distrepro.predict", "experiment=aws_horovod_32gpu"]
    faster = run(
        [*elsewhere, "hardware.link_gbit=100"], REPO
    ).stdout  # no longer the published setting
    assert "19600" in run(elsewhere, REPO).stdout and "19600" not in faster.split("(no")[0]
    # a slower network between 32 GPUs' hosts costs the all-reduce
    cluster = ["experiment=aws_horovod_32gpu"]
    fast = predict.predictions(compose_config(cluster))["horovod"]
    slow = predict.predictions(compose_config([*cluster, "hardware.link_gbit=1"]))["horovod"]
    assert slow < fast / 2


def skip_without_root() -> None:
    refused = network.refusal()
    if refused:
        pytest.skip(refused)


def namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines()}


@pytest.mark.slow
def test_two_bandwidths_two_workers_measure_the_links_and_check_the_model(tmp_path):
    skip_without_root()
    before = namespaces()
    repo = copy_repo(tmp_path / "repo")
    config = ["bandwidths=50mbit,1gbit", "workers=2", "seeds=1", "overrides=train.epochs=2"]
    run(["snakemake", "--cores", "all", "network", "--config", *config], repo, timeout=1800)
    assert namespaces() == before
    (report_dir,) = repo.glob("results/network/*/report")
    report = (report_dir / "report.md").read_text()
    assert "## Where the strategies cross" in report and "| communication |" in report
    records = [json.loads(p.read_text()) for p in repo.glob("results/runs/*/network.json")]
    assert len(records) == len(REGISTRY) * 3  # two bandwidths and unshaped
    # shaped links carry steady traffic; an unshaped epoch is over between two
    # samples of the counters (a quarter second), too short to count on
    for record in (r for r in records if r["bandwidth"] != "unshaped"):
        for role, ways in record["expected"].items():
            for way, expected in ways.items():  # headers and framing add, nothing is missing
                assert 0.95 < record["measured"][role][way] / expected < 1.3, (record, role, way)
    runs = [json.loads(p.read_text()) for p in repo.glob("results/runs/*/metrics.json")]
    for strategy in REGISTRY:
        rate = {
            json.loads((repo / "results/runs" / r["run_name"] / "network.json").read_text())[
                "bandwidth"
            ]: r["images_per_sec"]
            for r in runs
            if r["strategy"] == strategy
        }
        assert rate["50mbit"] < rate["1gbit"], (strategy, rate)
    for r in runs:  # two epochs train, on every link
        assert r["history"][1]["train_loss"] < r["history"][0]["train_loss"], r["run_name"]
    store = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    (experiment,) = [e for e in store.search_experiments() if e.name == "distrepro"]
    (parent,) = [
        r for r in store.search_runs([experiment.experiment_id]) if "network" in r.data.tags
    ]
    settings = store.search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    trained = [
        child
        for setting in settings
        for child in store.search_runs(
            [experiment.experiment_id], f"tags.mlflow.parentRunId = '{setting.info.run_id}'"
        )
    ]
    assert sorted(r.data.params["network.bandwidth"] for r in trained) == sorted(
        ["50mbit", "1gbit", "unshaped"] * len(REGISTRY)
    )
    assert all("measured_worker_sent_mb_per_step" in r.data.metrics for r in trained)


def test_the_report_orders_rates_and_finds_where_two_strategies_cross():
    from distrepro import network_report

    def run(strategy, bandwidth, rate):
        link = {"unshaped": 1e9, "10mbit": 1.2e6, "1000mbit": 1.2e8}[bandwidth]
        return {
            "strategy": strategy,
            "num_workers": 2,
            "num_ps": 1,
            "global_batch_size": 64,
            "parameters": 1000,
            "trainable_parameters": 1000,
            "fp16_allreduce": False,
            "rate": rate,
            "network": {"bandwidth": bandwidth, "link_bytes_per_s": link},
        }

    runs = [  # Horovod twice the parameter server's rate at 10 Mbit/s, half at 1000
        run("horovod", "1000mbit", 300.0),
        run("horovod", "10mbit", 200.0),
        run("horovod", "unshaped", 320.0) | {"gradients_ready_within_s": 0.0},  # no overlap
        run("parameter_server", "1000mbit", 600.0),
        run("parameter_server", "10mbit", 100.0),
    ]
    rows = network_report.curves(network_report.settings(runs))
    assert [(r["strategy"], r["bandwidth"]) for r in rows] == [
        ("horovod", "10mbit"),
        ("horovod", "1000mbit"),
        ("parameter_server", "10mbit"),
        ("parameter_server", "1000mbit"),
    ]
    # the unshaped 0.2 s a step, then the ring's 4 kB at 1.2 MB/s, none of it overlapped
    assert rows[0]["predicted"] == pytest.approx(64 / (0.2 + 4000 / 1.2e6))
    assert "parameter_server" not in [r["strategy"] for r in rows if "predicted" in r]
    (crossing,) = [
        s for s in network_report.crossings(rows) if s.startswith("horovod and parameter")
    ]
    assert "cross near 100 Mbit/s" in crossing  # halfway between 10 and 1000 on a log scale


def test_settings_the_traced_network_runs_cannot_take_stop_that_target_alone():
    config = ["--config", "seeds=1", "overrides=train.epochs=1 train.steps_per_epoch=12"]
    scaling = subprocess.run(
        ["snakemake", "-n", "scaling", *config[:-1], "workers=1,2", config[-1]],
        cwd=REPO,
        env=project_env(REPO),
        capture_output=True,
        text=True,
    )
    assert scaling.returncode == 0, scaling.stderr
    refused = subprocess.run(
        ["snakemake", "-n", "network", *config],
        cwd=REPO,
        env=project_env(REPO),
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    assert "train.profile_steps=[10, 15]" in refused.stdout + refused.stderr
