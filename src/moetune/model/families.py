"""What moetune knows of a model_type: module paths, expert layout and layer prefix read
off a tiny transformers build of it, plus an `Override` (model.overrides) for what no build
shows – mlx-lm's key names, peft's quirks. Any model type gets a Family; none needs an
override.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from functools import cache

from moetune.model.spec import ModelSpec


@dataclass(frozen=True)
class ModulePaths:
    """Names relative to one decoder layer (`<Family.layers_prefix>.<i>.`, usually
    `model.layers.<i>.`), as peft and mlx-lm see them.

    `attention` holds the Linear leaf names (peft `target_modules` style, e.g. "q_proj");
    the other peft fields are dotted paths of nn.Linear modules, `router` of the router
    module (a Linear or a `…TopKRouter`), and `expert_params` of the fused nn.Parameters
    for `LoraConfig.target_parameters`. mlx fields are mlx-lm `lora_parameters.keys`.
    An empty tuple means the family has no such part (or, for mlx, nothing adaptable).
    """

    attention: tuple[str, ...] = ()
    expert_params: tuple[str, ...] = ()
    dense_mlp: tuple[str, ...] = ()
    shared: tuple[str, ...] = ()
    router: tuple[str, ...] = ()
    mlx_attention: tuple[str, ...] = ()
    mlx_experts: tuple[str, ...] = ()
    mlx_dense: tuple[str, ...] = ()
    mlx_shared: tuple[str, ...] = ()
    mlx_router: tuple[str, ...] = ()
    # Per decoder layer, the paths above that layer really has (hybrid models mix mixers
    # and MLP kinds); empty means every layer has every path.
    present: tuple[frozenset[str], ...] = ()

    def in_layer(self, layer: int, path: str) -> bool:
        """Whether decoder layer `layer` should have `path`: always without `present`, and
        for a path no layer has (a wrong name must be reported, not skipped)."""
        if not self.present or layer >= len(self.present) or path in self.present[layer]:
            return True
        return not any(path in found for found in self.present)  # a path no layer has: a miss


_MLX_FIELDS = tuple(f.name for f in fields(ModulePaths) if f.name.startswith("mlx_"))


@dataclass(frozen=True)
class ExpertsLayout:
    """How transformers stores the fused expert stacks (the `@use_experts_implementation` flags)."""

    is_concatenated: bool = True  # gate/up as halves (False: interleaved [..., ::2])
    is_transposed: bool = False  # [E, in, out] instead of [E, out, in]
    has_bias: bool = False
    # False: gate and up are separate parameters (dbrx w1/v1), nothing to de-concatenate.
    fused_gate_up: bool = True
    # True: 2-D [E*I, H] stacks (dbrx) rather than 3-D [E, ., .]; view as [E, I, H] per expert.
    flat_2d: bool = False
    # True: transformers' `@use_experts_implementation` drives these experts (ExpertsInterface).
    experts_interface: bool = True


@dataclass(frozen=True)
class Override:
    """What a build of `model_type` cannot show: mlx-lm's `lora_parameters.keys` per part
    (mlx-lm's modules are its own), and peft's behaviour on the fused experts."""

    model_type: str
    mlx_attention: tuple[str, ...] = ()  # kept where the build has that projection
    mlx_experts: tuple[str, ...] = ()
    mlx_dense: tuple[str, ...] = ()
    mlx_shared: tuple[str, ...] = ()
    mlx_router: tuple[str, ...] = ()
    mlx_supported: bool = True
    peft_automap: bool = True  # peft >= 0.19 maps gate/up/down_proj names onto fused experts
    # Other target_modules names peft maps onto the fused experts (mixtral: its checkpoint
    # names w1/w2/w3; gate/up/down_proj match nothing there).
    peft_automap_names: tuple[str, ...] = ()
    aliases: tuple[str, ...] = ()  # other model_type strings this override serves

    def merged(self, built: ModulePaths) -> ModulePaths:
        """`built` (peft's paths, read off a build) with this override's mlx-lm keys; an
        attention key only where the build has that projection (DeepSeek's q_proj or
        q_a_proj/q_b_proj, by q_lora_rank)."""
        mlx = {f: getattr(self, f) for f in _MLX_FIELDS}
        have = {p.rpartition(".")[2] for p in built.attention}
        mlx["mlx_attention"] = tuple(k for k in self.mlx_attention if k.rpartition(".")[2] in have)
        return replace(built, **mlx)


@dataclass(frozen=True)
class Family(Override):
    """An override completed by a tiny build of its type (the classes, not the sizes, fix
    where the layers live and how the experts are stored)."""

    paths: ModulePaths = ModulePaths()  # the tiny build's, the override's mlx keys merged
    layout: ExpertsLayout = ExpertsLayout()
    layers_prefix: str = "model.layers"  # ModulePaths are relative to `<layers_prefix>.<i>.`

    def paths_of(self, spec: ModelSpec) -> ModulePaths:
        """The module paths of the model `spec` describes: peft's read off its own build,
        mlx-lm's from the override."""
        if not spec.mixers:  # a spec not read off a build (hand-made): the type's paths
            return self.paths
        from moetune.model.derive import derive_cached

        return self.merged(derive_cached(spec.hf_config, spec.name).paths)


OVERRIDES: dict[str, Override] = {}


def register(*overrides: Override) -> None:
    """Register each override under its model_type and aliases."""
    for over in overrides:
        for key in (over.model_type, *over.aliases):
            OVERRIDES[key] = over


@cache
def get_family(model_type: str) -> Family:
    """The family of `model_type`: a tiny build of it, with its override where one is
    registered (transformers must know the type)."""
    from moetune.model.census import shrunk_config
    from moetune.model.derive import derive_cached

    over = OVERRIDES.get(model_type)
    if over is None:  # nothing known of mlx-lm, and peft's automap left unclaimed
        over = Override(model_type, mlx_supported=False, peft_automap=False)
    tiny = derive_cached(shrunk_config(model_type), model_type)
    known = {f.name: getattr(over, f.name) for f in fields(Override)}
    return Family(
        **known,
        paths=over.merged(tiny.paths),
        layout=tiny.layout,
        layers_prefix=tiny.layers_prefix,
    )
