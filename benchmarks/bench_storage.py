"""Shard storage modes on the embedded default's rows: bytes, capture and read cost, teacher
fidelity, and held-out tau of a draft trained on each mode.

    snakemake --cores 2 results/vocab/vocab.safetensors        # the default's rows, once
    nice -n 10 python benchmarks/bench_storage.py [--epochs 3] [--seeds 3] [--threads 2]

(a) capture: one forward per batch over the default's four token files (embedded SmolLM2,
    float32), the same states handed to one `ShardWriter` per storage mode; forward and each
    mode's encode + write time (process CPU time, and wall) -> capture throughput per mode.
(b) bytes per token of each mode against SpecForge's layout: measured here (`to-specforge` of
    the reference shards: one torch.save file per sample), and computed for Kimi-K2.5's shapes
    (hidden 7168, vocabulary 163840, 61 layers) with the same rows, trained fraction and
    SpecForge's measured per-file overhead.
(c) read throughput: every row's aux states and teacher input decoded the way training reads
    them (`shard.aux`, `shard.teacher`; one torch thread), warm and cold page cache.
(d) teacher fidelity of the top-k modes at trained positions: KL(exact || top-k) over the
    draft vocabulary, the exact teacher's mass the top-k entries cover, argmax agreement;
    float8 aux error relative to the reference.
(e) a draft trained on each mode with the same seed and steps (`python -m draftsmith train-rank`,
    the default's config with `train.epochs` = --epochs), held-out tau (the default's 16
    held-out prompts, speculative decoding, K = 4, 64 new tokens), next to the reference trained
    with --seeds seeds: the seed-to-seed spread. `float8_e4m3+trained` feeds training the same
    teacher as `float8_e4m3` at every trained position; instead of a full run it is checked to
    give bit-identical losses for the first steps. The candidate `float8_e4m3+topk40-draft`
    (the teacher's own top-40 over the draft vocabulary, tail as one bucket) is trained with
    every seed, like the reference; `...-renormalized` (seed 0) is the ablation of its tail
    bucket: the same shards, the tail dropped and the 40 entries renormalized, in a trainer
    patched for this benchmark only (RENORM).

Finished captures and trained runs under --work are reused when the script is rerun.
Writes benchmarks/results/storage.json and storage.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as the rules run torch (no spin-waiting)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_job_threads import drop_cache  # noqa: E402
from storage_report import (  # noqa: E402
    ABLATION,
    DRAFT_TOPK,
    MODES,
    TRAINED,
    bytes_table,
    render,
    specforge_measured,
    summarize_runs,
)

from draftsmith.hidden.capture_base import plan_batches  # noqa: E402
from draftsmith.hidden.shards import open_shard  # noqa: E402
from draftsmith.hidden.writer import ShardWriter  # noqa: E402
from draftsmith.runtime.files import atomic_write_json, atomic_write_text, versions  # noqa: E402
from draftsmith.stages.capture import read_tokens  # noqa: E402


def clocks() -> tuple[float, float]:
    return time.process_time(), time.perf_counter()


def since(t0: tuple[float, float]) -> tuple[float, float]:
    c, w = clocks()
    return c - t0[0], w - t0[1]


# ------------------------------------------------------------------------------------ capture


def capture_all(results: Path, work: Path, cfg: dict) -> dict:
    """One forward per batch, every missing mode's writer fed the same states; CPU/wall seconds.

    Modes already captured under `work` are kept; a later capture of the missing modes also
    writes the reference (to hidden-baseline/) so its cost is timed against the same forward.
    capture.json: {"tokens", "threads", "runs": [{"modes", forward and write seconds}]}.
    """
    done = work / "capture.json"
    token_files = sorted((results / "tokens").glob("rows_*.safetensors"))
    old = json.loads(done.read_text()) if done.exists() else None
    if old is not None and "runs" not in old:  # the first format: one run of every mode then
        old = {
            "tokens": old["tokens"],
            "threads": old["threads"],
            "runs": [{**old, "modes": sorted(old["write_cpu_s"])}],
        }
    have = {m for r in (old or {"runs": []})["runs"] for m in r["modes"]}
    missing = [
        m
        for m in MODES
        if m not in have or not all((work / "hidden" / m / f.name).exists() for f in token_files)
    ]
    if not missing:
        return old
    run = capture_run(results, work, cfg, token_files, missing)
    out = {"tokens": run["tokens"], "threads": run["threads"], "runs": []}
    out["runs"] = [r for r in (old or out)["runs"] if not set(r["modes"]) & set(missing)] + [run]
    atomic_write_json(done, out)
    return out


def shard_manifest(f: Path, rows: int, fingerprint: str, n_layers: int, ids: list) -> dict:
    """The manifest of token file `f`'s shard in every mode (as capture writes it)."""
    a0 = int(f.stem.split("_")[1].split("-")[0])
    return {
        "row_range": [a0, a0 + rows],
        "target_fingerprint": fingerprint,
        "target_layers": n_layers,
        "aux_layer_ids": ids,
        "backend": "hf",
        "tokens_file": str(f),
        "versions": versions(),
    }


