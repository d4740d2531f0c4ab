"""The fake-tensor trace of one real training step: the step (fake_step.py), its byte
accounting (bytes.py), the data-dependent ops answered with a balanced routing
(balanced.py), its cache (cache.py) and its timing (duration.py).
"""
