"""The report of an experiment that a condition of the project's own hosts
sets (distrepro.network): a straggler's slowdown (network.json's
`slowdown`). For each value of the condition: each strategy's img/s, best
top-1 and time to the target top-1 with 95 % intervals and the main
report's verdicts; the straggler's own updates per second; the cost model's
img/s beside the measured, from the runs at the condition's neutral value;
which strategy reaches the target first. Another condition of the hosts
takes an entry in CONDITIONS, not a module of its own.

    python -m distrepro.conditions_report CONDITION OUT_DIR RUN_DIR..
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distrepro import costmodel, report, stats, strategies  # noqa: E402
from distrepro.atomic import write_json_atomically  # noqa: E402


@dataclass(frozen=True)
class Condition:
    name: str  # what it is, in a sentence
    heading: str  # what it is, before its value
    neutral: float  # its value in the runs the model starts from
    unit: str


CONDITIONS = {"slowdown": Condition("the straggler's slowdown", "Slowdown", 1.0, "x")}
COLUMNS = (
    "strategy",
    "seeds",
    "img/s",
    "model img/s (error)",
    "straggler updates/s",
    "best top-1",
    "time to target (s)",
)


def load(run_dir: Path, key: str) -> dict:
    """A run's metrics.json with its condition's value."""
    run = json.loads((run_dir / "metrics.json").read_text())
    value = json.loads((run_dir / "network.json").read_text()).get(key)
    return run | {"condition": CONDITIONS[key].neutral if value is None else float(value)}


def straggler_updates_per_s(run: dict) -> float:
    """The last worker's own updates per second over the epochs after the
    first: an asynchronous worker's from its count, a synchronous worker's
    the run's (it takes every update)."""
    later = run["history"][1:] or run["history"]
    if "updates_by_worker" not in later[0]:
        return run["images_per_sec"] / run["global_batch_size"]
    updates = sum(record["updates_by_worker"][-1] for record in later)
    return updates / sum(record["epoch_time_s"] for record in later)


def by_value(runs: list[dict]) -> dict[float, dict[str, list[dict]]]:
    """{condition value: {strategy label: runs}}, values in order."""
    grouped: dict[float, list[dict]] = {}
    for run in runs:
        grouped.setdefault(run["condition"], []).append(run)
    return {value: report.settings(grouped[value]) for value in sorted(grouped)}


def predicted(group: list[dict], value: float, neutral: list[dict] | None) -> float | None:
    """The cost model's img/s at the condition's value, from the mean img/s of
    the same strategy's runs at its neutral value (unshaped links: the
    exchange's share of a step taken as 0)."""
    if not neutral:
        return None
    run = group[0]
    even = stats.mean_interval(report.values(neutral, "images_per_sec")).estimate
    exchange = strategies.module(run["strategy"]).EXCHANGE
    return costmodel.straggler_rate(exchange, even, run["num_workers"], value)


def rows(values: dict[float, dict[str, list[dict]]], neutral_value: float) -> list[dict]:
    neutral = values.get(neutral_value, {})
    table = []
    for value, groups in values.items():
        for name, group in groups.items():
            model = predicted(group, value, neutral.get(name))
            rates = [straggler_updates_per_s(run) for run in group]
            measured = stats.mean_interval(report.values(group, "images_per_sec"))
            reached = report.values(group, "time_to_target_s")
            table.append(
                {
                    "condition": value,
                    "setting": name,
                    "strategy": group[0]["strategy"],
                    "seeds": len(group),
                    "images_per_sec": measured.estimate,
                    "images_per_sec_interval": [measured.low, measured.high],
                    "predicted_images_per_sec": model,
                    "model_error": None if model is None else measured.estimate / model - 1,
                    "straggler_updates_per_s": sum(rates) / len(rates),
                    "time_to_target_s": sum(reached) / len(reached) if reached else None,
                    "reached": len(reached),
                    "cells": [
                        report.cell(group, "images_per_sec", "{:.1f}"),
                        "-"
                        if model is None
                        else f"{model:.1f} ({measured.estimate / model - 1:+.0%})",
                        f"{sum(rates) / len(rates):.2f}",
                        report.cell(group, "best_top1", "{:.2%}"),
                        report.cell(group, "time_to_target_s", "{:.1f}"),
                    ],
                }
            )
    return table


def fastest(value_rows: list[dict], condition: Condition, value: float, target: float) -> str:
    """Which strategy reaches the target first at one value of the condition
    (only strategies whose every seed reached it are ranked)."""
    at = f"at {condition.name} {value:g}{condition.unit}"
    ranked = [
        r for r in value_rows if r["time_to_target_s"] is not None and r["reached"] == r["seeds"]
    ]
    if not ranked:
        return f"No strategy reached top-1 {target:.0%} with every seed {at}."
    first = min(ranked, key=lambda r: r["time_to_target_s"])
    seconds = first["time_to_target_s"]
    return f"{first['strategy']} reached top-1 {target:.0%} first {at}, in {seconds:.1f} s."


