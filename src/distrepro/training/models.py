"""ResNet-50 (tf_keras.applications) and a small CIFAR-style ResNet for CPUs."""

from __future__ import annotations

import tf_keras as keras
from tf_keras import layers


def basic_block(x, width: int, stride: int):
    shortcut = x
    y = layers.Conv2D(width, 3, stride, padding="same", use_bias=False)(x)
    y = layers.ReLU()(layers.BatchNormalization(momentum=0.9)(y))
    y = layers.Conv2D(width, 3, padding="same", use_bias=False)(y)
    y = layers.BatchNormalization(momentum=0.9)(y)
    if stride != 1 or shortcut.shape[-1] != width:
        shortcut = layers.Conv2D(width, 1, stride, use_bias=False)(shortcut)
        shortcut = layers.BatchNormalization(momentum=0.9)(shortcut)
    return layers.ReLU()(y + shortcut)


def small_resnet(inputs, blocks_per_stage, base_width: int):
    x = layers.Conv2D(base_width, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization(momentum=0.9)(x))
    for stage, blocks in enumerate(blocks_per_stage):
        for block in range(blocks):
            x = basic_block(x, base_width * 2**stage, 2 if stage and not block else 1)
    return layers.GlobalAveragePooling2D()(x)


MEAN_RGB = (0.485 * 255, 0.456 * 255, 0.406 * 255)
STDDEV_RGB = (0.229 * 255, 0.224 * 255, 0.225 * 255)


def build_model(model_cfg, image_size: int, num_classes: int) -> keras.Model:
    """0-255 images in, normalized here; logits in float32 whatever the
    precision policy (for a stable loss)."""
    pixels = keras.Input((image_size, image_size, 3))
    inputs = layers.Rescaling(
        [1 / s for s in STDDEV_RGB], [-m / s for m, s in zip(MEAN_RGB, STDDEV_RGB, strict=True)]
    )(pixels)
    if model_cfg.name == "resnet50":
        backbone = keras.applications.ResNet50(
            include_top=False, weights=None, input_tensor=inputs, pooling="avg"
        )
        features = backbone.output
    else:
        features = small_resnet(inputs, model_cfg.blocks_per_stage, model_cfg.base_width)
    logits = layers.Dense(num_classes, dtype="float32", name="logits")(features)
    return keras.Model(pixels, logits, name=model_cfg.name)


def restored_model(cfg, num_classes: int, checkpoint: str) -> keras.Model:
    """The run's model, outside any strategy, with the weights of one of its
    checkpoints (RunFiles' `model`)."""
    import tensorflow as tf

    model = build_model(cfg.model, cfg.data.image_size, num_classes)
    tf.train.Checkpoint(model=model).read(checkpoint).expect_partial()
    return model
