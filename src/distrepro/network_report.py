"""The network experiment's report: img/s against link rate per strategy as
its library ships it and at its best (95 % intervals over seeds), each
strategy's grid of settings and its winners, where the strategies cross (at
the libraries' defaults and best against best), the bytes per step measured
on each link beside what the model size implies for every layout, each run's
share of time communicating, and the cost model checked against every shaped
run.

    python -m distrepro.network_report winners BEST_JSON RUN_DIR..
    python -m distrepro.network_report [--winners BEST_JSON] OUT_DIR RUN_DIR..
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

from distrepro import config, costmodel, stats, strategies  # noqa: E402
from distrepro.atomic import write_json_atomically  # noqa: E402
from distrepro.network import (  # noqa: E402
    HEADER_BYTES,
    UNSHAPED,
    megabit,
    model_inputs,
    override,
    shipped,
)
from distrepro.report import markdown_table  # noqa: E402

# A run is communication-bound when the model's communication time exceeds its compute.
COMM_BOUND = 1.0
SHIPPED = "library defaults"
WHY_BYTES = {
    "all-reduce": (
        "All-reduce: the ring's 2(N-1)/N x gradient bytes (halved in fp16), plus the "
        "library's framing."
    ),
    "parameter server": (
        "Parameter server: a worker receives each variable it reads over the link once per "
        "update (R, measured, in the last column; the weight decay is applied on the ps "
        "tasks) and sends its gradients and the batch norm statistics it updates; a "
        "colocated ps task serves its share to the other workers over its host's link. gRPC "
        "framing adds a few %."
    ),
}


def variant(cfg) -> tuple[str, ...]:
    """The strategy's own keys that differ from its library's defaults, as overrides."""
    name = cfg.strategy.name.value
    ships = shipped(name)
    return tuple(
        override(key, cfg.strategy[key])
        for key in strategies.module(name).KEYS
        if cfg.strategy[key] != ships[key]
    )


def label(run_variant: tuple[str, ...]) -> str:
    return ", ".join(v.removeprefix("strategy.") for v in run_variant) or SHIPPED


def load(run_dir: Path) -> dict:
    metrics = json.loads((run_dir / "metrics.json").read_text())
    network = json.loads((run_dir / "network.json").read_text())
    if "measured_wire" not in network:  # its "measured" counted the headers too
        raise SystemExit(
            f"{run_dir}/network.json predates the TCP payload counts: "
            "move the run away to train it again"
        )
    cfg = config.load(run_dir / "config.yaml")
    timed = [h["images_per_sec"] for h in metrics["history"][1:]]
    return metrics | {
        "network": network,
        "cfg": cfg,
        "variant": variant(cfg),
        "rate": sum(timed) / len(timed),  # the epochs whose bytes were counted
    }


def settings(runs: list[dict]) -> dict[tuple, list[dict]]:
    """(strategy, workers, bandwidth, variant) -> its seeds' runs."""
    grouped: dict[tuple, list[dict]] = {}
    for run in runs:
        key = (run["strategy"], run["num_workers"], run["network"]["bandwidth"], run["variant"])
        grouped.setdefault(key, []).append(run)
    return grouped


def rate_class(bandwidth: str) -> str:
    return "unshaped" if bandwidth == UNSHAPED else "shaped"


def grid_rates(grouped: dict[tuple, list[dict]]) -> set[str]:
    """Where the grid runs: the lowest shaped rate, and unshaped."""
    shaped = [k[2] for k in grouped if k[2] != UNSHAPED]
    return {min(shaped, key=megabit), UNSHAPED} if shaped else {UNSHAPED}


def winners(runs: list[dict]) -> dict[str, list[str]]:
    """Each strategy's (and worker count's) fastest setting at the grid's
    rates: {"horovod/2/shaped": overrides, "horovod/2/unshaped": ...}."""
    grouped = settings(runs)
    rates = grid_rates(grouped)
    best: dict[str, tuple[float, tuple]] = {}
    for (strategy, workers, bandwidth, run_variant), group in grouped.items():
        if bandwidth in rates:
            key = f"{strategy}/{workers}/{rate_class(bandwidth)}"
            rate = stats.mean_interval([r["rate"] for r in group]).estimate
            if key not in best or rate > best[key][0]:
                best[key] = (rate, run_variant)
    return {key: list(run_variant) for key, (_, run_variant) in sorted(best.items())}


