"""The data stage: raw ILSVRC2012 forms -> ImageNet-schema TFRecords."""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    SYNSETS,
    TEXTS,
    add_bytes,
    jpeg_bytes,
    photo,
    train_images,
    val_images,
    write_train_tar,
)
from PIL import Image

from distrepro.config import compose_config
from distrepro.data.convert import BadImageError, verify_dir
from distrepro.data.raw import EXTRACTED_FROM, TRAIN_TAR, RawDataError
from distrepro.prepare import prepare

FEATURES = {
    "image/encoded": tf.io.FixedLenFeature([], tf.string),
    "image/format": tf.io.FixedLenFeature([], tf.string),
    "image/colorspace": tf.io.FixedLenFeature([], tf.string),
    "image/channels": tf.io.FixedLenFeature([], tf.int64),
    "image/height": tf.io.FixedLenFeature([], tf.int64),
    "image/width": tf.io.FixedLenFeature([], tf.int64),
    "image/filename": tf.io.FixedLenFeature([], tf.string),
    "image/class/label": tf.io.FixedLenFeature([], tf.int64),
    "image/class/synset": tf.io.FixedLenFeature([], tf.string),
    "image/class/text": tf.io.FixedLenFeature([], tf.string),
}


def overrides(raw: Path, out: Path, *extra: str, extract_dir: Path | None = None) -> list[str]:
    return [
        "data=imagenet",
        f"data.raw_dir={raw}",
        f"data.tfrecord_dir={out}",
        f"data.extract_dir={extract_dir or raw.parent / (raw.name + '_extracted')}",
        "data.train_shards=3",
        "data.val_shards=2",
        "prepare.processes=2",
        *extra,
    ]


def config_for(raw: Path, out: Path, *extra: str):
    return compose_config(overrides(raw, out, *extra))


def read_split(out: Path, split: str) -> list[dict]:
    shards = sorted(out.glob(f"{split}-*-of-*"))
    records = []
    for raw in tf.data.TFRecordDataset([str(s) for s in shards]):
        parsed = tf.io.parse_single_example(raw, FEATURES)
        records.append({k: v.numpy() for k, v in parsed.items()})
    return records


def check_records(out: Path) -> None:
    expected_train = {
        name: data for files in train_images().values() for name, data in files.items()
    }
    train = read_split(out, "train")
    assert sorted(r["image/filename"].decode() for r in train) == sorted(expected_train)
    for record in train:
        name = record["image/filename"].decode()
        synset = name.split("_")[0]
        assert record["image/class/synset"].decode() == synset
        assert record["image/class/label"] == SYNSETS.index(synset) + 1
        assert record["image/class/text"].decode() == TEXTS[synset]
        assert record["image/format"] == b"JPEG" and record["image/colorspace"] == b"RGB"
        image = tf.io.decode_jpeg(record["image/encoded"]).numpy()
        assert image.shape == (record["image/height"], record["image/width"], 3)
        assert record["image/channels"] == 3
        odd = any(k in name for k in ("cmyk", "gray", "png"))
        assert (record["image/encoded"] == expected_train[name]) is not odd
    val = read_split(out, "validation")
    labels = {name: synset for name, synset, _ in val_images()}
    assert len(val) == len(labels)
    for record in val:
        synset = labels[record["image/filename"].decode()]
        assert record["image/class/synset"].decode() == synset
        assert record["image/class/label"] == SYNSETS.index(synset) + 1
    metadata = json.loads((out / "metadata.json").read_text())
    assert metadata["splits"]["train"] == {"images": len(expected_train), "shards": 3}
    assert metadata["splits"]["validation"] == {"images": len(labels), "shards": 2}
    assert [c["synset"] for c in metadata["classes"]] == SYNSETS
    assert metadata["label_offset"] == 1


@pytest.mark.parametrize(
    "train_form, val_form",
    [("tar", "kaggle_tar"), ("tree", "lines_flat"), ("tree", "sorted")],
)
def test_each_raw_form_converts_to_the_imagenet_schema(raw_factory, tmp_path, train_form, val_form):
    raw = raw_factory(train_form, val_form)
    prepare(config_for(raw, tmp_path / "tfrecords"))
    check_records(tmp_path / "tfrecords")


def test_rerun_is_byte_identical(raw_factory, tmp_path):
    raw = raw_factory("tar", "kaggle_tar")
    for out in ("a", "b"):
        prepare(config_for(raw, tmp_path / out))
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name


