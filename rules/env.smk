# Environment stamps. A CPU role is checked on the submit host (localrule); a GPU role is
# checked where its jobs run, on a node with the GPUs it declares (envs.<role>.gpus), so a
# missing driver or a CPU-only torch fails there, before any GPU job is queued behind it.
# The pin files are params (their text), not inputs: the workflow's own files are reached through
# $DRAFTSMITH_WORKFLOW (common.smk, job_environment), so no param holds a path into the workflow.
# validate_env's `python` param is the one interpreter path in params, on purpose: the stamp
# describes that interpreter, so a different one must re-check the role.
# The check's output is keyed by what it depends on (results/env/<role>/<key>.json, key = digest
# of pin text, interpreter, GPUs); rule env_stamp publishes it as results/env/<role>.json, the
# input of every job of the role. A check that fails (a wrong interpreter in the config) fails
# under another key and never runs env_stamp, so the published stamp survives it: putting the
# config back plans no job at all, instead of rerunning everything over a typo.


rule validate_env:
    input:
        current_env_key,
        venv=venv_marker,
    output:
        "results/env/{role}/{envkey}.json",
    log:
        "logs/validate_env/{role}/{envkey}.log",
    benchmark:
        "benchmarks/jobs/validate_env/{role}/{envkey}.tsv"
    wildcard_constraints:
        role=roles_regex([r for r in ROLES if role_gpus(r) == 0]),
    localrule: True
    conda:
        "../envs/{role}.yaml"
    resources:
        mem_mb=1000,
        runtime=10,
    params:
        pins=pins_text,
        python=lambda w: role_python(w.role),
        gpus=lambda w: role_gpus(w.role),
    shell:
        '"$DRAFTSMITH_DRIVER" -m draftsmith env check --role {wildcards.role} '
        '--pins "$DRAFTSMITH_WORKFLOW/envs/{wildcards.role}.txt" --python {params.python:q} '
        "--gpus {params.gpus} "
        "--out {output} --log {log}"


use rule validate_env as validate_env_gpu with:
    benchmark:
        "benchmarks/jobs/validate_env_gpu/{role}/{envkey}.tsv"
    wildcard_constraints:
        role=roles_regex(gpu_roles()),
    localrule: False
    resources:
        mem_mb=4000,
        runtime=10,
        gpu=lambda w: role_gpus(w.role),


rule env_stamp:
    input:
        keyed_stamp,
    output:
        "results/env/{role}.json",
    log:
        "logs/env_stamp/{role}.log",
    benchmark:
        "benchmarks/jobs/env_stamp/{role}.tsv"
    localrule: True
    conda:
        "../envs/{role}.yaml"
    resources:
        mem_mb=100,
        runtime=1,
    shell:
        '"$DRAFTSMITH_DRIVER" -m draftsmith env publish {input} {output} 2> {log}'


rule build_venv:
    output:
        "results/venv/{role}/pyvenv.cfg",
    log:
        "logs/build_venv/{role}.log",
    benchmark:
        "benchmarks/jobs/build_venv/{role}.tsv"
    localrule: True  # pip needs the network; compute nodes often have none
    conda:
        "../envs/{role}.yaml"
    resources:
        mem_mb=4000,
        runtime=60,
    params:
        pins=pins_text,
    shell:
        '"$DRAFTSMITH_DRIVER" -m draftsmith env venv '
        '--pins "$DRAFTSMITH_WORKFLOW/envs/{wildcards.role}.txt" '
        "--out results/venv/{wildcards.role} > {log} 2>&1"
