"""Frozen expert stacks streamed from host RAM or disk a layer at a time (train.offload):
the store (store.py), the load into it (load.py) and where each stack's bytes come from
(sources.py).
"""
