"""The strategies, one module each (`distrepro.strategies.<name>`), each
holding its whole distribution concern behind one interface:

Launcher side (importing no TensorFlow):
    validate(cfg)                   refuse what it cannot run (config.ConfigError)
    processes(cfg) -> int           how many processes a run starts
    images_per_update(cfg) -> int   images one update of the variables takes
    updates_per_call(cfg) -> int    updates scheduled together (1, or more)
    describe(cfg) -> str            what a launch starts, in one line
    run(cfg, config_path, restarts) -> str | None
                                    start and supervise the processes once;
                                    why they failed, or None
    KEYS                            its own keys of strategy.* (beside SHARED_KEYS):
                                    any other set away from its default is refused
    host_shares(cfg, task_shares) -> tuple
                                    the model's share held beside each worker's
                                    host (colocated ps tasks), for the cost model
    EXCHANGE                        "all-reduce" or "parameter server": how the
                                    cost model (costmodel) counts its bytes
    BACKWARD_OVERLAP                the share of the backward pass its
                                    exchange may overlap (costmodel)

Training-process side: its `Distribution` (training.distribution), which the
shared process setup and training loop drive.

Nothing else names a strategy: the registry below maps `strategy.name` to
its module, and says which runs the report compares."""

from __future__ import annotations

import importlib
from types import ModuleType

REGISTRY = {
    "parameter_server": "distrepro.strategies.parameter_server",
    "horovod": "distrepro.strategies.horovod",
    "multi_worker_mirrored": "distrepro.strategies.multi_worker_mirrored",
}
# The keys of strategy.* that every strategy takes (config.StrategyConfig).
SHARED_KEYS = (
    "name",
    "num_workers",
    "hosts",
    "gpus_per_worker",
    "cores_per_worker",
    "workers_per_node",
    "steps_per_call",
)
# The seed's "standard TensorFlow distributed training", which every other
# strategy is compared with; and Horovod against TensorFlow's own all-reduce.
BASELINE = "parameter_server"
COMPARED = [(name, BASELINE) for name in REGISTRY if name != BASELINE]
COMPARED += [("horovod", "multi_worker_mirrored")]


def module(name: str) -> ModuleType:
    return importlib.import_module(REGISTRY[name])


def of(cfg) -> ModuleType:
    """The module of cfg's strategy."""
    return module(cfg.strategy.name.value)
