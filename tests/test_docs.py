"""docs/ stand alone and agree with the defaults a run gets."""

from __future__ import annotations

import re

import yaml
from wf import ROOT, with_defaults

from draftsmith.config import row_ranges
from draftsmith.prompts import load_sources

PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]


def test_docs_do_not_point_outside_the_repository():
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            if re.search(r"\.\./shared|shared/reference|DESIGN\.md|the DESIGN\b", line):
                bad.append(f"{page.name}:{n}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_contracts_page_covers_every_contract():
    text = (ROOT / "docs" / "contracts.md").read_text()
    for heading in (
        "Layer ids",
        "Final hidden state",
        "Shard file",
        "Loss mask",
        "Draft vocabulary",
        "Draft checkpoint",
        "Training",
        "Acceptance",
    ):
        assert re.search(rf"^## {heading}", text, flags=re.M), heading


def test_example_range_names_exist_in_the_default_config():
    cfg = with_defaults({})
    ranges = set(row_ranges(len(load_sources(cfg).train), cfg["data"]["rows_per_shard"]))
    bad = []
    for page in PAGES:
        for n, line in enumerate(page.read_text().splitlines(), start=1):
            if "snakemake" not in line and "--tokens" not in line and "--out" not in line:
                continue
            if re.search(r"refus|error|not a|invalid|fail|another", line, flags=re.I):
                continue  # an example of a name that is rejected
            for name in re.findall(r"rows_\d{6}-\d{6}", line):
                if name not in ranges:
                    bad.append(f"{page.name}:{n}: {name}")
    assert not bad, f"not ranges of the default config {sorted(ranges)}:\n" + "\n".join(bad)


def test_defaults_quoted_in_the_docs_are_the_schemas():
    """A sentence that says "default" and quotes `section.key: value` (or `key: value` for a
    key name only one section has) must quote the schema's default."""
    cfg = with_defaults({})
    owners: dict[str, list[str]] = {}
    for section, keys in cfg.items():
        for name in keys if isinstance(keys, dict) else ():
            owners.setdefault(name, []).append(section)
    bad = []
    for page in PAGES:
        if page.name == "config.md":
            continue  # generated from the schema itself
        # prose only: code blocks are commands, not statements about defaults
        prose = re.sub(r"```.*?```", " ", page.read_text(), flags=re.S)
        text = " ".join(prose.split())
        for n, line in enumerate(re.split(r"(?<=[.;:!?])\s+(?=[A-Z(])", text), start=1):
            # "the embedded default" names the shipped config, not a key's default value
            if "default" not in line.lower().replace("embedded default", ""):
                continue
            for key, value in re.findall(r"`([a-z_]+(?:\.[a-z_]+)?): ([^`]+)`", line):
                section, _, name = key.rpartition(".")
                if not section:
                    if len(owners.get(name, [])) != 1:
                        continue
                    section = owners[name][0]
                if section in cfg and name in cfg[section] and not value.startswith(("[", "{")):
                    if yaml.safe_load(value) != cfg[section][name]:
                        want = cfg[section][name]
                        bad.append(f"{page.name} sentence {n}: {key}: {value} (default {want})")
    assert not bad, "\n".join(bad)
