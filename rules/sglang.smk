# The patched SGLang (capture.backend: sglang): the capture patch applied to an overlay of the
# capture role's installed package (results/sglang/overlay, first on the capture server's
# PYTHONPATH). Refuses an SGLang other than the role's pin, or an install whose patched files
# are not the pinned wheel's. Every capture job depends on patched.json (rules/hidden.smk).


def sglang_pin():
    """The SGLang version the capture role pins (its envs/<role>.txt)."""
    from draftsmith.envcheck import read_pins

    pins = Path(workflow.basedir, "envs", f"{role_of('capture')}.txt")
    pin = read_pins(pins).get("sglang")
    if pin is None:
        raise ValueError(
            f"config: capture.backend sglang, but capture.role {role_of('capture')!r} "
            f"does not pin sglang in {pins}"
        )
    return pin


def sglang_patch_inputs(wildcards):
    """The capture role's pin file and the patches for its SGLang pin (lazy: sglang only)."""
    pins = Path(workflow.basedir, "envs", f"{role_of('capture')}.txt")
    patch_dir = Path(workflow.basedir, "patches", f"sglang-{sglang_pin()}")
    patches = sorted(patch_dir.glob("*.patch"))
    if not patches:
        raise ValueError(
            f"config: capture.backend sglang, but {patch_dir} has no *.patch for the "
            f"pinned SGLang {sglang_pin()}"
        )
    return {
        "pins": str(pins),
        "patches": [str(p) for p in patches],
        "pristine": str(patch_dir / "pristine.sha256"),
    }


rule patch_sglang:
    input:
        unpack(sglang_patch_inputs),
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
        "$DRAFTSMITH_PY_CAPTURE -m draftsmith.sglang_patch --pins {input.pins} --patches {input.patches} "
        "--pristine {input.pristine} --overlay {output.overlay} --out {output.record} "
        "> {log} 2>&1"
