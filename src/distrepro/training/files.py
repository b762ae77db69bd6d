"""A run's files: checkpoints (trusted only once read), history,
metrics.json, the profiled window's traces, and the run's end."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import tensorflow as tf

from distrepro import tracking
from distrepro.atomic import write_json_atomically
from distrepro.config import setting_name
from distrepro.stats import time_to_target
from distrepro.traces import (
    collective_share,
    exchange_shares,
    gradients_ready_within_s,
    worker_wait_share,
)


def unreadable(checkpoint: str) -> str | None:
    """Why a checkpoint cannot be read (each tensor read, its checksum
    checked), or None. A machine that went down mid-write leaves a short file."""
    try:
        reader = tf.train.load_checkpoint(checkpoint)
        for name in reader.get_variable_to_shape_map():
            reader.get_tensor(name)
    except Exception as error:  # by the damage: OpError, ValueError, IndexError...
        return f"{type(error).__name__}: {getattr(error, 'message', str(error)).splitlines()[0]}"
    return None


class RunFiles:
    """results/runs/<run>/: checkpoints, per-epoch history, metrics.json. The
    chief writes them; where a strategy needs every process to take part in a
    save (MultiWorkerMirroredStrategy), the others save into `scratch`, which
    is removed again."""

    def __init__(self, run_dir: Path, model, optimizer, is_chief: bool, scratch: Path | None):
        self.run_dir, self.is_chief, self.scratch = run_dir, is_chief, scratch
        self.model = model
        self.epoch = tf.Variable(0, dtype=tf.int64, trainable=False, name="epoch")
        checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer, epoch=self.epoch)
        self.manager = tf.train.CheckpointManager(checkpoint, run_dir / "checkpoints", 2)
        self.history_path = run_dir / "history.json"
        self.skipped_path = run_dir / "skipped_checkpoints.json"
        self.profiled: list[int] | None = None  # the updates a Profile traces

    def restore(self) -> list[dict]:
        """Restore the newest checkpoint that reads to its end, skipping (and
        recording) those that do not; return the history up to it."""
        for path in reversed(self.manager.checkpoints):
            problem = unreadable(path)
            if problem is None:
                self.manager.checkpoint.restore(path)
                break
            self.skip(path, problem)
        else:
            if self.manager.checkpoints:
                print("checkpoint: none reads; starting the run over", flush=True)
        epochs = int(self.epoch.numpy())
        if self.is_chief:
            tracking.resumed_at(self.run_dir, epochs)
        if not self.history_path.exists():
            return []
        return json.loads(self.history_path.read_text())[:epochs]

    def skip(self, path: str, problem: str) -> None:
        print(f"checkpoint: skipping {path}, which cannot be read: {problem}", flush=True)
        if self.is_chief:
            skipped = self.skipped_checkpoints()
            write_json_atomically(self.skipped_path, [*skipped, f"{Path(path).name}: {problem}"])

    def skipped_checkpoints(self) -> list[str]:
        return json.loads(self.skipped_path.read_text()) if self.skipped_path.exists() else []

    def end_epoch(self, history: list[dict]) -> None:
        """History first, then the checkpoint that makes the epoch count."""
        self.epoch.assign(len(history))
        if self.is_chief:
            write_json_atomically(self.history_path, history)
            self.manager.save(checkpoint_number=len(history))
        elif self.scratch:
            self.manager.checkpoint.write(str(self.scratch / "ckpt"))
            shutil.rmtree(self.scratch)

    def save_model(self, cfg) -> None:
        """The final model, rebuilt outside any strategy from the last
        checkpoint, and two validation images as its input example: what
        tracking logs as the run's MLflow model. (Not the live variables: under
        MultiWorkerMirroredStrategy reading batch norm's statistics is an
        all-reduce, which the other workers, done, no longer join.)"""
        from distrepro.training.inputs import make_dataset
        from distrepro.training.models import restored_model

        classes = self.model.output_shape[-1]
        final = restored_model(cfg, classes, self.manager.latest_checkpoint)
        partial = self.run_dir / f".partial-{tracking.MODEL_FILE}"  # Keras wants the suffix
        final.save(partial)
        os.replace(partial, self.run_dir / tracking.MODEL_FILE)
        images, _ = next(iter(make_dataset(cfg.data, "validation", 2)))
        np.save(self.run_dir / tracking.INPUT_EXAMPLE, images.numpy())

    def write_metrics(
        self, cfg, history: list[dict], mlflow_run_id: str | None, figures: dict
    ) -> dict:
        rates = [h["images_per_sec"] for h in history]
        metrics = {
            "run_name": self.run_dir.name,
            "strategy": cfg.strategy.name.value,
            "precision": cfg.precision.name.value,
            "model": cfg.model.name,
            "dataset": cfg.data.name,
            "global_batch_size": cfg.train.global_batch_size,
            "num_workers": cfg.strategy.num_workers,
            "num_ps": cfg.strategy.num_ps,
            "parameters": int(self.model.count_params()),
            "trainable_parameters": int(
                sum(math.prod(w.shape) for w in self.model.trainable_weights)
            ),
            "epochs": len(history),
            "images_per_sec": sum(rates) / len(rates),
            "total_time_s": sum(h["epoch_time_s"] for h in history),
            "top1": history[-1]["val_top1"],
            "top5": history[-1]["val_top5"],
            "best_top1": max(h["val_top1"] for h in history),
            "seed": cfg.seed,
            "cores": os.cpu_count(),
            "profile_steps": self.profiled,
            "setting": setting_name(cfg),
            "target_top1": cfg.train.target_top1,
            **time_to_target(history, cfg.train.target_top1),
            "final_checkpoint": self.manager.latest_checkpoint,
            "skipped_checkpoints": self.skipped_checkpoints(),
            "mlflow_run_id": mlflow_run_id,
            **figures,
            "history": history,
        }
        timeline = self.run_dir / PROFILE_DIR / HOROVOD_TIMELINE
        if timeline.exists():
            metrics |= exchange_shares(timeline)
            metrics["gradients_ready_within_s"] = gradients_ready_within_s(timeline)
        traces = (self.run_dir / PROFILE_DIR).glob(f"{WORKER_TRACES}/**/*.xplane.pb")
        shares = [s for s in map(worker_wait_share, traces) if not math.isnan(s)]
        if shares:
            metrics["ps_wait_share"] = sum(shares) / len(shares)
        traces = (self.run_dir / PROFILE_DIR).glob(f"{CHIEF_TRACE}/**/*.xplane.pb")
        shares = [s for s in map(collective_share, traces) if not math.isnan(s)]
        if shares and "allreduce_share" not in metrics:  # TensorFlow's own all-reduce
            metrics["allreduce_share"] = sum(shares) / len(shares)
        write_json_atomically(self.run_dir / "metrics.json", metrics)
        return metrics


PROFILE_DIR = "profile"
CHIEF_TRACE = "tensorflow"  # TensorFlow's profiler on the chief
HOROVOD_TIMELINE = "horovod_timeline.json"  # of the profiled window, beside TensorFlow's trace
WORKER_TRACES = "workers"  # the parameter-server workers' traces of the window


class Profile:
    """Traces updates [first, last) (train.profile_steps) of the first epoch
    this process trains: TensorFlow's profiler on the chief, into
    run_dir/profile/tensorflow, and what the strategy adds (Horovod's timeline)."""

    def __init__(
        self, cfg, files: RunFiles, start=lambda seconds: None, stop=lambda: None, multiple: int = 1
    ):
        first, last = cfg.train.profile_steps  # widened to whole calls of `multiple` updates
        self.first, self.last = first // multiple * multiple, -(-last // multiple) * multiple
        self.folder = files.run_dir / PROFILE_DIR
        self.is_chief, self.start_extra, self.stop_extra = files.is_chief, start, stop
        self.state = "waiting"
        self.folder.mkdir(exist_ok=True)
        files.profiled = [self.first, self.last]

    def at(self, update: int, seconds_per_update: float) -> None:
        """Called after `update` updates of an epoch; the strategy's own trace
        is told how long the window should take."""
        if self.state == "waiting" and update == self.first:
            if self.is_chief:
                tf.profiler.experimental.start(str(self.folder / CHIEF_TRACE))
            self.start_extra((self.last - self.first) * seconds_per_update)
            self.state = "tracing"
        elif self.state == "tracing" and update == self.last:
            if self.is_chief:
                tf.profiler.experimental.stop()
            self.stop_extra()
            self.state = "done"


def finish(cfg, files: RunFiles, history: list[dict], figures: dict) -> dict:
    """The chief's end of a run: metrics.json (with the strategy's own
    figures) and the final model in the run's files, then its MLflow record."""
    if cfg.train.log_model:
        files.save_model(cfg)
    metrics = files.write_metrics(cfg, history, tracking.run_id(files.run_dir), figures)
    tracking.SystemMetrics.stop()
    tracking.log_finished(files.run_dir, metrics)
    return metrics
