# Segment mode (capture.keep false, train.segment_rows): capture and training interleaved, one
# segment of rows at a time, so the disk holds at most two segments' shards (docs/scale.md).
# Per epoch and segment: segment_capture writes each range's shard (temp: deleted once its
# segment is trained) and its manifest (kept: per-tensor sha256, compared with the range's first
# capture, draftsmith.stages.segcapture); segment_train trains the segment from the previous segment's
# checkpoint and writes its own (kept). The capture of (epoch, segment) index i waits for the
# training of index i - 2, so one segment is captured while the one before it trains. Rule
# train exports the last checkpoint as rules/train.smk's rule does. A killed run: the next
# plain run captures again only what was in flight (Snakemake's incomplete outputs) and resumes
# the segment's training from its last checkpoint in state/train/.
# capture.backend sglang with sglang.capture_server run (auto on a CPU capture role): the
# captures of a run share one server (draftsmith.engines.sharedserver, state/servers/), which stops
# after the capture of the last index (--last-capture), when idle, or with the run; Snakemake's
# service() cannot express the i - 2 gate (docs/scale.md).

if not KEEP_SHARDS:

    rule segment_capture:
        input:
            configured_range,
            unpack(capture_engine_inputs),
            unpack(capture_vocab_input),
            unpack(segment_gate),
            tokens="results/tokens/{rows}.safetensors",
            target="results/target",
            stamp=stamp("capture"),
        output:
            shard=temp("results/segments/epoch{epoch}/{rows}.safetensors"),
            manifest="results/segments/epoch{epoch}/{rows}.json",
        log:
            "logs/segments/capture/epoch{epoch}/{rows}.log",
        benchmark:
            "benchmarks/jobs/segment_capture/epoch{epoch}-{rows}.tsv"
        wildcard_constraints:
            epoch=r"\d{3}",
        conda:
            role_env("capture")
        threads: 2
        resources:
            **gpu_resources("capture"),
            mem_mb=6000,
            runtime=60,
        params:
            cfg=cfg_json("capture", "target", server_of="capture"),
            patched=engine_input_args,
            vocab=lambda w, input: (
                f"--vocab {input.vocab}" if "vocab" in input.keys() else ""
            ),
            server=segment_server_args,
        shell:
            "$DRAFTSMITH_PY_CAPTURE -m draftsmith segment-capture --reference-dir state/segments "
            "{params.server} "
            "--cfg {params.cfg:q} --tokens {input.tokens} --target {input.target} "
            "--out {output.shard} --threads {threads} {params.patched} {params.vocab} "
            "> {log} 2>&1"

    rule segment_train:
        input:
            unpack(segment_train_inputs),
            tokens=expand("results/tokens/{rows}.safetensors", rows=RANGES),
            vocab="results/vocab/vocab.safetensors",
            target="results/target",
            stamp=stamp("train"),
        output:
            directory("results/segments/ckpt/epoch{epoch}-seg{seg}"),
        log:
            "logs/segments/train/epoch{epoch}-seg{seg}.log",
        benchmark:
            "benchmarks/jobs/segment_train/epoch{epoch}-seg{seg}.tsv"
        wildcard_constraints:
            epoch=r"\d{3}",
            seg=r"\d{4}",
        conda:
            role_env("train")
        threads: 2
        resources:
            **gpu_resources("train"),
            mem_mb=8000,
            runtime=240,
        params:
            cfg=cfg_json("train", "draft", "capture"),
            prev=lambda w, input: (
                f"--prev {input.prev}" if "prev" in input.keys() else ""
            ),
        shell:
            "$DRAFTSMITH_PY_TRAIN -m draftsmith segment-train train --cfg {params.cfg:q} "
            "--segment epoch{wildcards.epoch}-seg{wildcards.seg} --shards {input.shards} "
            "--tokens {input.tokens} {params.prev} --vocab {input.vocab} "
            "--target {input.target} --out {output} --state state/train "
            "--threads {threads} > {log} 2>&1"

    rule train:
        input:
            ckpt=segment_ckpt(len(SEGMENT_ORDER) - 1),
            manifests=expand("results/segments/epoch000/{rows}.json", rows=RANGES),
            tokens=expand("results/tokens/{rows}.safetensors", rows=RANGES),
            vocab="results/vocab/vocab.safetensors",
            target="results/target",
            stamp=stamp("train"),
        output:
            draft=directory("results/draft"),
            metrics="results/train/metrics.jsonl",
            offline="results/train/offline_acceptance.json",
        log:
            "logs/train.log",
        benchmark:
            "benchmarks/jobs/train/train.tsv"
        conda:
            role_env("train")
        resources:
            mem_mb=4000,
            runtime=30,
        params:
            cfg=cfg_json("train", "draft", "capture"),
        shell:
            "$DRAFTSMITH_PY_TRAIN -m draftsmith segment-train export --cfg {params.cfg:q} "
            "--ckpt {input.ckpt} --manifests {input.manifests} --tokens {input.tokens} "
            "--vocab {input.vocab} --target {input.target} --out {output.draft} "
            "--metrics {output.metrics} --offline {output.offline} > {log} 2>&1"

    rule hidden:
        input:
            expand(
                "results/segments/epoch{epoch:03d}/{rows}.json",
                epoch=range(config["train"]["epochs"]),
                rows=RANGES,
            ),
            "results/hidden/plan.json",
        localrule: True
