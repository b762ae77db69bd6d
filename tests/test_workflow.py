"""The Snakemake workflow end to end, in a temporary copy of the repository."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import psutil
import pytest
from conftest import (
    REPO,
    SHALLOW,
    SLURM_SH,
    copy_repo,
    peak_learning_rates,
    project_env,
    run,
    training_processes,
    wait_for_http,
)
from PIL import Image
from test_training import launch_args

from distrepro import processes
from distrepro.config import compose_config, memory_mb
from distrepro.strategies import COMPARED, REGISTRY

pytestmark = pytest.mark.slow
# Each in one process of the suite (pytest-xdist's groups): the module
# fixtures' runs, once, and the SLURM cluster, started once.
ON_REPRODUCED = pytest.mark.xdist_group("reproduced")
ON_SLURM = pytest.mark.xdist_group("slurm")


# Two seeds (the fewest with an interval) of the shallow ResNet: the workflow's
# paths, in a third of the default's time. Every command in that copy passes it.
SEEDS = 2
REPRODUCE_CONFIG = [f"seeds={SEEDS}", f"overrides={SHALLOW}"]
REPRODUCE = ["snakemake", "--cores", "all", "reproduce", "--config", *REPRODUCE_CONFIG]


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory) -> dict:
    """`snakemake reproduce` in a copy of the repo, stopped by SIGTERM to its
    process group (as Ctrl-C or a scheduler's signal reaches every process of
    the job) once the first training has checkpointed an epoch: the training
    processes left within 10 s, and the run it stopped."""
    repo = copy_repo(tmp_path_factory.mktemp("workflow") / "repo")
    proc = subprocess.Popen(
        REPRODUCE,
        cwd=repo,
        env=project_env(repo),
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while not list(repo.glob("results/runs/*/checkpoints/ckpt-1.index")):
            assert time.monotonic() < deadline and proc.poll() is None, "no checkpoint"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGTERM)
        code = proc.wait(60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while training_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    (stopped,) = [d for d in (repo / "results/runs").iterdir() if (d / "checkpoints").is_dir()]
    return {
        "repo": repo,
        "code": code,
        "left": training_processes(),
        "run_dir": stopped,
        "mlflow_run_id": (stopped / "mlflow_run_id").read_text(),
    }


@pytest.fixture(scope="module")
def reproduced(interrupted) -> Path:
    """The same command again, to its end: the stopped run resumes."""
    repo = interrupted["repo"]
    run(REPRODUCE, repo, timeout=1800)
    return repo


def client(repo) -> mlflow.MlflowClient:
    return mlflow.MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")


def runs_of(repo, **tags):
    (experiment,) = [e for e in client(repo).search_experiments() if e.name == "distrepro"]
    query = " and ".join(f"tags.{k} = '{v}'" for k, v in tags.items())
    return client(repo).search_runs([experiment.experiment_id], filter_string=query)


@ON_REPRODUCED
def test_reproduce_reports_every_strategy_with_mlflow_runs(reproduced):
    report = (reproduced / "results/report/report.md").read_text()
    for strategy in REGISTRY:
        # the seeds: a mean and its interval, e.g. "| 2 | 512.3 (498.0 to 526.6) |"; two
        # seeds' t interval (12.7 standard errors each side) may reach below zero
        row = next(line for line in report.splitlines() if f"| {strategy} (b64, 2 workers)" in line)
        assert re.search(rf"\| {SEEDS} \| [\d.]+ \(-?[\d.]+ to [\d.]+\) \|", row), row
    assert "4249" in report and "5058" in report and "(single runs)" in report
    for first, second in COMPARED:  # every strategy against the baseline, Horovod against TF
        found = re.search(
            rf"{first} \(b64, 2 workers\) against {second} \(b64, 2 workers\): (.*)", report
        )
        assert found and re.search(
            rf"{first} is \d+ % (faster|slower)|No difference in img/s", found[1]
        )
    assert "asynchronous" in report
    for png in ("throughput.png", "accuracy.png", "time_to_accuracy.png"):
        with Image.open(reproduced / "results/report" / png) as image:
            image.load()
            assert image.size[0] > 100
    metrics = [json.loads(p.read_text()) for p in reproduced.glob("results/runs/*/metrics.json")]
    assert sorted((m["strategy"], m["seed"]) for m in metrics) == [
        (strategy, seed) for strategy in sorted(REGISTRY) for seed in range(SEEDS)
    ]
    for m in metrics:
        assert m["top1"] >= 0.90 and m["eval_top1"] >= 0.90, m["run_name"]
        run_ = client(reproduced).get_run(m["mlflow_run_id"])
        assert run_.data.params["strategy.name"] == m["strategy"]
        assert run_.data.tags["seed"] == str(m["seed"])
        assert run_.data.metrics["eval_top1"] == pytest.approx(m["eval_top1"])
        assert run_.data.tags["dvc_tfrecords_md5"].endswith(".dir")
    rate = {m["mlflow_run_id"]: m["images_per_sec"] for m in metrics}  # the run's average
    parents = [r for r in runs_of(reproduced) if "seed" not in r.data.tags]
    assert sorted(p.data.tags["setting"].split("-")[2] for p in parents) == sorted(REGISTRY)
    for parent in parents:
        seeds = runs_of(reproduced, **{"mlflow.parentRunId": parent.info.run_id})
        assert sorted(r.data.tags["seed"] for r in seeds) == [str(s) for s in range(SEEDS)]
        assert {r.data.tags["setting"] for r in seeds} == {parent.data.tags["setting"]}
        # the parent spans its seeds: created as the first starts, ended with the last
        first = min(r.info.start_time for r in seeds)
        assert first - 10_000 < parent.info.start_time <= first
        assert parent.info.end_time == max(r.info.end_time for r in seeds)
        # the seeds' mean and interval on the parent's row of the runs table
        mean = sum(rate[r.info.run_id] for r in seeds) / SEEDS
        figures = parent.data.metrics
        assert figures["images_per_sec"] == pytest.approx(mean) and figures["seeds"] == SEEDS
        assert figures["images_per_sec_ci95_low"] < mean < figures["images_per_sec_ci95_high"]


@ON_REPRODUCED
def test_an_interrupted_workflow_leaves_no_training_process_and_resumes(interrupted, reproduced):
    """SIGTERM stops every process of the run; the same command resumes the
    stopped run from its checkpoint, in the same MLflow run."""
    assert interrupted["code"] != 0
    assert not interrupted["left"], "training processes outlived the interrupted workflow"
    run_dir = interrupted["run_dir"]
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert metrics["mlflow_run_id"] == interrupted["mlflow_run_id"]
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4, 5, 6]
    log = (reproduced / "logs/train" / f"{run_dir.name}.log").read_text()
    assert "epoch 1/6" not in log and "epoch 6/6" in log  # resumed after epoch 1
    assert not training_processes()


@ON_REPRODUCED
@pytest.mark.parametrize("strategy", REGISTRY)
def test_every_strategy_learns_digits_far_above_chance(reproduced, strategy):
    for path in reproduced.glob("results/runs/*/metrics.json"):
        metrics = json.loads(path.read_text())
        if metrics["strategy"] != strategy:
            continue
        assert metrics["num_workers"] == 2 and metrics["top1"] >= 0.90, metrics["history"]
        assert metrics["epochs"] == 6 and len(metrics["history"]) == 6
        assert metrics["images_per_sec"] > 0 and metrics["total_time_s"] > 0
        logged = client(reproduced).get_run(metrics["mlflow_run_id"])
        assert logged.data.params["strategy.name"] == strategy
        assert logged.data.params["train.global_batch_size"] == "64"
        assert logged.data.tags["strategy"] == strategy
        assert logged.data.tags["command"].startswith("python -m distrepro.launch")
        assert logged.data.metrics["top1"] == pytest.approx(metrics["top1"])
        history = client(reproduced).get_metric_history(metrics["mlflow_run_id"], "val_top1")
        assert sorted(m.step for m in history) == list(range(1, 7))
        # the run's own img/s, and its epochs' under their own name
        assert logged.data.metrics["images_per_sec"] == pytest.approx(metrics["images_per_sec"])
        epochs = client(reproduced).get_metric_history(
            metrics["mlflow_run_id"], "epoch_images_per_sec"
        )
        assert sorted(m.value for m in epochs) == sorted(
            h["images_per_sec"] for h in metrics["history"]
        )


@ON_REPRODUCED
def test_reproduce_leaves_data_clean_and_a_second_run_does_nothing(reproduced):
    assert "up to date" in run(["dvc", "status"], reproduced).stdout
    again = ["snakemake", "-n", "reproduce", "--config", *REPRODUCE_CONFIG]
    assert "Nothing to be done" in run(again, reproduced).stdout
    shown = run(["dvc", "metrics", "show"], reproduced).stdout
    assert "results/report/metrics.json" in shown and "horovod" in shown


@ON_REPRODUCED
def test_a_changed_value_reruns_exactly_the_jobs_it_affects(reproduced):
    changed = [f"seeds={SEEDS}", f"overrides={SHALLOW} train.weight_decay=0.0"]
    dry = run(["snakemake", "-n", "--config", *changed], reproduced)
    counts = dict(re.findall(r"^(\w+)\s+(\d+)$", dry.stdout, re.M))
    runs = SEEDS * len(REGISTRY)  # every seed of each strategy
    assert counts == {
        "setting_parent": str(len(REGISTRY)),
        "train": str(runs),
        "evaluate": str(runs),
        "report": "1",
        "reproduce": "1",
        "total": str(len(REGISTRY) + 2 * runs + 2),
    }


@ON_REPRODUCED
def test_snakemake_report_includes_the_plots(reproduced):
    run(["snakemake", "--report", "snakemake-report.html"], reproduced)
    page = (reproduced / "snakemake-report.html").read_text()
    assert "throughput.png" in page and "accuracy.png" in page


@ON_REPRODUCED
def test_two_point_sweep_with_two_seeds_nests_seeds_under_points_under_one_parent(reproduced):
    config = [
        "sweep=train.global_batch_size=32,64 strategy=horovod",
        f"overrides=train.epochs=2 strategy.num_workers=1 train.log_model=false {SHALLOW}",
        "seeds=2",
    ]
    run(["snakemake", "--cores", "2", "sweep", "--config", *config], reproduced, timeout=1800)
    (sweep,) = [r for r in runs_of(reproduced) if "sweep" in r.data.tags]
    points = runs_of(reproduced, **{"mlflow.parentRunId": sweep.info.run_id})
    assert len(points) == 2 and all("setting" in p.data.tags for p in points)
    seeds = [
        run_
        for point in points
        for run_ in runs_of(reproduced, **{"mlflow.parentRunId": point.info.run_id})
    ]
    assert sorted(r.data.tags["seed"] for r in seeds) == ["0", "0", "1", "1"]
    lrs = peak_learning_rates(seeds)
    assert sorted(lrs) == [32, 64]
    assert lrs[64] == pytest.approx(2 * lrs[32])
    (sweep_dir,) = reproduced.glob("results/sweeps/*/report")
    with Image.open(sweep_dir / "batch_size.png") as image:
        image.load()


@ON_REPRODUCED
def test_two_point_scaling_of_one_strategy_reports_efficiency_from_its_runs_rates(reproduced):
    config = [
        "workers=1,2",
        "seeds=1",
        "strategies=horovod",
        f"overrides=train.epochs=1 train.steps_per_epoch=12 train.log_model=false {SHALLOW}",
    ]
    run(["snakemake", "--cores", "2", "scaling", "--config", *config], reproduced, timeout=1800)
    (report_dir,) = reproduced.glob("results/scaling/*/report")
    report = (report_dir / "report.md").read_text()
    runs = [json.loads(p.read_text()) for p in reproduced.glob("results/runs/*/metrics.json")]
    scaled = [r for r in runs if r["epochs"] == 1]
    assert {r["strategy"] for r in scaled} == {"horovod"}
    rate = {
        r["num_workers"]: r["images_per_sec"]
        for r in scaled
        if r["global_batch_size"] == 32 * r["num_workers"]
    }
    assert sorted(rate) == [1, 2]
    efficiency = rate[2] / (2 * rate[1])
    assert f"| horovod | 2 | 64 | {rate[2]:.1f} | {2 * rate[1]:.1f} | {efficiency:.2f} |" in report
    assert "The runs had" in report and "cores" in report
    with Image.open(report_dir / "scaling.png") as image:
        image.load()
    (parent,) = [r for r in runs_of(reproduced) if "scaling" in r.data.tags]
    settings = runs_of(reproduced, **{"mlflow.parentRunId": parent.info.run_id})
    assert len(settings) == 2 and all("setting" in r.data.tags for r in settings)


def test_scaling_refuses_a_zero_count_before_any_job():
    dry = subprocess.run(
        ["snakemake", "-n", "scaling", "--config", "workers=0,2"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert dry.returncode != 0
    assert "workers=0,2: a worker count must be at least 1" in dry.stdout + dry.stderr


def test_aws_blog_8gpu_scaling_dry_run_is_the_seeds_curve():
    config = ["experiment=aws_blog_8gpu", "workers=1,2,4,8", "seeds=1"]
    dry = run(["snakemake", "-n", "scaling", "--config", *config], REPO).stdout
    for workers in (1, 2, 4, 8):
        batch = 256 * workers
        assert f"horovodrun -np {workers} -H localhost:{workers} --mpi" in dry
        assert f"1 ps + {workers} workers + 1 coordinator" in dry
        assert f"{workers} workers, TensorFlow all-reduce over NCCL" in dry
        assert dry.count(f"global batch {batch}, mixed_fp16") == len(REGISTRY)


def test_aws_blog_8gpu_dry_run_shows_the_8_gpu_commands():
    config = ["experiment=aws_blog_8gpu", "seeds=1"]  # the seed's protocol: one run each
    dry = run(["snakemake", "-n", "--config", *config], REPO).stdout
    assert "horovodrun -np 8 -H localhost:8 --mpi" in dry
    assert "1 ps + 8 workers + 1 coordinator" in dry
    assert "8 workers, TensorFlow all-reduce over NCCL" in dry
    assert dry.count("8 GPUs, 1 per worker") == len(REGISTRY)  # every training job
    evaluate_resources = re.findall(r"rule evaluate:.*?resources: ([^\n]*)", dry, re.S)
    assert len(evaluate_resources) == len(REGISTRY)
    assert all("gpu=1" in r for r in evaluate_resources)
    assert "1024 train / 128 validation shards" in dry
    assert dry.count("90 epochs, global batch 2048, mixed_fp16") == len(REGISTRY)


@pytest.mark.parametrize(
    "config, named",
    [
        (["seeds=0"], "0 is not valid"),
        (["seeds=0,-1"], "'0,-1' is not valid"),
        (["overrides=train.target_top1=1.5"], "train.target_top1=1.5 must be in (0, 1]"),
        (["overrides=train.target_top1=0"], "train.target_top1=0.0 must be in (0, 1]"),
        (["strategies=horovod,ring"], "strategies=horovod,ring: ring is not a strategy"),
    ],
)
def test_bad_seeds_targets_and_strategies_are_refused_before_any_job(config, named):
    dry = subprocess.run(
        ["snakemake", "-n", "--config", *config], cwd=REPO, capture_output=True, text=True
    )
    assert dry.returncode != 0 and named in dry.stdout + dry.stderr
    assert "rule train" not in dry.stdout


def test_workflow_lint_is_clean():
    lint = run(["snakemake", "--lint"], REPO)
    assert "good condition" in lint.stdout + lint.stderr
    run(["snakefmt", "--check", "Snakefile", "workflow"], REPO)


def rendered_text(url: str, profile) -> str:
    """The page as headless Chromium renders it, as plain text."""
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (`make test` installs it)")
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=2400,1200",  # the runs table draws only the columns in view
        f"--user-data-dir={profile}",
        "--virtual-time-budget=30000",
        "--dump-dom",
    ]
    dom = subprocess.run([chromium, *flags, url], capture_output=True, text=True, timeout=120)
    text = re.sub(r"<script.*?</script>|<style.*?</style>|<[^>]+>", " ", dom.stdout, flags=re.S)
    return " ".join(text.split())


@ON_REPRODUCED
def test_mlflow_ui_shows_the_reproduce_runs_and_their_metrics(reproduced, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ui = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "ui",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--backend-store-uri",
            f"sqlite:///{reproduced / 'mlflow.db'}",
        ],
        start_new_session=True,
    )
    try:
        base = f"http://127.0.0.1:{port}"
        wait_for_http(f"{base}/health")
        (experiment,) = [
            e for e in client(reproduced).search_experiments() if e.name == "distrepro"
        ]
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"
        # Seeds (and a sweep's settings) are folded under their parents.
        runs = [r for r in runs_of(reproduced) if "mlflow.parentRunId" not in r.data.tags]
        link = run(["python", "-m", "distrepro.tracking", "url", "distrepro", base], reproduced)
        listing = rendered_text(link.stdout.strip(), tmp_path / "a")
        for r in runs:
            assert r.info.run_name in listing
            if "setting" in r.data.tags:  # a setting's row shows its seeds' mean, as JS prints it
                assert repr(r.data.metrics["images_per_sec"]) in listing, r.info.run_name
        digest = next(
            r.inputs.dataset_inputs[0].dataset.digest for r in runs if r.inputs.dataset_inputs
        )
        assert f"digits ({digest})" in listing  # the Dataset column, with DVC's hash
        columns = ("Dataset", "images_per_sec", "images_per_sec_ci95_low", "top1", "best_top1")
        for column in (*columns, "eval_top1"):
            assert f" {column} " in listing, column

        # A reproduce training's page: its metrics.json img/s under the run's
        # name (not its last epoch's, which is under epoch_images_per_sec), and
        # the evaluation's top-1, as JavaScript prints them.
        def epochs(r) -> int:
            metrics = reproduced / "results/runs" / r.info.run_name / "metrics.json"
            return json.loads(metrics.read_text())["epochs"] if metrics.exists() else 0

        trained = next(r for r in runs_of(reproduced) if epochs(r) == 6)  # reproduce's
        run_page = rendered_text(
            f"{base}/#/experiments/{experiment.experiment_id}/runs/{trained.info.run_id}",
            tmp_path / "b",
        )
        top1 = trained.data.metrics["eval_top1"]
        shown = str(int(top1)) if top1.is_integer() else repr(top1)
        assert f"eval_top1 {shown}" in run_page
        metrics = json.loads(
            (reproduced / "results/runs" / trained.info.run_name / "metrics.json").read_text()
        )
        last_epoch = metrics["history"][-1]["images_per_sec"]
        assert last_epoch != metrics["images_per_sec"]
        assert f" images_per_sec {metrics['images_per_sec']!r}" in run_page
        assert f" images_per_sec {last_epoch!r}" not in run_page
        assert f"epoch_images_per_sec {last_epoch!r}" in run_page
    finally:
        processes.stop([ui])  # its graceful stop once outlasted 30 s of a loaded CI


RUNNING = ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING")  # a job's states before its end


def on_login_node(cluster: Path, command: list[str], cwd: Path, timeout: float = 60):
    """command on node1, where the cluster's clients reach slurmctld."""
    return run([SLURM_SH, "run", str(cluster), *command], cwd, timeout=timeout)


