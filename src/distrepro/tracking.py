"""MLflow: one run per training, with its epochs, final figures, model,
restarts and the chief's system metrics.

A training never waits long for MLflow, nor dies of it: its figures are in
the run's files first, each MLflow call gives up within seconds, and what a
server that does not answer missed is logged by a later call: the run itself
too, which is created when the server first answers (at an epoch's end, at
the run's end, or when the same command runs again)."""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import subprocess
import threading
import time
import zlib
from importlib import metadata
from pathlib import Path

import mlflow
import requests
import yaml
from mlflow.entities import Metric, Param, RunTag
from mlflow.exceptions import MlflowException

from distrepro import config, parents
from distrepro.atomic import write_json_atomically
from distrepro.config import REPO, flatten, setting_name, to_plain
from distrepro.handoff import AUTOTUNE_LOG, TRACKING_BEHIND
from distrepro.traces import PHASES

EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
# The MLflow UI's shared view of the runs table (?viewStateShareKey=runs): these columns.
RUNS_VIEW_TAG = "mlflow.sharedViewState.runs"
RUNS_VIEW_COLUMNS = [
    "attributes.`Dataset`",
    "params.`strategy.name`",
    "tags.`seed`",
    "metrics.`images_per_sec`",
    "metrics.`images_per_sec_ci95_low`",
    "metrics.`images_per_sec_ci95_high`",
    "metrics.`top1`",
    "metrics.`best_top1`",
    "metrics.`time_to_target_s`",
    "metrics.`eval_top1`",
]
RUNS_VIEW_PATH = "#/experiments/{id}/runs?workflowType=machine_learning&viewStateShareKey=runs"
# What a training logs when it ends, from metrics.json: its own figures, which
# the runs table shows. An epoch's figure of the same name is logged as
# epoch_<name> (one point per epoch), so that it does not shadow the run's.
FINAL_METRICS = ("images_per_sec", "total_time_s", "top1", "top5", "best_top1", "ps_wait_share")
FINAL_METRICS += tuple(PHASES.values()) + ("epochs_to_target", "time_to_target_s")
# The run's files that the MLflow record is kept by.
RUN_ID_FILE = "mlflow_run_id"
RUN_PARAMS = "mlflow_params.json"  # the training process's own params: the run may be created
LOGGED_EPOCHS = "mlflow_logged_epochs"  # how many epochs of history.json MLflow has
MODEL_ID_FILE = "mlflow_model_id"
MODEL_FILE, INPUT_EXAMPLE = "model.keras", "input_example.npy"  # the final model (files.py)
# MLflow's defaults retry a call for minutes; these give up within seconds.
BOUNDED_REQUESTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
for _key, _value in BOUNDED_REQUESTS.items():
    os.environ.setdefault(_key, _value)
PACKAGES = ("tensorflow", "tf_keras", "horovod", "mlflow", "snakemake", "dvc", "hydra-core")
UNANSWERED = (MlflowException, requests.RequestException, OSError)


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO / 'mlflow.db'}"


def client() -> mlflow.MlflowClient:
    return mlflow.MlflowClient(tracking_uri())


def behind(what: str, error: Exception) -> None:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    print(
        f"tracking is behind: {what} not logged yet ({tracking_uri()}: {first_line}); "
        "in the run's files, logged once the server answers",
        flush=True,
    )


def ensure_experiment(name: str) -> str:
    """Create the store and the experiment (one upstream step avoids SQLite
    races): a model-training one, with the shared view of its runs table that
    RUNS_VIEW_PATH opens."""
    experiment = client().get_experiment_by_name(name)
    tags = {EXPERIMENT_KIND: MODEL_TRAINING, RUNS_VIEW_TAG: runs_view()}
    if experiment is None:
        try:
            return client().create_experiment(name, tags=tags)
        except MlflowException:  # created meanwhile, by another host's launcher
            experiment = client().get_experiment_by_name(name)
    for key, value in tags.items():
        if experiment.tags.get(key) != value:
            client().set_experiment_tag(experiment.experiment_id, key, value)
    return experiment.experiment_id


def runs_view() -> str:
    """The runs table's columns as the MLflow UI stores a shared view: JSON,
    zlib-deflated, base64, prefixed "deflate;"."""
    state = json.dumps({"selectedColumns": RUNS_VIEW_COLUMNS})
    return "deflate;" + base64.b64encode(zlib.compress(state.encode())).decode()


def git_commit() -> str:
    def git(*args):
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout

    commit = git("rev-parse", "HEAD").strip() or "unknown"
    return commit + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def dvc_hash(tfrecord_dir: str) -> str:
    """The TFRecords' content hash as dvc.lock records it."""
    lock = REPO / "dvc.lock"
    if not lock.exists():
        return "untracked"
    target = os.path.relpath(Path(tfrecord_dir).resolve(), REPO)
    for stage in yaml.safe_load(lock.read_text())["stages"].values():
        for out in stage.get("outs", []):
            if out["path"] == target:
                return out["md5"]
    return "untracked"


