"""The vLLM engine: vLLM's own EAGLE-3 speculative decoding in the bench (`engine.py`, the module
`ENGINES` names), with the stand-ins applied on vLLM's CPU build (`cpu.py`). Importing this
package imports none of them."""
