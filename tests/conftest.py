"""Shared fixtures: tiny random MoE configs; never touches the network."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# OpenMP threads that spin at barriers slow tiny CPU training 10-50x whenever another
# process shares the cores; passive waiting keeps the suite's time stable on CI.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
