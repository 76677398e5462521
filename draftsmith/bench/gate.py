"""The benchmark's sanity gate: a tau under bench.tau_floor, or exactly 1.0, is an error.

tau == 1.0 means no proposal was ever accepted: speculation is not working, whatever the floor
(`tau_floor: 0` still refuses it). The bench rule fails with the likely causes and writes
nothing, unless `bench.smoke` is true (a smoke test on a random or tiny target): then the
verdict is recorded in report.json ("gate") and stated in the first line of report.md and
summary.html, and the job succeeds.
"""

from __future__ import annotations

import math

GATE_CAUSES = """\
Likely causes, most common first:
  - an untrained or random-weight target, or a draft trained for a few steps only (a smoke
    test): nothing to learn, so nothing is accepted. That is expected; to get the report of a
    smoke run anyway, set bench.smoke: true (docs/own-model.md). Keep the gate for real drafts;
  - layer ids: the aux states the draft was trained on are not the ones captured here
    (eagle_config.eagle_aux_hidden_state_layer_ids vs the capture manifests; SGLang "output of
    layer i" = transformers output_hidden_states[i + 1]; vLLM numbers the same states one higher);
  - wrong algorithm or feature path: the draft is fed something other than fc(concat of the 3 aux
    states) at step 0 (with SGLang: --speculative-algorithm EAGLE instead of EAGLE3 skips the fc);
  - vocab mapping: d2t is wrong or was recomputed on other data (draft id i -> target id
    d2t[i] + i), or the draft lm_head rows belong to another vocabulary;
  - a draft trained on another target (check the target fingerprint in the draft's export) or
    not trained at all (results/train/metrics.jsonl: does the loss fall?);
  - a chat template mismatch between training data and benchmark prompts."""


class GateError(SystemExit):
    """The benchmark ran but its figures say speculation is not working."""


def check_gate(results: dict[str, dict], floor: float) -> dict:
    """{"passed", "floor", "failed": {set: tau}, "message"}: the gate's verdict, raising nothing."""
    bad = {
        name: r["tau"]
        for name, r in results.items()
        if math.isnan(r["tau"]) or r["tau"] < floor or r["tau"] == 1.0
    }
    figures = ", ".join(f"{name}: tau {tau:.3f}" for name, tau in bad.items())
    message = (
        f"sanity gate failed ({figures}; bench.tau_floor = {floor}). A tau this close to "
        f"1.0 means the draft's proposals are almost never accepted, so speculation is not "
        f"really active; this is an error, not a benchmark result.\n{GATE_CAUSES}"
        if bad
        else ""
    )
    return {"passed": not bad, "floor": floor, "failed": bad, "message": message}


def gate(results: dict[str, dict], floor: float) -> None:
    """Raise GateError when any set's tau is under the floor or exactly 1.0."""
    verdict = check_gate(results, floor)
    if not verdict["passed"]:
        raise GateError(verdict["message"])


def gate_line(report: dict) -> str:
    """The report's first words on a smoke run whose gate failed ('' otherwise)."""
    g = report.get("gate") or {}
    if g.get("passed", True):
        return ""
    figures = ", ".join(f"{name}: tau {tau:.3f}" for name, tau in g["failed"].items())
    return (
        f"SMOKE RUN (bench.smoke: true): the sanity gate failed ({figures}; tau_floor "
        f"{g['floor']}) and was not enforced. These figures do not describe a usable draft."
    )
