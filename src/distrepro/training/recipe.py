"""The recipe every strategy trains with: learning-rate schedule, optimizer,
loss, the training step and the evaluation count."""

from __future__ import annotations

import math
from collections.abc import Callable

import tensorflow as tf
import tf_keras as keras

STEP_DECAY_AT = (1 / 3, 2 / 3, 8 / 9)  # epochs 30, 60, 80 of 90


class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak`, then cosine, polynomial (power 2) or step decay."""

    def __init__(self, peak: float, warmup: int, total: int, decay: str):
        self.peak, self.warmup, self.total, self.decay = peak, warmup, total, decay

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.peak * (step + 1) / max(1, self.warmup)
        progress = tf.clip_by_value(
            (step - self.warmup) / max(1, self.total - self.warmup), 0.0, 1.0
        )
        if self.decay == "cosine":
            decayed = self.peak * 0.5 * (1 + tf.cos(math.pi * progress))
        elif self.decay == "poly":
            decayed = self.peak * (1 - progress) ** 2
        else:
            drops = sum(tf.cast(progress >= at, tf.float32) for at in STEP_DECAY_AT)
            decayed = self.peak * 0.1**drops
        return tf.where(step < self.warmup, warm, decayed)

    def get_config(self):
        return {"peak": self.peak, "warmup": self.warmup, "total": self.total, "decay": self.decay}


def peak_learning_rate(train, batch_per_update: int) -> float:
    """The recipe's linear scaling: base rate x the update's batch / the base batch."""
    return train.base_learning_rate * batch_per_update / train.base_batch_size


class SGD(keras.optimizers.SGD):
    """SGD with momentum and L2 weight decay of the kernels, as a loss term
    weight_decay x |w|^2 / 2 would give it (weight_decay x w added to w's
    gradient, before the momentum), but added in the update, where the
    variable lives. Under the parameter server that is its ps task: a worker
    reads each variable once per update, for its forward pass, and never
    again for the decay."""

    def __init__(self, learning_rate, momentum: float, l2: float):
        super().__init__(learning_rate, momentum=momentum)
        self.l2 = l2

    def update_step(self, gradient, variable):
        if self.l2 and "kernel" in variable.name:
            gradient = gradient + tf.cast(self.l2, variable.dtype) * variable
        return super().update_step(gradient, variable)


def make_optimizer(cfg, peak: float, updates_per_epoch: int):
    """SGD with momentum, weight decay and the warmup-then-decay schedule up
    to `peak`."""
    train = cfg.train
    schedule = WarmupDecay(
        peak,
        train.warmup_epochs * updates_per_epoch,
        train.epochs * updates_per_epoch,
        train.lr_decay.value,
    )
    optimizer = SGD(schedule, train.momentum, train.weight_decay)
    if cfg.precision.name.value != "mixed_fp16":
        return optimizer
    scale = cfg.precision.loss_scale
    if scale == "dynamic":
        return keras.mixed_precision.LossScaleOptimizer(optimizer)
    return keras.mixed_precision.LossScaleOptimizer(
        optimizer, dynamic=False, initial_scale=float(scale)
    )


class Trainer:
    """One model's loss, training step and evaluation, strategy-agnostic."""

    def __init__(self, cfg, model: keras.Model, optimizer, num_classes: int, summed: int = 1):
        """summed: how many replicas' gradients the optimizer adds up in one
        update (TensorFlow's all-reduce sums them); each replica's loss is
        divided by it, so that an update follows the mean."""
        self.model, self.optimizer, self.num_classes = model, optimizer, num_classes
        self.summed = summed
        self.label_smoothing = cfg.train.label_smoothing
        self.scaled = isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)
        self.train_loss = keras.metrics.Mean("train_loss")
        self.train_accuracy = keras.metrics.SparseCategoricalAccuracy("train_accuracy")

    def loss(self, labels, logits):
        """The batch's cross-entropy (label-smoothed); the weight decay is the
        optimizer's (SGD)."""
        onehot = tf.one_hot(labels, self.num_classes)
        per_example = keras.losses.categorical_crossentropy(
            onehot, logits, from_logits=True, label_smoothing=self.label_smoothing
        )
        return tf.reduce_mean(per_example)

    def step(self, images, labels, wrap_tape: Callable | None = None):
        """One update from one batch. wrap_tape (Horovod's, or fp16 all-reduce)
        gives a tape whose gradients are already reduced over the workers."""
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            loss = self.loss(labels, logits)
            share = loss / self.summed
            scaled = self.optimizer.get_scaled_loss(share) if self.scaled else share
        variables = self.model.trainable_variables
        gradients = (wrap_tape(tape) if wrap_tape else tape).gradient(scaled, variables)
        if self.scaled:
            gradients = self.optimizer.get_unscaled_gradients(gradients)
        self.optimizer.apply_gradients(
            zip(gradients, variables, strict=True), skip_gradients_aggregation=bool(wrap_tape)
        )
        self.train_loss.update_state(loss)
        self.train_accuracy.update_state(labels, logits)
        return loss

    def reset_metrics(self):
        self.train_loss.reset_state()
        self.train_accuracy.reset_state()

    def count_correct(self, dataset) -> tf.Tensor:
        """[top-1 correct, top-5 correct, images] over a dataset."""
        totals = tf.zeros([3], tf.float64)
        for images, labels in dataset:
            totals += self._batch_counts(images, labels)
        return totals

    @tf.function
    def _batch_counts(self, images, labels):
        logits = self.model(images, training=False)
        k = min(5, self.num_classes)
        top1 = tf.math.in_top_k(labels, logits, 1)
        top5 = tf.math.in_top_k(labels, logits, k)
        counts = [tf.reduce_sum(tf.cast(t, tf.float64)) for t in (top1, top5)]
        return tf.stack(counts + [tf.cast(tf.size(labels), tf.float64)])


def epoch_plan(cfg, num_train: int, images_per_update: int, per_call: int = 1) -> int:
    """Updates per epoch: one pass over the train set, or train.steps_per_epoch,
    in whole calls of `per_call` updates."""
    updates = cfg.train.steps_per_epoch or max(1, num_train // images_per_update)
    return max(per_call, updates // per_call * per_call)
