"""What each value of a keyed choice field means: a registry per field (train.offload,
lora.stack, lora.engine) whose entries carry the traits the code asks –
`offload_mode(cfg.train.offload).streams`, `lora_stack(lora.stack).peft_adapter`,
`splits(engine)` – so no site compares a value by name, and a new value is its Literal in
sections.py plus one registration here (tests/test_keys.py keeps the two, every registry
that serves the field and the docs' list of its values in step).

It sits on the config floor, light (the registry helper only), because every floor from the
engine up asks it: the engine resolves lora.engine, the planner sizes train.offload.
"""

from __future__ import annotations

from dataclasses import dataclass

from moetune.registry import Registry

# ---------------------------------------------------------------- train.offload


@dataclass(frozen=True)
class OffloadMode:
    """Where train.offload keeps the frozen routed-expert stacks between uses."""

    streams: bool  # off the device, brought in a layer at a time (LoRA stays on it)
    on_disk: bool  # left in the base's safetensors files (or a scratch file), read by offset
    where: str  # the place in words, as plans and recommendations say it

    @property
    def in_host_ram(self) -> bool:
        """Held in host RAM (pinned on CUDA): bytes the host must hold and pin."""
        return self.streams and not self.on_disk


OFFLOAD_MODES: Registry[OffloadMode] = Registry("offload mode")
OFFLOAD_MODES.add("none", OffloadMode(streams=False, on_disk=False, where="the device"))
OFFLOAD_MODES.add("cpu", OffloadMode(streams=True, on_disk=False, where="host RAM"))
OFFLOAD_MODES.add(
    "disk", OffloadMode(streams=True, on_disk=True, where="the safetensors files on disk")
)


def offload_mode(name: str) -> OffloadMode:
    return OFFLOAD_MODES.get(name)


def streaming_modes() -> tuple[str, ...]:
    """The modes that stream, host RAM before disk: where both fit, RAM reads faster."""
    streaming = [name for name, mode in OFFLOAD_MODES.items() if mode.streams]
    return tuple(sorted(streaming, key=lambda name: offload_mode(name).on_disk))


# ---------------------------------------------------------------- lora.stack


@dataclass(frozen=True)
class LoraStack:
    """What trains the adapter lora.stack names."""

    peft_adapter: bool  # a peft adapter on the transformers model: the engines, peft rules apply
    runs_mlx: bool  # mlx-lm trains it from its own YAML (lora.mlx_keys, the MLX-* rules)


LORA_STACKS: Registry[LoraStack] = Registry("LoRA stack")
LORA_STACKS.add("peft", LoraStack(peft_adapter=True, runs_mlx=False))
LORA_STACKS.add("mlx", LoraStack(peft_adapter=False, runs_mlx=True))


def lora_stack(name: str) -> LoraStack:
    return LORA_STACKS.get(name)


# ---------------------------------------------------------------- lora.engine


@dataclass(frozen=True)
class LoraEngine:
    """How lora.engine computes the expert LoRA."""

    # moetune's split LoRA (True) or peft's ParamWrapper (False); None: probed per family
    # (auto), so only a resolved engine (engine/resolve.py) says which
    split: bool | None


LORA_ENGINES: Registry[LoraEngine] = Registry("LoRA engine")
LORA_ENGINES.add("auto", LoraEngine(split=None))
LORA_ENGINES.add("moetune", LoraEngine(split=True))
LORA_ENGINES.add("peft", LoraEngine(split=False))


def splits(engine: str) -> bool:
    """`engine` (asked or resolved) is moetune's split LoRA; auto is not, until resolved."""
    return LORA_ENGINES.get(engine).split is True


def wraps(engine: str) -> bool:
    """`engine` is peft's ParamWrapper by choice (peft), not by a probe's answer."""
    return LORA_ENGINES.get(engine).split is False
