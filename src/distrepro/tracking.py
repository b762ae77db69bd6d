"""MLflow: one run per training, resumed by id, with what reruns it."""

from __future__ import annotations

import json
import os
import platform
import subprocess
from importlib import metadata
from pathlib import Path

import mlflow
import yaml
from omegaconf import OmegaConf

from distrepro.config import flatten, setting_name

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("tensorflow", "tf_keras", "horovod", "mlflow", "snakemake", "dvc", "hydra-core")


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{REPO / 'mlflow.db'}"


def ensure_experiment(name: str) -> str:
    """Create the store and the experiment (one upstream step avoids SQLite races)."""
    mlflow.set_tracking_uri(tracking_uri())
    experiment = mlflow.get_experiment_by_name(name)
    return experiment.experiment_id if experiment else mlflow.create_experiment(name)


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


def start_run(plain_cfg: dict, run_dir: Path, extra_params: dict) -> str:
    """Start the run, or resume it when run_dir already names one."""
    id_file = run_dir / "mlflow_run_id"
    experiment_id = ensure_experiment(plain_cfg["mlflow_experiment"])
    if id_file.exists():
        return mlflow.start_run(run_id=id_file.read_text().strip()).info.run_id
    tags = {
        "strategy": plain_cfg["strategy"]["name"],
        "git_commit": git_commit(),
        "dvc_tfrecords_md5": dvc_hash(plain_cfg["data"]["tfrecord_dir"]),
        "hardware": f"{platform.machine()} {os.cpu_count()} cores, {platform.processor() or '?'}",
        "command": (run_dir / "command").read_text().strip(),
        **versions(),
    }
    tags |= {"seed": str(plain_cfg["seed"]), "setting": setting_name(OmegaConf.create(plain_cfg))}
    parent = plain_cfg.get("mlflow_parent_run_id")
    if parent:
        tags["mlflow.parentRunId"] = parent
    run = mlflow.start_run(experiment_id=experiment_id, run_name=run_dir.name, tags=tags)
    mlflow.log_params({**flatten(plain_cfg), **extra_params})
    mlflow.log_artifact(str(run_dir / "config.yaml"))
    id_file.write_text(run.info.run_id)
    restarts = run_dir / "restarts.json"
    if restarts.exists():
        log_restarts(run_dir, json.loads(restarts.read_text()))
    return run.info.run_id


def log_restarts(run_dir: Path, causes: list[str]) -> None:
    """The run's restarts so far: metric `restarts`, one tag per cause. Before
    the run exists they wait in restarts.json; start_run logs them."""
    id_file = run_dir / "mlflow_run_id"
    if not id_file.exists():
        return
    client = mlflow.MlflowClient(tracking_uri())
    run_id = id_file.read_text().strip()
    client.log_metric(run_id, "restarts", len(causes), step=len(causes))
    for number, cause in enumerate(causes, 1):
        client.set_tag(run_id, f"restart.{number}", cause)


def start_parent(experiment: str, kind: str, name: str, parent_run_id: str = "") -> str:
    """An MLflow run that runs are children of: a sweep's settings, or a
    setting's seeds (kind "sweep" or "setting", tagged kind=name)."""
    experiment_id = ensure_experiment(experiment)
    client = mlflow.MlflowClient()
    tags = {kind: name} | ({"mlflow.parentRunId": parent_run_id} if parent_run_id else {})
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


def main(argv: list[str]) -> None:
    """`init EXPERIMENT OUT` creates the store and experiment; `parent KIND
    EXPERIMENT NAME OUT [PARENT_RUN_ID]` creates a parent run. OUT receives the id."""
    if argv[:1] == ["init"] and len(argv) == 3:
        Path(argv[2]).write_text(ensure_experiment(argv[1]) + "\n")
    elif argv[:1] == ["parent"] and len(argv) in (5, 6) and argv[1] in ("sweep", "setting"):
        kind, experiment, name, out, *parent = argv[1:]
        Path(out).write_text(start_parent(experiment, kind, name, *parent) + "\n")
    else:
        raise SystemExit(
            "usage: python -m distrepro.tracking init EXPERIMENT OUT | "
            "parent sweep|setting EXPERIMENT NAME OUT [PARENT_RUN_ID]"
        )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
