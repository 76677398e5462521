"""Engine names stay in the engine's own files, so that adding an engine is its module, one
registry line and the schema's enums (docs/architecture.md, "Adding an engine").

The scan reads the code of the package (`draftsmith/**/*.py`), the rule files (`rules/*.smk`)
and the `Snakefile`: identifiers and string literals, not comments or docstrings. A token names
an engine when one of its words (split at `_`, `.`, `-`, spaces, ...) is an engine's name (the
keys of `draftsmith.engines.ENGINES`). It may do so only in:

- the engine's own files: its folder `draftsmith/engines/<name>/` (its engine module and
  helpers, e.g. SGLang's capture patch and CPU layer) and `rules/<name>.smk` (rules that build
  the engine's own inputs, e.g. the capture patch), and the Snakefile's
  `include: "rules/<name>.smk"`;
- the registry, `draftsmith/engines/__init__.py`, and its table below the engines,
  `draftsmith/config/engines.py` (backend name -> module);
- the places `ALLOWED` lists, each with its reason.

Not scanned, and free to name engines: the schema (`draftsmith/config/config.schema.yaml`, the backend enums and an
engine's settings section), the roles' pin files (`envs/`), `docs/`, `tests/`, `benchmarks/`,
`profiles/`.
"""

from __future__ import annotations

import io
import re
import shutil
import tokenize
from fnmatch import fnmatch
from pathlib import Path

import pytest

from draftsmith.engines import ENGINES

ROOT = Path(__file__).resolve().parents[1]

# path pattern (relative to the root) -> (engine names it may use, why)
ALLOWED = {
    "draftsmith/stages/env.py": (
        {"sglang"},
        "validate_env's self-check of the SGLang CPU layer for role sglang-cpu",
    ),
    "draftsmith/algorithms/eagle3/export.py": (
        {"sglang", "vllm"},
        "the EAGLE-3 export's two formats are the engines' checkpoint contracts",
    ),
    "draftsmith/algorithms/eagle3/contract.py": (
        {"sglang", "vllm"},
        "the checkpoint contract of SGLang's EAGLE-3 layer and vLLM's reading of it",
    ),
    "draftsmith/algorithms/eagle3/contract_mla.py": (
        {"sglang", "vllm"},
        "the checkpoint contract of both engines' MLA draft class (Eagle3DeepseekV2ForCausalLM)",
    ),
    "draftsmith/algorithms/dflash/export.py": (
        {"vllm"},
        "the DFlash export is the checkpoint contract of vLLM's DFlashDraftModel",
    ),
    "draftsmith/targets/tinymodel.py": (
        {"sglang", "vllm"},
        "--engine-shapes names the engines whose CPU MLA paths need those shapes",
    ),
    "draftsmith/targets/serving.py": (
        {"sglang", "vllm"},
        "which engine can serve which target, read from the engines' pinned wheels",
    ),
    "draftsmith/targets/layerids.py": (
        {"sglang", "vllm"},
        "the layer ids each engine feeds the draft, read from the engines' pinned wheels",
    ),
    "draftsmith/algorithms/*/__init__.py": (
        {"hf", "sglang", "vllm"},
        "an algorithm's spec says how each engine serves it, or why it cannot (its serving table)",
    ),
    "draftsmith/cli.py": (
        {"sglang"},
        "the command table lists the SGLang engine's own commands (its patch, its CPU self-check)",
    ),
    "draftsmith/config/settings.py": (
        {"sglang"},
        "the typed `sglang` section (SGLangSettings), typed with the others from the schema",
    ),
    "draftsmith/interop/*.py": (
        {"sglang", "vllm"},
        "the converters speak SpecForge's and speculators' formats, whose layer numberings "
        "are SGLang's and vLLM's",
    ),
    "draftsmith/hidden/shards.py": (
        {"sglang"},
        "the shard format's layer-id convention is named after SGLang's (docs/contracts/layer-ids.md)",
    ),
    "draftsmith/bench/gate.py": (
        {"sglang", "vllm"},
        "the gate's list of causes explains the engines' layer numbering",
    ),
    "draftsmith/runtime/files.py": (
        {"sglang"},
        "provenance records the installed sglang version among the packages",
    ),
    "draftsmith/algorithms/eagle3/model.py": (
        {"sglang"},
        "the draft's hidden_act is limited to what SGLang's draft layer implements",
    ),
    "draftsmith/algorithms/spec.py": (
        {"sglang"},
        "an export tensor's legacy name in SGLang's loader (FOREIGN)",
    ),
    "draftsmith/targets/model.py": (
        {"hf"},
        "Hugging Face model directories (check_hf_dir), not the hf engine",
    ),
}

