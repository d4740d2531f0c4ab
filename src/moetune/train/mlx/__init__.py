"""Training on mlx-lm: the stack (stack.py), the base as mlx loads it (base.py), the data
(data.py) and the adapter's format (format.py).
"""
