"""Hydra app: validate a composed config, prepare its run directory and hand
it to its strategy (distrepro.strategies), restarting a failed attempt from
its checkpoint up to train.max_restarts times."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from distrepro import hosts, parents, slurm, strategies
from distrepro.config import ConfigError, StrategyConfig, run_name, to_plain
from distrepro.devices import assign_gpus, host_gpus
from distrepro.handoff import DAMAGED_DATA, ON_SHAPED_HOSTS, TRACKING_BEHIND
from distrepro.processes import Restarts, TrainingFailed, end_with_parent


def validate(cfg: DictConfig) -> None:
    for key in ("bandwidth", "slowdown", "kill_interval_s"):
        value = cfg.network[key]
        if value is not None and ON_SHAPED_HOSTS not in os.environ:
            raise ConfigError(
                f"network.{key}={value}: a run on shaped links or CPUs starts on hosts of its "
                "own: `python -m distrepro.network` (as root) makes them and launches there"
            )
    validate_values(cfg)
    validate_devices(cfg.strategy)
    validate_nodes(cfg.strategy)
    validate_data(cfg)


def validate_values(cfg: DictConfig) -> None:
    """Refuse values that cannot train: the common ones here, the strategy's
    own by its module. The workflow checks every run's before any job starts
    (on the machine that will run them: not the devices; before the data is
    prepared: not the data)."""
    train, strategy = cfg.train, cfg.strategy
    if train.epochs < 1:
        raise ConfigError(f"train.epochs={train.epochs} must be at least 1")
    if cfg.seed < 0:
        raise ConfigError(f"seed={cfg.seed} must be at least 0")
    if not 0 < train.target_top1 <= 1:
        raise ConfigError(f"train.target_top1={train.target_top1} must be in (0, 1]")
    if train.profile:
        validate_profile_window(train, train.steps_per_epoch)
    if train.max_restarts < 0:
        raise ConfigError(f"train.max_restarts={train.max_restarts} must be at least 0")
    if strategy.num_workers < 1:
        raise ConfigError(f"strategy.num_workers={strategy.num_workers} must be at least 1")
    if train.global_batch_size % strategy.num_workers:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} does not divide by "
            f"strategy.num_workers={strategy.num_workers}"
        )
    if strategy.hosts:
        validate_hosts(strategy)
    if strategy.workers_per_node is not None and strategy.workers_per_node < 1:
        raise ConfigError(
            f"strategy.workers_per_node={strategy.workers_per_node} must be at least 1"
        )
    if strategy.steps_per_call < 1:
        raise ConfigError(f"strategy.steps_per_call={strategy.steps_per_call} must be at least 1")
    scale = cfg.precision.loss_scale
    if scale != "dynamic" and not (is_number(scale) and float(scale) > 0):
        raise ConfigError(f"precision.loss_scale={scale!r} must be 'dynamic' or a positive number")
    validate_keys(strategy)
    strategies.of(cfg).validate(cfg)


def validate_keys(strategy: DictConfig) -> None:
    """Refuse a key of another strategy, set: none is silently ignored."""
    own = (*strategies.SHARED_KEYS, *strategies.module(strategy.name.value).KEYS)
    default = StrategyConfig()
    for key, value in strategy.items():
        if key not in own and value != getattr(default, key):
            raise ConfigError(
                f"strategy.{key}={value} is not a key of strategy={strategy.name.value}, "
                f"which takes {', '.join(k for k in own if k != 'name')}"
            )


def validate_profile_window(train: DictConfig, updates_per_epoch: int | None) -> None:
    window = list(train.profile_steps)
    if len(window) == 2 and 0 <= window[0] < window[1] <= (updates_per_epoch or window[1]):
        return
    raise ConfigError(
        f"train.profile_steps={window} must be a window [first, last) of the epoch's "
        f"{updates_per_epoch or 'N'} updates"
    )


def validate_data(cfg: DictConfig) -> None:
    """Refuse a data.tfrecord_dir without finished TFRecords, and a profiled
    window beyond the epoch they make."""
    tfrecord_dir = Path(cfg.data.tfrecord_dir)
    if not (tfrecord_dir / "metadata.json").is_file():
        where = f"data={cfg.data.name} data.tfrecord_dir={tfrecord_dir}"
        if any(tfrecord_dir.glob("train-*-of-*")):
            raise ConfigError(
                f"data.tfrecord_dir={str(tfrecord_dir)!r} holds shards but no metadata.json: "
                f"index them once with `python -m distrepro.prepare {where} "
                "prepare.index_only=true` (no shard is rewritten)"
            )
        raise ConfigError(
            f"data.tfrecord_dir={str(tfrecord_dir)!r} holds no finished TFRecords "
            f"(metadata.json is missing): run `python -m distrepro.prepare {where}`"
        )
    if cfg.train.profile and not cfg.train.steps_per_epoch:
        images = json.loads((tfrecord_dir / "metadata.json").read_text())["splits"]["train"]
        strategy = strategies.of(cfg)
        per_call = strategy.updates_per_call(cfg)
        updates = max(per_call, images["images"] // strategy.images_per_update(cfg))
        validate_profile_window(cfg.train, updates // per_call * per_call)


def validate_hosts(strategy: DictConfig) -> None:
    try:
        slots = sum(n for _, n in hosts.parse(strategy.hosts))
    except hosts.HostsError as error:
        raise ConfigError(str(error)) from None
    if strategy.workers_per_node:
        raise ConfigError(
            f"strategy.hosts={strategy.hosts!r} names the machines; strategy.workers_per_node "
            "is for a SLURM job's nodes: give one of them"
        )
    if slots != strategy.num_workers:
        raise ConfigError(
            f"strategy.hosts={strategy.hosts!r} has {slots} slots for "
            f"strategy.num_workers={strategy.num_workers}: give each worker one"
        )


def validate_nodes(strategy: DictConfig) -> None:
    """Refuse, in a SLURM job, fewer nodes than strategy.workers_per_node needs."""
    nodes, needed = slurm.job_nodes(), slurm.nodes_for(strategy)
    if nodes and needed > len(nodes):
        raise ConfigError(
            f"strategy.workers_per_node={strategy.workers_per_node} puts strategy.num_workers="
            f"{strategy.num_workers} on {needed} nodes; this SLURM job has {len(nodes)}: "
            f"{','.join(nodes)}"
        )


def validate_devices(strategy: DictConfig) -> None:
    """Refuse, before anything starts, more GPUs than this machine has."""
    if strategy.gpus_per_worker and not strategy.hosts:
        try:
            assign_gpus(strategy.num_workers, strategy.gpus_per_worker, host_gpus())
        except ValueError as error:
            raise ConfigError(str(error)) from None


def is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> Path:
    run_dir = Path(cfg.results_dir) / run_name(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_plain(cfg))))
    command = ["python", "-m", "distrepro.launch", *overrides]
    (run_dir / "command").write_text(shlex.join(command) + "\n")
    return run_dir


def describe(cfg: DictConfig) -> str:
    """What launching cfg starts, in one line (shown by `snakemake -n`)."""
    strategy, train = cfg.strategy, cfg.train
    processes = strategies.of(cfg).describe(cfg)
    if strategy.gpus_per_worker:
        gpus = strategy.num_workers * strategy.gpus_per_worker
        processes += f"; {gpus} GPUs, {strategy.gpus_per_worker} per worker"
    return (
        f"{processes}; {cfg.model.name} on {cfg.data.name}, {train.epochs} epochs, "
        f"global batch {train.global_batch_size}, {cfg.precision.name.value}"
    )


def launch(cfg: DictConfig, overrides: list[str] = ()) -> Path:
    """Write the run directory of a validated cfg, train; return the run directory."""
    run_dir = prepare_run_dir(cfg, list(overrides))
    if (run_dir / "metrics.json").exists():
        if (run_dir / TRACKING_BEHIND).exists():
            from distrepro.tracking import log_finished

            print(f"{run_dir} is complete; logging what MLflow missed", flush=True)
            log_finished(run_dir, json.loads((run_dir / "metrics.json").read_text()))
        else:
            print(f"{run_dir} is complete; nothing to do")
        return run_dir
    config_path = run_dir / "config.yaml"
    run = strategies.of(cfg).run
    restarts = Restarts(cfg.train.max_restarts, run_dir)
    damaged = run_dir / DAMAGED_DATA
    damaged.unlink(missing_ok=True)
    while (cause := run(cfg, config_path, restarts)) is not None:
        if damaged.exists():
            raise TrainingFailed(f"{cause}: {damaged.read_text()}")
        # Every process is stopped; started again, the run resumes from its checkpoint.
        restarts.record(cause)
    return run_dir


def multirun_parent(cfg: DictConfig) -> str | None:
    """Under `-m`, the jobs of one Hydra sweep are children of one MLflow run,
    as a Snakemake sweep's are: the sweep directory, which Hydra's launcher
    creates before the first job, describes it (distrepro.parents)."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or cfg.mlflow_parent_run_id or cfg.mlflow_parent:
        return cfg.mlflow_parent
    folder = Path(hydra_cfg.sweep.dir)
    if not (folder / parents.SPEC).exists():
        parents.describe(folder, cfg.mlflow_experiment, "sweep", f"multirun-{folder.name}")
    return str(folder)


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # SIGTERM (timeout, a scheduler, the end of whatever started the launcher:
    # Snakemake, a shell) unwinds like Ctrl-C, so the tasks this launcher
    # started are stopped by its `finally` blocks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    end_with_parent(signal.SIGTERM)
    try:
        validate(cfg)
        cfg.mlflow_parent = multirun_parent(cfg)
        run_dir = launch(cfg, list(HydraConfig.get().overrides.task))
    except (ConfigError, TrainingFailed) as error:
        raise SystemExit(f"launch: {error}") from None
    if not (run_dir / "metrics.json").exists():  # a host's own worker under TF_CONFIG
        print(f"{run_dir}: this host's worker is done; the chief's host writes the metrics")
        return
    metrics = json.loads((run_dir / "metrics.json").read_text())
    print(json.dumps({k: v for k, v in metrics.items() if k != "history"}))


if __name__ == "__main__":
    main()
