"""Probes of the checkpoint traps: a .gguf is only a lossy copy to train from, and remote
code runs at import.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from importlib import util
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.lint.probes.tiny import _TINY, _TINY_MOE, _quiet, _version
from moetune.lint.registry import ProbeOutcome

if TYPE_CHECKING:
    pass


def gguf_not_trainable() -> ProbeOutcome:
    """transformers cannot read a .gguf without the gguf package; with it (moetune's export
    installs it) it only dequantizes: a Q8_0 tensor comes back as float32 that differs from
    the weights it was quantized from – a lossy copy, never the original to train."""
    if util.find_spec("gguf") is None:
        return ProbeOutcome(True, "no gguf package: transformers cannot read a .gguf at all")
    with tempfile.TemporaryDirectory() as tmp:
        error, dtype = _dequantized_q8_error(f"{tmp}/tiny.gguf")
    evidence = f"gguf {_version('gguf')}: Q8_0 loads as {dtype}, max abs error {error:.3g}"
    return ProbeOutcome(error > 0 and "float" in dtype, evidence)


def _dequantized_q8_error(path: str) -> tuple[float, str]:
    """Write a 1-layer llama GGUF with one Q8_0 tensor, load it with transformers; (max abs
    error against the original, the loaded dtype)."""
    # lazy: heavy to import (gguf, numpy, torch, transformers)
    import gguf
    import numpy as np
    import torch
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    weights = np.random.default_rng(0).standard_normal((32, 32)).astype(np.float32)
    writer = gguf.GGUFWriter(path, "llama")
    for add, value in ((writer.add_block_count, 1), (writer.add_context_length, 8),
                       (writer.add_embedding_length, 32), (writer.add_feed_forward_length, 32),
                       (writer.add_head_count, 1)):  # fmt: skip
        add(value)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(4)])
    writer.add_token_scores([0.0] * 4)
    writer.add_token_types([1] * 4)
    q8 = gguf.quants.quantize(weights, gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("blk.0.attn_q.weight", q8, raw_shape=q8.shape,
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with _quiet():
        config = load_gguf_checkpoint(path)["config"]
        fields = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**fields))
        loaded = load_gguf_checkpoint(path, return_tensors=True, model_to_load=model)
    tensor = torch.as_tensor(loaded["tensors"]["model.layers.0.self_attn.q_proj.weight"])
    return float((tensor.float() - torch.from_numpy(weights)).abs().max()), str(tensor.dtype)


def remote_code_runs() -> ProbeOutcome:
    """transformers' dynamic-module loader – what trust_remote_code turns on – executes a
    checkpoint file's module-level code at import, with the user's rights."""
    # lazy: heavy to import (transformers)
    from transformers.dynamic_module_utils import get_class_from_dynamic_module
    from transformers.utils.hub import HF_MODULES_CACHE, TRANSFORMERS_DYNAMIC_MODULE_NAME

    with tempfile.TemporaryDirectory() as tmp:
        root, marker = Path(tmp) / f"moetune_probe_{os.getpid()}", Path(tmp) / "ran"
        root.mkdir()
        write = f"pathlib.Path({str(marker)!r}).write_text('ran')"
        code = f"import pathlib\n{write}\nclass Probe:\n    pass\n"
        (root / "probe_code.py").write_text(code, encoding="utf-8")
        try:
            get_class_from_dynamic_module("probe_code.Probe", str(root))
        finally:  # the loader copied the file into its module cache
            shutil.rmtree(Path(HF_MODULES_CACHE, TRANSFORMERS_DYNAMIC_MODULE_NAME, root.name),
                          ignore_errors=True)  # fmt: skip
        ran = marker.exists()
    said = "wrote" if ran else "did not write"
    return ProbeOutcome(ran, f"importing probe_code.Probe from a local dir {said} a file")


def empty_tokenizer_built() -> ProbeOutcome:
    """transformers builds a tokenizer from a model dir that holds no tokenizer file at all
    (config.json and weights only) – one that turns text into no ids – instead of failing."""
    # lazy: heavy to import (transformers)
    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp, _quiet():
        _tiny_config(max_position_embeddings=8).save_pretrained(tmp)
        try:
            tok = AutoTokenizer.from_pretrained(tmp, local_files_only=True)
        except (OSError, ValueError) as exc:
            return ProbeOutcome(False, f"refused: {str(exc).splitlines()[0]}")
    ids = tok("Hello, world", add_special_tokens=False)["input_ids"]
    evidence = f"a dir without tokenizer files gave {type(tok).__name__}: {len(tok)} tokens, "
    return ProbeOutcome(len(ids) == 0, evidence + f"'Hello, world' → {ids}")


def positions_unchecked() -> ProbeOutcome:
    """A qwen3_moe forward on more tokens than max_position_embeddings runs without a word:
    RoPE computes the positions it was never trained on, so nothing stops such a run."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(_tiny_config(max_position_embeddings=8)).eval()
    try:
        with torch.no_grad():
            logits = model(torch.arange(32).remainder(32)[None]).logits
    except (IndexError, RuntimeError, ValueError) as exc:
        return ProbeOutcome(False, f"32 tokens on 8 positions refused: {exc}")
    finite = bool(torch.isfinite(logits).all())
    return ProbeOutcome(finite, f"32 tokens on max_position_embeddings 8 ran: finite={finite}")


def _tiny_config(**over: int) -> Any:
    """The probes' 2-layer qwen3_moe config (tiny.py's sizes), with `over` on top."""
    # lazy: heavy to import (transformers)
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", **_TINY, **_TINY_MOE["qwen3_moe"], **over)
