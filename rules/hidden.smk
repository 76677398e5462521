# Hidden-state shards: one capture job per row range, plus the disk estimate and the GPU layout
# printed when the workflow is parsed.
# Params carry only the `capture` and `target` sections, so a change to train.*, draft.* or
# bench.* leaves every shard fresh, while new layer ids or a new storage dtype make all stale.
# A corrupt shard: the train job that refuses it deletes it (draftsmith/runtime/repair.py), so the next
# plain run rebuilds only that range (docs/contracts/shard-format.md); `draftsmith.hidden.shards verify --delete` does
# the same by hand.

print_shard_estimate()
print_gpu_layout()


rule hidden_plan:
    input:
        tokens=expand("results/tokens/{rows}.safetensors", rows=RANGES),
        target="results/target",
        stamp=stamp("capture"),
    output:
        "results/hidden/plan.json",
    log:
        "logs/hidden_plan.log",
    benchmark:
        "benchmarks/jobs/hidden_plan/plan.tsv"
    localrule: True
    conda:
        role_env("capture")
    resources:
        mem_mb=1000,
        runtime=5,
    params:
        cfg=cfg_json("capture", "target", **segment_plan_keys()),
    shell:
        "$DRAFTSMITH_PY_CAPTURE -m draftsmith plan --cfg {params.cfg:q} --target {input.target} "
        "--out {output} {input.tokens} 2> {log}"


# offline (capture.keep true): every shard kept; segment mode: rules/segments.smk
if KEEP_SHARDS:

    rule capture:
        input:
            configured_range,
            unpack(capture_engine_inputs),
            unpack(capture_vocab_input),
            tokens="results/tokens/{rows}.safetensors",
            target="results/target",
            stamp=stamp("capture"),
        output:
            shard="results/hidden/{rows}.safetensors",
            manifest="results/hidden/{rows}.json",
        log:
            "logs/capture/{rows}.log",
        benchmark:
            "benchmarks/jobs/capture/{rows}.tsv"
        conda:
            role_env("capture")
        # one thread, as regenerate (rules/data.smk; benchmarks/bench_job_threads.py)
        threads: range_threads("capture")
        resources:
            **gpu_resources("capture"),
            mem_mb=6000,
            runtime=60,
        params:
            cfg=cfg_json("capture", "target", server_of="capture"),
            # the capture engine's own inputs as options (engine_input_args); the param keeps its
            # first name, since the shell command below is part of the rule's code (renaming it
            # would make every shard stale)
            patched=engine_input_args,
            vocab=lambda w, input: (
                f"--vocab {input.vocab}" if "vocab" in input.keys() else ""
            ),
        shell:
            "$DRAFTSMITH_PY_CAPTURE -m draftsmith capture --cfg {params.cfg:q} --tokens {input.tokens} "
            "--target {input.target} --out {output.shard} --threads {threads} {params.patched} "
            "{params.vocab} > {log} 2>&1"

    rule hidden:
        input:
            expand(
                "results/hidden/{rows}.{ext}", rows=RANGES, ext=("safetensors", "json")
            ),
            "results/hidden/plan.json",
        localrule: True