def capture_run(results: Path, work: Path, cfg: dict, token_files: list, modes: list) -> dict:
    from draftsmith.config.checks import aux_layer_ids
    from draftsmith.data.vocab import load_vocab
    from draftsmith.engines.hf.engine import forward_states, pad_rows
    from draftsmith.targets.model import fingerprint, load_target, target_config

    target = results / "target"
    dirs = {m: work / "hidden" / m for m in modes}
    if "bfloat16" not in dirs:  # the baseline the capture cost is measured against
        dirs["bfloat16"] = work / "hidden-baseline"
    d2t, _ = load_vocab(results / "vocab" / "vocab.safetensors")
    draft_ids = d2t + torch.arange(d2t.shape[0])
    model, _ = load_target(target, dtype=torch.float32)
    lm_head = model.get_output_embeddings().weight.detach()
    n_layers = int(target_config(target)["num_hidden_layers"])
    ids = aux_layer_ids(cfg["capture"]["aux_layer_ids"], n_layers)
    hidden = int(model.config.hidden_size)
    fwd = [0.0, 0.0]
    write = {m: [0.0, 0.0] for m in dirs}
    tokens_total = 0
    for f in token_files:
        tok = read_tokens(f)
        offsets = tok["row_offsets"].tolist()
        lengths = [b - a for a, b in zip(offsets, offsets[1:], strict=False)]
        manifest = shard_manifest(f, len(lengths), fingerprint(target), n_layers, ids)
        with contextlib.ExitStack() as stack:
            writers = {}
            for m, path in dirs.items():
                storage = MODES[m]
                t0 = clocks()
                writers[m] = stack.enter_context(
                    ShardWriter(
                        path / f.name,
                        input_ids=tok["input_ids"],
                        loss_mask=tok["loss_mask"],
                        row_offsets=tok["row_offsets"],
                        hidden_size=hidden,
                        dtype=cfg["capture"]["dtype"],
                        manifest=manifest,
                        storage=storage,
                        lm_head=lm_head if storage.final == "topk" else None,
                        draft_ids=draft_ids if storage.draft_topk else None,
                    )
                )
                write[m] = [x + y for x, y in zip(write[m], since(t0), strict=True)]
            for rows in plan_batches(lengths, int(cfg["capture"]["batch_tokens"])):
                t0 = clocks()
                aux, last = forward_states(model, pad_rows(tok["input_ids"], offsets, rows), ids)
                fwd = [x + y for x, y in zip(fwd, since(t0), strict=True)]
                for m, w in writers.items():
                    t0 = clocks()
                    for b, r in enumerate(rows):
                        w.write(offsets[r], aux[b, : lengths[r]], last[b, : lengths[r]])
                    write[m] = [x + y for x, y in zip(write[m], since(t0), strict=True)]
            for m in dirs:  # close (sha256, fsync, rename) one at a time, timed
                t0 = clocks()
                stack_close = writers[m].__exit__(None, None, None)
                assert stack_close is False
                write[m] = [x + y for x, y in zip(write[m], since(t0), strict=True)]
            stack.pop_all()
        tokens_total += tok["input_ids"].numel()
        print(f"captured {f.name}: forward {fwd[1]:.0f} s wall so far", flush=True)
    return {
        "modes": sorted(modes),
        "tokens": tokens_total,
        "forward_cpu_s": fwd[0],
        "forward_wall_s": fwd[1],
        "write_cpu_s": {m: v[0] for m, v in write.items()},
        "write_wall_s": {m: v[1] for m, v in write.items()},
        "threads": torch.get_num_threads(),
    }


