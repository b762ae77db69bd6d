"""Hydra app: turn a composed config into training processes.

`strategy=horovod` runs horovodrun; `strategy=parameter_server` starts the
ps and worker servers on free 127.0.0.1 ports and the coordinator, and stops
them all by pid when training ends, fails or is interrupted."""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from distrepro.atomic import write_json_atomically
from distrepro.config import run_name, to_plain
from distrepro.devices import assign_gpus, host_gpus, parameter_server_devices

BIN = Path(sys.executable).parent
HOROVOD_MODULE = "distrepro.horovod_train"


class ConfigError(ValueError):
    """A config that cannot train; the message names the key and value."""


def validate(cfg: DictConfig) -> None:
    train, strategy = cfg.train, cfg.strategy
    if train.epochs < 1:
        raise ConfigError(f"train.epochs={train.epochs} must be at least 1")
    if train.max_restarts < 0:
        raise ConfigError(f"train.max_restarts={train.max_restarts} must be at least 0")
    if strategy.num_workers < 1:
        raise ConfigError(f"strategy.num_workers={strategy.num_workers} must be at least 1")
    if train.global_batch_size % strategy.num_workers:
        raise ConfigError(
            f"train.global_batch_size={train.global_batch_size} does not divide by "
            f"strategy.num_workers={strategy.num_workers}"
        )
    if strategy.name.value == "parameter_server" and strategy.num_ps < 1:
        raise ConfigError(f"strategy.num_ps={strategy.num_ps} must be at least 1")
    validate_devices(strategy)
    scale = cfg.precision.loss_scale
    if scale != "dynamic" and not (is_number(scale) and float(scale) > 0):
        raise ConfigError(f"precision.loss_scale={scale!r} must be 'dynamic' or a positive number")
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


def validate_devices(strategy: DictConfig) -> None:
    """Refuse, before anything starts, more GPUs than this machine has."""
    if strategy.name.value == "horovod" and strategy.gpus_per_worker > 1:
        raise ConfigError(
            f"strategy.gpus_per_worker={strategy.gpus_per_worker}: Horovod uses one GPU per "
            "rank; ask for more ranks (strategy.num_workers) instead"
        )
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


def process_env(cfg: DictConfig) -> dict[str, str]:
    """What every training process of cfg gets in its environment."""
    env = {"GRPC_FAIL_FAST": "use_caller"}
    if cfg.train.xla:
        # XLA auto-clustering of the training step, in every process that runs it.
        env["TF_XLA_FLAGS"] = "--tf_xla_auto_jit=2 --tf_xla_cpu_global_jit"
    if cfg.strategy.controller == "mpi" and os.geteuid() == 0:
        env |= {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    if not cfg.strategy.gpus_per_worker and host_gpus():
        env["CUDA_VISIBLE_DEVICES"] = ""  # asked for no GPU: TF would take them all
    return env


def prepare_run_dir(cfg: DictConfig, overrides: list[str]) -> Path:
    run_dir = Path(cfg.results_dir) / run_name(cfg)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.create(to_plain(cfg))))
    command = ["python", "-m", "distrepro.launch", *overrides]
    (run_dir / "command").write_text(shlex.join(command) + "\n")
    return run_dir


def horovod_command(cfg: DictConfig, config_path: Path) -> list[str]:
    n = cfg.strategy.num_workers
    controller = "--mpi" if cfg.strategy.controller == "mpi" else "--gloo"
    hosts = cfg.strategy.hosts or f"localhost:{n}"
    program = [sys.executable, "-m", HOROVOD_MODULE, str(config_path)]
    return [str(BIN / "horovodrun"), "-np", str(n), "-H", hosts, controller, *program]


def describe(cfg: DictConfig) -> str:
    """What launching cfg starts, in one line (shown by `snakemake -n`)."""
    strategy, train = cfg.strategy, cfg.train
    if strategy.name.value == "horovod":
        options = horovod_command(cfg, Path("config.yaml"))[1:6]
        processes = shlex.join(["horovodrun", *options, "python", "-m", HOROVOD_MODULE])
    else:
        processes = f"{strategy.num_ps} ps + {strategy.num_workers} workers + 1 coordinator"
    if strategy.gpus_per_worker:
        gpus = strategy.num_workers * strategy.gpus_per_worker
        processes += f"; {gpus} GPUs, {strategy.gpus_per_worker} per worker"
    return (
        f"{processes}; {cfg.model.name} on {cfg.data.name}, {train.epochs} epochs, "
        f"global batch {train.global_batch_size}, {cfg.precision.name.value}"
    )


def free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def signal_group(proc: subprocess.Popen, signum: int) -> None:
    """Signal the process group the launcher started proc in (its children too)."""
    try:
        os.killpg(proc.pid, signum)
    except ProcessLookupError:
        pass  # the whole group has already exited


def stop(processes: list[subprocess.Popen]) -> None:
    """SIGTERM each process group, then SIGKILL what is left after 5 s."""
    for proc in processes:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + 5
    for proc in processes:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            signal_group(proc, signal.SIGKILL)
            proc.wait()


