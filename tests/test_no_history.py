"""The repository speaks of the product: no file tells who measured what in which work period
(session numbers, the team's other runs sharing the machine). Figures carry their command and
machine kind instead."""

from __future__ import annotations

import re
import subprocess

from wf import ROOT

HISTORY = re.compile(
    r"\bsession \d+|\(session\b|\bthis session\b|\blast session\b|other engineers|"
    r"helpers' (?:test )?runs|\bstop \d+\b|"
    # the project's own work items (an upstream project's issue, 5 digits and named, is a source)
    r"\bissues? \d{1,3}\b|"
    # a calendar date (a log line's timestamp, date then time, is data, not history)
    r"\b20\d\d-\d\d-\d\d\b(?![ T]\d\d:)",
    re.I,
)
# the pages a user reads are reference, not a lab notebook: no account of passes and attempts
NOTEBOOK = re.compile(
    r"\b(?:first|second|third|fourth) pass \(|\bas it then was\b|\bat the time\b|"
    r"\bearlier reports?\b|\blast run here\b|\b(?:measured|verified) here\b|"
    r"\bon this (?:project's )?machine\b|\bwe (?:tried|chose|measured|ran)\b",
    re.I,
)
TEXT = (".md", ".py", ".smk", ".yaml", ".yml", ".txt", ".toml", ".rst", ".sh", ".json")


def tracked_text_files() -> list[str]:
    files = subprocess.run(
        ["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True
    ).stdout.split()
    return [f for f in files if f.endswith(TEXT) or f in ("Snakefile", ".ci/run")]


def history_lines(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if HISTORY.search(line)]


def test_no_file_tells_the_history_of_its_making():
    this = "tests/test_no_history.py"
    bad = [
        f"{f}:{n}"
        for f in tracked_text_files()
        if f != this and (ROOT / f).is_file()
        for n in history_lines((ROOT / f).read_text(errors="replace"))
    ]
    assert not bad, (
        "history of the making (say what the figure is, its command and CPU kind):\n"
        + ("\n".join(bad))
    )


def test_docs_are_reference_not_a_lab_notebook():
    pages = [
        f for f in tracked_text_files() if f.endswith(".md") and f.startswith(("docs/", "README"))
    ]
    bad = [
        f"{f}:{n}"
        for f in pages
        if (ROOT / f).is_file()
        for n, line in enumerate((ROOT / f).read_text().splitlines(), 1)
        if NOTEBOOK.search(line)
    ]
    assert not bad, "an account of attempts (say what is, cite benchmarks/results/):\n" + "\n".join(
        bad
    )


def test_the_check_sees_a_session_note():
    assert history_lines("ok\nmeasured in session 9 on the shared machine\n") == [2]
    assert history_lines("two other engineers' runs") == [1]
    assert history_lines("Wrapped targets (issue 26): ...\nvllm-project/vllm issue 55005") == [1]
    assert history_lines("a session of SGLang's server; the session's key") == []
    assert history_lines("Measured on 2026-12-02.\n2026-12-02 10:47:12,067 INFO ok") == [1]
    assert NOTEBOOK.search("Second pass (issue 14): data per CPU minute")
    assert NOTEBOOK.search("the default at the time") and NOTEBOOK.search("Measured here (tiny)")
    assert not NOTEBOOK.search("a verification pass (K + 1 tokens)")
