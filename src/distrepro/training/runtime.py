"""One training process's runtime, set up once before its strategy starts:
its share of the cores, its device, the seed and the precision policy."""

from __future__ import annotations

import os

import tensorflow as tf
import tf_keras as keras

POLICIES = {"fp32": "float32", "mixed_fp16": "mixed_float16", "mixed_bf16": "mixed_bfloat16"}


def set_threads(processes_on_host: int) -> int:
    """Give each of the processes sharing this host its share of the cores.

    The inter-op pool keeps one thread more: a pool of one deadlocks on a
    blocking op (an iterator's GetNext) inside a loop."""
    threads = max(1, (os.cpu_count() or 1) // processes_on_host)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads + 1)
    return threads


def use_gpu(index: int | None) -> str:
    """Make the index-th visible GPU this process's only one (memory growing as
    needed, not all reserved); None: no GPU. Returns the device used."""
    gpus = tf.config.list_physical_devices("GPU")
    chosen = gpus[index : index + 1] if index is not None else []
    tf.config.set_visible_devices(chosen, "GPU")
    for gpu in chosen:
        tf.config.experimental.set_memory_growth(gpu, True)
    return chosen[0].name if chosen else "cpu"


def set_seed(cfg) -> None:
    """The seed sets initialisation, data order and augmentation; with
    train.deterministic, TensorFlow's ops give the same results every time."""
    keras.utils.set_random_seed(cfg.seed)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()


def set_precision(name: str) -> None:
    keras.mixed_precision.set_global_policy(POLICIES[name])


def setup(cfg, processes_on_host: int, gpu: int | None) -> dict:
    """Threads, device, precision and seed of this process; what it got, as
    MLflow params."""
    threads = set_threads(processes_on_host)
    device = use_gpu(gpu)
    set_precision(cfg.precision.name.value)
    set_seed(cfg)
    return {"threads_per_process": threads, "device": device}
