"""Hydra app: the seed's comparison table regenerated from this project's runs,
every strategy against the parameter-server baseline and Horovod against
TensorFlow's own all-reduce (strategies.COMPARED).

`python -m distrepro.report 'report.runs=[results/runs/a,results/runs/b]'`
writes report.md, report.html and PNG plots to report.out_dir."""

from __future__ import annotations

import html
import itertools
import json
import platform
from pathlib import Path

import hydra
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from distrepro import config, stats, strategies  # noqa: E402,F401  (config registers the schema)

SEED_SETTING = "ImageNet, ResNet-50, 8 x V100 (p3.16xlarge), batch 2048, fp16, 90 epochs"
SEED_RUNS = {  # the seed's published figures, by the strategy each ran
    "parameter_server": {"images_per_sec": 4249, "total_time_s": 27621, "best_top1": 0.7549},
    "horovod": {"images_per_sec": 5058, "total_time_s": 22906, "best_top1": 0.7559},
}
SUMMARY_KEYS = ("strategy", "seed", "images_per_sec", "total_time_s", "top1", "best_top1")
MEASURES = (  # metrics.json key, column, format
    ("images_per_sec", "img/s", "{:.1f}"),
    ("total_time_s", "total time (s)", "{:.1f}"),
    ("best_top1", "best top-1", "{:.2%}"),
    ("time_to_target_s", "time to target (s)", "{:.1f}"),
)
COLUMNS = ("setting", "seeds", *(column for _, column, _ in MEASURES))
PROFILE_COLUMNS = ("run", "profiled updates", "allreduce", "negotiation", "workers waiting")
SCALING_COLUMNS = ("strategy", "workers", "global batch", "img/s", "ideal img/s", "efficiency")
ASYNCHRONOUS = (
    "Parameter-server training is asynchronous: the order in which the workers' "
    "updates reach the variables depends on timing, so its runs differ even with "
    "one seed and `train.deterministic=true`; its spread is part of what is measured."
)


def load_runs(run_dirs: list[str]) -> list[dict]:
    return [json.loads((Path(d) / "metrics.json").read_text()) for d in run_dirs]


def settings(runs: list[dict]) -> dict[str, list[dict]]:
    """Runs that differ only in their seed, under a readable label (with the
    setting's hash when the label alone would not tell two settings apart)."""
    groups: dict[str, list[dict]] = {}
    for run in runs:
        groups.setdefault(run["setting"], []).append(run)
    labels = [label(group[0]) for group in groups.values()]
    return {
        name if labels.count(name) == 1 else f"{name} {setting[-8:]}": group
        for name, (setting, group) in zip(labels, groups.items(), strict=True)
    }


def label(run: dict) -> str:
    return f"{run['strategy']} (b{run['global_batch_size']}, {run['num_workers']} workers)"


def values(group: list[dict], key: str) -> list[float]:
    return [run[key] for run in group if run.get(key) is not None]


def cell(group: list[dict], key: str, form: str) -> str:
    found = values(group, key)
    if not found:
        return "not reached"
    interval = stats.mean_interval(found)
    text = form.format(interval.estimate)
    if interval.resolved:
        low, high = interval.low, interval.high
        if form.endswith("%}"):  # a fraction: the interval stops at 0 and 1
            low, high = max(low, 0.0), min(high, 1.0)
        text += f" ({form.format(low)} to {form.format(high)})"
    if len(found) < len(group):
        text += f", {len(found)} of {len(group)} reached"
    return text


def table_rows(groups: dict[str, list[dict]]) -> list[list[str]]:
    return [
        [name, str(len(group)), *(cell(group, key, form) for key, _, form in MEASURES)]
        for name, group in groups.items()
    ]


def seed_rows() -> list[list[str]]:
    return [
        [
            f"{name} (batch 2048, 8 GPUs)",
            "1",
            f"{SEED_RUNS[name]['images_per_sec']}",
            f"{SEED_RUNS[name]['total_time_s']:,}",
            f"{SEED_RUNS[name]['best_top1']:.2%}",
            "-",
        ]
        for name in SEED_RUNS
    ]


