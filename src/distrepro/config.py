"""Typed schema of the `conf/` tree and composition helpers."""

from __future__ import annotations

import copy
import hashlib
import json
import shlex
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, Optional

from hydra import compose, initialize_config_dir
from hydra._internal.config_loader_impl import ConfigLoaderImpl
from hydra.core.config_store import ConfigStore
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import MISSING, DictConfig, OmegaConf

from distrepro import hosts, strategies

REPO = Path(__file__).resolve().parents[2]
CONF_DIR = REPO / "conf"


class OnBadImage(Enum):
    error = "error"
    skip = "skip"


StrategyName = Enum("StrategyName", {name: name for name in strategies.REGISTRY})


class ConfigError(ValueError):
    """A config that cannot train; the message names the key and value."""


class PrecisionName(Enum):
    fp32 = "fp32"
    mixed_fp16 = "mixed_fp16"
    mixed_bf16 = "mixed_bf16"


class LrDecay(Enum):
    cosine = "cosine"
    poly = "poly"
    step = "step"


@dataclass
class DataConfig:
    name: str = MISSING
    raw_dir: str = MISSING
    tfrecord_dir: str = MISSING
    extract_dir: str = "data/extracted/${data.name}"
    train_shards: int = MISSING
    val_shards: int = MISSING
    num_classes: int = MISSING
    image_size: int = MISSING
    val_fraction: float = 0.0
    random_flip: bool = True
    min_crop_area: float = 0.08
    on_bad_image: OnBadImage = OnBadImage.error


@dataclass
class ModelConfig:
    name: str = MISSING
    blocks_per_stage: list[int] = MISSING
    base_width: int = MISSING
    parameters: Optional[int] = None  # published count, for the cost model (distrepro.predict)


@dataclass
class StrategyConfig:
    """Every strategy's keys. The shared ones (strategies.SHARED_KEYS) mean
    the same for each; the others belong to the strategies that name them
    (their module's KEYS) and are refused, set, for any other."""

    name: StrategyName = MISSING
    num_workers: int = 2
    hosts: Optional[str] = None
    gpus_per_worker: int = 0
    cores_per_worker: int = 1  # what a scheduler gives each worker (SLURM's cpus-per-task)
    workers_per_node: Optional[int] = None  # SLURM: the workers on each node; None: one node
    steps_per_call: int = 1  # updates in one call of the training step (tf.function)
    # The parameter server's:
    num_ps: int = 0
    ps_placement: str = "separate"  # separate (the first host) or colocated (beside the workers)
    partitioner: str = "none"  # none, min_size or fixed (TensorFlow's variable partitioners)
    # Horovod's:
    controller: str = "gloo"  # gloo or mpi
    elastic: bool = False  # go on with the ranks left when one fails
    min_workers: int = 1  # elastic: fewer ranks than this end the run
    commit_every: int = 10  # elastic: updates between commits of the state
    fusion_threshold_mb: Optional[float] = None  # HOROVOD_FUSION_THRESHOLD; None: Horovod's
    cycle_time_ms: Optional[float] = None  # HOROVOD_CYCLE_TIME; None: Horovod's
    autotune: bool = False  # Horovod's autotuning of fusion and cycle time, logged
    # TensorFlow's all-reduce's:
    communication: str = "auto"  # auto, ring or nccl
    bytes_per_pack: int = 0  # CommunicationOptions.bytes_per_pack; 0: TensorFlow's
    # Horovod's and TensorFlow's all-reduce's:
    fp16_allreduce: bool = False  # gradients all-reduced in fp16


@dataclass
class PrecisionConfig:
    name: PrecisionName = MISSING
    loss_scale: str = "dynamic"  # mixed_fp16 only: "dynamic" or a fixed number


@dataclass
class TrainConfig:
    epochs: int = MISSING
    global_batch_size: int = MISSING
    base_learning_rate: float = 0.1
    base_batch_size: int = 256
    warmup_epochs: int = 0
    lr_decay: LrDecay = LrDecay.cosine
    momentum: float = 0.9
    weight_decay: float = 0.0
    label_smoothing: float = 0.0
    warmup_steps_excluded: int = 5
    steps_per_epoch: Optional[int] = None
    xla: bool = False
    max_restarts: int = 3
    target_top1: float = 0.97
    deterministic: bool = False
    profile: bool = False
    profile_steps: list[int] = field(default_factory=lambda: [10, 15])
    log_model: bool = True


@dataclass
class PrepareConfig:
    processes: int = 0
    verify: bool = True
    index_only: bool = False


@dataclass
class ReportConfig:
    runs: list[str] = field(default_factory=list)
    out_dir: str = "results/report"


@dataclass
class NetworkConfig:
    bandwidth: Optional[str] = None  # set: python -m distrepro.network (hosts of their own)
    slowdown: Optional[float] = None  # the last worker's host, that many times slower
    kill_interval_s: Optional[float] = None  # the last worker killed this often on average
    kill_seed: int = 0
    max_kills: int = 3


