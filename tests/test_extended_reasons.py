"""Every test left out of CI (`extended`) says what only it proves and why no CI-sized version
of it exists, and names the CI tests that prove the rest.

.ci/run leaves out tests marked `extended`; each such mark must be written
`pytest.mark.extended(reason="...")` with a reason of three parts, in this order:

    proves: <what only this test proves>;
    no CI-sized version: <why it cannot be made to fit CI's budget>;
    CI covers the rest: <the CI tests, `test_x.py` or `test_x.py::test_name`, that prove what
    is left, or "none: <why none can>">

A bare `pytest.mark.extended`, a reason without the parts, a part too short to say anything, or
a cited CI test that does not exist or that no .ci/run step runs (missing, or itself extended)
is refused here. Where an extended test proves something a CI-sized test could, the CI-sized
test belongs in CI where the budget allows: test_vllm.py's sampling counters test is such.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parent
MIN_PART = 25  # characters: a part shorter than this says nothing
REASON = re.compile(
    r"^proves: (?P<proves>.+?); no CI-sized version: (?P<why>.+?); "
    r"CI covers the rest: (?P<ci>.+)$",
    re.S,
)
CITED = re.compile(r"\b(test_\w+\.py)(?:::(\w+))?")
NONE = re.compile(rf"^none: .{{{MIN_PART},}}", re.S)


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


def ci_problems(ci: str, tests: Path) -> list[str]:
    """What is wrong with a reason's "CI covers the rest" part: each cited test exists and a
    .ci/run step selects it (test_docs' reading of .ci/run's marker expressions, `extended`
    left out); a part citing none must say "none: " and why."""
    from test_docs import case_marks, ci_marker_expressions, selected

    cited = CITED.findall(ci)
    if not cited:
        return [] if NONE.match(ci.strip()) else [f"names no CI test and no 'none: <why>': {ci!r}"]
    exprs, bad = ci_marker_expressions(), []
    for file, func in cited:
        path = tests / file
        if not path.is_file():
            bad.append(f"cites {file}, which does not exist")
            continue
        marks = case_marks(path)
        if func and func not in marks:
            bad.append(f"cites {file}::{func}, which does not exist")
            continue
        cases = [c for f, cs in marks.items() if not func or f == func for c in cs]
        if not any(selected(e, c) for e in exprs for c in cases):
            bad.append(
                f"cites {file}{'::' + func if func else ''} as CI's, which no .ci/run step runs"
            )
    return bad


def reason_problems(reason: str | None, tests: Path = TESTS) -> list[str]:
    if reason is None:
        return ["extended without a reason"]
    m = REASON.match(" ".join(reason.split()))
    if not m:
        return [
            "the reason is not 'proves: ...; no CI-sized version: ...; CI covers the rest: ...'"
        ]
    bad = [
        f"its '{label}' part is under {MIN_PART} characters"
        for label, part in (("proves", m["proves"]), ("no CI-sized version", m["why"]))
        if len(part.strip()) < MIN_PART
    ]
    return bad + ci_problems(m["ci"], tests)


def bad_marks(source: str, name: str, tests: Path = TESTS) -> list[str]:
    return [
        f"{name}:{line}: {problem}"
        for line, reason in extended_marks(ast.parse(source))
        for problem in reason_problems(reason, tests)
    ]


def test_every_extended_mark_carries_its_reason():
    bad = []
    for path in sorted(TESTS.glob("*.py")):
        bad += bad_marks(path.read_text(), path.name)
    assert not bad, "\n".join(bad)


def marked(reason: str) -> str:
    return f"import pytest\npytestmark = [pytest.mark.extended(reason={reason!r})]\n"


def test_the_check_catches_a_bare_mark_and_a_reason_without_its_parts():
    proves = "proves: a killed server relaunched mid-range, its rows equal to hf's"
    why = "no CI-sized version: two server start-ups, about 6 minutes on 2 cores"
    ci = "CI covers the rest: test_sglang_capture.py (a torn dump retried)"
    bare = "import pytest\n@pytest.mark.extended\ndef test_x():\n    pass\n"
    planted = [
        bare,
        marked("slow"),
        marked("x" * 80),  # long, but says nothing in the form asked
        # the old form: what it shows and its cost, in prose
        marked("sampled decoding through SGLang's CPU server, about 5 minutes on 2 cores"),
        marked(f"{proves}; {ci}"),  # no why
        marked(f"{why}; {ci}"),  # no proves
        marked(f"{proves}; {why}"),  # no CI part
        marked(f"proves: it works; {why}; {ci}"),  # a part that says nothing
        marked(f"{proves}; {why}; CI covers the rest: the matrix"),  # names no test
        marked(f"{proves}; {why}; CI covers the rest: test_no_such_file.py"),
        marked(f"{proves}; {why}; CI covers the rest: test_vllm.py::test_no_such_test"),
        # an extended test is not CI's
        marked(f"{proves}; {why}; CI covers the rest: test_sglang.py"),
        marked(
            f"{proves}; {why}; CI covers the rest: test_vllm.py::test_vllm_sampling_matches_ours"
        ),
    ]
    for source in planted:
        assert bad_marks(source, "planted.py"), source
    good = [
        marked(f"{proves}; {why}; {ci}"),
        marked(
            f"{proves}; {why}; CI covers the rest: test_vllm.py::test_vllm_sampling_counters_consistent"
        ),
        marked(f"{proves}; {why}; CI covers the rest: none: no CI machine has the CPU it pins"),
    ]
    for source in good:
        assert bad_marks(source, "good.py") == [], source
