"""Hydra app: the seed's comparison table regenerated from this project's runs.

`python -m distrepro.report 'report.runs=[results/runs/a,results/runs/b]'`
writes report.md, report.html and PNG plots to report.out_dir."""

from __future__ import annotations

import html
import json
import platform
from pathlib import Path

import hydra
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from omegaconf import DictConfig  # noqa: E402

from distrepro import config  # noqa: E402,F401  (registers the config schema)

SEED = {
    "setting": "ImageNet, ResNet-50, 8 x V100 (p3.16xlarge), batch 2048, fp16, 90 epochs",
    "parameter_server": {"images_per_sec": 4249, "total_time_s": 27621, "best_top1": 0.7549},
    "horovod": {"images_per_sec": 5058, "total_time_s": 22906, "best_top1": 0.7559},
}
SUMMARY_KEYS = ("strategy", "images_per_sec", "total_time_s", "top1", "top5", "best_top1")
COLUMNS = ("strategy", "img/s", "total time (s)", "best top-1", "top-5", "speedup")


def load_runs(run_dirs: list[str]) -> list[dict]:
    return [json.loads((Path(d) / "metrics.json").read_text()) for d in run_dirs]


def table_rows(runs: list[dict]) -> list[list[str]]:
    baseline = {r["images_per_sec"] for r in runs if r["strategy"] == "parameter_server"}
    rows = []
    for run in runs:
        speedup = run["images_per_sec"] / min(baseline) if baseline else float("nan")
        rows.append(
            [
                f"{run['strategy']} (b{run['global_batch_size']}, {run['num_workers']} workers)",
                f"{run['images_per_sec']:.1f}",
                f"{run['total_time_s']:.1f}",
                f"{100 * run['best_top1']:.2f} %",
                f"{100 * run.get('eval_top5', run['top5']):.2f} %",
                f"{speedup:.2f}x",
            ]
        )
    return rows


def seed_rows() -> list[list[str]]:
    ps = SEED["parameter_server"]["images_per_sec"]
    return [
        [
            name,
            f"{s['images_per_sec']}",
            f"{s['total_time_s']:,}",
            f"{100 * s['best_top1']:.2f} %",
            "-",
            f"{s['images_per_sec'] / ps:.2f}x",
        ]
        for name, s in ((n, SEED[n]) for n in ("parameter_server", "horovod"))
    ]


def plot(runs: list[dict], key: str, ylabel: str, path: Path) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for run in runs:
        epochs = [h["epoch"] for h in run["history"]]
        ax.plot(epochs, [h[key] for h in run["history"]], marker="o", label=run["run_name"])
    ax.set_xlabel("epoch")
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_against_batch(runs: list[dict], path: Path) -> None:
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 4))
    for strategy in sorted({r["strategy"] for r in runs}):
        mine = sorted(
            (r for r in runs if r["strategy"] == strategy), key=lambda r: r["global_batch_size"]
        )
        batches = [r["global_batch_size"] for r in mine]
        left.plot(batches, [r["images_per_sec"] for r in mine], marker="o", label=strategy)
        right.plot(batches, [r["best_top1"] for r in mine], marker="o", label=strategy)
    for ax, label in ((left, "images/s"), (right, "best top-1")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("global batch size")
        ax.set_ylabel(label)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def markdown_table(rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def html_table(rows: list[list[str]]) -> str:
    head = "".join(f"<th>{c}</th>" for c in COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def write_report(runs: list[dict], out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [out_dir / "throughput.png", out_dir / "accuracy.png"]
    plot(runs, "images_per_sec", "images/s", plots[0])
    plot(runs, "val_top1", "validation top-1", plots[1])
    if len({r["global_batch_size"] for r in runs}) > 1:
        plots.append(out_dir / "batch_size.png")
        plot_against_batch(runs, plots[-1])
    ours = (
        f"{runs[0]['dataset']}, {runs[0]['model']}, {runs[0]['precision']}, "
        f"{runs[0]['epochs']} epochs, on {platform.machine()} CPU"
    )
    sections = [
        ("This run", ours, table_rows(runs)),
        ("The seed experiment", SEED["setting"], seed_rows()),
    ]
    md = ["# Parameter server vs Horovod\n"]
    page = ["<html><body><h1>Parameter server vs Horovod</h1>"]
    for title, setting, rows in sections:
        md += [f"## {title}\n", f"{setting}\n", markdown_table(rows), ""]
        page += [f"<h2>{title}</h2><p>{html.escape(setting)}</p>", html_table(rows)]
    md += [f"![{p.stem}]({p.name})" for p in plots]
    page += [f'<img src="{p.name}" alt="{p.stem}">' for p in plots] + ["</body></html>"]
    summary = {r["run_name"]: {k: r[k] for k in SUMMARY_KEYS} for r in runs}
    (out_dir / "metrics.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out_dir / "report.md").write_text("\n".join(md) + "\n")
    (out_dir / "report.html").write_text("\n".join(page) + "\n")
    return [out_dir / "report.md", out_dir / "report.html", out_dir / "metrics.json", *plots]


@hydra.main(config_path="../../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    if not cfg.report.runs:
        raise SystemExit("report: give the runs, e.g. 'report.runs=[results/runs/NAME]'")
    for path in write_report(load_runs(list(cfg.report.runs)), Path(cfg.report.out_dir)):
        print(path)


if __name__ == "__main__":
    main()
