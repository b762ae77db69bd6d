"""Several machines, proven on one: two hosts in network namespaces, each
with its own name, address and sshd (scripts/hosts.sh), Horovod over MPI,
and the parameter server and TensorFlow's all-reduce started by TF_CONFIG,
training across them."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from conftest import (
    HOSTS_SH,
    ON_TWO_HOSTS,
    REPO,
    SESSION_MARK,
    netns_names,
    project_env,
    skip_without_hosts,
    stale_hosts_kept,
)
from omegaconf import OmegaConf
from test_setup import stand_in
from test_training import PYTHON, launch_args

from distrepro import hosts, slurm
from distrepro.config import compose_config
from distrepro.launch import ConfigError, validate_nodes, validate_values

TASK = [PYTHON, "-m", "distrepro.strategies.parameter_server", "task"]


def on(folder: Path, host: str, command: list[str]) -> list[str]:
    """command on host, as its sshd would run it."""
    return [HOSTS_SH, "run", str(folder), host, *command]


def train_on_node1(
    folder: Path, tfrecords: Path, results: Path, *overrides: str, env: dict | None = None
) -> dict:
    """Launch on node1; assert top-1 far above chance; the MLflow run's params."""
    command = on(folder, "node1", launch_args(tfrecords, results, *overrides, "train.epochs=5"))
    subprocess.run(command, check=True, cwd=REPO, timeout=900, env={**os.environ, **(env or {})})
    (run_dir,) = [p for p in results.iterdir() if (p / "metrics.json").exists()]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["top1"] >= 0.85, metrics["history"]  # chance is 0.1
    return mlflow.get_run(metrics["mlflow_run_id"]).data.params


# Horovod over Gloo, the parameter server and TensorFlow's all-reduce by
# strategy.hosts, each on hosts of its own: the conditions runs of test_network.
@ON_TWO_HOSTS
def test_horovod_over_mpi_trains_across_two_hosts(
    two_hosts, digits_tfrecords, tmp_path, mlflow_uri
):
    overrides = ["strategy=horovod", "strategy.controller=mpi"]
    params = train_on_node1(
        two_hosts, digits_tfrecords, tmp_path, *overrides, "strategy.hosts='node1:1,node2:1'"
    )
    assert params["devices"] == "rank 0 on node1: cpu; rank 1 on node2: cpu"


@ON_TWO_HOSTS
def test_the_parameter_server_trains_across_hosts_that_start_their_tasks_by_tf_config(
    two_hosts, digits_tfrecords, tmp_path, mlflow_uri
):
    cluster = {
        "chief": ["node1:2220"],
        "worker": ["node1:2221", "node2:2222"],
        "ps": ["node2:2223"],
    }

    def tf_config(job: str, index: int) -> dict:
        task = {"type": job, "index": index}
        return {"TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}

    tasks = [
        subprocess.Popen(
            on(two_hosts, host, TASK), env={**os.environ, **tf_config(job, index)}, cwd=REPO
        )
        for host, job, index in [("node1", "worker", 0), ("node2", "worker", 1), ("node2", "ps", 0)]
    ]
    try:
        chief = tf_config("chief", 0)
        params = train_on_node1(
            two_hosts, digits_tfrecords, tmp_path, "strategy=parameter_server", env=chief
        )
    finally:
        for task in tasks:
            task.kill()
            task.wait()
    where = "worker:0 on node1; worker:1 on node2; ps:0 on node2; coordinator on node1"
    assert params["hosts"] == where


@ON_TWO_HOSTS
def test_tensorflows_all_reduce_trains_across_hosts_that_each_launch_their_worker(
    two_hosts, digits_tfrecords, tmp_path, mlflow_uri
):
    cluster = {"worker": ["node1:2231", "node2:2232"]}

    def tf_config(index: int) -> dict:
        task = {"type": "worker", "index": index}
        return {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster, "task": task})}

    overrides = ("strategy=multi_worker_mirrored", "train.epochs=5")
    second = subprocess.Popen(
        on(two_hosts, "node2", launch_args(digits_tfrecords, tmp_path, *overrides)),
        env=tf_config(1),
        cwd=REPO,
    )
    try:
        params = train_on_node1(
            two_hosts,
            digits_tfrecords,
            tmp_path,
            "strategy=multi_worker_mirrored",
            env=tf_config(0),
        )
        assert second.wait(120) == 0
    finally:
        second.kill()
    assert params["devices"] == "worker 0 on node1: cpu; worker 1 on node2: cpu"