def versions() -> dict[str, str]:
    found = {}
    for name in PACKAGES:
        try:
            found[f"version.{name}"] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[f"version.{name}"] = "absent"
    return found


def start_run(run_dir: Path, params: dict) -> str | None:
    """On the chief, once its params are known: describe the run (its
    params, beside config.yaml), sample the system's figures into it, and
    create or resume it; its id, or None while the server does not answer."""
    write_json_atomically(run_dir / RUN_PARAMS, params)
    SystemMetrics.start(run_dir)
    return run_id(run_dir)


def run_id(run_dir: Path) -> str | None:
    """The run's MLflow id; the run is created on first need, once its
    training process has described it and the server answers. None until then."""
    id_file = run_dir / RUN_ID_FILE
    if not id_file.exists() and (run_dir / RUN_PARAMS).exists():
        with parents.locked(run_dir / ".mlflow.lock"):  # the launcher may ask at the same time
            if not id_file.exists():
                try:
                    id_file.write_text(create_run(run_dir))
                except UNANSWERED as error:
                    behind("the run", error)
    return id_file.read_text().strip() if id_file.exists() else None


def create_run(run_dir: Path) -> str:
    """The MLflow run of a described run_dir: tags, params, dataset, config,
    the restarts so far; a child of its parent."""
    cfg = config.load(run_dir / "config.yaml")
    plain = to_plain(cfg)
    tags = {
        "strategy": plain["strategy"]["name"],
        "git_commit": git_commit(),
        "dvc_tfrecords_md5": dvc_hash(plain["data"]["tfrecord_dir"]),
        "hardware": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or '?'}",
        "command": (run_dir / "command").read_text().strip(),
        "seed": str(plain["seed"]),
        "setting": setting_name(cfg),
        **versions(),
    }
    parent = plain["mlflow_parent_run_id"]
    if plain["mlflow_parent"]:
        parent = parents.run_id(Path(plain["mlflow_parent"]))
    if parent:
        tags["mlflow.parentRunId"] = parent
    experiment_id = ensure_experiment(plain["mlflow_experiment"])
    run = client().create_run(experiment_id, run_name=run_dir.name, tags=tags)
    own = json.loads((run_dir / RUN_PARAMS).read_text())
    params = [Param(k, str(v)) for k, v in {**flatten(plain), **own}.items()]
    client().log_batch(run.info.run_id, params=params)
    log_dataset(plain["data"], [run.info.run_id, parent])
    client().log_artifact(run.info.run_id, str(run_dir / "config.yaml"))
    restarts = run_dir / "restarts.json"
    if restarts.exists():
        log_restarts(run_dir, json.loads(restarts.read_text()), run.info.run_id)
    return run.info.run_id


def log_dataset(data_cfg: dict, run_ids: list[str | None]) -> None:
    """The TFRecords as the training input of the runs (a run and its parent,
    which the UI shows folded): the UI's Dataset column. Name, DVC's hash as
    digest, the folder as source."""
    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.data.sources import LocalArtifactDatasetSource
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    folder = str(Path(data_cfg["tfrecord_dir"]).resolve())
    dataset = MetaDataset(
        LocalArtifactDatasetSource(folder),
        name=data_cfg["name"],
        digest=dvc_hash(data_cfg["tfrecord_dir"]),
    )
    used = DatasetInput(dataset._to_mlflow_entity(), [InputTag(MLFLOW_DATASET_CONTEXT, "training")])
    for run in filter(None, run_ids):
        client().log_inputs(run, datasets=[used])


def log_restarts(run_dir: Path, causes: list[str], run: str | None = None) -> None:
    """The run's restarts so far: metric `restarts`, one tag per cause. Before
    the run exists they wait in restarts.json; its creation logs them."""
    run = run or run_id(run_dir)
    if run is None:
        return
    try:
        client().log_metric(run, "restarts", len(causes), step=len(causes))
        for number, cause in enumerate(causes, 1):
            client().set_tag(run, f"restart.{number}", cause)
    except UNANSWERED as error:
        behind("the restarts", error)


def resumed_at(run_dir: Path, epochs: int) -> None:
    """The run goes on from its checkpoint of `epochs` epochs: those after it
    are trained, and logged, again."""
    count = run_dir / LOGGED_EPOCHS
    if count.exists() and int(count.read_text()) > epochs:
        count.write_text(str(epochs))


