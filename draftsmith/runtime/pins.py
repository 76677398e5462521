"""Pin files (`envs/<role>.txt`): exact `name==version` lines and `# draftsmith: <word>`
directives, read without pip; the environment checks and the SGLang patch read them here, and
the key of a check or a cached venv is taken from their text (`stamp_key`)."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

DIRECTIVE_RE = re.compile(r"^#\s*draftsmith:\s*(\S+)\s*$")
DIRECTIVES = ("no-deps",)
PIN_RE = re.compile(r"^([A-Za-z0-9_.\-]+)(\[[^\]]*\])?==([^\s;#]+)")


class EnvError(RuntimeError):
    pass


def read_pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a pin file; anything else (but comments) is an error."""
    pins = {}
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("--"):
            continue
        m = PIN_RE.match(line)
        if not m:
            raise EnvError(f"{path}:{n}: {line!r} is not an exact pin (name==version)")
        pins[canonical(m.group(1))] = m.group(3)
    return pins


def read_directives(path: Path) -> set[str]:
    """The `# draftsmith: <word>` lines of a pin file; an unknown word is an error."""
    found = set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        m = DIRECTIVE_RE.match(line.strip())
        if m:
            if m.group(1) not in DIRECTIVES:
                raise EnvError(
                    f"{path}:{n}: unknown directive {m.group(1)!r} (known: {', '.join(DIRECTIVES)})"
                )
            found.add(m.group(1))
    return found


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def same_version(installed: str, pinned: str) -> bool:
    """Equal up to the local label (torch 2.13.0+cpu satisfies ==2.13.0, as pip decides)."""
    return installed == pinned or installed.split("+", 1)[0] == pinned


def stamp_key(pins_text: str, python: str, gpus: int) -> str:
    """What a role's check depends on (pin file text, interpreter, GPUs), as 12 hex digits.

    validate_env writes `results/env/<role>/<key>.json`; rule env_stamp copies it to
    `results/env/<role>.json`, the input of every job of the role. A failed check (a wrong
    interpreter) fails under another key, so the published stamp is never deleted by it, and
    putting the config back plans nothing at all (docs/troubleshooting.md)."""
    text = json.dumps([pins_text, python, int(gpus)])
    return hashlib.sha256(text.encode()).hexdigest()[:12]
