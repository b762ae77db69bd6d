"""What both strategies share: precision, schedule, optimizer, loss, step,
evaluation, checkpoints and the run's files. A strategy adds only how steps
are distributed."""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from contextlib import contextmanager, suppress
from pathlib import Path

import tensorflow as tf
import tf_keras as keras

from distrepro import tracking
from distrepro.atomic import write_json_atomically
from distrepro.config import setting_name
from distrepro.processes import DAMAGED_DATA, TERMINAL
from distrepro.stats import time_to_target
from distrepro.traces import exchange_shares, worker_wait_share

POLICIES = {"fp32": "float32", "mixed_fp16": "mixed_float16", "mixed_bf16": "mixed_bfloat16"}
STEP_DECAY_AT = (1 / 3, 2 / 3, 8 / 9)  # epochs 30, 60, 80 of 90


def set_threads(processes_on_host: int) -> int:
    """Give each of the processes sharing this host its share of the cores.

    The inter-op pool keeps one thread more: a pool of one deadlocks on a
    blocking op (an iterator's GetNext) inside a loop."""
    threads = max(1, (os.cpu_count() or 1) // processes_on_host)
    tf.config.threading.set_intra_op_parallelism_threads(threads)
    tf.config.threading.set_inter_op_parallelism_threads(threads + 1)
    return threads


def use_gpu(index: int | None) -> str:
    """Make the index-th visible GPU this process's only one (memory growing as
    needed, not all reserved); None: no GPU. Returns the device used."""
    gpus = tf.config.list_physical_devices("GPU")
    chosen = gpus[index : index + 1] if index is not None else []
    tf.config.set_visible_devices(chosen, "GPU")
    for gpu in chosen:
        tf.config.experimental.set_memory_growth(gpu, True)
    return chosen[0].name if chosen else "cpu"


def set_seed(cfg) -> None:
    """The seed sets initialisation, data order and augmentation; with
    train.deterministic, TensorFlow's ops give the same results every time."""
    keras.utils.set_random_seed(cfg.seed)
    if cfg.train.deterministic:
        tf.config.experimental.enable_op_determinism()


def set_precision(name: str) -> None:
    keras.mixed_precision.set_global_policy(POLICIES[name])


class WarmupDecay(keras.optimizers.schedules.LearningRateSchedule):
    """Linear warmup to `peak`, then cosine, polynomial (power 2) or step decay."""

    def __init__(self, peak: float, warmup: int, total: int, decay: str):
        self.peak, self.warmup, self.total, self.decay = peak, warmup, total, decay

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        warm = self.peak * (step + 1) / max(1, self.warmup)
        progress = tf.clip_by_value(
            (step - self.warmup) / max(1, self.total - self.warmup), 0.0, 1.0
        )
        if self.decay == "cosine":
            decayed = self.peak * 0.5 * (1 + tf.cos(math.pi * progress))
        elif self.decay == "poly":
            decayed = self.peak * (1 - progress) ** 2
        else:
            drops = sum(tf.cast(progress >= at, tf.float32) for at in STEP_DECAY_AT)
            decayed = self.peak * 0.1**drops
        return tf.where(step < self.warmup, warm, decayed)

    def get_config(self):
        return {"peak": self.peak, "warmup": self.warmup, "total": self.total, "decay": self.decay}


def peak_learning_rate(train, batch_per_update: int) -> float:
    """The recipe's linear scaling: base rate x the update's batch / the base batch."""
    return train.base_learning_rate * batch_per_update / train.base_batch_size


def make_optimizer(cfg, peak: float, updates_per_epoch: int):
    """SGD with momentum and the warmup-then-decay schedule up to `peak`."""
    train = cfg.train
    schedule = WarmupDecay(
        peak,
        train.warmup_epochs * updates_per_epoch,
        train.epochs * updates_per_epoch,
        str(train.lr_decay),
    )
    optimizer = keras.optimizers.SGD(schedule, momentum=train.momentum)
    if str(cfg.precision.name) != "mixed_fp16":
        return optimizer
    scale = cfg.precision.loss_scale
    if scale == "dynamic":
        return keras.mixed_precision.LossScaleOptimizer(optimizer)
    return keras.mixed_precision.LossScaleOptimizer(
        optimizer, dynamic=False, initial_scale=float(scale)
    )


class Trainer:
    """One model's loss, training step and evaluation, strategy-agnostic."""

    def __init__(self, cfg, model: keras.Model, optimizer, num_classes: int):
        self.model, self.optimizer, self.num_classes = model, optimizer, num_classes
        self.label_smoothing = cfg.train.label_smoothing
        self.weight_decay = cfg.train.weight_decay
        self.scaled = isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)
        self.train_loss = keras.metrics.Mean("train_loss")
        self.train_accuracy = keras.metrics.SparseCategoricalAccuracy("train_accuracy")

    def loss(self, labels, logits):
        onehot = tf.one_hot(labels, self.num_classes)
        per_example = keras.losses.categorical_crossentropy(
            onehot, logits, from_logits=True, label_smoothing=self.label_smoothing
        )
        decay = tf.add_n(
            [tf.nn.l2_loss(v) for v in self.model.trainable_variables if "kernel" in v.name]
        )
        return tf.reduce_mean(per_example) + self.weight_decay * tf.cast(decay, tf.float32)

    def step(self, images, labels, wrap_tape: Callable = lambda tape: tape):
        """One update from one batch; wrap_tape lets Horovod average gradients."""
        with tf.GradientTape() as tape:
            logits = self.model(images, training=True)
            loss = self.loss(labels, logits)
            scaled = self.optimizer.get_scaled_loss(loss) if self.scaled else loss
        variables = self.model.trainable_variables
        gradients = wrap_tape(tape).gradient(scaled, variables)
        if self.scaled:
            gradients = self.optimizer.get_unscaled_gradients(gradients)
        self.optimizer.apply_gradients(zip(gradients, variables, strict=True))
        self.train_loss.update_state(loss)
        self.train_accuracy.update_state(labels, logits)
        return loss

    def reset_metrics(self):
        self.train_loss.reset_state()
        self.train_accuracy.reset_state()

    def count_correct(self, dataset) -> tf.Tensor:
        """[top-1 correct, top-5 correct, images] over a dataset."""
        totals = tf.zeros([3], tf.float64)
        for images, labels in dataset:
            totals += self._batch_counts(images, labels)
        return totals

    @tf.function
    def _batch_counts(self, images, labels):
        logits = self.model(images, training=False)
        k = min(5, self.num_classes)
        top1 = tf.math.in_top_k(labels, logits, 1)
        top5 = tf.math.in_top_k(labels, logits, k)
        counts = [tf.reduce_sum(tf.cast(t, tf.float64)) for t in (top1, top5)]
        return tf.stack(counts + [tf.cast(tf.size(labels), tf.float64)])


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
    """results/runs/<run>/: checkpoints, per-epoch history, metrics.json."""

    def __init__(self, run_dir: Path, model, optimizer, is_chief: bool):
        self.run_dir, self.is_chief = run_dir, is_chief
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

    def write_metrics(self, cfg, history: list[dict], mlflow_run_id: str) -> dict:
        rates = [h["images_per_sec"] for h in history]
        metrics = {
            "run_name": self.run_dir.name,
            "strategy": str(cfg.strategy.name),
            "precision": str(cfg.precision.name),
            "model": cfg.model.name,
            "dataset": cfg.data.name,
            "global_batch_size": cfg.train.global_batch_size,
            "num_workers": cfg.strategy.num_workers,
            "num_ps": cfg.strategy.num_ps,
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
            "history": history,
        }
        timeline = self.run_dir / PROFILE_DIR / HOROVOD_TIMELINE
        if timeline.exists():
            metrics |= exchange_shares(timeline)
        traces = (self.run_dir / PROFILE_DIR).glob(f"{WORKER_TRACES}/**/*.xplane.pb")
        shares = [s for s in map(worker_wait_share, traces) if not math.isnan(s)]
        if shares:
            metrics["ps_wait_share"] = sum(shares) / len(shares)
        write_json_atomically(self.run_dir / "metrics.json", metrics)
        return metrics