# ------------------------------------------------------------------------------------ reading


def read_pass(paths) -> tuple[float, float]:
    """(CPU, wall) seconds to decode every row the way training reads it (aux + teacher)."""
    t0 = clocks()
    for p in paths:
        shard = open_shard(p)
        offs = shard.row_offsets.tolist()
        for a, b in zip(offs, offs[1:], strict=False):
            aux = shard.aux(a, b)
            teacher = shard.teacher(a, b)
            del aux, teacher
    return since(t0)


def read_throughput(work: Path, tokens: int, modes=tuple(MODES), repeats: int = 5) -> dict:
    """Tokens per CPU-second (one torch thread, best of `repeats`, modes interleaved so that
    load from other jobs hits every mode alike), warm and cold page cache; wall beside it."""
    torch.set_num_threads(1)  # as docs/contracts/shard-format.md recommends for loaders
    paths = {m: sorted((work / "hidden" / m).glob("rows_*.safetensors")) for m in modes}
    times = {m: {"warm": [], "cold": []} for m in modes}
    for m in modes:
        read_pass(paths[m])  # warm the page cache
    for _ in range(repeats):
        for m in modes:
            times[m]["warm"].append(read_pass(paths[m]))
        for m in modes:
            drop_cache(paths[m])
            times[m]["cold"].append(read_pass(paths[m]))
    out = {}
    for m, t in times.items():
        out[m] = {
            f"{k}_tokens_per_{unit}": tokens / min(x[i] for x in t[k])
            for k in ("warm", "cold")
            for i, unit in ((0, "cpu_s"), (1, "s"))
        }
    return out


# ------------------------------------------------------------------------------------ fidelity


@torch.no_grad()
def fidelity(work: Path, results: Path) -> dict:
    from draftsmith.algorithms.eagle3.ttt import teacher_logprobs
    from draftsmith.data.vocab import load_vocab
    from draftsmith.hidden.storage import topk_teacher
    from draftsmith.train.loop import target_tensors

    d2t, t2d = load_vocab(results / "vocab" / "vocab.safetensors")
    heads = target_tensors(results / "target")
    hot = d2t + torch.arange(d2t.shape[0])
    rows = heads["lm_head"][hot]
    index = torch.full((t2d.shape[0],), -1, dtype=torch.long)
    index[hot] = torch.arange(hot.shape[0])
    names = sorted(p.name for p in (work / "hidden" / "bfloat16").glob("rows_*.safetensors"))
    kl, tv, cover, agree, n, err_num, err_den = 0.0, 0.0, 0.0, 0, 0, 0.0, 0.0
    for name in names:
        ref = open_shard(work / "hidden" / "bfloat16" / name)
        top = open_shard(work / "hidden" / "bfloat16+topk32" / name)
        fp8 = open_shard(work / "hidden" / "float8_e4m3" / name)
        idx = ref.trained.nonzero().flatten()
        t = top.teacher(0, top.n_tokens)
        for s in range(0, idx.numel(), 2048):
            sel = idx[s : s + 2048]
            exact = teacher_logprobs(ref.last_hidden_states[sel], rows)
            approx = topk_teacher(t["topk_ids"][sel], t["topk_logprobs"][sel], index, rows.shape[0])
            p, q = exact.exp(), approx.exp()
            kept = q > 0
            # KL(top-k || exact) is finite (top-k's support is inside the exact one's)
            kl += float(torch.where(kept, q * (approx - exact), torch.zeros_like(q)).sum())
            tv += float(0.5 * (p - q).abs().sum())
            cover += float((p * kept).sum())
            agree += int((exact.argmax(-1) == approx.argmax(-1)).sum())
            n += sel.numel()
        a, b = ref.aux(0, ref.n_tokens), fp8.aux(0, fp8.n_tokens)
        err_num += float((a - b).pow(2).sum())
        err_den += float(a.pow(2).sum())
    return {
        "trained_positions": n,
        "topk32_kl_mean": kl / n,
        "topk32_total_variation_mean": tv / n,
        "topk32_mass_covered": cover / n,
        "topk32_argmax_agreement": agree / n,
        "fp8_aux_relative_rms_error": (err_num / err_den) ** 0.5,
    }


