"""ModelSpec for any model transformers builds: config.json -> a meta-device build -> `Derived`.

No family table: the language model is transformers' own causal-LM class for the config
(for multimodal checkpoints the one inside `text_config`), built on the meta device, and
read by structure (`model.read` puts each parameter into a component, `model.summary`
reads the spec's figures). A build takes 10 ms – 2 s, so `derive_cached` memoises it.
"""

from __future__ import annotations

import inspect
import json
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from moetune.errors import ConfigError, UnknownFamilyError
from moetune.model.hf_config import (
    CHECKPOINT_ONLY_KEYS,
    PRIVATE_KEYS,
    hf_config_object,
    quiet_transformers,
)
from moetune.model.layout_types import ExpertsLayout, ModulePaths
from moetune.model.multimodal import multimodal_class, text_config_of, text_path
from moetune.model.read import classify_layer, find_layers, layout, outside, sum_layers, union_paths
from moetune.model.remote import needs_remote_code, refused
from moetune.model.sanity import check_build, check_config
from moetune.model.spec import ModelSpec
from moetune.model.summary import spec_of
from moetune.model.textlm import module_classes, serves, text_lm_class, text_model_class

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class Derived:
    """What a meta build says about one config: the spec and where its parts live."""

    spec: ModelSpec
    paths: ModulePaths
    layout: ExpertsLayout
    layers_prefix: str
    # a module has `gradient_checkpointing` (what `gradient_checkpointing_enable` needs)
    checkpointable: bool = True


def derive(raw: dict[str, Any], name: str = "custom") -> Derived:
    """Spec, module paths and expert layout of a config.json dict, from a meta build."""
    model_type = str(raw.get("model_type") or "")
    if not model_type:
        raise UnknownFamilyError(
            f"{name}: config.json has no model_type",
            "add the model's model_type (e.g. qwen3_moe) to config.json",
        )
    kwargs = {k: v for k, v in raw.items() if k not in (*PRIVATE_KEYS, *CHECKPOINT_ONLY_KEYS)}
    config = _text_config(_config_object(model_type, kwargs, name))
    # Heterogeneous configs (per_layer_config) refuse global reads of per-layer fields; the
    # spec's summary figures take the global value, the build has every layer's own.
    config.allow_global_per_layer_attribute_access = True
    check_config(raw, config, name)
    model = build_language_model(config, name)
    check_build(model, name)
    with quiet_transformers():
        return _read_build(model, config, raw, name)


def _config_object(model_type: str, kwargs: dict[str, Any], name: str) -> Any:
    # lazy: heavy to import (transformers)
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        # lazy: heavy to import (transformers)
        import transformers

        if needs_remote_code(kwargs):  # its classes ship with it and were not registered
            raise refused(name, {**kwargs, "model_type": model_type})

        raise UnknownFamilyError(
            f"{name}: transformers {transformers.__version__} does not know model_type "
            f"{model_type!r}",
            "upgrade transformers (pip install -U transformers) or check the model_type",
        )
    return hf_config_object(model_type, kwargs, name)


def _text_config(config: Any) -> Any:
    """The language model's config: `text_config` of a multimodal checkpoint (or of its
    thinker's), else itself."""
    return text_config_of(config)


def to_hf_config(spec: ModelSpec) -> PretrainedConfig:
    """The transformers config of the (text, bf16) model `spec` describes."""
    config = dict(spec.hf_config)
    model_type = str(config.pop("model_type", spec.model_type))
    return hf_config_object(model_type, config, spec.name)


def checkpointing_refused(spec: ModelSpec) -> str | None:
    """The causal-LM class's name when it refuses activation checkpointing, else None: its
    `supports_gradient_checkpointing` is False (jetmoe on transformers 5.24), or no module of
    it can checkpoint (diffusion_gemma_text's encoder layers are no GradientCheckpointingLayer,
    and transformers refuses the model as "not compatible") – read off the spec's cached
    meta build, so asking costs no second build."""
    cls = causal_lm_class(to_hf_config(spec))
    if not getattr(cls, "supports_gradient_checkpointing", True):
        return str(cls.__name__)
    return None if derive_cached(spec.hf_config, spec.name).checkpointable else str(cls.__name__)


def causal_lm_class(config: Any) -> Any:
    """transformers' causal-LM class for `config` (the auto mapping, else the modeling
    module's `…ForCausalLM` whose config_class is this config's class)."""
    # lazy: heavy to import (transformers)
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        pass
    for candidate in module_classes(type(config)):
        if candidate.__name__.endswith("ForCausalLM") and serves(candidate, config):
            return candidate
    base = text_model_class(config) if type(config) in _text_config_classes() else None
    if base is not None:  # a multimodal checkpoint's language model: its text model + head
        config_cls: Any = type(config)
        return text_lm_class(config_cls, base)
    if text_path(config):  # the multimodal class loads it (checkpoint_class)
        raise UnknownFamilyError(
            f"{config.model_type!r} is a multimodal checkpoint: this step builds the causal "
            f"LM of a text checkpoint, not {type(config).__name__}'s multimodal class",
            "train it without train.offload, model.experts_dtype or several ranks (the "
            "plain load trains a multimodal checkpoint in its own layout)",
        )
    raise UnknownFamilyError(
        f"transformers has no causal-LM class for {config.model_type!r} (encoder-decoder "
        "or encoder-only models cannot be fine-tuned as a decoder)",
        "pick a decoder model; moetune fine-tunes causal language models",
    )


