rule report:
    input:
        report_inputs,
    output:
        md="results/{reportdir}/report.md",
        html="results/{reportdir}/report.html",
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
        reportdir="report|sweeps/[0-9a-f]+/report",
    conda:
        "../../environment.yml"
    params:
        runs=report_run_list,
    shell:
        "python -m distrepro.report 'report.runs={params.runs}' report.out_dir=results/{wildcards.reportdir} > {log} 2>&1"
