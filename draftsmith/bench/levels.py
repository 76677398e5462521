"""The report's concurrency section: one row per `bench.concurrency` level and the plot of
throughput and tau against concurrency (docs/report.md, "Concurrency").

A server engine run at several levels leaves `by_concurrency` in each set's figures
(`draftsmith.bench.figures.concurrency_figures`); this module renders them for report.md and
summary.html, and says where acceptance or outputs moved with the batch (greedy: both must
equal the first level's) and what the engine itself reported about its sampling. Pure but for
the plot, which is drawn into PNG bytes (summary.html embeds it; report.md has the table).
"""

from __future__ import annotations

HEAD = (
    "set",
    "concurrency",
    "tau",
    "tau change",
    "accept rate by position",
    "tok/s spec",
    "tok/s plain",
    "speedup",
    "ms/token spec (median / p90)",
    "ms/token plain (median / p90)",
    "spec = plain greedy",
    "plain = first level's",
)


def has_levels(report: dict) -> bool:
    """Whether any set was measured at more than one concurrency level."""
    return any(len(r.get("by_concurrency") or []) > 1 for r in report["sets"].values())


def _ms(t: dict) -> str:
    return f"{1000 * t['median']:.1f} / {1000 * t['p90']:.1f}"


def _count(value, total) -> str:
    return "n/a (sampled)" if value is None else f"{value}/{total}"


def rows(report: dict) -> list[list[str]]:
    """The concurrency table, one row per set and level."""
    out = []
    for name, r in report["sets"].items():
        for lv in r.get("by_concurrency") or []:
            rates = " / ".join("n/a" if v is None else f"{v:.2f}" for v in lv["accept_rate_by_pos"])
            out.append(
                [
                    name,
                    str(lv["concurrency"]),
                    f"{lv['tau']:.3f}",
                    f"{lv['tau_change']:+.3f}",
                    rates,
                    f"{lv['spec_tokens_per_s']:.1f}",
                    f"{lv['baseline_tokens_per_s']:.1f}",
                    f"{lv['speedup']:.2f}x",
                    _ms(lv["spec_tpot"]),
                    _ms(lv["baseline_tpot"]),
                    _count(lv["identical_to_plain"], lv["prompts"]),
                    _count(lv["plain_identical_to_first"], lv["prompts"]),
                ]
            )
    return out


def findings(report: dict) -> list[str]:
    """Sentences for the report: levels whose acceptance or outputs moved with the batch, and
    the engine's own notes (e.g. sampling it does not do as configured)."""
    out = list(report.get("engine_notes") or [])
    for name, r in report["sets"].items():
        levels = r.get("by_concurrency") or []
        if len(levels) < 2:
            continue
        first = levels[0]
        broken = [lv for lv in levels if lv["batch_invariant"] is False]
        if not broken and levels[0]["batch_invariant"] is not None:
            out.append(
                f"{name}: acceptance does not depend on batching: at every level the outputs "
                f"equal plain greedy decoding at concurrency {first['concurrency']} and the "
                f"verification passes are within 1% of its {first['verify_passes']}."
            )
        for lv in broken:
            out.append(
                f"{name} at concurrency {lv['concurrency']}: acceptance moved with the batch: "
                f"tau {lv['tau']:.3f} against {first['tau']:.3f} at concurrency "
                f"{first['concurrency']}, {lv['verify_passes']} passes against "
                f"{first['verify_passes']}; outputs differing from plain greedy: "
                f"{lv['differing'][:4]}."
            )
    return out


def markdown(report: dict) -> list[str]:
    """report.md's concurrency section (no lines when there is a single level)."""
    if not has_levels(report):
        return []
    lines = ["## Concurrency", "", "| " + " | ".join(HEAD) + " |", "|" + "---|" * len(HEAD)]
    lines += ["| " + " | ".join(row) + " |" for row in rows(report)]
    lines += ["", *(f"- {f}" for f in findings(report)), ""]
    lines += ["The plot of throughput and tau against concurrency is in summary.html.", ""]
    return lines


def html(report: dict, png: bytes | None) -> str:
    """summary.html's concurrency section, the plot embedded ('' with a single level)."""
    import base64
    import html as h

    if not has_levels(report):
        return ""
    head = "".join(f"<th>{h.escape(c)}</th>" for c in HEAD)
    body = "".join(
        "<tr>" + "".join(f"<td>{h.escape(c)}</td>" for c in row) + "</tr>" for row in rows(report)
    )
    items = "".join(f"<li>{h.escape(f)}</li>" for f in findings(report))
    img = ""
    if png:
        data = base64.b64encode(png).decode()
        img = (
            '<p><img alt="concurrency" style="max-width:100%" '
            f'src="data:image/png;base64,{data}"></p>'
        )
    return f"<h2>Concurrency</h2><table><tr>{head}</tr>{body}</table><ul>{items}</ul>{img}"


def plot(report: dict) -> bytes:
    """Throughput (speculative and plain tokens/s) and tau against concurrency, per set."""
    import io

    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name, r in report["sets"].items():
        levels = r.get("by_concurrency") or []
        xs = [lv["concurrency"] for lv in levels]
        line = ax1.plot(xs, [lv["spec_tokens_per_s"] for lv in levels], "o-", label=f"{name} spec")
        ax1.plot(
            xs,
            [lv["baseline_tokens_per_s"] for lv in levels],
            "s--",
            color=line[0].get_color(),
            label=f"{name} plain",
        )
        ax2.plot(xs, [lv["tau"] for lv in levels], "o-", label=name)
    ticks = sorted(
        {lv["concurrency"] for r in report["sets"].values() for lv in r["by_concurrency"]}
    )
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks, [str(t) for t in ticks])
        ax.set_xlabel("requests in flight")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    ax1.set_ylabel("output tokens/s (all requests)")
    ax1.set_title("Throughput against concurrency")
    ax2.set_ylabel("tau (tokens per verification pass)")
    ax2.set_title("Acceptance against concurrency")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()
