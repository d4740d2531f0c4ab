"""int8 / NF4 frozen expert stacks (engine/quant/stacks.py, engine/quant/load.py).

Formats are checked against hand-computed values and known tables, then on tiny models of
four experts layouts: concatenated [E, out, in] (qwen3_moe, olmoe, mixtral – whose
checkpoint keeps per-expert w1/w2/w3 keys) and gpt_oss (interleaved gate/up, transposed
[E, in, out], biases). Tiny models use initializer_range 0.1 so the experts move the logits.
"""

from __future__ import annotations

import copy
import gc
import json
import warnings
import weakref
from typing import Any

import pytest
import torch
import transformers
from peft import LoraConfig, get_peft_model
from peft.tuners.lora.layer import ParamWrapper
from peft.utils import get_peft_model_state_dict, set_peft_model_state_dict
from transformers.integrations.accelerate import get_device

from moetune.engine import apply_split_lora
from moetune.engine.quant import stacks as quant
from moetune.engine.quant.int8_nf4 import NF4, NF4_LEVELS, pack_nibbles, unpack_nibbles
from moetune.engine.quant.load import expert_device_map, load_quantized
from moetune.engine.quant.stacks import (
    QUANTIZED,
    QUANTIZERS,
    QuantError,
    QuantizedStack,
    expert_linear,
    expert_weight,
    experts_modules,
    peft_targets,
    quantize_experts_,
    quantizer_for,
    shardable_,
    stack_nbytes,
    stacks_of,
)
from moetune.model.tiny import tiny_config
from moetune.registry import Registry

pytestmark = pytest.mark.filterwarnings("ignore")

