"""TensorFlow's own all-reduce: `tf.distribute.MultiWorkerMirroredStrategy`.
One process per worker, each with its TF_CONFIG; every update, the workers'
gradients are summed by TensorFlow's collective all-reduce (RING over gRPC
on CPU, NCCL on GPUs, from TensorFlow's own wheels: no Horovod). Worker 0 is
the chief; the others take part in each checkpoint save into a scratch
folder that they remove, as TensorFlow's multi-worker tutorial does.

The launcher starts the workers, on this machine, on `strategy.hosts` over
ssh, or as steps of a SLURM job on its nodes, writing each one's TF_CONFIG.
Under a TF_CONFIG of the user's (a cluster whose hosts each start their own
worker) the launcher starts its host's worker alone. A worker that dies
stops the collective: the launcher stops the others and the run restarts
from its last checkpoint.

    python -m distrepro.strategies.multi_worker_mirrored CONFIG   (under TF_CONFIG)
"""

from __future__ import annotations

import functools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from omegaconf import DictConfig

from distrepro import hosts
from distrepro.config import ConfigError
from distrepro.devices import devices_of_tasks, host_gpus
from distrepro.processes import Restarts, free_ports, process_env, start, stop
from distrepro.strategies.synchronous import (  # noqa: F401  (the interface)
    host_shares,
    images_per_update,
    processes,
    updates_per_call,
)
from distrepro.training.distribution import Distribution, main

MODULE = "distrepro.strategies.multi_worker_mirrored"
KEYS = ("communication", "bytes_per_pack", "fp16_allreduce")
EXCHANGE = "all-reduce"
BACKWARD_OVERLAP = 0.0  # TensorFlow reduces the gradients once the backward pass is done
COMMUNICATIONS = ("auto", "ring", "nccl")  # auto: RING on CPU, NCCL with GPUs


def validate(cfg: DictConfig) -> None:
    strategy = cfg.strategy
    if strategy.bytes_per_pack < 0:
        raise ConfigError(
            f"strategy.bytes_per_pack={strategy.bytes_per_pack} must be at least 0 "
            "(0: TensorFlow decides)"
        )
    if strategy.communication not in COMMUNICATIONS:
        raise ConfigError(
            f"strategy.communication={strategy.communication} must be one of "
            f"{', '.join(COMMUNICATIONS)}"
        )
    if strategy.gpus_per_worker > 1:
        raise ConfigError(
            f"strategy.gpus_per_worker={strategy.gpus_per_worker}: one GPU per worker process; "
            "ask for more workers (strategy.num_workers) instead"
        )
    if "TF_CONFIG" in os.environ:
        tf_config = json.loads(os.environ["TF_CONFIG"])
        task, workers = tf_config.get("task", {}), tf_config.get("cluster", {}).get("worker", [])
        if task.get("type") != "worker" or len(workers) != strategy.num_workers:
            raise ConfigError(
                f"TF_CONFIG names {task.get('type')}:{task.get('index')} in a cluster of "
                f"{len(workers)} workers: each host's launcher needs its own worker task in a "
                f"cluster of strategy.num_workers={strategy.num_workers}"
            )


def communication(cfg: DictConfig) -> str:
    if cfg.strategy.communication == "auto":
        return "NCCL" if cfg.strategy.gpus_per_worker else "RING"
    return cfg.strategy.communication.upper()


def describe(cfg: DictConfig) -> str:
    return f"{cfg.strategy.num_workers} workers, TensorFlow all-reduce over {communication(cfg)}"


def supervise(workers: list[subprocess.Popen]) -> str | None:
    """Wait for every worker; return why one failed, or None."""
    while any(proc.poll() is None for proc in workers):
        for index, proc in enumerate(workers):
            if proc.poll():
                return f"worker {index} (pid {proc.pid}) exited with {proc.returncode}"
        time.sleep(0.2)
    failed = [(i, proc) for i, proc in enumerate(workers) if proc.returncode]
    return f"worker {failed[0][0]} exited with {failed[0][1].returncode}" if failed else None


def run(cfg: DictConfig, config_path: Path, restarts: Restarts) -> str | None:
    """Run the workers once; return why it failed, or None."""
    worker = [sys.executable, "-m", MODULE, str(config_path)]
    if "TF_CONFIG" in os.environ:
        workers = [start(worker, process_env(cfg))]
    else:
        machines = hosts.of_run(cfg) or [("127.0.0.1", cfg.strategy.num_workers)]
        placed = {
            f"worker:{i}": host for i, host in enumerate(h for h, n in machines for _ in range(n))
        }
        ports = free_ports(len(placed))
        cluster = {
            "worker": [f"{placed[name]}:{port}" for name, port in zip(placed, ports, strict=True)]
        }
        devices = devices_of_tasks(placed, cfg.strategy.gpus_per_worker, host_gpus())
        workers = []
        for index, (name, host) in enumerate(placed.items()):
            tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
            env = {**process_env(cfg), "TF_CONFIG": json.dumps(tf_config), **devices.get(name, {})}
            workers.append(start(hosts.command_on(host, worker, env, name), env))
    try:
        return supervise(workers)
    finally:
        stop(workers)