def epoch_metrics(record: dict) -> list[Metric]:
    """One epoch's figures as MLflow metrics at its step (see FINAL_METRICS),
    stamped with the epoch's end: logged again after a lost answer, they are
    the same rows, which MLflow's store keeps once."""
    at = int(record["timed_window"][1] * 1000)
    return [
        Metric(f"epoch_{k}" if k in FINAL_METRICS else k, v, at, record["epoch"])
        for k, v in record.items()
        if k != "epoch" and isinstance(v, int | float)
    ]


def log_epochs(run_dir: Path, history: list[dict]) -> bool:
    """Log the epochs of history that MLflow does not have yet; False, with a
    warning, while the server does not answer (a later call logs them)."""
    count = run_dir / LOGGED_EPOCHS
    logged = int(count.read_text()) if count.exists() else 0
    run = run_id(run_dir)
    if run is None:
        return False
    try:
        for record in history[logged:]:
            client().log_batch(run, metrics=epoch_metrics(record))
            logged += 1
            count.write_text(str(logged))
    except UNANSWERED as error:
        behind(f"epochs {logged + 1} to {len(history)}", error)
        return False
    return True


def now_ms() -> int:
    return int(time.time() * 1000)


def log_network(run_dir: Path, record: dict) -> None:
    """The figures of a finished run on the project's own hosts: the link's
    measured rate (shaped), per role the bytes per step measured (payload
    and on the wire) and expected, the seconds each quota held a host back,
    the kills."""
    figures = {"kills": float(len(record["kills"]))}
    if record["link_bytes_per_s"] is not None:
        figures["link_mbyte_per_s"] = record["link_bytes_per_s"] / 1e6
    figures |= {f"throttled_s_{host}": cpu["throttled_s"] for host, cpu in record["cpu"].items()}
    for kind in ("measured", "measured_wire", "expected"):
        for role, ways in record[kind].items():
            figures |= {f"{kind}_{role}_{way}_mb_per_step": n / 1e6 for way, n in ways.items()}
    at, run = now_ms(), run_id(run_dir)
    try:
        if run is None:
            raise MlflowException("the run has not been created yet")
        client().log_batch(run, metrics=[Metric(k, v, at, 0) for k, v in figures.items()])
    except UNANSWERED as error:
        print(f"tracking: the network figures are in {run_dir}/network.json only: {error}")


def log_finished(run_dir: Path, metrics: dict) -> bool:
    """A finished run's record, from its files: the run itself if MLflow has
    not got it yet, the epochs it lacks, the final figures, tags, model and
    artifacts, its end (and its parents'). While the server does not answer,
    run_dir/mlflow_behind says so, and the same command run again (which finds
    the run done) logs it."""
    marker = run_dir / TRACKING_BEHIND
    marker.write_text("the finished run is not in MLflow yet\n")
    run = run_id(run_dir)
    if run is None:
        return False
    if metrics["mlflow_run_id"] != run:  # created only now: the run's files say so too
        metrics["mlflow_run_id"] = run
        write_json_atomically(run_dir / "metrics.json", metrics)
    at = now_ms()
    final = [Metric(k, metrics[k], at, 0) for k in FINAL_METRICS if metrics.get(k) is not None]
    tags = {"target_reached": str(metrics["epochs_to_target"] is not None).lower()}
    if metrics["skipped_checkpoints"]:
        tags["skipped_checkpoints"] = "; ".join(metrics["skipped_checkpoints"])
    try:
        if not log_epochs(run_dir, metrics["history"]):
            return False
        client().log_batch(run, metrics=final, tags=[RunTag(k, v) for k, v in tags.items()])
        log_model(run_dir, run)
        profile = run_dir / "profile"
        if profile.is_dir():
            client().log_artifacts(run, str(profile), "profile")
        for name in ("metrics.json", AUTOTUNE_LOG):
            if (run_dir / name).exists():
                client().log_artifact(run, str(run_dir / name))
        client().set_terminated(run, end_time=at)
        parent = config.load(run_dir / "config.yaml").mlflow_parent
        if parent:
            parents.extend(Path(parent), at)
    except UNANSWERED as error:
        behind("the finished run", error)
        return False
    marker.unlink()
    return True


def log_model(run_dir: Path, run: str) -> None:
    """The final model (run_dir/model.keras, when the run saved one) as the
    run's MLflow model: the TensorFlow flavor, with its signature and an input
    example from the validation set. `mlflow.tensorflow.load_model` of
    models:/<id in run_dir/mlflow_model_id> gives it back."""
    id_file = run_dir / MODEL_ID_FILE
    if id_file.exists() or not (run_dir / MODEL_FILE).exists():
        return
    import numpy as np
    import tf_keras as keras
    from mlflow.models import infer_signature

    model = keras.models.load_model(run_dir / MODEL_FILE)
    example = np.load(run_dir / INPUT_EXAMPLE)
    mlflow.set_tracking_uri(tracking_uri())  # Model.log asks the fluent API's store
    info = mlflow.tensorflow.log_model(
        model,
        name="model",
        run_id=run,
        signature=infer_signature(example, model(example).numpy()),
        input_example=example,
        pip_requirements=[f"{p}=={metadata.version(p)}" for p in ("tensorflow", "tf_keras")],
    )
    id_file.write_text(info.model_id)