FAMILIES = ["qwen3_moe-dense0", "olmoe", "mixtral", "gpt_oss"]
# relative Frobenius error of one matrix on Gaussian weights (measured: int8 0.0066, nf4 0.092)
MATRIX_BOUND = {"int8": 1e-2, "nf4": 0.1}
# relative output error per stack on the fixed batch, mean over experts (tiny, odd shapes)
STACK_BOUND = {"int8": 1e-2, "nf4": 0.12}
# relative logit error; measured int8 ≤ 0.006, nf4 0.02–0.04, gpt_oss nf4 0.18 (its tiny
# model is that sensitive: Gaussian noise of NF4's size on its experts moves logits 0.20)
LOGIT_BOUND = {"int8": 1e-2, "nf4": 0.25}
METHODS = [("int8", False), ("nf4", False), ("nf4", True)]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def _model(variant: str, **over: Any) -> Any:
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model(
        **{**tiny_config(variant), "initializer_range": 0.1, **over}
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return transformers.AutoModelForCausalLM.from_config(config).eval()


def _ids() -> torch.Tensor:
    return torch.randint(3, 64, (2, 12), generator=torch.Generator().manual_seed(1))


@torch.no_grad()
def _logits(model: Any) -> torch.Tensor:
    return model(_ids()).logits


def _dequantized_copy(model: Any) -> Any:
    """The quantised model with float Parameters (from its stacks) in their place."""
    copy_ = copy.deepcopy(model)
    for module in list(copy_.modules()):
        stacks = stacks_of(module)
        module._modules.pop(QUANTIZED, None)  # so attribute reads find the Parameters
        for name, stack in stacks.items():
            module.register_parameter(name, torch.nn.Parameter(stack.dequantize(), False))
    return copy_


# ------------------------------------------------------------------------ formats


def test_nf4_levels_are_qlora_normal_quantiles() -> None:
    """bitsandbytes' create_normal_map: 8 quantiles above 0, 7 below, an exact 0, scaled."""
    offset = 0.9677083
    pos = torch.special.ndtri(torch.linspace(offset, 0.5, 9, dtype=torch.float64)[:-1])
    neg = -torch.special.ndtri(torch.linspace(offset, 0.5, 8, dtype=torch.float64)[:-1])
    levels = torch.cat([pos, neg, torch.zeros(1, dtype=torch.float64)]).sort().values
    torch.testing.assert_close(NF4_LEVELS.double(), levels / levels.abs().max(), atol=1e-6, rtol=0)


def test_int8_matches_hand_computation() -> None:
    w = torch.tensor([[[1.0, -2.2, 0.5, 4.0], [0.0, 0.0, 0.0, 0.0], [-3.0, 3.0, 1.2, 0.0]]])
    stack = QuantizedStack.from_float(w, "int8")
    # scale = row absmax / 127; codes = round(w / scale): 31.75, -69.85, 15.875, 127 | 50.8
    assert stack.codes.tolist() == [[[32, -70, 16, 127], [0, 0, 0, 0], [-127, 127, 51, 0]]]
    torch.testing.assert_close(stack.scales, torch.tensor([[4 / 127, 0.0, 3 / 127]]))
    assert torch.equal(stack.dequantize(), stack.codes.float() * stack.scales.unsqueeze(-1))
    assert stack.dequantize()[0, 1].eq(0).all()  # an all-zero row stays exactly zero


@pytest.mark.parametrize("method", ["int8", "nf4", "nf4dq"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_expert_in_a_reused_buffer_is_the_dequantised_one(
    method: str, dtype: torch.dtype
) -> None:
    """The split path's per-expert weights (a buffer reused across experts; int8's row scales
    kept apart) are the stack's dequantised experts, bit for bit."""
    w = torch.randn(3, 48, 128, generator=torch.Generator().manual_seed(0))
    stack = QuantizedStack.from_float(w, method.removesuffix("dq"), double_quant=method == "nf4dq")
    into = torch.empty(48, 128, dtype=dtype)
    for e in range(3):
        v, scale = stack.factored_expert(e, into)
        expected = stack.canonical_expert(e, dtype)
        if scale is None:
            assert torch.equal(v, expected)
        else:  # W = s[:, None]·V with V the codes, exact in the compute dtype
            assert torch.equal(v, stack.codes[e].to(dtype))
            assert torch.equal((scale.unsqueeze(-1) * v.float()).to(dtype), expected)


def test_nf4_table_values_dequantise_exactly() -> None:
    index = torch.randperm(64, generator=torch.Generator().manual_seed(0)) % 16
    block = NF4_LEVELS[index]
    w = torch.stack([block * 2.5, block.flip(0) * 0.75]).view(1, 2, 64)  # [E=1, out=2, in=64]
    stack = QuantizedStack.from_float(w, "nf4")
    assert unpack_nibbles(stack.codes).view(2, 64).tolist() == [
        index.tolist(),
        index.flip(0).tolist(),
    ]
    assert stack.absmax.tolist() == [[2.5, 0.75]]
    assert torch.equal(stack.dequantize(), w)


def test_nibble_packing_is_lossless_high_nibble_first() -> None:
    codes = torch.randint(0, 16, (3, 50), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)
    assert pack_nibbles(torch.tensor([[0x1, 0x2, 0xF, 0x0]], dtype=torch.uint8)).tolist() == [
        [0x12, 0xF0]
    ]


@pytest.mark.parametrize("transposed", [False, True])
def test_roundtrip_error_bounds(transposed: bool) -> None:
    w = torch.randn(4, 96, 128, generator=torch.Generator().manual_seed(0))
    errors = {}
    for method, dq in METHODS:
        stack = QuantizedStack.from_float(w, method, transposed=transposed, double_quant=dq)
        back = stack.dequantize()
        assert back.shape == w.shape and back.dtype == w.dtype
        errors[method, dq] = torch.tensor([_rel(b, a) for a, b in zip(w, back, strict=True)])
        assert errors[method, dq].max() <= MATRIX_BOUND[method], (method, dq, errors[method, dq])
    # double quantisation of the absmax scales adds little to NF4's own error
    assert (errors["nf4", True] <= 1.05 * errors["nf4", False]).all()


@pytest.mark.parametrize(("method", "dq"), METHODS)
def test_expert_reads_only_its_own_storage(method: str, dq: bool) -> None:
    w = torch.randn(4, 48, 80, generator=torch.Generator().manual_seed(0))  # 80: blocks wrap
    for transposed in (False, True):
        stack = QuantizedStack.from_float(w, method, transposed=transposed, double_quant=dq)
        full = stack.dequantize()
        for e in range(4):
            assert stack.expert(e).shape == w[e].shape
            assert torch.equal(stack.expert(e), full[e])
        for buf in stack.buffers():  # poison every expert but 2
            buf[[0, 1, 3]] = float("nan") if buf.is_floating_point() else 7
        assert torch.equal(stack.expert(2), full[2])


def test_nbytes_against_bf16() -> None:
    w = torch.randn(8, 256, 512).to(torch.bfloat16)
    ratios = {}
    for method, dq in METHODS:
        stack = QuantizedStack.from_float(w, method, double_quant=dq)
        assert stack.nbytes == stack_nbytes((8, 256, 512), method, double_quant=dq)
        ratios[method, dq] = stack.nbytes / w.nbytes
    assert ratios["int8", False] == pytest.approx(1 / 2 + 4 / (2 * 512))  # fp32 scale per row
    assert ratios["nf4", False] == pytest.approx(1 / 4 + 4 / (2 * 64))  # fp32 absmax per 64
    assert 1 / 4 < ratios["nf4", True] < 1 / 4 + 1.1 / (2 * 64)  # int8 absmax per 64
    # odd sizes pad each expert to whole blocks, and the formula still agrees
    odd = QuantizedStack.from_float(torch.randn(3, 24, 16), "nf4", double_quant=True)
    assert odd.nbytes == stack_nbytes((3, 24, 16), "nf4", double_quant=True)


def test_to_moves_storage_and_keeps_it_exact() -> None:
    stack = QuantizedStack.from_float(torch.randn(2, 8, 64).to(torch.bfloat16), "nf4")
    absmax = stack.absmax.clone()
    assert list(stack.parameters()) == [] and stack.dtype == torch.bfloat16
    stack.to(torch.float16)  # a float cast changes the compute dtype, not the storage
    assert stack.absmax.dtype == torch.float32 and torch.equal(stack.absmax, absmax)
    assert stack.dequantize().dtype == torch.float16 and stack.expert(1).dtype == torch.float16
    moved = copy.deepcopy(stack).to("meta")
    assert {b.device.type for b in moved.buffers()} == {"meta"}
    assert set(stack.state_dict()) == {"codes", "absmax"}


@pytest.mark.parametrize(("method", "dq"), METHODS)
def test_a_shardable_stack_holds_the_same_bytes_as_frozen_parameters(method: str, dq: bool) -> None:
    """What FSDP2 shards (Parameters, not buffers): every stored tensor, floats as bytes so a
    mixed-precision cast never touches them; the same state-dict names and values; the
    stacks in the float module's order whatever order they were installed in."""
    model = _model("qwen3_moe-dense0")
    quantize_experts_(model, method, dq)
    experts = next(m for m in model.modules() if stacks_of(m))
    holder = experts._modules[QUANTIZED]
    holder._modules = dict(reversed(holder._modules.items()))  # as a streamed load may install
    before, logits = copy.deepcopy(model.state_dict()), _logits(model)
    shardable_(model)
    assert list(stacks_of(experts)) == ["gate_up_proj", "down_proj"]
    stack = stacks_of(experts)["down_proj"]
    assert list(stack.buffers()) == [] and stack.parameters()
    assert all(not p.requires_grad and not p.is_floating_point() for p in stack.parameters())
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(model.state_dict()[k].view(v.dtype), v) for k, v in before.items())
    assert torch.equal(_logits(model), logits)
    held = {k: v.clone() for k, v in stack.stored().items()}
    model.to(torch.bfloat16)  # a float cast: the compute dtype, never the stored bytes
    assert stack.dtype == torch.bfloat16 and stack.dequantize().dtype == torch.bfloat16
    assert all(torch.equal(stack.stored()[k], v) for k, v in held.items())
    assert stack.nbytes == stack_nbytes(stack.shape, method, double_quant=dq)


def test_registry_prefers_available_library_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    class LibraryNF4(NF4):
        name, priority, present = "nf4-lib", 10, False

        @classmethod
        def available(cls) -> bool:
            return cls.present

    with_library: Registry[Any] = Registry("quantizer backend", QuantError)
    for name, backend in QUANTIZERS.items():
        with_library.add(name, backend)
    with_library.add("nf4-lib", LibraryNF4)
    monkeypatch.setattr(quant, "QUANTIZERS", with_library)
    assert quantizer_for("nf4") is NF4
    LibraryNF4.present = True
    assert quantizer_for("nf4") is LibraryNF4
    assert QuantizedStack.from_float(torch.randn(1, 4, 64), "nf4").backend is LibraryNF4
    with pytest.raises(QuantError, match="fp8"):
        quantizer_for("fp8")
    with pytest.raises(QuantError, match="double-quantise"):
        quantizer_for("int8", double_quant=True)


# ------------------------------------------------------------------------ models


@pytest.mark.parametrize("method", ["int8", "nf4"])
@pytest.mark.parametrize("variant", FAMILIES)
def test_quantize_experts_frees_floats_and_bounds_error(variant: str, method: str) -> None:
    model = _model(variant)
    reference = _logits(model)
    found = list(experts_modules(model))
    originals = {(p, n): getattr(m, n) for p, m, names in found for n in names}
    shapes = {key: tuple(param.shape) for key, param in originals.items()}
    alive = [weakref.ref(param) for param in originals.values()]
    params_before = sum(p.nbytes for p in model.parameters())
    del originals

    report = quantize_experts_(model, method)
    gc.collect()
    assert all(ref() is None for ref in alive), "a float expert stack is still referenced"
    assert not [n for n, p in model.named_parameters() if p.ndim == 3 and "experts" in n]
    assert sum(p.nbytes for p in model.parameters()) == params_before - report.bytes_before
    for path, module, _ in found:
        for name, stack in stacks_of(module).items():
            assert stack.shape == shapes[path, name] == getattr(module, name).shape

    assert {(s.layer, s.projection) for s in report.stacks} == set(shapes)
    assert all(s.error_mean <= STACK_BOUND[method] for s in report.stacks), report.to_json()
    assert report.bytes_after < report.bytes_before
    assert json.loads(json.dumps(report.to_json()))["layers"][found[0][0]]["down_proj"]

    quantized = _logits(model)  # stock experts forward, each stack dequantised on read
    assert torch.allclose(quantized, _logits(_dequantized_copy(model)), atol=1e-5)
    assert _rel(quantized, reference) <= LOGIT_BOUND[method]


@pytest.mark.parametrize("variant", ["qwen3_moe-dense0", "gpt_oss"])
def test_expert_weight_and_linear_quantised_or_not(variant: str) -> None:
    model = _model(variant)
    _, experts, _ = next(experts_modules(model))
    float_w = experts.down_proj.detach().clone()
    x = torch.randn(5, experts.down_proj.shape[1 if experts.is_transposed else 2])
    expected = x @ float_w[1] if experts.is_transposed else x @ float_w[1].T
    assert torch.equal(expert_weight(experts, "down_proj", 1, torch.float32), float_w[1])
    torch.testing.assert_close(expert_linear(experts, "down_proj", 1, x), expected)

    quantize_experts_(model, "int8")
    stack = stacks_of(experts)["down_proj"]
    assert torch.equal(expert_weight(experts, "down_proj", 1, torch.float32), stack.expert(1))
    assert _rel(expert_weight(experts, "down_proj", 1, torch.float32), float_w[1]) < 1e-2

    saved: list[torch.Size] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor.shape)
        return tensor

    x.requires_grad_(True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        y = expert_linear(experts, "down_proj", 1, x)
    assert _rel(y, expected) < 1e-2
    assert stack.expert(1).shape not in saved  # the dequantised matrix is not kept for backward
    y.square().sum().backward()
    w = stack.expert(1)
    reference = x.detach().requires_grad_(True)
    (reference @ w if experts.is_transposed else reference @ w.T).square().sum().backward()
    torch.testing.assert_close(x.grad, reference.grad)


def test_peft_targets_puts_lora_on_quantised_experts() -> None:
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"], target_parameters=experts)
    base = _model("qwen3_moe-dense0")
    float_peft = get_peft_model(copy.deepcopy(base), lora)
    for name, param in float_peft.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)

    quantized = copy.deepcopy(base)
    quantize_experts_(quantized, "int8")
    # the trap: peft matches target_parameters among Parameters, silently adds nothing
    bare = get_peft_model(copy.deepcopy(quantized), lora)
    assert not any(isinstance(m, ParamWrapper) for m in bare.modules())
    with peft_targets(quantized):
        quant_peft = get_peft_model(quantized, lora)
    assert sum(isinstance(m, ParamWrapper) for m in quant_peft.modules()) == 4
    assert not [n for n, p in quant_peft.named_parameters() if p.ndim == 3]  # stand-ins gone
    set_peft_model_state_dict(quant_peft, get_peft_model_state_dict(float_peft))

    apply_split_lora(float_peft)
    apply_split_lora(quant_peft)  # its stock path would parametrize a Parameter that is gone
    logits = quant_peft(_ids()).logits
    assert _rel(logits, float_peft(_ids()).logits) <= LOGIT_BOUND["int8"]
    logits.square().mean().backward()
    grads = [n for n, p in quant_peft.named_parameters() if p.grad is not None]
    assert any("experts" in n and "lora_A" in n for n in grads)


# ------------------------------------------------------------------------ loading


def _saved(variant: str, tmp_path: Any) -> tuple[Any, Any]:
    model = _model(variant)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path)
    return model, tmp_path


