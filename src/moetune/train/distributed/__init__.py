"""Inside a rank of a multi-process run: nodes and their rendezvous (nodes.py), the
sharded load (sharded_load.py, zero3_load.py) and no orphaned process (orphans.py).
"""
