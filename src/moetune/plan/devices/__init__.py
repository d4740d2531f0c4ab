"""One device of N: memory per rank under FSDP2 / ZeRO-3 (sharding.py, from the run's byte
sizes in sizes.py), expert parallelism (expert_parallel.py) and each node's host RAM
(host_ram.py).
"""
