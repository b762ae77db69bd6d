"""Training throughput, all in one invocation on this machine:

- this project's training with every strategy (strategies.REGISTRY) on the
  digits TFRecords, at the same global batch, and the ratios the report
  compares (every strategy against the parameter server, Horovod against
  TensorFlow's all-reduce);
- Horovod's synthetic-benchmark recipe (benchmarks/synthetic_horovod.py):
  same model, image size, per-rank batch and number of ranks, random data;
- every strategy again with `train.xla=true` (XLA auto-clustering of the step).

    python benchmarks/train_benchmark.py [--epochs 3] [--workers 2] [--batch 64]

Needs data/tfrecords/digits (`dvc repro`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from distrepro.strategies import COMPARED, REGISTRY

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def project_run(strategy: str, args, results: Path, xla: bool = False) -> float:
    out = results / f"{strategy}-xla{xla}"
    overrides = [
        f"strategy={strategy}",
        f"strategy.num_workers={args.workers}",
        f"train.epochs={args.epochs}",
        f"train.global_batch_size={args.batch}",
        f"train.xla={xla}",
        f"results_dir={out}",
    ]
    subprocess.run([sys.executable, "-m", "distrepro.launch", *overrides], cwd=REPO, check=True)
    (metrics,) = out.glob("*/metrics.json")
    return json.loads(metrics.read_text())["images_per_sec"]


def synthetic_run(args, steps: int) -> float:
    n = args.workers
    cmd = [str(BIN / "horovodrun"), "-np", str(n), "-H", f"localhost:{n}", "--gloo"]
    script = [sys.executable, str(REPO / "benchmarks" / "synthetic_horovod.py")]
    options = ["--image-size", "32", "--batch-size", str(args.batch // n), "--steps", str(steps)]
    out = subprocess.run([*cmd, *script, *options], capture_output=True, text=True, check=True)
    return float(re.search(r"images_per_sec ([\d.]+)", out.stdout)[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=64, help="global batch")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{tmp}/mlflow.db"
        rate = {name: project_run(name, args, Path(tmp)) for name in REGISTRY}
        steps_per_epoch = 1437 // args.batch
        synthetic = synthetic_run(args, steps_per_epoch * args.epochs)
        xla = {name: project_run(name, args, Path(tmp), xla=True) for name in REGISTRY}
    result = {f"project_{name}_images_per_sec": round(rate[name], 1) for name in REGISTRY}
    result["synthetic_horovod_images_per_sec"] = round(synthetic, 1)
    result["project_horovod_over_synthetic"] = round(rate["horovod"] / synthetic, 2)
    result |= {f"{a}_over_{b}": round(rate[a] / rate[b], 2) for a, b in COMPARED}
    result |= {f"{name}_xla_images_per_sec": round(xla[name], 1) for name in REGISTRY}
    result |= {f"{name}_xla_over_no_xla": round(xla[name] / rate[name], 2) for name in REGISTRY}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