@pytest.mark.parametrize("variant", ["qwen3_moe-tied-local_experts", "mixtral", "gpt_oss"])
def test_load_quantized_streams_stacks_through_cpu(
    variant: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, path = _saved(variant, tmp_path)
    expected = quantize_experts_(copy.deepcopy(model), "nf4")
    from transformers import core_model_loading

    real_set = core_model_loading.set_param_for_module
    arrivals: list[tuple[str, str, int]] = []

    def spy(target: Any, name: str, value: torch.Tensor, *args: Any) -> None:
        # when any tensor arrives, no expert stack sits in the model as a float Parameter
        floats = [n for n, p in target.named_parameters() if p.ndim == 3 and not p.is_meta]
        assert not floats, floats
        arrivals.append((name, value.device.type, value.ndim))
        real_set(target, name, value, *args)

    monkeypatch.setattr(core_model_loading, "set_param_for_module", spy)
    loaded, report = load_quantized(path, "nf4", "cpu", torch.float32, error_experts=None)

    stacks = [name for name, _, ndim in arrivals if ndim == 3]
    assert len(stacks) == len(expected.stacks) == len(report.stacks)
    assert not [n for n, p in loaded.named_parameters() if p.ndim == 3 or p.is_meta]
    errors = {(s.layer, s.projection): (s.error_mean, s.bytes_after) for s in report.stacks}
    assert errors == {
        (s.layer, s.projection): (s.error_mean, s.bytes_after) for s in expected.stacks
    }
    logits = _logits(loaded)
    assert torch.allclose(logits, _logits(_dequantized_copy(loaded)), atol=1e-5)
    assert _rel(logits, _logits(model)) <= LOGIT_BOUND["nf4"]


def test_device_map_stages_only_expert_stacks_on_cpu() -> None:
    """transformers' own resolver: stacks (and expert biases) -> cpu, everything else -> GPU."""
    config = transformers.AutoConfig.for_model(**tiny_config("gpt_oss"))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    device_map = expert_device_map([p for p, _, _ in experts_modules(model)], "cuda:0")
    placed = {name: get_device(device_map, name) for name in model.state_dict()}
    assert {n for n, d in placed.items() if d == "cpu"} == {
        n for n in placed if ".mlp.experts." in n
    }
    assert {d for n, d in placed.items() if ".experts." not in n} == {"cuda:0"}


def test_load_quantized_names_a_missing_checkpoint(tmp_path: Any) -> None:
    model = _model("mixtral")
    model.config.save_pretrained(tmp_path)
    with pytest.raises(QuantError, match="safetensors"):
        load_quantized(tmp_path, "int8", "cpu")


@pytest.mark.gpu
def test_load_quantized_never_puts_a_float_stack_on_the_gpu(tmp_path: Any) -> None:
    over = {"hidden_size": 256, "moe_intermediate_size": 512, "num_experts": 8, "head_dim": 64}
    model = _model("qwen3_moe-dense0", **over)
    model.save_pretrained(tmp_path)
    largest = max(p.nbytes for n, p in model.named_parameters() if p.ndim == 3) // 2  # bf16
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loaded, _ = load_quantized(tmp_path, "nf4", "cuda")
    final = torch.cuda.memory_allocated() - before
    assert torch.cuda.max_memory_allocated() - before < final + largest // 2
    assert loaded(_ids().cuda()).logits.isfinite().all()
