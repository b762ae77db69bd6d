"""The report of an experiment that a condition of the project's own hosts
sets (distrepro.network): a straggler's slowdown, or the mean interval
between kills of a worker (network.json's `slowdown`, `kill_interval_s`).
For each value of the condition: each strategy's img/s, best top-1 and time
to the target top-1 (from its launch) with 95 % intervals and the main
report's verdicts; the condition's own figures beside the cost model's,
which starts from the runs at the condition's neutral value (no straggler,
no kills); which strategy reaches the target first. Another condition of
the hosts takes an entry in CONDITIONS, not a module of its own.

    python -m distrepro.conditions_report CONDITION OUT_DIR RUN_DIR..
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from distrepro import costmodel, report, stats, strategies  # noqa: E402
from distrepro.atomic import write_json_atomically  # noqa: E402


def straggler_updates_per_s(run: dict) -> float:
    """The last worker's own updates per second over the epochs after the
    first: an asynchronous worker's from its count, a synchronous worker's
    the run's (it takes every update)."""
    later = run["history"][1:] or run["history"]
    if "updates_by_worker" not in later[0]:
        return run["images_per_sec"] / run["global_batch_size"]
    updates = sum(record["updates_by_worker"][-1] for record in later)
    return updates / sum(record["epoch_time_s"] for record in later)


def mean(numbers: list[float]) -> float:
    return sum(numbers) / len(numbers)


def exchange(run: dict) -> str:
    return strategies.module(run["strategy"]).EXCHANGE


def straggler_figures(group: list[dict], value: float, neutral: list[dict]) -> dict:
    """The straggler's own pace; the model's img/s from the runs without one
    (unshaped links: the exchange's share of a step taken as 0)."""
    figures = {"straggler_updates_per_s": mean([straggler_updates_per_s(r) for r in group])}
    figures["cells"] = ["-", f"{figures['straggler_updates_per_s']:.2f}"]
    if neutral:
        even = mean(report.values(neutral, "images_per_sec"))
        model = costmodel.straggler_rate(exchange(group[0]), even, group[0]["num_workers"], value)
        error = mean(report.values(group, "images_per_sec")) / model - 1
        figures |= {"predicted_images_per_sec": model, "model_error": error}
        figures["cells"][0] = f"{model:.1f} ({error:+.0%})"
    return figures


def start_up_s(run: dict) -> float:
    """From the launch to the first epoch's timed part (TensorFlow's start,
    the model built, the warmup updates)."""
    return run["history"][0]["timed_window"][0] - run["launched_at"]


def kill_figures(group: list[dict], value: float, neutral: list[dict]) -> dict:
    """Kills a run and the seconds each cost: the run's wall time beyond the
    mean of the same strategy's runs without kills, over its kills; the
    model's from those runs' start-up and epoch times."""
    kills = [len(run["kills"]) for run in group]
    figures = {"kills": mean(kills), "cells": [f"{mean(kills):.1f}", "-"]}
    if neutral and any(kills):
        undisturbed = mean([run["wall_s"] for run in neutral])
        lost = mean(
            [(r["wall_s"] - undisturbed) / k for r, k in zip(group, kills, strict=True) if k]
        )
        epochs = [e["epoch_time_s"] for run in neutral for e in run["history"][1:]]
        model = costmodel.seconds_lost_per_kill(
            exchange(group[0]),
            mean([start_up_s(r) for r in neutral]),
            mean(epochs),
            group[0]["num_workers"],
        )
        figures |= {"lost_per_kill_s": lost, "predicted_lost_per_kill_s": model}
        figures["cells"][1] = f"{lost:.1f} (model {model:.1f})"
    return figures


@dataclass(frozen=True)
class Condition:
    name: str  # what it is, in a sentence
    at: str  # a run's condition, "{}" its value
    neutral: float  # its value in the runs the model starts from
    unit: str
    columns: tuple[str, ...]  # its own, after img/s
    figures: Callable[[list[dict], float, list[dict]], dict]  # theirs, and their cells
    about: str  # how the runs were made and the model reads them

    def phrase(self, value: float) -> str:
        """The condition at value, in words: "at slowdown 4x", "without kills"."""
        return "without kills" if math.isinf(value) else self.at.format(f"{value:g}{self.unit}")


CONDITIONS = {
    "slowdown": Condition(
        "the straggler's slowdown",
        "at slowdown {}",
        1.0,
        "x",
        ("model img/s (error)", "straggler updates/s"),
        straggler_figures,
        "The straggler is the last worker's host, its CPU quota divided by the slowdown; the "
        "others keep strategy.cores_per_worker cores. The model's img/s starts from the same "
        "strategy's runs without a straggler (no fit): a synchronous step waits for the "
        "straggler, asynchronous workers' rates add up.",
    ),
    "kill_interval_s": Condition(
        "the mean interval between kills",
        "with a kill every {} on average",
        math.inf,
        " s",
        ("kills", "s lost a kill"),
        kill_figures,
        "The last worker's training processes are killed with SIGKILL at random times "
        "(network.kill_seed); the parameter server starts the worker's task again, the "
        "synchronous strategies restart from their last checkpoint. A kill's cost is the run's "
        "wall time beyond the same strategy's runs without kills; the model's (no fit) is the "
        "restart, measured as those runs' start-up, and for a restart from a checkpoint half an "
        "epoch on average besides; for the parameter server the killed worker's share of the "
        "restart.",
    ),
}


