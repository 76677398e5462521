"""What the capture stage's CLI (`draftsmith.stages.capture`) and its engines (`draftsmith.engines`)
share, below both: the error for inputs a capture cannot use, and the length-sorted batching.

`plan_batches` groups rows up to `capture.batch_tokens` (padded rows x longest row).
"""

from __future__ import annotations


class CaptureError(ValueError):
    """Inputs the capture cannot use; the message names the file or key."""


def plan_batches(lengths: list[int], batch_tokens: int) -> list[list[int]]:
    """Row indices grouped longest first so that len(group) * longest <= batch_tokens.

    A row longer than the budget forms a batch of its own.
    """
    order = sorted(range(len(lengths)), key=lambda r: (-lengths[r], r))
    batches: list[list[int]] = []
    for r in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= batch_tokens:
            batches[-1].append(r)
        else:
            batches.append([r])
    return batches