def checkpoint_class(config: Any) -> Any:
    """The class a checkpoint with this (top-level) config loads as in its own key layout:
    transformers' multimodal class where it has one (towers and all), else the causal LM."""
    # lazy: heavy to import (torch)
    from torch import nn

    cls = multimodal_class(config)
    if cls is None:
        return causal_lm_class(config)
    if cls.forward is nn.Module.forward:  # Qwen3-Omni's: thinker and talker run from generate
        inner = ".".join(k.removesuffix("_config") for k in text_path(config)[:-1])
        raise UnknownFamilyError(
            f"transformers' {cls.__name__} has no forward of its own (only generate): it "
            "cannot be trained as one model",
            f"train its {inner or 'language model'} alone (that sub-model's save_pretrained)",
        )
    if "labels" not in inspect.signature(cls.forward).parameters:
        raise _not_a_language_model(cls, config)
    return cls


def _not_a_language_model(cls: type, config: Any) -> UnknownFamilyError:
    """DiffusionGemma's block-diffusion class: its forward denoises a canvas of tokens
    (its logits are the canvas's, not the next token of each input), so a language-model
    loss has nothing to train; its language model alone is a causal LM."""
    text_type = text_config_of(config).model_type
    return UnknownFamilyError(
        f"transformers' {cls.__name__}.forward takes no labels: it is not a language "
        f"model's forward (its logits are not each input token's next), so it cannot be "
        "trained as one",
        f"train its language model alone: a text checkpoint of model_type {text_type!r} "
        "(config.json's text_config, the language model's weights)",
    )


@cache
def _text_config_classes() -> frozenset[type]:
    """The `text_config` classes of multimodal configs (not their vision or audio towers);
    read once: it touches every config class transformers registers."""
    # lazy: heavy to import (transformers)
    from transformers import CONFIG_MAPPING

    subs = (getattr(top, "sub_configs", None) or {} for top in CONFIG_MAPPING.values())
    return frozenset(s["text_config"] for s in subs if "text_config" in s)


def build_language_model(config: Any, name: str = "custom", device: str = "meta", **kw: Any) -> Any:
    """The causal LM for a transformers config, built on `device` (meta: no memory)."""
    # lazy: heavy to import (torch)
    import torch

    cls = causal_lm_class(config)
    kw.setdefault("dtype", torch.bfloat16)
    try:
        with quiet_transformers(), torch.device(device):
            return ensure_backbone(cls._from_config(config, **kw))
    except (ValueError, TypeError, KeyError, AttributeError, IndexError, RuntimeError) as exc:
        said = " ".join(str(exc).split())[:300] or type(exc).__name__
        raise ConfigError(
            f"{name}: transformers cannot build {config.model_type} from this config.json "
            f"({type(exc).__name__}: {said})",
            "correct the field transformers names, or re-download the model's config.json",
        ) from exc


def ensure_backbone(model: Any) -> Any:
    """Point `model.base_model` at the decoder when the class names a `base_model_prefix`
    it does not have (Llama4ForCausalLM says `language_model`, holds `model`): TRL's fused
    LM head asks `base_model` for the last hidden state, and would get the whole model."""
    if getattr(model, "base_model", model) is not model:
        return model
    prefix, _ = find_layers(model, getattr(model.config, "num_hidden_layers", None))
    head = prefix.split(".")[0]
    if head != prefix:
        model.base_model_prefix = head  # this instance only; the class stays as shipped
    return model


def _read_build(model: Any, config: Any, raw: dict[str, Any], name: str) -> Derived:
    prefix, layers = find_layers(model, getattr(config, "num_hidden_layers", None))
    read = [classify_layer(layer) for layer in layers]
    spec = spec_of(name, config, raw, read, outside(model, prefix) + sum_layers(read))
    checkpointable = any(hasattr(m, "gradient_checkpointing") for m in model.modules())
    return Derived(spec, union_paths(read), layout(read, spec.hidden_size), prefix, checkpointable)


_CACHE: dict[str, Derived] = {}
_CACHE_SIZE = 256


def _key(raw: dict[str, Any], name: str) -> str:
    return json.dumps([raw, name], sort_keys=True, default=str)


def derive_cached(raw: dict[str, Any], name: str = "custom") -> Derived:
    """`derive`, memoised on the config's content (a meta build takes 10 ms – 2 s). The
    result also answers for the spec's own `hf_config` (the same language model), which
    `Family.paths_of` looks up – without a second build of it."""
    key = _key(raw, name)
    if key not in _CACHE:
        if len(_CACHE) >= _CACHE_SIZE:
            _CACHE.clear()
        found = derive(raw, name)
        _CACHE[key] = _CACHE[_key(found.spec.hf_config, name)] = found
    return _CACHE[key]
