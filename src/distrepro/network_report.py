"""The network experiment's report: img/s against link rate per strategy
(95 % intervals over seeds), where the strategies cross, the bytes per step
measured on each link beside what the model size implies, each run's share
of time communicating, and the cost model checked against every shaped run.

    python -m distrepro.network_report OUT_DIR RUN_DIR..
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import yaml  # noqa: E402

from distrepro import costmodel, stats, strategies  # noqa: E402
from distrepro.atomic import write_json_atomically  # noqa: E402
from distrepro.network import UNSHAPED  # noqa: E402
from distrepro.report import markdown_table  # noqa: E402

# A run is communication-bound when the model's communication time exceeds its compute.
COMM_BOUND = 1.0
WHY_BYTES = {
    "all-reduce": (
        "All-reduce: the ring's 2(N-1)/N x gradient bytes, plus TCP/IP headers and "
        "acknowledgements of what the link receives (a few %) and the library's framing."
    ),
    "parameter server": (
        "Parameter server: a worker receives each variable twice per update (read in the "
        "forward pass and again in the backward; remote reads are not kept within a step) "
        "and sends its gradients and the batch norm statistics it updates; gRPC framing, "
        "TCP/IP headers and acknowledgements add a few %. The ps link carries all workers'."
    ),
}


def megabit(bandwidth: str) -> float:
    number, unit = bandwidth[:-4], bandwidth[-4:]
    return float(number) * {"kbit": 1e-3, "mbit": 1.0, "gbit": 1e3}[unit]


def load(run_dir: Path) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    network = json.loads((run_dir / "network.json").read_text())
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    timed = [h["images_per_sec"] for h in metrics["history"][1:]]
    return metrics | {
        "network": network,
        "num_ps": config["strategy"]["num_ps"],
        "fp16_allreduce": config["strategy"]["fp16_allreduce"],
        "rate": sum(timed) / len(timed),  # the epochs whose bytes were counted
    }


def settings(runs: list[dict]) -> dict[tuple, list[dict]]:
    """(strategy, workers, bandwidth) -> its seeds' runs."""
    grouped: dict[tuple, list[dict]] = {}
    for run in runs:
        key = (run["strategy"], run["num_workers"], run["network"]["bandwidth"])
        grouped.setdefault(key, []).append(run)
    return grouped


def model_inputs(run: dict) -> tuple[float, float]:
    gradients = costmodel.gradient_bytes(run["trainable_parameters"], run["fp16_allreduce"])
    return gradients, costmodel.variable_bytes(run["parameters"])


def prediction(run: dict, unshaped: list[dict]) -> tuple[float, float, float]:
    """(img/s, communication s per step, compute s per step) the cost model
    gives for run's link rate, from its strategy's unshaped runs: their time
    per step (the compute time) and, when traced by Horovod, how spread out
    its gradients become ready."""
    module = strategies.module(run["strategy"])
    compute_s = (
        run["global_batch_size"] / stats.mean_interval([r["rate"] for r in unshaped]).estimate
    )
    ready = [r["gradients_ready_within_s"] for r in unshaped if "gradients_ready_within_s" in r]
    overlap = costmodel.overlap(
        module.BACKWARD_OVERLAP, sum(ready) / len(ready) if ready else None, compute_s
    )
    link = run["network"]["link_bytes_per_s"]
    setting = costmodel.Setting(
        workers=run["num_workers"],
        workers_per_host=1,
        num_ps=max(1, run["num_ps"]),
        global_batch=run["global_batch_size"],
        compute_s=compute_s,
    )
    links = costmodel.Links(hosts=link, devices=link, worker_ps=link, ps=link)
    gradients, variables = model_inputs(run)
    step_s = costmodel.step_time(module.EXCHANGE, overlap, setting, links, gradients, variables)
    idle = dataclasses.replace(setting, compute_s=0.0)
    communication = costmodel.step_time(module.EXCHANGE, 0.0, idle, links, gradients, variables)
    return setting.global_batch / step_s, communication, compute_s


