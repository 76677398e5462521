"""Row ranges and config-derived values shared by the Snakefile and the package.

Pure standard library: imported by the Snakefile at DAG-build time.
"""

from __future__ import annotations

import re

RANGE_RE = re.compile(r"^rows_(\d{6})-(\d{6})$")


def range_name(a: int, b: int) -> str:
    return f"rows_{a:06d}-{b:06d}"


def row_ranges(n_rows: int, rows_per_shard: int) -> list[str]:
    """Half-open, zero-padded ranges covering [0, n_rows)."""
    if rows_per_shard < 1:
        raise ValueError(f"data.rows_per_shard must be >= 1, got {rows_per_shard}")
    return [
        range_name(a, min(a + rows_per_shard, n_rows)) for a in range(0, n_rows, rows_per_shard)
    ]


def parse_range(name: str) -> tuple[int, int]:
    m = RANGE_RE.match(name)
    if not m:
        raise ValueError(f"not a row range name: {name!r} (expected rows_AAAAAA-BBBBBB)")
    a, b = int(m.group(1)), int(m.group(2))
    if b <= a:
        raise ValueError(f"empty or reversed row range: {name!r}")
    return a, b


def aux_layer_ids(setting, num_layers: int) -> list[int]:
    """SGLang's "output of layer i" ids; `auto` is SGLang's default [1, N//2-1, N-4]."""
    if setting == "auto":
        ids = [1, num_layers // 2 - 1, num_layers - 4]
    else:
        ids = [int(i) for i in setting]
    bad = [i for i in ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(
            f"capture.aux_layer_ids {ids}: ids {bad} are outside [0, {num_layers}) "
            f"for a target with {num_layers} layers"
        )
    if len(ids) != 3:
        raise ValueError(f"capture.aux_layer_ids must have 3 ids, got {ids}")
    return ids


def check_range(name: str, ranges: list[str], n_rows: int, rows_per_shard: int) -> None:
    """Raise ValueError unless `name` is one of the configured `ranges`; the message lists them."""
    if name in ranges:
        return
    shown = ranges if len(ranges) <= 6 else [*ranges[:3], "...", *ranges[-2:]]
    valid = (
        f"the {len(ranges)} configured ranges ({n_rows} training rows, data.rows_per_shard "
        f"{rows_per_shard}) are: {', '.join(shown)}"
    )
    try:
        a, b = parse_range(name)
    except ValueError as e:
        raise ValueError(f"{e}; {valid}") from None
    if b > n_rows:
        raise ValueError(
            f"row range {name} is past the end of the training rows [0, {n_rows}) "
            f"(data.sources minus data.heldout_rows); {valid}"
        )
    raise ValueError(f"row range {name} is not a configured range; {valid}")
