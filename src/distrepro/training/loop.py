"""The training loop every strategy shares: epochs of updates, progress,
evaluation, checkpoints and MLflow logging at each epoch's end."""

from __future__ import annotations

import functools
import os
import time
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import tensorflow as tf

from distrepro import tracking
from distrepro.handoff import DAMAGED_DATA, TERMINAL
from distrepro.training.files import Profile, RunFiles
from distrepro.training.recipe import Trainer

if TYPE_CHECKING:
    from distrepro.training.distribution import Distribution


class Progress:
    """How far training is: the epochs' history and the position in the
    current epoch. Elastic Horovod keeps one that it commits and shares."""

    def __init__(self, history: list[dict]):
        self.history, self.batch, self.started, self.timed_from = history, 0, 0.0, 0.0
        self.fewest_workers = 0  # in the current epoch so far

    def commit(self) -> None:
        """Nothing to keep: without elastic Horovod a failure restarts the run."""


def train_loop(
    cfg,
    trainer: Trainer,
    files: RunFiles,
    distribution: Distribution,
    updates_per_epoch: int,
    warmup: int,
    progress: Progress,
    stride: int | None = None,
    profile: Profile | None = None,
) -> list[dict]:
    """Epochs from `progress` on, committing it every `stride` updates, after
    the warmup and at each epoch's end; the chief shows a progress bar on the
    launcher's terminal, logs each epoch to MLflow and prints it. The first
    `warmup` updates of each epoch are left out of images/s; the epoch records
    the fewest workers that took part; `profile` traces a window."""
    strides = range(0, updates_per_epoch, stride or updates_per_epoch)
    window = (profile.first, profile.last) if profile else ()
    stops = sorted({warmup, updates_per_epoch, *strides, *window})
    with naming_damaged_data(cfg, files.run_dir):
        while len(progress.history) < cfg.train.epochs:
            if progress.batch == 0:
                trainer.reset_metrics()
                progress.started = progress.timed_from = time.time()
                progress.fewest_workers = distribution.workers()
            bar = epoch_bar(cfg, files, len(progress.history) + 1, updates_per_epoch)
            for stop in (s for s in stops if s > progress.batch):
                distribution.run_updates(stop - progress.batch)
                progress.batch = stop
                progress.fewest_workers = min(progress.fewest_workers, distribution.workers())
                if stop == warmup:
                    progress.timed_from = time.time()
                if profile:
                    profile.at(stop, (time.time() - progress.started) / stop)
                progress.commit()
                if bar:
                    rate = stop * distribution.images_per_update / (time.time() - progress.started)
                    loss = float(trainer.train_loss.result())
                    bar.set_postfix_str(f"loss {loss:.3f}, {rate:.0f} img/s", refresh=False)
                    bar.update(stop - bar.n)
            if bar:
                bar.refresh()  # update() skips draws within tqdm's mininterval, maybe the last
                bar.close()
            end = time.time()
            correct = distribution.count_correct().numpy()
            images_per_sec = (
                (updates_per_epoch - warmup)
                * distribution.images_per_update
                / (end - progress.timed_from)
            )
            record = epoch_record(
                len(progress.history) + 1, trainer, correct, images_per_sec, end - progress.started
            ) | {"timed_window": [progress.timed_from, end]}
            by_worker = distribution.updates_by_worker()
            if by_worker is not None:
                record["updates_by_worker"] = by_worker
            progress.history = [*progress.history, record | {"workers": progress.fewest_workers}]
            progress.batch = 0
            end_epoch(cfg, files, progress.history)
            progress.commit()
    return progress.history


def terminal() -> str | None:
    """The launcher's terminal, when it has one (see processes.process_env)."""
    return os.environ.get(TERMINAL)


def progress_stride(updates_per_epoch: int, multiple: int = 1) -> int | None:
    """Updates between progress-bar updates (a multiple of `multiple`): about
    a hundredth of the epoch; None when there is no terminal to draw on."""
    if terminal() is None:
        return None
    return multiple * max(1, updates_per_epoch // (100 * multiple))


@functools.cache
def terminal_file():
    """The launcher's terminal, open for the whole process."""
    return open(terminal(), "w")  # noqa: SIM115


def epoch_bar(cfg, files: RunFiles, epoch: int, updates_per_epoch: int):
    """The chief's bar for one epoch, drawn on the launcher's terminal: the
    training processes' own output goes through pipes (horovodrun's prefixes)."""
    if not (files.is_chief and terminal()):
        return None
    from tqdm import tqdm

    return tqdm(
        total=updates_per_epoch,
        desc=f"epoch {epoch}/{cfg.train.epochs}",
        unit="step",
        file=terminal_file(),
        leave=False,
    )


def epoch_record(epoch: int, trainer: Trainer, correct, images_per_sec, epoch_time_s) -> dict:
    """One epoch's line of history.json; correct: [top-1, top-5, images]. (The
    loop adds the timed part's wall-clock window, which the network experiment
    matches with its interface counters.)"""
    top1, top5, images = correct
    return {
        "epoch": epoch,
        "train_loss": float(trainer.train_loss.result()),
        "train_accuracy": float(trainer.train_accuracy.result()),
        "val_top1": float(top1 / images),
        "val_top5": float(top5 / images),
        "images_per_sec": float(images_per_sec),
        "epoch_time_s": float(epoch_time_s),
    }


def end_epoch(cfg, files: RunFiles, history: list[dict]) -> None:
    """Checkpoint the epoch; the chief logs it to MLflow and prints it."""
    files.end_epoch(history)
    if not files.is_chief:
        return
    tracking.log_epochs(files.run_dir, history)
    record = history[-1]
    print(
        f"epoch {record['epoch']}/{cfg.train.epochs}  loss {record['train_loss']:.3f}  "
        f"top-1 {record['val_top1']:.3f}  top-5 {record['val_top5']:.3f}  "
        f"{record['images_per_sec']:.1f} img/s  {record['epoch_time_s']:.1f} s",
        flush=True,
    )


@contextmanager
def naming_damaged_data(cfg, run_dir: Path):
    """Turn TensorFlow's DataLossError into a report naming the damaged shards,
    left in run_dir for the launcher (restarting cannot help)."""
    try:
        yield
    except tf.errors.DataLossError:
        report = damage_report(cfg.data.tfrecord_dir)
        (run_dir / DAMAGED_DATA).write_text(report)
        raise SystemExit(report) from None


def damage_report(tfrecord_dir: str) -> str:
    """TensorFlow's DataLossError names no file: find the damaged shards."""
    from distrepro.data.index import damaged_shards

    problems = damaged_shards(Path(tfrecord_dir)) or ["(every shard reads to its end now)"]
    return (
        f"damaged TFRecords in data.tfrecord_dir={tfrecord_dir!r}:\n  "
        + "\n  ".join(problems)
        + "\nRestore them (`dvc status` lists tracked data that changed; `dvc pull` or "
        "`dvc repro` restores it), then start the run again: it resumes from its last checkpoint."
    )
