"""ModelSpec for any model transformers builds: a meta-device build, read by structure.

No family table: the language model is transformers' own causal-LM class for the config
(for multimodal checkpoints the one inside `text_config`), built on the meta device, and
every parameter is put into a component by where it sits:

- routed experts: modules transformers dispatches with `use_experts_implementation` (or,
  undecorated, modules holding 3-D stacks / per-expert ModuleLists named `experts`);
- the MoE block is the experts' parent: its children named `shared…` are shared experts,
  the rest (router weights, score-correction biases) routers;
- norms: any `…Norm` module; dense MLPs: a layer child named like an MLP without experts;
- attention: every other layer child (the token mixer: GQA, MLA, linear attention, Mamba…,
  its kind named in `ModelSpec.mixers`);
- outside the layers: input embeddings, the output head (tied: counted once), norms, and
  `other` (MTP heads and the like).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from moetune.errors import ConfigError, UnknownFamilyError
from moetune.model.counting import (
    CHECKPOINT_ONLY_KEYS,
    PRIVATE_KEYS,
    hf_config_object,
    plain_floats,
    quiet_transformers,
)
from moetune.model.families import ExpertsLayout, ModulePaths
from moetune.model.sanity import check_config
from moetune.model.spec import Components, ModelSpec

if TYPE_CHECKING:
    from torch import nn

# config fields that name the experts each token is routed to (first set one wins)
TOP_K_FIELDS = (
    "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "moe_top_k",
    "top_k", "top_k_experts", "n_activated_experts", "experts_per_token", "num_selected_experts",
)  # fmt: skip
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "mlp_block")


@dataclass(frozen=True)
class Derived:
    """What a meta build says about one config: the spec and where its parts live."""

    spec: ModelSpec
    paths: ModulePaths
    layout: ExpertsLayout
    layers_prefix: str


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
    with quiet_transformers():
        return _read_build(model, config, raw, name)


def _config_object(model_type: str, kwargs: dict[str, Any], name: str) -> Any:
    from transformers import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        raise UnknownFamilyError(
            f"{name}: transformers {transformers.__version__} does not know model_type "
            f"{model_type!r}",
            "upgrade transformers (pip install -U transformers) or check the model_type",
        )
    return hf_config_object(model_type, kwargs, name)


def _text_config(config: Any) -> Any:
    """The language model's config: `text_config` of a multimodal checkpoint, else itself."""
    sub = getattr(type(config), "sub_configs", None) or {}
    text = getattr(config, "text_config", None) if "text_config" in sub else None
    return text if text is not None else config


