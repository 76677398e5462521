"""The SGLang engine: a real SGLang server per job or per run (`engine.py`, the module `ENGINES`
names), its capture (`capture.py`), the patched SGLang the capture needs (`patch.py`), the
server's launch (`server.py`) and the CPU compatibility layer of role sglang-cpu (`cpu/`, with
the overlay its servers get on PYTHONPATH). Importing this package imports none of them: the
overlay loads `cpu` inside SGLang processes, which must not pull in the engine."""
