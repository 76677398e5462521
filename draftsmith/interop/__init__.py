"""Conversion from and to SpecForge and speculators (drafts and data).

May import: draftsmith.runtime, config, data, targets, hidden.
"""
