import hashlib
import itertools
import os
import shlex
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from snakemake.exceptions import WorkflowError

from distrepro.config import (
    compose_config,
    compose_many,
    memory_mb,
    run_name,
    setting_name,
)
from distrepro.launch import ConfigError, describe, validate_values
from distrepro.network import UNSHAPED, layout, refusal
from distrepro.slurm import nodes_for
from distrepro.strategies import REGISTRY

STRATEGIES = list(REGISTRY)
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
    return hashlib.sha256("|".join(map(str, parts)).encode()).hexdigest()[:8]


def sweep_points():
    """Hydra's sweep grammar, several keys -> their product; every strategy
    and every seed unless the sweep names them."""
    parsed = OverridesParser.create().parse_overrides(shlex.split(config["sweep"]))
    axes = [
        (
            [f"{o.get_key_element()}={v}" for v in o.sweep_string_iterator()]
            if o.is_sweep_override()
            else [f"{o.get_key_element()}={o.get_value_element_as_str()}"]
        )
        for o in parsed
    ]
    named = {o.get_key_element() for o in parsed}
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


def network_points():
    """Each strategy at each of `bandwidths` and unshaped (the compute time the
    cost model starts from), at each worker count of `workers` (else the
    configured one), every seed; traced, for the share of time communicating."""
    bandwidths = [b for b in config["bandwidths"].split(",") if b] + [UNSHAPED]
    points = []
    for strategy in STRATEGIES:
        base = compose_config(base_overrides() + [f"strategy={strategy}"])
        for workers, bandwidth, seed in itertools.product(
            WORKER_COUNTS or [base.strategy.num_workers], bandwidths, SEEDS
        ):
            points.append(
                base_overrides()
                + [
                    f"strategy={strategy}",
                    f"strategy.num_workers={workers}",
                    f"strategy.hosts='{layout(workers)}'",
                    f"network.bandwidth={bandwidth}",
                    "train.profile=true",
                    f"seed={seed}",
                ]
            )
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
)
# The runs of each group, by the results/ folder of its report. A run in
# several groups (with --config sweep or workers, reproduce's runs may be
# points too) is trained once, under the MLflow parent of the first group:
# the one the user asked for by giving its config. (Started again under
# another, a finished run is left as it is.)
GROUPS = {
    f"sweeps/{SWEEP_ID}": sweep_points() if config["sweep"] else [],
    f"scaling/{SCALING_ID}": scaling_points() if WORKER_COUNTS else [],
    f"network/{NETWORK_ID}": network_points(),
    "reproduce": [
        base_overrides() + [f"strategy={strategy}", f"seed={seed}"]
        for strategy in STRATEGIES
        for seed in SEEDS
    ],
}
ALL_OVERRIDES = [o for group in GROUPS.values() for o in group]
CONFIGS = compose_many(ALL_OVERRIDES)
SCOPES = [scope for scope, group in GROUPS.items() for _ in group]
NETWORK_SCOPE = f"network/{NETWORK_ID}"
# The network group is always composed, as its target may be asked for; what
# it cannot run (its traced runs need epochs of 15 updates) stops that target
# alone, saying why, not every other.
NETWORK_REFUSED = None
for scope, overrides, cfg in zip(SCOPES, ALL_OVERRIDES, CONFIGS):
    try:
        validate_values(cfg)
    except ConfigError as error:
        refused = f"{error} (overrides: {shlex.join(overrides)})"
        if scope != NETWORK_SCOPE:
            raise WorkflowError(refused) from None
        NETWORK_REFUSED = NETWORK_REFUSED or refused
if NETWORK_REFUSED:
    kept = [i for i, scope in enumerate(SCOPES) if scope != NETWORK_SCOPE]
    ALL_OVERRIDES = [ALL_OVERRIDES[i] for i in kept]
    CONFIGS = [CONFIGS[i] for i in kept]
    GROUPS[NETWORK_SCOPE] = []
RUNS = {}  # run -> (overrides, config), the first group's overrides for a shared run
for overrides, cfg in zip(ALL_OVERRIDES, CONFIGS):
    RUNS.setdefault(run_name(cfg), (overrides, cfg))
GROUP_RUNS = {}
for scope, group in GROUPS.items():
    start = sum(len(runs) for runs in GROUP_RUNS.values())
    GROUP_RUNS[scope] = [run_name(c) for c in CONFIGS[start : start + len(group)]]
EXPERIMENT = CONFIGS[-1].mlflow_experiment


def run_config(wildcards):
    return RUNS[wildcards.run][1]


def run_overrides(wildcards):
    """The run's overrides, quoted for the shell, naming its setting's parent run."""
    quoted = shlex.join(RUNS[wildcards.run][0])
    return f"{quoted} mlflow_parent_run_id=$(cat {setting_parent_file(wildcards)})"


def tfrecords_of(wildcards):
    return f"{run_config(wildcards).data.tfrecord_dir}/metadata.json"


def train_inputs(wildcards):
    return {
        "tfrecords": tfrecords_of(wildcards),
        "store": "results/mlflow/experiment_id",
        "parent": setting_parent_file(wildcards),
    }


def setting_parent_file(wildcards):
    """The MLflow parent of a setting's seeds; a sweep's or a scaling's settings
    are children of its own parent."""
    scope = next(s for s, runs in GROUP_RUNS.items() if wildcards.run in runs)
    setting = setting_name(run_config(wildcards))
    return f"results/{scope}/settings/{setting}/parent_run_id"


def setting_parent_inputs(wildcards):
    inputs = ["results/mlflow/experiment_id"]
    if wildcards.scope != "reproduce":
        inputs.append(f"results/{wildcards.scope}/parent_run_id")
    return inputs


def outer_parent(wildcards):
    if wildcards.scope == "reproduce":
        return ""
    return f"$(cat results/{wildcards.scope}/parent_run_id)"


def group_kind(wildcards):
    return {"sweeps": "sweep", "scaling": "scaling", "network": "network"}[
        wildcards.kind
    ]


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
    return next(c for c in CONFIGS if c.data.name == wildcards.dataset)


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
    refused = refusal() or NETWORK_REFUSED
    if refused:
        raise WorkflowError(f"the network target: {refused}")
    return f"results/network/{NETWORK_ID}/report/report.md"


NETWORK_RUNS = GROUP_RUNS[NETWORK_SCOPE]


def network_inputs(wildcards):
    return [f"results/runs/{run}/network.json" for run in NETWORK_RUNS]


def report_runs(wildcards):
    """results/report is reproduce's; results/<group>/report a group's."""
    scope = str(Path(wildcards.reportdir).parent)
    return GROUP_RUNS["reproduce" if scope == "." else scope]


def report_inputs(wildcards):
    return [f"results/runs/{run}/evaluation.json" for run in report_runs(wildcards)]


def report_run_list(wildcards):
    return "[" + ",".join(f"results/runs/{run}" for run in report_runs(wildcards)) + "]"
