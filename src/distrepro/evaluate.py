"""Hydra app: a run's final model on the validation TFRecords.

The model is the run's MLflow model, loaded back through MLflow, or, for a
run that logged none (train.log_model=false), its final checkpoint. Adds
eval top-1/top-5/images-per-second to the run's metrics.json and logs them
to the same MLflow run."""

from __future__ import annotations

import json
import time
from pathlib import Path

import hydra
from mlflow.entities import Metric
from omegaconf import DictConfig

from distrepro import config, tracking
from distrepro.atomic import write_json_atomically


def final_model(cfg: DictConfig, run_dir: Path, metrics: dict):
    """(the model, where it came from): the MLflow model, else the checkpoint."""
    import mlflow

    from distrepro.training.inputs import read_metadata
    from distrepro.training.models import restored_model

    model_id = run_dir / tracking.MODEL_ID_FILE
    if model_id.exists():
        uri = f"models:/{model_id.read_text().strip()}"
        mlflow.set_tracking_uri(tracking.tracking_uri())
        return mlflow.tensorflow.load_model(uri), uri
    classes = read_metadata(cfg.data.tfrecord_dir)["num_classes"]
    return restored_model(cfg, classes, metrics["final_checkpoint"]), metrics["final_checkpoint"]


def evaluate(cfg: DictConfig) -> dict:
    from distrepro.training.inputs import make_dataset, read_metadata
    from distrepro.training.recipe import Trainer
    from distrepro.training.runtime import set_precision, use_gpu

    run_dir = Path(cfg.results_dir) / config.run_name(cfg)
    metrics = json.loads((run_dir / "metrics.json").read_text())
    use_gpu(0)  # one GPU, where there is one
    set_precision(cfg.precision.name.value)
    model, source = final_model(cfg, run_dir, metrics)
    trainer = Trainer(cfg, model, None, read_metadata(cfg.data.tfrecord_dir)["num_classes"])
    batches = make_dataset(cfg.data, "validation", cfg.train.global_batch_size)
    trainer.count_correct(batches.take(1))  # trace before timing
    start = time.perf_counter()
    top1, top5, images = trainer.count_correct(batches).numpy()
    evaluation = {
        "eval_top1": float(top1 / images),
        "eval_top5": float(top5 / images),
        "eval_images_per_sec": float(images / (time.perf_counter() - start)),
        "eval_images": int(images),
        "eval_model": source,
    }
    write_json_atomically(run_dir / "metrics.json", {**metrics, **evaluation})
    at, figures = tracking.now_ms(), ("eval_top1", "eval_top5", "eval_images_per_sec")
    logged = [Metric(k, evaluation[k], at, 0) for k in figures]
    tracking.client().log_batch(metrics["mlflow_run_id"], metrics=logged)
    write_json_atomically(run_dir / "evaluation.json", evaluation)
    return evaluation


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    print(json.dumps(evaluate(cfg)))


if __name__ == "__main__":
    main()
