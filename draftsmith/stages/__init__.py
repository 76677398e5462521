"""The commands the rules run that hand their work to an engine, and the environment check.

May import: every subpackage (they are the top of the layers).
"""
