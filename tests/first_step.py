"""One training step on a fixed batch, split over the workers of a strategy;
the chief saves the variables before and after it.

    horovodrun -np N ... python first_step.py horovod TFRECORD_DIR GLOBAL_BATCH OUT.npz
    TF_CONFIG=... python first_step.py multi_worker_mirrored TFRECORD_DIR BATCH OUT.npz [fp16]

fp16: TensorFlow's all-reduce of the gradients in fp16 (strategy.fp16_allreduce).
"""

import functools
import json
import os
import sys
from contextlib import nullcontext

import numpy as np
import tf_keras as keras
from omegaconf import OmegaConf

import distrepro  # noqa: F401  (tf-keras first)
from distrepro.training.inputs import make_dataset
from distrepro.training.recipe import Trainer


def model() -> keras.Model:
    """No batch norm: its statistics are per worker by design, so they would differ."""
    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )


def main(strategy_name: str, tfrecord_dir: str, global_batch: int, out: str, fp16: bool) -> None:
    import tensorflow as tf

    from distrepro.strategies.multi_worker_mirrored import HalfPrecisionAllReduce

    if strategy_name == "horovod":
        import horovod.tensorflow as hvd

        hvd.init()
        rank, size, scope = hvd.rank(), hvd.size(), nullcontext()
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        rank = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
        size, scope = strategy.num_replicas_in_sync, strategy.scope()
    data = OmegaConf.create({"tfrecord_dir": tfrecord_dir, "image_size": 32})
    images, labels = next(iter(make_dataset(data, "validation", global_batch)))
    per_worker = global_batch // size
    mine = slice(rank * per_worker, (rank + 1) * per_worker)
    cfg = OmegaConf.create({"train": {"label_smoothing": 0.1, "weight_decay": 1e-4}})
    with scope:
        net = model()
        rng = np.random.default_rng(0)  # the same start in every run, whatever the op seeds
        net.set_weights([rng.normal(0, 0.1, w.shape).astype("float32") for w in net.get_weights()])
        summed = 1 if strategy_name == "horovod" else size
        trainer = Trainer(cfg, net, keras.optimizers.SGD(0.5), num_classes=10, summed=summed)
    initial = [v.numpy() for v in net.trainable_variables]
    if strategy_name == "horovod":
        trainer.step(images[mine], labels[mine], lambda tape: hvd.DistributedGradientTape(tape))
    else:
        step = functools.partial(trainer.step, wrap_tape=HalfPrecisionAllReduce if fp16 else None)
        tf.function(lambda x, y: strategy.run(step, args=(x, y)))(images[mine], labels[mine])
    if rank == 0:
        after = [v.numpy() for v in net.trainable_variables]
        np.savez(
            out,
            **{f"initial{i}": v for i, v in enumerate(initial)},
            **{f"after{i}": v for i, v in enumerate(after)},
        )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:] == ["fp16"])
