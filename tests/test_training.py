"""Training: both strategies on digits, Horovod averaging, bad configs,
resume after a kill, no process left behind, mixed precision, MPI, GPU
placement of the parameter-server tasks, XLA."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import numpy as np
import psutil
import pytest
from conftest import REPO, SHALLOW, peak_learning_rates, training_processes, wait_for_http
from mlflow.entities import LoggedModelStatus
from omegaconf import errors as omegaconf_errors
from test_setup import V100, stand_in

from distrepro import parents, processes, tracking
from distrepro.config import compose_config, run_name
from distrepro.launch import ConfigError, validate
from distrepro.strategies import REGISTRY
from distrepro.traces import read_timeline

PYTHON = sys.executable
HOROVODRUN = str(Path(PYTHON).parent / "horovodrun")


def launch_args(tfrecords: Path, results: Path, *overrides: str, shallow: bool = True) -> list[str]:
    """A launch on the session's digits, of the shallow model unless a test
    needs the default's longer epochs. The final model goes to MLflow only
    where a test says so (train.log_model=true): 3 s a run otherwise spent."""
    model = [SHALLOW] if shallow else []
    return [
        PYTHON,
        "-m",
        "distrepro.launch",
        f"data.tfrecord_dir={tfrecords}",
        f"results_dir={results}",
        "train.log_model=false",
        *model,
        *overrides,
    ]


def launch(tfrecords: Path, results: Path, *overrides: str) -> dict:
    args = launch_args(tfrecords, results, *overrides)
    subprocess.run(args, check=True, cwd=REPO, timeout=900)
    (run_dir,) = [p for p in results.iterdir() if (p / "metrics.json").exists()]
    return json.loads((run_dir / "metrics.json").read_text())


def first_step(strategy: str, workers: int, tfrecords: Path, out: Path, *fp16: str) -> dict:
    """tests/first_step.py on `workers` workers of a synchronous strategy."""
    script = [PYTHON, str(REPO / "tests" / "first_step.py"), strategy, str(tfrecords), "16"]
    script += [str(out), *fp16]
    if strategy == "horovod":
        hvd = [HOROVODRUN, "-np", str(workers), "-H", f"localhost:{workers}", "--gloo"]
        subprocess.run([*hvd, *script], check=True, timeout=300)
    else:
        with socket.socket() as a, socket.socket() as b:
            for s in (a, b):
                s.bind(("127.0.0.1", 0))
            addresses = [f"127.0.0.1:{s.getsockname()[1]}" for s in (a, b)][:workers]
        procs = []
        try:
            for index in range(workers):
                task = {
                    "cluster": {"worker": addresses},
                    "task": {"type": "worker", "index": index},
                }
                env = {**os.environ, "TF_CONFIG": json.dumps(task)}
                procs.append(subprocess.Popen(script, env=env))
            assert [proc.wait(300) for proc in procs] == [0] * workers
        finally:  # a worker left waiting for its peer is stopped too
            for proc in procs:
                proc.kill()
                proc.wait()
    return dict(np.load(out))


@pytest.mark.parametrize("strategy", ["horovod", "multi_worker_mirrored"])
def test_two_workers_step_like_one_process_with_twice_the_batch(
    digits_tfrecords, tmp_path, strategy
):
    one = first_step(strategy, 1, digits_tfrecords, tmp_path / "one.npz")
    two = first_step(strategy, 2, digits_tfrecords, tmp_path / "two.npz")
    afters = [key for key in one if key.startswith("after")]
    assert afters
    for key in afters:
        initial = one[key.replace("after", "initial")]
        np.testing.assert_array_equal(initial, two[key.replace("after", "initial")])
        assert not np.allclose(one[key], initial, atol=1e-4), f"{key}: the step changed nothing"
        np.testing.assert_allclose(one[key], two[key], rtol=1e-4, atol=1e-5)


def test_tensorflows_fp16_all_reduce_steps_as_the_fp32_one_does_to_fp16_precision(
    digits_tfrecords, tmp_path
):
    one = first_step("multi_worker_mirrored", 1, digits_tfrecords, tmp_path / "one.npz")
    two = first_step("multi_worker_mirrored", 2, digits_tfrecords, tmp_path / "two.npz", "fp16")
    afters = [key for key in one if key.startswith("after")]
    for key in afters:
        initial = one[key.replace("after", "initial")]
        assert not np.allclose(two[key], initial, atol=1e-4), f"{key}: the step changed nothing"
        np.testing.assert_allclose(two[key], one[key], rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.global_batch_size=65"], "train.global_batch_size=65 does not divide"),
        (["train.epochs=0"], "train.epochs=0"),
        (["data.tfrecord_dir=/nonexistent/tfrecords"], "data.tfrecord_dir='/nonexistent"),
        (["strategy=parameter_server", "strategy.num_ps=0"], "strategy.num_ps=0"),
        (["seed=-1"], "seed=-1"),
        (["train.target_top1=0"], "train.target_top1=0"),
        (["train.target_top1=1.5"], "train.target_top1=1.5"),
        (["train.profile=true", "train.profile_steps=[10,500]"], "profile_steps=[10, 500]"),
        (["train.profile=true", "train.profile_steps=[5]"], "profile_steps=[5]"),
        (["strategy.elastic=true", "strategy.min_workers=3"], "strategy.min_workers=3"),
        (["strategy.elastic=true", "strategy.controller=mpi"], "controller=mpi"),
        (["strategy.elastic=true", "strategy.commit_every=0"], "strategy.commit_every=0"),
        (["strategy=parameter_server", "strategy.elastic=true"], "not a key of strategy=param"),
        (["strategy.steps_per_call=0"], "strategy.steps_per_call=0 must be at least 1"),
        (["strategy.elastic=true", "strategy.commit_every=15"], "a multiple of strategy.steps_"),
        (["strategy.fusion_threshold_mb=-1"], "strategy.fusion_threshold_mb=-1.0 must be at"),
        (["strategy.cycle_time_ms=0"], "strategy.cycle_time_ms=0.0 must be above 0"),
        (["strategy.partitioner=fixed"], "strategy.partitioner=fixed is not a key of strategy=h"),
        (["strategy=multi_worker_mirrored", "strategy.bytes_per_pack=-1"], "bytes_per_pack=-1"),
        (["strategy=multi_worker_mirrored", "strategy.autotune=true"], "autotune=True is not a"),
        (["strategy=parameter_server", "strategy.fp16_allreduce=true"], "fp16_allreduce=True is"),
        (["strategy=parameter_server", "strategy.ps_placement=nearby"], "ps_placement=nearby"),
        (["strategy=parameter_server", "strategy.partitioner=even"], "partitioner=even must be"),
        (
            ["strategy=parameter_server", "strategy.ps_placement=colocated", "strategy.num_ps=3"],
            "strategy.num_ps=3: strategy.ps_placement=colocated puts one ps task",
        ),
    ],
)
def test_bad_configs_are_refused_before_any_process(digits_tfrecords, overrides, message):
    cfg = compose_config([f"data.tfrecord_dir={digits_tfrecords}", *overrides])
    with pytest.raises(ConfigError, match=re.escape(message)):
        validate(cfg)


@pytest.mark.parametrize("override", ["strategy=allreduce", "train.epochs=many", "train.epoch=3"])
def test_unknown_choices_and_wrong_types_fail_at_composition(override):
    with pytest.raises((omegaconf_errors.OmegaConfBaseException, Exception)) as error:
        compose_config([override])
    assert override.split("=")[0].split(".")[-1] in str(error.value)


def test_bad_config_on_the_command_line_fails_in_seconds(tmp_path):
    start = time.monotonic()
    result = subprocess.run(
        launch_args(tmp_path / "missing", tmp_path / "runs"), capture_output=True, text=True
    )
    assert result.returncode != 0
    assert "data.tfrecord_dir=" in result.stderr and "metadata.json" in result.stderr
    assert time.monotonic() - start < 60
    assert not (tmp_path / "runs").exists() and not training_processes()


def wait_for(paths, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while not list(paths()) and time.monotonic() < deadline:
        time.sleep(0.2)


def logged_epochs(results: Path, epochs: int):
    """The runs under results whose MLflow run has `epochs` epochs: each was
    checkpointed before it was logged."""
    return lambda: [
        count
        for count in results.glob(f"*/{tracking.LOGGED_EPOCHS}")
        if count.read_text() == str(epochs)
    ]


def kill_the_launcher_at(args: list[str], ready) -> None:
    """Start the launcher; once `ready()` lists something, kill -9 the
    launcher alone; within 10 s no process of the run is left."""
    proc = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL)
    try:
        wait_for(ready, 300)
        assert training_processes(), "the run had no training process"
        proc.kill()
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while training_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not training_processes(), "processes of the run outlived its launcher"


@pytest.mark.parametrize(
    "strategy, damaged",
    [("parameter_server", None), ("horovod", "ckpt-2"), ("multi_worker_mirrored", None)],
)
def test_a_killed_launcher_leaves_no_process_and_the_run_resumes(
    digits_tfrecords, tmp_path, mlflow_uri, strategy, damaged
):
    """kill -9 of the launcher (a scheduler's time limit, the OOM killer):
    its processes end with it; the same command resumes in the same MLflow
    run, past a newest checkpoint that a crash left short."""
    results = tmp_path / "runs"
    overrides = (f"strategy={strategy}", "train.epochs=3")
    kill_the_launcher_at(
        launch_args(digits_tfrecords, results, *overrides),
        logged_epochs(results, 2 if damaged else 1),
    )
    (run_dir,) = results.iterdir()
    assert not (run_dir / "metrics.json").exists()
    first_id = (run_dir / "mlflow_run_id").read_text()
    if damaged:
        with open(run_dir / f"checkpoints/{damaged}.data-00000-of-00001", "r+b") as data:
            data.truncate(100)  # what a machine that goes down mid-write leaves

    again = subprocess.run(
        launch_args(digits_tfrecords, results, *overrides),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["mlflow_run_id"] == first_id
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3]
    if strategy == "parameter_server":  # each worker reads its own shards, and updates
        by_worker = [h["updates_by_worker"] for h in metrics["history"]]
        assert len({sum(counts) for counts in by_worker}) == 1 and min(map(min, by_worker)) > 0
    client = mlflow.MlflowClient(mlflow_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "distrepro"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_id == first_id and run.info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(first_id, "val_top1"))
    assert steps == ([1, 2, 2, 3] if damaged else [1, 2, 3])  # the skipped epoch twice
    if damaged:
        assert f"checkpoint: skipping {run_dir}/checkpoints/{damaged}" in again.stdout
        (skip,) = metrics["skipped_checkpoints"]
        assert skip.startswith(f"{damaged}: ")
        assert run.data.tags["skipped_checkpoints"] == skip
    else:
        assert metrics["skipped_checkpoints"] == [] and "skipped_checkpoints" not in run.data.tags


def test_a_checkpoint_is_trusted_only_once_it_reads(tmp_path):
    """Every checkpoint unreadable: the run starts over, saying so."""
    import tensorflow as tf

    from distrepro.training.files import RunFiles, unreadable

    variable = tf.Variable([1.0, 2.0])
    files = RunFiles(tmp_path, variable, tf.Variable(0.0), is_chief=True, scratch=None)
    files.end_epoch([{"epoch": 1}])
    (path,) = files.manager.checkpoints
    assert unreadable(path) is None
    variable.assign([0.0, 0.0])
    assert files.restore() == [{"epoch": 1}] and variable.numpy().tolist() == [1.0, 2.0]
    (tmp_path / "checkpoints/ckpt-1.data-00000-of-00001").write_bytes(b"\0" * 100)
    assert unreadable(path)
    files = RunFiles(tmp_path, variable, tf.Variable(0.0), is_chief=True, scratch=None)
    assert files.restore() == []
    assert json.loads((tmp_path / "skipped_checkpoints.json").read_text())[0].startswith("ckpt-1")


# A tracking server without MLflow's job runner (GenAI jobs, a process pool):
# it starts in seconds.
QUICK_SERVER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
# A training whose server is down gives up on each call at once, rather than
# after MLflow's retries (the launcher's bounded ones: about 3 s a call).
NO_RETRIES = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}


class TrackingServer:
    """`mlflow server` on a free port of 127.0.0.1, over a copy of the empty
    store; stopped by its pid (its process group: the server's workers)."""

    def __init__(self, store: Path, folder: Path):
        shutil.copy(store, folder / "server.db")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.folder, self.proc = folder, None
        self.uri = f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                *(str(Path(PYTHON).parent / "mlflow"), "server", "--host", "127.0.0.1"),
                *("--port", str(self.port), "--workers", "1"),
                *("--backend-store-uri", f"sqlite:///{self.folder / 'server.db'}"),
                *("--artifacts-destination", str(self.folder / "artifacts")),
            ],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, **QUICK_SERVER},
        )
        wait_for_http(f"{self.uri}/health")

    def stop(self) -> None:
        if self.proc:
            processes.stop([self.proc])


