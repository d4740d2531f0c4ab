"""Reading a meta build by structure: each decoder layer's parameters put into components,
the module paths of its parts, and the experts' layout.

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

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.errors import ConfigError
from moetune.model.layout_types import ExpertsLayout, ModulePaths
from moetune.model.spec import Components

if TYPE_CHECKING:
    from torch import nn

_MLP_NAMES = ("mlp", "feed_forward", "ffn", "block_sparse_moe", "moe", "mlp_block")
_COMPONENTS = ("attention", "dense_mlp", "routed_experts", "shared_experts", "routers",
               "norms", "other")  # fmt: skip
_PARTS = ("attention", "expert_params", "dense_mlp", "shared", "router")
Experts = list[tuple[str, "nn.Module"]]  # (layer-relative path, module) of each experts module


def is_experts(module: nn.Module, path: str = "") -> bool:
    """Routed experts: an `@use_experts_implementation` module, a module holding 3-D
    stacks, an undecorated `…Experts` container, or a plain ModuleList at `….experts`
    (DeepSeek-MoE's remote code: one MLP per expert)."""
    if "is_concatenated" in vars(module):  # set by the decorator's __init__
        return True
    if "Conv" not in type(module).__name__ and any(
        p.dim() == 3 for p in module.parameters(recurse=False)
    ):
        return True
    if type(module).__name__ == "ModuleList" and path.rpartition(".")[2] == "experts":
        return len(list(module.children())) > 1
    return type(module).__name__.endswith("Experts")


def find_layers(model: nn.Module, num_layers: int | None) -> tuple[str, list[nn.Module]]:
    """(prefix, layers): the ModuleList of decoder layers (the largest one by parameters)."""
    # lazy: heavy to import (torch)
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
class Layer:
    """One decoder layer's parameters by component, and its parts' paths."""

    counts: dict[str, int]
    experts: Experts
    paths: dict[str, list[str]]
    mixer: str
    module: nn.Module
    top_k: int = 0  # a router's own `top_k` attribute, where the config names none


def classify_layer(layer: nn.Module) -> Layer:
    """One decoder layer by structure: its parameters by component, its parts' paths."""
    experts = _outermost_experts(layer)
    blocks = {p.rpartition(".")[0]: p for p, _ in experts}
    mixer = _mixer_kind(layer, blocks, experts)
    counts = _counts(layer, experts, blocks, mixer)
    paths = _part_paths(layer, experts, blocks, mixer)
    top_k = next((k for m in layer.modules() if (k := first_int(m, ("top_k",)))), 0)
    return Layer(counts, experts, paths, mixer, layer, top_k)


def _outermost_experts(layer: nn.Module) -> Experts:
    """The layer's experts modules, none inside another (per-expert MLPs of a ModuleList)."""
    found = [(p, m) for p, m in layer.named_modules() if p and is_experts(m, p)]
    return [(p, m) for p, m in found if not any(p.startswith(f"{q}.") for q, _ in found)]


def _counts(
    layer: nn.Module, experts: Experts, blocks: dict[str, str], mixer: str
) -> dict[str, int]:
    """Parameters by component (SSM mixers' own weights in `other`)."""
    counts = dict.fromkeys(_COMPONENTS, 0)
    for pname, param in layer.named_parameters():
        kind = _kind_of(pname, layer, experts, blocks)
        if mixer == "mamba" and kind in ("attention", "norms") and _in_mixer(layer, pname):
            kind = "other"  # SSM mixers: counted apart, no LoRA target (CUDA kernels read
        counts[kind] += param.numel()  # their weights directly)
    return counts


def _part_paths(
    layer: nn.Module, experts: Experts, blocks: dict[str, str], mixer: str
) -> dict[str, list[str]]:
    """Layer-relative paths of the Linears (and expert stacks) LoRA can target, by part."""
    # lazy: heavy to import (torch)
    from torch import nn

    paths: dict[str, list[str]] = {k: [] for k in (*_PARTS, "not_targeted")}
    routers = _router_children(blocks, layer)
    frozen = gradless_modules(layer)
    for mpath, module in layer.named_modules():
        kind = _kind_of(f"{mpath}.weight", layer, experts, blocks)
        if (kind == "attention" and mixer == "mamba") or _under(mpath, frozen):
            continue
        if module.__class__ is nn.Linear and module.out_features == 1:
            continue  # a scalar gate (qwen2_moe's shared_expert_gate), not a projection
        if kind == "routers" and mpath in routers:  # a router is read, never a LoRA target
            paths["router"].append(_weight_holder(module, mpath))
        elif isinstance(module, nn.Linear) and not per_token_linear(module):
            paths["not_targeted"].append(mpath)  # peft's LoRA would not match its output
        elif isinstance(module, nn.Linear) and kind in ("attention", "dense_mlp", "shared_experts"):
            path = _leaf_if_unique(layer, mpath) if kind == "attention" else mpath
            paths[{"shared_experts": "shared"}.get(kind, kind)].append(path)
    for epath, module in experts:
        paths["expert_params"] += [f"{epath}.{n}" for n in _stack_names(module)]
    return paths


def per_token_linear(module: nn.Module) -> bool:
    """Its forward maps [tokens, in_features] to [tokens, out_features], as peft's LoRA
    (which adds B·A·x to it) assumes. A subclass with its own forward is tried on meta:
    DeepSeek-V4's grouped `o_a_proj` (a block-diagonal bmm over head groups) is not."""
    # lazy: heavy to import (torch)
    import torch
    from torch import nn

    linear: Any = module
    if type(module).forward is nn.Linear.forward:
        return True
    weight = linear.weight
    try:
        out = module(torch.empty(3, linear.in_features, device=weight.device, dtype=weight.dtype))
    except (RuntimeError, ValueError, TypeError):
        return False
    return isinstance(out, torch.Tensor) and tuple(out.shape) == (3, linear.out_features)


def runs_without_grad(module: nn.Module) -> bool:
    """Its forward is decorated with `@torch.no_grad()` (DeepSeek-V3.2's lightning indexer,
    which only picks the keys each query attends to): LoRA inside it would never learn."""
    # lazy: heavy to import (torch)
    import torch

    forward = type(module).forward
    cells = zip(forward.__code__.co_freevars, forward.__closure__ or (), strict=False)
    return any(
        name == "ctx_factory" and isinstance(getattr(cell.cell_contents, "__self__", None),
                                             torch.no_grad)
        for name, cell in cells
    )  # fmt: skip


def gradless_modules(layer: nn.Module) -> tuple[str, ...]:
    """Layer-relative paths of the submodules whose forward runs without autograd."""
    return tuple(p for p, m in layer.named_modules() if p and runs_without_grad(m))


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == r or path.startswith(f"{r}.") for r in roots)


