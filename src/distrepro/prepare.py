"""Hydra app: raw images (data.raw_dir) -> TFRecords (data.tfrecord_dir)."""

from __future__ import annotations

import json
from pathlib import Path

import hydra
from omegaconf import DictConfig

from distrepro import config  # noqa: F401  (registers the config schema)
from distrepro.data.convert import BadImageError, verify_dir, write_dataset
from distrepro.data.raw import RawDataError, find_dataset


def prepare(cfg: DictConfig) -> dict:
    data = cfg.data
    out_dir = Path(data.tfrecord_dir)
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
