"""The network experiment: the cost model's formulas on hand-made numbers,
the bytes a known model implies, the counters' arithmetic, the refusals, the
predictions for the seed, and (as root) a two-bandwidth run of the workflow
on shaped hosts."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import mlflow
import psutil
import pytest
import yaml
from conftest import (
    HOSTS_REGISTRY,
    HOSTS_SH,
    REPO,
    SHALLOW,
    assert_no_hosts_left_behind,
    copy_repo,
    netns_names,
    project_env,
    run,
    stale_hosts_kept,
)
from omegaconf import DictConfig
from PIL import Image

from distrepro import costmodel, network, predict
from distrepro.config import compose_config, load
from distrepro.strategies import REGISTRY

RESNET50 = 25_557_032  # conf/model/resnet50.yaml


def test_bytes_per_step_follow_the_formulas_on_hand_made_numbers():
    four = costmodel.Setting(workers=4, workers_per_host=1, global_batch=64, compute_s=1.0)
    assert costmodel.ring_bytes(4, 100) == 150  # 2 x 3/4 x 100
    ring = costmodel.expected_bytes("all-reduce", four, gradients=100, variables=200)
    assert ring == {"worker": {"sent": 150, "received": 150}}
    # a worker reads the 200 bytes once; a separate ps host carries all four workers'
    separate = costmodel.expected_bytes("parameter server", four, gradients=100, variables=200)
    assert separate == {
        "worker": {"sent": 100, "received": 200},
        "ps": {"sent": 800, "received": 400},
    }
    # colocated, a quarter of the model beside each worker: each host's worker reads
    # 3/4 of it over the link and its ps serves its quarter to the three others
    even = dataclasses.replace(four, ps_shares=(0.25,) * 4)
    colocated = costmodel.expected_bytes("parameter server", even, gradients=100, variables=200)
    assert colocated == {"worker": {"sent": 75 + 150, "received": 150 + 75}}
    # with R = 1 and variables = gradients, as many bytes each way as the ring's
    same = costmodel.expected_bytes("parameter server", even, gradients=100, variables=100)
    assert same["worker"] == {"sent": 150, "received": 150}


def test_step_times_follow_the_formulas_on_hand_made_numbers():
    one_per_host = costmodel.Setting(workers=4, workers_per_host=1, global_batch=64, compute_s=1.0)
    links = costmodel.Links(hosts=150.0, devices=1500.0, worker_ps=300.0, ps=1000.0)
    step = costmodel.step_time
    # ring: 150 bytes over a 150 B/s link, after the compute or beside 2/3 of it
    assert step("all-reduce", 0.0, one_per_host, links, 100, 200) == pytest.approx(2.0)
    assert step("all-reduce", 1.0, one_per_host, links, 100, 200) == pytest.approx(4 / 3)
    one_host = costmodel.Setting(4, 4, 64, 1.0)  # the ring stays on the device links
    assert step("all-reduce", 0.0, one_host, links, 100, 200) == pytest.approx(1.1)
    # separate ps: a worker's own 1 + (200 + 100) / 300 = 2 s against the ps
    # link's 4 x 200 / 1000 = 0.8 s; a slower ps link decides instead
    assert step("parameter server", 0.0, one_per_host, links, 100, 200) == pytest.approx(2.0)
    slow_ps = dataclasses.replace(links, ps=200.0)
    assert step("parameter server", 0.0, one_per_host, slow_ps, 100, 200) == pytest.approx(4.0)
    # synchronous: the ps link's 4 x 200 read bytes, then its 4 x 100 gradient
    # bytes, come after one another and after the compute: 1 + 1200 / 1000
    together = dataclasses.replace(one_per_host, synchronous=True)
    assert step("parameter server", 0.0, together, links, 100, 200) == pytest.approx(2.2)
    assert step("parameter server", 0.0, together, slow_ps, 100, 200) == pytest.approx(7.0)
    # colocated and even: each host link carries 225 B each way at 150 B/s = 1.5 s,
    # its worker 1 + 225 / 150 = 2.5 s on its own path
    even = dataclasses.replace(one_per_host, ps_shares=(0.25,) * 4)
    assert step("parameter server", 0.0, even, links, 100, 200) == pytest.approx(2.5)
    # uneven shares: a worker whose host holds none of the model reads and sends
    # all of it over its link, 1 + 300 / 150 = 3 s (its peers' links carry 350 B)
    uneven = dataclasses.replace(one_per_host, ps_shares=(0.5, 0.5, 0.0, 0.0))
    assert step("parameter server", 0.0, uneven, links, 100, 200) == pytest.approx(3.0)
    # img/s: the global batch over the step
    assert 64 / step("parameter server", 0.0, one_per_host, links, 100, 200) == pytest.approx(32.0)


def test_the_hosts_cpus_bound_a_step_on_hand_made_numbers():
    links = costmodel.Links(hosts=150.0, devices=1500.0, worker_ps=300.0, ps=1000.0)
    one_host = costmodel.Setting(workers=4, workers_per_host=4, global_batch=64, compute_s=1.0)
    cpu = costmodel.HostCPU(vcpus=8, decode_s=0.25, ps_apply_s=0.01, ps_serve_s=0.005)
    step = costmodel.step_time
    # CPU-bound: 64 images x 0.25 = 16 core-s over 8 vCPUs = 2 s, over the
    # ring's 1.1 s; the ps tasks on the same host add 4 x (100 x 0.01 +
    # 200 x 0.005) = 8 core-s: 3 s
    assert costmodel.cpu_time("all-reduce", one_host, cpu, 100, 200) == pytest.approx(2.0)
    assert step("all-reduce", 0.0, one_host, links, 100, 200, cpu) == pytest.approx(2.0)
    assert step("parameter server", 0.0, one_host, links, 100, 200, cpu) == pytest.approx(3.0)
    # link-bound: no decoding (synthetic data) and cheap ps work leave the links'
    # figures as they were
    idle = costmodel.HostCPU(vcpus=8, decode_s=0.0, ps_apply_s=0.001, ps_serve_s=0.001)
    one_per_host = dataclasses.replace(one_host, workers_per_host=1)
    for exchange, seconds in (("all-reduce", 2.0), ("parameter server", 2.0)):
        assert step(exchange, 0.0, one_per_host, links, 100, 200, idle) == pytest.approx(seconds)
    # a separate ps host of its own carries the ps work alone: 8 core-s / 8
    # against each worker host's 16 images x 0.25 / 8 = 0.5 s
    cpu_time = costmodel.cpu_time("parameter server", one_per_host, cpu, 100, 200)
    assert cpu_time == pytest.approx(1.0)
    # colocated, the host with half the model does half the ps work beside its decoding
    halves = dataclasses.replace(one_per_host, ps_shares=(0.5, 0.5, 0.0, 0.0))
    assert costmodel.cpu_time("parameter server", halves, cpu, 100, 200) == pytest.approx(1.0)


def test_a_straggler_slows_a_synchronous_step_and_one_asynchronous_worker():
    rate = costmodel.straggler_rate
    assert rate("all-reduce", 100.0, 2, 4.0) == pytest.approx(
        25.0
    )  # compute-bound: the straggler's pace
    assert rate("all-reduce", 100.0, 2, 4.0, exchange_share=0.5) == pytest.approx(40.0)
    assert rate("parameter server", 100.0, 2, 4.0) == pytest.approx(62.5)  # 50 + 12.5
    assert rate("parameter server", 100.0, 4, 1.0) == pytest.approx(100.0)


def test_the_bytes_expected_of_resnet50_in_the_seeds_setting():
    counts = {"parameters": RESNET50, "trainable_parameters": RESNET50}
    horovod = compose_config(["experiment=aws_blog_8gpu", "strategy=horovod"])
    assert network.expected(horovod, counts)["worker"]["sent"] == 2 * 7 / 8 * 4 * RESNET50
    halved = compose_config(["experiment=aws_blog_8gpu", "strategy.fp16_allreduce=true"])
    assert network.expected(halved, counts)["worker"]["sent"] == 2 * 7 / 8 * 2 * RESNET50
    ps = network.expected(
        compose_config(["experiment=aws_blog_8gpu", "strategy=parameter_server"]), counts
    )
    assert ps["worker"] == {"sent": 4 * RESNET50, "received": 4 * RESNET50}
    assert ps["ps"]["sent"] == 8 * 4 * RESNET50  # one ps host carries all eight workers'


def test_each_strategy_takes_the_keys_of_the_grid_it_has():
    grid = "strategy.ps_placement=separate,colocated strategy.fp16_allreduce=false,true"
    assert network.variants("parameter_server", grid) == [
        ["strategy.ps_placement=separate"],
        ["strategy.ps_placement=colocated"],
    ]
    assert network.variants("horovod", grid) == [
        ["strategy.fp16_allreduce=False"],
        ["strategy.fp16_allreduce=True"],
    ]
    packed = f"{grid} strategy.bytes_per_pack=0,1"
    assert len(network.variants("multi_worker_mirrored", packed)) == 4


def test_the_winners_are_the_fastest_setting_at_the_grids_rates():
    from distrepro import network_report

    def run(bandwidth, rate, variant=()):
        return {
            "strategy": "parameter_server",
            "num_workers": 2,
            "network": {"bandwidth": bandwidth},
            "variant": variant,
            "rate": rate,
        }

    colocated = ("strategy.ps_placement=colocated",)
    runs = [
        run("10mbit", 20.0),
        run("10mbit", 22.0),  # library defaults: two seeds, mean 21
        run("10mbit", 45.0, colocated),
        run("100mbit", 300.0),  # not a grid rate: the lowest shaped one is
        run("unshaped", 600.0),
        run("unshaped", 550.0, colocated),
    ]
    assert network_report.winners(runs) == {
        "parameter_server/2/shaped": list(colocated),
        "parameter_server/2/unshaped": [],
    }


def test_a_run_counted_before_the_payload_is_refused_by_the_report_naming_it(tmp_path):
    from distrepro import network_report

    (tmp_path / "metrics.json").write_text("{}")
    (tmp_path / "network.json").write_text(json.dumps({"measured": {}, "expected": {}}))
    with pytest.raises(SystemExit, match=f"{tmp_path}/network.json predates the TCP payload"):
        network_report.load(tmp_path)


class Sampled(network.Counters):
    """Counters with hand-made samples, for the arithmetic alone."""

    def __init__(self, samples):
        self.samples = samples


def test_bytes_per_step_come_from_the_counters_over_the_timed_windows():
    # node2 sends 1000 B/s in 2 packets and receives 500 B/s in 1 from t=0 to t=100
    samples = [(t, {"node2": [1000 * t, 500 * t, 2 * t, t]}) for t in range(0, 101, 10)]
    history = [
        {"timed_window": [1.0, 9.0], "images_per_sec": 64.0},  # the first epoch: left out
        {"timed_window": [15.0, 35.0], "images_per_sec": 32.0},  # 20 s: 640 images, 10 steps
        {"timed_window": [40.0, 45.0], "images_per_sec": 128.0},  # 5 s: 640 images, 10 steps
        {"timed_window": [95.0, 120.0], "images_per_sec": 64.0},  # beyond the samples: left out
    ]
    moved = network.bytes_per_step(Sampled(samples), history, global_batch=64)
    assert moved["steps"] == pytest.approx(20)
    assert moved["wire_per_step"]["node2"]["sent"] == pytest.approx(1000 * 25 / 20)
    assert moved["wire_per_step"]["node2"]["received"] == pytest.approx(500 * 25 / 20)
    headers = network.HEADER_BYTES  # the payload: each packet's headers left out
    assert moved["per_step"]["node2"]["sent"] == pytest.approx((1000 - 2 * headers) * 25 / 20)
    assert moved["per_step"]["node2"]["received"] == pytest.approx((500 - headers) * 25 / 20)


@pytest.mark.parametrize(
    "override, refusal",
    [
        ("network.bandwidth=fast", "'fast' is not a rate in tc's units"),
        ("strategy.hosts='a:1,b:1'", "the network experiment places the processes itself"),
        ("network.slowdown=0.5", "network.slowdown=0.5 must be at least 1"),
    ],
)
def test_bad_network_settings_are_refused_naming_them(override, refusal):
    cfg = compose_config(["network.bandwidth=10mbit", override])
    if cfg.strategy.hosts is None:
        cfg.strategy.hosts = network.layout(cfg.strategy.num_workers)
    with pytest.raises(network.NetworkError, match=refusal):
        network.validate(cfg)


@pytest.mark.parametrize(
    "overrides, refusal",
    [
        (["network.kill_interval_s=0"], "network.kill_interval_s=0.0 must be above 0"),
        (["network.kill_interval_s=30", "network.max_kills=4"], "at most train.max_restarts=3"),
        (["network.kill_interval_s=30", "strategy.num_workers=1"], "never hit the chief's"),
    ],
)
def test_bad_kill_schedules_are_refused_naming_them(overrides, refusal):
    cfg = compose_config(["network.bandwidth=unshaped", *overrides])
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


@pytest.mark.parametrize("override", ["network.bandwidth=10mbit", "network.slowdown=4"])
def test_a_launcher_outside_the_experiments_hosts_refuses_their_conditions(override):
    launched = subprocess.run(
        [sys.executable, "-m", "distrepro.launch", override],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert launched.returncode != 0 and "python -m distrepro.network" in launched.stderr
    assert override in launched.stderr


def test_predict_prints_the_seeds_figures_beside_its_predictions():
    printed = run([sys.executable, "-m", "distrepro.predict", "experiment=aws_blog_8gpu"], REPO)
    seed = compose_config(["experiment=aws_blog_8gpu"])
    predicted = predict.predictions(seed, synchronous=True)  # as the seed's blog ran it
    assert predicted["parameter_server"] < predict.predictions(seed)["parameter_server"]
    assert "(synchronous)" in printed.stdout
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


def test_predict_all_prints_every_published_figure_with_its_error():
    printed = run([sys.executable, "-m", "distrepro.predict", "--all"], REPO).stdout
    families = yaml.safe_load((REPO / "conf" / "published.yaml").read_text())["families"]
    rows = predict.checks()
    assert len(rows) == sum(len(f["runs"]) + ("input" in f) for f in families)
    for r in rows:
        shown = f"predicted {r['predicted']:>9,.0f}  published {r['published']:>9,.0f}"
        assert f"{shown}  {r['error']:+5.0%}" in printed, r
    assert printed.count("input, not a check") == sum("input" in f for f in families)
    assert predict.summary(rows) in printed
    assert "with today's compute input (893.09 img/s a V100)" in printed


def skip_without_root() -> None:
    refused = network.refusal()
    if refused:
        pytest.skip(refused)


def test_a_killed_network_run_leaves_hosts_that_the_next_removes_and_no_live_ones(tmp_path):
    """kill -9 of `python -m distrepro.network` leaves its hosts (namespaces,
    sshd); `hosts.sh down --stale`, which each network run starts with,
    removes them, and leaves the hosts of a live owner (this session's) alone."""
    skip_without_root()
    live = tmp_path / "live"
    subprocess.run([HOSTS_SH, "up", live], check=True)
    killed = subprocess.Popen(
        [sys.executable, "-m", "distrepro.network", "network.bandwidth=unshaped"],
        cwd=tmp_path,
        env=project_env(REPO),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert "hosts up" in killed.stdout.readline()
        (left,) = [
            link.resolve()
            for link in HOSTS_REGISTRY.iterdir()
            if link.is_symlink() and (link / "owner").read_text().split()[0] == str(killed.pid)
        ]
        names = (left / "namespaces").read_text().split()
        with stale_hosts_kept():
            killed.kill()
            killed.wait()
            assert set(names) <= set(netns_names())
        subprocess.run([HOSTS_SH, "down", "--stale"], check=True)
        assert not set(names) & set(netns_names())
        assert set((live / "namespaces").read_text().split()) <= set(netns_names())
        assert psutil.pid_exists(int((live / "sshd-node1.pid").read_text()))
    finally:
        killed.kill()
        killed.wait()
        subprocess.run([HOSTS_SH, "down", "--stale"], check=True)  # the killed run's, if left
        subprocess.run([HOSTS_SH, "down", live], check=True)


# Each strategy at its library's defaults and one setting of its own, with a different layout
# (the parameter server's ps tasks beside the workers, sharded) or fp16 gradients.
GRID = "strategy.ps_placement=colocated strategy.partitioner=fixed strategy.fp16_allreduce=true"

# Each module fixture's tests in one process of the suite (a pytest-xdist group): its runs, once.
NETWORK_GRID = pytest.mark.xdist_group("network_grid")
CONDITIONS = pytest.mark.xdist_group("conditions")


@pytest.fixture(scope="module")
def network_grid(tmp_path_factory) -> Path:
    """`snakemake network` with variants=best at one shaped rate, one seed,
    three epochs of the shallow ResNet (two timed: a fast machine's one
    timed epoch of fp16 gradients was 0.9 s, four of the counters' samples):
    each strategy's grid at 50 Mbit/s and unshaped, its winners."""
    skip_without_root()
    repo = copy_repo(tmp_path_factory.mktemp("network") / "repo")
    config = ["bandwidths=50mbit", "workers=2", "seeds=1", "variants=best", f"grid={GRID}"]
    config.append(f"overrides=train.epochs=3 train.log_model=false {SHALLOW}")
    run(["snakemake", "--cores", "all", "network", "--config", *config], repo, timeout=1800)
    assert_no_hosts_left_behind()
    return repo


def network_json(repo: Path, metrics: dict) -> dict:
    return json.loads((repo / "results/runs" / metrics["run_name"] / "network.json").read_text())


def network_records(repo: Path) -> list[tuple[dict, DictConfig]]:
    """Each run's network.json and its config."""
    return [
        (json.loads(path.read_text()), load(path.parent / "config.yaml"))
        for path in repo.glob("results/runs/*/network.json")
    ]


@pytest.mark.slow
@NETWORK_GRID
def test_each_strategys_settings_measure_their_links_and_the_winners_are_named(network_grid):
    repo = network_grid
    records = network_records(repo)
    # the library's defaults and one setting, at 50mbit and unshaped
    assert len(records) == 2 * 2 * len(REGISTRY)
    # shaped links carry steady traffic; an unshaped epoch is over between two
    # samples of the counters (a quarter second), too short to count on
    for record, cfg in records:
        if record["bandwidth"] == "unshaped":
            continue
        for role, ways in record["expected"].items():
            # The libraries' framing adds, nothing is missing, within what the
            # counters resolve: the edges of each timed window (two, of 1 to 2 s
            # each) fall between two samples a quarter second apart, a step's burst
            # counted in or out (0.944 once, the suite's other processes loading the
            # machine; 0.56 once in a single window of 0.9 s).
            for way, expected in ways.items():
                measured = record["measured"][role][way]  # the TCP payload
                assert 0.9 < measured / expected < 1.3, (cfg.strategy, role, way, record)
        # each variable read once per update (twice would be over 2): beside
        # a colocated ps the framing of the gradients it takes in counts as
        # reads (1.25 at 10 Mbit/s with every variable in two, 1.12 of the model)
        if record["exchange"] == "parameter server":
            assert 0.9 < record["reads_per_update"] < 1.5, (cfg.strategy, record)
    shaped = {
        (cfg.strategy.name.value, cfg.strategy.fp16_allreduce, cfg.strategy.ps_placement): record
        for record, cfg in records
        if record["bandwidth"] == "50mbit"
    }
    for strategy in ("horovod", "multi_worker_mirrored"):  # fp16 gradients: half the bytes
        halved = shaped[(strategy, True, "separate")]["measured"]["worker"]["sent"]
        full = shaped[(strategy, False, "separate")]["measured"]["worker"]["sent"]
        assert 0.45 < halved / full < 0.6, (strategy, halved, full)
    # the colocated, sharded ps: every worker's host link carries the same
    # bytes each way, the separate ps host's link all workers' reads
    colocated = shaped[("parameter_server", False, "colocated")]
    assert set(colocated["expected"]) == {"worker"}
    assert "ps" in shaped[("parameter_server", False, "separate")]["expected"]
    runs = [json.loads(p.read_text()) for p in repo.glob("results/runs/*/metrics.json")]
    for r in runs:  # a shaped link measures its rate and carries no more
        record = network_json(repo, r)
        if record["bandwidth"] == "50mbit":
            assert 0.9 < record["link_bytes_per_s"] / (50e6 / 8) < 1.0, record
            steps_per_s = r["images_per_sec"] / r["global_batch_size"]
            sent = record["measured_wire"]["worker"]["sent"] * steps_per_s
            assert sent < 1.02 * record["link_bytes_per_s"], (r["run_name"], record)
    for r in runs:  # the epochs train, on every link
        assert r["history"][1]["train_loss"] < r["history"][0]["train_loss"], r["run_name"]
    ps = [r for r in runs if "ps_shares" in r]
    assert {len(r["ps_shares"]) for r in ps} == {1, 2} and all(
        sum(r["ps_shares"].values()) == pytest.approx(1) for r in ps
    )


@pytest.mark.slow
@NETWORK_GRID
def test_the_network_report_names_the_winners_and_compares_best_against_best(network_grid):
    repo = network_grid
    (report_dir,) = repo.glob("results/network/*/report")
    report = (report_dir / "report.md").read_text()
    (best_file,) = repo.glob("results/network/*/best.json")
    best = json.loads(best_file.read_text())
    assert sorted(best) == sorted(
        f"{s}/2/{kind}" for s in REGISTRY for kind in ("shaped", "unshaped")
    )
    winners = [line for line in report.splitlines() if line.endswith("| winner |")]
    assert len(winners) == 2 * len(REGISTRY), winners  # one each at 50mbit and unshaped
    for key, overrides in best.items():
        strategy, _, kind = key.split("/")
        setting = ", ".join(o.removeprefix("strategy.") for o in overrides) or "library defaults"
        rate = "50mbit" if kind == "shaped" else "unshaped"
        assert f"| {strategy} | 2 | {rate} | {setting} |" in report, (key, report)
    assert "## Best against best" in report and "best against best" in report
    assert "## Where the strategies cross, library defaults" in report
    assert "## Where the strategies cross, at its best" in report
    assert "| regime | communicating |" in report  # by the model, each setting's bound
    with Image.open(report_dir / "throughput.png") as image:
        image.load()
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
        ["50mbit", "unshaped"] * 2 * len(REGISTRY)
    )
    assert all("measured_worker_sent_mb_per_step" in r.data.metrics for r in trained)


@pytest.fixture(scope="module")
def conditions(tmp_path_factory) -> Path:
    """`snakemake stragglers churn` in one invocation: every run's last worker
    at slowdown 4, so that the stragglers target's runs are the churn target's
    runs without kills (one run each, trained once), and the kills, one at
    most, hit the straggler's host. One seed, five epochs of the shallow
    ResNet: six trainings for both targets. A quarter of a core binds its
    host's processes beside the suite's other processes' work, which a milder
    slowdown's share need not (its host may get less than that anyway)."""
    skip_without_root()
    repo = copy_repo(tmp_path_factory.mktemp("conditions") / "repo")
    config = ["slowdowns=4", "kill_intervals=5", "workers=2", "seeds=1"]
    overrides = "train.epochs=5 train.log_model=false network.slowdown=4 network.max_kills=1"
    config.append(f"overrides={overrides} {SHALLOW}")
    targets = ["stragglers", "churn"]
    run(["snakemake", "--cores", "all", *targets, "--config", *config], repo, 1800)
    assert_no_hosts_left_behind()
    return repo


def condition_records(repo: Path) -> list[tuple[dict, dict]]:
    """The conditions targets' runs: each network.json and metrics.json."""
    return [
        (json.loads(path.read_text()), json.loads((path.parent / "metrics.json").read_text()))
        for path in repo.glob("results/runs/*/network.json")
    ]


# Where each strategy's processes ran, as its MLflow params say: a worker on
# each worker's host; across machines by default a ps task beside each worker,
# the parameter server's coordinator on the head.
PLACED = {
    "parameter_server": {
        "hosts": "worker:0 on node2; worker:1 on node3; ps:0 on node2; ps:1 on node3; "
        "coordinator on node1"
    },
    "horovod": {"devices": "rank 0 on node2: cpu; rank 1 on node3: cpu"},
    "multi_worker_mirrored": {
        "devices": "worker 0 on node2: cpu; worker 1 on node3: cpu",
        "communication": "RING",
    },
}


@pytest.mark.slow
@CONDITIONS
def test_a_straggler_is_held_to_its_quota_and_the_report_compares_the_strategies(conditions):
    repo = conditions
    records = [(r, m) for r, m in condition_records(repo) if r["kill_interval_s"] is None]
    assert sorted((m["strategy"], r["slowdown"]) for r, m in records) == sorted(
        (s, 4) for s in REGISTRY
    )
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    for record, metrics in records:
        cores = {host: cpu["cores"] for host, cpu in record["cpu"].items()}
        assert cores == {"node2": 1.0, "node3": pytest.approx(1 / 4)}, record["cpu"]
        assert record["cpu"]["node3"]["throttled_s"] > 0.5, (metrics["strategy"], record)
        # trained across the hosts it was given, far above chance (0.1)
        params = client.get_run(metrics["mlflow_run_id"]).data.params
        placed = PLACED[metrics["strategy"]]
        assert {key: params[key] for key in placed} == placed
        assert metrics["top1"] >= 0.85, (metrics["strategy"], metrics["history"])
        if metrics["strategy"] == "parameter_server":
            later = metrics["history"][1:]  # the first epoch's counts are the start-up's
            fast, slow = (sum(h["updates_by_worker"][i] for h in later) for i in (0, 1))
            assert slow < fast, metrics["history"]  # asynchronous: it makes fewer updates
    (report_dir,) = repo.glob("results/stragglers/*/report")
    report = (report_dir / "report.md").read_text()
    assert "## At slowdown 4x" in report
    for strategy in REGISTRY:
        assert report.count(f"| {strategy} (b64, 2 workers) | 1 |") == 1, report
    assert report.count("horovod (b64, 2 workers) against parameter_server (b64, 2") == 1
    with Image.open(report_dir / "throughput.png") as image:
        image.load()


@pytest.mark.slow
@CONDITIONS
def test_each_strategy_recovers_from_a_killed_worker_and_the_report_counts_the_cost(conditions):
    repo = conditions
    records = condition_records(repo)
    churned = [(r, m) for r, m in records if r["kill_interval_s"] == 5]
    calm = [(r, m) for r, m in records if r["kill_interval_s"] is None]
    assert sorted(m["strategy"] for _, m in churned) == sorted(REGISTRY)
    assert sorted(m["strategy"] for _, m in calm) == sorted(REGISTRY)
    client = mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    causes = {  # each strategy's own recovery, in its words
        "parameter_server": "task worker:1 (pid",
        "horovod": "horovodrun exited with",
        "multi_worker_mirrored": "worker 1 (pid",
    }
    for record, metrics in churned:
        (kill,) = record["kills"]  # at most one
        assert kill["host"] == "node3" and all("distrepro" in p for p in kill["processes"])
        assert not any(" task ps " in p for p in kill["processes"])  # ps:1 is on node3 too
        (recovery,) = record["recoveries"]
        assert causes[metrics["strategy"]] in recovery, (metrics["strategy"], record)
        mlflow_run = client.get_run(metrics["mlflow_run_id"])
        assert mlflow_run.data.metrics["restarts"] == 1
        assert mlflow_run.data.tags["restart.1"] == recovery
        assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4, 5]
        assert metrics["top1"] > 0.5, metrics["history"]  # chance is 0.1
    for record, _ in calm:
        assert record["kills"] == [] and record["recoveries"] == []
    (report_dir,) = repo.glob("results/churn/*/report")
    report = (report_dir / "report.md").read_text()
    assert "## Without kills" in report and "## With a kill every 5 s on average" in report
    rows = json.loads((report_dir / "conditions.json").read_text())["rows"]
    killed = [r for r in rows if r["condition"] == 5]
    assert len(killed) == len(REGISTRY) and all("lost_per_kill_s" in r for r in killed)
    # the model's figure beside each, from the runs without kills (the
    # stragglers' model has no runs without a straggler here: its unit test)
    assert all(r["predicted_lost_per_kill_s"] > 0 for r in killed)


