import functools
import hashlib
import itertools
import json
import os
import shlex
from pathlib import Path

from snakemake.exceptions import WorkflowError

from distrepro.config import (
    compose_config,
    compose_many,
    memory_mb,
    run_name,
    setting_name,
    sweep_axes,
)
from distrepro.launch import ConfigError, describe, validate_values
from distrepro.network import (
    UNSHAPED,
    layout,
    library_defaults,
    megabit,
    refusal,
    variants,
)
from distrepro.slurm import nodes_for
from distrepro.strategies import REGISTRY

STRATEGIES = list(
    dict.fromkeys(s for s in config["strategies"].split(",") if s)
) or list(REGISTRY)
if unknown := [s for s in STRATEGIES if s not in REGISTRY]:
    raise WorkflowError(
        f"strategies={config['strategies']}: {unknown[0]} is not a strategy "
        f"({', '.join(REGISTRY)})"
    )
SEEDS = (
    list(range(config["seeds"]))
    if isinstance(config["seeds"], int)
    else [int(seed) for seed in config["seeds"].split(",")]
)
# --config workers=2 arrives as a number, workers="1,2,4" as text.
WORKER_COUNTS = [int(n) for n in str(config["workers"]).split(",") if n]


def base_overrides():
    experiment = [f"experiment={config['experiment']}"] if config["experiment"] else []
    return experiment + shlex.split(config["overrides"])


def group_id(*parts):
    # a subset of the strategies is a group of its own; the ids of every strategy stay as they were
    parts += (config["strategies"],) if config["strategies"] else ()
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:8]


def sweep_points():
    """Hydra's sweep grammar, several keys -> their product; every strategy
    and every seed unless the sweep names them."""
    axes = sweep_axes(config["sweep"])
    named = {axis[0].split("=")[0] for axis in axes}
    if "strategy" not in named:
        axes.append([f"strategy={s}" for s in STRATEGIES])
    if "seed" not in named:
        axes.append([f"seed={s}" for s in SEEDS])
    return [base_overrides() + list(point) for point in itertools.product(*axes)]


def scaling_points():
    """Each strategy at each worker count of `workers`, the batch per worker
    fixed at the configured one (weak scaling), every seed."""
    counts = WORKER_COUNTS
    if min(counts) < 1:
        raise WorkflowError(
            f"workers={config['workers']}: a worker count must be at least 1"
        )
    points = []
    for strategy in STRATEGIES:
        base = compose_config(base_overrides() + [f"strategy={strategy}"])
        per_worker, rest = divmod(
            base.train.global_batch_size, base.strategy.num_workers
        )
        if rest:
            raise WorkflowError(
                f"train.global_batch_size={base.train.global_batch_size} does not divide by "
                f"strategy.num_workers={base.strategy.num_workers}: no batch per worker to keep"
            )
        for workers, seed in itertools.product(counts, SEEDS):
            points.append(
                base_overrides()
                + [
                    f"strategy={strategy}",
                    f"strategy.num_workers={workers}",
                    f"train.global_batch_size={per_worker * workers}",
                    f"seed={seed}",
                ]
            )
    return points


BANDWIDTHS = [b for b in config["bandwidths"].split(",") if b]
# The grid's shaped rate: the lowest (variants=best).
GRID_BANDWIDTH = min(BANDWIDTHS, key=megabit) if BANDWIDTHS else None


def hosts_point(strategy, workers, seed, *conditions):
    """A run on the project's own hosts (distrepro.network) under conditions
    (network.* overrides, a strategy's variant)."""
    return base_overrides() + [
        f"strategy={strategy}",
        f"strategy.num_workers={workers}",
        f"strategy.hosts='{layout(workers)}'",
        *conditions,
        f"seed={seed}",
    ]


def network_point(strategy, workers, bandwidth, seed, variant=()):
    """A run of the network target: traced, for the share of time communicating;
    without a variant, at its library's defaults."""
    return hosts_point(
        strategy,
        workers,
        seed,
        *(variant or library_defaults(strategy)),
        f"network.bandwidth={bandwidth}",
        "train.profile=true",
    )


def network_workers(strategy):
    """The worker counts of `workers`, else the configured one."""
    base = compose_config(base_overrides() + [f"strategy={strategy}"])
    return WORKER_COUNTS or [base.strategy.num_workers]


