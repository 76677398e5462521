# draftsmith: EAGLE-3 draft models for a target served by SGLang, as a make-style build.
# This file is the table of contents; every stage lives in rules/<stage>.smk and every
# command is one call into the draftsmith package. See README.md and docs/.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/env.smk"
include: "rules/target.smk"
include: "rules/data.smk"
include: "rules/hidden.smk"
include: "rules/train.smk"
include: "rules/bench.smk"


rule all:
    default_target: True
    input:
        "results/bench/report.json",