def _in_mixer(layer: nn.Module, pname: str) -> bool:
    """Inside a layer child that is neither a norm nor an MLP block (the token mixer)."""
    # lazy: heavy to import (torch)
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


def _kind_of(pname: str, layer: nn.Module, experts: Experts, blocks: dict[str, str]) -> str:
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


def _mixer_kind(layer: nn.Module, blocks: dict[str, str], experts: Experts) -> str:
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
        if any(n in joined for n in needles):  # MLA by structure, whatever the class reads
            # as (kimi_linear's MLA class is KimiLinearAttention)
            return "mla" if "kv_a_proj_with_mqa" in module_names else kind
    if "kv_a_proj_with_mqa" in module_names:  # MLA in a container (longcat_flash: a
        return "mla"  # ModuleList of two per layer)
    return "attention" if "q_proj" in module_names else (names[0] if names else "none")


_MIXER_NEEDLES = (
    ("mamba", ("mamba", "ssm", "mixer")),
    (  # KDA (kimi_linear, bailing_hybrid) is a "…DeltaAttention"
        "linear_attention",
        ("deltanet", "deltaattention", "linearattention", "linear_attention", "lightning"),
    ),
    ("conv", ("shortconv", "conv")),
    ("attention", ("attention", "attn")),
    ("mlp", ("mlp",)),  # a dense MLP as the layer's only block (nemotron_h's MLP layers)
)


def dense_layers(read: list[Layer], moe: tuple[int, ...]) -> tuple[int, ...] | None:
    """Non-MoE layers with a dense MLP; None when that is every non-MoE layer."""
    rest = [i for i in range(len(read)) if i not in set(moe)]
    ids = tuple(i for i in rest if read[i].counts["dense_mlp"])
    return None if len(ids) == len(rest) else ids


def attention_layers(read: list[Layer]) -> tuple[int, ...] | None:
    """Layers with token-mixer Linears to adapt; None when every layer has them."""
    ids = tuple(i for i, r in enumerate(read) if r.paths["attention"])
    return None if len(ids) == len(read) else ids


def outside(model: Any, prefix: str) -> Components:
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


def sum_layers(read: list[Layer]) -> Components:
    total = Components()
    for r in read:
        total += Components(**r.counts)
    return total


def first_int(config: Any, names: tuple[str, ...]) -> int:
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


def union_paths(read: list[Layer]) -> ModulePaths:
    """Every layer-relative path any layer has; `present` says which layer has which."""
    union: dict[str, list[str]] = {}
    for r in read:
        for kind, found in r.paths.items():
            union.setdefault(kind, [])
            union[kind] += [p for p in found if p not in union[kind]]
    untargeted = union.pop("not_targeted", [])
    present = tuple(
        frozenset(p for k, found in r.paths.items() if k != "not_targeted" for p in found)
        for r in read
    )
    return ModulePaths(
        attention=tuple(union.get("attention", ())),
        expert_params=tuple(union.get("expert_params", ())),
        dense_mlp=tuple(union.get("dense_mlp", ())),
        shared=tuple(union.get("shared", ())),
        router=tuple(union.get("router", ())),
        present=present,
        not_targeted=tuple(untargeted),
    )


def layout(read: list[Layer], hidden: int) -> ExpertsLayout:
    """The first experts module's layout: the decorator's flags where transformers set them,
    else read off the stacks (llama4's [E, H, 2I] is transposed, dbrx's w1/v1 are apart)."""
    module = next((m for r in read for _, m in r.experts), None)
    if module is None:
        return ExpertsLayout()
    flags = vars(module)
    decorated = "is_concatenated" in flags
    stacks = dict(module.named_parameters())
    # undecorated, three stacks are gate, up and down apart (dbrx's w1, v1, w2)
    fused = "gate_up_proj" in stacks if decorated else len(_stack_names(module)) != 3
    down = stacks.get("down_proj")
    transposed = down is not None and down.dim() == 3 and down.shape[1] != hidden  # [E, I, H]
    return ExpertsLayout(
        is_concatenated=bool(flags.get("is_concatenated", fused)),
        is_transposed=bool(flags.get("is_transposed", transposed)),
        has_bias=bool(flags.get("has_bias", False)),
        fused_gate_up=fused,
        flat_2d=not any(p.dim() == 3 for p in stacks.values()),
        experts_interface=decorated,
    )
