"""Turning a config.json dict into a transformers config object, quietly."""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from moetune.errors import ConfigError, ModelSourceError
from moetune.io import quiet_logger

# Keys moetune adds to catalog files, and checkpoint-only settings that must not reach a
# bf16 build (from_config would try to set up the quantizer).
PRIVATE_KEYS = ("_moetune",)
CHECKPOINT_ONLY_KEYS = ("quantization_config",)


def hf_config_object(model_type: str, cfg: dict[str, Any], name: str = "custom") -> Any:
    """The transformers config for `cfg`: its defaults and attribute_map aliases applied.

    Raises ConfigError when transformers rejects a field, so a bad config.json is reported
    with the model name instead of a traceback.
    """
    # lazy: heavy to import (huggingface_hub, transformers)
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    kwargs = {
        k: plain_floats(v) for k, v in cfg.items() if k != "model_type" and k not in PRIVATE_KEYS
    }
    try:
        with quiet_transformers():
            return AutoConfig.for_model(model_type, **kwargs)
    except (StrictDataclassError, TypeError, ValueError, KeyError, AttributeError) as exc:
        # the strict-dataclass message puts the field on line 1 and the cause on line 2
        first = " ".join(str(exc).split()) or type(exc).__name__
        raise ConfigError(
            f"{name}: config.json is not a valid {model_type} config ({first})",
            "correct the field named above, or re-download the model's config.json",
        ) from exc


def plain_floats(value: Any) -> Any:
    """to_dict writes inf / nan as {"__float__": "Infinity"}; the config takes floats."""
    if isinstance(value, dict):
        if set(value) == {"__float__"}:
            return float(value["__float__"])
        return {k: plain_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_floats(v) for v in value]
    return value


def quiet_transformers() -> AbstractContextManager[None]:
    """Config-sanity warnings (e.g. eos id outside a tiny vocab) are noise when planning."""
    return quiet_logger("transformers")


HF_QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's export, beside config.json


def quant_config_of(config: dict[str, Any]) -> Any:
    """A config.json's `quantization_config` (a multimodal one's under text_config): the one
    source of a base's published format, read into the spec (ModelSpec.quant_config). One
    declared only in hf_quant_config.json is put there by `with_hf_quant_config` first."""
    text = config.get("text_config")
    for where in (config, text if isinstance(text, dict) else {}):
        if "quantization_config" in where and where["quantization_config"] is not None:
            return _checked_quant(where["quantization_config"])
    return None


def _checked_quant(qcfg: Any) -> dict[str, Any]:
    """A `quantization_config` that says how its weights are stored: a mapping (the formats
    judge its keys). An empty one or a bare string says a base is quantised but not how
    (transformers refuses to load it too): refused here, the one place every stage reads."""
    if isinstance(qcfg, dict) and qcfg:
        return qcfg
    got = "empty" if qcfg in ({}, "", []) else f"a {type(qcfg).__name__}, not a mapping"
    raise ModelSourceError(
        f"config.json's quantization_config is {got}: it does not say how the weights are stored",
        "use the config.json published with these weights (a float base has no "
        "quantization_config at all)",
    )


def with_hf_quant_config(config: dict[str, Any], hf_quant: Any) -> dict[str, Any]:
    """`config` with the quantisation an `hf_quant_config.json` declares (NVIDIA's ModelOpt
    exports, e.g. Qwen3-235B-A22B-NVFP4, whose config.json has none) as its
    `quantization_config`, in the form transformers gives ModelOpt's: quant_method "modelopt"
    and the "quantization" section's keys (quant_algo, group_size, exclude_modules …).
    A config.json that declares its own keeps it: the two describe the same weights."""
    section = hf_quant.get("quantization") if isinstance(hf_quant, dict) else None
    if quant_config_of(config) or not isinstance(section, dict) or not section:
        return config
    producer = hf_quant.get("producer") if isinstance(hf_quant.get("producer"), dict) else {}
    qcfg = {"quant_method": str(producer.get("name") or "modelopt").lower(), **section}
    return {**config, "quantization_config": qcfg}
