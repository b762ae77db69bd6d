"""The parameter-server coordinator: TF 2 ParameterServerStrategy with a
ClusterCoordinator scheduling steps on the worker tasks (asynchronous).

The cluster comes from TF_CONFIG when set (several machines), else from
DISTREPRO_CLUSTER, written by the launcher for its localhost tasks."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import tensorflow as tf
from omegaconf import OmegaConf

from distrepro import tracking
from distrepro.training import core
from distrepro.training.inputs import make_dataset, read_metadata
from distrepro.training.models import build_model


def cluster_resolver():
    if "TF_CONFIG" in os.environ:
        return tf.distribute.cluster_resolver.TFConfigClusterResolver()
    spec = tf.train.ClusterSpec(json.loads(os.environ["DISTREPRO_CLUSTER"]))
    return tf.distribute.cluster_resolver.SimpleClusterResolver(spec, rpc_layer="grpc")


def task_devices() -> str:
    """The GPUs the launcher gave each task, as CUDA_VISIBLE_DEVICES."""
    assigned = json.loads(os.environ.get("DISTREPRO_DEVICES") or "{}")
    if not assigned:
        return (
            "cpu (no GPU on this host)"
            if "TF_CONFIG" not in os.environ
            else "set by TF_CONFIG hosts"
        )
    return "; ".join(
        f"{task}: GPU {env['CUDA_VISIBLE_DEVICES']}"
        if env["CUDA_VISIBLE_DEVICES"]
        else f"{task}: cpu"
        for task, env in assigned.items()
    )


def main(config_path: str) -> None:
    cfg = OmegaConf.load(config_path)
    run_dir = Path(config_path).parent
    threads = core.set_threads(cfg.strategy.num_workers + cfg.strategy.num_ps + 1)
    core.set_precision(cfg.precision.name)
    tf.random.set_seed(cfg.seed)
    metadata = read_metadata(cfg.data.tfrecord_dir)
    per_worker = cfg.train.global_batch_size // cfg.strategy.num_workers
    steps_per_call = cfg.strategy.steps_per_call
    updates = core.epoch_plan(cfg, metadata["splits"]["train"]["images"], per_worker)
    updates = max(steps_per_call, updates // steps_per_call * steps_per_call)

    strategy = tf.distribute.experimental.ParameterServerStrategy(cluster_resolver())
    coordinator = tf.distribute.experimental.coordinator.ClusterCoordinator(strategy)
    with strategy.scope():
        model = build_model(cfg.model, cfg.data.image_size, metadata["num_classes"])
        # Asynchronous: each worker's update is one batch of per_worker images.
        peak = core.peak_learning_rate(cfg.train, per_worker)
        optimizer = core.make_optimizer(cfg, peak, updates)
        trainer = core.Trainer(cfg, model, optimizer, metadata["num_classes"])
    files = core.RunFiles(run_dir, model, optimizer, is_chief=True)

    def dataset_fn(context: tf.distribute.InputContext):
        return make_dataset(
            cfg.data,
            "train",
            per_worker,
            context.input_pipeline_id,
            context.num_input_pipelines,
            cfg.seed,
        )

    def per_worker_dataset_fn():
        return strategy.distribute_datasets_from_function(dataset_fn)

    train_batches = iter(coordinator.create_per_worker_dataset(per_worker_dataset_fn))
    val_batches = make_dataset(cfg.data, "validation", per_worker)

    @tf.function
    def train_steps(iterator):
        for _ in tf.range(steps_per_call):
            strategy.run(trainer.step, args=next(iterator))

    def run_updates(count: int) -> None:
        for _ in range(-(-count // steps_per_call)):
            coordinator.schedule(train_steps, args=(train_batches,))
        coordinator.join()

    extra = {
        "threads_per_process": threads,
        "steps_per_call": steps_per_call,
        "devices": task_devices(),
        "peak_learning_rate": peak,
    }
    run_id = tracking.start_run(OmegaConf.to_container(cfg), run_dir, extra)
    warmup = -(-cfg.train.warmup_steps_excluded // steps_per_call) * steps_per_call
    history = core.train_loop(
        cfg,
        trainer,
        files,
        run_updates,
        lambda: trainer.count_correct(val_batches),
        per_worker,
        updates,
        min(warmup, updates - steps_per_call),
    )
    core.finish(cfg, files, history, run_id)


if __name__ == "__main__":
    main(sys.argv[1])
