"""One Horovod rank (started by horovodrun through the launcher)."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import horovod.tensorflow as hvd
import tensorflow as tf
from omegaconf import OmegaConf

from distrepro import tracking
from distrepro.training import core
from distrepro.training.inputs import make_dataset, read_metadata
from distrepro.training.models import build_model


def main(config_path: str) -> None:
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
    main(sys.argv[1])