def causal_lm_class(config: Any) -> Any:
    """transformers' causal-LM class for `config` (the auto mapping, else the modeling
    module's `…ForCausalLM` whose config_class is this config's class)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        pass
    for candidate in module_classes(type(config)):
        if candidate.__name__.endswith("ForCausalLM") and _serves(candidate, config):
            return candidate
    from moetune.model.textlm import text_lm_class, text_model_class

    base = text_model_class(config) if _is_text_of_multimodal(config) else None
    if base is not None:  # a multimodal checkpoint's language model: its text model + head
        config_cls: Any = type(config)
        return text_lm_class(config_cls, base)
    raise UnknownFamilyError(
        f"transformers has no causal-LM class for {config.model_type!r} (encoder-decoder "
        "or encoder-only models cannot be fine-tuned as a decoder)",
        "pick a decoder model; moetune fine-tunes causal language models",
    )


def _serves(candidate: type, config: Any) -> bool:
    return getattr(candidate, "config_class", None) is type(config)


def _is_text_of_multimodal(config: Any) -> bool:
    """A `text_config` class of some multimodal config (not a vision or audio tower)."""
    from transformers import CONFIG_MAPPING

    for top in CONFIG_MAPPING.values():
        if (getattr(top, "sub_configs", None) or {}).get("text_config") is type(config):
            return True
    return False


def module_classes(config_cls: type) -> list[type]:
    package = config_cls.__module__.rpartition(".")[0]
    try:
        module = importlib.import_module(f"{package}.modeling_{package.rpartition('.')[2]}")
    except ImportError:
        return []
    return [v for v in vars(module).values() if isinstance(v, type)]


def build_language_model(config: Any, name: str = "custom", device: str = "meta", **kw: Any) -> Any:
    """The causal LM for a transformers config, built on `device` (meta: no memory)."""
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


# ------------------------------------------------------------------ reading the build


def is_experts(module: nn.Module) -> bool:
    """Routed experts: an `@use_experts_implementation` module, a module holding 3-D
    stacks, or an undecorated `…Experts` / `experts` container."""
    if "is_concatenated" in vars(module):  # set by the decorator's __init__
        return True
    if "Conv" not in type(module).__name__ and any(
        p.dim() == 3 for p in module.parameters(recurse=False)
    ):
        return True
    return type(module).__name__.endswith("Experts")


def find_layers(model: nn.Module, num_layers: int | None) -> tuple[str, list[nn.Module]]:
    """(prefix, layers): the ModuleList of decoder layers (the largest one by parameters)."""
    from torch import nn

    best: tuple[int, int, str, list[nn.Module]] = (0, -1, "", [])
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or not len(module) or _inside_experts(path):
            continue
        size = sum(p.numel() for p in module.parameters())
        rank = (int(len(module) == num_layers), size)  # the configured count first
        if rank > best[:2]:
            best = (*rank, path, list(module))
    if best[1] < 0:
        raise ConfigError(
            f"the {type(model).__name__} build has no list of {num_layers} decoder layers",
            "check num_hidden_layers in config.json",
        )
    return best[2], best[3]


def _inside_experts(path: str) -> bool:
    return ".experts" in f".{path}"


@dataclass
class _Layer:
    """One decoder layer's parameters by component, and its parts' paths."""

    counts: dict[str, int]
    experts: list[tuple[str, nn.Module]]
    paths: dict[str, list[str]]
    mixer: str
    module: nn.Module
    top_k: int = 0  # a router's own `top_k` attribute, where the config names none


def _classify_layer(layer: nn.Module) -> _Layer:
    from torch import nn

    counts = dict.fromkeys(("attention", "dense_mlp", "routed_experts", "shared_experts",
                            "routers", "norms", "other"), 0)  # fmt: skip
    paths: dict[str, list[str]] = {k: [] for k in ("attention", "expert_params", "dense_mlp",
                                                    "shared", "router")}  # fmt: skip
    experts = [(p, m) for p, m in layer.named_modules() if p and is_experts(m)]
    experts = [(p, m) for p, m in experts if not any(p.startswith(f"{q}.") for q, _ in experts)]
    blocks = {p.rpartition(".")[0]: p for p, _ in experts}
    mixer = _mixer_kind(layer, blocks, experts)
    for pname, param in layer.named_parameters():
        kind = _kind_of(pname, layer, experts, blocks)
        if mixer == "mamba" and kind in ("attention", "norms") and _in_mixer(layer, pname):
            kind = "other"  # SSM mixers: counted apart, no LoRA target (CUDA kernels read
        counts[kind] += param.numel()  # their weights directly)
    for mpath, module in layer.named_modules():
        kind = _kind_of(f"{mpath}.weight", layer, experts, blocks)
        if kind == "attention" and mixer == "mamba":
            continue
        if module.__class__ is nn.Linear and module.out_features == 1:
            continue  # a scalar gate (qwen2_moe's shared_expert_gate), not a projection
        if isinstance(module, nn.Linear) and kind in ("attention", "dense_mlp", "shared_experts"):
            path = _leaf_if_unique(layer, mpath) if kind == "attention" else mpath
            paths[{"shared_experts": "shared"}.get(kind, kind)].append(path)
        elif kind == "routers" and mpath in _router_children(blocks, layer):
            paths["router"].append(_weight_holder(module, mpath))
    for epath, module in experts:
        paths["expert_params"] += [f"{epath}.{n}" for n in _stack_names(module)]
    top_k = next((k for m in layer.modules() if (k := _first_int(m, ("top_k",)))), 0)
    return _Layer(counts, experts, paths, mixer, layer, top_k)


def _in_mixer(layer: nn.Module, pname: str) -> bool:
    """Inside a layer child that is neither a norm nor an MLP block (the token mixer)."""
    from torch import nn

    top = pname.split(".")[0]
    child = getattr(layer, top, None)
    return isinstance(child, nn.Module) and not is_norm(child) and top not in _MLP_NAMES


def _stack_names(module: nn.Module) -> list[str]:
    """The expert weight stacks LoRA adapts: 3-D parameters, or the 2-D flattened ones of
    families without 3-D stacks (dbrx); never the biases."""
    named = [(n, p) for n, p in module.named_parameters() if not n.endswith("bias")]
    rank = 3 if any(p.dim() == 3 for _, p in named) else 2
    return [n for n, p in named if p.dim() == rank]


def _weight_holder(module: nn.Module, path: str) -> str:
    """The router's module that holds its weight (dbrx: `router.layer`)."""
    if "weight" in module._parameters:
        return path
    inner = next((n for n, m in module.named_modules() if "weight" in m._parameters), "")
    return f"{path}.{inner}" if inner else path