def prediction(group: list[dict], unshaped: list[dict]) -> tuple[float, float, float]:
    """(img/s, communication s per step, compute s per step) the cost model
    gives for a setting at its link rate, from its strategy's unshaped runs
    of the same setting: their time per step (the compute time) and, when
    traced by Horovod, how spread out its gradients become ready."""
    run = group[0]
    module = strategies.module(run["strategy"])
    compute_s = (
        run["global_batch_size"] / stats.mean_interval([r["rate"] for r in unshaped]).estimate
    )
    ready = [r["gradients_ready_within_s"] for r in unshaped if "gradients_ready_within_s" in r]
    overlap = costmodel.overlap(
        module.BACKWARD_OVERLAP, sum(ready) / len(ready) if ready else None, compute_s
    )
    link = sum(r["network"]["link_bytes_per_s"] for r in group) / len(group)
    links = costmodel.Links(hosts=link, devices=link, worker_ps=link, ps=link)
    setting, gradients, variables = model_inputs(run["cfg"], run, compute_s)
    step_s = costmodel.step_time(module.EXCHANGE, overlap, setting, links, gradients, variables)
    idle = dataclasses.replace(setting, compute_s=0.0)
    communication = costmodel.step_time(module.EXCHANGE, 0.0, idle, links, gradients, variables)
    return setting.global_batch / step_s, communication, compute_s


def curves(grouped: dict[tuple, list[dict]]) -> list[dict]:
    """One row per shaped setting: measured mean and interval, link rate,
    predicted img/s and its error, communication share."""
    rows = []
    shaped = [key for key in grouped if key[2] != UNSHAPED]
    for key in sorted(shaped, key=lambda k: (k[0], k[1], k[3], megabit(k[2]))):
        strategy, workers, bandwidth, run_variant = key
        group = grouped[key]
        measured = stats.mean_interval([r["rate"] for r in group])
        row = {
            "strategy": strategy,
            "workers": workers,
            "bandwidth": bandwidth,
            "variant": run_variant,
            "mbit": megabit(bandwidth),
            "link_mbyte_s": sum(r["network"]["link_bytes_per_s"] for r in group) / len(group) / 1e6,
            "images_per_sec": measured.estimate,
            "ci95": [measured.low, measured.high],
            "rates": [r["rate"] for r in group],
            "seeds": len(group),
            "communication_share": share(group),
        }
        unshaped = grouped.get((strategy, workers, UNSHAPED, run_variant))
        if unshaped:
            rate, communication, compute_s = prediction(group, unshaped)
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


def curve_of(rows: list[dict], picked: dict[tuple, tuple] | None) -> list[dict]:
    """The rows of each strategy's curve: its library's defaults (picked None), or the
    setting picked for each (strategy, workers, rate class)."""
    if picked is None:
        return [r for r in rows if not r["variant"]]
    return [
        r
        for r in rows
        if picked.get((r["strategy"], r["workers"], rate_class(r["bandwidth"]))) == r["variant"]
    ]


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


def verdicts(shipped_rows: list[dict], best_rows: list[dict]) -> list[str]:
    """At each rate, each compared pair best against best, with the 95 %
    interval of its img/s ratio, and how far that moved from the libraries' defaults."""
    sentences = []
    by = {
        kind: {(r["workers"], r["bandwidth"], r["strategy"]): r for r in rows}
        for kind, rows in (("shipped", shipped_rows), ("best", best_rows))
    }
    for (workers, bandwidth, a), row in sorted(by["best"].items(), key=lambda i: megabit(i[0][1])):
        for first, second in strategies.COMPARED:
            other = by["best"].get((workers, bandwidth, second))
            if first != a or other is None:
                continue
            ratio = stats.ratio_interval(row["rates"], other["rates"])
            said = stats.ratio_sentence(
                first, second, ratio, "img/s", "is {} faster than", "is {} slower than"
            )
            before = [by["shipped"].get((workers, bandwidth, s)) for s in (first, second)]
            moved = ""
            if all(before):
                was = before[0]["images_per_sec"] / before[1]["images_per_sec"]
                moved = (
                    f" At the libraries' defaults {first}/{second} was {was:.2f}x; "
                    f"best against best {ratio.estimate:.2f}x."
                )
            sentences.append(f"At {bandwidth}, best against best: {said}{moved}")
    return sentences


