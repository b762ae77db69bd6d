"""Under horovodrun: one training step on a fixed batch, variables saved by rank 0.

Usage: hvd_first_step.py TFRECORD_DIR GLOBAL_BATCH OUT.npz"""

import sys

import horovod.tensorflow as hvd
import numpy as np
import tf_keras as keras
from omegaconf import OmegaConf

import distrepro  # noqa: F401  (tf-keras first)
from distrepro.training.core import Trainer
from distrepro.training.inputs import make_dataset


def main(tfrecord_dir: str, global_batch: int, out: str) -> None:
    hvd.init()
    data = OmegaConf.create({"tfrecord_dir": tfrecord_dir, "image_size": 32})
    images, labels = next(iter(make_dataset(data, "validation", global_batch)))
    per_rank = global_batch // hvd.size()
    mine = slice(hvd.rank() * per_rank, (hvd.rank() + 1) * per_rank)
    # No batch norm: its statistics are per rank by design, so they would differ.
    model = keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(8, 3, strides=2, activation="relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(10),
        ]
    )
    cfg = OmegaConf.create({"train": {"label_smoothing": 0.1, "weight_decay": 1e-4}})
    trainer = Trainer(cfg, model, keras.optimizers.SGD(0.5), num_classes=10)
    rng = np.random.default_rng(0)  # the same start in both runs, whatever the op seeds
    model.set_weights([rng.normal(0, 0.1, w.shape).astype("float32") for w in model.get_weights()])
    trainer.step(images[mine], labels[mine], lambda tape: hvd.DistributedGradientTape(tape))
    if hvd.rank() == 0:
        np.savez(out, *[v.numpy() for v in model.trainable_variables])


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
