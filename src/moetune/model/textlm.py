"""A causal LM for the language model of a multimodal checkpoint whose transformers code
ships no `…ForCausalLM` of its own (qwen3_vl_moe, glm4v_moe, glm5_next, …).

Its conditional-generation class holds the text model and an output head; this class is
the same two parts – transformers' own text model class and a Linear head, tied where the
config ties – so moetune can count, audit, trace and train the language model alone.
"""

from __future__ import annotations

import importlib
from functools import cache
from typing import Any, ClassVar


def text_model_class(config: Any) -> Any:
    """transformers' base (headless) model class for `config`, or None."""
    # lazy: heavy to import (transformers)
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(config)]
    except KeyError:
        pass
    for cls in module_classes(type(config)):
        name = cls.__name__
        if serves(cls, config) and name.endswith("Model") and not name.endswith("PreTrainedModel"):
            return cls
    return None


def modeling_module(config_cls: type) -> Any:
    """The `modeling_<type>` module beside a config class, or None."""
    package = config_cls.__module__.rpartition(".")[0]
    try:
        return importlib.import_module(f"{package}.modeling_{package.rpartition('.')[2]}")
    except ImportError:
        return None


def module_classes(config_cls: type) -> list[type]:
    module = modeling_module(config_cls)
    return [v for v in vars(module).values() if isinstance(v, type)] if module else []


def serves(candidate: type, config: Any) -> bool:
    """Whether model class `candidate` is built from `config`'s class."""
    return getattr(candidate, "config_class", None) is type(config)


@cache
def text_lm_class(config_cls: Any, base_cls: Any) -> Any:
    """A `…ForCausalLM` for `base_cls` (built once per class pair)."""
    # lazy: heavy to import (torch, transformers)
    from torch import nn
    from transformers import GenerationMixin
    from transformers.modeling_outputs import CausalLMOutputWithPast

    pretrained = next(c for c in base_cls.__mro__[1:] if c.__name__.endswith("PreTrainedModel"))

    class TextCausalLM(pretrained, GenerationMixin):  # type: ignore[misc, valid-type]
        config_class = config_cls
        base_model_prefix = "model"
        _tied_weights_keys: ClassVar = {"lm_head.weight": "model.embed_tokens.weight"}

        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.model = base_cls(config)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
            self.post_init()

        def get_output_embeddings(self) -> Any:
            return self.lm_head

        def forward(self, input_ids: Any = None, labels: Any = None, **kwargs: Any) -> Any:
            kwargs.pop("num_items_in_batch", None)
            hidden = self.model(input_ids=input_ids, **kwargs).last_hidden_state
            logits = self.lm_head(hidden)
            loss = None
            if labels is not None:
                loss = self.loss_function(logits, labels, self.config.vocab_size)
            return CausalLMOutputWithPast(loss=loss, logits=logits)

    TextCausalLM.__name__ = TextCausalLM.__qualname__ = base_cls.__name__ + "ForCausalLM"
    # transformers reads the class's modeling module to see whether its experts can be
    # dispatched (experts_implementation=…): point it at the text model's own module
    TextCausalLM.__module__ = base_cls.__module__
    return TextCausalLM