def bytes_rows(runs: list[dict]) -> list[list[str]]:
    """Per strategy, setting and link: measured bytes per step (mean over the
    shaped runs; payload, then on the wire) beside the expected, each way,
    and R as measured."""
    rows = []
    keyed: dict[tuple, list[dict]] = {}
    for run in runs:
        if run["network"]["bandwidth"] != UNSHAPED:
            keyed.setdefault((run["strategy"], run["variant"]), []).append(run)
    for (strategy, run_variant), shaped in sorted(keyed.items()):
        reads = [r["network"].get("reads_per_update") for r in shaped]
        reads = [r for r in reads if r is not None]
        for role in shaped[0]["network"]["expected"]:
            cells = [strategy, label(run_variant), role]
            for way in ("sent", "received"):
                measured, wire = (
                    sum(r["network"][kind][role][way] for r in shaped) / len(shaped)
                    for kind in ("measured", "measured_wire")
                )
                expected = shaped[0]["network"]["expected"][role][way]
                cells += [
                    f"{measured / 1e6:.3f}",
                    f"{wire / 1e6:.3f}",
                    f"{expected / 1e6:.3f}",
                    f"{measured / expected:.2f}",
                ]
            rows.append([*cells, f"{sum(reads) / len(reads):.2f}" if reads else "-"])
    return rows


def half_widths(row: dict) -> tuple[float, float]:
    low, high = row["ci95"]
    if math.isnan(low):  # one seed
        return 0.0, 0.0
    return row["images_per_sec"] - low, high - row["images_per_sec"]


