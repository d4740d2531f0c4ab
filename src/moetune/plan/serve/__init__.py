"""Serving memory: the engine registry and its plan (engines.py), vLLM (vllm.py) and GGUF
file types (gguf.py).

Importing this package registers vLLM in engines.ENGINES.
"""

from moetune.plan.serve import vllm  # noqa: F401  (registers vLLM in engines.ENGINES)