def _leaf_if_unique(layer: nn.Module, path: str) -> str:
    """A mixer Linear by its leaf name (peft's `q_proj` style) when no other module of the
    layer has that leaf name, else by its layer-relative path."""
    leaf = path.rpartition(".")[2]
    same = [p for p, _ in layer.named_modules() if p.rpartition(".")[2] == leaf]
    return leaf if same == [path] else path


def _router_children(blocks: dict[str, str], layer: nn.Module) -> set[str]:
    """Children of a MoE block that are neither its experts nor its shared experts."""
    out: set[str] = set()
    for block, epath in blocks.items():
        parent = layer.get_submodule(block) if block else layer
        for child, module in parent.named_children():
            path = f"{block}.{child}" if block else child
            has_weights = any(True for _ in module.parameters())  # not an activation module
            if path != epath and has_weights and _in_block(block, path) == "routers":
                out.add(path)
    return out


def _kind_of(pname: str, layer: nn.Module, experts: list[tuple[str, Any]], blocks: dict) -> str:
    module_path = pname.rpartition(".")[0]
    if any(pname.startswith(f"{e}.") for e, _ in experts):
        return "routed_experts"
    if _is_norm(layer, module_path):
        return "norms"
    for block in blocks:
        kind = _in_block(block, module_path)
        if kind:
            return kind
    top = module_path.split(".")[0]
    if top in _MLP_NAMES or "mlp" in top:
        return "dense_mlp"
    return "attention" if module_path else "other"


def _in_block(block: str, module_path: str) -> str | None:
    """shared_experts / routers for a parameter inside the MoE block `block`, else None.
    An empty `block` is the layer itself: only gate/router-named children count then."""
    if block and module_path != block and not module_path.startswith(f"{block}."):
        return None
    child = module_path[len(block) :].lstrip(".").split(".")[0]
    if "shared" in child:
        return "shared_experts"
    if block or any(n in child for n in ("gate", "router")):
        return "routers"
    return None


def _is_norm(layer: nn.Module, module_path: str) -> bool:
    try:
        module = layer.get_submodule(module_path) if module_path else layer
    except AttributeError:
        return False
    return is_norm(module)


def is_norm(module: nn.Module) -> bool:
    """A normalisation layer: named so, holding only vectors (not DBRX's NormAttentionNorm)."""
    named = "norm" in type(module).__name__.lower()
    return named and all(p.dim() <= 1 for p in module.parameters())


def _mixer_kind(layer: nn.Module, blocks: dict[str, str], experts: list) -> str:
    """The token mixer's kind, named from its class: attention, mla, linear_attention,
    mamba, conv (the analytic planner has activation terms for some of them)."""
    names = [
        type(m).__name__.lower()
        for p, m in layer.named_children()
        if not is_norm(m) and p not in _MLP_NAMES and p not in blocks
    ]
    joined = " ".join(names)
    module_names = {p.rpartition(".")[2] for p, _ in layer.named_modules()}
    for kind, needles in _MIXER_NEEDLES:
        if any(n in joined for n in needles):
            return "mla" if kind == "attention" and "kv_a_proj_with_mqa" in module_names else kind
    return "attention" if "q_proj" in module_names else (names[0] if names else "none")


_MIXER_NEEDLES = (
    ("mamba", ("mamba", "ssm", "mixer")),
    ("linear_attention", ("deltanet", "linearattention", "linear_attention", "lightning")),
    ("conv", ("shortconv", "conv")),
    ("attention", ("attention", "attn")),
)


