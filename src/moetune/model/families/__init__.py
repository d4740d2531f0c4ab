"""What moetune knows of each model family: the family lookup read off a tiny build
(registry.py), what no build shows (overrides.py, registered here) and how serving stacks
take each family's expert LoRA (serving.py). The layout types they share sit below, in
model/layout_types.py, because the build readers use them too.
"""

from moetune.model.families import overrides  # noqa: F401  (registers the overrides)