def curves(grouped: dict[tuple, list[dict]]) -> list[dict]:
    """One row per shaped setting: measured mean and interval, link rate,
    predicted img/s and its error, communication share."""
    rows = []
    shaped = [key for key in grouped if key[2] != UNSHAPED]
    for strategy, workers, bandwidth in sorted(shaped, key=lambda k: (k[0], k[1], megabit(k[2]))):
        group = grouped[(strategy, workers, bandwidth)]
        unshaped = grouped.get((strategy, workers, UNSHAPED))
        measured = stats.mean_interval([r["rate"] for r in group])
        row = {
            "strategy": strategy,
            "workers": workers,
            "bandwidth": bandwidth,
            "mbit": megabit(bandwidth),
            "link_mbyte_s": sum(r["network"]["link_bytes_per_s"] for r in group) / len(group) / 1e6,
            "images_per_sec": measured.estimate,
            "ci95": [measured.low, measured.high],
            "seeds": len(group),
            "communication_share": share(group),
        }
        if unshaped:
            predicted = [prediction(r, unshaped) for r in group]
            rate = sum(p[0] for p in predicted) / len(predicted)
            _, communication, compute_s = predicted[0]
            row |= {
                "predicted": rate,
                "error": (rate - measured.estimate) / measured.estimate,
                "communication_bound": communication > COMM_BOUND * compute_s,
            }
        rows.append(row)
    return rows


def share(group: list[dict]) -> float | None:
    """The mean share of the traced updates spent communicating (all-reduce,
    or parameter-server workers waiting), when the runs were traced."""
    found = [r.get("allreduce_share", r.get("ps_wait_share")) for r in group]
    found = [f for f in found if f is not None]
    return sum(found) / len(found) if found else None


def crossings(rows: list[dict]) -> list[str]:
    """Where each compared pair's mean curves cross, interpolated on log rate."""
    sentences = []
    for a, b in strategies.COMPARED:
        pairs = {}
        for row in rows:
            pairs.setdefault((row["workers"], row["mbit"]), {})[row["strategy"]] = row
        points = sorted(
            (mbit, p[a]["images_per_sec"] / p[b]["images_per_sec"])
            for (_, mbit), p in pairs.items()
            if a in p and b in p
        )
        if not points:
            continue
        found = None
        for (x0, r0), (x1, r1) in itertools.pairwise(points):
            if (r0 - 1) * (r1 - 1) < 0:
                t = math.log(r0) / (math.log(r0) - math.log(r1))
                found = math.exp(math.log(x0) + t * (math.log(x1) - math.log(x0)))
                sentences.append(
                    f"{a} and {b} cross near {found:.0f} Mbit/s (between {x0:g} and {x1:g}): "
                    f"{a}/{b} is {r0:.2f} at {x0:g} and {r1:.2f} at {x1:g} Mbit/s."
                )
        if found is None:
            ratios = ", ".join(f"{r:.2f} at {x:g}" for x, r in points)
            faster = a if points[0][1] > 1 else b
            sentences.append(
                f"{a} and {b} do not cross between {points[0][0]:g} and {points[-1][0]:g} "
                f"Mbit/s: {faster} is faster throughout ({a}/{b}: {ratios})."
            )
    return sentences


def bytes_rows(runs: list[dict]) -> list[list[str]]:
    """Per strategy and link: measured bytes per step (mean over shaped runs)
    beside the expected, each way."""
    rows = []
    for strategy in strategies.REGISTRY:
        shaped = [
            r for r in runs if r["strategy"] == strategy and r["network"]["bandwidth"] != UNSHAPED
        ]
        if not shaped:
            continue
        for role in shaped[0]["network"]["expected"]:
            cells = [strategy, role]
            for way in ("sent", "received"):
                measured = sum(r["network"]["measured"][role][way] for r in shaped) / len(shaped)
                expected = shaped[0]["network"]["expected"][role][way]
                cells += [
                    f"{measured / 1e6:.3f}",
                    f"{expected / 1e6:.3f}",
                    f"{measured / expected:.2f}",
                ]
            rows.append(cells)
    return rows


def half_widths(row: dict) -> tuple[float, float]:
    low, high = row["ci95"]
    if math.isnan(low):  # one seed
        return 0.0, 0.0
    return row["images_per_sec"] - low, high - row["images_per_sec"]


def plot(rows: list[dict], path: Path) -> None:
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for index, strategy in enumerate(strategies.REGISTRY):
        mine = [r for r in rows if r["strategy"] == strategy]
        if not mine:
            continue
        color = plt.cm.tab10.colors[index]
        x = [r["mbit"] for r in mine]
        y = [r["images_per_sec"] for r in mine]
        spread = list(zip(*map(half_widths, mine), strict=True))
        ax.errorbar(x, y, yerr=spread, marker="o", capsize=3, color=color, label=strategy)
        predicted = [r.get("predicted") for r in mine]
        if all(p is not None for p in predicted):
            ax.plot(x, predicted, linestyle="--", color=color, alpha=0.7)
    ax.set_xscale("log")
    ax.set_xlabel("each host's link (Mbit/s, tc tbf)")
    ax.set_ylabel("images/s (timed epochs after the first)")
    ax.set_title("Throughput against bandwidth (dashed: cost model)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(value: float | None, form: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else form.format(value)
    )