def test_an_epoch_logged_again_after_a_lost_answer_is_kept_once(tmp_path, mlflow_uri):
    client = mlflow.MlflowClient(mlflow_uri)
    run = client.create_run(tracking.ensure_experiment("distrepro")).info.run_id
    (tmp_path / tracking.RUN_ID_FILE).write_text(run)
    history = [
        {"epoch": e, "val_top1": 0.1 * e, "timed_window": [1e9 + e, 1e9 + e + 0.5]} for e in (1, 2)
    ]
    assert tracking.log_epochs(tmp_path, history[:1])
    (tmp_path / tracking.LOGGED_EPOCHS).write_text("0")  # its answer was lost
    assert tracking.log_epochs(tmp_path, history)
    logged = client.get_metric_history(run, "val_top1")
    assert sorted((m.step, m.value, m.timestamp) for m in logged) == [
        (1, 0.1, 1_000_000_001_500),
        (2, 0.2, 1_000_000_002_500),
    ]


def test_a_run_goes_on_while_its_tracking_server_is_down_and_logs_once_it_is_back(
    digits_tfrecords, tmp_path, monkeypatch, empty_mlflow_store
):
    server = TrackingServer(empty_mlflow_store, tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)
    for name, value in NO_RETRIES.items():
        monkeypatch.setenv(name, value)
    results = tmp_path / "runs"
    overrides = ("strategy.num_workers=1", "train.epochs=3", "train.steps_per_epoch=10")
    args = launch_args(digits_tfrecords, results, *overrides)
    try:
        server.start()
        proc = subprocess.Popen(
            args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            wait_for(lambda: results.glob("*/checkpoints/ckpt-1.index"), 300)
            server.stop()
            output, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
        assert proc.returncode == 0, output[-3000:]
        assert "tracking is behind" in output
        (run_dir,) = results.iterdir()
        metrics = json.loads((run_dir / "metrics.json").read_text())
        assert (run_dir / "mlflow_behind").exists()

        server.start()
        again = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=300)
        assert again.returncode == 0, again.stderr[-3000:]
        assert "logging what MLflow missed" in again.stdout
        assert not (run_dir / "mlflow_behind").exists()
        client = mlflow.MlflowClient(server.uri)
        run = client.get_run(metrics["mlflow_run_id"])
        assert run.info.status == "FINISHED"
        assert run.data.metrics["top1"] == pytest.approx(metrics["top1"])
        history = client.get_metric_history(run.info.run_id, "val_top1")
        assert sorted(m.step for m in history) == [1, 2, 3]
        assert "metrics.json" in [a.path for a in client.list_artifacts(run.info.run_id)]
    finally:
        server.stop()