@torch.no_grad()
def topk_fidelity(work: Path, results: Path, mode: str) -> dict:
    """A top-k-over-the-draft-vocabulary mode at trained positions, against the exact teacher
    (from the reference shards' bf16 final states): the mass its k entries cover, the teacher
    mass it leaves as the tail bucket vs the exact one, the error of the listed probabilities,
    argmax agreement; and, for comparison, what the full vocabulary's top-k of the same k covers
    (k entries spent partly outside the draft vocabulary)."""
    from draftsmith.algorithms.eagle3.ttt import tail_mass, teacher_logprobs
    from draftsmith.data.vocab import load_vocab
    from draftsmith.hidden.storage import topk_teacher
    from draftsmith.train.loop import target_tensors

    d2t, t2d = load_vocab(results / "vocab" / "vocab.safetensors")
    w = target_tensors(results / "target")["lm_head"].float()
    hot = d2t + torch.arange(d2t.shape[0])
    rows = w[hot]
    k = MODES[mode].topk
    acc = {"cover": 0.0, "rest_err": 0.0, "listed_err": 0.0, "agree": 0, "full_cover": 0.0}
    acc["outside"], n = 0.0, 0
    for p_ref in sorted((work / "hidden" / "bfloat16").glob("rows_*.safetensors")):
        ref = open_shard(p_ref)
        top = open_shard(work / "hidden" / mode / p_ref.name)
        idx = ref.trained.nonzero().flatten()
        t = top.teacher(0, top.n_tokens)
        for s in range(0, idx.numel(), 1024):
            sel = idx[s : s + 1024]
            last = ref.last_hidden_states[sel].float()
            exact = teacher_logprobs(last, rows)
            approx = topk_teacher(
                t["draft_topk_ids"][sel], t["topk_logprobs"][sel], None, hot.numel()
            )
            p, q = exact.exp(), approx.exp()
            listed = torch.isfinite(approx)
            acc["cover"] += float((p * listed).sum())
            acc["rest_err"] += float((tail_mass(approx, q) - (p * ~listed).sum(-1)).abs().sum())
            acc["listed_err"] += float(((q - p) * listed).abs().sum())
            acc["agree"] += int((exact.argmax(-1) == approx.argmax(-1)).sum())
            full_top = (last @ w.T).topk(k, dim=-1).indices
            inside = t2d[full_top]
            acc["outside"] += float((~inside).sum())
            mask = torch.zeros(sel.numel(), w.shape[0], dtype=torch.bool).scatter(
                -1, full_top, True
            )
            acc["full_cover"] += float((p * mask[:, hot]).sum())
            n += sel.numel()
    return {
        "trained_positions": n,
        "k": k,
        "mass_covered": acc["cover"] / n,
        "tail_mass_abs_error": acc["rest_err"] / n,
        "listed_abs_error": acc["listed_err"] / n,
        "argmax_agreement": acc["agree"] / n,
        "full_vocab_topk_mass_covered": acc["full_cover"] / n,
        "full_vocab_topk_entries_outside_draft_vocab": acc["outside"] / n,
    }


# ------------------------------------------------------------------------------------ training


def train_cfg(cfg: dict, epochs: int, seed: int, max_steps: int = 0) -> dict:
    train = {**cfg["train"], "epochs": epochs, "seed": seed, "max_steps": max_steps}
    return {"train": train, "draft": cfg["draft"], "capture": cfg["capture"]}


# The ablation of the tail bucket: the draft-vocabulary top-k renormalized like the
# full-vocabulary one (its tail dropped), in a trainer patched for this benchmark only.
RENORM = (
    "import sys, draftsmith.algorithms.eagle3.ttt as t, draftsmith.train.loop as tr\n"
    "top = t.topk_teacher\n"
    "def renorm(ids, logp, index, k):\n"
    "    out = top(ids, logp, index, k)\n"
    "    return out - out.logsumexp(-1, keepdim=True)\n"
    "t.topk_teacher = renorm\n"
    "tr.main(sys.argv[1:])\n"
)