def verdicts(groups: dict[str, list[dict]]) -> list[str]:
    """For each pair of strategies the registry compares (every one against
    the baseline, Horovod against TensorFlow's all-reduce): one sentence per
    measure for each pair of settings that differ only in their strategy."""
    sentences = []
    for first, second in strategies.COMPARED:
        for name, group in groups.items():
            if group[0]["strategy"] != first:
                continue
            for other_name, other in groups.items():
                if other[0]["strategy"] == second and comparable(group[0], other[0]):
                    sentences += compare(name, group, other_name, other)
    return sentences


def comparable(a: dict, b: dict) -> bool:
    keys = ("dataset", "model", "precision", "global_batch_size", "num_workers", "epochs")
    return all(a[k] == b[k] for k in keys)


RATIOS = (  # key, what, how the first strategy is when its ratio is above 1, below 1
    ("images_per_sec", "img/s", "is {} faster than", "is {} slower than"),
    ("total_time_s", "total time", "takes {} longer than", "takes {} less time than"),
)


def compare(a_name: str, a: list[dict], b_name: str, b: list[dict]) -> list[str]:
    """What the runs support on each measure, a against b, one sentence each."""
    a_short, b_short = a[0]["strategy"], b[0]["strategy"]
    sentences = [
        stats.ratio_sentence(
            a_short, b_short, stats.ratio_interval(values(a, key), values(b, key)), *words
        )
        for key, *words in RATIOS
    ]
    top1 = stats.difference_interval(values(a, "best_top1"), values(b, "best_top1"))
    sentences.append(stats.difference_sentence(a_short, b_short, top1, "best top-1"))
    reached_a, reached_b = values(a, "time_to_target_s"), values(b, "time_to_target_s")
    to_target = f"time to top-1 {a[0]['target_top1']:.0%}"
    if len(reached_a) == len(a) and len(reached_b) == len(b):
        ratio = stats.ratio_interval(reached_a, reached_b)
        words = ("takes {} longer than", "takes {} less time than")
        sentences.append(stats.ratio_sentence(a_short, b_short, ratio, to_target, *words))
    else:
        sentences.append(
            f"The {to_target} was reached by {len(reached_a)} of {len(a)} {a_short} runs and "
            f"{len(reached_b)} of {len(b)} {b_short} runs: no ratio."
        )
    return [f"{a_name} against {b_name}: " + " ".join(sentences)]


def curves(group: list[dict], x_key: str, y_key: str) -> list[tuple[list[float], list[float]]]:
    """Each run's curve of y against x (an epoch, or the cumulated epoch time)."""
    result = []
    for run in group:
        history = run["history"]
        if x_key == "wall_time_s":
            x = list(np.cumsum([h["epoch_time_s"] for h in history]))
        else:
            x = [h[x_key] for h in history]
        result.append((x, [h[y_key] for h in history]))
    return result


