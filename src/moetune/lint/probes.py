"""Probes: demonstrate each rule's trap on the installed library versions.

Every probe builds the smallest thing that shows the trap (a 2-layer, 4-expert model on
the meta device, a subprocess, a library call) and returns whether the trap reproduced,
with the evidence. A probe that cannot run here raises ProbeUnavailable with the reason.
Heavy libraries are imported inside the probes so `moetune lint` never pays for them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata, util
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any
from unittest import mock

from moetune.lint.rules import ProbeOutcome, ProbeUnavailable
from moetune.model import spec_from_config
from moetune.model.census import shrunk_config
from moetune.model.counting import hf_config_object
from moetune.model.derive import build_language_model
from moetune.model.tiny import tiny_config as tiny_moe_config

if TYPE_CHECKING:
    from torch import nn

# peft's exact words (peft/tuners/lora/layer.py, ParamWrapper); rules quote them.
PEFT_DROPOUT_TEXT = "lora.ParamWrapper does not work with lora_dropout != 0"
EXPERT_PARAMS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
GLU_NAMES = ["gate_proj", "up_proj", "down_proj"]

_TINY = dict(
    hidden_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=8,
    vocab_size=32,
    intermediate_size=32,
    num_experts_per_tok=2,
)
_TINY_MOE: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(num_experts=4, moe_intermediate_size=8),
    "qwen2_moe": dict(num_experts=4, moe_intermediate_size=8, shared_expert_intermediate_size=16),
    "gpt_oss": dict(num_local_experts=4),
    # layer 0 dense (first_k_dense_replace), layer 1 MoE with one shared expert
    "deepseek_v3": dict(
        n_routed_experts=4,
        moe_intermediate_size=8,
        first_k_dense_replace=1,
        n_shared_experts=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=None,
        kv_lora_rank=8,
        qk_rope_head_dim=4,
        qk_nope_head_dim=4,
        v_head_dim=8,
    ),
}


# -- tiny transformers models and peft ------------------------------------------------------


def tiny_model(model_type: str, device: str = "meta", dtype: Any = None) -> nn.Module:
    """A 2-layer, 4-expert, hidden-16 causal LM of `model_type` (random or weightless)."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(model_type, **_TINY, **_TINY_MOE[model_type])
    with _quiet(), torch.device(device):
        return AutoModelForCausalLM.from_config(config, dtype=dtype or torch.bfloat16)


@contextmanager
def _quiet() -> Iterator[None]:
    """peft/transformers warnings (rank_pattern mismatch, tiny-vocab eos) are noise here."""
    # lazy: heavy to import (transformers)
    from transformers.utils import logging as tf_logging

    level = tf_logging.get_verbosity()
    tf_logging.set_verbosity(logging.CRITICAL)  # errors too: the gguf probe expects one
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        tf_logging.set_verbosity(level)


def adapted_modules(model: nn.Module, **lora: Any) -> set[str]:
    """Wrap `model` with LoraConfig(r=2, **lora); names (from `layers.`) that got a lora_A."""
    # lazy: heavy to import (peft)
    from peft import LoraConfig, get_peft_model

    with _quiet():
        peft_model = get_peft_model(model, LoraConfig(r=2, **lora))
    names = set()
    for name, _ in peft_model.named_parameters():
        if ".lora_A." in name and "layers." in name:
            module = name.split(".lora_A.")[0]
            names.add(module[module.index("layers.") :].replace(".base_layer", ""))
    return names


def _version(lib: str) -> str:
    try:
        return metadata.version(lib)
    except metadata.PackageNotFoundError:
        return "absent"


# -- peft / transformers traps ------------------------------------------------------------


def moe_lora_dropout() -> ProbeOutcome:
    """peft refuses lora_dropout != 0 on fused expert parameters."""
    model = tiny_model("qwen3_moe")
    try:
        adapted_modules(model, target_parameters=list(EXPERT_PARAMS), lora_dropout=0.1)
    except ValueError as err:
        return ProbeOutcome(PEFT_DROPOUT_TEXT in str(err), f"get_peft_model raised: {err}")
    return ProbeOutcome(False, "get_peft_model accepted lora_dropout=0.1 on fused experts")


