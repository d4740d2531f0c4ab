"""Which Linears a base kept as stored holds in its format's bytes – the rest stay float.

Publishers leave modules unquantised by name: compressed-tensors' `ignore` (Kimi-K2-Thinking's
INT4 keeps attention, the shared experts and the dense layers in bf16), ModelOpt's
`exclude_modules`, transformers' `modules_to_not_convert`. The plan counts each Linear as its
checkpoint stores it (engine/stored/formats.kept_float), so its frozen bytes are the files'.
"""

from __future__ import annotations

import json
from typing import Any

from moetune.model.build import build_model
from moetune.model.spec import ModelSpec


def stored_linear_params(spec: ModelSpec, qcfg: dict[str, Any]) -> int:
    """Weights of the non-expert Linears `qcfg` stores quantised (attention, dense and shared
    MLP: not embeddings, lm_head, norms, the router, nor what its lists keep float), counted on
    transformers' meta build; once per process for a model and a quantization_config."""
    key = (spec.name, spec.model_type, spec.total_params, json.dumps(qcfg, sort_keys=True))
    if key not in _PARAMS:
        _PARAMS[key] = sum(w for path, w in _linears(spec) if stores(qcfg, path))
    return _PARAMS[key]


def stores(qcfg: dict[str, Any], path: str) -> bool:
    """Whether the checkpoint holds the (non-expert) Linear at `path` in its format."""
    # lazy: heavy to import (torch via moetune.engine)
    from moetune.engine.stored.formats import kept_float, published_quantised

    return published_quantised(path) and not kept_float(qcfg, path)


def _linears(spec: ModelSpec) -> list[tuple[str, int]]:
    """(module path, weight count) of every Linear outside the routed experts."""
    # lazy: heavy to import (torch)
    from torch import nn

    return [(path, m.weight.numel()) for path, m in build_model(spec).named_modules()
            if isinstance(m, nn.Linear) and ".experts" not in f".{path}"]  # fmt: skip


_PARAMS: dict[tuple[str, str, int, str], int] = {}
