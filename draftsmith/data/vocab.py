"""Draft vocabulary: the most frequent assistant tokens, as SGLang's `d2t` / `t2d` buffers.

Frequencies are counted over masked (assistant) tokens of every row range. The top
`draft.vocab_size` ids are sorted by id; when the data has fewer distinct tokens, the smallest
unused ids pad the list (count 0). Written to `results/vocab/vocab.safetensors`:

- `d2t [K] int64`: offsets, `d2t[i] + i` is the target id of draft id i (SGLang:
  `hot_token_id = d2t + arange(K)`);
- `t2d [V] bool`: marks exactly the target ids in the draft vocabulary;
- `counts [K] int64`: assistant-token frequency of each draft id.

The file depends on the token files and the `draft` config section (Snakemake params), so it is
rebuilt whenever either changes; there is no cache key. It also lists the regenerated rows files
as inputs: each tokens file must hold the row count of its rows file (a stale tokens file is an
error), and a deleted rows file is rebuilt even though nothing else still needs it.

CLI (rule vocab): `python -m draftsmith vocab --cfg <json> --target results/target
--out results/vocab/vocab.safetensors [--rows results/data/rows_*.jsonl]
--tokens results/tokens/rows_*.safetensors`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from draftsmith.runtime.files import atomic_path, command_parser, init_logging, parse_cfg

log = logging.getLogger("draftsmith.data.vocab")


def count_tokens(token_files, vocab_size: int):
    """Assistant-token frequencies [V] int64 over the given tokens files."""
    import torch

    from draftsmith.data.tokens import read_tokens

    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for path in token_files:
        t = read_tokens(path)
        ids = t["input_ids"][t["loss_mask"].bool()]
        if ids.numel() and int(ids.max()) >= vocab_size:
            raise ValueError(
                f"{path}: token id {int(ids.max())} is outside the target vocabulary ({vocab_size})"
            )
        counts += torch.bincount(ids, minlength=vocab_size)
    return counts


def check_row_counts(rows_files, token_files) -> None:
    """Each tokens file was made from its rows file: the same range, the same row count."""
    from safetensors import safe_open

    if len(rows_files) != len(token_files):
        raise ValueError(f"{len(rows_files)} rows files but {len(token_files)} tokens files")
    for rows_path, tok_path in zip(sorted(rows_files), sorted(token_files), strict=True):
        if Path(rows_path).stem != Path(tok_path).stem:
            raise ValueError(f"{rows_path} and {tok_path} are not the same row range")
        with open(rows_path, encoding="utf-8") as f:
            n_rows = sum(1 for line in f if line.strip())
        with safe_open(str(tok_path), "pt") as f:
            stats = json.loads((f.metadata() or {}).get("stats", "{}"))
        if stats.get("rows") != n_rows:
            raise ValueError(
                f"{tok_path} was tokenized from {stats.get('rows')} rows but {rows_path} has "
                f"{n_rows}: the tokens file is stale"
            )


def build_vocab(counts, draft_vocab_size: int) -> dict:
    """Top-K ids by frequency (ties: smaller id first), padded with unused ids, sorted by id."""
    import torch

    vocab_size = counts.numel()
    if draft_vocab_size > vocab_size:
        raise ValueError(
            f"draft.vocab_size={draft_vocab_size} exceeds the target vocabulary ({vocab_size})"
        )
    # Stable sort on -count keeps ids ascending within equal counts.
    order = torch.sort(-counts, stable=True).indices
    seen = int((counts > 0).sum())
    chosen = order[: min(seen, draft_vocab_size)]
    if chosen.numel() < draft_vocab_size:
        unused = torch.ones(vocab_size, dtype=torch.bool)
        unused[chosen] = False
        pad = unused.nonzero().flatten()[: draft_vocab_size - chosen.numel()]
        chosen = torch.cat([chosen, pad])
    ids = torch.sort(chosen).values
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    return {
        "d2t": ids - torch.arange(draft_vocab_size, dtype=torch.int64),
        "t2d": t2d,
        "counts": counts[ids].clone(),
    }


def check_vocab(d2t, t2d) -> None:
    """The invariants: d2t[i] + i are distinct, ascending, in range, exactly the ids t2d marks."""
    import torch

    ids = d2t + torch.arange(d2t.numel(), dtype=d2t.dtype)
    if d2t.dtype != torch.int64 or t2d.dtype != torch.bool:
        raise ValueError(f"d2t must be int64 and t2d bool, got {d2t.dtype} and {t2d.dtype}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= t2d.numel()):
        raise ValueError("d2t maps draft ids outside the target vocabulary")
    if ids.numel() > 1 and not bool((ids[1:] > ids[:-1]).all()):
        raise ValueError("d2t + arange is not strictly ascending (draft ids must be sorted by id)")
    if int(t2d.sum()) != ids.numel() or not bool(t2d[ids].all()):
        raise ValueError("t2d does not mark exactly the target ids of d2t")


def save_vocab(path, vocab: dict, meta: dict) -> None:
    from safetensors.torch import save_file

    with atomic_path(path) as tmp:
        save_file(vocab, str(tmp), metadata={"format": "draftsmith.data.vocab/1", **meta})


def load_vocab(path):
    """(d2t [K] int64, t2d [V] bool) from a vocab file, invariants checked."""
    from safetensors.torch import load_file

    t = load_file(str(path))
    if "d2t" not in t or "t2d" not in t:
        raise ValueError(f"{path}: not a draft vocabulary (needs d2t and t2d)")
    try:
        check_vocab(t["d2t"], t["t2d"])
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    return t["d2t"], t["t2d"]


def target_vocab_size(target_dir) -> int:
    """`vocab_size` of the target's config.json (or its text_config)."""
    path = Path(target_dir) / "config.json"
    cfg = json.loads(path.read_text())
    size = cfg.get("vocab_size") or cfg.get("text_config", {}).get("vocab_size")
    if not size:
        raise SystemExit(f"{path}: no vocab_size")
    return int(size)