def _read_build(model: nn.Module, config: Any, raw: dict[str, Any], name: str) -> Derived:
    prefix, layers = find_layers(model, getattr(config, "num_hidden_layers", None))
    read = [_classify_layer(layer) for layer in layers]
    components = _outside(model, prefix) + _sum_layers(read)
    moe = tuple(i for i, r in enumerate(read) if r.experts)
    num_experts = _num_experts(read, config)
    top_k = _top_k(config, read, num_experts) if moe else 0
    routed = [r.counts["routed_experts"] for r in read]
    active = components.total - sum(n - n * top_k // max(1, num_experts) for n in routed)
    hidden = int(getattr(config, "hidden_size", 0) or 0)
    spec = ModelSpec(
        name=name,
        model_type=str(config.model_type),
        num_layers=len(layers),
        hidden_size=hidden,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        moe_layers=moe,
        num_experts=num_experts if moe else 0,
        top_k=top_k,
        expert_intermediate_size=_expert_size(read, moe, hidden, num_experts),
        num_shared_experts=_shared_count(config, read),
        shared_intermediate_size=_per_glu(read, moe, "shared_experts", hidden),
        dense_intermediate_size=_dense_size(config, read, moe, hidden),
        num_attention_heads=int(getattr(config, "num_attention_heads", 0) or 0),
        num_kv_heads=_kv_heads(config),
        head_dim=_head_dim(config),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        components=components,
        active_params=active,
        dtype=_dtype(raw, config),
        hf_config=_hf_dict(config),
        attention_layer_ids=_attention_layers(read),
        quant_method=(raw.get("quantization_config") or {}).get("quant_method"),
        mixers=tuple(r.mixer for r in read),
        dense_layer_ids=_dense_layers(read, moe),
    )
    return Derived(spec, _union_paths(read), _layout(read), prefix)


def _dense_layers(read: list[_Layer], moe: tuple[int, ...]) -> tuple[int, ...] | None:
    """Non-MoE layers with a dense MLP; None when that is every non-MoE layer."""
    rest = [i for i in range(len(read)) if i not in set(moe)]
    ids = tuple(i for i in rest if read[i].counts["dense_mlp"])
    return None if len(ids) == len(rest) else ids


def _attention_layers(read: list[_Layer]) -> tuple[int, ...] | None:
    """Layers with token-mixer Linears to adapt; None when every layer has them."""
    ids = tuple(i for i, r in enumerate(read) if r.paths["attention"])
    return None if len(ids) == len(read) else ids


def _outside(model: Any, prefix: str) -> Components:
    """Embeddings, head, final norms and extra heads (MTP) outside the decoder layers."""
    modules = dict(model.named_modules())
    head = model.get_output_embeddings()
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    inputs = {id(p) for p in model.get_input_embeddings().parameters()}
    counts = dict.fromkeys(("embeddings", "lm_head", "norms", "other"), 0)
    for pname, param in model.named_parameters():
        if pname.startswith(f"{prefix}."):
            continue
        module = modules.get(pname.rpartition(".")[0])
        kind = (
            "embeddings" if id(param) in inputs or type(module).__name__ == "Embedding"
            else "lm_head" if id(param) in head_ids
            else "norms" if module is not None and is_norm(module)
            else "other"
        )  # fmt: skip
        counts[kind] += param.numel()
    return Components(**counts)


def _sum_layers(read: list[_Layer]) -> Components:
    total = Components()
    for r in read:
        total += Components(**r.counts)
    return total


def _num_experts(read: list[_Layer], config: Any) -> int:
    from torch import nn

    for r in read:
        for _, module in r.experts:
            n = getattr(module, "num_experts", None)
            if isinstance(n, int) and n > 0:
                return n
            stacks = [p for p in module.parameters(recurse=False) if p.dim() == 3]
            if stacks:
                return int(stacks[0].shape[0])
            lists = [len(c) for c in module.children() if isinstance(c, nn.ModuleList)]
            if lists:
                return lists[0]
    return int(_first_int(config, ("num_experts", "n_routed_experts", "num_local_experts")))


def _first_int(config: Any, names: tuple[str, ...]) -> int:
    for n in names:
        value = getattr(config, n, None)
        if isinstance(value, list | tuple) and value:
            if len(set(value)) > 1:  # transformers builds one router width for every layer
                n = (getattr(config, "attribute_map", None) or {}).get(n, n)  # config.json's name
                raise ConfigError(
                    f"{config.model_type}: per-layer {n} {list(value)} differ; transformers "
                    "builds every layer with the first",
                    f"set every entry of {n} to the same value",
                )
            value = value[0]
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return 0


def _top_k(config: Any, read: list[_Layer], num_experts: int) -> int:
    k = _first_int(config, TOP_K_FIELDS)
    if not k:  # the router knows (e.g. a `top_k` attribute)
        k = next((r.top_k for r in read if r.top_k), 0)
    if not k:
        raise ConfigError(
            f"{config.model_type}: cannot tell how many experts each token is routed to",
            f"set one of {', '.join(TOP_K_FIELDS[:3])} in config.json",
        )
    if k > num_experts:
        raise ConfigError(
            f"{config.model_type}: top-k {k} exceeds the {num_experts} experts",
            "set num_experts_per_tok to at most the number of experts",
        )
    return k


def _glu_factor(read: list[_Layer]) -> int:
    """3 projections per expert (gate, up, down) when gated, else 2."""
    for r in read:
        for _, module in r.experts:
            return 3 if getattr(module, "has_gate", True) else 2
    return 3


def _expert_size(read: list[_Layer], moe: tuple[int, ...], hidden: int, experts: int) -> int:
    if not moe or not hidden or not experts:
        return 0
    for _, module in read[moe[0]].experts:
        down = getattr(module, "down_proj", None)
        decorated = "is_transposed" in vars(module)
        if decorated and down is not None and getattr(down, "dim", lambda: 0)() == 3:
            return int(down.shape[1] if getattr(module, "is_transposed", False) else down.shape[2])
    per_expert = read[moe[0]].counts["routed_experts"] // experts
    return per_expert // (_glu_factor(read) * hidden)


def _per_glu(read: list[_Layer], layers: tuple[int, ...], kind: str, hidden: int) -> int:
    """Intermediate width of a dense / shared MLP: the input width of its Linear that
    projects back to the hidden size (its down projection)."""
    if not layers or not hidden:
        return 0
    r = read[layers[0]]
    for path in r.paths["shared" if kind == "shared_experts" else kind]:
        linear: Any = r.module.get_submodule(path)
        if linear.out_features == hidden and linear.in_features != hidden:
            return int(linear.in_features)
    return r.counts[kind] // (3 * hidden)


def _shared_count(config: Any, read: list[_Layer]) -> int:
    if not any(r.counts["shared_experts"] for r in read):
        return 0
    return (
        _first_int(config, ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"))
        or 1
    )


def _dense_size(config: Any, read: list[_Layer], moe: tuple[int, ...], hidden: int) -> int:
    dense = tuple(i for i in range(len(read)) if i not in set(moe) and read[i].counts["dense_mlp"])
    return _per_glu(read, dense, "dense_mlp", hidden)


def _kv_heads(config: Any) -> int:
    kv = getattr(config, "num_key_value_heads", None)
    return int(kv or getattr(config, "num_attention_heads", 0) or 0)


def _head_dim(config: Any) -> int:
    if getattr(config, "qk_nope_head_dim", None):  # MLA: query/key width per head
        return int(config.qk_nope_head_dim) + int(getattr(config, "qk_rope_head_dim", 0) or 0)
    head_dim = _first_int(config, ("head_dim",))
    if head_dim:
        return head_dim
    heads = int(getattr(config, "num_attention_heads", 0) or 0)
    return int(getattr(config, "hidden_size", 0) or 0) // heads if heads else 0


def _dtype(raw: dict[str, Any], config: Any) -> str:
    value = raw.get("torch_dtype") or raw.get("dtype") or getattr(config, "dtype", None)
    text = str(value or "bfloat16").removeprefix("torch.")
    return text if text in ("bfloat16", "float16", "float32") else "bfloat16"


def _hf_dict(config: Any) -> dict[str, Any]:
    """The (text) config as a dict transformers rebuilds the same model from."""
    out = plain_floats(config.to_dict())
    for key in ("transformers_version", "architectures", *CHECKPOINT_ONLY_KEYS):
        out.pop(key, None)
    return out


def _union_paths(read: list[_Layer]) -> ModulePaths:
    """Every layer-relative path any layer has; `present` says which layer has which."""
    union: dict[str, list[str]] = {}
    for r in read:
        for kind, found in r.paths.items():
            union.setdefault(kind, [])
            union[kind] += [p for p in found if p not in union[kind]]
    present = tuple(frozenset(p for found in r.paths.values() for p in found) for r in read)
    return ModulePaths(
        attention=tuple(union.get("attention", ())),
        expert_params=tuple(union.get("expert_params", ())),
        dense_mlp=tuple(union.get("dense_mlp", ())),
        shared=tuple(union.get("shared", ())),
        router=tuple(union.get("router", ())),
        present=present,
    )


def _layout(read: list[_Layer]) -> ExpertsLayout:
    for r in read:
        for _, module in r.experts:
            flags = vars(module)
            decorated = "is_concatenated" in flags
            names = {n for n, _ in module.named_parameters(recurse=False)}
            return ExpertsLayout(
                is_concatenated=bool(flags.get("is_concatenated", True)),
                is_transposed=bool(flags.get("is_transposed", False)),
                has_bias=bool(flags.get("has_bias", False)),
                fused_gate_up="gate_up_proj" in names or not decorated,
                flat_2d=not any(p.dim() == 3 for p in module.parameters()),
                experts_interface=decorated,
            )
    return ExpertsLayout()


@lru_cache(maxsize=256)
def _cached(key: str) -> Derived:
    import json

    raw, name = json.loads(key)
    return derive(raw, name)


def derive_cached(raw: dict[str, Any], name: str = "custom") -> Derived:
    """`derive`, memoised on the config's content (a meta build takes 10 ms – 2 s)."""
    import json

    return _cached(json.dumps([raw, name], sort_keys=True, default=str))
