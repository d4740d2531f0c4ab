"""Training engines that plug into transformers and peft instead of replacing them.

Importing this package registers the "moetune_lora" experts implementation
(`experts_lora`): split LoRA for fused MoE experts, trained on peft's own adapter
parameters, so adapters stay in the peft format; "moetune_ep" (`expert_parallel`): split
LoRA with the experts placed over a DeviceMesh (train.strategy ep); and the quantisers:
int8 / NF4 (quant/int8_nf4.py) and each published format (stored/fp8.py, …).
`forwards`: per-model-type forwards for experts peft's wrappers cannot reach
(forwards_dbrx.py, registered here: the registry module imports none of its plug-ins).
"""

from moetune.engine import expert_parallel as _ep  # noqa: F401  (registers "moetune_ep")
from moetune.engine import forwards_dbrx as _dbrx  # noqa: F401  (registers its override)
from moetune.engine.experts_lora import (
    IMPLEMENTATION,
    EngineError,
    SplitParamWrapper,
    apply_lora_dropout,
    apply_split_lora,
    is_split,
    register,
    restore_peft_lora,
    split_lora_experts_forward,
    train_only,
)
from moetune.engine.quant import int8_nf4 as _quant_int  # noqa: F401  (registers int8 / NF4)
from moetune.engine.stored import (  # noqa: F401  (each registers its published format)
    awq,
    ct_fp8,
    ct_nvfp4,
    fp8,
    fp8_scaled,
    gptq,
    int4,
    mxfp4,
    nvfp4,
)

__all__ = [
    "IMPLEMENTATION",
    "EngineError",
    "SplitParamWrapper",
    "apply_lora_dropout",
    "apply_split_lora",
    "is_split",
    "register",
    "restore_peft_lora",
    "split_lora_experts_forward",
    "train_only",
]