def load(run_dir: Path, key: str) -> dict:
    """A run's metrics.json with its hosts' record, its condition's value and
    its time to the target from its launch (restarts included)."""
    run = json.loads((run_dir / "metrics.json").read_text())
    record = json.loads((run_dir / "network.json").read_text())
    value = record.get(key)
    reached = [e for e in run["history"] if e["val_top1"] >= run["target_top1"]]
    return run | {
        "condition": CONDITIONS[key].neutral if value is None else float(value),
        "launched_at": record["launched_at"],
        "wall_s": record["wall_s"],
        "kills": record.get("kills", []),
        "time_to_target_s": reached[0]["timed_window"][1] - record["launched_at"]
        if reached
        else None,
    }


def by_value(runs: list[dict]) -> dict[float, dict[str, list[dict]]]:
    """{condition value: {strategy label: runs}}, values in order."""
    grouped: dict[float, list[dict]] = {}
    for run in runs:
        grouped.setdefault(run["condition"], []).append(run)
    return {value: report.settings(grouped[value]) for value in sorted(grouped)}


def rows(values: dict[float, dict[str, list[dict]]], condition: Condition) -> list[dict]:
    neutral = values.get(condition.neutral, {})
    table = []
    for value, groups in values.items():
        for name, group in groups.items():
            measured = stats.mean_interval(report.values(group, "images_per_sec"))
            reached = report.values(group, "time_to_target_s")
            own = condition.figures(group, value, neutral.get(name, []))
            table.append(
                {
                    "condition": value,
                    "setting": name,
                    "strategy": group[0]["strategy"],
                    "seeds": len(group),
                    "images_per_sec": measured.estimate,
                    "images_per_sec_interval": [measured.low, measured.high],
                    "time_to_target_s": mean(reached) if reached else None,
                    "reached": len(reached),
                    **own,
                    "cells": [
                        report.cell(group, "images_per_sec", "{:.1f}"),
                        *own["cells"],
                        report.cell(group, "best_top1", "{:.2%}"),
                        report.cell(group, "time_to_target_s", "{:.1f}"),
                    ],
                }
            )
    return table


def fastest(value_rows: list[dict], condition: Condition, value: float, target: float) -> str:
    """Which strategy reaches the target first at one value of the condition
    (only strategies whose every seed reached it are ranked)."""
    at = condition.phrase(value)
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
    wins, values = [], sorted({r["condition"] for r in table})
    for value in values:
        here = [r for r in table if r["condition"] == value and r["reached"] == r["seeds"]]
        here = [r for r in here if r["time_to_target_s"] is not None]
        if (
            here
            and min(here, key=lambda r: r["time_to_target_s"])["strategy"] == strategies.BASELINE
        ):
            wins.append(condition.phrase(value))
    if wins:
        return f"The parameter server reaches top-1 {target:.0%} first {' and '.join(wins)}."
    return (
        f"The parameter server reaches top-1 {target:.0%} first under none of these "
        f"conditions: {', '.join(condition.phrase(v) for v in sorted(values))}."
    )


def plot(table: list[dict], condition: Condition, path: Path) -> None:
    """img/s and time to target against the condition, per strategy (thin
    dashed: the cost model's img/s, where it has one); the runs at a
    condition of no value (no kills) as dotted lines."""
    fig, (rate_ax, time_ax) = plt.subplots(1, 2, figsize=(10, 4.2))
    for index, strategy in enumerate(strategies.REGISTRY):
        mine = [r for r in table if r["strategy"] == strategy]
        color = plt.cm.tab10.colors[index]
        for row in (r for r in mine if math.isinf(r["condition"])):
            rate_ax.axhline(row["images_per_sec"], color=color, linestyle=":", linewidth=1)
            if row["time_to_target_s"]:
                time_ax.axhline(row["time_to_target_s"], color=color, linestyle=":", linewidth=1)
        mine = [r for r in mine if not math.isinf(r["condition"])]
        if not mine:
            continue
        x = [r["condition"] for r in mine]
        y = [r["images_per_sec"] for r in mine]
        spread = [
            [v - r["images_per_sec_interval"][0] for v, r in zip(y, mine, strict=True)],
            [r["images_per_sec_interval"][1] - v for v, r in zip(y, mine, strict=True)],
        ]
        rate_ax.errorbar(x, y, yerr=spread, marker="o", capsize=3, color=color, label=strategy)
        model = [r.get("predicted_images_per_sec") for r in mine]
        if all(m is not None for m in model):
            rate_ax.plot(x, model, linestyle="--", color=color, alpha=0.4, linewidth=1)
        reached = [(r["condition"], r["time_to_target_s"]) for r in mine if r["time_to_target_s"]]
        if reached:
            time_ax.plot(*zip(*reached, strict=True), marker="o", color=color, label=strategy)
    for ax, what in (
        (rate_ax, "images/s (timed epochs after the first)"),
        (time_ax, "time to target from the launch (s)"),
    ):
        ax.set_xlabel(f"{condition.name} ({condition.unit.strip()})")
        ax.set_ylabel(what)
        ax.legend(fontsize=7)
    fig.suptitle(f"Training against {condition.name}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write(key: str, out_dir: Path, runs: list[dict]) -> None:
    condition, target = CONDITIONS[key], runs[0]["target_top1"]
    values = by_value(runs)
    table = rows(values, condition)
    columns = ("strategy", "seeds", "img/s", *condition.columns, "best top-1", "time to target (s)")
    lines = [
        f"# Training against {condition.name}",
        "",
        f"{len(runs)} runs on the project's own hosts (unshaped links), {runs[0]['epochs']} "
        f"epochs, target top-1 {target:.0%}, its time counted from the launch. {condition.about}",
    ]
    for value, groups in values.items():
        value_rows = [r for r in table if r["condition"] == value]
        phrase = condition.phrase(value)
        lines += ["", f"## {phrase[0].upper()}{phrase[1:]}", ""]
        cells = [[r["setting"], str(r["seeds"]), *r["cells"]] for r in value_rows]
        lines.append(report.markdown_table(cells, columns))
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
