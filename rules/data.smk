# Conversation data: prompt sources -> regenerated rows -> tokens + loss mask -> draft vocabulary.
# Row ranges (RANGES) are fixed at DAG-build time by draftsmith.prompts.load_sources (common.smk).
# Each job's --cfg carries only the keys it reads, so e.g. a data.max_length change re-tokenizes
# without regenerating, and a draft.vocab_size change rebuilds only the vocabulary. Source files
# (the bundled set's package file included) are inputs: editing one makes every range stale.
# `rule data` requests every artifact of the stage: Snakemake rebuilds a deleted intermediate
# (e.g. one range's rows) only when it is requested, so `rule all` includes rules.data.input.
from draftsmith.prompts import source_files


rule data_report:
    input:
        sources=source_files(config),
        stamp=stamp("data"),
    output:
        "results/data/sources.json",
    log:
        "logs/data/data_report.log",
    localrule: True
    conda:
        role_env("data")
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        py=python_cmd("data"),
        cfg=json.dumps(
            {
                "data": {
                    k: config["data"][k]
                    for k in ("sources", "heldout_rows", "max_rows")
                }
            },
            sort_keys=True,
        ),
    shell:
        "{params.py} -m draftsmith.prompts --cfg {params.cfg:q} --out {output} > {log} 2>&1"


rule regenerate:
    input:
        sources=source_files(config),
        target="results/target",
        stamp=stamp("regenerate"),
    output:
        rows="results/data/{rows}.jsonl",
        report="results/data/{rows}.report.json",
    log:
        "logs/regenerate/{rows}.log",
    conda:
        role_env("regenerate")
    threads: 1
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        py=python_cmd("regenerate"),
        cfg=json.dumps(
            {
                "data": {
                    k: config["data"][k]
                    for k in ("sources", "heldout_rows", "max_rows")
                },
                "regenerate": config["regenerate"],
            },
            sort_keys=True,
        ),
    shell:
        "{params.py} -m draftsmith.regenerate --cfg {params.cfg:q} --range {wildcards.rows} "
        "--target {input.target} --out {output.rows} --report {output.report} "
        "--threads {threads} > {log} 2>&1"


rule tokenize:
    input:
        rows="results/data/{rows}.jsonl",
        target="results/target",
        stamp=stamp("data"),
    output:
        "results/tokens/{rows}.safetensors",
    log:
        "logs/tokenize/{rows}.log",
    conda:
        role_env("data")
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        py=python_cmd("data"),
        cfg=json.dumps(
            {"data": {k: config["data"][k] for k in ("max_length", "overlong")}},
            sort_keys=True,
        ),
    shell:
        "{params.py} -m draftsmith.tokens --cfg {params.cfg:q} --rows {input.rows} "
        "--target {input.target} --out {output} > {log} 2>&1"


rule vocab:
    input:
        tokens=expand("results/tokens/{rows}.safetensors", rows=RANGES),
        rows=expand("results/data/{rows}.jsonl", rows=RANGES),
        sources="results/data/sources.json",
        target="results/target",
        stamp=stamp("data"),
    output:
        "results/vocab/vocab.safetensors",
    log:
        "logs/vocab.log",
    conda:
        role_env("data")
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        py=python_cmd("data"),
        cfg=json.dumps({"draft": {"vocab_size": config["draft"]["vocab_size"]}}),
    shell:
        "{params.py} -m draftsmith.vocab --cfg {params.cfg:q} --target {input.target} "
        "--out {output} --rows {input.rows} --tokens {input.tokens} > {log} 2>&1"


rule data:
    input:
        "results/data/sources.json",
        expand("results/data/{rows}.jsonl", rows=RANGES),
        expand("results/data/{rows}.report.json", rows=RANGES),
        expand("results/tokens/{rows}.safetensors", rows=RANGES),
        "results/vocab/vocab.safetensors",
    localrule: True
