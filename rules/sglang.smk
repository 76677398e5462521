# The patched SGLang (capture.backend: sglang): the capture patch applied to an overlay of the
# capture role's installed package (results/sglang/overlay, first on the capture server's
# PYTHONPATH). Refuses an SGLang other than the role's pin, or an install whose patched files
# are not the pinned wheel's. Every capture job depends on patched.json (rules/hidden.smk).

from draftsmith.engines.sglang.patch import rule_inputs as patch_inputs


rule patch_sglang:
    input:
        # the capture role's pin file, the patches and pristine hashes for its SGLang pin
        unpack(lambda w: patch_inputs(workflow.basedir, role_of("capture"))),
        stamp=stamp("capture"),
    output:
        record="results/sglang/patched.json",
        overlay=directory("results/sglang/overlay"),
    log:
        "logs/patch_sglang.log",
    benchmark:
        "benchmarks/jobs/patch_sglang/patched.tsv"
    localrule: True
    conda:
        role_env("capture")
    resources:
        mem_mb=1000,
        runtime=10,
    shell:
        "$DRAFTSMITH_PY_CAPTURE -m draftsmith sglang-patch --pins {input.pins} --patches {input.patches} "
        "--pristine {input.pristine} --overlay {output.overlay} --out {output.record} "
        "> {log} 2>&1"
