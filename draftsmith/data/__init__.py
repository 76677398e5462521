"""Prompts and their sources, the regeneration driver, tokenization with the loss mask, the draft
vocabulary.

May import: draftsmith.runtime, draftsmith.config.
"""
