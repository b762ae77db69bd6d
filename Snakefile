# snakemake --cores all reproduce   (the default target)
# snakemake --cores all sweep --config sweep="train.global_batch_size=32,64,128"
# snakemake --cores all scaling --config workers="1,2,4"
# snakemake --cores all network --config bandwidths="10mbit,100mbit,1gbit" workers=2   (as root)
# snakemake --cores all stragglers --config slowdowns="1,2,4" workers=2   (as root)
# snakemake --cores all churn --config kill_intervals="30,60" workers=2   (as root)
# Values come from Hydra (conf/); --config experiment=NAME overrides="k=v k=v".
# --config strategies=horovod,parameter_server: every target trains only those.
from snakemake.utils import min_version, validate

min_version("9.0")


validate(config, "workflow/schemas/config.schema.yaml", set_default=True)


include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/report.smk"


# MLflow bookkeeping runs where snakemake does, also under a cluster executor.
localrules:
    tracking_store,
    group_parent,
    setting_parent,


rule reproduce:
    default_target: True
    input:
        "results/report/report.md",


rule sweep:
    input:
        sweep_report(),


rule scaling:
    input:
        scaling_report,


rule network:
    input:
        network_report,


rule stragglers:
    input:
        stragglers_report,


rule churn:
    input:
        churn_report,
