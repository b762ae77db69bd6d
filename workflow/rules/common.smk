import hashlib
import itertools
import shlex

from hydra.core.override_parser.overrides_parser import OverridesParser
from snakemake.exceptions import WorkflowError

from distrepro.config import compose_many, run_name, setting_name
from distrepro.launch import ConfigError, describe, validate_values

STRATEGIES = ["parameter_server", "horovod"]
SEEDS = (
    list(range(config["seeds"]))
    if isinstance(config["seeds"], int)
    else [int(seed) for seed in config["seeds"].split(",")]
)


def base_overrides():
    experiment = [f"experiment={config['experiment']}"] if config["experiment"] else []
    return experiment + shlex.split(config["overrides"])


def sweep_points():
    """Hydra's sweep grammar, several keys -> their product; both strategies
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
    return [list(point) for point in itertools.product(*axes)]


SWEEP_ID = hashlib.sha256((config["overrides"] + config["sweep"]).encode()).hexdigest()[
    :8
]
REPRODUCE_OVERRIDES = [
    base_overrides() + [f"strategy={strategy}", f"seed={seed}"]
    for strategy in STRATEGIES
    for seed in SEEDS
]
SWEEP_OVERRIDES = (
    [base_overrides() + p for p in sweep_points()] if config["sweep"] else []
)
CONFIGS = compose_many(REPRODUCE_OVERRIDES + SWEEP_OVERRIDES)
RUNS = {
    run_name(c): (o, c) for o, c in zip(REPRODUCE_OVERRIDES + SWEEP_OVERRIDES, CONFIGS)
}
for overrides, cfg in zip(REPRODUCE_OVERRIDES + SWEEP_OVERRIDES, CONFIGS):
    try:
        validate_values(cfg)
    except ConfigError as error:
        raise WorkflowError(f"{error} (overrides: {shlex.join(overrides)})") from None
REPRODUCE_RUNS = [run_name(c) for c in CONFIGS[: len(REPRODUCE_OVERRIDES)]]
SWEEP_RUNS = [run_name(c) for c in CONFIGS[len(REPRODUCE_OVERRIDES) :]]
EXPERIMENT = CONFIGS[0].mlflow_experiment


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
    """The MLflow parent of a setting's seeds; a sweep's settings are its children."""
    scope = f"sweeps/{SWEEP_ID}" if wildcards.run in SWEEP_RUNS else "reproduce"
    return (
        f"results/{scope}/settings/{setting_name(run_config(wildcards))}/parent_run_id"
    )


def setting_parent_inputs(wildcards):
    if wildcards.scope == "reproduce":
        return ["results/mlflow/experiment_id"]
    return ["results/mlflow/experiment_id", sweep_parent_file()]


def outer_parent(wildcards):
    return "" if wildcards.scope == "reproduce" else f"$(cat {sweep_parent_file()})"


def plan_of(wildcards):
    return describe(run_config(wildcards))


def workers_of(wildcards):
    return run_config(wildcards).strategy.num_workers


def gpus_of(wildcards):
    strategy = run_config(wildcards).strategy
    return strategy.num_workers * strategy.gpus_per_worker


def eval_gpus_of(wildcards):
    return min(1, gpus_of(wildcards))


def shards_of(wildcards):
    data = next(c.data for c in CONFIGS if c.data.name == wildcards.dataset)
    return f"{data.train_shards} train / {data.val_shards} validation shards"


def sweep_parent_file():
    return f"results/sweeps/{SWEEP_ID}/parent_run_id"


def sweep_report():
    return f"results/sweeps/{SWEEP_ID}/report/report.md"


def report_runs(wildcards):
    return SWEEP_RUNS if wildcards.reportdir.startswith("sweeps/") else REPRODUCE_RUNS


def report_inputs(wildcards):
    return [f"results/runs/{run}/evaluation.json" for run in report_runs(wildcards)]


def report_run_list(wildcards):
    return "[" + ",".join(f"results/runs/{run}" for run in report_runs(wildcards)) + "]"
