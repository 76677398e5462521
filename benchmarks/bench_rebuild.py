"""What a project built by one checkout needs when another checkout's workflow meets it: the jobs
that rerun and why, the time they take, and whether the draft comes out bit-identical.

    python benchmarks/bench_rebuild.py --before DIR --after DIR [--workdir DIR] [--tiny]

DIR: two checkouts of the repository (e.g. `git worktree add /tmp/before <commit>`).

1. Builds a project with the `--before` checkout's Snakefile (`--tiny`: a tiny random target
   made by the before checkout's `tiny-model` command and tests/wf.py's tiny config, smoke
   bench; else the embedded default).
2. Asks the `--after` checkout's Snakefile what it would rerun (`snakemake -n`, Snakemake's
   reasons counted), runs it, and asks again (nothing left is the check).
3. Builds a fresh project with the `--after` checkout alone.
4. Compares sha256 of results/draft/model.safetensors: before, after the rebuild, fresh after.

Writes benchmarks/results/<name>.{json,md} (--name, default rebuild_<kind>[_tiny]).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
TRIGGERS = ("--rerun-triggers", "mtime", "params", "input")  # all but code and software-env


def snakemake(checkout: Path, project: Path, *args: str) -> tuple[int, str, float]:
    cmd = [sys.executable, "-m", "snakemake", "-s", str(checkout / "Snakefile"),
           "--directory", str(project), "--configfile", str(project / "config.yaml"), *args]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=project)
    return proc.returncode, proc.stdout + proc.stderr, time.monotonic() - t0


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else None


def reasons(dry: str) -> dict:
    """rule -> Counter of Snakemake's reasons, from a dry run's output."""
    out: dict[str, Counter] = {}
    rule = None
    for line in dry.splitlines():
        m = re.match(r"^(?:local)?rule (\w+):", line.strip())
        if m:
            rule = m.group(1)
        elif rule and line.strip().startswith("reason:"):
            why = line.split(":", 1)[1].strip()
            why = "code changed" if why.startswith("Code has changed") else why.split(":")[0]
            out.setdefault(rule, Counter())[why] += 1
    return {r: dict(c) for r, c in out.items()}


def project_config(before: Path, work: Path, tiny: bool) -> dict:
    if not tiny:
        return {}
    target = work / "target"
    if not target.exists():
        cmd = [sys.executable, "-m", "draftsmith", "tiny-model", "--out", str(target)]
        if not (before / "draftsmith" / "cli.py").exists():  # a checkout before the one CLI
            old = ".".join(("draftsmith", "tinymodel"))  # its module then had a main of its own
            cmd = [sys.executable, "-m", old, "--out", str(target)]
        subprocess.run(cmd, cwd=before, check=True, capture_output=True)
    sys.path.insert(0, str(ROOT / "tests"))
    from wf import tiny_config

    return tiny_config(target, bench={"smoke": True})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before", type=Path, required=True)
    ap.add_argument("--after", type=Path, required=True)
    ap.add_argument("--workdir", type=Path, default=ROOT / "benchmarks" / "work" / "rebuild")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--name", default="")
    ap.add_argument(
        "--precision", choices=["auto", "bf16", "fp32"], default=None,
        help="train.precision for both checkouts (the one auto resolved to before, to compare "
        "code with code where auto itself changed)",
    )  # fmt: skip
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from draftsmith.runtime.hardware import cpu_facts

    kind = cpu_facts().kind
    work = args.workdir.resolve()
    work.mkdir(parents=True, exist_ok=True)
    cfg = project_config(args.before.resolve(), work, args.tiny)
    if args.precision:
        cfg.setdefault("train", {})["precision"] = args.precision
    runs = {}
    for name in ("built", "fresh"):
        (work / name).mkdir(exist_ok=True)
        (work / name / "config.yaml").write_text(yaml.safe_dump(cfg))
    draft = Path("results/draft/model.safetensors")
    rc, _, s = snakemake(args.before, work / "built", "--cores", "all")
    runs["before"] = {
        "rc": rc,
        "seconds": round(s, 1),
        "draft_sha256": sha256(work / "built" / draft),
    }
    rc, dry, _ = snakemake(args.after, work / "built", "-n", *TRIGGERS)
    runs["dry_run_after_without_code_trigger"] = {"rc": rc, "jobs": reasons(dry)}
    rc, dry, _ = snakemake(args.after, work / "built", "-n")
    runs["dry_run_after"] = {"rc": rc, "jobs": reasons(dry)}
    rc, _, s = snakemake(args.after, work / "built", "--cores", "all")
    runs["rebuild_after"] = {"rc": rc, "seconds": round(s, 1),
                             "draft_sha256": sha256(work / "built" / draft)}  # fmt: skip
    rc, dry, _ = snakemake(args.after, work / "built", "-n")
    runs["second_dry_run"] = {"rc": rc, "jobs": reasons(dry)}
    rc, _, s = snakemake(args.after, work / "fresh", "--cores", "all")
    runs["fresh_after"] = {
        "rc": rc,
        "seconds": round(s, 1),
        "draft_sha256": sha256(work / "fresh" / draft),
    }
    shas = {runs[k]["draft_sha256"] for k in ("before", "rebuild_after", "fresh_after")}
    result = {"kind": kind, "tiny": args.tiny, "identical": len(shas) == 1 and None not in shas,
              "before": str(args.before), "after": str(args.after), **runs}  # fmt: skip
    name = args.name or f"rebuild_{kind}{'_tiny' if args.tiny else ''}"
    name += f"_{args.precision}" if args.precision else ""
    out = ROOT / "benchmarks" / "results"
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    flags = (" --tiny" if args.tiny else "") + (
        f" --precision {args.precision}" if args.precision else ""
    )
    lines = [f"# A built project meets another checkout ({kind}{', tiny project' if args.tiny else ''})",
             "", f"`python benchmarks/bench_rebuild.py --before {args.before} --after {args.after}"
             f"{flags}`", "",
             "| step | exit | seconds | draft sha256 |", "|---|---:|---:|---|"]  # fmt: skip
    for key in ("before", "rebuild_after", "fresh_after"):
        r = runs[key]
        lines.append(f"| {key} | {r['rc']} | {r['seconds']} | `{r['draft_sha256']}` |")
    lines += ["", f"Draft bit-identical in all three: **{result['identical']}**.", "",
              "Jobs the after checkout reruns on the built project (rule: reason x jobs):", ""]  # fmt: skip
    for rule, why in sorted(runs["dry_run_after"]["jobs"].items()):
        lines.append(f"- {rule}: " + ", ".join(f"{w} x{n}" for w, n in why.items()))
    skip = runs["dry_run_after_without_code_trigger"]["jobs"]
    n_skip = sum(sum(v.values()) for v in skip.values())
    lines += ["", f"With `{' '.join(TRIGGERS)}` the after checkout finds {n_skip} jobs to run."]
    left = runs["second_dry_run"]["jobs"]
    lines += ["", f"After that one rebuild, a dry run finds {sum(sum(v.values()) for v in left.values())} "
              "jobs to run." if left else "After that one rebuild, a dry run finds nothing to do."]  # fmt: skip
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
