"""Module-path building blocks shared by the family modules."""

from __future__ import annotations

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
MLX_ATTENTION = tuple(f"self_attn.{n}" for n in QKVO)
GLU = ("gate_proj", "up_proj", "down_proj")


def under(prefix: str, names: tuple[str, ...] = GLU) -> tuple[str, ...]:
    """`names` below one module: under("mlp.shared_experts") -> mlp.shared_experts.gate_proj, …"""
    return tuple(f"{prefix}.{n}" for n in names)


def fused(prefix: str) -> tuple[str, ...]:
    """The two fused expert parameters of an `…Experts` module."""
    return (f"{prefix}.gate_up_proj", f"{prefix}.down_proj")