def processes_on_nodes(cluster: Path) -> list[str]:
    """The names of the processes running on the cluster's hosts."""
    names = []
    for namespace in (cluster / "hosts" / "namespaces").read_text().split():
        pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True)
        names += [psutil.Process(int(pid)).name() for pid in pids.stdout.split()]
    return names


def assert_only_daemons_left(cluster: Path) -> None:
    """Within a minute of its jobs' end, a node runs no job process (slurmstepd
    ends with its step's last)."""
    deadline = time.monotonic() + 60
    daemons = {"munged", "slurmctld", "slurmscriptd", "slurmd"}
    while (left := set(processes_on_nodes(cluster))) != daemons:
        assert time.monotonic() < deadline, f"left on the nodes: {left}"
        time.sleep(1)


@ON_SLURM
def test_the_workflow_runs_through_the_slurm_profile_on_two_nodes(slurm_cluster, tmp_path):
    assert "sshd" not in processes_on_nodes(slurm_cluster)  # SLURM starts every process
    repo = copy_repo(tmp_path / "repo")
    on_login_node(
        slurm_cluster,
        # the test cluster keeps no accounting (sacct): jobs are followed with squeue
        ["snakemake", "--workflow-profile", "workflow/profiles/slurm"]
        + ["--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1"]
        + [
            "--config",
            "seeds=1",
            f"overrides=train.epochs=5 strategy.workers_per_node=1 train.log_model=false {SHALLOW}",
        ]
        + ["--", "reproduce"],
        repo,
        timeout=1800,
    )
    jobs = {}  # rule -> SLURM job ids; the executor comments each job "rule_R_wildcards_.."
    listed = on_login_node(
        slurm_cluster, ["squeue", "--noheader", "--states=all", "--format=%i %k"], repo
    ).stdout
    for job, comment in (line.split() for line in listed.splitlines()):
        jobs.setdefault(re.match(r"rule_(\w+?)(_wildcards|$)", comment)[1], []).append(job)
    assert {rule: len(ids) for rule, ids in jobs.items()} == {
        "prepare": 1,
        "train": len(REGISTRY),
        "evaluate": len(REGISTRY),
        "report": 1,
    }
    memory = set()
    for job in jobs["train"]:  # a worker on each node, the memory config.memory_mb estimates
        shown = on_login_node(slurm_cluster, ["scontrol", "show", "job", job], repo).stdout
        assert "JobState=COMPLETED" in shown and " NodeList=node[1-2]" in shown, shown
        assert "NumNodes=2 " in shown and "NumTasks=2 " in shown, shown
        memory |= {int(m) for m in re.findall(r"MinMemoryNode=(\d+)M", shown)}
    overrides = ["train.epochs=5", "strategy.workers_per_node=1", SHALLOW]
    configs = [compose_config([f"strategy={s}", *overrides]) for s in REGISTRY]
    assert memory == {memory_mb(cfg) for cfg in configs}
    for strategy in REGISTRY:  # each strategy's processes ran on both nodes
        (trained,) = [r for r in runs_of(repo, strategy=strategy) if "devices" in r.data.params]
        where = " ".join(trained.data.params.get(key, "") for key in ("devices", "hosts"))
        assert "on node1" in where and "on node2" in where, (strategy, where)
    report = (repo / "results/report/report.md").read_text()
    for strategy in REGISTRY:  # its one seed, and the verdicts
        assert f"| {strategy} (b64, 2 workers) | 1 |" in report, report
    assert "## What the runs support" in report
    for metrics in repo.glob("results/runs/*/metrics.json"):
        assert json.loads(metrics.read_text())["top1"] >= 0.85, metrics  # chance is 0.1
    assert_only_daemons_left(slurm_cluster)


