rule evaluate:
    input:
        "results/runs/{run}/metrics.json",
    output:
        "results/runs/{run}/evaluation.json",
    log:
        "logs/evaluate/{run}.log",
    benchmark:
        "results/benchmarks/evaluate/{run}.tsv"
    conda:
        "../../environment.yml"
    threads: 1
    resources:
        **CLUSTER,
        gpu=eval_gpus_of,
        mem_mb=eval_memory_of,
    params:
        overrides=run_overrides,
    shell:
        "python -m distrepro.evaluate {params.overrides} > {log} 2>&1"