def plot(
    groups: dict[str, list[dict]],
    x_key: str,
    y_key: str,
    labels: tuple[str, str],
    path: Path,
    target: float | None = None,
) -> None:
    """Each seed's curve thin, the mean over the seeds bold, a colour per setting."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for color, (name, group) in zip(itertools.cycle(plt.cm.tab10.colors), groups.items()):
        lines = curves(group, x_key, y_key)
        for x, y in lines:
            ax.plot(x, y, color=color, linewidth=0.7, alpha=0.5)
        epochs = min(len(x) for x, _ in lines)
        mean_x = np.mean([x[:epochs] for x, _ in lines], axis=0)
        mean_y = np.mean([y[:epochs] for _, y in lines], axis=0)
        ax.plot(mean_x, mean_y, color=color, linewidth=2.5, label=f"{name}, mean of {len(lines)}")
    if target is not None:
        ax.axhline(target, color="grey", linestyle="--", linewidth=1, label=f"target {target:.0%}")
    ax.set_xlabel(labels[0])
    ax.set_ylabel(labels[1])
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_against_batch(groups: dict[str, list[dict]], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    for strategy in sorted({g[0]["strategy"] for g in groups.values()}):
        mine = sorted(
            (g for g in groups.values() if g[0]["strategy"] == strategy),
            key=lambda g: g[0]["global_batch_size"],
        )
        batches = [g[0]["global_batch_size"] for g in mine]
        for ax, key in ((left, "images_per_sec"), (right, "best_top1")):
            intervals = [stats.mean_interval(values(g, key)) for g in mine]
            means = [i.estimate for i in intervals]
            errors = [0.0 if not i.resolved else i.high - i.estimate for i in intervals]
            ax.errorbar(batches, means, yerr=errors, marker="o", capsize=3, label=strategy)
    for ax, ylabel in ((left, "images/s"), (right, "best top-1")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch size")
        ax.set_ylabel(ylabel)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def by_workers(groups: dict[str, list[dict]]) -> dict[str, list[list[dict]]]:
    """Each strategy's settings in order of workers, when they span several
    counts at one batch per worker (a scaling); else nothing."""
    curves = {}
    for strategy in sorted({g[0]["strategy"] for g in groups.values()}):
        mine = sorted(
            (g for g in groups.values() if g[0]["strategy"] == strategy),
            key=lambda g: g[0]["num_workers"],
        )
        per_worker = {g[0]["global_batch_size"] // g[0]["num_workers"] for g in mine}
        if len({g[0]["num_workers"] for g in mine}) > 1 and len(per_worker) == 1:
            curves[strategy] = mine
    return curves


def scaling_rows(curves: dict[str, list[list[dict]]]) -> list[list[str]]:
    """img/s at each count against linear scaling from the smallest count."""
    rows = []
    for strategy, settings_ in curves.items():
        base = settings_[0]
        base_rates, base_workers = values(base, "images_per_sec"), base[0]["num_workers"]
        for group in settings_:
            workers = group[0]["num_workers"]
            rates = values(group, "images_per_sec")
            ideal = workers / base_workers * float(np.mean(base_rates))
            efficiency = stats.scaling_efficiency(rates, workers, base_rates, base_workers)
            text = f"{efficiency.estimate:.2f}"
            if efficiency.resolved:
                text += f" ({efficiency.low:.2f} to {efficiency.high:.2f})"
            rows.append(
                [
                    strategy,
                    str(workers),
                    str(group[0]["global_batch_size"]),
                    cell(group, "images_per_sec", "{:.1f}"),
                    f"{ideal:.1f}",
                    text,
                ]
            )
    return rows


def plot_scaling(curves: dict[str, list[list[dict]]], path: Path) -> None:
    """img/s against workers per strategy (95 % intervals), and the ideal line."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for color, (strategy, settings_) in zip(itertools.cycle(plt.cm.tab10.colors), curves.items()):
        workers = [g[0]["num_workers"] for g in settings_]
        intervals = [stats.mean_interval(values(g, "images_per_sec")) for g in settings_]
        means = [i.estimate for i in intervals]
        errors = [i.high - i.estimate if i.resolved else 0.0 for i in intervals]
        ax.errorbar(workers, means, yerr=errors, marker="o", capsize=3, color=color, label=strategy)
        ideal = [n / workers[0] * means[0] for n in workers]
        ax.plot(workers, ideal, linestyle="--", color=color, label=f"{strategy}, linear")
    ax.set_xlabel("workers")
    ax.set_ylabel("images/s")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def profile_rows(runs: list[dict]) -> list[list[str]]:
    """Per profiled run, the shares of its traced window in which gradients were
    being allreduced (Horovod, TensorFlow's all-reduce) or negotiated (Horovod),
    or in which the workers ran no kernel, waiting on the ps tasks (parameter
    server)."""
    rows = []
    for run in runs:
        if not run.get("profile_steps"):
            continue
        window = "{} to {}".format(*run["profile_steps"])
        keys = ("allreduce_share", "negotiate_share", "ps_wait_share")
        shares = [f"{run[k]:.0%}" if k in run else "-" for k in keys]
        rows.append([run["run_name"], window, *shares])
    return rows


