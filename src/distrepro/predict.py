"""Images/s of each strategy on a cluster, from the cost model (costmodel),
published hardware figures (conf/hardware/, each value with its source) and
the host CPU's costs measured here (benchmarks/cpu_costs.json): place your
own cluster on the curve by overriding them.

    python -m distrepro.predict experiment=aws_blog_8gpu       (the seed, beside its figures)
    python -m distrepro.predict experiment=aws_horovod_32gpu   (AWS's 32-GPU Horovod run)
    python -m distrepro.predict experiment=aws_horovod_32gpu hardware.link_gbit=100
    python -m distrepro.predict --all   (every published figure of conf/published.yaml)

The CPU costs are scaled to the target by one stated rule: a vCPU there does
the work of a vCPU of the machine that measured them.
"""

from __future__ import annotations

import functools
import json
import math
import statistics
import sys

import hydra
import yaml
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from distrepro import costmodel, strategies
from distrepro.config import CONF_DIR, compose_config

CPU_COSTS = CONF_DIR.parent / "benchmarks" / "cpu_costs.json"  # benchmarks/cpu_costs.py


def setting(cfg: DictConfig, device_img_s: float, synchronous: bool) -> costmodel.Setting:
    hardware, workers = cfg.hardware, cfg.strategy.num_workers
    per_worker = cfg.train.global_batch_size / workers
    return costmodel.Setting(
        workers=workers,
        workers_per_host=hardware.workers_per_host,
        global_batch=cfg.train.global_batch_size,
        compute_s=per_worker / device_img_s,
        synchronous=synchronous,
    )


def links(hardware: DictConfig, hosts: int) -> costmodel.Links:
    """Within one host a ps task is on its CPU, over PCIe; across hosts, on
    another host, over the network."""
    ps = hardware.link_gbit if hosts > 1 else None
    return costmodel.Links(
        hosts=costmodel.gbit(hardware.link_gbit),
        devices=costmodel.gbit(hardware.device_link_gbit),
        worker_ps=costmodel.gbit(ps or hardware.worker_ps_gbit),
        ps=costmodel.gbit(ps or hardware.ps_link_gbit),
    )


@functools.cache
def cpu_costs() -> dict:
    return json.loads(CPU_COSTS.read_text())


def host_cpu(hardware: DictConfig, synthetic: bool) -> costmodel.HostCPU:
    costs = cpu_costs()
    return costmodel.HostCPU(
        vcpus=hardware.host_vcpus,
        decode_s=0.0 if synthetic else costs["decode_s_per_image"],
        ps_apply_s=costs["ps_apply_s_per_byte"],
        ps_serve_s=costs["ps_serve_s_per_byte"],
    )


def predictions(
    cfg: DictConfig,
    device_img_s: float | None = None,
    synthetic: bool = False,
    synchronous: bool = False,
) -> dict[str, float]:
    """Predicted img/s of every strategy in cfg's setting on cfg.hardware,
    from its compute figure or `device_img_s`; the parameter server's
    workers stepping together when `synchronous` (as TensorFlow 1.x's did)."""
    hardware = cfg.hardware
    parameters = cfg.model.parameters
    gradients = costmodel.gradient_bytes(parameters, cfg.strategy.fp16_allreduce)
    variables = costmodel.variable_bytes(parameters)
    given = setting(cfg, device_img_s or hardware.device_img_s, synchronous)
    between = links(hardware, hosts_of(cfg))
    cpu = host_cpu(hardware, synthetic)
    return {
        name: given.global_batch
        / costmodel.step_time(
            strategies.module(name).EXCHANGE,
            strategies.module(name).BACKWARD_OVERLAP,
            given,
            between,
            gradients,
            variables,
            cpu,
        )
        for name in strategies.REGISTRY
    }


def hosts_of(cfg: DictConfig) -> int:
    return math.ceil(cfg.strategy.num_workers / cfg.hardware.workers_per_host)


def hardware_entry(choice: str) -> dict:
    """A hardware entry's values over those of the entries it builds on."""
    values = yaml.safe_load((CONF_DIR / "hardware" / f"{choice}.yaml").read_text())
    entry = {}
    for base in values.pop("defaults", []):
        entry.update(values if base == "_self_" else hardware_entry(base))
    return entry or values


def compute_inputs(hardware: DictConfig) -> dict[str, float]:
    """Every hardware entry's figure for the same device, by entry."""
    entries = {p.stem: hardware_entry(p.stem) for p in (CONF_DIR / "hardware").glob("*.yaml")}
    return {
        name: entry["device_img_s"]
        for name, entry in sorted(entries.items(), key=lambda e: e[1]["device_img_s"])
        if entry["device"] == hardware.device
    }


