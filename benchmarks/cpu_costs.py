"""The host CPU's costs the cost model reads (distrepro.costmodel.HostCPU),
measured on this machine and written to benchmarks/cpu_costs.json:

- decode: core-seconds per training image of the project's input pipeline
  (decode the crop of a photo-sized JPEG, resize to 224, flip), on one
  thread, the process's CPU time from the kernel;
- ps apply / ps serve: core-seconds per byte a parameter-server task spends
  taking in a worker's gradients and applying them (momentum SGD, as the
  recipe's optimizer) or serving its variables to a worker: a real ps task
  (a tf.distribute.Server in a process of its own) holding ResNet-50's
  variables, each update one remote function over gRPC on 127.0.0.1 (every
  gradient sent anew: an eager op's input would be sent once and cached),
  its CPU time from the kernel (psutil).

Each figure is the median of ten passes; the ps task's from five pairs of
a ps task and a worker process, on CPUs of their own (the last and the
first), as a ps host's and a worker's would.

    python benchmarks/cpu_costs.py [--images 400] [--out benchmarks/cpu_costs.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import multiprocessing
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
from convert_benchmark import make_photos
from input_benchmark import one_thread
from omegaconf import DictConfig

import distrepro  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from distrepro import processes
from distrepro.config import compose_config
from distrepro.prepare import prepare

PASSES = 10
PS_PAIRS = 5  # ps task and worker processes, each pair for a fifth of the passes
WARM_UP_BATCHES = 4  # a pass's pipeline starts (shuffle buffer, prefetch) before it is timed
UPDATES = 8  # updates applied (and variables served) per pass: 0.8 GB
PS, WORKER = "/job:ps/task:0/device:CPU:0", "/job:worker/task:0/device:CPU:0"

PS_TASK = """
import sys, tensorflow as tf
cluster = tf.train.ClusterSpec({"ps": [sys.argv[1]], "worker": [sys.argv[2]]})
tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc").join()
"""


def photos(tmp: Path, images: int) -> DictConfig:
    """The data config of `images` photos prepared as training TFRecords."""
    make_photos(tmp / "raw", images)
    cfg = compose_config(
        [
            "data=imagenet",
            f"data.raw_dir={tmp}/raw",
            f"data.tfrecord_dir={tmp}/tfrecords",
            f"data.extract_dir={tmp}/extracted",
            "data.image_size=224",
            "data.train_shards=2",
            "data.val_shards=1",
            "prepare.verify=false",
        ]
    )
    prepare(cfg)
    return cfg.data


def decode_pass(data_cfg: DictConfig, images: int) -> float:
    """Core-seconds per image of the training input pipeline over `images`
    photos, after its start. A pipeline of its own: one left running
    between passes would decode ahead, unmeasured."""
    from distrepro.training.inputs import make_dataset

    batches = iter(one_thread(make_dataset(data_cfg, "train", 32)))
    for _ in range(WARM_UP_BATCHES):
        next(batches)
    before, seen = cpu_seconds(psutil.Process()), 0
    while seen < images:
        seen += int(next(batches)[1].shape[0])
    return (cpu_seconds(psutil.Process()) - before) / seen


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


@contextlib.contextmanager
def ps_task(shapes: list) -> Iterator[Callable[[], dict[str, float]]]:
    """A ps task holding variables of these shapes, and one pass of it: its
    core-seconds per byte applying a worker's gradients and serving its
    variables."""
    import tensorflow as tf

    ps_address, worker_address = (f"127.0.0.1:{port}" for port in processes.free_ports(2))
    last = max(os.sched_getaffinity(0))
    task = processes.start(  # ends with this process, however it ends
        ["taskset", "-c", str(last), sys.executable, "-c", PS_TASK, ps_address, worker_address]
    )
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    try:
        cluster = tf.train.ClusterSpec({"ps": [ps_address], "worker": [worker_address]})
        tf.config.experimental_connect_to_cluster(cluster, job_name="worker", protocol="grpc")
        yield ps_pass(task.pid, shapes)
    finally:
        processes.stop([task])


def ps_pass(pid: int, shapes: list) -> Callable[[], dict[str, float]]:
    import tensorflow as tf

    with tf.device(PS):
        variables = [tf.Variable(tf.zeros(shape)) for shape in shapes]
        momenta = [tf.Variable(tf.zeros(shape)) for shape in shapes]
    with tf.device(WORKER):
        gradients = [tf.random.normal(shape) for shape in shapes]

    @tf.function
    def apply():
        with tf.device(PS):
            for variable, momentum, gradient in zip(variables, momenta, gradients, strict=True):
                tf.raw_ops.ResourceApplyKerasMomentum(
                    var=variable.handle, accum=momentum.handle, lr=0.1, grad=gradient, momentum=0.9
                )

    @tf.function
    def serve():
        with tf.device(WORKER):
            return tf.add_n([tf.reduce_sum(tf.identity(variable)) for variable in variables])

    def done():  # remote ops run in order: the read of one value waits for them
        with tf.device(PS):
            variables[0][:1].numpy()

    apply(), serve(), done()  # the first of each traces it and sets up its channels
    ps = psutil.Process(pid)
    update_bytes = sum(math.prod(shape) for shape in shapes) * 4

    def one_pass() -> dict[str, float]:
        costs = {}
        for key, step in (("ps_apply_s_per_byte", apply), ("ps_serve_s_per_byte", serve)):
            before = cpu_seconds(ps)
            for _ in range(UPDATES):
                step()
            done()
            costs[key] = (cpu_seconds(ps) - before) / (UPDATES * update_bytes)
        return costs

    return one_pass


def ps_passes(count: int, shapes: list[list[int]]) -> dict[str, list[float]]:
    """`count` passes of a ps task and its worker (this process) of their own."""
    passes = {}
    with ps_task(shapes) as one_ps_pass:
        for _ in range(count):
            for key, value in one_ps_pass().items():
                passes.setdefault(key, []).append(value)
    return passes


def measure(images: int) -> dict[str, list[float]]:
    """Every figure's passes, taken in turn so that the machine's slower
    spells fall on all of them; the ps task's from PS_PAIRS pairs of
    processes, as its cost per byte differs from one pair to the next."""
    from distrepro.training.models import build_model

    model = build_model(compose_config(["model=resnet50"]).model, 224, 1000)
    shapes = [v.shape.as_list() for v in model.trainable_variables]
    passes = {"decode_s_per_image": []}
    with tempfile.TemporaryDirectory() as tmp:
        data_cfg = photos(Path(tmp), images)
        for _ in range(PS_PAIRS):
            with multiprocessing.get_context("spawn").Pool(1) as pair:
                for key, values in pair.apply(ps_passes, (PASSES // PS_PAIRS, shapes)).items():
                    passes.setdefault(key, []).extend(values)
            for _ in range(PASSES // PS_PAIRS):
                passes["decode_s_per_image"].append(decode_pass(data_cfg, images))
    return passes


def significant(value: float) -> float:
    return float(f"{value:.4g}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("cpu_costs.json"))
    args = parser.parse_args()
    started = time.monotonic()
    passes = measure(args.images)
    result = {
        "command": "python benchmarks/cpu_costs.py",
        "cpu": cpu_model(),
        "vcpus": psutil.cpu_count(),
        "date": time.strftime("%Y-%m-%d"),
        **{key: significant(statistics.median(values)) for key, values in passes.items()},
        "passes": {key: [significant(v) for v in values] for key, values in passes.items()},
        "seconds": round(time.monotonic() - started, 1),
    }
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
