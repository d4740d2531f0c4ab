"""The run directory: checkpoints and provenance (checkpoint.py), recovery of a run that
stopped (recovery.py) and the lock that keeps one run per dir (lock.py).
"""
