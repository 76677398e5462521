"""The hf engine: transformers in the job's own process (`engine.py`, the module `ENGINES`
names), with its decode attention (`attention.py`) and the bench's models and worker pool
(`bench.py`, `bench_pool.py`). Importing this package imports none of them."""
