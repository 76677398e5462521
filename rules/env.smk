rule validate_env:
    input:
        pins=pins_file,
        venv=venv_marker,
    output:
        "results/env/{role}.json",
    log:
        "logs/validate_env/{role}.log",
    conda:
        "../envs/{role}.yaml"
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        driver=f"env PYTHONPATH={workflow.basedir} {sys.executable}",
        python=lambda w: role_python(w.role),
        gpus=lambda w: role_gpus(w.role),
    shell:
        "{params.driver} -m draftsmith.envcheck check --role {wildcards.role} "
        "--pins {input.pins} --python {params.python} --gpus {params.gpus} "
        "--out {output} --log {log}"


rule build_venv:
    input:
        pins=pins_file,
    output:
        "results/venv/{role}/pyvenv.cfg",
    log:
        "logs/build_venv/{role}.log",
    conda:
        "../envs/{role}.yaml"
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        driver=f"env PYTHONPATH={workflow.basedir} {sys.executable}",
    shell:
        "{params.driver} -m draftsmith.envcheck venv --pins {input.pins} "
        "--out results/venv/{wildcards.role} > {log} 2>&1"
