"""Horovod: `horovodrun` starts one rank per worker; each rank averages its
gradients with the others' (allreduce over Gloo, MPI or NCCL).

The launcher side (`run`) imports no TensorFlow; the ranks run
`python -m distrepro.strategies.horovod CONFIG`."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from distrepro.processes import Restarts, process_env, start, stop

MODULE = "distrepro.strategies.horovod"


def command(cfg: DictConfig, config_path: Path) -> list[str]:
    n = cfg.strategy.num_workers
    controller = "--mpi" if cfg.strategy.controller == "mpi" else "--gloo"
    hosts = cfg.strategy.hosts or f"localhost:{n}"
    program = [sys.executable, "-m", MODULE, str(config_path)]
    horovodrun = Path(sys.executable).parent / "horovodrun"
    return [str(horovodrun), "-np", str(n), "-H", hosts, controller, *program]


def run(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    """Run the job once; return why it failed, or None."""
    proc = start(command(cfg, config_path), process_env(cfg))
    try:
        code = proc.wait()
    finally:
        stop([proc])
    return f"horovodrun exited with {code}" if code else None


def rank_main(config_path: str) -> None:
    """One rank: init, pin a GPU, wrap the tape, broadcast, train; rank 0 logs."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from distrepro import tracking
    from distrepro.training import core
    from distrepro.training.inputs import make_dataset, read_metadata
    from distrepro.training.models import build_model

    cfg = OmegaConf.load(config_path)
    run_dir = Path(config_path).parent
    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    threads = core.set_threads(hvd.local_size())
    device = core.use_gpu(hvd.local_rank() if cfg.strategy.gpus_per_worker else None)
    devices = hvd.allgather_object(f"rank {rank} on {socket.gethostname()}: {device}")
    core.set_precision(cfg.precision.name)
    tf.random.set_seed(cfg.seed)
    metadata = read_metadata(cfg.data.tfrecord_dir)
    per_rank = cfg.train.global_batch_size // size
    updates = core.epoch_plan(
        cfg, metadata["splits"]["train"]["images"], cfg.train.global_batch_size
    )

    model = build_model(cfg.model, cfg.data.image_size, metadata["num_classes"])
    peak = core.peak_learning_rate(cfg.train, cfg.train.global_batch_size)
    optimizer = core.make_optimizer(cfg, peak, updates)
    trainer = core.Trainer(cfg, model, optimizer, metadata["num_classes"])
    files = core.RunFiles(run_dir, model, optimizer, is_chief=rank == 0)
    train_batches = iter(make_dataset(cfg.data, "train", per_rank, rank, size, cfg.seed))
    val_batches = make_dataset(cfg.data, "validation", per_rank, rank, size)
    compression = hvd.Compression.fp16 if cfg.strategy.fp16_allreduce else hvd.Compression.none

    @tf.function
    def train_step(images, labels):
        return trainer.step(
            images, labels, lambda tape: hvd.DistributedGradientTape(tape, compression=compression)
        )

    def run_updates(count: int) -> None:
        for _ in range(count):
            train_step(*next(train_batches))

    def count_correct():
        return hvd.allreduce(trainer.count_correct(val_batches), op=hvd.Sum)

    run_id = None
    if rank == 0:
        extra = {
            "threads_per_process": threads,
            "ranks": size,
            "devices": "; ".join(devices),
            "peak_learning_rate": peak,
        }
        run_id = tracking.start_run(OmegaConf.to_container(cfg), run_dir, extra)
    hvd.broadcast_variables(model.variables, root_rank=0)
    warmup = min(cfg.train.warmup_steps_excluded, updates - 1)
    history = core.train_loop(
        cfg,
        trainer,
        files,
        run_updates,
        count_correct,
        cfg.train.global_batch_size,
        updates,
        warmup,
    )
    if rank == 0:
        core.finish(cfg, files, history, run_id)


if __name__ == "__main__":
    rank_main(sys.argv[1])
