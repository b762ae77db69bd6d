"""The host CPU's costs the cost model reads (distrepro.costmodel.HostCPU),
measured on this machine and written to benchmarks/cpu_costs.json:

- decode: core-seconds per training image of the project's input pipeline
  (decode the crop of a photo-sized JPEG, resize to 224, flip), on one
  thread, the process's CPU time from the kernel;
- ps apply / ps serve: core-seconds per byte a parameter-server task spends
  taking in a gradient and applying it (momentum SGD, as the recipe's
  optimizer) or reading a variable out to a worker: a real ps task (a
  tf.distribute.Server in a process of its own) over gRPC on 127.0.0.1,
  its CPU time from the kernel (psutil), for a ResNet-50-sized variable.

Each figure is the median of five passes. The ps task and this process run
on CPUs of their own (the last and the first), as a ps host's and a worker's
would.

    python benchmarks/cpu_costs.py [--images 400] [--out benchmarks/cpu_costs.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
from convert_benchmark import make_photos
from input_benchmark import one_thread

import distrepro  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from distrepro.config import compose_config
from distrepro.prepare import prepare
from distrepro.processes import free_ports

PARAMETERS = 25_557_032  # ResNet-50's (conf/model/resnet50.yaml)
PASSES = 5
UPDATES = 48  # gradients applied (and variables read) per pass: 4.9 GB

PS_TASK = """
import sys, tensorflow as tf
cluster = tf.train.ClusterSpec({"ps": [sys.argv[1]], "worker": [sys.argv[2]]})
tf.distribute.Server(cluster, job_name="ps", task_index=0, protocol="grpc").join()
"""


def decode_seconds(images: int) -> list[float]:
    """Core-seconds per image of the training input pipeline, each pass."""
    from distrepro.training.inputs import make_dataset

    with tempfile.TemporaryDirectory() as tmp:
        make_photos(Path(tmp) / "raw", images)
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
        batches = iter(one_thread(make_dataset(cfg.data, "train", 32)))
        next(batches)  # the pipeline's start
        seconds = []
        for _ in range(PASSES):
            before, seen = cpu_seconds(psutil.Process()), 0
            while seen < images:
                seen += int(next(batches)[1].shape[0])
            seconds.append((cpu_seconds(psutil.Process()) - before) / seen)
        return seconds


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def ps_seconds() -> dict[str, list[float]]:
    """Core-seconds per byte of a ps task applying gradients and serving its
    variable, each pass."""
    import tensorflow as tf

    ps_address, worker_address = (f"127.0.0.1:{port}" for port in free_ports(2))
    last = max(os.sched_getaffinity(0))
    task = subprocess.Popen(
        ["taskset", "-c", str(last), sys.executable, "-c", PS_TASK, ps_address, worker_address]
    )
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    try:
        cluster = tf.train.ClusterSpec({"ps": [ps_address], "worker": [worker_address]})
        tf.config.experimental_connect_to_cluster(cluster, job_name="worker", protocol="grpc")
        with tf.device("/job:ps/task:0/device:CPU:0"):
            variable = tf.Variable(tf.zeros([PARAMETERS]))
            momentum = tf.Variable(tf.zeros([PARAMETERS]))
        with tf.device("/job:worker/task:0/device:CPU:0"):
            gradient = tf.random.normal([PARAMETERS])

        def apply():
            with tf.device("/job:ps/task:0/device:CPU:0"):
                tf.raw_ops.ResourceApplyKerasMomentum(
                    var=variable.handle, accum=momentum.handle, lr=0.1, grad=gradient, momentum=0.9
                )

        def serve():
            with tf.device("/job:worker/task:0/device:CPU:0"):
                tf.identity(variable).numpy()

        def done():  # remote ops run in order: the read of one value waits for them
            with tf.device("/job:ps/task:0/device:CPU:0"):
                variable[:1].numpy()

        apply(), serve(), done()  # the first of each sets up its channel
        ps = psutil.Process(task.pid)
        costs = {"ps_apply_s_per_byte": [], "ps_serve_s_per_byte": []}
        for _ in range(PASSES):
            for key, step in (("ps_apply_s_per_byte", apply), ("ps_serve_s_per_byte", serve)):
                before = cpu_seconds(ps)
                for _ in range(UPDATES):
                    step()
                done()
                used = cpu_seconds(ps) - before
                costs[key].append(used / (UPDATES * PARAMETERS * 4))
        return costs
    finally:
        task.kill()
        task.wait()


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
    passes = {"decode_s_per_image": decode_seconds(args.images), **ps_seconds()}
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
