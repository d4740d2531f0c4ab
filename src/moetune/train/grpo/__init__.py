"""GRPO's parts: rewards (rewards.py), the SFT warm start (sft.py), whether the adapter
is live in the rollouts (adapter_live.py), each completion's own random stream
(row_sampling.py), routing replay (replay.py) and the routing
shift between rollout and training (shift.py).
"""
