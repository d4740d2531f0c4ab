"""The layout types of a model family: where a decoder layer's parts live (`ModulePaths`),
how transformers stores the fused expert stacks (`ExpertsLayout`), and what a build
cannot show (`Override`). Plain data, so the readers of a build (model.read, model.derive)
use them without the family lookup (model.families.registry) that builds one.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace


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
    # Linears LoRA is not aimed at, layer-relative: their forward is not a per-token x·Wᵀ
    # (peft's LoRA output would not match it: DeepSeek-V4's grouped o_a_proj), or an
    # override leaves them out (`Override.left_out`, with its why)
    not_targeted: tuple[str, ...] = ()

    def in_layer(self, layer: int, path: str) -> bool:
        """Whether decoder layer `layer` should have `path`: always without `present`, and
        for a path no layer has (a wrong name must be reported, not skipped)."""
        if not self.present or layer >= len(self.present) or path in self.present[layer]:
            return True
        return not any(path in found for found in self.present)  # a path no layer has: a miss


_MLX_FIELDS = tuple(f.name for f in fields(ModulePaths) if f.name.startswith("mlx_"))
_LINEAR_FIELDS = ("attention", "dense_mlp", "shared")  # the peft target_modules parts


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
    # Linears kept out of the LoRA targets though their forward is a plain x·Wᵀ, as
    # (layer-relative path or a `.`-suffix of it, why): a module whose adapter keys peft's
    # load renames away (inkling2's sconv.weight_proj)
    left_out: tuple[tuple[str, str], ...] = ()

    def merged(self, built: ModulePaths) -> ModulePaths:
        """`built` (peft's paths, read off a build) with this override's mlx-lm keys and its
        left-out Linears moved to `not_targeted`; an attention key only where the build has
        that projection (DeepSeek's q_proj or q_a_proj/q_b_proj, by q_lora_rank)."""
        mlx = {f: getattr(self, f) for f in _MLX_FIELDS}
        have = {p.rpartition(".")[2] for p in built.attention}
        mlx["mlx_attention"] = tuple(k for k in self.mlx_attention if k.rpartition(".")[2] in have)
        return replace(self._without_left_out(built), **mlx)

    def left_out_why(self, path: str) -> str | None:
        """Why this override keeps the Linear at `path` out of the targets (None: it does not)."""
        hits = (why for name, why in self.left_out if path == name or path.endswith(f".{name}"))
        return next(hits, None)

    def _without_left_out(self, built: ModulePaths) -> ModulePaths:
        dropped = [p for f in _LINEAR_FIELDS for p in getattr(built, f) if self.left_out_why(p)]
        if not dropped:
            return built
        kept = {f: tuple(p for p in getattr(built, f) if p not in dropped) for f in _LINEAR_FIELDS}
        return replace(built, **kept, not_targeted=(*built.not_targeted, *dropped))
