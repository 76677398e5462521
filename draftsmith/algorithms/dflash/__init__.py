"""DFlash: a block drafter (draftsmith.algorithms.dflash.model) served as vLLM's `DFlashDraftModel`.

Not a switch on the EAGLE-3 draft: this algorithm brings its own draft module, objective
(draftsmith.algorithms.dflash.train), export and contract check (draftsmith.algorithms.dflash.export) and decoder
(draftsmith.algorithms.dflash.decode), named here for train.py, export.py and specdec.py:

    TRAINER   module with build_draft, objective, batch_losses
    EXPORTER  module with export_draft, check_export, load_export, config_problems

Capture: the configured `capture.aux_layer_ids` (the same shards as EAGLE-3 by default; DFlash
recipes often list five ids, which the shards, the fc and the export follow); the block size
is train.ttt_steps + 1 (one known token and ttt_steps masks).
"""

from __future__ import annotations

NAME = "dflash"
DRAFT: dict[str, bool] = {}
SPECULATORS = False
TRAINER = "draftsmith.algorithms.dflash.train"
EXPORTER = "draftsmith.algorithms.dflash.export"
ARCH = "DFlashDraftModel"


def export_keys(cfg) -> dict:
    return {}


def extra_params(c: dict) -> dict[str, tuple]:
    return {}

# config_problems: the EXPORTER's (the registry's export_problems asks it there)