def run_train(work: Path, results: Path, mode: str, tcfg: dict, name: str, threads: int) -> Path:
    run = work / "runs" / name
    if (run / "draft" / "config.json").exists() and (run / "metrics.jsonl").exists():
        return run
    ablation = mode == ABLATION
    shards = sorted(
        (work / "hidden" / (DRAFT_TOPK if ablation else mode)).glob("rows_*.safetensors")
    )
    entry = ["-c", RENORM] if ablation else ["-m", "draftsmith", "train-rank"]
    cmd = [
        "nice",
        "-n",
        "10",
        sys.executable,
        *entry,
        "--cfg",
        json.dumps(tcfg),
        "--shards",
        *map(str, shards),
        "--vocab",
        str(results / "vocab" / "vocab.safetensors"),
        "--target",
        str(results / "target"),
        "--out",
        str(run / "draft"),
        "--metrics",
        str(run / "metrics.jsonl"),
        "--state",
        str(run / "state"),
        "--threads",
        str(threads),
        "--device",
        "cpu",
    ]
    t0 = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    with open(work / f"train-{name}.log", "w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    (run / "train_seconds.txt").write_text(f"{time.perf_counter() - t0:.1f}\n")
    return run


def metrics(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def heldout_tau(run: Path, results: Path, cfg: dict, threads: int) -> dict:
    from draftsmith.bench.specdec import prompt_ids, speculative_generate, stop_ids, summarize
    from draftsmith.config.settings import job
    from draftsmith.data.prompts import prompt_turns
    from draftsmith.engines.hf.engine import load_models
    from draftsmith.stages.bench import load_sets

    done = run / "tau.json"
    if done.exists():
        return json.loads(done.read_text())
    torch.set_num_threads(threads)
    model, tokenizer, draft = load_models(
        results / "target", run / "draft", cfg["target"]["dtype"], "cpu"
    )
    bench = cfg["bench"]
    only = {**cfg, "bench": {**bench, "humaneval_size": 0, "files": []}}
    rows = load_sets(job(only, ("bench",)))["heldout"]
    stops, aux_ids = stop_ids(model, tokenizer), list(draft.config.aux_layer_ids)
    traces = [
        speculative_generate(
            model,
            draft,
            prompt_ids(tokenizer, prompt_turns(row)),
            bench["max_new_tokens"],
            stops,
            bench["num_steps"],
            aux_ids,
        )
        for row in rows
    ]
    s = summarize(traces)
    out = {"tau": s["tau"], "accept_rate_by_pos": s["accept_rate_by_pos"], "prompts": len(rows)}
    tail = metrics(run)[-max(1, len(metrics(run)) // 10) :]
    out["train_acc_last10pct"] = [
        statistics.mean(r["acc_per_pos"][j] for r in tail)
        for j in range(len(tail[0]["acc_per_pos"]))
    ]
    out["steps"] = tail[-1]["step"]
    out["train_seconds"] = float((run / "train_seconds.txt").read_text())
    atomic_write_json(done, out)
    return out


def trained_identity(work: Path, results: Path, cfg: dict, threads: int) -> dict:
    """float8_e4m3+trained vs float8_e4m3: the first steps' losses, bit for bit."""
    tcfg = train_cfg(cfg, 1, 0, max_steps=5)
    a = metrics(run_train(work, results, "float8_e4m3", tcfg, "identity-float8_e4m3", threads))
    b = metrics(
        run_train(
            work, results, "float8_e4m3+trained", tcfg, "identity-float8_e4m3+trained", threads
        )
    )
    same = [x["loss"] for x in a] == [y["loss"] for y in b]
    return {"steps": len(a), "identical_losses": same, "losses": [x["loss"] for x in a]}


# ------------------------------------------------------------------------------------ report


def cached(path: Path, compute):
    """A figure computed once per --work directory (delete the file to measure it again)."""
    if path.exists():
        return json.loads(path.read_text())
    value = compute()
    atomic_write_json(path, value)
    return value


def read_all(work: Path, tokens: int) -> dict:
    """read.json (the first modes, measured together); a mode added later is measured with
    the reference in its own pass (read-<mode>.json, its reference figures beside it)."""
    out = cached(work / "read.json", lambda: read_throughput(work, tokens))
    for m in MODES:
        if m not in out:
            got = cached(
                work / f"read-{m}.json", lambda m=m: read_throughput(work, tokens, (m, "bfloat16"))
            )
            out = {**out, m: {**got[m], "reference_same_pass": got["bfloat16"]}}
    return out


def fidelity_all(work: Path, results: Path) -> dict:
    """fidelity.json (top-32 of the full vocabulary, fp8) plus, per later top-k mode,
    fidelity-<mode>.json."""
    out = cached(work / "fidelity.json", lambda: fidelity(work, results))
    out = {**out, "modes": {}}
    for m, st in MODES.items():
        if st.final == "topk" and st.draft_topk:
            out["modes"][m] = cached(
                work / f"fidelity-{m}.json", lambda m=m: topk_fidelity(work, results, m)
            )
    return out


def write_report(report: dict, out: Path, t_start: float) -> None:
    """storage.json and storage.md as they stand (rewritten after every trained run)."""
    report["load_end"] = round(os.getloadavg()[0], 1)
    report["seconds"] = round(time.perf_counter() - t_start)
    atomic_write_json(out / "storage.json", report)
    atomic_write_text(out / "storage.md", render(report))


def main(argv: list[str] | None = None) -> None:
    import yaml
    from snakemake.utils import validate

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--results", type=Path, default=ROOT / "results")
    ap.add_argument("--work", type=Path, default=ROOT / "benchmarks" / "work" / "storage")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument(
        "--only-cached",
        action="store_true",
        help="report the trained runs already under --work, start no new training",
    )
    args = ap.parse_args(argv)
    if not (args.results / "vocab" / "vocab.safetensors").exists():
        raise SystemExit(
            f"{args.results}: run `snakemake --cores 2 results/vocab/vocab.safetensors`"
        )
    cfg = yaml.safe_load((ROOT / "config.yaml").read_text())
    validate(
        cfg, str(ROOT / "draftsmith" / "config" / "config.schema.yaml")
    )  # fills the schema's defaults
    torch.set_num_threads(args.threads)
    load_start = round(os.getloadavg()[0], 1)
    t_start = time.perf_counter()

    cap = capture_all(args.results, args.work, cfg)
    sf = specforge_measured(args.work)
    report = {
        "epochs": args.epochs,
        "seeds": args.seeds,
        "threads": args.threads,
        "load_start": load_start,
        "shards": sorted(p.name for p in (args.results / "tokens").glob("rows_*.safetensors")),
        "capture": cap,
        "bytes": bytes_table(args.work, sf, cfg["capture"]["dtype"]),
        "read": read_all(args.work, cap["tokens"]),
        "fidelity": fidelity_all(args.work, args.results),
        "draft_vocab": cfg["draft"]["vocab_size"],
        "versions": versions(),
    }
    print(json.dumps(report["bytes"]["modes"], indent=1), flush=True)
    # the compact mode first, then the reference's other seeds, then the other modes; the
    # report is rewritten after every run, so a partial run still leaves its figures
    plan = [("bfloat16-seed0", "bfloat16", 0), ("float8_e4m3+topk32-seed0", TRAINED[0], 0)]
    plan += [(f"bfloat16-seed{s}", "bfloat16", s) for s in range(1, args.seeds)]
    plan += [(f"{DRAFT_TOPK}-seed{s}", DRAFT_TOPK, s) for s in range(args.seeds)]
    plan += [(f"{m}-seed0", m, 0) for m in TRAINED[1:] if m != DRAFT_TOPK]  # ablation last
    if args.only_cached:  # extra seeds of the modes, run by hand (same config, --seed)
        plan += [(f"{m}-seed{s}", m, s) for m in TRAINED for s in range(1, args.seeds)]
    report["runs"] = {}
    for name, mode, seed in plan:
        if args.only_cached and not (args.work / "runs" / name / "tau.json").exists():
            continue
        tcfg = train_cfg(cfg, args.epochs, seed)
        run = run_train(args.work, args.results, mode, tcfg, name, args.threads)
        report["runs"][name] = heldout_tau(run, args.results, cfg, args.threads)
        print(f"{name}: tau {report['runs'][name]['tau']:.3f}", flush=True)
        summarize_runs(report, args.seeds)
        write_report(report, args.out, t_start)
    ident = args.work / "runs" / "identity-float8_e4m3+trained" / "metrics.jsonl"
    if not args.only_cached or ident.exists():
        report["trained_identity"] = trained_identity(args.work, args.results, cfg, args.threads)
    write_report(report, args.out, t_start)
    print(render(report))


if __name__ == "__main__":
    main()