def hand_made_run(folder: Path, strategy: str, seed: int, rate: float, reach: int | None, **record):
    """A run's metrics.json and network.json: 3 epochs of 10 s x 100/rate after a
    5 s start, the target reached at epoch `reach` (None: never), wall time 40 s
    unless record says."""
    folder.mkdir()
    epoch_s = 1000 / rate
    history = [
        {
            "epoch": e,
            "epoch_time_s": epoch_s,
            "val_top1": 0.95 if reach and e >= reach else 0.5,
            "timed_window": [5.0 + (e - 1) * epoch_s, 5.0 + e * epoch_s],
        }
        | ({"updates_by_worker": record["by_worker"]} if "by_worker" in record else {})
        for e in (1, 2, 3)
    ]
    metrics = {
        "strategy": strategy,
        "setting": f"digits-{strategy}-{folder.name[:-2]}",
        "seed": seed,
        "dataset": "digits",
        "model": "small_resnet",
        "precision": "fp32",
        "global_batch_size": 64,
        "num_workers": 2,
        "epochs": 3,
        "images_per_sec": rate,
        "total_time_s": 3 * epoch_s,
        "best_top1": 0.95 + seed / 100,
        "target_top1": 0.9,
        "history": history,
    }
    network_record = {"launched_at": 0.0, "wall_s": 40.0, "kills": []} | record
    (folder / "metrics.json").write_text(json.dumps(metrics))
    (folder / "network.json").write_text(json.dumps(network_record))
    return str(folder)


