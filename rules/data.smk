# Conversation data: prompt sources -> regenerated rows -> tokens + loss mask -> draft vocabulary.
# Row ranges (RANGES) are fixed at DAG-build time by draftsmith.data.prompts.load_sources (common.smk).
# Each job's --cfg carries only the keys it reads, so e.g. a data.overlong change re-tokenizes
# without regenerating (data.max_length also bounds the regenerated prompt + reply), and a
# draft.vocab_size change rebuilds only the vocabulary. Source files
# are inputs and the bundled set's package file is a param by content (bundled_digest): editing
# either makes every range stale. Per-range rules refuse ranges the config does not define.
# `rule data` requests every artifact of the stage: Snakemake rebuilds a deleted intermediate
# (e.g. one range's rows) only when it is requested, so `rule all` includes rules.data.input.
rule data_report:
    input:
        sources=user_source_files(),
        stamp=stamp("data"),
    output:
        "results/data/sources.json",
    log:
        "logs/data/data_report.log",
    benchmark:
        "benchmarks/jobs/data_report/sources.tsv"
    localrule: True
    conda:
        role_env("data")
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        cfg=cfg_json(data=("sources", "heldout_rows", "max_rows", "system_prompt")),
        bundled=bundled_digest(),
    shell:
        "$DRAFTSMITH_PY_DATA -m draftsmith prompts --cfg {params.cfg:q} --out {output} > {log} 2>&1"


rule regenerate:
    input:
        configured_range,
        sources=user_source_files(),
        target="results/target",
        stamp=stamp("regenerate"),
    output:
        rows="results/data/{rows}.jsonl",
        report="results/data/{rows}.report.json",
    log:
        "logs/regenerate/{rows}.log",
    benchmark:
        "benchmarks/jobs/regenerate/{rows}.tsv"
    # a GPU role's server: the stage's jobs first, one load for all of them
    priority: range_priority("regenerate")
    conda:
        role_env("regenerate")
    # one thread: on a 2-core CPU two range jobs side by side finish sooner than two-thread
    # jobs one after another (benchmarks/bench_job_threads.py); a CPU SGLang server at tp_size
    # N gets N, a core per rank; site profiles set their own
    threads: range_threads("regenerate")
    resources:
        **gpu_resources("regenerate"),
        mem_mb=6000,
        runtime=60,
    params:
        cfg=cfg_json(
            "regenerate",
            server_of="regenerate",
            data=(
                "sources",
                "heldout_rows",
                "max_rows",
                "max_length",
                "system_prompt",
            ),
        ),
        bundled=bundled_digest(),
    shell:
        "$DRAFTSMITH_PY_REGENERATE -m draftsmith regenerate --cfg {params.cfg:q} --range {wildcards.rows} "
        "--target {input.target} --out {output.rows} --report {output.report} "
        "--threads {threads} > {log} 2>&1"


rule tokenize:
    input:
        configured_range,
        rows="results/data/{rows}.jsonl",
        target="results/target",
        stamp=stamp("data"),
    output:
        "results/tokens/{rows}.safetensors",
    log:
        "logs/tokenize/{rows}.log",
    benchmark:
        "benchmarks/jobs/tokenize/{rows}.tsv"
    conda:
        role_env("data")
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        cfg=json.dumps(
            {
                "data": {
                    k: config["data"][k]
                    for k in ("max_length", "overlong", *set_away("data", "reasoning"))
                },
                # only when on, so the default's params (and its token files) stay as they were
                **remote_code_cfg(),
                **thinking_cfg(),
            },
            sort_keys=True,
        ),
    shell:
        "$DRAFTSMITH_PY_DATA -m draftsmith tokens --cfg {params.cfg:q} --rows {input.rows} "
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
    benchmark:
        "benchmarks/jobs/vocab/vocab.tsv"
    conda:
        role_env("data")
    resources:
        mem_mb=2000,
        runtime=10,
    params:
        cfg=json.dumps({"draft": {"vocab_size": config["draft"]["vocab_size"]}}),
    shell:
        "$DRAFTSMITH_PY_DATA -m draftsmith vocab --cfg {params.cfg:q} --target {input.target} "
        "--out {output} --rows {input.rows} --tokens {input.tokens} > {log} 2>&1"


rule data:
    input:
        "results/data/sources.json",
        expand("results/data/{rows}.jsonl", rows=RANGES),
        expand("results/data/{rows}.report.json", rows=RANGES),
        expand("results/tokens/{rows}.safetensors", rows=RANGES),
        "results/vocab/vocab.safetensors",
    localrule: True