def plot(curve_rows: dict[str, list[dict]], path: Path) -> None:
    """Each strategy's curves (its library's defaults solid, at its best dotted), the
    cost model's dashed."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = {SHIPPED: "-", "at its best": ":"}
    for (kind, rows), (index, strategy) in itertools.product(
        curve_rows.items(), enumerate(strategies.REGISTRY)
    ):
        mine = [r for r in rows if r["strategy"] == strategy]
        if not mine:
            continue
        color = plt.cm.tab10.colors[index]
        x = [r["mbit"] for r in mine]
        y = [r["images_per_sec"] for r in mine]
        spread = list(zip(*map(half_widths, mine), strict=True))
        ax.errorbar(
            x,
            y,
            yerr=spread,
            marker="o",
            capsize=3,
            color=color,
            linestyle=styles[kind],
            label=f"{strategy}, {kind}",
        )
        predicted = [r.get("predicted") for r in mine]
        if all(p is not None for p in predicted):
            ax.plot(x, predicted, linestyle="--", color=color, alpha=0.4, linewidth=1)
    ax.set_xscale("log")
    ax.set_xlabel("each host's link (Mbit/s, tc tbf)")
    ax.set_ylabel("images/s (timed epochs after the first)")
    ax.set_title("Throughput against bandwidth (thin dashed: cost model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def fmt(value: float | None, form: str) -> str:
    return (
        "-"
        if value is None or (isinstance(value, float) and math.isnan(value))
        else form.format(value)
    )


def curve_table(rows: list[dict]) -> str:
    return markdown_table(
        [
            [
                r["strategy"],
                label(r["variant"]),
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
        ],
        (
            "strategy",
            "setting",
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
    )


def model_check(rows: list[dict]) -> list[str]:
    bound = [abs(r["error"]) for r in rows if r.get("communication_bound")]
    others = [abs(r["error"]) for r in rows if r.get("communication_bound") is False]
    lines = []
    for name, errors in (("Communication", bound), ("Compute", others)):
        if errors:
            lines.append(
                f"{name}-bound settings: mean |error| {sum(errors) / len(errors):.0%}, "
                f"largest {max(errors):.0%} ({len(errors)} settings)."
            )
    return lines


def grid_section(grouped: dict[tuple, list[dict]], picked: dict[tuple, tuple]) -> list[str]:
    """Each strategy's settings at the grid's rates (one seed), the winners marked."""
    rows, rates = [], grid_rates(grouped)
    for (strategy, workers, bandwidth, run_variant), group in sorted(grouped.items()):
        if bandwidth not in rates:
            continue
        winner = picked.get((strategy, workers, rate_class(bandwidth)))
        rate = stats.mean_interval([r["rate"] for r in group]).estimate
        mark = "winner" if winner == run_variant else ""
        cells = [strategy, str(workers), bandwidth, label(run_variant), str(len(group))]
        rows.append([*cells, f"{rate:.1f}", mark])
    return [
        "## Each strategy's settings, and what won",
        "",
        "The settings a user of each strategy would try (`--config grid=...`), one seed "
        "each (the library's defaults: every seed) at the grid's shaped rate and unshaped, "
        "by mean img/s; "
        "the winner at each is then trained with every seed at every shaped rate (the "
        "shaped winner) or unshaped.",
        "",
        markdown_table(rows, ("strategy", "workers", "link", "setting", "seeds", "img/s", "")),
        "",
    ]


def write(out_dir: Path, runs: list[dict], best: dict[str, list[str]] | None = None) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    grouped = settings(runs)
    rows = curves(grouped)
    picked = None
    if best is not None:
        picked = {}
        for key, overrides in best.items():
            strategy, workers, kind = key.split("/")
            picked[(strategy, int(workers), kind)] = tuple(overrides)
    curve_rows = {SHIPPED: curve_of(rows, None)}
    if picked is not None:
        curve_rows["at its best"] = curve_of(rows, picked)
    plot(curve_rows, out_dir / "throughput.png")
    first = runs[0]
    gradients = costmodel.gradient_bytes(first["trainable_parameters"], fp16_allreduce=False)
    variables = costmodel.variable_bytes(first["parameters"])
    unshaped = [
        [
            k[0],
            label(k[3]),
            str(k[1]),
            f"{stats.mean_interval([r['rate'] for r in g]).estimate:.1f}",
        ]
        for k, g in sorted(grouped.items())
        if k[2] == UNSHAPED
    ]
    layouts = [
        f"- {name}, {SHIPPED}: "
        + (
            ", ".join(f"{k}={shipped(name)[k]}" for k in strategies.module(name).KEYS)
            or "no settings of its own"
        )
        for name in strategies.REGISTRY
    ]
    text = [
        "# The interconnect: throughput against link bandwidth",
        "",
        f"{first['model']} ({first['parameters']:,} parameters, {first['trainable_parameters']:,} "
        f"trainable): {gradients / 1e6:.3f} MB of gradients (half with fp16 all-reduce) and "
        f"{variables / 1e6:.3f} MB of "
        f"variables per update; global batch {first['global_batch_size']}, {first['dataset']}. "
        "Each worker on a host of its own, the launcher and the parameter server's "
        "coordinator on another; every host's link shaped both ways with `tc tbf`; img/s "
        "over the timed epochs after the first.",
        "",
        "The settings compared (a ps task on a host of its own is `ps_placement=separate`; "
        "one beside each worker `colocated`):",
        "",
        *layouts,
        "",
        "![throughput](throughput.png)",
        "",
    ]
    if picked is not None:
        text += grid_section(grouped, picked)
        text += [
            "## Best against best",
            "",
            *[f"- {s}" for s in verdicts(curve_rows[SHIPPED], curve_rows["at its best"])],
            "",
        ]
    for kind, kind_rows in curve_rows.items():
        text += [f"## Where the strategies cross, {kind}", "", *crossings(kind_rows), ""]
    text += [
        "## Throughput and the cost model",
        "",
        "Predicted: `distrepro.costmodel` from the same setting's unshaped runs' time per step "
        "(the compute time), the measured link rate, the model's bytes and each ps task's "
        "share; nothing fitted. Regime: by the model, communication time per step against "
        "compute. Communicating: the traced updates' share in all-reduce (or, parameter "
        "server, workers waiting).",
        "",
        curve_table(rows),
        "",
        *model_check(rows),
        "",
        "Unshaped (the compute time's source):",
        "",
        markdown_table(unshaped, ("strategy", "setting", "workers", "img/s")),
        "",
        "## Bytes per step on each link",
        "",
        "MB per step (one global batch), mean over the shaped runs, from the switch's port "
        "counters over the timed epochs: the TCP payload (the bytes counted, less "
        f"{HEADER_BYTES} bytes of Ethernet, IP and TCP headers per packet counted) and on the "
        "wire (headers, acknowledgements and all; the kernel sends fewer, larger packets on a "
        "fast link); expected from the model's size (`distrepro.costmodel`). A colocated "
        "parameter server's worker link carries its ps task's traffic too.",
        "",
        markdown_table(
            bytes_rows(runs),
            (
                "strategy",
                "setting",
                "link",
                "sent",
                "on the wire",
                "expected",
                "ratio",
                "received",
                "on the wire",
                "expected",
                "ratio",
                "R",
            ),
        ),
        "",
        *[f"- {why}" for why in WHY_BYTES.values()],
        "",
    ]
    (out_dir / "report.md").write_text("\n".join(text))
    summary = [{k: v for k, v in r.items() if k != "rates"} for r in rows]
    write_json_atomically(out_dir / "network.json", {"settings": summary, "winners": best})


def main(argv: list[str]) -> None:
    if argv[:1] == ["winners"]:
        out, *run_dirs = argv[1:]
        write_json_atomically(Path(out), winners([load(Path(d)) for d in run_dirs]))
        print(Path(out).read_text())
        return
    best = None
    if argv[:1] == ["--winners"]:
        best, argv = json.loads(Path(argv[1]).read_text()), argv[2:]
    out_dir, *run_dirs = argv
    write(Path(out_dir), [load(Path(d)) for d in run_dirs], best)
    print((Path(out_dir) / "report.md").read_text())


if __name__ == "__main__":
    main(sys.argv[1:])
