"""The config: schema validation and defaults, typed settings, the engines' table (read from their
sources, never imported), the config reference page.

May import: draftsmith.runtime.
"""
