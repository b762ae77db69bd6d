"""Training input preprocessing per core: the project's against TF Model Garden's.

The reference restates the train branch of Model Garden's ResNet preprocessing
(official/legacy/image_classification/resnet/imagenet_preprocessing.py):
parse -> sample_distorted_bounding_box (area 0.05-1, 100 attempts) ->
decode_and_crop_jpeg -> flip -> bilinear resize to 224 -> mean subtraction.
Both read the same photo-sized JPEG TFRecords, one thread each, alternately
twice in this one invocation.

    python benchmarks/input_benchmark.py [--images 600] [--size 224]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from convert_benchmark import make_photos

import distrepro  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from distrepro.config import compose_config
from distrepro.prepare import prepare

MEANS = (123.68, 116.78, 103.94)


def model_garden_train(record, size: int):
    import tensorflow as tf

    features = tf.io.parse_single_example(
        record,
        {
            "image/encoded": tf.io.FixedLenFeature([], tf.string),
            "image/class/label": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    encoded = features["image/encoded"]
    begin, crop_size, _ = tf.image.sample_distorted_bounding_box(
        tf.image.extract_jpeg_shape(encoded),
        bounding_boxes=tf.constant([0.0, 0.0, 1.0, 1.0], shape=[1, 1, 4]),
        min_object_covered=0.1,
        aspect_ratio_range=[0.75, 1.33],
        area_range=[0.05, 1.0],
        max_attempts=100,
        use_image_if_no_bounding_boxes=True,
    )
    window = tf.stack([begin[0], begin[1], crop_size[0], crop_size[1]])
    image = tf.image.decode_and_crop_jpeg(encoded, window, channels=3)
    image = tf.image.random_flip_left_right(image)
    image = tf.compat.v1.image.resize(
        image, [size, size], method=tf.image.ResizeMethod.BILINEAR, align_corners=False
    )
    return image - MEANS, features["image/class/label"]


def one_thread(dataset):
    import tensorflow as tf

    options = tf.data.Options()
    options.threading.private_threadpool_size = 1
    options.threading.max_intra_op_parallelism = 1
    options.autotune.enabled = False
    return dataset.with_options(options)


def rate(dataset, count: int) -> float:
    """Images per second over `count` images, after one warm-up batch."""
    iterator = iter(dataset)
    next(iterator)
    start, seen = time.perf_counter(), 0
    while seen < count:
        seen += int(next(iterator)[1].shape[0])
    return seen / (time.perf_counter() - start)


def main() -> None:
    import tensorflow as tf

    from distrepro.training.inputs import make_dataset

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=600)
    parser.add_argument("--size", type=int, default=224)
    args = parser.parse_args()
    tf.config.threading.set_intra_op_parallelism_threads(1)
    tf.config.threading.set_inter_op_parallelism_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        make_photos(Path(tmp) / "raw", args.images)
        cfg = compose_config(
            [
                "data=imagenet",
                f"data.raw_dir={tmp}/raw",
                f"data.tfrecord_dir={tmp}/tfrecords",
                f"data.extract_dir={tmp}/extracted",
                f"data.image_size={args.size}",
                "data.train_shards=4",
                "data.val_shards=1",
                "prepare.verify=false",
            ]
        )
        prepare(cfg)
        files = sorted(str(p) for p in Path(tmp, "tfrecords").glob("train-*"))
        reference = (
            tf.data.TFRecordDataset(files)
            .repeat()
            .map(lambda r: model_garden_train(r, args.size))
            .batch(32)
        )
        project = make_dataset(cfg.data, "train", 32)
        rates = {"project": [], "model_garden": []}
        for _ in range(2):
            rates["project"].append(rate(one_thread(project), args.images))
            rates["model_garden"].append(rate(one_thread(reference), args.images))
    best = {name: max(values) for name, values in rates.items()}
    result = {
        "images_per_sec_one_thread": {k: [round(v, 1) for v in vs] for k, vs in rates.items()},
        "project_over_model_garden": round(best["project"] / best["model_garden"], 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
