"""A parameter-server or worker task: a `tf.distribute.Server` that serves
until its launcher stops it. Usage: python -m distrepro.ps_server JOB INDEX THREADS
with the cluster as JSON in DISTREPRO_CLUSTER."""

from __future__ import annotations

import json
import os
import sys

import tensorflow as tf


def main(job: str, index: int, threads: int) -> None:
    cluster = tf.train.ClusterSpec(json.loads(os.environ["DISTREPRO_CLUSTER"]))
    for gpu in tf.config.list_physical_devices("GPU"):  # those CUDA_VISIBLE_DEVICES gives
        tf.config.experimental.set_memory_growth(gpu, True)
    # One inter-op thread more than the share, as in training.core.set_threads.
    config = tf.compat.v1.ConfigProto(
        intra_op_parallelism_threads=threads, inter_op_parallelism_threads=threads + 1
    )
    server = tf.distribute.Server(
        cluster, job_name=job, task_index=index, protocol="grpc", config=config, start=True
    )
    server.join()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