def until(condition, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "gave up waiting"
        time.sleep(0.2)


@contextlib.contextmanager
def held(proc: subprocess.Popen):
    """The run's processes (the launcher and all it started: horovodrun puts
    its ranks in groups of their own) stopped meanwhile: a server's start,
    however long a loaded machine makes it, leaves the run its epochs."""
    launcher = psutil.Process(proc.pid)
    launcher.suspend()
    run = [launcher, *launcher.children(recursive=True)]
    for process in run[1:]:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.suspend()
    try:
        yield
    finally:
        for process in run:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.resume()


def latest_checkpoint(results: Path) -> int:
    found = [int(p.name[5:].split(".")[0]) for p in results.glob("*/checkpoints/ckpt-*.index")]
    return max(found, default=0)


OUTAGE_EPOCHS = 20
OUTAGE_RUN = ("strategy.num_workers=1", f"train.epochs={OUTAGE_EPOCHS}", "train.steps_per_epoch=10")
OUTAGE_RUN += ("train.log_model=true",)


OUTAGE = pytest.mark.xdist_group("outage")  # in one process of the suite: one run


@pytest.fixture(scope="module")
def outage_at_start(digits_tfrecords, tmp_path_factory, empty_mlflow_store):
    """A run started while its tracking server is down: the server comes up
    after the first epoch, goes away once the run is in MLflow with a system
    metric, and comes back an epoch and 3 s later, with epochs left to run:
    the run is held while the server starts (which took 14 s to over 30 s of
    a loaded CI machine, longer than the run's last 22 epochs on a fast one).
    System metrics every second."""
    folder = tmp_path_factory.mktemp("outage")
    server = TrackingServer(empty_mlflow_store, folder)
    results = folder / "runs"
    overrides = OUTAGE_RUN
    env = {
        **os.environ,
        **NO_RETRIES,
        "MLFLOW_TRACKING_URI": server.uri,
        "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL": "1",
    }
    client = mlflow.MlflowClient(server.uri)
    times = {"launched": time.time()}
    try:
        proc = subprocess.Popen(  # the default model: an epoch outlasts a 1 s system sample
            launch_args(digits_tfrecords, results, *overrides, shallow=False),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            until(lambda: latest_checkpoint(results) >= 1)
            with held(proc):
                server.start()
                times["up"] = time.time()
            until(lambda: list(results.glob("*/mlflow_run_id")))
            (run_dir,) = results.iterdir()
            run_id = (run_dir / "mlflow_run_id").read_text()
            cpu = "system/cpu_utilization_percentage"
            until(lambda: client.get_metric_history(run_id, cpu))
            server.stop()
            times["down"] = time.time()
            after = latest_checkpoint(results)
            until(lambda: latest_checkpoint(results) > after and time.time() > times["down"] + 3)
            with held(proc):
                held_at = latest_checkpoint(results)
                server.start()
                times["back"] = time.time()
                assert latest_checkpoint(results) == held_at, "the run went on while held"
            output, _ = proc.communicate(timeout=600)
        finally:
            proc.kill()
        assert proc.returncode == 0 and latest_checkpoint(results) == OUTAGE_EPOCHS, output[-3000:]
        yield {"run_dir": run_dir, "client": client, "output": output, "times": times, "env": env}
    finally:
        server.stop()


@OUTAGE
def test_a_run_started_while_its_tracking_server_is_down_is_logged_once_it_is_back(
    outage_at_start,
):
    run_dir, client = outage_at_start["run_dir"], outage_at_start["client"]
    assert (
        "tracking is behind: the run not logged yet (http://127.0.0.1:"
        in (outage_at_start["output"])
    )
    assert "Traceback" not in outage_at_start["output"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    run = client.get_run(metrics["mlflow_run_id"])
    assert run.info.status == "FINISHED" and not (run_dir / "mlflow_behind").exists()
    assert run.info.start_time / 1000 > outage_at_start["times"]["up"]  # created once it was up
    history = client.get_metric_history(run.info.run_id, "val_top1")
    assert sorted(m.step for m in history) == list(
        range(1, OUTAGE_EPOCHS + 1)
    )  # the epochs before it too
    assert run.data.metrics["top1"] == pytest.approx(metrics["top1"])


@OUTAGE
def test_system_metrics_resume_after_the_tracking_server_comes_back(outage_at_start):
    times, client = outage_at_start["times"], outage_at_start["client"]
    run_id = (outage_at_start["run_dir"] / "mlflow_run_id").read_text()
    sampled = [
        m.timestamp / 1000
        for m in client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    ]
    # samples from while it was down (sent when it came back), and after
    assert any(times["down"] + 1 < t < times["back"] for t in sampled), (times, sampled)
    assert any(t > times["back"] + 1 for t in sampled), (times, sampled)


@OUTAGE
def test_the_final_model_is_in_mlflow_and_evaluates_as_the_checkpoint_does(
    outage_at_start, digits_tfrecords
):
    run_dir, client = outage_at_start["run_dir"], outage_at_start["client"]
    model = client.get_logged_model((run_dir / "mlflow_model_id").read_text())
    assert model.source_run_id == (run_dir / "mlflow_run_id").read_text()
    assert model.status.to_proto() == LoggedModelStatus.READY.to_proto(), model.status
    assert model.name == "model" and model.model_id in model.model_uri
    evaluate = [PYTHON, "-m", "distrepro.evaluate", f"data.tfrecord_dir={digits_tfrecords}"]
    evaluate += [f"results_dir={run_dir.parent}", *OUTAGE_RUN]

    def evaluated() -> dict:
        subprocess.run(evaluate, check=True, cwd=REPO, env=outage_at_start["env"], timeout=300)
        return json.loads((run_dir / "evaluation.json").read_text())

    through_mlflow = evaluated()
    assert through_mlflow["eval_model"] == f"models:/{model.model_id}"
    (run_dir / "mlflow_model_id").rename(run_dir / "model_id_aside")
    try:
        from_checkpoint = evaluated()
    finally:
        (run_dir / "model_id_aside").rename(run_dir / "mlflow_model_id")
    assert from_checkpoint["eval_model"].endswith(f"checkpoints/ckpt-{OUTAGE_EPOCHS}")
    assert through_mlflow["eval_top1"] == pytest.approx(from_checkpoint["eval_top1"])
    assert through_mlflow["eval_top1"] > 0.5  # chance is 0.1


def test_parameter_server_launcher_stops_its_tasks_on_failure_and_sigint(
    digits_tfrecords, tmp_path, mlflow_uri
):
    empty = tmp_path / "no-shards"
    empty.mkdir()
    (empty / "metadata.json").write_text((digits_tfrecords / "metadata.json").read_text())
    overrides = ("strategy=parameter_server", "train.max_restarts=0")
    failed = subprocess.run(launch_args(empty, tmp_path / "failed", *overrides), cwd=REPO)
    assert failed.returncode != 0
    assert not training_processes()

    results = tmp_path / "interrupted"
    args = launch_args(digits_tfrecords, results, "strategy=parameter_server")
    # Ctrl-C as in a shell: pytest-xdist's processes ignore SIGINT, which a child inherits
    proc = subprocess.Popen(
        args, cwd=REPO, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)
    )
    try:
        deadline = time.monotonic() + 300
        while not list(results.glob("*/mlflow_run_id")) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(training_processes()) == 4  # 2 workers, 1 ps, the coordinator
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) != 0  # stopped, not trained to its end
    finally:
        proc.kill()
    assert not training_processes()
    assert not list(results.glob("*/metrics.json"))


# The dynamic loss scale, fp16's default, is built in test_fp16_loss_scale_is_dynamic_or_fixed.
@pytest.mark.parametrize("precision, scale", [("mixed_fp16", "128"), ("mixed_bf16", None)])
def test_mixed_precision_trains_a_few_steps(
    digits_tfrecords, tmp_path, mlflow_uri, precision, scale
):
    metrics = launch(
        digits_tfrecords,
        tmp_path / "runs",
        f"precision={precision}",
        *([f"precision.loss_scale={scale}"] if scale else []),
        "strategy.num_workers=1",
        "train.epochs=1",
        "train.steps_per_epoch=4",
        "train.warmup_steps_excluded=1",
        "data.image_size=16",  # fp16 on a CPU without AVX-512: 60 s an epoch at 32
    )
    assert metrics["precision"] == precision
    assert math.isfinite(metrics["history"][0]["train_loss"])
    run = mlflow.MlflowClient(mlflow_uri).get_run(metrics["mlflow_run_id"])
    assert run.data.params["precision.loss_scale"] == (scale or "dynamic")


def test_hydra_multirun_runs_each_point_as_a_child_of_one_parent(
    digits_tfrecords, tmp_path, mlflow_uri
):
    refused = launch_args(
        digits_tfrecords,
        tmp_path / "runs",
        "train.global_batch_size=63,65",
        f"hydra.sweep.dir={tmp_path / 'refused'}",
    )
    result = subprocess.run([*refused[:3], "-m", *refused[3:]], cwd=REPO, capture_output=True)
    assert result.returncode != 0 and b"train.global_batch_size=63" in result.stderr
    client = mlflow.MlflowClient(mlflow_uri)
    experiments = [e.experiment_id for e in client.search_experiments()]
    assert not client.search_runs(experiments)  # no parent run for a refused sweep

    sweep_dir = tmp_path / "sweep"
    args = launch_args(
        digits_tfrecords,
        tmp_path / "runs",
        "train.global_batch_size=32,64",
        "strategy.num_workers=1",
        "train.epochs=1",
        "train.steps_per_epoch=4",
        "train.warmup_steps_excluded=1",
        f"hydra.sweep.dir={sweep_dir}",
    )
    subprocess.run([*args[:3], "-m", *args[3:]], check=True, cwd=REPO, timeout=900)
    parent_id = (sweep_dir / parents.RUN_ID).read_text().strip()
    parent = client.get_run(parent_id)
    children = client.search_runs(
        [parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent_id}'"
    )
    lrs = peak_learning_rates(children)
    assert sorted(lrs) == [32, 64]
    assert lrs[64] == pytest.approx(2 * lrs[32])
    assert len(list((tmp_path / "runs").glob("*/metrics.json"))) == 2


def test_run_name_changes_with_any_value():
    base = run_name(compose_config([]))
    assert base == run_name(compose_config([]))
    assert base != run_name(compose_config(["train.weight_decay=0.0"]))


def test_parameter_server_tasks_get_their_own_gpus(digits_tfrecords, tmp_path, mlflow_uri):
    bin_dir = tmp_path / "bin"  # this machine as the launcher sees it: four GPUs
    gpus = "\n".join(V100.replace("GPU 0", f"GPU {i}") for i in range(4))
    stand_in(bin_dir / "nvidia-smi", gpus)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    results = tmp_path / "runs"
    args = launch_args(
        digits_tfrecords,
        results,
        "strategy=parameter_server",
        "strategy.gpus_per_worker=2",
        "train.epochs=1",
        "train.steps_per_epoch=20",
    )
    proc = subprocess.Popen(args, cwd=REPO, env=env)
    seen = {}
    try:
        deadline = time.monotonic() + 300
        while len(seen) < 4 and time.monotonic() < deadline and proc.poll() is None:
            for task in training_processes():
                try:
                    cmdline, environ = task.cmdline(), task.environ()
                except psutil.Error:
                    continue  # exited meanwhile
                name = "coordinator" if "coordinator" in cmdline else ":".join(cmdline[-3:-1])
                seen[name] = environ.get("CUDA_VISIBLE_DEVICES")
            time.sleep(0.2)
        assert proc.wait(300) == 0
    finally:
        proc.kill()
    assert seen == {"worker:0": "0,1", "worker:1": "2,3", "ps:0": "", "coordinator": ""}
    (run_dir,) = results.iterdir()
    run = mlflow.MlflowClient(mlflow_uri).get_run((run_dir / "mlflow_run_id").read_text())
    assert "worker:1: GPU 2,3" in run.data.params["devices"]


@pytest.mark.parametrize("strategy", ["horovod", "parameter_server"])
def test_xla_compiles_the_training_step(digits_tfrecords, tmp_path, mlflow_uri, strategy):
    args = launch_args(
        digits_tfrecords,
        tmp_path / "runs",
        f"strategy={strategy}",
        "train.xla=true",
        "train.epochs=1",
        "train.steps_per_epoch=10",
        "train.warmup_steps_excluded=1",
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "0"}  # XLA says so at INFO level
    result = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Compiled cluster using XLA" in result.stdout + result.stderr
    (metrics,) = [json.loads(p.read_text()) for p in (tmp_path / "runs").glob("*/metrics.json")]
    assert math.isfinite(metrics["history"][0]["train_loss"])


@pytest.mark.parametrize("scale, dynamic", [("dynamic", True), ("1024", False)])
def test_fp16_loss_scale_is_dynamic_or_fixed(scale, dynamic):
    from distrepro.training.recipe import make_optimizer

    cfg = compose_config(["precision=mixed_fp16", f"precision.loss_scale={scale}"])
    optimizer = make_optimizer(cfg, 0.1, 10)  # the schema a run loads its config into
    assert optimizer.dynamic is dynamic
    if not dynamic:
        assert float(optimizer.loss_scale) == 1024.0


def test_a_truncated_shard_is_named_and_the_run_goes_on_once_it_is_restored(
    digits_tfrecords, tmp_path, mlflow_uri
):
    tfrecords = tmp_path / "tfrecords"
    shutil.copytree(digits_tfrecords, tfrecords)
    shard = tfrecords / "train-00001-of-00004"
    good = shard.read_bytes()
    shard.write_bytes(good[: len(good) // 2])
    results = tmp_path / "runs"
    args = launch_args(
        tfrecords, results, "strategy.num_workers=1", "train.epochs=1", "train.steps_per_epoch=40"
    )
    failed = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert failed.returncode != 0
    assert f"{shard}: truncated or corrupt record at byte" in failed.stderr + failed.stdout
    assert "dvc pull" in failed.stderr + failed.stdout
    assert "restart 1" not in failed.stdout  # damaged data: restarting cannot help
    assert not training_processes()

    shard.write_bytes(good)
    metrics = launch(tfrecords, results, *args[6:])
    (run_dir,) = results.iterdir()
    assert metrics["mlflow_run_id"] == (run_dir / "mlflow_run_id").read_text()


def kill_after_first_checkpoint(args: list[str], results: Path, task: str):
    """Run the launcher; once epoch 1 is checkpointed, kill -9 one process of
    `task` (see is_task); return the launcher's exit code and output."""
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        deadline = time.monotonic() + 300
        while not list(results.glob("*/checkpoints/ckpt-1.index")) and time.monotonic() < deadline:
            time.sleep(0.2)
        victims = [p for p in training_processes() if is_task(p, task)]
        victims[0].kill()
        output, _ = proc.communicate(timeout=600)
    finally:
        proc.kill()
    return proc.returncode, output


def is_task(proc: psutil.Process, task: str) -> bool:
    """A parameter-server task ("worker 1", "ps 0") or the process horovodrun
    started as rank N ("rank N")."""
    if " ".join(proc.cmdline()[-3:-1]) == task:
        return True
    if not task.startswith("rank") or "distrepro.strategies.horovod" not in proc.cmdline()[1:3]:
        return False
    return task == f"rank {proc.environ().get('HOROVOD_RANK')}"


def test_a_run_survives_a_killed_ps_task(digits_tfrecords, tmp_path, mlflow_uri):
    """A ps task killed: the launcher starts it again and the workers go on.
    (A killed worker of each strategy: the churn test, on hosts of their own.)"""
    results = tmp_path / "runs"
    args = launch_args(digits_tfrecords, results, "strategy=parameter_server", "train.epochs=4")
    code, output = kill_after_first_checkpoint(args, results, "ps 0")
    assert code == 0, output[-3000:]
    assert "task ps:0" in output and "restart 1 of at most 3" in output
    (metrics,) = [json.loads(p.read_text()) for p in results.glob("*/metrics.json")]
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4]
    assert metrics["top1"] > 0.5, metrics["history"]  # chance is 0.1
    client = mlflow.MlflowClient(mlflow_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "distrepro"]
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.metrics["restarts"] >= 1
    assert "exited with" in run.data.tags["restart.1"]
    assert not training_processes()


def test_elastic_horovod_goes_on_without_its_killed_chief_and_takes_it_back(
    digits_tfrecords, tmp_path, mlflow_uri
):
    results = tmp_path / "runs"
    args = launch_args(
        digits_tfrecords,
        results,
        "strategy.elastic=true",
        "train.epochs=14",
        "train.max_restarts=0",
        shallow=False,  # the chief's return takes about ten seconds
    )
    code, output = kill_after_first_checkpoint(args, results, "rank 0")
    assert code == 0, output[-3000:]
    (metrics,) = [json.loads(p.read_text()) for p in results.glob("*/metrics.json")]
    ranks = [h["workers"] for h in metrics["history"]]
    assert [h["epoch"] for h in metrics["history"]] == list(range(1, 15))
    assert ranks[0] == 2 and 1 in ranks and ranks[-1] == 2, ranks  # left out, then back
    assert metrics["top1"] > 0.5, metrics["history"]  # chance is 0.1
    client = mlflow.MlflowClient(mlflow_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "distrepro"]
    (run,) = client.search_runs([experiment.experiment_id])
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "val_top1"))
    # Every epoch; the one the chief logged as it was killed, before its commit,
    # the survivors redo from that commit and log again.
    assert sorted(set(steps)) == list(range(1, 15)) and len(steps) - 14 <= 1, steps
    assert "restarts" not in run.data.metrics  # the rank left went on; nothing restarted
    assert not training_processes()


