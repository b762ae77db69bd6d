"""A strategy inside a training process, and the one process setup every
strategy shares.

`main(config_path, SomeDistribution)` is what a strategy's process runs: it
loads the run's config into the launcher's schema, sets up the runtime
(threads, device, precision, seed), lets the strategy connect, builds the
recipe under the strategy's scope, tracks the run on the chief and drives the
shared training loop. The strategy answers, through its `Distribution`, the
few questions that differ: how many processes share this host and which GPU
is this one's, how a batch of updates runs, how correct predictions are
summed over workers, how many workers and images an update takes, and
whether this process is the chief, the one that writes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from distrepro import config

if TYPE_CHECKING:  # TensorFlow's modules: the launcher imports a strategy's module without them
    from distrepro.training.files import Profile, RunFiles
    from distrepro.training.recipe import Trainer


class Distribution:
    """How one process of a strategy takes part in training. Subclasses set
    the attributes and implement the methods that raise here."""

    is_chief = True  # writes checkpoints, history, metrics and the MLflow run
    images_per_update = 0  # set in __init__: the global batch, or a worker's
    updates_per_call = 1  # updates scheduled together
    summed_replicas = 1  # replicas whose gradients the optimizer sums
    scratch: Path | None = None  # where a non-chief saves, if all must (see RunFiles)

    def __init__(self, cfg: DictConfig, run_dir: Path):
        """Before TensorFlow's runtime starts: what the process needs to know."""
        self.cfg, self.run_dir = cfg, run_dir

    def processes_on_host(self) -> int:
        """How many training processes share this host's cores."""
        raise NotImplementedError

    def gpu(self) -> int | None:
        """The index of this process's GPU among those it sees, or None."""
        return None

    def connect(self) -> None:
        """After the runtime setup: start the strategy's own machinery."""

    def scope(self):
        """Where the model and optimizer are built."""
        return nullcontext()

    def prepare(self, trainer: Trainer) -> None:
        """Input and step functions, once the recipe is built."""
        raise NotImplementedError

    def run_updates(self, count: int) -> None:
        raise NotImplementedError

    def count_correct(self):
        """[top-1, top-5, images] over the validation set, summed over workers."""
        raise NotImplementedError

    def updates_by_worker(self) -> list[int] | None:
        """Each worker's updates since the last call, where workers update at
        their own pace; None where every update is every worker's."""
        return None

    def workers(self) -> int:
        """How many workers take part now."""
        return self.cfg.strategy.num_workers

    def params(self, device: str) -> dict:
        """Where this run's processes are, as MLflow params (called on every
        process: it may be collective)."""
        return {"devices": device}

    def figures(self) -> dict:
        """What the strategy adds to the chief's metrics.json."""
        return {}

    def profile(self, files: RunFiles) -> Profile:
        from distrepro.training.files import Profile

        return Profile(self.cfg, files, multiple=self.updates_per_call)

    def train(self, train: Callable, track: Callable, files: RunFiles) -> list[dict]:
        """Track the run and train from the last checkpoint; elastic Horovod
        trains its own way."""
        from distrepro.training.loop import Progress

        track()
        return train(Progress(files.restore()))

    def end(self) -> None:
        """Before the chief writes the run's end."""


def main(config_path: str, distribution: type[Distribution]) -> None:
    from distrepro import tracking
    from distrepro.training import loop, runtime
    from distrepro.training.files import RunFiles, finish
    from distrepro.training.inputs import read_metadata
    from distrepro.training.models import build_model
    from distrepro.training.recipe import Trainer, epoch_plan, make_optimizer, peak_learning_rate

    cfg = config.load(config_path)
    run_dir = Path(config_path).parent
    strategy = distribution(cfg, run_dir)
    setup = runtime.setup(cfg, strategy.processes_on_host(), strategy.gpu())
    strategy.connect()
    metadata = read_metadata(cfg.data.tfrecord_dir)
    per_call = strategy.updates_per_call
    images = metadata["splits"]["train"]["images"]
    updates = epoch_plan(cfg, images, strategy.images_per_update, per_call)
    peak = peak_learning_rate(cfg.train, strategy.images_per_update)
    with strategy.scope():
        model = build_model(cfg.model, cfg.data.image_size, metadata["num_classes"])
        optimizer = make_optimizer(cfg, peak, updates)
        classes = metadata["num_classes"]
        trainer = Trainer(cfg, model, optimizer, classes, strategy.summed_replicas)
    files = RunFiles(run_dir, model, optimizer, strategy.is_chief, strategy.scratch)
    strategy.prepare(trainer)
    params = {
        "threads_per_process": setup["threads_per_process"],
        "peak_learning_rate": peak,
        **strategy.params(setup["device"]),
    }
    warmup = -(-cfg.train.warmup_steps_excluded // per_call) * per_call
    warmup = min(warmup, updates - per_call)
    profile = strategy.profile(files) if cfg.train.profile else None

    def track() -> None:
        """Start or resume the MLflow run on the chief (elastic Horovod's new one too)."""
        if strategy.is_chief:
            tracking.start_run(run_dir, params)

    def train(progress: loop.Progress, stride: int | None = None) -> list[dict]:
        stride = stride or loop.progress_stride(updates, per_call)
        return loop.train_loop(
            cfg, trainer, files, strategy, updates, warmup, progress, stride, profile
        )

    history = strategy.train(train, track, files)
    strategy.end()
    if strategy.is_chief:
        finish(cfg, files, history, strategy.figures())
