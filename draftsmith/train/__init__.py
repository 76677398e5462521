"""Training: the loop of one rank, its data, checkpoints, the launcher of the ranks.

May import: draftsmith.runtime, config, data, targets, hidden, algorithms, interop.
"""
