"""The target model: loading and conversion, model families, checkpoint layouts, layer ids, serving
facts, fast tokenizers, tiny test targets.

May import: draftsmith.runtime, config, data.
"""