def submit_training(cluster: Path, launcher: list[str], log: Path, mlflow_uri: str) -> str:
    """sbatch a launcher as a job of a worker on each node; its job id."""
    sbatch = ["sbatch", "--parsable", "--nodes=2", "--ntasks-per-node=1", f"--output={log}"]
    sbatch += [f"--export=ALL,MLFLOW_TRACKING_URI={mlflow_uri}", f"--wrap={shlex.join(launcher)}"]
    return on_login_node(cluster, sbatch, REPO).stdout.strip()


def state_at_end(cluster: Path, job: str, log: Path, seconds: float = 900) -> str:
    """The job's state once it has ended."""
    deadline = time.monotonic() + seconds
    state = ["squeue", "--noheader", "--states=all", f"--jobs={job}", "--format=%T"]
    while (shown := on_login_node(cluster, state, REPO).stdout.strip()) in RUNNING:
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(1)
    return shown


def only_run(mlflow_uri: str):
    client = mlflow.MlflowClient(mlflow_uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == "distrepro"]
    (trained,) = client.search_runs([experiment.experiment_id])
    return trained


@ON_SLURM
def test_horovod_over_mpi_is_one_pmix_step_on_both_nodes(
    slurm_cluster, digits_tfrecords, mlflow_uri, tmp_path
):
    results, log = tmp_path / "runs", tmp_path / "job.log"
    overrides = ("strategy=horovod", "strategy.controller=mpi", "strategy.workers_per_node=1")
    launcher = launch_args(digits_tfrecords, results, *overrides, "train.epochs=4")
    job = submit_training(slurm_cluster, launcher, log, mlflow_uri)
    assert state_at_end(slurm_cluster, job, log) == "COMPLETED", log.read_text()[-3000:]
    (metrics,) = [json.loads(p.read_text()) for p in results.glob("*/metrics.json")]
    assert metrics["top1"] > 0.2, metrics["history"]  # chance is 0.1
    params = only_run(mlflow_uri).data.params
    # one world of two ranks, not two of one: MPI met its peers through PMIx
    assert params["devices"] == "rank 0 on node1: cpu; rank 1 on node2: cpu", params
    assert params["strategy.controller"] == "mpi"
    assert_only_daemons_left(slurm_cluster)