def test_the_hosts_leave_nothing_behind(tmp_path):
    skip_without_hosts()
    subprocess.run([HOSTS_SH, "up", tmp_path], check=True)
    names = (tmp_path / "namespaces").read_text().split()
    sshd = [int((tmp_path / f"sshd-{host}.pid").read_text()) for host in ("node1", "node2")]
    left = subprocess.Popen(on(tmp_path, "node2", ["sleep", "600"]))
    assert set(names) <= set(netns_names()) and all(psutil.pid_exists(pid) for pid in sshd)
    subprocess.run([HOSTS_SH, "down", tmp_path], check=True)
    assert left.wait(timeout=10) != 0
    psutil.wait_procs([psutil.Process(pid) for pid in sshd if psutil.pid_exists(pid)], timeout=10)
    assert not any(psutil.pid_exists(pid) for pid in sshd)
    assert not set(names) & set(netns_names())
    assert not any(Path("/etc/netns", name).exists() for name in names)


@pytest.mark.parametrize(
    "signum, processes", [(signal.SIGTERM, 0), (signal.SIGKILL, 0), (signal.SIGTERM, 2)]
)
def test_a_stopped_test_session_leaves_no_hosts_behind(tmp_path, signum, processes):
    """pytest stopped with SIGTERM (CI's time limit) tears its fixtures down,
    also in the processes of pytest-xdist that hold them; with SIGKILL, the next
    session's start removes what it left: its hosts, with every daemon on them
    (the SLURM cluster's run there too)."""
    skip_without_hosts()
    held = tmp_path / "held"
    env = {**project_env(REPO), "DISTREPRO_HELD": str(held)}
    env.pop(SESSION_MARK)  # a session of its own
    env.pop("PYTEST_XDIST_WORKER", None)
    session = [PYTHON, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--numprocesses"]
    inner = subprocess.Popen(
        [*session, str(processes), "tests/sessions/hold_the_hosts.py"], cwd=REPO, env=env
    )
    try:
        deadline = time.monotonic() + 180
        while not held.exists():
            assert inner.poll() is None and time.monotonic() < deadline, "no hosts held"
            time.sleep(0.5)
        folder = Path(held.read_text())
        hosts = set((folder / "namespaces").read_text().split())
        daemons = [int(p.read_text()) for p in folder.glob("sshd-*.pid")]
        assert len(daemons) == 2 and all(psutil.pid_exists(pid) for pid in daemons)
        if signum == signal.SIGKILL:
            with stale_hosts_kept():  # left behind, until the next session starts
                inner.kill()
                inner.wait(120)
                assert hosts <= set(netns_names())
        else:
            inner.send_signal(signum)
            inner.wait(120)
    finally:
        inner.kill()
    if signum == signal.SIGKILL:
        next_session = [*session, "0", "--collect-only", "tests/test_stats.py"]
        subprocess.run(next_session, cwd=REPO, env=env)
    assert not hosts & set(netns_names())
    psutil.wait_procs([psutil.Process(p) for p in daemons if psutil.pid_exists(p)], timeout=10)
    assert not [pid for pid in daemons if psutil.pid_exists(pid)]


@pytest.mark.parametrize(
    "listed, named",
    [
        ("node1:1,node2", "'node2' is not HOST:SLOTS"),
        ("node1:x,node2:2", "'node1:x' is not HOST:SLOTS"),
        ("node1:1,node2:2", "has 3 slots for strategy.num_workers=2"),
    ],
)
def test_bad_hosts_are_refused_naming_them(listed, named):
    cfg = compose_config([f"strategy.hosts='{listed}'"])
    with pytest.raises(ConfigError, match=named):
        validate_values(cfg)


@pytest.mark.parametrize(
    "strategy, task, refusal",
    [
        ("parameter_server", {"type": "worker", "index": 0}, "names this process worker:0"),
        ("multi_worker_mirrored", {"type": "ps", "index": 0}, "names ps:0 in a cluster of 1"),
        ("horovod", {"type": "worker", "index": 0}, "horovodrun places the ranks"),
    ],
)
def test_a_launcher_under_another_tasks_tf_config_is_refused(monkeypatch, strategy, task, refusal):
    tf_config = {"cluster": {"worker": ["node2:2222"], "ps": ["node1:2223"]}, "task": task}
    monkeypatch.setenv("TF_CONFIG", json.dumps(tf_config))
    with pytest.raises(ConfigError, match=refusal):
        validate_values(compose_config([f"strategy={strategy}"]))


@pytest.fixture
def slurm_job(tmp_path, monkeypatch) -> dict[str, str]:
    """The environment of a step in SLURM job 7 of the nodes gpu-a, gpu-b and
    gpu-c, as squeue and scontrol (stand-ins) give them."""
    stand_in(tmp_path / "squeue", "gpu-[a-c]")  # `squeue --jobs 7 --format=%N`
    stand_in(tmp_path / "scontrol", "gpu-a\ngpu-b\ngpu-c")  # `scontrol show hostnames ..`
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    slurm.nodes_of_job.cache_clear()
    yield {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-a", "SLURM_NTASKS": "1"}
    slurm.nodes_of_job.cache_clear()


@pytest.mark.parametrize(
    "workers, per_node, listed",
    [
        (8, None, "gpu-a:3,gpu-b:3,gpu-c:2"),  # spread evenly
        (7, None, "gpu-a:3,gpu-b:2,gpu-c:2"),
        (2, None, "gpu-a:1,gpu-b:1"),
        (5, 2, "gpu-a:2,gpu-b:2,gpu-c:1"),
        (4, 4, "gpu-a:4"),
    ],
)
def test_a_slurm_job_of_several_nodes_gives_the_hosts(slurm_job, workers, per_node, listed):
    strategy = OmegaConf.create({"num_workers": workers, "workers_per_node": per_node})
    assert hosts.from_slurm(strategy, slurm_job) == listed
    assert hosts.from_slurm(strategy, {}) is None  # not in a SLURM job


def test_a_slurm_job_too_small_for_workers_per_node_is_refused(slurm_job, monkeypatch):
    for name, value in slurm_job.items():
        monkeypatch.setenv(name, value)
    cfg = compose_config(["strategy=horovod", "strategy.num_workers=4"])
    cfg.strategy.workers_per_node = 1
    with pytest.raises(ConfigError, match="on 4 nodes; this SLURM job has 3: gpu-a,gpu-b,gpu-c"):
        validate_nodes(cfg.strategy)
    cfg.strategy.workers_per_node = 2
    validate_nodes(cfg.strategy)


def test_a_job_step_leaves_the_launchers_step_settings_behind(slurm_job, monkeypatch):
    for name, value in slurm_job.items():
        monkeypatch.setenv(name, value)
    command = slurm.step([("gpu-a", 2), ("gpu-b", 1)], ["python", "rank.py"], "horovod", "pmix")
    assert command[command.index("srun") :] == [
        "srun",
        "--overlap",
        "--job-name=horovod",
        "--nodelist=gpu-a,gpu-b",
        "--nodes=2",
        "--ntasks=3",
        "--ntasks-per-node=2",
        "--kill-on-bad-exit=1",
        "--mpi=pmix",
        "python",
        "rank.py",
    ]
    unset = command[1 : command.index("srun")]
    assert unset == ["--unset=SLURM_JOB_NODELIST", "--unset=SLURM_NTASKS"]  # the job id stays
    assert hosts.command_on("gpu-b", ["python", "task.py"], {}, "worker:1")[-5:] == [
        "--ntasks=1",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "python",
        "task.py",
    ]


def test_workers_per_node_beside_named_hosts_is_refused():
    cfg = compose_config(["strategy=horovod", "strategy.hosts='a:1,b:1'"])
    cfg.strategy.workers_per_node = 1
    with pytest.raises(ConfigError, match="give one of them"):
        validate_values(cfg)


def test_a_host_of_no_slots_carries_the_ps_tasks_and_no_worker(tmp_path):
    """The network experiment's layout: the ps on a host of its own."""
    from distrepro.strategies import horovod, parameter_server

    listed = "strategy.hosts='head:0,a:1,b:1'"
    cfg = compose_config(["strategy=parameter_server", listed, "strategy.ps_placement=separate"])
    validate_values(cfg)
    assert parameter_server.placement(cfg) == {"worker:0": "a", "worker:1": "b", "ps:0": "head"}
    command = horovod.command(compose_config(["strategy=horovod", listed]), tmp_path / "c.yaml")
    assert command[command.index("-H") + 1] == "a:1,b:1"


def test_colocated_ps_tasks_sit_beside_each_workers_host_with_their_share():
    from distrepro.strategies import parameter_server

    listed = "strategy.hosts='head:0,a:1,b:1'"
    cfg = compose_config(["strategy=parameter_server", listed])  # across machines: colocated
    validate_values(cfg)
    assert parameter_server.placement(cfg) == {
        "worker:0": "a",
        "worker:1": "b",
        "ps:0": "a",
        "ps:1": "b",
    }
    assert parameter_server.processes(cfg) == 2 + 2 + 1
    assert parameter_server.host_shares(cfg, {"ps:0": 0.7, "ps:1": 0.3}) == (0.7, 0.3)
    assert parameter_server.host_shares(cfg) == (0.5, 0.5)  # unmeasured: even
    separate = ["strategy=parameter_server", listed, "strategy.ps_placement=separate"]
    separate = compose_config(separate)
    assert parameter_server.host_shares(separate, {"ps:0": 1.0}) == ()


@pytest.mark.parametrize(
    ("where", "across"),
    [
        ([], False),
        (["strategy.hosts='a:2'"], False),
        (["strategy.hosts='head:0,a:1'"], True),
        (["strategy.workers_per_node=1"], True),  # a SLURM job of two nodes
        (["strategy.workers_per_node=2"], False),
    ],
)
def test_a_run_across_machines_defaults_to_the_settings_that_won_there(where, across):
    ps = compose_config(["strategy=parameter_server", *where]).strategy
    assert ps.ps_placement == ("colocated" if across else "separate")
    for name in ("horovod", "multi_worker_mirrored"):
        assert compose_config([f"strategy={name}", *where]).strategy.fp16_allreduce is across


def test_a_setting_the_user_gives_is_kept_across_machines():
    across = "strategy.hosts='a:1,b:1'"
    ps = compose_config(["strategy=parameter_server", across, "strategy.ps_placement=separate"])
    assert ps.strategy.ps_placement == "separate"
    hvd = compose_config(["strategy=horovod", across, "strategy.fp16_allreduce=false"])
    assert hvd.strategy.fp16_allreduce is False


def test_horovod_in_a_slurm_job_of_several_nodes_describes_its_job_step(slurm_job, monkeypatch):
    from distrepro.strategies import horovod

    for name, value in slurm_job.items():
        monkeypatch.setenv(name, value)
    cfg = compose_config(["strategy=horovod", "strategy.num_workers=4"])
    cfg.strategy.workers_per_node = 2
    assert horovod.describe(cfg) == (
        "Horovod ranks over gloo as one SLURM job step on gpu-a:2,gpu-b:2"
    )
