"""Images/s of each strategy on a cluster, from the cost model (costmodel)
and published hardware figures (conf/hardware/, each value with its source):
place your own cluster on the curve by overriding them.

    python -m distrepro.predict experiment=aws_blog_8gpu       (the seed, beside its figures)
    python -m distrepro.predict experiment=aws_horovod_32gpu   (AWS's 32-GPU Horovod run)
    python -m distrepro.predict experiment=aws_horovod_32gpu hardware.link_gbit=100
"""

from __future__ import annotations

import math

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from distrepro import costmodel, strategies
from distrepro.config import CONF_DIR


def setting(cfg: DictConfig) -> costmodel.Setting:
    hardware, workers = cfg.hardware, cfg.strategy.num_workers
    per_worker = cfg.train.global_batch_size / workers
    return costmodel.Setting(
        workers=workers,
        workers_per_host=hardware.workers_per_host,
        global_batch=cfg.train.global_batch_size,
        compute_s=per_worker / hardware.device_img_s,
    )


def links(hardware: DictConfig) -> costmodel.Links:
    return costmodel.Links(
        hosts=costmodel.gbit(hardware.link_gbit),
        devices=costmodel.gbit(hardware.device_link_gbit),
        worker_ps=costmodel.gbit(hardware.worker_ps_gbit),
        ps=costmodel.gbit(hardware.ps_link_gbit),
    )


def predictions(cfg: DictConfig) -> dict[str, float]:
    """Predicted img/s of every strategy in cfg's setting on cfg.hardware."""
    parameters = cfg.model.parameters
    gradients = costmodel.gradient_bytes(parameters, cfg.strategy.fp16_allreduce)
    variables = costmodel.variable_bytes(parameters)
    given, between = setting(cfg), links(cfg.hardware)
    return {
        name: given.global_batch
        / costmodel.step_time(
            strategies.module(name).EXCHANGE,
            strategies.module(name).BACKWARD_OVERLAP,
            given,
            between,
            gradients,
            variables,
        )
        for name in strategies.REGISTRY
    }


def refusal(cfg: DictConfig) -> str | None:
    if cfg.hardware is None:
        return "no hardware: choose one of conf/hardware/ (hardware=p3_16xlarge) or an experiment"
    if cfg.model.parameters is None:
        return f"model.parameters is not set for model={cfg.model.name}: give its parameter count"
    return None


def published_here(cfg: DictConfig, hardware_changed: bool) -> dict:
    """The experiment's published img/s, when cfg is still the setting they
    were measured in (not another worker count, batch or machine)."""
    if not cfg.published:
        return {}
    setting = cfg.published.setting
    same = (
        not hardware_changed
        and cfg.hardware.name == setting.hardware
        and cfg.strategy.num_workers == setting.num_workers
        and cfg.train.global_batch_size == setting.global_batch_size
    )
    return cfg.published.images_per_sec if same else {}


def table(predicted: dict[str, float], published: dict) -> list[str]:
    lines = [f"{'strategy':<24}{'predicted img/s':>16}{'published':>12}{'error':>9}"]
    for name, rate in predicted.items():
        known = published.get(name)
        error = f"{(rate - known) / known:+.0%}" if known else ""
        lines.append(f"{name:<24}{rate:>16,.0f}{known or '':>12}{error:>9}")
    return lines


def sources(choice: str) -> str:
    """The hardware config's text, whose comments give each value's source."""
    text = (CONF_DIR / "hardware" / f"{choice}.yaml").read_text()
    bases = [
        line.strip()[2:]
        for line in text.splitlines()
        if line.startswith("  - ") and "_self_" not in line
    ]
    return "".join(sources(base) for base in bases) + f"# conf/hardware/{choice}.yaml\n{text}"


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    refused = refusal(cfg)
    if refused:
        raise SystemExit(f"predict: {refused}")
    hardware = cfg.hardware
    hosts = math.ceil(cfg.strategy.num_workers / hardware.workers_per_host)
    print(
        f"{cfg.model.name} ({cfg.model.parameters:,} parameters), global batch "
        f"{cfg.train.global_batch_size}, {cfg.strategy.num_workers} workers, "
        f"{hardware.workers_per_host} a host, on {hosts} host(s): {hardware.name}"
    )
    if hardware.device_model != cfg.model.name:
        print(f"note: hardware.device_img_s was measured with {hardware.device_model}")
    changed = any(o.startswith("hardware.") for o in HydraConfig.get().overrides.task)
    published = published_here(cfg, changed)
    print("\n".join(table(predictions(cfg), published)))
    if published:
        print(f"published: {cfg.published.source}")
    elif cfg.published:
        print(f"(no published figure: they are for {dict(cfg.published.setting)} as published)")
    print("\nInputs and their sources:\n" + sources(HydraConfig.get().runtime.choices["hardware"]))


if __name__ == "__main__":
    main()
