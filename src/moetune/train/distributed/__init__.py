"""Inside a rank of a multi-process run: nodes and their rendezvous (nodes.py), the
sharded load (sharded_load.py, zero3_load.py), no orphaned process (orphans.py), and
expert parallelism's launch checks (ep_checks.py), recompute replay (ep_replay.py),
micro-batches padded alike on every rank (ep_padding.py) and sliced expert LoRA saved,
resumed and clipped whole (ep_state.py).
"""