def quantized_experts_peft() -> ProbeOutcome:
    """peft matches target_parameters only among Parameters: on experts stored quantised
    (buffers) it silently adapts nothing."""
    # lazy: heavy to import (torch, moetune.engine)
    import torch

    from moetune.engine.quant import quantize_experts_

    model = tiny_model("qwen3_moe", device="cpu", dtype=torch.float32)
    quantize_experts_(model, "int8", error_experts=0)
    try:  # attention too, as in a real recipe: the experts then go missing without a word
        adapted = adapted_modules(
            model, target_modules=["q_proj"], target_parameters=list(EXPERT_PARAMS)
        )
    except ValueError as err:  # a peft that refuses instead of skipping: the trap is gone
        return ProbeOutcome(False, f"get_peft_model raised instead: {err}")
    experts = sorted(n for n in adapted if "experts" in n)
    attention = sorted(n for n in adapted if "q_proj" in n)
    return ProbeOutcome(
        bool(attention) and not experts,
        f"adapted on quantised stacks: {len(attention)} q_proj, experts {experts or 'none'}",
    )


def _bnb_replaced(model: nn.Module) -> set[str]:
    """Modules transformers' bitsandbytes integration swaps for quantized ones (bnb itself is
    stubbed, so the selection logic runs without the library or a GPU)."""
    # lazy: heavy to import (torch, transformers)
    import torch
    from transformers import BitsAndBytesConfig
    from transformers.integrations import bitsandbytes as tf_bnb

    class QuantizedStub(torch.nn.Module):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__()

    stub = SimpleNamespace(nn=SimpleNamespace(Linear4bit=QuantizedStub, Linear8bitLt=QuantizedStub))
    with mock.patch.object(tf_bnb, "bnb", stub, create=True):
        tf_bnb.replace_with_bnb_linear(
            model, ["lm_head"], quantization_config=BitsAndBytesConfig(load_in_4bit=True)
        )
    return {n for n, m in model.named_modules() if isinstance(m, QuantizedStub)}


def _kbit_prepared_expert_dtype() -> str:
    """dtype of a bf16 fused expert stack after peft's prepare_model_for_kbit_training."""
    # lazy: heavy to import (peft)
    from peft import prepare_model_for_kbit_training

    model = tiny_model("qwen3_moe", device="cpu")
    with _quiet():
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    return str(dict(model.named_parameters())["model.layers.0.mlp.experts.gate_up_proj"].dtype)


def moe_4bit_bnb() -> ProbeOutcome:
    """bnb replaces only nn.Linear (experts stay bf16); kbit prep upcasts them to fp32."""
    replaced = _bnb_replaced(tiny_model("qwen3_moe"))
    experts_quantized = any(".experts" in n for n in replaced)
    attention_quantized = "model.layers.0.self_attn.q_proj" in replaced
    dtype = _kbit_prepared_expert_dtype()
    present = attention_quantized and not experts_quantized and dtype == "torch.float32"
    evidence = (
        f"bnb replacement quantized {len(replaced)} Linear modules, experts among them: "
        f"{experts_quantized}; prepare_model_for_kbit_training left the bf16 expert stack as "
        f"{dtype}"
    )
    return ProbeOutcome(present, evidence)


def peft_automap_drops_mlp() -> ProbeOutcome:
    """deepseek_v3: gate/up/down names are remapped to experts; dense + shared MLPs lose LoRA."""
    got = adapted_modules(tiny_model("deepseek_v3"), target_modules=[*GLU_NAMES, "o_proj"])
    dense = any(n.startswith("layers.0.mlp.") for n in got)
    shared = any(".shared_experts." in n for n in got)
    experts = "layers.1.mlp.experts" in got
    evidence = (
        f"target_modules gate/up/down_proj on a tiny deepseek_v3 adapted: dense MLP {dense}, "
        f"shared experts {shared}, routed experts {experts}"
    )
    return ProbeOutcome(experts and not dense and not shared, evidence)


def peft_qwen2moe_unmapped() -> ProbeOutcome:
    """qwen2_moe: gate/up/down names reach only the shared expert, never the fused experts."""
    got = adapted_modules(tiny_model("qwen2_moe"), target_modules=GLU_NAMES)
    experts = any(n.endswith("mlp.experts") for n in got)
    shared = any(".shared_expert." in n for n in got)
    evidence = f"qwen2_moe with gate/up/down_proj: routed experts {experts}, shared {shared}"
    return ProbeOutcome(shared and not experts, evidence)


def lora_router_targeted() -> ProbeOutcome:
    """ "all-linear" also adapts the qwen3_moe router (mlp.gate, via target_parameters)."""
    got = adapted_modules(tiny_model("qwen3_moe"), target_modules="all-linear")
    router = sorted(n for n in got if n.endswith("mlp.gate"))
    return ProbeOutcome(bool(router), f"all-linear on qwen3_moe adapted routers: {router}")


