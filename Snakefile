# draftsmith: EAGLE-3 draft models for a target served by SGLang, as a make-style build.
# This file is the table of contents; every stage lives in rules/<stage>.smk and every
# command is one call into the draftsmith package. See README.md and docs/.
# Every rule that does work times itself into benchmarks/jobs/<rule>/<wildcards>.tsv
# (benchmark:), which benchmarks/bench_default.py sums into the run's stage split.

from snakemake.utils import min_version

min_version("9.0")


configfile: "config.yaml"


report: "report/workflow.rst"


include: "rules/common.smk"
include: "rules/env.smk"
include: "rules/target.smk"
include: "rules/data.smk"
include: "rules/hidden.smk"
include: "rules/sglang.smk"
include: "rules/train.smk"
include: "rules/segments.smk"
include: "rules/bench.smk"


# Ctrl-C or SIGTERM of snakemake stops the running jobs within seconds (draftsmith.runtime.stopping):
# Snakemake's own SIGTERM handling would wait for them to finish.
onstart:
    forward_stop_signals()


# Everything that must exist, so that deleting any intermediate (a range's rows, tokens or shard,
# the vocabulary, the draft) rebuilds it and what depends on it: Snakemake rebuilds a missing file
# only when some target asks for it (docs/output.md).
rule all:
    default_target: True
    input:
        expand("results/env/{role}.json", role=ROLES),
        "results/target",
        rules.data.input,
        rules.hidden.input,
        rules.train.output,
        rules.bench.output,
    localrule: True
