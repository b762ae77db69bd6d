"""Write scikit-learn's digits as an ImageNet-layout raw dataset (no download).

`data.raw_dir/train/nXXXXXXXX/*.JPEG`, `val/nXXXXXXXX/*.JPEG` (a seeded,
stratified held-out split) and `LOC_synset_mapping.txt`, the class list.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import hydra
import numpy as np
from omegaconf import DictConfig
from PIL import Image

from distrepro import config  # noqa: F401  (registers the config schema)

DIGIT_NAMES = "zero one two three four five six seven eight nine".split()


def synset(digit: int) -> str:
    return f"n{digit:08d}"


def write_digits(raw_dir: Path, image_size: int, val_fraction: float, seed: int) -> None:
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = (digits.images * (255.0 / 16.0)).astype(np.uint8)
    indices = np.arange(len(pixels))
    train_idx, val_idx = train_test_split(
        indices, test_size=val_fraction, random_state=seed, stratify=digits.target
    )
    partial = raw_dir.with_name(raw_dir.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    for split, split_idx in (("train", train_idx), ("val", val_idx)):
        for i in sorted(split_idx):
            folder = partial / split / synset(int(digits.target[i]))
            folder.mkdir(parents=True, exist_ok=True)
            image = Image.fromarray(pixels[i]).convert("RGB")
            image = image.resize((image_size, image_size), Image.Resampling.BICUBIC)
            image.save(folder / f"digit_{i:05d}.JPEG", "JPEG", quality=95)
    mapping = "".join(f"{synset(d)} {name}\n" for d, name in enumerate(DIGIT_NAMES))
    (partial / "LOC_synset_mapping.txt").write_text(mapping)
    shutil.rmtree(raw_dir, ignore_errors=True)
    os.replace(partial, raw_dir)


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if cfg.data.name != "digits":
        raise SystemExit(f"distrepro.digits writes data=digits only, not data={cfg.data.name}")
    write_digits(Path(cfg.data.raw_dir), cfg.data.image_size, cfg.data.val_fraction, cfg.seed)
    print(f"wrote digits to {cfg.data.raw_dir}")


if __name__ == "__main__":
    main()
