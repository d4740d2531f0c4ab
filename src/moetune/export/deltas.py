"""Every LoRA layer of a peft adapter as the base parameter it changes, and its ΔW computed
from peft's own saved tensors.

Names, nesting and scaling come from peft itself: the adapter's LoraConfig is applied to
the base built on the meta device (no memory), and each LoRA layer found there says which
parameter it adapts. The arithmetic is moetune's: for an expert stack (peft's ParamWrapper)
A is `[E·r, in]` (expert-major) and B `[out, E·r]` with the expert index *fastest*, so
expert e's ΔW is `s · B[:, e::E] @ A[e·r:(e+1)·r]`, laid out like the stored parameter
(`[E, out, in]`, or `[E, in, out]` where the experts module is_transposed, e.g. gpt_oss).
Every adapter tensor must be claimed by a layer: an export never drops a tensor silently.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from moetune.errors import clip
from moetune.export.registry import ExportError
from moetune.model.derive import checkpoint_class
from moetune.model.saved_names import loaded_key_map

PREFIX = "base_model.model."


@dataclass(frozen=True)
class LoraTarget:
    """One LoRA layer: its key in the adapter file and the base parameter it changes."""

    key: str  # adapter key stem, e.g. "model.layers.1.mlp.experts.base_layer"
    param: str  # the base parameter, e.g. "model.layers.1.mlp.experts.gate_up_proj"
    experts: int  # 0 for a plain Linear weight, else the stack's expert count
    transposed: bool  # an expert stack stored [E, in, out] (transformers' is_transposed)
    scaling: float  # peft's alpha / r (or alpha / sqrt(r) with rslora)

    @property
    def is_experts(self) -> bool:
        return self.experts > 0


def meta_base(base: str) -> Any:
    """The base's causal-LM class built on the meta device (no weights read)."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base)
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return checkpoint_class(config)._from_config(config)


def lora_targets(adapter_dir: Path, base: str) -> list[LoraTarget]:
    """Every LoRA layer peft builds for this adapter on this base, in module order."""
    # lazy: heavy to import (peft)
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora.layer import LoraLayer

    config = LoraConfig.from_pretrained(str(adapter_dir))
    config.inference_mode = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = get_peft_model(meta_base(base), config)
    found = []
    for name, module in wrapped.named_modules():
        if isinstance(module, LoraLayer) and "default" in module.lora_A:
            found.append(_target(name.removeprefix(PREFIX), module))
    return found


def _target(key: str, module: Any) -> LoraTarget:
    name = getattr(module, "parameter_name", None)
    scaling = float(module.scaling["default"])
    if name is None:  # a Linear (or Embedding / Conv) LoRA: ΔW = s·B@A on .weight
        return LoraTarget(key, f"{key}.weight", 0, False, scaling)
    owner = key.replace(".base_layer", "")
    transposed = bool(getattr(module.get_base_layer(), "is_transposed", False))
    experts = int(module.num_experts) if module._param_ndim == 3 else 0
    return LoraTarget(key, f"{owner}.{name}", experts, transposed, scaling)


def delta(target: LoraTarget, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """ΔW in the stored layout of `target.param`, in the dtype of `a` and `b`."""
    if not target.is_experts:
        return target.scaling * (b @ a)
    per_a, per_b = expert_factors(target, a, b)
    out = target.scaling * torch.bmm(per_b, per_a)  # [E, out, in]
    return out.transpose(1, 2) if target.transposed else out


def expert_factors(
    target: LoraTarget, a: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-expert A `[E, r, in]` and B `[E, out, r]` (scaling not applied)."""
    e = target.experts
    per_a = a.reshape(e, -1, a.shape[-1])
    per_b = b.reshape(b.shape[0], -1, e).permute(2, 0, 1)
    return per_a, per_b


class AdapterTensors:
    """The adapter's safetensors, read one tensor at a time; tracks which were claimed."""

    def __init__(self, adapter_dir: Path, model: Any = None) -> None:
        # lazy: heavy to import (peft, safetensors)
        from peft import LoraConfig
        from safetensors import safe_open

        path = adapter_dir / "adapter_model.safetensors"
        if not path.is_file():
            raise ExportError(
                f"{clip(adapter_dir, 80)} has no adapter_model.safetensors",
                "save the adapter with peft's save_pretrained (safe_serialization, the default)",
            )
        self._file = safe_open(str(path), framework="pt")
        self.keys = frozenset(self._file.keys())
        self.unclaimed = set(self.keys)
        # module-path key -> file key: the adapter may hold the checkpoint's saved names
        # (model/saved_names.py), which peft maps onto the modules as it loads them
        self.file_key = {k: k for k in self.keys}
        if model is not None:
            config = LoraConfig.from_pretrained(str(adapter_dir))
            self.file_key.update(loaded_key_map(model, config, sorted(self.keys)))

    def pair(self, target: LoraTarget, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) of one layer, as `dtype`."""
        wanted = [f"{PREFIX}{target.key}.lora_{x}.weight" for x in "AB"]
        missing = [n for n in wanted if n not in self.file_key]
        if missing:
            raise ExportError(
                f"the adapter has no {clip(missing[0], 100)}",
                "export with the base the adapter was trained on (--base)",
            )
        names = [self.file_key[n] for n in wanted]
        self.unclaimed.difference_update(names)
        a, b = (self._file.get_tensor(n).to(dtype) for n in names)
        return a, b

    def require_all_claimed(self) -> None:
        """Refuse an adapter with tensors no LoRA layer explains (never export a part)."""
        if self.unclaimed:
            first = sorted(self.unclaimed)[0]
            raise ExportError(
                f"{len(self.unclaimed)} adapter tensors map to no LoRA layer of the base "
                f"(first: {clip(first, 90)})",
                "export with the base the adapter was trained on; lora_bias, modules_to_save "
                "and non-LoRA tuners are not exported",
            )


def iter_deltas(
    adapter_dir: Path, base: str, dtype: torch.dtype = torch.float32
) -> Iterator[tuple[LoraTarget, torch.Tensor, torch.Tensor]]:
    """(target, A, B) for every LoRA layer; raises at the end if a tensor was left over."""
    tensors = AdapterTensors(adapter_dir, meta_base(base))
    for target in lora_targets(adapter_dir, base):
        a, b = tensors.pair(target, dtype)
        yield target, a, b
    tensors.require_all_claimed()