@ON_SLURM
def test_a_parameter_server_worker_step_cancelled_on_the_second_node_is_started_again(
    slurm_cluster, digits_tfrecords, mlflow_uri, tmp_path
):
    results, log = tmp_path / "runs", tmp_path / "job.log"
    launcher = launch_args(
        digits_tfrecords,
        results,
        "strategy=parameter_server",
        "strategy.workers_per_node=1",
        "train.epochs=4",
    )
    job = submit_training(slurm_cluster, launcher, log, mlflow_uri)
    deadline = time.monotonic() + 300
    while not list(results.glob("*/checkpoints/ckpt-1.index")):
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    steps = ["squeue", "--steps", "--noheader", f"--jobs={job}", "--format=%i %j %N"]
    listed = on_login_node(slurm_cluster, steps, REPO).stdout
    (step,) = [line.split()[0] for line in listed.splitlines() if "worker:1 node2" in line]
    on_login_node(slurm_cluster, ["scancel", step], REPO)
    assert state_at_end(slurm_cluster, job, log) == "COMPLETED", log.read_text()[-3000:]
    (run_dir,) = results.iterdir()
    assert json.loads((run_dir / "restarts.json").read_text())[0].startswith("task worker:1 ")
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert [h["epoch"] for h in metrics["history"]] == [1, 2, 3, 4]
    assert only_run(mlflow_uri).data.metrics["restarts"] == 1
    assert_only_daemons_left(slurm_cluster)