def test_the_stragglers_report_ranks_time_to_target_beside_the_model(tmp_path):
    """Hand-made runs at slowdowns 1 and 4: the parameter server's straggler
    makes a fifth of its updates, Horovod waits for its straggler."""
    from distrepro import conditions_report

    def run(strategy, slowdown, seed, rate, reach, by_worker=None):
        more = {"by_worker": by_worker} if by_worker else {}
        name = f"{strategy}-{slowdown}-{seed}"
        return hand_made_run(
            tmp_path / name, strategy, seed, rate, reach, slowdown=slowdown, **more
        )

    runs = [
        run("parameter_server", 1, 0, 100.0, 2, [10, 10]),
        run("parameter_server", 1, 1, 102.0, 2, [10, 10]),
        run("parameter_server", 4, 0, 61.0, 2, [16, 4]),
        run("parameter_server", 4, 1, 63.0, 2, [16, 4]),
        run("horovod", 1, 0, 120.0, 2),
        run("horovod", 1, 1, 118.0, 2),
        run("horovod", 4, 0, 31.0, 3),
        run("horovod", 4, 1, 29.0, None),  # this seed did not reach the target
    ]
    out = tmp_path / "report"
    conditions_report.main(["slowdown", str(out), *runs])
    rows = json.loads((out / "conditions.json").read_text())["rows"]
    at = {(r["strategy"], r["condition"]): r for r in rows}
    assert at["horovod", 4.0]["predicted_images_per_sec"] == pytest.approx(119.0 / 4)
    assert at["parameter_server", 4.0]["predicted_images_per_sec"] == pytest.approx(101.0 * 5 / 8)
    # the straggler's own pace: 4 updates in each epoch of 1000/61 and 1000/63 s
    assert at["parameter_server", 4.0]["straggler_updates_per_s"] == pytest.approx(
        (4 * 61 / 1000 + 4 * 63 / 1000) / 2
    )
    assert at["horovod", 4.0]["straggler_updates_per_s"] == pytest.approx(30.0 / 64)
    # from the launch: 5 s, then two epochs of 1000/119.. s
    assert at["horovod", 1.0]["time_to_target_s"] == pytest.approx(
        5 + (2000 / 120 + 2000 / 118) / 2
    )
    text = (out / "report.md").read_text()
    assert "## At slowdown 1x" in text and "## At slowdown 4x" in text
    assert "horovod reached top-1 90% first at slowdown 1x" in text
    # Horovod's unreached seed leaves it unranked at 4x
    assert "parameter_server reached top-1 90% first at slowdown 4x" in text
    assert "The parameter server reaches top-1 90% first at slowdown 4x." in text
    assert "1 of 2 reached" in text and "29.8 (+1%)" in text  # Horovod at 4x: 30 against 29.75
    with Image.open(out / "throughput.png") as image:
        image.load()


