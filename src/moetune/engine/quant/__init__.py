"""Frozen expert stacks held quantised in memory: the quantiser registry (stacks.py),
int8 / NF4 (int8_nf4.py) and loading a base into them (load.py).
"""
