"""Process plumbing every stage shares: atomic files, hardware and thread policy, stopping, the
job's lifeline, a shared server's SLURM step, ports, load, finiteness, repair, pin files.

May import: the standard library, torch, safetensors; nothing else of draftsmith.
"""
