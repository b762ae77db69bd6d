"""What the synchronous strategies (Horovod, TensorFlow's all-reduce) share on
the launcher side: one process per worker, every update takes the global
batch, strategy.steps_per_call updates per call of the training step."""

from __future__ import annotations

from omegaconf import DictConfig


def processes(cfg: DictConfig) -> int:
    return cfg.strategy.num_workers


def images_per_update(cfg: DictConfig) -> int:
    return cfg.train.global_batch_size


def updates_per_call(cfg: DictConfig) -> int:
    return cfg.strategy.steps_per_call


def host_shares(cfg: DictConfig, task_shares: dict[str, float] | None = None) -> tuple:
    """No ps tasks beside the workers."""
    return ()