def test_undecodable_file_stops_the_run_naming_it(raw_factory, tmp_path):
    raw = raw_factory()
    bad = raw / "train" / SYNSETS[1] / "truncated.JPEG"
    bad.write_bytes((raw / "train" / SYNSETS[1] / f"{SYNSETS[1]}_0.JPEG").read_bytes()[:300])
    out = tmp_path / "tfrecords"
    with pytest.raises(BadImageError, match="truncated.JPEG"):
        prepare(config_for(raw, out))
    assert not (out / "metadata.json").exists()
    assert not list(out.glob(".*.tmp"))
    for shard in out.glob("*-of-*"):
        assert len(read_split(out, shard.name.split("-")[0])) > 0

    metadata = prepare(config_for(raw, out, "data.on_bad_image=skip"))
    assert metadata["skipped"] == [str(bad)]
    assert verify_dir(out)["train"] == sum(len(f) for f in train_images().values())


def evil_tar(path: Path, kind: str) -> None:
    with tarfile.open(path, "w") as tar:
        if kind == "dotdot":
            add_bytes(tar, "../../escaped.JPEG", b"x")
        elif kind == "absolute":
            add_bytes(tar, "/tmp/escaped.JPEG", b"x")
        else:
            link = tarfile.TarInfo("link.JPEG")
            link.type = tarfile.SYMTYPE
            link.linkname = "/etc/passwd"
            tar.addfile(link)


@pytest.mark.parametrize("kind", ["dotdot", "absolute", "symlink"])
def test_tar_members_outside_the_target_are_refused(raw_factory, tmp_path, kind):
    raw = raw_factory("tree", "sorted")
    shutil.rmtree(raw / "val")
    evil_tar(raw / "ILSVRC2012_img_val.tar", kind)
    with pytest.raises(RawDataError, match="refusing member"):
        prepare(config_for(raw, tmp_path / "tfrecords"))
    assert not list(tmp_path.rglob("escaped.JPEG"))
    assert not (tmp_path / "raw_extracted" / "val").exists()