PROFILE_DIR = "profile"
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
                tf.profiler.experimental.start(str(self.folder / "tensorflow"))
            self.start_extra((self.last - self.first) * seconds_per_update)
            self.state = "tracing"
        elif self.state == "tracing" and update == self.last:
            if self.is_chief:
                tf.profiler.experimental.stop()
            self.stop_extra()
            self.state = "done"


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
    run_updates: Callable[[int], None],
    count_correct: Callable[[], tf.Tensor],
    images_per_update: int,
    updates_per_epoch: int,
    warmup: int,
    workers: Callable[[], int],
    progress: Progress | None = None,
    stride: int | None = None,
    profile: Profile | None = None,
) -> list[dict]:
    """Epochs from `progress` (by default the last checkpoint) on, committing it
    every `stride` updates, after the warmup and at each epoch's end; the chief
    shows a progress bar on the launcher's terminal, logs each epoch to MLflow
    and prints it. The first `warmup` updates of each epoch are left out of
    images/s; `workers` says how many take part (the epoch records the fewest);
    `profile` traces a window."""
    progress = progress or Progress(files.restore())
    strides = range(0, updates_per_epoch, stride or updates_per_epoch)
    window = (profile.first, profile.last) if profile else ()
    stops = sorted({warmup, updates_per_epoch, *strides, *window})
    with naming_damaged_data(cfg, files.run_dir):
        while len(progress.history) < cfg.train.epochs:
            if progress.batch == 0:
                trainer.reset_metrics()
                progress.started = progress.timed_from = time.time()
                progress.fewest_workers = workers()
            bar = epoch_bar(cfg, files, len(progress.history) + 1, updates_per_epoch)
            for stop in (s for s in stops if s > progress.batch):
                run_updates(stop - progress.batch)
                progress.batch = stop
                progress.fewest_workers = min(progress.fewest_workers, workers())
                if stop == warmup:
                    progress.timed_from = time.time()
                if profile:
                    profile.at(stop, (time.time() - progress.started) / stop)
                progress.commit()
                if bar:
                    rate = stop * images_per_update / (time.time() - progress.started)
                    loss = float(trainer.train_loss.result())
                    bar.set_postfix_str(f"loss {loss:.3f}, {rate:.0f} img/s", refresh=False)
                    bar.update(stop - bar.n)
            if bar:
                bar.refresh()  # update() skips draws within tqdm's mininterval, maybe the last
                bar.close()
            end = time.time()
            correct = count_correct().numpy()
            images_per_sec = (
                (updates_per_epoch - warmup) * images_per_update / (end - progress.timed_from)
            )
            record = epoch_record(
                len(progress.history) + 1, trainer, correct, images_per_sec, end - progress.started
            )
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
    """One epoch's line of history.json; correct: [top-1, top-5, images]."""
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


def finish(cfg, files: RunFiles, history: list[dict], run_id: str) -> dict:
    """The chief's end of a run: metrics.json, then its MLflow record."""
    import mlflow

    metrics = files.write_metrics(cfg, history, run_id)
    tracking.log_finished(files.run_dir, metrics)
    with suppress(*tracking.UNANSWERED):  # ends the run here, and its system metrics
        mlflow.end_run()
    return metrics


def epoch_plan(cfg, num_train: int, batch_per_update: int) -> int:
    """Updates per epoch: one pass over the train set, or train.steps_per_epoch."""
    if cfg.train.steps_per_epoch:
        return cfg.train.steps_per_epoch
    return max(1, num_train // batch_per_update)
