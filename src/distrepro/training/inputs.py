"""Input pipeline over ImageNet-schema TFRecords.

list files -> shard by worker -> interleave records -> parse ->
decode-and-crop -> augment -> batch -> prefetch. Pixels leave it as 0-255
floats: the model normalizes them on its own device, which costs the host's
cores (the bottleneck of an 8-GPU machine) nothing.
"""

from __future__ import annotations

import json
from pathlib import Path

import tensorflow as tf

EVAL_CROP_FRACTION = 0.875


def read_metadata(tfrecord_dir: str) -> dict:
    path = Path(tfrecord_dir) / "metadata.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"data.tfrecord_dir={tfrecord_dir!r} has no metadata.json: "
            "run `python -m distrepro.prepare` (or `dvc repro`) first"
        )
    return json.loads(path.read_text())


def parse(record: tf.Tensor) -> tuple[tf.Tensor, tf.Tensor]:
    features = tf.io.parse_single_example(
        record,
        {
            "image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    return features["image/encoded"], tf.cast(features["image/class/label"], tf.int32) - 1


def random_crop(encoded: tf.Tensor, size: int, min_area: float, flip: bool, seed: int) -> tf.Tensor:
    """Random-resized crop (decoding only the crop), then an optional flip.
    The op seed (never 0, which TensorFlow's op determinism refuses) and the
    global seed together fix the sequence of crops."""
    shape = tf.image.extract_jpeg_shape(encoded)
    begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
        shape,
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.1,
        aspect_ratio_range=(3 / 4, 4 / 3),
        area_range=(min_area, 1.0),
        max_attempts=10,
        use_image_if_no_bounding_boxes=True,
        seed=seed + 1,
    )
    window = tf.stack([begin[0], begin[1], crop_size[0], crop_size[1]])
    image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3)
    image = tf.image.resize(image, [size, size])
    return tf.image.random_flip_left_right(image, seed=seed + 1) if flip else image


def center_crop(encoded: tf.Tensor, size: int) -> tf.Tensor:
    """Resize the shorter side to size / 0.875, then take the central square."""
    image = tf.cast(tf.io.decode_jpeg(encoded, channels=3), tf.float32)
    shape = tf.cast(tf.shape(image)[:2], tf.float32)
    scale = size / EVAL_CROP_FRACTION / tf.reduce_min(shape)
    image = tf.image.resize(image, tf.cast(tf.round(shape * scale), tf.int32))
    return tf.image.resize_with_crop_or_pad(image, size, size)


def make_dataset(
    data_cfg, split: str, batch_size: int, index: int = 0, count: int = 1, seed: int = 0
) -> tf.data.Dataset:
    """Batches of (0-255 image, 0-based label) for worker `index` of `count`:
    its share of the files, or of the records when there are fewer files than
    workers, shuffled by its own seed. Under the parameter server, whose
    workers all run one traced function, index is a tensor (TensorFlow's
    current worker index), which cannot be a seed: there the workers differ
    by their shares alone."""
    training = split == "train"
    names = sorted(str(p) for p in Path(data_cfg.tfrecord_dir).glob(f"{split}-*-of-*"))
    files = tf.data.Dataset.from_tensor_slices(names)
    if len(names) >= count:
        files = files.shard(count, index)
    worker_seed = seed + index if isinstance(index, int) else seed
    if training:
        files = files.shuffle(len(names), seed=worker_seed).repeat()
    records = files.interleave(
        tf.data.TFRecordDataset,
        cycle_length=4,
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=not training,
    )
    if len(names) < count:
        records = records.shard(count, index)
    if training:
        records = records.shuffle(1024, seed=worker_seed)

    def preprocess(record):
        encoded, label = parse(record)
        if training:
            image = random_crop(
                encoded,
                data_cfg.image_size,
                data_cfg.min_crop_area,
                data_cfg.random_flip,
                worker_seed,
            )
        else:
            image = center_crop(encoded, data_cfg.image_size)
        return image, label

    batches = records.map(preprocess, num_parallel_calls=tf.data.AUTOTUNE)
    return batches.batch(batch_size, drop_remainder=training).prefetch(tf.data.AUTOTUNE)
