"""Find the images and labels of a raw ImageNet-layout dataset.

Accepted under `raw_dir` (the forms ILSVRC2012 is really distributed in):
- train: `ILSVRC2012_img_train.tar` (a tar of one tar per synset) or
  `train/nXXXXXXXX/*.JPEG`;
- validation: `val/nXXXXXXXX/*` (sorted), or flat (`ILSVRC2012_img_val.tar`
  or `val/*.JPEG`) with labels from `LOC_val_solution.csv` (Kaggle) or a
  one-synset-per-line file in sorted file-name order (`*synset_labels*.txt`);
- class names, where present: `LOC_synset_mapping.txt`, `synset_words.txt`
  or `imagenet_metadata.txt`.
"""

from __future__ import annotations

import csv
import json
import os
import shutil
import tarfile
from dataclasses import dataclass
from pathlib import Path

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
VAL_DIRS = ("val", "validation")
KAGGLE_VAL_LABELS = "LOC_val_solution.csv"
SYNSET_TEXT_FILES = ("LOC_synset_mapping.txt", "synset_words.txt", "imagenet_metadata.txt")
EXTRACTED_FROM = ".extracted-from.json"  # the stamp of a finished extraction


class RawDataError(ValueError):
    """The raw dataset is missing, malformed, or unsafe to read."""


@dataclass(frozen=True)
class Image:
    path: Path
    synset: str


@dataclass(frozen=True)
class RawDataset:
    train: list[Image]
    validation: list[Image]
    synsets: list[str]
    synset_texts: dict[str, str]


def find_dataset(raw_dir: Path, extract_dir: Path) -> RawDataset:
    """Locate train/validation images under raw_dir, extracting tars if needed."""
    if not raw_dir.is_dir():
        raise RawDataError(f"data.raw_dir {str(raw_dir)!r} is not a directory")
    train = list_synset_tree(train_dir(raw_dir, extract_dir))
    synsets = sorted({image.synset for image in train})
    validation = list_validation(raw_dir, extract_dir)
    unknown = sorted({image.synset for image in validation} - set(synsets))
    if unknown:
        raise RawDataError(
            f"validation labels name synsets absent from the train set: {unknown[:5]}"
        )
    return RawDataset(train, validation, synsets, read_synset_texts(raw_dir))


def train_dir(raw_dir: Path, extract_dir: Path) -> Path:
    if (raw_dir / "train").is_dir():
        return raw_dir / "train"
    if (raw_dir / TRAIN_TAR).is_file():
        return extract_once(raw_dir / TRAIN_TAR, extract_dir / "train", nested=True)
    raise RawDataError(f"no train/ directory or {TRAIN_TAR} in data.raw_dir {str(raw_dir)!r}")


def list_synset_tree(root: Path) -> list[Image]:
    images = [
        Image(path, synset_dir.name)
        for synset_dir in sorted(p for p in root.iterdir() if p.is_dir())
        for path in sorted(synset_dir.iterdir())
        if path.is_file() and not path.name.startswith(".")
    ]
    if not images:
        raise RawDataError(f"no images in synset folders under {str(root)!r}")
    return images