def start(cmd: list[str], env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen(cmd, env={**os.environ, **(env or {})}, start_new_session=True)


class TrainingFailed(RuntimeError):
    """The run failed more often than train.max_restarts allows."""


class Restarts:
    """The restarts of one launch, at most train.max_restarts, each printed and
    recorded with the run's earlier ones (run_dir/restarts.json and the MLflow
    run's metric `restarts`)."""

    def __init__(self, limit: int, run_dir: Path):
        self.limit, self.used, self.path = limit, 0, run_dir / "restarts.json"
        self.causes: list[str] = json.loads(self.path.read_text()) if self.path.exists() else []

    def record(self, cause: str) -> None:
        if self.used >= self.limit:
            raise TrainingFailed(
                f"{cause}; giving up: train.max_restarts={self.limit} restarts already used"
            )
        self.used += 1
        self.causes.append(cause)
        write_json_atomically(self.path, self.causes)
        print(f"launch: {cause}; restart {self.used} of at most {self.limit}", flush=True)
        from distrepro.tracking import log_restarts

        log_restarts(self.path.parent, self.causes)


def supervise(
    coordinator: subprocess.Popen, tasks: dict, restart, restarts: Restarts
) -> str | None:
    """Wait for the coordinator; return why it failed, or None. A dead worker
    task is started again on its address (TF's coordinator reruns its lost
    steps); a dead ps task ends the attempt, as TF cannot recover from it."""
    while coordinator.poll() is None:
        for name, proc in list(tasks.items()):
            if proc.poll() is None:
                continue
            cause = f"task {name} (pid {proc.pid}) exited with {proc.returncode}"
            if not name.startswith("worker"):
                return cause
            restarts.record(cause)
            tasks[name] = restart(name)
        time.sleep(0.2)
    code = coordinator.returncode
    return f"the coordinator exited with {code}" if code else None


def run_parameter_server(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    n, m = cfg.strategy.num_workers, cfg.strategy.num_ps
    ports = free_ports(n + m)
    cluster = {
        "worker": [f"127.0.0.1:{p}" for p in ports[:n]],
        "ps": [f"127.0.0.1:{p}" for p in ports[n:]],
    }
    devices = parameter_server_devices(n, m, cfg.strategy.gpus_per_worker, host_gpus())
    env = {
        **process_env(cfg),
        "DISTREPRO_CLUSTER": json.dumps(cluster),
        "DISTREPRO_DEVICES": json.dumps(devices),
    }
    threads = str(max(1, (os.cpu_count() or 1) // (n + m + 1)))

    def start_task(name: str) -> subprocess.Popen:
        job, index = name.split(":")
        server = [sys.executable, "-m", "distrepro.ps_server", job, index, threads]
        return start(server, {**env, **devices.get(name, {})})

    names = [f"worker:{i}" for i in range(n)] + [f"ps:{i}" for i in range(m)]
    tasks: dict[str, subprocess.Popen] = {}
    coordinator = None
    try:
        tasks = {name: start_task(name) for name in names}
        coordinator = start(
            [sys.executable, "-m", "distrepro.ps_train", str(config_path)],
            {**env, **devices.get("coordinator", {})},
        )
        return supervise(coordinator, tasks, start_task, restarts)
    finally:
        stop([*tasks.values(), *([coordinator] if coordinator else [])])


def run_horovod(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    proc = start(horovod_command(cfg, config_path), process_env(cfg))
    try:
        code = proc.wait()
    finally:
        stop([proc])
    return f"horovodrun exited with {code}" if code else None


def launch(cfg: DictConfig, overrides: list[str] = ()) -> Path:
    """Write the run directory of a validated cfg, train; return the run directory."""
    run_dir = prepare_run_dir(cfg, list(overrides))
    if (run_dir / "metrics.json").exists():
        print(f"{run_dir} is complete; nothing to do")
        return run_dir
    from distrepro.tracking import ensure_experiment  # mlflow: 2 s to import, not for -n

    ensure_experiment(cfg.mlflow_experiment)
    config_path = run_dir / "config.yaml"
    run = run_horovod if cfg.strategy.name.value == "horovod" else run_parameter_server
    restarts = Restarts(cfg.train.max_restarts, run_dir)
    while (cause := run(cfg, config_path, restarts)) is not None:
        # Every process is stopped; started again, the run resumes from its checkpoint.
        restarts.record(cause)
    return run_dir


def multirun_parent(cfg: DictConfig) -> str | None:
    """Under `-m`, the jobs of one Hydra sweep are children of one MLflow run,
    as a Snakemake sweep's are; its id is kept in the sweep directory, which
    Hydra's launcher creates before the first job."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode != RunMode.MULTIRUN or cfg.mlflow_parent_run_id:
        return cfg.mlflow_parent_run_id
    id_file = Path(hydra_cfg.sweep.dir) / "mlflow_parent_run_id"
    if not id_file.exists():
        from distrepro.tracking import start_parent

        name = f"multirun-{Path(hydra_cfg.sweep.dir).name}"
        id_file.write_text(start_parent(cfg.mlflow_experiment, name))
    return id_file.read_text().strip()


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    # SIGTERM (timeout, Snakemake, a scheduler) unwinds like Ctrl-C, so the
    # tasks this launcher started are stopped by its `finally` blocks.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    try:
        validate(cfg)
        cfg.mlflow_parent_run_id = multirun_parent(cfg)
        run_dir = launch(cfg, list(HydraConfig.get().overrides.task))
    except (ConfigError, TrainingFailed) as error:
        raise SystemExit(f"launch: {error}") from None
    print(
        json.dumps(
            {
                k: v
                for k, v in json.loads((run_dir / "metrics.json").read_text()).items()
                if k != "history"
            }
        )
    )


if __name__ == "__main__":
    main()
