"""The repository speaks of the product: no file tells who measured what in which work period
(session numbers, the team's other runs sharing the machine). Figures carry their command and
machine kind instead."""

from __future__ import annotations

import re
import subprocess

from wf import ROOT

HISTORY = re.compile(
    r"\bsession \d+|\(session\b|\bthis session\b|\blast session\b|other engineers|"
    r"helpers' (?:test )?runs|\bstop \d+\b",
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


def test_the_check_sees_a_session_note():
    assert history_lines("ok\nmeasured in session 9 on the shared machine\n") == [2]
    assert history_lines("two other engineers' runs") == [1]
    assert history_lines("a session of SGLang's server; the session's key") == []