def test_a_killed_conversion_leaves_no_shard_that_looks_whole(raw_factory, tmp_path):
    raw = raw_factory()
    big = raw / "train" / SYNSETS[2]
    for i in range(400):
        pixels = np.random.default_rng(i).integers(0, 255, (256, 256, 3), dtype=np.uint8)
        out = io.BytesIO()
        Image.fromarray(pixels).save(out, "JPEG", quality=95)
        (big / f"big_{i}.JPEG").write_bytes(out.getvalue())
    out = tmp_path / "tfrecords"
    args = overrides(raw, out, "prepare.processes=1", "data.train_shards=2")
    proc = subprocess.Popen(
        [sys.executable, "-m", "distrepro.prepare", *args], start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while not list(out.glob(".train-*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert list(out.glob(".train-*.tmp")), "conversion never started a shard"
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert not (out / "metadata.json").exists()
    read_split(out, "train")  # every shard that is visible reads to its end
    with pytest.raises(ValueError, match="metadata.json"):
        verify_dir(out)


def test_a_tar_extraction_is_redone_when_its_source_changes(raw_factory, tmp_path):
    first, second = (raw_factory("tar", "kaggle_tar", name) for name in ("first", "second"))
    changed = train_images()
    changed[SYNSETS[1]]["only_in_the_new_tar.JPEG"] = jpeg_bytes(photo(77))
    write_train_tar(second / TRAIN_TAR, changed)
    extract_dir = tmp_path / "extracted"
    new_image = extract_dir / "train" / SYNSETS[1] / "only_in_the_new_tar.JPEG"

    def train_files(raw: Path, out: str) -> set[str]:
        prepare(compose_config(overrides(raw, tmp_path / out, extract_dir=extract_dir)))
        return {r["image/filename"].decode() for r in read_split(tmp_path / out, "train")}

    assert "only_in_the_new_tar.JPEG" not in train_files(first, "a")
    assert "only_in_the_new_tar.JPEG" in train_files(second, "b"), "another tar, same folder"
    assert "only_in_the_new_tar.JPEG" not in train_files(first, "c"), "back to the first tar"

    write_train_tar(first / TRAIN_TAR, changed)  # a damaged tar replaced in place
    assert "only_in_the_new_tar.JPEG" in train_files(first, "d")
    extracted_at = new_image.stat().st_mtime_ns
    time.sleep(0.01)
    assert "only_in_the_new_tar.JPEG" in train_files(first, "e")
    assert new_image.stat().st_mtime_ns == extracted_at, "an unchanged tar was extracted again"


def test_an_interrupted_extraction_is_not_taken_as_finished(raw_factory, tmp_path):
    raw = raw_factory("tar", "kaggle_tar")
    prepare(config_for(raw, tmp_path / "a"))
    extracted = tmp_path / "raw_extracted" / "train"
    (extracted / EXTRACTED_FROM).unlink()  # as if killed before the stamp was written
    for image in (extracted / SYNSETS[2]).iterdir():
        image.unlink()
    prepare(config_for(raw, tmp_path / "b"))
    check_records(tmp_path / "b")


def test_prepare_digits_writes_the_embedded_raw_data_when_missing(tmp_path):
    raw, out = tmp_path / "raw" / "digits", tmp_path / "tfrecords"
    cfg = compose_config(
        ["data=digits", f"data.raw_dir={raw}", f"data.tfrecord_dir={out}", "prepare.processes=2"]
    )
    metadata = prepare(cfg)
    assert sorted(p.name for p in (raw / "train").iterdir()) == [f"n{d:08d}" for d in range(10)]
    assert (
        metadata["splits"]["train"]["images"] + metadata["splits"]["validation"]["images"] == 1797
    )
    assert verify_dir(out)["validation"] == metadata["splits"]["validation"]["images"]


def write_plain_shards(out: Path, split: str, labels_per_shard: list[list[int]]) -> None:
    """Shards as the classic converters write them: tf.io.TFRecordWriter, standard keys only."""
    out.mkdir(parents=True, exist_ok=True)
    image = tf.io.encode_jpeg(tf.zeros([8, 8, 3], tf.uint8)).numpy()
    for i, labels in enumerate(labels_per_shard):
        name = out / f"{split}-{i:05d}-of-{len(labels_per_shard):05d}"
        with tf.io.TFRecordWriter(str(name)) as writer:
            for label in labels:
                feature = {
                    "image/encoded": tf.train.Feature(bytes_list=tf.train.BytesList(value=[image])),
                    "image/class/label": tf.train.Feature(
                        int64_list=tf.train.Int64List(value=[label])
                    ),
                    "image/class/synset": tf.train.Feature(
                        bytes_list=tf.train.BytesList(value=[f"n{label:08d}".encode()])
                    ),
                }
                example = tf.train.Example(features=tf.train.Features(feature=feature))
                writer.write(example.SerializeToString())


def index_config(out: Path, *extra: str):
    return compose_config(
        [
            "data=imagenet",
            f"data.tfrecord_dir={out}",
            "data.num_classes=3",
            "prepare.index_only=true",
            "prepare.processes=2",
            *extra,
        ]
    )


def test_shards_made_elsewhere_are_indexed_without_rewriting_them(tmp_path):
    out = tmp_path / "tfrecords"
    write_plain_shards(out, "train", [[1, 2, 3, 1], [2, 3, 3]])
    write_plain_shards(out, "validation", [[1, 2, 3]])
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    from distrepro.launch import ConfigError, validate

    with pytest.raises(ConfigError, match="prepare.index_only=true"):
        validate(index_config(out))
    metadata = prepare(index_config(out))
    assert metadata["splits"] == {
        "train": {"images": 7, "shards": 2},
        "validation": {"images": 3, "shards": 1},
    }
    assert [c["synset"] for c in metadata["classes"]] == ["n00000001", "n00000002", "n00000003"]
    assert json.loads((out / "metadata.json").read_text()) == metadata
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name in before} == before
    assert verify_dir(out) == {"train": 7, "validation": 3}
    validate(index_config(out))


@pytest.mark.parametrize(
    "damage", ["label", "truncated", "missing_shard", "no_validation", "not_imagenet"]
)
def test_indexing_refuses_bad_shards_naming_them(tmp_path, damage):
    out = tmp_path / "tfrecords"
    write_plain_shards(out, "train", [[1, 2], [3, 4 if damage == "label" else 1]])
    if damage != "no_validation":
        write_plain_shards(out, "validation", [[1, 2, 3]])
    shard = out / "train-00001-of-00002"
    if damage == "truncated":
        shard.write_bytes(shard.read_bytes()[:-30])
    if damage == "missing_shard":
        shard.unlink()
    if damage == "not_imagenet":
        with tf.io.TFRecordWriter(str(shard)) as writer:
            writer.write(tf.train.Example().SerializeToString())
    expected = {"no_validation": "no validation-", "missing_shard": "train-00001-of-00002"}
    with pytest.raises(ValueError, match=expected.get(damage, str(shard))):
        prepare(index_config(out))
    assert not (out / "metadata.json").exists()
