"""Hidden-state shards: the format, the writer, storage modes, the capture plan, segments.

May import: draftsmith.runtime, config, data, targets.
"""
