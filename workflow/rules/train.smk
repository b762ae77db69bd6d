# A training job counts strategy.cores_per_worker (1) per worker, so that the two
# strategies of `reproduce` are timed alone on a 2-core machine; 1-worker sweep
# points run side by side. Under SLURM it asks for a task per worker, their
# cores and GPUs, the nodes strategy.workers_per_node spreads them over, and
# the memory its data and model need (config.memory_mb), on each node.
# A failed or killed job is retried and resumes from its checkpoint. `exec`
# makes the launcher Snakemake's own child: it stops its run when Snakemake ends.
rule train:
    input:
        unpack(train_inputs),
    output:
        "results/runs/{run}/metrics.json",
    log:
        "logs/train/{run}.log",
    benchmark:
        "results/benchmarks/train/{run}.tsv"
    retries: config["train_retries"]
    conda:
        "../../environment.yml"
    threads: train_threads_of
    resources:
        **CLUSTER,
        tasks=workers_of,
        nodes=nodes_of,
        slurm_extra=tasks_per_node_of,
        cpus_per_task=cores_of,
        gpu=gpus_of,
        tasks_per_gpu=tasks_per_gpu_of,
        mem_mb=memory_of,
    params:
        overrides=run_overrides,
        plan=plan_of,
    message:
        "{wildcards.run}: {params.plan}"
    shell:
        "exec python -m distrepro.launch {params.overrides} > {log} 2>&1"


# A run on the project's own hosts (distrepro.network, as root): the same
# training, on links of its network.bandwidth and, with network.slowdown,
# under CPU quotas, with network.kill_interval_s, losing a worker now and then
# (the network, stragglers and churn targets); it also writes the run's
# metrics.json.
rule network_train:
    input:
        unpack(train_inputs),
    output:
        "results/runs/{run}/network.json",
    log:
        "logs/network/{run}.log",
    benchmark:
        "results/benchmarks/network/{run}.tsv"
    retries: config["train_retries"]
    conda:
        "../../environment.yml"
    threads: train_threads_of
    resources:
        mem_mb=memory_of,
    params:
        overrides=run_overrides,
        plan=plan_of,
    message:
        "{wildcards.run}: {params.plan}, on links of its own"
    shell:
        "exec python -m distrepro.network {params.overrides} > {log} 2>&1"


# The MLflow parents of a group's settings and of a setting's seeds, described
# (distrepro.parents): each is created in MLflow by its first child.
rule group_parent:
    output:
        "results/{kind}/{id}/parent.json",
    log:
        "logs/group_parent/{kind}/{id}.log",
    benchmark:
        "results/benchmarks/group_parent/{kind}/{id}.tsv"
    wildcard_constraints:
        kind="sweeps|scaling|network|stragglers|churn",
        id="[0-9a-f]+",
    conda:
        "../../environment.yml"
    params:
        experiment=EXPERIMENT,
        kind=group_kind,
    shell:
        "python -m distrepro.parents {params.kind} {params.experiment} {params.kind}-{wildcards.id} results/{wildcards.kind}/{wildcards.id} > {log} 2>&1"


rule setting_parent:
    input:
        outer_parent_spec,
    output:
        "results/{scope}/settings/{setting}/parent.json",
    log:
        "logs/setting_parent/{scope}/{setting}.log",
    benchmark:
        "results/benchmarks/setting_parent/{scope}/{setting}.tsv"
    wildcard_constraints:
        scope="reproduce|(sweeps|scaling|network|stragglers|churn)/[0-9a-f]+",
    conda:
        "../../environment.yml"
    params:
        experiment=EXPERIMENT,
        outer=outer_parent,
    shell:
        "python -m distrepro.parents setting {params.experiment} {wildcards.setting} results/{wildcards.scope}/settings/{wildcards.setting} {params.outer} > {log} 2>&1"