def write(out_dir: Path, runs: list[dict]) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    grouped = settings(runs)
    rows = curves(grouped)
    plot(rows, out_dir / "throughput.png")
    first = runs[0]
    gradients, variables = model_inputs(first)
    curve_table = [
        [
            r["strategy"],
            str(r["workers"]),
            r["bandwidth"],
            f"{r['link_mbyte_s']:.2f}",
            str(r["seeds"]),
            f"{r['images_per_sec']:.1f} ({' to '.join(fmt(x, '{:.1f}') for x in r['ci95'])})",
            fmt(r.get("predicted"), "{:.1f}"),
            fmt(r.get("error"), "{:+.0%}"),
            {True: "communication", False: "compute", None: "-"}[r.get("communication_bound")],
            fmt(r["communication_share"], "{:.0%}"),
        ]
        for r in rows
    ]
    unshaped = [
        [k[0], str(k[1]), f"{stats.mean_interval([r['rate'] for r in g]).estimate:.1f}"]
        for k, g in sorted(grouped.items())
        if k[2] == UNSHAPED
    ]
    bound = [abs(r["error"]) for r in rows if r.get("communication_bound")]
    others = [abs(r["error"]) for r in rows if r.get("communication_bound") is False]
    check = [
        f"Communication-bound runs: mean |error| {sum(bound) / len(bound):.0%}, "
        f"largest {max(bound):.0%} ({len(bound)} settings)."
        if bound
        else "No setting is communication-bound.",
        f"Compute-bound runs: mean |error| {sum(others) / len(others):.0%}, "
        f"largest {max(others):.0%} ({len(others)} settings)."
        if others
        else "",
    ]
    text = [
        "# The interconnect: throughput against link bandwidth",
        "",
        f"{first['model']} ({first['parameters']:,} parameters, {first['trainable_parameters']:,} "
        f"trainable): {gradients / 1e6:.3f} MB of gradients and {variables / 1e6:.3f} MB of "
        f"variables per update; global batch {first['global_batch_size']}, {first['dataset']}. "
        "Each worker, and the parameter server's ps tasks, on a host of its own; every host's "
        "link shaped both ways with `tc tbf`; img/s over the timed epochs after the first.",
        "",
        "![throughput](throughput.png)",
        "",
        "## Where the strategies cross",
        "",
        *crossings(rows),
        "",
        "## Throughput and the cost model",
        "",
        "Predicted: `distrepro.costmodel` from the unshaped runs' time per step (the compute "
        "time), the measured link rate and the model's bytes; nothing fitted. Regime: by the "
        "model, communication time per step against compute. Communicating: the traced "
        "updates' share in all-reduce (or, parameter server, workers waiting).",
        "",
        markdown_table(
            curve_table,
            (
                "strategy",
                "workers",
                "link",
                "MB/s measured",
                "seeds",
                "img/s (95 % CI)",
                "predicted",
                "error",
                "regime",
                "communicating",
            ),
        ),
        "",
        *[line for line in check if line],
        "",
        "Unshaped (the compute time's source):",
        "",
        markdown_table(unshaped, ("strategy", "workers", "img/s")),
        "",
        "## Bytes per step on each link",
        "",
        "MB per step (one global batch), mean over the shaped runs, from the interface "
        "counters over the timed epochs; expected from the model's size (`distrepro.costmodel`).",
        "",
        markdown_table(
            bytes_rows(runs),
            ("strategy", "link", "sent", "expected", "ratio", "received", "expected", "ratio"),
        ),
        "",
        *[f"- {why}" for why in WHY_BYTES.values()],
        "",
    ]
    (out_dir / "report.md").write_text("\n".join(text))
    write_json_atomically(out_dir / "network.json", {"settings": rows})


def main(argv: list[str]) -> None:
    out_dir, *run_dirs = argv
    write(Path(out_dir), [load(Path(d)) for d in run_dirs])
    print((Path(out_dir) / "report.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