def markdown_table(rows: list[list[str]], columns: tuple[str, ...] = COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def html_table(rows: list[list[str]], columns: tuple[str, ...] = COLUMNS) -> str:
    head = "".join(f"<th>{c}</th>" for c in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def summary(groups: dict[str, list[dict]]) -> dict:
    """report metrics.json (`dvc metrics show`): each setting's means and intervals."""
    result = {}
    for name, group in groups.items():
        entry = {"runs": {r["run_name"]: {k: r.get(k) for k in SUMMARY_KEYS} for r in group}}
        for key, _, _ in MEASURES:
            found = values(group, key)
            if found:
                interval = stats.mean_interval(found)
                entry[key] = {"mean": interval.estimate, "ci95": [interval.low, interval.high]}
        result[name] = entry
    return result


def write_report(runs: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    groups = settings(runs)
    target = runs[0]["target_top1"]
    plots = [out_dir / name for name in ("throughput.png", "accuracy.png", "time_to_accuracy.png")]
    plot(groups, "epoch", "images_per_sec", ("epoch", "images/s"), plots[0])
    plot(groups, "epoch", "val_top1", ("epoch", "validation top-1"), plots[1], target)
    plot(
        groups,
        "wall_time_s",
        "val_top1",
        ("training time (s)", "validation top-1"),
        plots[2],
        target,
    )
    curves = by_workers(groups)
    if curves:
        plots.append(out_dir / "scaling.png")
        plot_scaling(curves, plots[-1])
    elif len({r["global_batch_size"] for r in runs}) > 1:
        plots.append(out_dir / "batch_size.png")
        plot_against_batch(groups, plots[-1])
    ours = (
        f"{runs[0]['dataset']}, {runs[0]['model']}, {runs[0]['precision']}, "
        f"{runs[0]['epochs']} epochs, target top-1 {target:.0%}, on {platform.machine()} CPU; "
        "mean over the seeds, 95 % confidence interval in brackets"
    )
    sections = [("This project's runs", ours, table_rows(groups), COLUMNS)]
    if curves:
        cores = runs[0].get("cores", "?")
        scaling = (
            f"Weak scaling: the batch per worker fixed, efficiency = img/s(N) / (N/N0 x "
            f"img/s(N0)) from the smallest count N0 (1 is linear). The runs had {cores} "
            f"cores: worker counts above that share them."
        )
        sections.append(("Scaling", scaling, scaling_rows(curves), SCALING_COLUMNS))
    if profiled := profile_rows(runs):
        where = (
            "Shares of each profiled window (train.profile_steps of the first epoch). "
            "Horovod, from its timeline: some gradient being allreduced, or negotiated "
            "(waiting for every rank); both overlap the backward pass. TensorFlow's "
            "all-reduce, from the chief's profiler trace: some gradient being all-reduced "
            "(CollectiveReduceV2) within the traced step functions. Parameter server, "
            "from the workers' profiler traces: no compute kernel running on a worker, "
            "that is, waiting for variables from the ps tasks (or for input or a core). "
            "Traces: MLflow artifacts profile/ of each run."
        )
        sections.append(("Where the time goes", where, profiled, PROFILE_COLUMNS))
    sections.append(("The seed experiment (single runs)", SEED_SETTING, seed_rows(), COLUMNS))
    findings = verdicts(groups) + [ASYNCHRONOUS]
    title = " vs ".join(dict.fromkeys(run["strategy"] for run in runs))
    md = [f"# {title}\n"]
    page = [f"<html><body><h1>{html.escape(title)}</h1>"]
    for title, setting, rows, columns in sections:
        md += [f"## {title}\n", f"{setting}\n", markdown_table(rows, columns), ""]
        page += [f"<h2>{title}</h2><p>{html.escape(setting)}</p>", html_table(rows, columns)]
    md += ["## What the runs support\n", *(f"- {f}" for f in findings), ""]
    page += ["<h2>What the runs support</h2><ul>"]
    page += [f"<li>{html.escape(f)}</li>" for f in findings] + ["</ul>"]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    page += [f'<img src="{p.name}" alt="{p.stem}">' for p in plots] + ["</body></html>"]
    (out_dir / "metrics.json").write_text(json.dumps(summary(groups), indent=2) + "\n")
    (out_dir / "report.md").write_text("\n".join(md) + "\n")
    (out_dir / "report.html").write_text("\n".join(page) + "\n")
    return [out_dir / "report.md", out_dir / "report.html", out_dir / "metrics.json", *plots]


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if not cfg.report.runs:
        raise SystemExit("report: give the runs, e.g. 'report.runs=[results/runs/NAME]'")
    from distrepro.tracking import log_setting_figures

    runs = load_runs(list(cfg.report.runs))
    for path in write_report(runs, Path(cfg.report.out_dir)):
        print(path)
    log_setting_figures(summary(settings(runs)), runs)


if __name__ == "__main__":
    main()
