# Benchmark: speculative decoding with the trained draft against plain greedy decoding of the
# target, on the held-out rows, HumanEval and any bench.files; the report and its plots.
# bench.backend picks the engine: hf (in-process chains) or sglang (the target served by SGLang
# without and with EAGLE-3; the job launches both servers with its role's interpreter).
# The rule fails (sanity gate) when a set's tau is under bench.tau_floor or exactly 1.0, unless
# bench.smoke is set. Captions are rendered by the job with the config it ran with
# (results/bench/captions/), so `snakemake --report` never describes a figure with a newer config.


rule bench:
    input:
        draft="results/draft",
        target="results/target",
        metrics="results/train/metrics.jsonl",
        offline="results/train/offline_acceptance.json",
        sources=[
            s["path"] for s in config["data"]["sources"] if s["format"] != "bundled"
        ],
        files=[f["path"] for f in config["bench"]["files"]],
        stamp=stamp("bench"),
    output:
        json=report(
            "results/bench/report.json",
            caption=run_caption("report_json"),
            category="Benchmark",
            labels={"figure": "all numbers (JSON)"},
        ),
        md="results/bench/report.md",
        html=report(
            "results/bench/summary.html",
            caption=run_caption("summary"),
            category="Benchmark",
            labels={"figure": "summary"},
        ),
        acceptance=report(
            "results/bench/acceptance.png",
            caption=run_caption("acceptance"),
            category="Benchmark",
            labels={"figure": "acceptance by position"},
        ),
        hist=report(
            "results/bench/accept_hist.png",
            caption=run_caption("accept_hist"),
            category="Benchmark",
            labels={"figure": "accepted length histogram"},
        ),
        training=report(
            "results/bench/training.png",
            caption=run_caption("training"),
            category="Training",
            labels={"figure": "training curves"},
        ),
        captions=directory("results/bench/captions"),
    log:
        "logs/bench/bench.log",
    benchmark:
        "benchmarks/jobs/bench/bench.tsv"
    conda:
        role_env("bench")
    threads: 2
    resources:
        **gpu_resources("bench"),
        mem_mb=6000,
        runtime=60,
    params:
        cfg=cfg_json("bench", "data", "target", server_of="bench"),
    shell:
        "$DRAFTSMITH_PY_BENCH -m draftsmith bench --cfg {params.cfg:q} --draft {input.draft} "
        "--target {input.target} --metrics {input.metrics} --offline {input.offline} "
        "--env-stamp {input.stamp} "
        "--threads {threads} --report-json {output.json} --report-md {output.md} "
        "--summary-html {output.html} --acceptance {output.acceptance} "
        "--hist {output.hist} --training {output.training} --captions {output.captions} "
        "> {log} 2>&1"
