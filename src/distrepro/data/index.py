"""Adopt ImageNet-schema TFRecords made elsewhere: write the missing metadata.json.

Shards from the classic converters (`build_imagenet_data.py`,
`imagenet_to_gcs.py`) come without the converter's `metadata.json`. Each shard
is read once, in a process pool: its records counted, their framing and labels
checked. No shard is rewritten.
"""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter
from pathlib import Path

from tqdm import tqdm

from distrepro.atomic import write_json_atomically
from distrepro.data.convert import LABEL_OFFSET, SPLITS, shard_name
from distrepro.data.tfrecord import parse_example, read_records

LABEL = "image/class/label"
SYNSET = "image/class/synset"
ENCODED = "image/encoded"


class ShardError(ValueError):
    """A shard that is missing, does not parse or holds a label out of range."""


def find_shards(tfrecord_dir: Path) -> dict[str, list[Path]]:
    """Each split's complete `SPLIT-NNNNN-of-NNNNN` shard list."""
    found = {}
    for split in SPLITS:
        shards = sorted(tfrecord_dir.glob(f"{split}-*-of-*"))
        if not shards:
            raise ShardError(
                f"data.tfrecord_dir={str(tfrecord_dir)!r} has no {split}-*-of-* shards"
            )
        totals = {int(path.name.rsplit("-of-", 1)[1]) for path in shards}
        expected = {shard_name(split, i, n) for n in totals for i in range(n)}
        missing = sorted(expected - {path.name for path in shards})
        if len(totals) > 1 or missing:
            raise ShardError(
                f"{tfrecord_dir}: the {split} shards are incomplete "
                f"(missing {missing[:3] or 'none'}, shard counts {sorted(totals)})"
            )
        found[split] = shards
    return found


def scan_shard(path: str) -> tuple[str, int, Counter, dict[int, str]]:
    """(path, records, label counts, synset of each label seen) of one shard."""
    labels: Counter = Counter()
    synsets: dict[int, str] = {}
    for number, record in enumerate(read_records(path)):
        try:
            features = parse_example(record, {LABEL, SYNSET, ENCODED})
        except ValueError as error:
            raise ShardError(f"{path}: record {number} is not an Example ({error})") from None
        if ENCODED not in features or len(features.get(LABEL, [])) != 1:
            raise ShardError(f"{path}: record {number} lacks {ENCODED} or a single {LABEL}")
        (label,) = features[LABEL]
        labels[label] += 1
        if features.get(SYNSET):
            synsets[label] = features[SYNSET][0].decode()
    return path, labels.total(), labels, synsets


def check_shard(path: str) -> str | None:
    """What is wrong with one shard's framing, or None."""
    try:
        for _ in read_records(path):
            pass
    except (OSError, ValueError) as error:
        return str(error)
    return None


def damaged_shards(tfrecord_dir: Path, processes: int = 0) -> list[str]:
    """`path: what is wrong` for every shard that does not read to its end."""
    paths = sorted(str(p) for split in SPLITS for p in tfrecord_dir.glob(f"{split}-*-of-*"))
    with multiprocessing.get_context("spawn").Pool(processes or os.cpu_count()) as pool:
        return [problem for problem in pool.map(check_shard, paths) if problem]


def index_dir(tfrecord_dir: Path, name: str, num_classes: int, processes: int = 0) -> dict:
    """Scan every shard and write tfrecord_dir/metadata.json; return it."""
    shards = find_shards(tfrecord_dir)
    low, high = LABEL_OFFSET, num_classes + LABEL_OFFSET - 1
    images = dict.fromkeys(SPLITS, 0)
    synsets: dict[int, str] = {}
    paths = [str(path) for split in SPLITS for path in shards[split]]
    context = multiprocessing.get_context("spawn")
    with context.Pool(processes or os.cpu_count()) as pool:
        results = pool.imap_unordered(scan_shard, paths)
        for path, count, labels, seen in tqdm(
            results, total=len(paths), desc=f"indexing {name}", unit="shard"
        ):
            bad = sorted(label for label in labels if not low <= label <= high)
            if bad:
                raise ShardError(
                    f"{path}: labels {bad[:5]} outside [{low}, {high}] "
                    f"(data.num_classes={num_classes}, labels are 1-based)"
                )
            images[Path(path).name.split("-")[0]] += count
            synsets.update(seen)
    metadata = {
        "dataset": name,
        "num_classes": num_classes,
        "label_offset": LABEL_OFFSET,
        "classes": [
            {"label": label, "synset": synset, "text": ""}
            for label, synset in sorted(synsets.items())
        ],
        "splits": {
            split: {"images": images[split], "shards": len(shards[split])} for split in SPLITS
        },
        "skipped": [],
        "seed": None,
        "indexed_from_existing_shards": True,
    }
    write_json_atomically(tfrecord_dir / "metadata.json", metadata)
    return metadata
