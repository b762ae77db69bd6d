rule report:
    input:
        report_inputs,
    output:
        md="results/{reportdir}/report.md",
        html="results/{reportdir}/report.html",
        metrics="results/{reportdir}/metrics.json",
        throughput=report(
            "results/{reportdir}/throughput.png",
            category="Throughput",
            caption="../report/throughput.rst",
        ),
        accuracy=report(
            "results/{reportdir}/accuracy.png",
            category="Accuracy",
            caption="../report/accuracy.rst",
        ),
    log:
        "logs/report/{reportdir}.log",
    benchmark:
        "results/benchmarks/report/{reportdir}.tsv"
    wildcard_constraints:
        reportdir="report|(sweeps|scaling)/[0-9a-f]+/report",
    conda:
        "../../environment.yml"
    resources:
        **CLUSTER,
    params:
        runs=report_run_list,
    shell:
        "python -m distrepro.report 'report.runs={params.runs}' report.out_dir=results/{wildcards.reportdir} > {log} 2>&1"


# variants=best: the grid's winner of each strategy at its shaped rate and
# unshaped, which the network target then trains with every seed.
checkpoint network_best:
    input:
        grid_inputs,
    output:
        "results/network/{id}/best.json",
    log:
        "logs/report/network/{id}-best.log",
    benchmark:
        "results/benchmarks/report/network/{id}-best.tsv"
    wildcard_constraints:
        id="[0-9a-f]+",
    conda:
        "../../environment.yml"
    params:
        runs=lambda wildcards, input: " ".join(str(Path(f).parent) for f in input),
    shell:
        "python -m distrepro.network_report winners {output} {params.runs} > {log} 2>&1"


rule network_report:
    input:
        runs=network_inputs,
        best=best_file,
    output:
        md="results/network/{id}/report/report.md",
        curves=report(
            "results/network/{id}/report/throughput.png",
            category="Network",
            caption="../report/network.rst",
        ),
        summary="results/network/{id}/report/network.json",
    log:
        "logs/report/network/{id}.log",
    benchmark:
        "results/benchmarks/report/network/{id}.tsv"
    wildcard_constraints:
        id="[0-9a-f]+",
    conda:
        "../../environment.yml"
    params:
        runs=lambda wildcards, input: " ".join(str(Path(f).parent) for f in input.runs),
        winners=lambda wildcards, input: f"--winners {input.best}" if input.best else "",
    shell:
        "python -m distrepro.network_report {params.winners} results/network/{wildcards.id}/report {params.runs} > {log} 2>&1"


# The stragglers and churn targets' reports: their runs against the slowdown
# or the mean interval between kills (distrepro.conditions_report).
rule conditions_report:
    input:
        conditions_inputs,
    output:
        md="results/{kind}/{id}/report/report.md",
        curves=report(
            "results/{kind}/{id}/report/throughput.png",
            category="Conditions",
            caption="../report/conditions.rst",
        ),
        summary="results/{kind}/{id}/report/conditions.json",
    log:
        "logs/report/{kind}/{id}.log",
    benchmark:
        "results/benchmarks/report/{kind}/{id}.tsv"
    wildcard_constraints:
        kind="stragglers|churn",
        id="[0-9a-f]+",
    conda:
        "../../environment.yml"
    params:
        condition=lambda wildcards: {
            "stragglers": "slowdown",
            "churn": "kill_interval_s",
        }[wildcards.kind],
        runs=lambda wildcards, input: " ".join(str(Path(f).parent) for f in input),
    shell:
        "python -m distrepro.conditions_report {params.condition} results/{wildcards.kind}/{wildcards.id}/report {params.runs} > {log} 2>&1"
