"""The check a GPU user runs (`make gpu-check`): the seed's setting, briefly.

ResNet-50 at 224 px, mixed fp16, 256 images per GPU, a few hundred steps of
each strategy on all of this machine's GPUs, on ImageNet-shaped TFRecords of
generated photos. Prints img/s per GPU of every strategy, the ratios the
report compares, and the GPU each training process used as `nvidia-smi` saw it.

    python benchmarks/gpu_check.py [--steps 200] [--images 2560]
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import psutil
from convert_benchmark import make_photos

from distrepro.devices import host_gpus
from distrepro.strategies import COMPARED, REGISTRY

REPO = Path(__file__).resolve().parents[1]
PER_GPU_BATCH = 256


def gpu_processes(seen: dict[str, set[str]], stop: threading.Event) -> None:
    """Sample `nvidia-smi` until stop: which training process used which GPU."""
    query = ["nvidia-smi", "--query-compute-apps=pid,gpu_bus_id", "--format=csv,noheader"]
    while not stop.wait(2):
        listing = subprocess.run(query, capture_output=True, text=True).stdout
        for pid, bus in csv.reader(listing.splitlines(), skipinitialspace=True):
            try:
                cmdline = psutil.Process(int(pid)).cmdline()
            except psutil.Error:
                continue
            seen.setdefault(f"pid {pid} {role(cmdline)}", set()).add(bus)


def role(cmdline: list[str]) -> str:
    """The module a process runs and its arguments, e.g. "parameter_server
    task worker 3 1" (what follows `python -m distrepro.strategies.`)."""
    after = cmdline[cmdline.index("-m") + 1 :] if "-m" in cmdline else cmdline
    return " ".join(after).removeprefix("distrepro.strategies.")


def run(strategy: str, gpus: int, data_overrides: list[str], steps: int, tmp: Path) -> dict:
    overrides = [
        "experiment=aws_blog_8gpu",
        f"strategy={strategy}",
        f"strategy.num_workers={gpus}",
        f"train.global_batch_size={PER_GPU_BATCH * gpus}",
        "train.epochs=1",
        f"train.steps_per_epoch={steps}",
        "train.warmup_steps_excluded=20",
        f"results_dir={tmp / 'runs'}",
        *data_overrides,
    ]
    seen: dict[str, set[str]] = {}
    stop = threading.Event()
    sampler = threading.Thread(target=gpu_processes, args=(seen, stop))
    sampler.start()
    try:
        subprocess.run([sys.executable, "-m", "distrepro.launch", *overrides], cwd=REPO, check=True)
    finally:
        stop.set()
        sampler.join()
    (metrics,) = (tmp / "runs").glob(f"*{strategy}*/metrics.json")
    images_per_sec = json.loads(metrics.read_text())["images_per_sec"]
    return {
        "images_per_sec_per_gpu": round(images_per_sec / gpus, 1),
        "gpu_of_each_process": {name: sorted(buses) for name, buses in sorted(seen.items())},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--images", type=int, default=2560)
    args = parser.parse_args()
    gpus = len(host_gpus())
    if not gpus:
        raise SystemExit("gpu-check: this machine has no GPU (nvidia-smi lists none); stopping")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        make_photos(tmp / "raw", args.images)
        data = [
            f"data.raw_dir={tmp / 'raw'}",
            f"data.tfrecord_dir={tmp / 'tfrecords'}",
            f"data.extract_dir={tmp / 'extracted'}",
            "data.num_classes=10",
            "data.train_shards=16",
            "data.val_shards=2",
        ]
        prepare = [sys.executable, "-m", "distrepro.prepare", "data=imagenet", *data]
        subprocess.run(prepare, cwd=REPO, check=True)
        results = {name: run(name, gpus, data, args.steps, tmp) for name in REGISTRY}
    rate = {name: results[name]["images_per_sec_per_gpu"] for name in REGISTRY}
    names = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
    model = subprocess.run(names, capture_output=True, text=True).stdout.splitlines()[0]
    print(
        json.dumps(
            {
                "gpu_model": model,
                "gpu_count": gpus,
                **results,
                **{f"{a}_over_{b}": round(rate[a] / rate[b], 2) for a, b in COMPARED},
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
