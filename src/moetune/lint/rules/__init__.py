"""The lint rules, one module an area. The registry (lint/registry.py) imports none of
them; importing this package registers them all, in this order.
"""

from moetune.lint.rules import (  # noqa: F401  (each registers its rules)
    dist,
    infra,
    ladder,
    mlx,
    model,
    offload,
    peft,
    serve,
    stored,
)
