"""Hydra app: the final checkpoint of a run on the validation TFRecords.

Adds eval top-1/top-5/images-per-second to the run's metrics.json and logs
them to the same MLflow run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import hydra
import mlflow
from omegaconf import DictConfig

from distrepro import config, tracking
from distrepro.atomic import write_json_atomically


def evaluate(cfg: DictConfig) -> dict:
    import tensorflow as tf

    from distrepro.training.inputs import make_dataset, read_metadata
    from distrepro.training.models import build_model
    from distrepro.training.recipe import Trainer
    from distrepro.training.runtime import set_precision, use_gpu

    run_dir = Path(cfg.results_dir) / config.run_name(cfg)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    use_gpu(0)  # one GPU, where there is one
    set_precision(cfg.precision.name.value)
    metadata = read_metadata(cfg.data.tfrecord_dir)
    model = build_model(cfg.model, cfg.data.image_size, metadata["num_classes"])
    tf.train.Checkpoint(model=model).restore(metrics["final_checkpoint"]).expect_partial()
    trainer = Trainer(cfg, model, None, metadata["num_classes"])
    batches = make_dataset(cfg.data, "validation", cfg.train.global_batch_size)
    trainer.count_correct(batches.take(1))  # trace before timing
    start = time.perf_counter()
    top1, top5, images = trainer.count_correct(batches).numpy()
    evaluation = {
        "eval_top1": float(top1 / images),
        "eval_top5": float(top5 / images),
        "eval_images_per_sec": float(images / (time.perf_counter() - start)),
        "eval_images": int(images),
    }
    write_json_atomically(run_dir / "metrics.json", {**metrics, **evaluation})
    mlflow.set_tracking_uri(tracking.tracking_uri())
    with mlflow.start_run(run_id=metrics["mlflow_run_id"]):
        mlflow.log_metrics({k: v for k, v in evaluation.items() if k != "eval_images"})
    write_json_atomically(run_dir / "evaluation.json", evaluation)
    return evaluation


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(json.dumps(evaluate(cfg)))


if __name__ == "__main__":
    main()