@dataclass
class Config:
    data: DataConfig = MISSING
    model: ModelConfig = MISSING
    strategy: StrategyConfig = MISSING
    precision: PrecisionConfig = MISSING
    train: TrainConfig = field(default_factory=TrainConfig)
    prepare: PrepareConfig = field(default_factory=PrepareConfig)
    report: ReportConfig = field(default_factory=ReportConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    hardware: Optional[Any] = None  # the cost model's cluster (conf/hardware/, distrepro.predict)
    published: Optional[Any] = None  # an experiment's published figures, beside predictions
    seed: int = 0
    results_dir: str = "results/runs"
    mlflow_experiment: str = "distrepro"
    mlflow_parent_run_id: Optional[str] = None  # an existing MLflow run
    mlflow_parent: Optional[str] = None  # or a folder describing one (distrepro.parents)
    experiment: Optional[Any] = None


ConfigStore.instance().store(name="config_schema", node=Config)


def on_several_hosts(several: Any, one: Any, *, _parent_: DictConfig) -> Any:
    """`${on_several_hosts:A,B}` in a strategy's config: A for a run across
    several machines (strategy.hosts of two or more, or workers_per_node
    below num_workers), B on one machine."""
    listed, per_node = _parent_.hosts, _parent_.workers_per_node
    across = bool(listed and len(hosts.parse(listed)) > 1)
    split = per_node is not None and per_node < _parent_.num_workers
    return several if across or split else one


OmegaConf.register_new_resolver("on_several_hosts", on_several_hosts, replace=True)


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Compose `conf/config.yaml` with Hydra overrides, as the apps do."""
    return compose_many([list(overrides)])[0]


def compose_many(override_lists: list[list[str]]) -> list[DictConfig]:
    """Many compositions (a sweep's points) at the cost of one per distinct
    choice of config groups: Hydra composes each choice once (about 0.1 s),
    then applies the value overrides to a copy exactly as compose would."""
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()} | {"hydra"}
    parser = OverridesParser.create()
    composed: dict[tuple[str, ...], DictConfig] = {}
    configs = []
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for overrides in override_lists:
            parsed = parser.parse_overrides(overrides)
            choice = tuple(
                o.input_line
                for o in parsed
                if o.key_or_group.split(".")[0] in groups and "." not in o.key_or_group
            )
            if choice not in composed:
                composed[choice] = compose(config_name="config", overrides=list(choice))
            cfg = copy.deepcopy(composed[choice])
            values = [o for o in parsed if o.input_line not in choice]
            ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
            configs.append(cfg)
    return configs


def sweep_axes(text: str) -> list[list[str]]:
    """Hydra's sweep grammar ("a=1,2 b=x"): one axis of overrides per key."""
    parsed = OverridesParser.create().parse_overrides(shlex.split(text))
    return [
        (
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [f"{o.get_key_element()}={o.get_value_element_as_str()}"]
        )
        for o in parsed
    ]


def load(path: Path | str) -> DictConfig:
    """A run's saved config.yaml, in the schema the launcher validated it in
    (the same types, enums and defaults)."""
    return OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.load(path))


def to_plain(cfg: DictConfig) -> dict:
    """The resolved config without Hydra's own node, as plain data."""
    plain = OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)
    plain.pop("hydra", None)
    return plain


def flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    """`{"a": {"b": 1}}` -> `{"a.b": 1}`, as MLflow params are named."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def setting_name(cfg: DictConfig) -> str:
    """A readable name that changes whenever anything trained but the seed does: what
    the runs of one setting with different seeds share."""
    plain = to_plain(cfg)
    for not_the_setting in ("prepare", "report", "mlflow_parent_run_id", "mlflow_parent", "seed"):
        plain.pop(not_the_setting, None)
    plain["train"].pop("log_model")  # what is logged, not what is trained
    digest = hashlib.sha256(json.dumps(plain, sort_keys=True).encode()).hexdigest()
    return (
        f"{cfg.data.name}-{cfg.model.name}-{plain['strategy']['name']}"
        f"-{plain['precision']['name']}-b{cfg.train.global_batch_size}"
        f"-w{cfg.strategy.num_workers}-{digest[:8]}"
    )


def memory_mb(cfg: DictConfig) -> int:
    """Host memory a training run needs, estimated from its data and model.
    Each process (workers, ps tasks, coordinator) holds TensorFlow's runtime,
    about 1.5 GB. A worker on CPU also keeps its batch's activations for the
    backward pass: about 16 bytes per pixel, times the base width and a
    quarter of the blocks (ResNet-50 at 224 px: 205 MB an image). On a GPU
    they are in its memory, and the host keeps a few input batches."""
    strategy, model, size = cfg.strategy, cfg.model, cfg.data.image_size
    processes = strategies.of(cfg).processes(cfg)
    per_worker = cfg.train.global_batch_size // strategy.num_workers
    if strategy.gpus_per_worker:
        per_image = 4 * 3 * size**2 * 4  # four batches of float pixels
    else:
        per_image = 16 * size**2 * model.base_width * sum(model.blocks_per_stage) / 4
    return int(1500 * processes + strategy.num_workers * per_worker * per_image / 2**20)


def run_name(cfg: DictConfig) -> str:
    """A readable name that changes whenever anything the run depends on does."""
    return f"{setting_name(cfg)}-s{cfg.seed}"
