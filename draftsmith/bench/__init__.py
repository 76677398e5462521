"""The benchmark's parts: speculative decoding in-process, report figures and inputs, concurrency
levels, captions, the acceptance gate.

May import: draftsmith.runtime, config, data, targets, hidden, algorithms, interop.
"""