class MultiWorkerMirrored(Distribution):
    """A worker: its replica's gradients summed with every other's by
    TensorFlow's collective all-reduce inside the optimizer's update; it
    reads its own shards of the data."""

    def __init__(self, cfg, run_dir):
        super().__init__(cfg, run_dir)
        tf_config = json.loads(os.environ["TF_CONFIG"])
        self.addresses = tf_config["cluster"]["worker"]
        self.index = tf_config["task"]["index"]
        self.is_chief = self.index == 0
        self.images_per_update = images_per_update(cfg)
        self.updates_per_call = updates_per_call(cfg)
        self.summed_replicas = len(self.addresses)
        if not self.is_chief:
            self.scratch = run_dir / "checkpoints" / f"worker-{self.index}-scratch"

    def processes_on_host(self) -> int:
        host = self.addresses[self.index].rsplit(":", 1)[0]
        return sum(address.rsplit(":", 1)[0] == host for address in self.addresses)

    def gpu(self) -> int | None:
        return (
            0 if self.cfg.strategy.gpus_per_worker else None
        )  # the launcher's CUDA_VISIBLE_DEVICES

    def connect(self) -> None:
        import tensorflow as tf

        implementation = tf.distribute.experimental.CommunicationImplementation
        options = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=self.cfg.strategy.bytes_per_pack,
            implementation=getattr(implementation, communication(self.cfg)),
        )
        self.strategy = tf.distribute.MultiWorkerMirroredStrategy(communication_options=options)

    def scope(self):
        return self.strategy.scope()

    def prepare(self, trainer) -> None:
        import tensorflow as tf

        from distrepro.training.inputs import make_dataset

        cfg, strategy, workers = self.cfg, self.strategy, len(self.addresses)

        def dataset_fn(context: tf.distribute.InputContext):
            batch = context.get_per_replica_batch_size(cfg.train.global_batch_size)
            pipeline, pipelines = context.input_pipeline_id, context.num_input_pipelines
            return make_dataset(cfg.data, "train", batch, pipeline, pipelines, cfg.seed)

        self.batches = iter(strategy.distribute_datasets_from_function(dataset_fn))
        per_worker = cfg.train.global_batch_size // workers
        self.validation = make_dataset(cfg.data, "validation", per_worker, self.index, workers)
        self.trainer = trainer
        step = trainer.step
        if cfg.strategy.fp16_allreduce:
            step = functools.partial(trainer.step, wrap_tape=HalfPrecisionAllReduce)

        @tf.function
        def train_steps(iterator):
            for _ in tf.range(self.updates_per_call):
                strategy.run(step, args=next(iterator))

        @tf.function
        def sum_over_workers(value):
            mine = strategy.run(tf.identity, args=(value,))  # one replica per worker
            return strategy.reduce(tf.distribute.ReduceOp.SUM, mine, axis=None)

        self.train_steps, self.sum_over_workers = train_steps, sum_over_workers

    def run_updates(self, count: int) -> None:
        for _ in range(count // self.updates_per_call):
            self.train_steps(self.batches)

    def count_correct(self):
        return self.sum_over_workers(self.trainer.count_correct(self.validation))

    def params(self, device: str) -> dict:
        """Each worker writes where it runs into the run directory; after a
        sum over workers (every one has written) the chief reads them all."""
        import tensorflow as tf

        folder = self.run_dir / "worker_hosts"
        folder.mkdir(exist_ok=True)
        line = f"worker {self.index} on {socket.gethostname()}: {device}"
        (folder / str(self.index)).write_text(line)
        self.sum_over_workers(tf.zeros([1]))
        where = [(folder / str(i)).read_text() for i in range(len(self.addresses))]
        return {"communication": communication(self.cfg), "devices": "; ".join(where)}

    def end(self) -> None:
        """Every worker waits for the others here, so that none is still in a
        collective when the chief, whose coordination service they all
        report to, goes."""
        import tensorflow as tf

        self.sum_over_workers(tf.zeros([1]))


class HalfPrecisionAllReduce:
    """A tape whose gradients are summed over the workers in fp16, as
    Horovod's fp16 compression sends them, instead of by the optimizer in
    fp32: half the bytes on the wire."""

    def __init__(self, tape):
        self.tape = tape

    def gradient(self, target, sources):
        import tensorflow as tf

        gradients = self.tape.gradient(target, sources)
        halves = [tf.cast(g, tf.float16) for g in gradients]
        summed = tf.distribute.get_replica_context().all_reduce(tf.distribute.ReduceOp.SUM, halves)
        return [tf.cast(s, g.dtype) for s, g in zip(summed, gradients, strict=True)]


if __name__ == "__main__":
    main(sys.argv[1], MultiWorkerMirrored)