def test_the_churn_report_counts_what_each_kill_cost_beside_the_model(tmp_path):
    """Hand-made runs without kills and with a kill every 30 s: Horovod
    restarts from its checkpoint, the parameter server's worker rejoins."""
    from distrepro import conditions_report

    def run(strategy, seed, wall_s, kills, interval=None):
        name = f"{strategy}-{interval}-{seed}"
        kill = {"at_s": 12.0, "host": "node3", "pids": [1], "processes": ["python -m distrepro"]}
        record = {"kill_interval_s": interval, "wall_s": wall_s, "kills": [kill] * kills}
        return hand_made_run(tmp_path / name, strategy, seed, 100.0, 3, **record)

    runs = [
        run("parameter_server", 0, 40.0, 0),
        run("parameter_server", 1, 42.0, 0),
        run("parameter_server", 0, 45.0, 2, 30),
        run("parameter_server", 1, 47.0, 2, 30),
        run("horovod", 0, 40.0, 0),
        run("horovod", 1, 40.0, 0),
        run("horovod", 0, 70.0, 2, 30),
        run("horovod", 1, 60.0, 1, 30),
    ]
    out = tmp_path / "report"
    conditions_report.main(["kill_interval_s", str(out), *runs])
    rows = json.loads((out / "conditions.json").read_text())["rows"]
    at = {(r["strategy"], r["condition"]): r for r in rows}
    assert at["parameter_server", 30.0]["lost_per_kill_s"] == pytest.approx(2.5)  # (5 + 5) / 2 / 2
    assert at["horovod", 30.0]["lost_per_kill_s"] == pytest.approx((30 / 2 + 20 / 1) / 2)
    assert at["horovod", 30.0]["kills"] == pytest.approx(1.5)
    # start-up 5 s and epochs of 10 s: a restart from a checkpoint 5 + 10/2, a ps worker's 5/2
    assert at["horovod", 30.0]["predicted_lost_per_kill_s"] == pytest.approx(10.0)
    assert at["parameter_server", 30.0]["predicted_lost_per_kill_s"] == pytest.approx(2.5)
    text = (out / "report.md").read_text()
    assert "## Without kills" in text and "## With a kill every 30 s on average" in text
    assert "| 2.0 | 2.5 (model 2.5) |" in text


def test_the_report_orders_rates_and_finds_where_two_strategies_cross():
    from distrepro import network_report

    def run(strategy, bandwidth, rate):
        link = {"unshaped": 1e9, "10mbit": 1.2e6, "1000mbit": 1.2e8}[bandwidth]
        return {
            "strategy": strategy,
            "num_workers": 2,
            "global_batch_size": 64,
            "parameters": 1000,
            "trainable_parameters": 1000,
            "cfg": compose_config([f"strategy={strategy}"]),
            "variant": (),
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
