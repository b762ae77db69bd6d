"""Horovod: `horovodrun` starts one rank per worker; each rank averages its
gradients with the others' (allreduce over Gloo, MPI or NCCL).

With strategy.elastic, horovodrun runs the ranks that its host discovery
script lists (at least strategy.min_workers): when a rank fails, its host is
left out for a cool-down, the others restore their last commit and go on,
and the host's ranks rejoin after it.

The launcher side (`run`) imports no TensorFlow; the ranks run
`python -m distrepro.strategies.horovod CONFIG`."""

from __future__ import annotations

import math
import os
import socket
import sys
from pathlib import Path

from horovod.common.elastic import ObjectState
from omegaconf import DictConfig, OmegaConf

from distrepro import hosts
from distrepro.processes import Restarts, process_env, start, stop

MODULE = "distrepro.strategies.horovod"
DISCOVERY_SCRIPT = "discover_hosts.sh"
ELASTIC_HOSTS = "elastic_hosts"  # what the discovery script lists; edit it to add or drop hosts
COOLDOWN_S = (5, 60)  # a failed host is left out this long, doubling with each failure
# Horovod's elastic mode leaves out the whole host of a failed rank. On one
# machine two names for it (each local) make two "hosts", so that one failed
# rank does not take every rank with it.
LOCAL_NAMES = ("localhost", "127.0.0.1")


def local_hosts(num_workers: int) -> list[tuple[str, int]]:
    """(host, slots) of an elastic run on this machine alone."""
    first = math.ceil(num_workers / 2)
    named = [(LOCAL_NAMES[0], first)]
    if num_workers > first:
        named.append((LOCAL_NAMES[1], num_workers - first))
    return named


def elastic_hosts(cfg: DictConfig) -> list[tuple[str, int]]:
    return hosts.of_run(cfg) or local_hosts(cfg.strategy.num_workers)


def write_discovery_script(cfg: DictConfig, run_dir: Path) -> Path:
    """run_dir/discover_hosts.sh prints run_dir/elastic_hosts, written from the
    config when missing."""
    listed = run_dir / ELASTIC_HOSTS
    if not listed.exists():
        listed.write_text("".join(f"{host}:{slots}\n" for host, slots in elastic_hosts(cfg)))
    script = run_dir / DISCOVERY_SCRIPT
    script.write_text(f"#!/bin/sh\nexec cat '{listed.resolve()}'\n")
    script.chmod(0o755)
    return script


def command(cfg: DictConfig, config_path: Path) -> list[str]:
    n = cfg.strategy.num_workers
    controller = "--mpi" if cfg.strategy.controller == "mpi" else "--gloo"
    program = [sys.executable, "-m", MODULE, str(config_path)]
    horovodrun = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(n)]
    machines = hosts.of_run(cfg)
    if not cfg.strategy.elastic:
        listed = ",".join(f"{host}:{slots}" for host, slots in machines or [("localhost", n)])
        return [*horovodrun, "-H", listed, controller, *program]
    elastic = [
        *("--min-np", str(cfg.strategy.min_workers), "--max-np", str(n)),
        *("--host-discovery-script", str(config_path.parent / DISCOVERY_SCRIPT)),
        *("--blacklist-cooldown-range", *map(str, COOLDOWN_S)),
    ]
    if not machines:
        elastic += ["--network-interface", "lo"]
    return [*horovodrun, *elastic, controller, *program]


def run(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    """Run the job once; return why it failed, or None."""
    if cfg.strategy.elastic:
        write_discovery_script(cfg, config_path.parent)
    proc = start(command(cfg, config_path), process_env(cfg))
    try:
        code = proc.wait()
    finally:
        stop([proc])
    return f"horovodrun exited with {code}" if code else None


class ElasticState(ObjectState):
    """What a restoring or joining rank needs: the model's and optimizer's
    variables (kept in host memory at each commit, broadcast from rank 0 at
    each sync) and plain values such as the history. Horovod's own
    TensorFlowKerasState calls optimizer.variables(), a property in tf_keras."""

    def __init__(self, variables: list, **values):
        import horovod.tensorflow as hvd

        self.variables = variables
        self._save_variables()
        super().__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **values)

    def _save_variables(self) -> None:
        self._saved_variables = [variable.numpy() for variable in self.variables]

    def save(self) -> None:
        self._save_variables()
        super().save()

    def restore(self) -> None:
        for variable, value in zip(self.variables, self._saved_variables, strict=True):
            variable.assign(value)
        super().restore()

    def sync(self) -> None:
        import horovod.tensorflow as hvd

        hvd.broadcast_variables(self.variables, root_rank=0)
        self._save_variables()
        super().sync()


def gpu_index(cfg: DictConfig, local_rank: int) -> int:
    """This rank's GPU on its host; under a local elastic run's two names the
    ranks number their GPUs from 0 under each, so the second name's come after
    the first's."""
    if not cfg.strategy.elastic or cfg.strategy.hosts:
        return local_rank
    offset = 0
    for host, slots in local_hosts(cfg.strategy.num_workers):
        if host == os.environ.get("HOROVOD_HOSTNAME"):
            break
        offset += slots
    return offset + local_rank