def lora_no_experts() -> ProbeOutcome:
    """gpt_oss has no peft name mapping: "all-linear" silently leaves every expert frozen."""
    got = adapted_modules(tiny_model("gpt_oss"), target_modules="all-linear")
    experts = sorted(n for n in got if ".experts" in n)
    evidence = f"all-linear on gpt_oss raised nothing and adapted {len(got)} modules, experts: "
    return ProbeOutcome(bool(got) and not experts, evidence + str(experts))


# -- mlx-lm (Apple silicon, Linux CPU) ----------------------------------------------------


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


# -- infrastructure walls ----------------------------------------------------------------------


def card_too_small() -> ProbeOutcome:
    """An allocation beyond the card's memory fails; PyTorch does not spill to host RAM."""
    # lazy: heavy to import (torch)
    import torch

    if not torch.cuda.is_available():
        raise ProbeUnavailable("needs a CUDA device (run the gpu tier on a GPU machine)")
    _, total = torch.cuda.mem_get_info()
    try:
        block = torch.empty(total + 2**30, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as err:
        return ProbeOutcome(True, f"allocating total+1 GiB raised OutOfMemoryError: {err}"[:300])
    del block
    return ProbeOutcome(False, f"allocated {total + 2**30} bytes on a {total}-byte card")


_XET_SCRIPT = """
import os, importlib.util
from huggingface_hub import constants
os.environ["HF_HUB_DISABLE_XET"] = "1"
from huggingface_hub import constants as again
print(again.HF_HUB_DISABLE_XET, importlib.util.find_spec("hf_xet") is not None)
"""


def hub_xet_enabled() -> ProbeOutcome:
    """hf-xet is on by default and HF_HUB_DISABLE_XET set after import is ignored."""
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", _XET_SCRIPT], capture_output=True, text=True, env=env, timeout=60
    )
    if proc.returncode != 0:
        return ProbeOutcome(False, f"probe script failed: {proc.stderr.strip()[-300:]}")
    late_flag, xet_installed = proc.stdout.split()
    evidence = (
        f"huggingface_hub {_version('huggingface_hub')}: HF_HUB_DISABLE_XET set after import "
        f"reads {late_flag}; hf_xet installed: {xet_installed}"
    )
    return ProbeOutcome(late_flag == "False" and xet_installed == "True", evidence)


def volume_too_small() -> ProbeOutcome:
    """The hub only warns when the disk is too small; the download then dies mid-way."""
    # lazy: heavy to import (huggingface_hub)
    from huggingface_hub import file_download

    check = getattr(file_download, "_check_disk_space", None)
    if check is None:
        return ProbeOutcome(False, "huggingface_hub no longer has _check_disk_space")
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        check(10**18, tmp)  # an exabyte never fits
    warned = [str(w.message)[:80] for w in caught]
    return ProbeOutcome(bool(warned), f"_check_disk_space(1 EB) did not raise; warned: {warned}")


def watchdog_too_short() -> ProbeOutcome:
    raise ProbeUnavailable(
        "in-pod watchdog behaviour needs a pod; the sizing is covered by the check() tests"
    )


def ci_step_timeout_missing() -> ProbeOutcome:
    raise ProbeUnavailable(
        "GitHub Actions timeout semantics cannot run offline; covered by the check() tests"
    )


def experts_not_dispatched() -> ProbeOutcome:
    """transformers builds some MoE families' experts without @use_experts_implementation
    (dbrx here), so moetune's split LoRA has no ExpertsInterface to plug into."""
    # lazy: heavy to import (moetune.engine)
    from moetune.engine.resolve import split_engine_serves

    served = split_engine_serves(spec_from_config(tiny_moe_config("dbrx"), "tiny-dbrx"))
    verb = "dispatch" if served else "do not dispatch"
    return ProbeOutcome(not served, f"dbrx experts {verb} through ExpertsInterface")


def gradient_checkpointing_unsupported() -> ProbeOutcome:
    """Some causal-LM classes (jetmoe on transformers 5.24) refuse activation checkpointing:
    `gradient_checkpointing_enable()` raises at the trainer's setup, after the model loaded."""
    model = build_language_model(hf_config_object("jetmoe", shrunk_config("jetmoe")), "jetmoe")
    try:
        model.gradient_checkpointing_enable()
    except ValueError as exc:
        return ProbeOutcome(True, f"jetmoe: {exc}")
    return ProbeOutcome(False, "jetmoe now supports gradient checkpointing")


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
