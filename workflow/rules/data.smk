rule tracking_store:
    output:
        "results/mlflow/experiment_id",
    log:
        "logs/tracking_store.log",
    benchmark:
        "results/benchmarks/tracking_store.tsv"
    conda:
        "../../environment.yml"
    params:
        experiment=EXPERIMENT,
    shell:
        "python -m distrepro.tracking init {params.experiment} {output} > {log} 2>&1"


rule prepare:
    output:
        "data/tfrecords/{dataset}/metadata.json",
    log:
        "logs/prepare/{dataset}.log",
    benchmark:
        "results/benchmarks/prepare/{dataset}.tsv"
    conda:
        "../../environment.yml"
    # The converter runs a process per core it is given (local: at most --cores).
    threads: prepare_threads_of
    resources:
        **CLUSTER,
    params:
        shards=shards_of,
    message:
        "TFRecords of {wildcards.dataset} through DVC: {params.shards}"
    shell:
        "dvc repro prepare@{wildcards.dataset} > {log} 2>&1"
