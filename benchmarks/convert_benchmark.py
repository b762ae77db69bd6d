"""Conversion throughput: the project's converter vs a one-image-at-a-time one.

The reference decodes and re-encodes every image in one process, as the
classic ImageNet build scripts do. Both convert the same photo-sized JPEGs
(crops of scikit-learn's sample photographs) in this one invocation.

    python benchmarks/convert_benchmark.py [--images 400]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

import distrepro  # noqa: F401  (sets TF_USE_LEGACY_KERAS first)
from distrepro.data.convert import Record, records_of, to_example, write_dataset
from distrepro.data.raw import find_dataset

CLASSES = 10


def make_photos(raw_dir: Path, count: int, seed: int = 0) -> None:
    """Distinct ~500x375 JPEG crops of the sample photographs, ImageNet layout."""
    from sklearn.datasets import load_sample_images

    photos = load_sample_images().images
    rng = np.random.default_rng(seed)
    for i in range(count):
        photo = photos[i % len(photos)]
        y, x = rng.integers(0, photo.shape[0] - 375), rng.integers(0, photo.shape[1] - 500)
        crop = Image.fromarray(photo[y : y + 375, x : x + 500])
        for split in ("train", "val"):
            folder = raw_dir / split / f"n{i % CLASSES:08d}"
            folder.mkdir(parents=True, exist_ok=True)
            if split == "train" or i % 10 == 0:
                crop.save(folder / f"img_{i:05d}.JPEG", "JPEG", quality=90)


def reference_convert(records: list[Record], out_path: Path) -> None:
    """One image at a time: decode, re-encode, write."""
    import tensorflow as tf

    with tf.io.TFRecordWriter(str(out_path)) as writer:
        for record in records:
            image = tf.io.decode_jpeg(tf.io.read_file(record.path), channels=3)
            encoded = tf.io.encode_jpeg(image, quality=95).numpy()
            height, width = int(image.shape[0]), int(image.shape[1])
            writer.write(to_example(record, encoded, height, width))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_photos(tmp / "raw", args.images)
        dataset = find_dataset(tmp / "raw", tmp / "extracted")
        total = len(dataset.train) + len(dataset.validation)
        by_split = records_of(dataset)

        start = time.perf_counter()
        reference_convert(by_split["train"] + by_split["validation"], tmp / "reference.tfrecord")
        reference_s = time.perf_counter() - start

        start = time.perf_counter()
        write_dataset(dataset, tmp / "ours", "photos", {"train": 8, "validation": 2}, 0, False)
        ours_s = time.perf_counter() - start
    result = {
        "images": total,
        "reference_images_per_s": round(total / reference_s, 1),
        "project_images_per_s": round(total / ours_s, 1),
        "ratio": round(reference_s / ours_s, 2),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
