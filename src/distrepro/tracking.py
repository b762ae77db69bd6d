"""MLflow: one run per training, resumed by id, with what reruns it.

A training never waits long for MLflow, nor dies of it: its figures are in
the run's files first, each MLflow call gives up within seconds, and what a
server that does not answer missed is logged by a later call, at the latest
when the run finishes or when the same command runs again."""

from __future__ import annotations

import base64
import json
import math
import os
import platform
import subprocess
import zlib
from importlib import metadata
from pathlib import Path

import mlflow
import requests
import yaml
from mlflow.entities import Metric, RunTag
from mlflow.exceptions import MlflowException

from distrepro.config import REPO, flatten, setting_name, to_plain
from distrepro.handoff import TRACKING_BEHIND
from distrepro.traces import PHASES

EXPERIMENT_KIND, MODEL_TRAINING = "mlflow.experimentKind", "custom_model_development"
PARENT_KINDS = ("sweep", "scaling", "network", "setting")
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
SYSTEM_METRICS_INTERVAL_S = 5
# What a training logs when it ends, from metrics.json.
FINAL_METRICS = ("images_per_sec", "total_time_s", "top1", "top5", "best_top1", "ps_wait_share")
FINAL_METRICS += tuple(PHASES.values()) + ("epochs_to_target", "time_to_target_s")
LOGGED_EPOCHS = "mlflow_logged_epochs"  # how many epochs of history.json MLflow has
# MLflow's defaults retry a call for minutes; these give up within seconds.
BOUNDED_REQUESTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
for _key, _value in BOUNDED_REQUESTS.items():
    os.environ.setdefault(_key, _value)
PACKAGES = ("tensorflow", "tf_keras", "horovod", "mlflow", "snakemake", "dvc", "hydra-core")


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO / 'mlflow.db'}"


def ensure_experiment(name: str) -> str:
    """Create the store and the experiment (one upstream step avoids SQLite
    races): a model-training one, with the shared view of its runs table that
    RUNS_VIEW_PATH opens."""
    mlflow.set_tracking_uri(tracking_uri())
    experiment = mlflow.get_experiment_by_name(name)
    tags = {EXPERIMENT_KIND: MODEL_TRAINING, RUNS_VIEW_TAG: runs_view()}
    if experiment is None:
        try:
            return mlflow.create_experiment(name, tags=tags)
        except MlflowException:  # created meanwhile, by another host's launcher
            experiment = mlflow.get_experiment_by_name(name)
    for key, value in tags.items():
        if experiment.tags.get(key) != value:
            mlflow.MlflowClient().set_experiment_tag(experiment.experiment_id, key, value)
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


def active() -> str | None:
    """The id of this process's active MLflow run, if any."""
    run = mlflow.active_run()
    return run.info.run_id if run else None


def start_run(cfg, run_dir: Path, extra_params: dict) -> str:
    """Start the run of a composed or loaded cfg, or resume it when run_dir
    already names one."""
    plain = to_plain(cfg)
    id_file = run_dir / "mlflow_run_id"
    experiment_id = ensure_experiment(plain["mlflow_experiment"])
    mlflow.set_system_metrics_sampling_interval(SYSTEM_METRICS_INTERVAL_S)
    if id_file.exists():
        run_id = id_file.read_text().strip()
        return mlflow.start_run(run_id=run_id, log_system_metrics=True).info.run_id
    tags = {
        "strategy": plain["strategy"]["name"],
        "git_commit": git_commit(),
        "dvc_tfrecords_md5": dvc_hash(plain["data"]["tfrecord_dir"]),
        "hardware": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or '?'}",
        "command": (run_dir / "command").read_text().strip(),
        **versions(),
    }
    tags |= {"seed": str(plain["seed"]), "setting": setting_name(cfg)}
    parent = plain.get("mlflow_parent_run_id")
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = mlflow.start_run(
        experiment_id=experiment_id, run_name=run_dir.name, tags=tags, log_system_metrics=True
    )
    mlflow.log_params({**flatten(plain), **extra_params})
    log_dataset(plain["data"], [run.info.run_id, parent])
    mlflow.log_artifact(str(run_dir / "config.yaml"))
    id_file.write_text(run.info.run_id)
    restarts = run_dir / "restarts.json"
    if restarts.exists():
        log_restarts(run_dir, json.loads(restarts.read_text()))
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
    client = mlflow.MlflowClient()
    for run_id in filter(None, run_ids):
        client.log_inputs(run_id, datasets=[used])


UNANSWERED = (MlflowException, requests.RequestException, OSError)


def behind(what: str, error: Exception) -> None:
    print(f"tracking is behind: {what} not logged yet ({error}); in the run's files", flush=True)


def log_restarts(run_dir: Path, causes: list[str]) -> None:
    """The run's restarts so far: metric `restarts`, one tag per cause. Before
    the run exists they wait in restarts.json; start_run logs them."""
    id_file = run_dir / "mlflow_run_id"
    if not id_file.exists():
        return
    client = mlflow.MlflowClient(tracking_uri())
    run_id = id_file.read_text().strip()
    try:
        client.log_metric(run_id, "restarts", len(causes), step=len(causes))
        for number, cause in enumerate(causes, 1):
            client.set_tag(run_id, f"restart.{number}", cause)
    except UNANSWERED as error:
        behind("the restarts", error)


def resumed_at(run_dir: Path, epochs: int) -> None:
    """The run goes on from its checkpoint of `epochs` epochs: those after it
    are trained, and logged, again."""
    count = run_dir / LOGGED_EPOCHS
    if count.exists() and int(count.read_text()) > epochs:
        count.write_text(str(epochs))


