"""Memory and step time when the frozen experts stream from host RAM or disk
(train.offload): the memory plan (memory.py) and a CPU host's step (cpu_step.py).
"""
