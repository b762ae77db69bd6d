"""Hydra app: raw images (data.raw_dir) -> TFRecords (data.tfrecord_dir).

`prepare.index_only=true` adopts standard-schema shards already in
data.tfrecord_dir (made by another converter): it writes their metadata.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from distrepro import config  # noqa: F401  (registers the config schema)
from distrepro.data.convert import BadImageError, verify_dir, write_dataset
from distrepro.data.index import index_dir
from distrepro.data.raw import RawDataError, find_dataset
from distrepro.digits import write_digits


def prepare(cfg: DictConfig) -> dict:
    data = cfg.data
    out_dir = Path(data.tfrecord_dir)
    if cfg.prepare.index_only:
        return index_dir(out_dir, data.name, data.num_classes, cfg.prepare.processes)
    if data.name == "digits" and not Path(data.raw_dir).exists():
        print(f"prepare: writing the embedded digits dataset to {data.raw_dir}")
        write_digits(Path(data.raw_dir), data.image_size, data.val_fraction, cfg.seed)
    dataset = find_dataset(Path(data.raw_dir), Path(data.extract_dir))
    metadata = write_dataset(
        dataset,
        out_dir,
        name=data.name,
        shards={"train": data.train_shards, "validation": data.val_shards},
        seed=cfg.seed,
        skip_bad=data.on_bad_image.name == "skip",
        processes=cfg.prepare.processes,
    )
    if cfg.prepare.verify:
        verify_dir(out_dir)
    return metadata


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        metadata = prepare(cfg)
    except (RawDataError, BadImageError, ValueError) as error:
        raise SystemExit(f"prepare: {error}") from None
    print(json.dumps(metadata["splits"]), "skipped:", len(metadata["skipped"]))


if __name__ == "__main__":
    main()
