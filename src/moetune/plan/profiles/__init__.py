"""Activation terms of each layer kind: the profile registry (registry.py) and one module
per kind of mixer (attention, MLA, conv, SSM, hybrid, Gemma 4, AXK2).
"""
