"""The names a checkpoint saves its tensors under, and a LoRA adapter's keys in those names.

transformers 5 builds many models in a module layout of its own and maps a checkpoint's
keys onto it on load (its conversion mapping: renames such as `model.layers.` ->
`model.language_model.layers.`, converters that fuse `experts.N.w1` into one stack);
`save_pretrained` reverts the mapping, so a checkpoint keeps the names it was published
with. peft 0.21, loading an adapter, applies the same forward mapping to the adapter's
keys. An adapter saved under module paths is therefore renamed a second time wherever a
rename is not idempotent – unlimited_ocr's `(^|model\\.)layers\\.` also matches inside
`language_model.layers.`, mistral_large4's `^layers\\.` after peft strips its prefix – and
its tensors are left unloaded (docs/knowledge.md §13).

- `checkpoint_named`: the adapter's tensors under the checkpoint's saved names
  (transformers' own revert), kept only where peft's forward mapping gives back every
  tensor under its module path, else the module paths where those survive;
- `loaded_key_map`: which adapter-file key peft loads into which module path;
- `saved_names`: the checkpoint keys `save_pretrained` writes for some parameters.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from moetune.errors import MoetuneError

PREFIX = "base_model.model."  # peft's prefix of every adapter key
WEIGHTS = "adapter_model.safetensors"


class AdapterNamesError(MoetuneError):
    """An adapter's keys cannot be written so that peft loads them back onto the model."""


def reverted(model: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """`tensors` (peft keys, module paths) through transformers' save-time revert."""
    # lazy: heavy to import (transformers)
    from transformers.core_model_loading import revert_weight_conversion

    stripped = {k.removeprefix(PREFIX): v for k, v in tensors.items()}
    return {PREFIX + k: v for k, v in revert_weight_conversion(model, stripped).items()}


def loaded(model: Any, lora_config: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """What peft's `PeftModel.from_pretrained` makes of adapter `tensors` on `model` (its
    transformers v5 conversion; peft keys, adapter name left out)."""
    # lazy: heavy to import (peft)
    from peft.utils.transformers_weight_conversion import (
        convert_peft_adapter_state_dict_for_transformers,
    )

    return convert_peft_adapter_state_dict_for_transformers(model, lora_config, dict(tensors))


def _round_trips(
    model: Any, lora_config: Any, candidate: dict[str, Any], want: dict[str, Any]
) -> bool:
    # lazy: heavy to import (torch)
    import torch

    try:
        back = loaded(model, lora_config, candidate)
    except (ValueError, RuntimeError, KeyError, IndexError):
        return False
    return back.keys() == want.keys() and all(torch.equal(back[k], want[k]) for k in want)


def checkpoint_named(model: Any, lora_config: Any, tensors: dict[str, Any]) -> dict[str, Any]:
    """The adapter `tensors` under the checkpoint's own saved names where peft loads those
    back exactly; else under module paths where those survive peft's mapping; else refused."""
    try:
        candidates = [reverted(model, tensors), tensors]
    except (ValueError, RuntimeError, KeyError, IndexError):
        candidates = [tensors]
    for candidate in candidates:
        if _round_trips(model, lora_config, candidate, tensors):
            return candidate
    first = sorted(set(tensors) - set(loaded(model, lora_config, tensors)))[:1]
    raise AdapterNamesError(
        f"peft's conversion for {type(model).__name__} renames {first[0] if first else '?'} "
        "to a module the model does not have",
        "leave that module out of lora.target_modules (transformers' conversion mapping "
        "renames its keys on load)",
    )


def write_checkpoint_named(adapter_dir: Path, model: Any) -> list[str]:
    """Rewrite a peft adapter dir's weights in `checkpoint_named` form (`model`: the
    peft-wrapped transformers model it was trained on); a note where peft cannot load it
    back whole (the adapter is kept as peft wrote it: training is never thrown away)."""
    # lazy: heavy to import (peft, safetensors)
    from peft import LoraConfig
    from safetensors.torch import load_file, save_file

    path = adapter_dir / WEIGHTS
    config_file = adapter_dir / "adapter_config.json"
    if not path.is_file() or '"LORA"' not in config_file.read_text(encoding="utf-8"):
        return []
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    tensors = load_file(str(path))
    try:
        named = checkpoint_named(base, LoraConfig.from_pretrained(str(adapter_dir)), tensors)
    except AdapterNamesError as exc:
        return [f"the adapter will not load whole with PeftModel.from_pretrained: {exc.cause}"]
    if named.keys() != tensors.keys():
        tmp = path.with_suffix(".tmp")
        save_file({k: v.contiguous() for k, v in named.items()}, str(tmp), {"format": "pt"})
        tmp.replace(path)
    return []


def loaded_key_map(model: Any, lora_config: Any, keys: list[str]) -> dict[str, str]:
    """Module-path key -> the adapter-file key peft loads into it (placeholder tensors
    carry each key's index through peft's mapping; no weights are read)."""
    # lazy: heavy to import (torch)
    import torch

    marks = {k: torch.tensor([float(i)]) for i, k in enumerate(keys)}
    out = {}
    for name, value in loaded(model, lora_config, marks).items():
        if value.numel() == 1:  # a plain rename; a converter's output is claimed by no key
            out[name] = keys[int(value.item())]
    return out


def saved_names(model: Any, names: set[str]) -> set[str]:
    """The checkpoint keys `save_pretrained` writes for the state-dict entries `names` of
    `model` (a meta build will do: only names and shapes are used)."""
    # lazy: heavy to import (transformers)
    from transformers.core_model_loading import revert_weight_conversion

    state = {k: v for k, v in model.state_dict().items() if k in names}
    return set(revert_weight_conversion(model, state))
