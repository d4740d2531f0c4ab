"""Workarounds for transformers bugs, one module a family (a model fix each).

registry.py holds MODEL_FIXES and imports none of its fixes; importing this package
registers them all.
"""

from moetune.model.fixes import llama4, omni, step3p7  # noqa: F401  (registers their fixes)
