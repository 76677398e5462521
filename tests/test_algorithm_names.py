"""Algorithm names stay in the algorithm's own folder, so that adding an algorithm is its folder,
one registry line and the schema's enum (docs/architecture.md, "Adding a draft algorithm").

The scan reads the code of the package, the rule files and the Snakefile, as
tests/test_engine_names.py does (identifiers and string literals, not comments or docstrings).
A word names an algorithm when it starts with an algorithm's stem (`eagle3`: EAGLE-3 and
EAGLE-3.1, `Eagle3Draft`, `EAGLE3`; `dflash`: `DFlashDraft`, `dflash_config`). It may do so only
in the algorithm's own folders (`draftsmith/algorithms/<folder>/`, the registry's modules) and in
the places ALLOWED lists, each with its reason.
"""

from __future__ import annotations

import re
import shutil
from fnmatch import fnmatch
from pathlib import Path

import pytest
from test_engine_names import code_tokens, scanned_files

from draftsmith import algorithms

ROOT = Path(__file__).resolve().parents[1]


def stems_of_registry() -> dict[str, tuple[str, ...]]:
    """A word's stem -> the folders of the algorithms it names, from the registry: a name's
    stem is its first alphanumeric run ("eagle3.1" -> "eagle3"), its folder the last part of
    its module (draftsmith.algorithms.eagle31 -> "eagle31")."""
    out: dict[str, tuple[str, ...]] = {}
    for name, module in algorithms.MODULES.items():
        stem = re.split(r"[^A-Za-z0-9]+", name)[0].lower()
        out[stem] = (*out.get(stem, ()), module.rpartition(".")[2])
    return out


STEMS = stems_of_registry()

ALLOWED = {
    "draftsmith/algorithms/__init__.py": (
        {"eagle3", "dflash"},
        "the registry: each name's folder, and the keys that tell an export written before it "
        "recorded its algorithm",
    ),
    "draftsmith/engines/sglang/capture.py": (
        {"eagle3"},
        "SGLang captures aux states through its EAGLE3 mode, whatever the draft's algorithm",
    ),
    "draftsmith/engines/sglang/engine.py": (
        {"eagle3"},
        "the report's server keys and log name, kept so reports compare across versions",
    ),
    "draftsmith/engines/sglang/cpu/*": (
        {"eagle3"},
        "SGLang's own module and class names the CPU layer patches",
    ),
    "draftsmith/targets/serving.py": (
        {"eagle3"},
        "SGLang's and vLLM's interface names, read from their pinned wheels",
    ),
    "draftsmith/config/settings.py": (
        {"dflash"},
        "the schema's dflash section, typed with the others",
    ),
    "draftsmith/bench/gate.py": (
        {"eagle3"},
        "the sanity gate's causes name SGLang's EAGLE modes (EAGLE vs EAGLE3)",
    ),
}


def stems(text: str) -> set[str]:
    words = re.split(r"[^A-Za-z0-9]+", text)
    return {s for w in words for s in STEMS if w.lower().startswith(s)}


def scan(root: Path) -> tuple[list[str], set[tuple[str, str]]]:
    bad, used = [], set()
    for path in scanned_files(root):
        rel = str(path.relative_to(root))
        for line, text in code_tokens(path):
            for stem in stems(text):
                if any(rel.startswith(f"draftsmith/algorithms/{f}/") for f in STEMS[stem]):
                    continue
                allowed = [p for p, (s, _) in ALLOWED.items() if fnmatch(rel, p) and stem in s]
                used.update((p, stem) for p in allowed)
                if not allowed:
                    bad.append(f"{rel}:{line}: {stem} in {text[:80]}")
    return bad, used


@pytest.fixture(scope="module")
def repo_scan():
    return scan(ROOT)


def test_algorithm_names_stay_in_their_folders(repo_scan):
    bad, _ = repo_scan
    assert not bad, (
        "algorithm names outside the algorithm's folder (ask its spec, draftsmith.algorithms."
        "spec, instead):\n" + "\n".join(bad)
    )


def test_the_stems_are_the_registrys():
    assert STEMS == {"eagle3": ("eagle3", "eagle31"), "dflash": ("dflash",)}


def test_every_allowance_is_still_used(repo_scan):
    _, used = repo_scan
    listed = {(p, s) for p, (stems_, _) in ALLOWED.items() for s in stems_}
    assert listed - used == set()


def test_a_planted_algorithm_name_fails(tmp_path):
    for rel in ("draftsmith/train/loop.py", "rules/common.smk"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    shutil.copy(ROOT / "Snakefile", tmp_path / "Snakefile")
    (tmp_path / "rules" / "train.smk").write_text("")
    assert scan(tmp_path)[0] == []
    with open(tmp_path / "draftsmith" / "train" / "loop.py", "a") as f:
        f.write('\n\ndef planted(job):\n    """dflash here is prose."""\n')
        f.write('    return job.draft.algorithm == "dflash"\n')
    bad, _ = scan(tmp_path)
    assert len(bad) == 1 and bad[0].startswith("draftsmith/train/loop.py:") and "dflash" in bad[0]