def rank_main(config_path: str) -> None:
    """One rank: init, pin a GPU, wrap the tape, train; the chief (rank 0) logs."""
    import horovod.tensorflow as hvd
    import mlflow
    import tensorflow as tf

    from distrepro import tracking
    from distrepro.training import core
    from distrepro.training.inputs import make_dataset, read_metadata
    from distrepro.training.models import build_model

    cfg = OmegaConf.load(config_path)
    run_dir = Path(config_path).parent
    hvd.init()
    # Without strategy.hosts every rank is on this machine (elastic: under two names).
    threads = core.set_threads(hvd.local_size() if cfg.strategy.hosts else cfg.strategy.num_workers)
    gpu = gpu_index(cfg, hvd.local_rank()) if cfg.strategy.gpus_per_worker else None
    device = f"rank {hvd.rank()} on {socket.gethostname()}: {core.use_gpu(gpu)}"
    core.set_precision(cfg.precision.name)
    core.set_seed(cfg)
    metadata = read_metadata(cfg.data.tfrecord_dir)
    global_batch = cfg.train.global_batch_size
    updates = core.epoch_plan(cfg, metadata["splits"]["train"]["images"], global_batch)

    model = build_model(cfg.model, cfg.data.image_size, metadata["num_classes"])
    peak = core.peak_learning_rate(cfg.train, global_batch)
    optimizer = core.make_optimizer(cfg, peak, updates)
    trainer = core.Trainer(cfg, model, optimizer, metadata["num_classes"])
    files = core.RunFiles(run_dir, model, optimizer, is_chief=hvd.rank() == 0)
    compression = hvd.Compression.fp16 if cfg.strategy.fp16_allreduce else hvd.Compression.none

    @tf.function
    def train_step(images, labels):
        return trainer.step(
            images, labels, lambda tape: hvd.DistributedGradientTape(tape, compression=compression)
        )

    shard = {}

    def reshard() -> None:
        """This rank's share of the data. An elastic run keeps the global batch
        (and so the learning rate) for any number of ranks, leaving out the
        remainder of a batch they do not divide."""
        rank, size = hvd.rank(), hvd.size()
        per_rank = global_batch // size
        train = make_dataset(cfg.data, "train", per_rank, rank, size, cfg.seed)
        shard["train"] = iter(train)
        shard["validation"] = make_dataset(cfg.data, "validation", per_rank, rank, size)

    def run_updates(count: int) -> None:
        for _ in range(count):
            train_step(*next(shard["train"]))

    def count_correct():
        return hvd.allreduce(trainer.count_correct(shard["validation"]), op=hvd.Sum)

    def track(devices: list[str]) -> None:
        """Start (or, on a new chief, resume) the MLflow run on rank 0."""
        if hvd.rank() == 0 and mlflow.active_run() is None:
            extra = {
                "threads_per_process": threads,
                "ranks": hvd.size(),
                "devices": "; ".join(devices),
                "peak_learning_rate": peak,
            }
            tracking.start_run(OmegaConf.to_container(cfg), run_dir, extra)

    warmup = min(cfg.train.warmup_steps_excluded, updates - 1)
    profile = None
    if cfg.train.profile:
        timeline = str(run_dir / core.PROFILE_DIR / core.HOROVOD_TIMELINE)
        start_timeline = lambda seconds: hvd.start_timeline(timeline)  # noqa: E731
        profile = core.Profile(cfg, files, start_timeline, hvd.stop_timeline)

    def train(progress: core.Progress, stride: int | None = None) -> list[dict]:
        return core.train_loop(
            cfg,
            trainer,
            files,
            run_updates,
            count_correct,
            global_batch,
            updates,
            warmup,
            hvd.size,
            progress,
            stride or core.progress_stride(updates),
            profile,
        )

    if cfg.strategy.elastic:
        history = train_elastic(cfg, files, trainer, train, reshard, lambda: track([device]))
    else:
        track(hvd.allgather_object(device))
        hvd.broadcast_variables(model.variables, root_rank=0)
        reshard()
        history = train(core.Progress(files.restore()))
    if hvd.rank() == 0:
        core.finish(cfg, files, history, mlflow.active_run().info.run_id)


def train_elastic(cfg, files, trainer, train, reshard, track) -> list[dict]:
    """Train as ranks come and go. After a failure the ranks left restore
    their last commit; when a host rejoins, the next commit stops every rank.
    Either way they start again from the commit, resharded for their number
    (the global batch, and so the learning rate, stays as configured)."""
    import horovod.tensorflow as hvd

    from distrepro.training import core

    trainer.optimizer.build(trainer.model.trainable_variables)
    optimizer_variables = trainer.optimizer.variables
    if callable(optimizer_variables):  # LossScaleOptimizer's is a method
        optimizer_variables = optimizer_variables()
    variables = trainer.model.variables + list(optimizer_variables)
    state = ElasticState(variables, **vars(core.Progress(files.restore())))

    @hvd.elastic.run
    def train_from(state: ElasticState) -> list[dict]:
        files.is_chief = hvd.rank() == 0
        track()
        reshard()
        return train(state, cfg.strategy.commit_every)

    return train_from(state)


if __name__ == "__main__":
    rank_main(sys.argv[1])