# Report figures named after SGLang's way of counting (a rename would change the report)
FIGURE_NAMES = ("tau_sglang", "SGLang count")
# "HF" in capitals is Hugging Face ("the target HF dir", HF_HUB_OFFLINE), not the hf engine
HUGGING_FACE = "HF"


def scanned_files(root: Path) -> list[Path]:
    return [
        *sorted((root / "draftsmith").rglob("*.py")),
        *sorted((root / "rules").glob("*.smk")),
        root / "Snakefile",
    ]


def code_tokens(path: Path):
    """(line, text) of the identifiers and string literals of a Python or Snakemake file,
    without comments and docstrings (a string that is a statement of its own)."""
    toks = list(tokenize.generate_tokens(io.StringIO(path.read_text()).readline))
    skip = (tokenize.NL, tokenize.COMMENT)
    prev = tokenize.NEWLINE
    for i, t in enumerate(toks):
        if t.type == tokenize.STRING and prev in (
            tokenize.NEWLINE,
            tokenize.INDENT,
            tokenize.DEDENT,
        ):
            nxt = next((u for u in toks[i + 1 :] if u.type not in skip), None)
            if nxt is None or nxt.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                prev = t.type
                continue  # a docstring
        if t.type in (tokenize.NAME, tokenize.STRING):
            yield t.start[0], t.string
        if t.type not in skip:
            prev = t.type


def named_engines(text: str, engines) -> set[str]:
    for figure in FIGURE_NAMES:
        text = text.replace(figure, " ")
    words = {w for w in re.split(r"[^A-Za-z0-9]+", text) if w and w != HUGGING_FACE}
    return {e for e in engines if e in {w.lower() for w in words}}


def own_files(engine: str) -> tuple[str, ...]:
    return (f"draftsmith/engines/{engine}/*", f"rules/{engine}.smk")


def may_name(rel: str, engine: str, text: str) -> bool:
    if rel in ("draftsmith/engines/__init__.py", "draftsmith/config/engines.py"):
        return True
    if rel == "Snakefile" and text.strip("\"'") == f"rules/{engine}.smk":
        return True  # the include: line of the engine's rule file
    if any(fnmatch(rel, pattern) for pattern in own_files(engine)):
        return True
    return any(fnmatch(rel, pattern) and engine in names for pattern, (names, _) in ALLOWED.items())


def scan(root: Path, engines) -> tuple[list[str], set[tuple[str, str]]]:
    """(the places that name an engine where they may not, the (pattern, engine) pairs of
    ALLOWED that were used)."""
    bad, used = [], set()
    for path in scanned_files(root):
        rel = str(path.relative_to(root))
        for line, text in code_tokens(path):
            for engine in named_engines(text, engines):
                if not may_name(rel, engine, text):
                    bad.append(f"{rel}:{line}: {engine} in {text[:80]}")
                for pattern, (names, _) in ALLOWED.items():
                    if fnmatch(rel, pattern) and engine in names:
                        used.add((pattern, engine))
    return bad, used


@pytest.fixture(scope="module")
def repo_scan():
    return scan(ROOT, ENGINES)


def test_engine_names_stay_in_their_places(repo_scan):
    bad, _ = repo_scan
    assert not bad, (
        "engine names outside the engine's files (declare what the workflow needs in the "
        "engine's WORKFLOW, draftsmith.engines.NEEDS):\n" + "\n".join(bad)
    )


def test_every_allowance_is_still_used(repo_scan):
    """The allow-list is exact: an entry no file needs any more goes."""
    _, used = repo_scan
    listed = {(pattern, e) for pattern, (names, _) in ALLOWED.items() for e in names}
    assert listed - used == set()


def test_a_planted_engine_name_fails(tmp_path):
    """The scan finds a branch on an engine's name in a stage CLI and in the rules (a copy of
    the files it plants them in, the registry and the Snakefile)."""
    for rel in (
        "draftsmith/stages/capture.py",
        "draftsmith/engines/__init__.py",
        "rules/common.smk",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, tmp_path / rel)
    shutil.copy(ROOT / "Snakefile", tmp_path / "Snakefile")
    assert scan(tmp_path, ENGINES)[0] == []
    with open(tmp_path / "draftsmith" / "stages" / "capture.py", "a") as f:
        f.write('\n\ndef planted(cap):\n    """hf here is prose."""\n    return cap == "vllm"\n')
    with open(tmp_path / "rules" / "common.smk", "a") as f:
        f.write("\n\n# sglang in a comment is prose\ndef planted_tp():\n")
        f.write('    return config["sglang"]["tp_size"]\n')
    bad, _ = scan(tmp_path, ENGINES)
    assert len(bad) == 2, bad
    assert bad[0].startswith("draftsmith/stages/capture.py:") and ": vllm in " in bad[0]
    assert bad[1].startswith("rules/common.smk:") and ": sglang in " in bad[1]
