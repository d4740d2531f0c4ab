"""Probes of the published-quantised-base traps (lint/rules/stored.py), on the installed
transformers: what its own quantizers do with an FP8 / MXFP4 checkpoint on this machine."""

from __future__ import annotations

from unittest import mock

from moetune.lint.registry import ProbeOutcome


def fp8_dequantised_on_cpu() -> ProbeOutcome:
    """transformers' FineGrainedFP8 quantizer, given a pre-quantised checkpoint and no GPU,
    turns `dequantize` on and loads bf16 – with a warning once, not an error."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import FineGrainedFP8Config
    from transformers.quantizers.quantizer_finegrained_fp8 import FineGrainedFP8HfQuantizer

    if torch.cuda.is_available():
        return ProbeOutcome(True, "a GPU is present: the CPU fallback is not exercised here")
    config = FineGrainedFP8Config(weight_block_size=(128, 128))
    quantizer = FineGrainedFP8HfQuantizer(config, pre_quantized=True)
    quantizer.validate_environment()
    return ProbeOutcome(bool(config.dequantize),
                        f"FineGrainedFP8 on CPU: dequantize={config.dequantize}")  # fmt: skip


def mxfp4_refuses_training() -> ProbeOutcome:
    """transformers' MXFP4 quantizer says the model is not trainable: a gpt-oss checkpoint
    loaded through it must be dequantised to bf16 first."""
    # lazy: heavy to import (transformers)
    from transformers import Mxfp4Config  # type: ignore[attr-defined]
    from transformers.quantizers.quantizer_mxfp4 import Mxfp4HfQuantizer

    quantizer = Mxfp4HfQuantizer(Mxfp4Config(), pre_quantized=True)
    trainable = quantizer.is_trainable
    return ProbeOutcome(not trainable, f"Mxfp4HfQuantizer.is_trainable = {trainable}")


def transformers_inflates() -> ProbeOutcome:
    """transformers' own path cannot train a published quantised base as stored: FP8 is
    inflated to bf16 on a CPU, MXFP4 refuses training."""
    fp8, mxfp4 = fp8_dequantised_on_cpu(), mxfp4_refuses_training()
    return ProbeOutcome(fp8.trap_present or mxfp4.trap_present,
                        f"{fp8.evidence}; {mxfp4.evidence}")  # fmt: skip


def fp8_block_from_grid() -> ProbeOutcome:
    """transformers' `Fp8Dequantize` takes the block as weight rows / scale rows instead of
    config.json's weight_block_size: DeepSeek's 576-row kv_a_proj_with_mqa (a ceil grid of 5)
    is refused, and a 192-row one (grid 2: block 96, not 128) is scaled wrongly without a
    word. The reference is DeepSeek's weight_dequant: W[i, j] = q[i, j] · s[i // 128, j // 128]."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    dequant = Fp8Dequantize(None)._dequantize_one
    q = torch.ones(576, 128).to(torch.float8_e4m3fn)
    try:
        dequant(q, torch.ones(5, 1), output_dtype=torch.float32)
        refused = "dequantised"
    except ValueError as exc:
        refused = f"refused ({exc})"
    scale = torch.tensor([[1.0], [2.0]])  # rows 0..127 scale 1, rows 128..191 scale 2
    got = dequant(q[:192], scale, output_dtype=torch.float32)
    want = scale.repeat_interleave(128, dim=0)[:192].expand(192, 128)
    wrong = int((got != want).any(dim=1).sum())
    return ProbeOutcome(refused != "dequantised" or wrong > 0,
                        f"576 rows / grid 5: {refused}; 192 rows / grid 2: {wrong} rows "
                        "mis-scaled")  # fmt: skip


def bnb_import_only_at_load() -> ProbeOutcome:
    """transformers' bitsandbytes quantizer calls a pre-quantised 4-bit base trainable
    whether or not bitsandbytes is installed, and raises its ImportError only when the
    weights load (`validate_environment`): after the plan, on the machine that trains."""
    # lazy: heavy to import (transformers)
    import transformers.quantizers.quantizer_bnb_4bit as bnb4
    from transformers import BitsAndBytesConfig

    quantizer = bnb4.Bnb4BitHfQuantizer(BitsAndBytesConfig(load_in_4bit=True), pre_quantized=True)
    with mock.patch.object(bnb4, "is_bitsandbytes_available", lambda: False):
        try:
            quantizer.validate_environment()
        except ImportError as exc:
            return ProbeOutcome(bool(quantizer.is_trainable), f"at load: {exc}")
    return ProbeOutcome(False, "validate_environment passed with bitsandbytes missing")
