"""Write raw images as sharded TFRecords in the standard ImageNet schema.

Good RGB JPEG bytes pass through untouched (checked by a fast reduced-scale
decode); CMYK, grayscale and non-JPEG files are re-encoded as RGB JPEG.
Shards are written under a hidden temporary name and renamed when whole;
`metadata.json` is written last, so its presence marks a finished directory.
"""

from __future__ import annotations

import io
import json
import multiprocessing
import os
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image as PILImage
from tqdm import tqdm

from distrepro.atomic import write_json_atomically
from distrepro.data.raw import RawDataset
from distrepro.data.tfrecord import example, write_record

LABEL_OFFSET = 1  # labels are 1-based over the sorted synsets; 0 is background
SPLITS = ("train", "validation")
JPEG_QUALITY = 95


class BadImageError(ValueError):
    """An input image could not be decoded."""


@dataclass(frozen=True)
class Record:
    path: str
    synset: str
    label: int
    text: str


@dataclass(frozen=True)
class ShardTask:
    out_path: str
    records: list[Record]
    skip_bad: bool


def shard_name(split: str, index: int, num_shards: int) -> str:
    return f"{split}-{index:05d}-of-{num_shards:05d}"


def plan_shards(records: list[Record], num_shards: int, seed: int, key: str) -> list[list[Record]]:
    """Seeded shuffle, then near-equal contiguous shards."""
    if not 1 <= num_shards <= len(records):
        raise ValueError(f"{key}={num_shards} must be between 1 and the {len(records)} images")
    shuffled = list(records)
    random.Random(seed).shuffle(shuffled)
    bounds = [round(i * len(shuffled) / num_shards) for i in range(num_shards + 1)]
    return [shuffled[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


def rgb_jpeg(data: bytes, name: str) -> tuple[bytes, int, int]:
    """(JPEG bytes, height, width): good RGB JPEGs as they are, others re-encoded."""
    try:
        with PILImage.open(io.BytesIO(data)) as image:
            width, height = image.size
            if image.format == "JPEG" and image.mode == "RGB":
                image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
                image.load()
                return data, height, width
            out = io.BytesIO()
            image.convert("RGB").save(out, "JPEG", quality=JPEG_QUALITY)
            return out.getvalue(), height, width
    except (OSError, ValueError, SyntaxError) as error:
        raise BadImageError(f"cannot decode image {name}: {error}") from error


def to_example(record: Record, encoded: bytes, height: int, width: int) -> bytes:
    return example(
        {
            "image/encoded": encoded,
            "image/format": "JPEG",
            "image/colorspace": "RGB",
            "image/channels": 3,
            "image/height": height,
            "image/width": width,
            "image/filename": Path(record.path).name,
            "image/class/label": record.label,
            "image/class/synset": record.synset,
            "image/class/text": record.text,
        }
    )


def write_shard(task: ShardTask) -> tuple[int, list[str]]:
    """Write one shard atomically; return (records written, skipped files)."""
    out = Path(task.out_path)
    tmp = out.with_name(f".{out.name}.tmp")
    written, skipped = 0, []
    try:
        with open(tmp, "wb") as writer:
            for record in task.records:
                try:
                    encoded, height, width = rgb_jpeg(Path(record.path).read_bytes(), record.path)
                except BadImageError:
                    if not task.skip_bad:
                        raise
                    skipped.append(record.path)
                    continue
                write_record(writer, to_example(record, encoded, height, width))
                written += 1
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return written, skipped


def records_of(dataset: RawDataset) -> dict[str, list[Record]]:
    labels = {synset: i + LABEL_OFFSET for i, synset in enumerate(dataset.synsets)}
    texts = dataset.synset_texts

    def records(images):
        return [
            Record(str(im.path), im.synset, labels[im.synset], texts.get(im.synset, ""))
            for im in images
        ]

    return {"train": records(dataset.train), "validation": records(dataset.validation)}


def write_dataset(
    dataset: RawDataset,
    out_dir: Path,
    name: str,
    shards: dict[str, int],
    seed: int,
    skip_bad: bool,
    processes: int = 0,
) -> dict:
    """Convert both splits into out_dir; return the metadata written."""
    by_split = records_of(dataset)
    plans = {
        split: plan_shards(by_split[split], shards[split], seed, f"data.{key}")
        for split, key in (("train", "train_shards"), ("validation", "val_shards"))
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "metadata.json").unlink(missing_ok=True)
    tasks = [
        ShardTask(str(out_dir / shard_name(split, i, len(plan))), records, skip_bad)
        for split, plan in plans.items()
        for i, records in enumerate(plan)
    ]
    counts = {split: 0 for split in SPLITS}
    skipped: list[str] = []
    context = multiprocessing.get_context("spawn")
    try:
        with context.Pool(processes or os.cpu_count()) as pool:
            results = pool.imap(write_shard, tasks)
            for task, (written, bad) in tqdm(
                zip(tasks, results, strict=True),
                total=len(tasks),
                desc=f"{name} shards",
                unit="shard",
            ):
                counts[Path(task.out_path).name.split("-")[0]] += written
                skipped.extend(bad)
    except BaseException:
        # Leaving the pool terminates the workers still writing, before their own cleanup runs.
        remove_temporaries(out_dir)
        raise
    remove_stale_shards(out_dir, {Path(t.out_path).name for t in tasks})
    metadata = {
        "dataset": name,
        "num_classes": len(dataset.synsets),
        "label_offset": LABEL_OFFSET,
        "classes": [
            {"label": i + LABEL_OFFSET, "synset": s, "text": dataset.synset_texts.get(s, "")}
            for i, s in enumerate(dataset.synsets)
        ],
        "splits": {
            split: {"images": counts[split], "shards": len(plans[split])} for split in SPLITS
        },
        "skipped": sorted(skipped),
        "seed": seed,
    }
    write_json_atomically(out_dir / "metadata.json", metadata)
    return metadata


def remove_stale_shards(out_dir: Path, keep: set[str]) -> None:
    """Drop shards of an earlier shard count and temporaries of a killed run."""
    remove_temporaries(out_dir)
    for split in SPLITS:
        for path in out_dir.glob(f"{split}-*-of-*"):
            if path.name not in keep:
                path.unlink()


def remove_temporaries(out_dir: Path) -> None:
    for split in SPLITS:
        for path in out_dir.glob(f".{split}-*.tmp"):
            path.unlink(missing_ok=True)


def verify_dir(out_dir: Path) -> dict[str, int]:
    """Read every record back, decode every image; return images per split."""
    import tensorflow as tf

    metadata_path = out_dir / "metadata.json"
    if not metadata_path.is_file():
        raise ValueError(f"{out_dir} has no metadata.json: conversion did not finish")
    metadata = json.loads(metadata_path.read_text())
    low, high = LABEL_OFFSET, metadata["num_classes"] + LABEL_OFFSET - 1
    counts = {}
    for split, info in metadata["splits"].items():
        counts[split] = 0
        for i in range(info["shards"]):
            shard = out_dir / shard_name(split, i, info["shards"])
            for raw in tf.data.TFRecordDataset(str(shard)):
                example = tf.io.parse_single_example(
                    raw,
                    {
                        "image/encoded": tf.io.FixedLenFeature([], tf.string),
                        "image/class/label": tf.io.FixedLenFeature([], tf.int64),
                    },
                )
                label = int(example["image/class/label"])
                if not low <= label <= high:
                    raise ValueError(f"{shard}: label {label} outside [{low}, {high}]")
                tf.io.decode_jpeg(example["image/encoded"], channels=3)
                counts[split] += 1
        if counts[split] != info["images"]:
            raise ValueError(
                f"{out_dir}: {split} has {counts[split]} records, metadata says {info['images']}"
            )
    return counts
