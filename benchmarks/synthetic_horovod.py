"""Horovod's tensorflow2_synthetic_benchmark recipe (rewritten, not vendored):
the same model on one fixed random batch per rank, no input pipeline.

    horovodrun -np 2 -H localhost:2 --gloo python benchmarks/synthetic_horovod.py \
        --image-size 32 --batch-size 32 --steps 60
"""

import argparse
import time

import horovod.tensorflow as hvd
import tensorflow as tf

import distrepro  # noqa: F401  (tf-keras first)
from distrepro.config import compose_config
from distrepro.training.models import build_model
from distrepro.training.runtime import set_threads


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--image-size", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=32, help="per rank")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--model", default="small_resnet")
    args = parser.parse_args()
    hvd.init()
    set_threads(hvd.local_size())
    model = build_model(compose_config([f"model={args.model}"]).model, args.image_size, 10)
    optimizer = tf.optimizers.SGD(0.01)
    images = tf.random.uniform([args.batch_size, args.image_size, args.image_size, 3])
    labels = tf.random.uniform([args.batch_size], maxval=10, dtype=tf.int64)
    loss_fn = tf.losses.SparseCategoricalCrossentropy(from_logits=True)

    @tf.function
    def step(first: bool):
        with tf.GradientTape() as tape:
            loss = loss_fn(labels, model(images, training=True))
        tape = hvd.DistributedGradientTape(tape)
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables, strict=True))
        if first:
            hvd.broadcast_variables(model.variables, root_rank=0)
            hvd.broadcast_variables(optimizer.variables, root_rank=0)

    step(True)
    for _ in range(args.warmup):
        step(False)
    start = time.perf_counter()
    for _ in range(args.steps):
        step(False)
    elapsed = time.perf_counter() - start
    if hvd.rank() == 0:
        print(f"images_per_sec {args.batch_size * hvd.size() * args.steps / elapsed:.2f}")


if __name__ == "__main__":
    main()