def list_validation(raw_dir: Path, extract_dir: Path) -> list[Image]:
    val_dir = next((raw_dir / d for d in VAL_DIRS if (raw_dir / d).is_dir()), None)
    if val_dir is None and (raw_dir / VAL_TAR).is_file():
        val_dir = extract_once(raw_dir / VAL_TAR, extract_dir / "val", nested=False)
    if val_dir is None:
        raise RawDataError(f"no val/ directory or {VAL_TAR} in data.raw_dir {str(raw_dir)!r}")
    if any(p.is_dir() for p in val_dir.iterdir()):
        return list_synset_tree(val_dir)
    files = sorted(p for p in val_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    labels = read_val_labels(raw_dir, [p.name for p in files])
    return [Image(path, labels[path.name]) for path in files]


def read_val_labels(raw_dir: Path, filenames: list[str]) -> dict[str, str]:
    """Synset of each flat validation file, from the Kaggle CSV or a line file."""
    kaggle = raw_dir / KAGGLE_VAL_LABELS
    if kaggle.is_file():
        with kaggle.open(newline="") as f:
            by_id = {
                row["ImageId"]: row["PredictionString"].split()[0] for row in csv.DictReader(f)
            }
        missing = [name for name in filenames if Path(name).stem not in by_id]
        if missing:
            raise RawDataError(f"{kaggle}: no label for {missing[:5]}")
        return {name: by_id[Path(name).stem] for name in filenames}
    line_files = sorted(raw_dir.glob("*synset_labels*.txt"))
    if not line_files:
        raise RawDataError(
            f"flat validation images need labels: put {KAGGLE_VAL_LABELS} or a "
            f"*synset_labels*.txt file (one synset per line) in {str(raw_dir)!r}"
        )
    synsets = line_files[0].read_text().split()
    if len(synsets) != len(filenames):
        raise RawDataError(
            f"{line_files[0]}: {len(synsets)} labels for {len(filenames)} validation images"
        )
    return dict(zip(filenames, synsets, strict=True))


def read_synset_texts(raw_dir: Path) -> dict[str, str]:
    for name in SYNSET_TEXT_FILES:
        path = raw_dir / name
        if path.is_file():
            pairs = (line.split(None, 1) for line in path.read_text().splitlines() if line.strip())
            return {p[0]: (p[1].strip() if len(p) > 1 else "") for p in pairs}
    return {}


def extract_once(tar_path: Path, dest: Path, nested: bool) -> Path:
    """Safely extract tar_path into dest, unless dest already holds this tar's files.

    dest is reused only when its stamp names this very tar (resolved path,
    size, modification time); otherwise it is extracted anew beside it and
    swapped in whole. The stamp is written last, so a killed extraction never
    counts as finished. With nested=True, every member is itself a tar
    (`nXXXXXXXX.tar`) whose files go to `dest/nXXXXXXXX/`.
    """
    source = tar_source(tar_path)
    stamp = dest / EXTRACTED_FROM
    if stamp.is_file() and json.loads(stamp.read_text()) == source:
        return dest
    partial = dest.with_name(dest.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    with tarfile.open(tar_path, mode="r|*") as outer:
        for member in outer:
            check_member(tar_path, member)
            if not member.isfile():
                continue
            fileobj = outer.extractfile(member)
            if nested:
                subdir = partial / Path(member.name).name.removesuffix(".tar")
                with tarfile.open(fileobj=fileobj, mode="r|*") as inner:
                    for inner_member in inner:
                        check_member(Path(f"{tar_path}:{member.name}"), inner_member)
                        if inner_member.isfile():
                            write_member(inner, inner_member, subdir)
            else:
                write_member(outer, member, partial, fileobj)
    (partial / EXTRACTED_FROM).write_text(json.dumps(source))
    shutil.rmtree(dest, ignore_errors=True)
    os.replace(partial, dest)
    return dest


def tar_source(tar_path: Path) -> dict:
    """What identifies a tar for reuse of its extraction."""
    stat = tar_path.stat()
    return {"path": str(tar_path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def check_member(tar_path: Path, member: tarfile.TarInfo) -> None:
    name = member.name
    if not (member.isfile() or member.isdir()):
        raise RawDataError(
            f"{tar_path}: refusing member {name!r}: links and devices are not allowed"
        )
    if os.path.isabs(name) or ".." in Path(name).parts:
        raise RawDataError(
            f"{tar_path}: refusing member {name!r}: it would land outside the target"
        )


def write_member(tar: tarfile.TarFile, member: tarfile.TarInfo, dest: Path, fileobj=None) -> None:
    """Write one file member flat into dest (tar-internal folders are dropped)."""
    dest.mkdir(parents=True, exist_ok=True)
    source = fileobj or tar.extractfile(member)
    with open(dest / Path(member.name).name, "wb") as out:
        shutil.copyfileobj(source, out)