def network_points():
    """Each strategy at its library's defaults at each of `bandwidths` and unshaped (the
    compute time the cost model starts from), at each worker count, every
    seed; with variants=best also each strategy's grid at the grid's rate and
    unshaped, one seed."""
    points = []
    for strategy in STRATEGIES:
        for workers in network_workers(strategy):
            points += [
                network_point(strategy, workers, bandwidth, seed)
                for bandwidth in [*BANDWIDTHS, UNSHAPED]
                for seed in SEEDS
            ]
            if config["variants"] == "best":
                points += [
                    network_point(strategy, workers, bandwidth, SEEDS[0], variant)
                    for variant in variants(strategy, config["grid"])
                    for bandwidth in (GRID_BANDWIDTH, UNSHAPED)
                ]
    return points


SLOWDOWNS = [float(k) for k in str(config["slowdowns"]).split(",")]


def stragglers_points():
    """Each strategy at each worker count of `workers` (else its configured
    one) on unshaped links, the last worker's host at each of `slowdowns`,
    every seed."""
    if min(SLOWDOWNS) < 1:
        raise WorkflowError(
            f"slowdowns={config['slowdowns']}: a slowdown must be at least 1 (1: none)"
        )
    return [
        hosts_point(
            strategy,
            workers,
            seed,
            f"network.bandwidth={UNSHAPED}",
            f"network.slowdown={slowdown:g}",
        )
        for strategy in STRATEGIES
        for workers in network_workers(strategy)
        for slowdown in SLOWDOWNS
        for seed in SEEDS
    ]


KILL_INTERVALS = [float(s) for s in str(config["kill_intervals"]).split(",")]


def churn_points():
    """Each strategy at each worker count of `workers` (else its configured
    one) on unshaped links, without kills and at each of `kill_intervals`
    (the mean seconds between kills of the last worker), every seed."""
    if min(KILL_INTERVALS) <= 0:
        raise WorkflowError(
            f"kill_intervals={config['kill_intervals']}: an interval must be above 0"
        )
    kills = [[]] + [[f"network.kill_interval_s={s:g}"] for s in KILL_INTERVALS]
    return [
        hosts_point(strategy, workers, seed, f"network.bandwidth={UNSHAPED}", *kill)
        for strategy in STRATEGIES
        for workers in network_workers(strategy)
        for kill in kills
        for seed in SEEDS
    ]


def best_points(best_json):
    """Each strategy's winners (results/network/<id>/best.json): the grid's
    shaped winner at every shaped rate, its unshaped winner unshaped, every
    seed."""
    points = []
    for key, variant in json.loads(Path(best_json).read_text()).items():
        strategy, workers, shaped = key.split("/")
        rates = BANDWIDTHS if shaped == "shaped" else [UNSHAPED]
        points += [
            network_point(strategy, int(workers), bandwidth, seed, variant)
            for bandwidth in rates
            for seed in SEEDS
        ]
    return points


SWEEP_ID = group_id(config["experiment"], config["overrides"], config["sweep"], SEEDS)
SCALING_ID = group_id(
    config["experiment"], config["overrides"], config["workers"], SEEDS
)
NETWORK_ID = group_id(
    config["experiment"],
    config["overrides"],
    config["workers"],
    config["bandwidths"],
    SEEDS,
    config["variants"],
    config["grid"] if config["variants"] == "best" else "",
)
NETWORK_SCOPE = f"network/{NETWORK_ID}"
STRAGGLERS_ID = group_id(
    config["experiment"], config["overrides"], config["workers"], SLOWDOWNS, SEEDS
)
CHURN_ID = group_id(
    config["experiment"], config["overrides"], config["workers"], KILL_INTERVALS, SEEDS
)
RUNS = {}  # run -> (overrides, config), the first group's overrides for a shared run
GROUP_RUNS = {}  # the runs of each group, by the results/ folder of its report