def test_a_run_that_keeps_failing_stops_after_max_restarts(digits_tfrecords, tmp_path):
    results = tmp_path / "runs"
    args = launch_args(
        digits_tfrecords,
        results,
        "strategy=parameter_server",
        "train.epochs=4",
        "train.max_restarts=0",
    )
    code, output = kill_after_first_checkpoint(args, results, "worker 0")
    assert code != 0
    assert "task worker:0" in output and "exited with -9" in output
    assert "giving up: train.max_restarts=0 restarts already used" in output
    assert not training_processes()


def test_one_deterministic_rank_repeats_a_seed_exactly_and_not_another(
    digits_tfrecords, tmp_path, mlflow_uri
):
    def losses(name: str, seed: int) -> list[float]:
        metrics = launch(
            digits_tfrecords,
            tmp_path / name,
            "strategy.num_workers=1",
            "train.deterministic=true",
            f"seed={seed}",
            "train.epochs=2",
            "train.steps_per_epoch=8",
        )
        assert metrics["seed"] == seed and metrics["setting"] in metrics["run_name"]
        return [h["train_loss"] for h in metrics["history"]]

    first = losses("first", 0)
    assert losses("again", 0) == first
    assert losses("other", 1) != first


ON_A_TERMINAL = ("horovod", "parameter_server")
PROFILED = pytest.mark.xdist_group("profiled")  # the others' output goes to a pipe