def main(argv: list[str] | None = None) -> None:
    ap = command_parser("vocab", __doc__)
    ap.add_argument("--cfg", required=True, help="JSON with the draft section")
    ap.add_argument("--target", required=True, help="target HF directory (config.json)")
    ap.add_argument("--out", required=True, help="results/vocab/vocab.safetensors")
    ap.add_argument("--tokens", nargs="+", required=True, help="results/tokens/rows_*.safetensors")
    ap.add_argument("--rows", nargs="*", default=[], help="results/data/rows_*.jsonl (checked)")
    args = ap.parse_args(argv)
    init_logging("draftsmith.data.vocab")
    k = int(parse_cfg(args.cfg)["draft"]["vocab_size"])
    vocab_size = target_vocab_size(args.target)
    try:
        if args.rows:
            check_row_counts(args.rows, args.tokens)
        counts = count_tokens(args.tokens, vocab_size)
        vocab = build_vocab(counts, k)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    check_vocab(vocab["d2t"], vocab["t2d"])
    total, distinct = int(counts.sum()), int((counts > 0).sum())
    covered = int(vocab["counts"].sum())
    log.info(
        "%d assistant tokens, %d distinct; draft vocab %d of %d covers %.2f%% of them%s",
        total,
        distinct,
        k,
        vocab_size,
        100.0 * covered / max(total, 1),
        f" ({k - distinct} padding ids)" if distinct < k else "",
    )
    meta = {
        "draft_vocab_size": str(k),
        "target_vocab_size": str(vocab_size),
        "assistant_tokens": str(total),
        "distinct_tokens": str(distinct),
        "coverage": f"{covered / max(total, 1):.6f}",
        "token_files": str(len(args.tokens)),
    }
    save_vocab(args.out, vocab, meta)