def create_parent(experiment: str, name: str, tags: dict, parent: str | None) -> str:
    """A parent run (see distrepro.parents), started now."""
    tags = tags | ({"mlflow.parentRunId": parent} if parent else {})
    return client().create_run(ensure_experiment(experiment), run_name=name, tags=tags).info.run_id


def end_no_earlier(run: str, end_ms: int) -> None:
    ended = client().get_run(run).info.end_time
    if ended is None or ended < end_ms:
        client().set_terminated(run, end_time=end_ms)


def log_setting_figures(summary: dict, runs: list[dict]) -> None:
    """Each setting's parent run gets its seeds' means under the children's
    metric names, with the 95 % interval as <name>_ci95_low/_high and the
    count as `seeds`, so that the runs table compares settings without
    unfolding them (report.summary gives the figures)."""
    at = now_ms()
    by_run = {run["run_name"]: run["mlflow_run_id"] for run in runs}
    try:
        for setting in summary.values():
            child = client().get_run(by_run[next(iter(setting["runs"]))])
            parent = child.data.tags.get("mlflow.parentRunId")
            if parent is None:
                continue
            figures = [Metric("seeds", len(setting["runs"]), at, 0)]
            for key, value in setting.items():
                if key != "runs":
                    figures += [Metric(key, value["mean"], at, 0)]
                    for bound, end in zip(value["ci95"], ("low", "high"), strict=True):
                        if not math.isnan(bound):  # one seed has no interval
                            figures += [Metric(f"{key}_ci95_{end}", bound, at, 0)]
            client().log_batch(parent, metrics=figures)
    except UNANSWERED as error:
        behind("the settings' means", error)


class SystemMetrics:
    """The chief's system figures (MLflow's CPU, disk and network monitors,
    as `system/<name>`), sampled every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL
    seconds (5) into its run. What a server that does not answer missed is
    kept and sent with the next sample: MLflow's own monitor stops at its
    first failed call and never resumes. One per process."""

    running: SystemMetrics | None = None

    def __init__(self, run_dir: Path):
        from mlflow.system_metrics.metrics.cpu_monitor import CPUMonitor
        from mlflow.system_metrics.metrics.disk_monitor import DiskMonitor
        from mlflow.system_metrics.metrics.network_monitor import NetworkMonitor

        self.run_dir, self.pending, self.started = run_dir, [], time.time()
        self.monitors = [CPUMonitor(), DiskMonitor(), NetworkMonitor()]
        self.interval = float(os.environ.get("MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL", 5))
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.sample, daemon=True, name="system-metrics")

    @classmethod
    def start(cls, run_dir: Path) -> None:
        if cls.running is None:
            cls.running = cls(run_dir)
            cls.running.thread.start()

    @classmethod
    def stop(cls) -> None:
        """Take a last sample and send what is left, if the server answers."""
        if cls.running is not None:
            cls.running.done.set()
            cls.running.thread.join()
            cls.running = None

    def sample(self) -> None:
        while not self.done.wait(self.interval):
            self.take()
        self.take()

    def take(self) -> None:
        at = now_ms()
        step = round((time.time() - self.started) / self.interval)
        for monitor in self.monitors:
            monitor.collect_metrics()
            figures = monitor.aggregate_metrics()
            self.pending += [Metric(f"system/{k}", v, at, step) for k, v in figures.items()]
            monitor.clear_metrics()
        run = run_id(self.run_dir) if (self.run_dir / RUN_ID_FILE).exists() else None
        if run is None:
            return
        try:
            client().log_batch(run, metrics=self.pending)
            self.pending = []
        except UNANSWERED:
            pass  # kept for the next sample


def main(argv: list[str]) -> None:
    """`init EXPERIMENT OUT` creates the store and experiment; `url
    EXPERIMENT UI` prints the UI's link to the experiment's runs table."""
    if argv[:1] == ["init"] and len(argv) == 3:
        Path(argv[2]).write_text(ensure_experiment(argv[1]) + "\n")
    elif argv[:1] == ["url"] and len(argv) == 3:
        print(argv[2].rstrip("/") + "/" + RUNS_VIEW_PATH.format(id=ensure_experiment(argv[1])))
    else:
        raise SystemExit(
            "usage: python -m distrepro.tracking init EXPERIMENT OUT | url EXPERIMENT UI"
        )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