@pytest.fixture(scope="module", params=list(REGISTRY))
def profiled(request, digits_tfrecords, tmp_path_factory, empty_mlflow_store) -> dict:
    """A profiled run of each strategy (2 epochs of 60 updates: steps after the
    window keep the parameter server's workers busy while their trace goes
    on), on a pseudo-terminal (`script`) or, for the others, into a pipe: its
    metrics, MLflow client and output. Autotuned, Horovod keeps its log."""
    strategy, folder = request.param, tmp_path_factory.mktemp(f"profiled-{request.param}")
    shutil.copy(empty_mlflow_store, folder / "mlflow.db")
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{folder / 'mlflow.db'}"}
    overrides = ["train.epochs=2", "train.steps_per_epoch=60", "train.profile=true"]
    if strategy == "horovod":  # shorter samples than Horovod's, so that 120 steps score some
        overrides.append("strategy.autotune=true")
        env.update(HOROVOD_AUTOTUNE_WARMUP_SAMPLES="1", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="3")
    args = launch_args(digits_tfrecords, folder / "runs", f"strategy={strategy}", *overrides)
    if strategy in ON_A_TERMINAL:
        typescript = folder / "typescript"
        script = ["script", "-qec", shlex.join(args), str(typescript)]
        subprocess.run(
            script, check=True, timeout=600, stdout=subprocess.DEVNULL, cwd=REPO, env=env
        )
        output = typescript.read_text(errors="replace").replace("\r", "\n")
    else:
        ran = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
        assert ran.returncode == 0, ran.stderr[-3000:]
        output = ran.stdout + ran.stderr
    (metrics,) = [json.loads(p.read_text()) for p in folder.glob("runs/*/metrics.json")]
    client = mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"])
    return {"strategy": strategy, "metrics": metrics, "client": client, "output": output}


