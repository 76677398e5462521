# Draft training (TTT) and the SGLang export, in one package call.
# Params carry the train, draft and capture sections: a train.* or draft.* change retrains
# without touching the shards. Resumable state lives in state/train/<run key>/, outside the
# declared outputs (Snakemake deletes a failed job's outputs, never the checkpoints), so a
# killed or failed job resumes from its newest checkpoint when rerun (docs/contracts/training.md).
# draftsmith.train.launch starts train.nproc processes on each of the job's nodes (resource nodes,
# set by a site profile; inside SLURM one srun step and a c10d rendezvous, docs/cluster.md).
# offline_acceptance.json: the draft's acceptance per chain step on the train.eval_rows rows
# held out of training, and the tau it predicts (draftsmith.algorithms.eagle3.offline; none at eval_rows 0).


# offline (capture.keep true): every shard kept; segment mode: rules/segments.smk
if KEEP_SHARDS:

    rule train:
        input:
            shards=expand("results/hidden/{rows}.safetensors", rows=RANGES),
            manifests=expand("results/hidden/{rows}.json", rows=RANGES),
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
        threads: 2
        resources:
            **gpu_resources("train"),
            mem_mb=8000,
            runtime=240,
            nodes=1,
        params:
            cfg=cfg_json("train", "draft", "capture"),
            nproc=config["train"]["nproc"],
            threads_per_proc=lambda wildcards, threads: max(
                1, threads // config["train"]["nproc"]
            ),
        shell:
            "$DRAFTSMITH_PY_TRAIN -m draftsmith train --nproc-per-node {params.nproc} "
            "--nnodes {resources.nodes} --cpus-per-node {threads} -- --cfg {params.cfg:q} "
            "--shards {input.shards} --vocab {input.vocab} --target {input.target} "
            "--out {output.draft} --metrics {output.metrics} --offline {output.offline} "
            "--state state/train "
            "--threads {params.threads_per_proc} > {log} 2>&1"