def sensitivity(cfg: DictConfig, synchronous: bool) -> list[str]:
    """The predictions under each compute input, side by side."""
    inputs = compute_inputs(cfg.hardware)
    rows = {name: predictions(cfg, rate, synchronous=synchronous) for name, rate in inputs.items()}
    lines = [f"{'under each compute input':<24}" + "".join(f"{n:>18}" for n in rows)]
    lines.append(f"{'(img/s a device)':<24}" + "".join(f"{r:>18,.1f}" for r in inputs.values()))
    for strategy in strategies.REGISTRY:
        cells = "".join(f"{rows[n][strategy]:>18,.0f}" for n in rows)
        lines.append(f"{strategy:<24}{cells}")
    return lines


def refusal(cfg: DictConfig) -> str | None:
    if cfg.hardware is None:
        return "no hardware: choose one of conf/hardware/ (hardware=p3_16xlarge) or an experiment"
    if cfg.hardware.get("host_vcpus") is None:
        return f"hardware={cfg.hardware.name} gives no host_vcpus: add its host's vCPU count"
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
    synchronous = bool(published) and cfg.published.get("synchronous", False)
    print("\n".join(table(predictions(cfg, synchronous=synchronous), published)))
    if published:
        print(f"published: {cfg.published.source}")
    elif cfg.published:
        print(f"(no published figure: they are for {dict(cfg.published.setting)} as published)")
    if synchronous:
        print("parameter_server: as published, its workers stepping together (synchronous)")
    print("\n" + "\n".join(sensitivity(cfg, synchronous)))
    print("\nInputs and their sources:\n" + sources(HydraConfig.get().runtime.choices["hardware"]))
    print(cpu_inputs())


def cpu_inputs() -> str:
    costs = cpu_costs()
    return (
        f"# {CPU_COSTS.relative_to(CONF_DIR.parent)}, `{costs['command']}` on {costs['cpu']} "
        f"({costs['date']}), a vCPU there for a vCPU here:\n"
        f"decode_s_per_image: {costs['decode_s_per_image']:.3g}\n"
        f"ps_apply_s_per_byte: {costs['ps_apply_s_per_byte']:.3g}\n"
        f"ps_serve_s_per_byte: {costs['ps_serve_s_per_byte']:.3g}"
    )


def checks(device_img_s: float | None = None) -> list[dict]:
    """Every published run of conf/published.yaml, predicted: its family's
    input first (marked), then its runs. device_img_s replaces every
    family's compute input (for a comparison with another one)."""
    rows = []
    for family in yaml.safe_load((CONF_DIR / "published.yaml").read_text())["families"]:
        given = family.get("input")
        first = (
            [{**given, "strategy": family["runs"][0]["strategy"], "input": True}] if given else []
        )
        for run in [*first, *family["runs"]]:
            cfg = compose_config(
                [
                    "experiment=aws_blog_8gpu",
                    f"strategy={run['strategy']}",
                    f"hardware={family['hardware']}",
                    f"strategy.num_workers={run['gpus']}",
                    f"train.global_batch_size={run['gpus'] * family['batch_per_gpu']}",
                ]
            )
            rate = device_img_s or (given["img_s"] if given else None)
            predicted = predictions(
                cfg, rate, family.get("synthetic", False), family.get("synchronous", False)
            )[run["strategy"]]
            rows.append(
                {
                    "source": family["source"],
                    "strategy": run["strategy"],
                    "gpus": run["gpus"],
                    "published": run["img_s"],
                    "predicted": predicted,
                    "error": (predicted - run["img_s"]) / run["img_s"],
                    "input": run.get("input", False),
                }
            )
    return rows


def summary(rows: list[dict]) -> str:
    errors = [abs(r["error"]) for r in rows if not r["input"]]
    return (
        f"{len(errors)} checks: mean |error| {statistics.mean(errors):.0%}, "
        f"largest {max(errors):.0%}"
    )


def print_checks() -> None:
    rows = checks()
    source = None
    for r in rows:
        if r["source"] != source:
            source = r["source"]
            print(f"\n{source}")
        mark = "  input, not a check" if r["input"] else ""
        print(
            f"  {r['strategy']:<22}{r['gpus']:>4} GPUs  predicted {r['predicted']:>9,.0f}"
            f"  published {r['published']:>9,.0f}  {r['error']:+5.0%}{mark}"
        )
    print(f"\n{summary(rows)}")
    today = compose_config(["hardware=p3_16xlarge"]).hardware.device_img_s
    print(f"with today's compute input ({today} img/s a V100) for every family:")
    print(summary(checks(today)))
    print("\n" + cpu_inputs())


if __name__ == "__main__":
    if sys.argv[1:] == ["--all"]:
        print_checks()
    else:
        main()