def where_ps_wins(table: list[dict], condition: Condition, target: float) -> str:
    """The sentence the experiment is for."""
    wins = []
    for value in sorted({r["condition"] for r in table}):
        here = [r for r in table if r["condition"] == value and r["reached"] == r["seeds"]]
        here = [r for r in here if r["time_to_target_s"] is not None]
        if (
            here
            and min(here, key=lambda r: r["time_to_target_s"])["strategy"] == strategies.BASELINE
        ):
            wins.append(f"{value:g}{condition.unit}")
    if wins:
        return (
            f"The parameter server reaches top-1 {target:.0%} first at {condition.name} "
            f"{', '.join(wins)}."
        )
    return (
        f"At no {condition.name} of these runs does the parameter server reach top-1 "
        f"{target:.0%} first."
    )


def plot(table: list[dict], condition: Condition, path: Path) -> None:
    """img/s and time to target against the condition, per strategy (thin
    dashed: the cost model)."""
    fig, (rate_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
    for index, strategy in enumerate(strategies.REGISTRY):
        mine = [r for r in table if r["strategy"] == strategy]
        if not mine:
            continue
        color = plt.cm.tab10.colors[index]
        x = [r["condition"] for r in mine]
        y = [r["images_per_sec"] for r in mine]
        spread = [
            [v - r["images_per_sec_interval"][0] for v, r in zip(y, mine, strict=True)],
            [r["images_per_sec_interval"][1] - v for v, r in zip(y, mine, strict=True)],
        ]
        rate_ax.errorbar(x, y, yerr=spread, marker="o", capsize=3, color=color, label=strategy)
        model = [r["predicted_images_per_sec"] for r in mine]
        if all(m is not None for m in model):
            rate_ax.plot(x, model, linestyle="--", color=color, alpha=0.4, linewidth=1)
        reached = [(r["condition"], r["time_to_target_s"]) for r in mine if r["time_to_target_s"]]
        if reached:
            time_ax.plot(*zip(*reached, strict=True), marker="o", color=color, label=strategy)
    for ax, what in (
        (rate_ax, "images/s (timed epochs after the first)"),
        (time_ax, "time to target (s)"),
    ):
        ax.set_xlabel(f"{condition.name} ({condition.unit})")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    fig.suptitle(f"Training against {condition.name} (thin dashed: cost model)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(key: str, out_dir: Path, runs: list[dict]) -> None:
    condition, target = CONDITIONS[key], runs[0]["target_top1"]
    values = by_value(runs)
    table = rows(values, condition.neutral)
    lines = [
        f"# Training against {condition.name}",
        "",
        f"{len(runs)} runs on the project's own hosts (unshaped links), {runs[0]['epochs']} "
        f"epochs, target top-1 {target:.0%}. The straggler is the last worker's host, its CPU "
        "quota divided by the slowdown; the others keep strategy.cores_per_worker cores. "
        "The model's img/s starts from the same strategy's runs without a straggler (no fit): "
        "a synchronous step waits for the straggler, asynchronous workers' rates add up.",
    ]
    for value, groups in values.items():
        value_rows = [r for r in table if r["condition"] == value]
        lines += ["", f"## {condition.heading} {value:g}{condition.unit}", ""]
        lines.append(
            report.markdown_table(
                [[r["setting"], str(r["seeds"]), *r["cells"]] for r in value_rows], COLUMNS
            )
        )
        lines += ["", fastest(value_rows, condition, value, target)]
        lines += [f"- {sentence}" for sentence in report.verdicts(groups)]
    lines += ["", where_ps_wins(table, condition, target), "", "![](throughput.png)", ""]
    out_dir.mkdir(parents=True, exist_ok=True)
    plot(table, condition, out_dir / "throughput.png")
    summary = [{k: v for k, v in r.items() if k != "cells"} for r in table]
    write_json_atomically(out_dir / "conditions.json", {"condition": key, "rows": summary})
    (out_dir / "report.md").write_text("\n".join(lines))


def main(argv: list[str]) -> None:
    key, out_dir, *run_dirs = argv
    if key not in CONDITIONS:
        raise SystemExit(f"conditions_report: {key!r} is not one of {', '.join(CONDITIONS)}")
    write(key, Path(out_dir), [load(Path(d), key) for d in run_dirs])


if __name__ == "__main__":
    main(sys.argv[1:])