def log_epochs(run_dir: Path, history: list[dict]) -> bool:
    """Log the epochs of history that MLflow does not have yet; False, with a
    warning, when the server does not answer (the next call logs them)."""
    count = run_dir / LOGGED_EPOCHS
    logged = int(count.read_text()) if count.exists() else 0
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    client = mlflow.MlflowClient(tracking_uri())
    try:
        for record in history[logged:]:
            at = mlflow.utils.time.get_current_time_millis()
            figures = [
                Metric(k, v, at, record["epoch"])
                for k, v in record.items()
                if k != "epoch" and isinstance(v, int | float)
            ]
            client.log_batch(run_id, metrics=figures)
            logged += 1
            count.write_text(str(logged))
    except UNANSWERED as error:
        behind(f"epochs {logged + 1} to {len(history)}", error)
        return False
    return True


def log_network(run_dir: Path, record: dict) -> None:
    """The network experiment's figures of a finished run: the link's
    measured rate and, per role, the bytes per step measured and expected."""
    figures = {"link_mbyte_per_s": record["link_bytes_per_s"] / 1e6}
    for kind in ("measured", "expected"):
        for role, ways in record[kind].items():
            figures |= {f"{kind}_{role}_{way}_mb_per_step": n / 1e6 for way, n in ways.items()}
    run_id = (run_dir / "mlflow_run_id").read_text().strip()
    at = mlflow.utils.time.get_current_time_millis()
    try:
        mlflow.MlflowClient(tracking_uri()).log_batch(
            run_id, metrics=[Metric(k, v, at, 0) for k, v in figures.items()]
        )
    except UNANSWERED as error:
        print(f"tracking: the network figures are in {run_dir}/network.json only: {error}")


def log_finished(run_dir: Path, metrics: dict) -> bool:
    """A finished run's record, from its files: the epochs MLflow lacks, the
    final figures, tags and artifacts, its end. While the server does not
    answer, run_dir/mlflow_behind says so, and the same command run again
    (which finds the run done) logs it."""
    marker = run_dir / TRACKING_BEHIND
    run_id = metrics["mlflow_run_id"]
    client = mlflow.MlflowClient(tracking_uri())
    at = mlflow.utils.time.get_current_time_millis()
    final = [Metric(k, metrics[k], at, 0) for k in FINAL_METRICS if metrics.get(k) is not None]
    tags = {"target_reached": str(metrics["epochs_to_target"] is not None).lower()}
    if metrics["skipped_checkpoints"]:
        tags["skipped_checkpoints"] = "; ".join(metrics["skipped_checkpoints"])
    try:
        if not log_epochs(run_dir, metrics["history"]):
            raise MlflowException("the epochs could not be logged")
        client.log_batch(run_id, metrics=final, tags=[RunTag(k, v) for k, v in tags.items()])
        profile = run_dir / "profile"
        if profile.is_dir():
            client.log_artifacts(run_id, str(profile), "profile")
        client.log_artifact(run_id, str(run_dir / "metrics.json"))
        client.set_terminated(run_id)
    except UNANSWERED as error:
        behind("the finished run", error)
        marker.write_text(f"{error}\n")
        return False
    marker.unlink(missing_ok=True)
    return True


def log_setting_figures(summary: dict, runs: list[dict]) -> None:
    """Each setting's parent run gets its seeds' means under the children's
    metric names, with the 95 % interval as <name>_ci95_low/_high and the
    count as `seeds`, so that the runs table compares settings without
    unfolding them (report.summary gives the figures)."""
    client = mlflow.MlflowClient(tracking_uri())
    at = mlflow.utils.time.get_current_time_millis()
    by_run = {run["run_name"]: run["mlflow_run_id"] for run in runs}
    try:
        for setting in summary.values():
            child = client.get_run(by_run[next(iter(setting["runs"]))])
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
            client.log_batch(parent, metrics=figures)
    except UNANSWERED as error:
        behind("the settings' means", error)


def start_parent(experiment: str, kind: str, name: str, parent_run_id: str = "") -> str:
    """An MLflow run that runs are children of: a sweep's, a scaling's or a
    network experiment's settings, or a setting's seeds (tagged kind=name)."""
    experiment_id = ensure_experiment(experiment)
    client = mlflow.MlflowClient()
    tags = {kind: name} | ({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def main(argv: list[str]) -> None:
    """`init EXPERIMENT OUT` creates the store and experiment; `parent KIND
    EXPERIMENT NAME OUT [PARENT_RUN_ID]` creates a parent run (OUT receives the
    id); `url EXPERIMENT UI` prints the UI's link to the experiment's runs table."""
    if argv[:1] == ["init"] and len(argv) == 3:
        Path(argv[2]).write_text(ensure_experiment(argv[1]) + "\n")
    elif argv[:1] == ["url"] and len(argv) == 3:
        print(argv[2].rstrip("/") + "/" + RUNS_VIEW_PATH.format(id=ensure_experiment(argv[1])))
    elif argv[:1] == ["parent"] and len(argv) in (5, 6) and argv[1] in PARENT_KINDS:
        kind, experiment, name, out, *parent = argv[1:]
        Path(out).write_text(start_parent(experiment, kind, name, *parent) + "\n")
    else:
        raise SystemExit(
            "usage: python -m distrepro.tracking init EXPERIMENT OUT | "
            "parent sweep|scaling|setting EXPERIMENT NAME OUT [PARENT_RUN_ID] | url EXPERIMENT UI"
        )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