def add_group(scope, points):
    """Compose and validate a group's points (added to the group's runs); a
    run in several groups (with --config sweep or workers, reproduce's runs
    may be points too) is trained once, under the MLflow parent of the first
    group: the one the user asked for by giving its config. (Started again
    under another, a finished run is left as it is.) The group's runs."""
    configs = compose_many(points)
    for overrides, cfg in zip(points, configs):
        try:
            validate_values(cfg)
        except ConfigError as error:
            raise WorkflowError(
                f"{error} (overrides: {shlex.join(overrides)})"
            ) from None
        RUNS.setdefault(run_name(cfg), (overrides, cfg))
    names = [run_name(cfg) for cfg in configs]
    GROUP_RUNS[scope] = list(dict.fromkeys(GROUP_RUNS.get(scope, []) + names))
    return list(dict.fromkeys(names))


if config["sweep"]:
    add_group(f"sweeps/{SWEEP_ID}", sweep_points())
if WORKER_COUNTS:
    add_group(f"scaling/{SCALING_ID}", scaling_points())
add_group(
    "reproduce",
    [
        base_overrides() + [f"strategy={strategy}", f"seed={seed}"]
        for strategy in STRATEGIES
        for seed in SEEDS
    ],
)
EXPERIMENT = RUNS[GROUP_RUNS["reproduce"][0]][1].mlflow_experiment


@functools.cache
def network_runs():
    """The network target's runs (hosts_runs): also its traced runs' epochs of
    fewer than 15 updates stop it alone, saying why."""
    return hosts_runs("network", NETWORK_SCOPE, network_points)


def hosts_runs(target, scope, points):
    """An experiment's runs on the project's own hosts, composed only when
    its target is asked for: what cannot run stops that target alone."""
    try:
        refused = refusal()
        if refused:
            raise WorkflowError(refused)
        return add_group(scope, points())
    except WorkflowError as error:
        raise WorkflowError(f"the {target} target: {error}") from None


@functools.cache
def stragglers_runs():
    return hosts_runs("stragglers", f"stragglers/{STRAGGLERS_ID}", stragglers_points)


@functools.cache
def churn_runs():
    return hosts_runs("churn", f"churn/{CHURN_ID}", churn_points)


def run_config(wildcards):
    return run_entry(wildcards.run)[1]


def run_entry(run):
    """(overrides, config) of a run: of reproduce, a sweep, a scaling, or the
    network, stragglers or churn target's (composed on first need)."""
    for compose in (network_runs, stragglers_runs, churn_runs):
        if run in RUNS:
            break
        compose()
    return RUNS[run]


def run_overrides(wildcards):
    """The run's overrides, quoted for the shell, naming its setting's parent run."""
    quoted = shlex.join(run_entry(wildcards.run)[0])
    return f"{quoted} mlflow_parent={setting_parent(wildcards)}"


def tfrecords_of(wildcards):
    return f"{run_config(wildcards).data.tfrecord_dir}/metadata.json"


def train_inputs(wildcards):
    return {
        "tfrecords": tfrecords_of(wildcards),
        "store": "results/mlflow/experiment_id",
        "parent": f"{setting_parent(wildcards)}/parent.json",
    }


def setting_parent(wildcards):
    """The folder describing the MLflow parent of a setting's seeds
    (distrepro.parents); a sweep's or a scaling's settings are children of its
    own parent."""
    scope = next(s for s, runs in GROUP_RUNS.items() if wildcards.run in runs)
    setting = setting_name(run_config(wildcards))
    return f"results/{scope}/settings/{setting}"


def outer_parent(wildcards):
    """A setting's own parent's folder: its group's; none in reproduce."""
    return "" if wildcards.scope == "reproduce" else f"results/{wildcards.scope}"


def outer_parent_spec(wildcards):
    outer = outer_parent(wildcards)
    return [f"{outer}/parent.json"] if outer else []


def group_kind(wildcards):
    return {
        "sweeps": "sweep",
        "scaling": "scaling",
        "network": "network",
        "stragglers": "stragglers",
        "churn": "churn",
    }[wildcards.kind]


def plan_of(wildcards):
    return describe(run_config(wildcards))


# What each job asks of a scheduler (the SLURM profile's sbatch options, and
# local --cores/--resources). $SLURM_PARTITION and $SLURM_ACCOUNT name a
# partition and an account; without them SLURM's defaults apply.
CLUSTER = {
    resource: os.environ[variable]
    for resource, variable in [
        ("slurm_partition", "SLURM_PARTITION"),
        ("slurm_account", "SLURM_ACCOUNT"),
    ]
    if os.environ.get(variable)
}


