"""Every test left out of CI (`extended`) says why no CI-sized version of it exists.

.ci/run leaves out tests marked `extended`; each such mark must be written
`pytest.mark.extended(reason="...")`, the reason naming what only that test shows and what
keeps it out of CI's budget. A bare `pytest.mark.extended` is refused here, and so is a reason
too short to say anything.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MIN_REASON = 60  # characters: what only this test shows, and what it costs


def is_extended(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr == "extended"
        and isinstance(node.value, ast.Attribute)
        and node.value.attr == "mark"
    )


def extended_marks(tree: ast.AST):
    """(line, reason or None) for every `*.mark.extended` in `tree`."""
    called = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and is_extended(node.func):
            called.add(id(node.func))
            reason = next((k.value for k in node.keywords if k.arg == "reason"), None)
            text = reason.value if isinstance(reason, ast.Constant) else None
            yield node.lineno, text if isinstance(text, str) else None
    for node in ast.walk(tree):
        if is_extended(node) and id(node) not in called:
            yield node.lineno, None


def bad_marks(source: str, name: str) -> list[str]:
    out = []
    for line, reason in extended_marks(ast.parse(source)):
        if reason is None or len(reason.strip()) < MIN_REASON:
            out.append(f"{name}:{line}: extended without a reason of {MIN_REASON}+ characters")
    return out


def test_every_extended_mark_carries_its_reason():
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        bad += bad_marks(path.read_text(), path.name)
    assert not bad, "\n".join(bad)


def test_the_check_catches_a_bare_mark_and_a_short_reason():
    bare = "import pytest\n@pytest.mark.extended\ndef test_x():\n    pass\n"
    short = 'import pytest\npytestmark = [pytest.mark.extended(reason="slow")]\n'
    good = "import pytest\npytestmark = [pytest.mark.extended(reason=" + repr("x" * 80) + ")]\n"
    assert bad_marks(bare, "bare.py") and bad_marks(short, "short.py")
    assert bad_marks(good, "good.py") == []