@PROFILED
def test_a_progress_bar_on_a_terminal_and_plain_lines_in_logs(profiled):
    output = profiled["output"]
    if profiled["strategy"] in ON_A_TERMINAL:
        assert re.search(r"epoch 1/2: +100%.*60/60 .*step/s, loss [\d.]+, \d+ img/s", output)
    else:  # without a terminal every strategy takes the same path: checked once
        assert "step/s" not in output
    assert re.search(r"epoch 1/2  loss [\d.]+ ", output)


@PROFILED
def test_a_profiled_run_keeps_its_traces_and_system_metrics_in_mlflow(profiled, tmp_path):
    metrics, client, strategy = profiled["metrics"], profiled["client"], profiled["strategy"]
    run_id = metrics["mlflow_run_id"]
    local = Path(client.download_artifacts(run_id, "profile", str(tmp_path / "artifacts")))
    (trace,) = local.glob("tensorflow/plugins/profile/*/*.xplane.pb")  # the chief's
    assert trace.stat().st_size > 0
    if strategy == "horovod":
        assert 0 < metrics["allreduce_share"] < 1 and 0 < metrics["negotiate_share"] < 1
        timeline = read_timeline(local / "horovod_timeline.json")
        assert any(e.get("name") == "ALLREDUCE" for e in timeline)
        autotuned = client.download_artifacts(run_id, "horovod_autotune.csv", str(tmp_path))
        assert Path(autotuned).read_text().count("\n") > 1  # a sample per line
    elif strategy == "parameter_server":
        assert 0 < metrics["ps_wait_share"] < 1
        assert len(list(local.glob("workers/plugins/profile/*/*.xplane.pb"))) == 2
    else:  # TensorFlow's all-reduce, read from the chief's trace
        assert 0 < metrics["allreduce_share"] < 1 and "negotiate_share" not in metrics
    assert client.get_metric_history(run_id, "system/cpu_utilization_percentage")
    assert client.get_metric_history(run_id, "system/system_memory_usage_megabytes")