def workers_of(wildcards):
    return run_config(wildcards).strategy.num_workers


def nodes_of(wildcards):
    return nodes_for(run_config(wildcards).strategy)


def tasks_per_node_of(wildcards):
    """sbatch's options beyond Snakemake's own: the workers on each node."""
    strategy = run_config(wildcards).strategy
    return f"--ntasks-per-node={strategy.workers_per_node or strategy.num_workers}"


def cores_of(wildcards):
    return run_config(wildcards).strategy.cores_per_worker


def train_threads_of(wildcards):
    return workers_of(wildcards) * cores_of(wildcards)


def gpus_of(wildcards):
    strategy = run_config(wildcards).strategy
    return strategy.num_workers * strategy.gpus_per_worker


def tasks_per_gpu_of(wildcards):
    """1 when each worker has one GPU: a task per GPU. 0 when a worker has
    several: the job asks for its GPUs alone, and the launcher starts the
    workers among them."""
    return int(run_config(wildcards).strategy.gpus_per_worker == 1)


def memory_of(wildcards):
    return memory_mb(run_config(wildcards))


def eval_gpus_of(wildcards):
    return min(1, gpus_of(wildcards))


def eval_memory_of(wildcards):
    """A worker's share of the run's memory: evaluation is one process."""
    return memory_of(wildcards) // workers_of(wildcards)


def dataset_config(wildcards):
    return next(cfg for _, cfg in RUNS.values() if cfg.data.name == wildcards.dataset)


def prepare_threads_of(wildcards):
    """prepare.processes, else a process per shard, at most this machine's cores."""
    cfg = dataset_config(wildcards)
    shards = cfg.data.train_shards + cfg.data.val_shards
    return cfg.prepare.processes or min(shards, os.cpu_count() or 1)


def shards_of(wildcards):
    data = dataset_config(wildcards).data
    return f"{data.train_shards} train / {data.val_shards} validation shards"


def sweep_report():
    return f"results/sweeps/{SWEEP_ID}/report/report.md"


def scaling_report(wildcards):
    if not WORKER_COUNTS:
        raise WorkflowError(
            "the scaling target needs worker counts: --config workers=1,2,4"
        )
    return f"results/scaling/{SCALING_ID}/report/report.md"


def network_report(wildcards):
    network_runs()
    return f"results/network/{NETWORK_ID}/report/report.md"


def stragglers_report(wildcards):
    stragglers_runs()
    return f"results/stragglers/{STRAGGLERS_ID}/report/report.md"


def churn_report(wildcards):
    churn_runs()
    return f"results/churn/{CHURN_ID}/report/report.md"


def conditions_inputs(wildcards):
    """The runs of a stragglers or a churn experiment."""
    runs = {"stragglers": stragglers_runs, "churn": churn_runs}[wildcards.kind]()
    return [f"results/runs/{run}/network.json" for run in runs]


def grid_inputs(wildcards):
    return [f"results/runs/{run}/network.json" for run in network_runs()]


def network_inputs(wildcards):
    """The network target's runs; with variants=best, once the grid's
    winners are known (the checkpoint network_best), theirs too."""
    runs = network_runs()
    if config["variants"] == "best":
        best = checkpoints.network_best.get(id=wildcards.id).output[0]
        runs = runs + add_group(NETWORK_SCOPE, best_points(best))
    return [f"results/runs/{run}/network.json" for run in dict.fromkeys(runs)]


def best_file(wildcards):
    """The grid's winners, for the report (variants=best)."""
    if config["variants"] != "best":
        return []
    return [checkpoints.network_best.get(id=wildcards.id).output[0]]


def report_runs(wildcards):
    """results/report is reproduce's; results/<group>/report a group's."""
    scope = str(Path(wildcards.reportdir).parent)
    return GROUP_RUNS["reproduce" if scope == "." else scope]


def report_inputs(wildcards):
    return [f"results/runs/{run}/evaluation.json" for run in report_runs(wildcards)]


def report_run_list(wildcards):
    return "[" + ",".join(f"results/runs/{run}" for run in report_runs(wildcards)) + "]"
