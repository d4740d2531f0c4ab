"""train.dpo and train.grpo: the settings of the preference and RL objectives."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator

from moetune.config.base import (
    FiniteFloat,
    Fraction,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    _rule,
    _Section,
)


class DpoArgs(_Section):
    """train.method: dpo – preference pairs (prompt/chosen/rejected) through TRL's DPOTrainer.
    The reference policy is the base with the adapter disabled: no second model copy."""

    beta: PositiveFloat = Field(
        0.1, description="How far the policy may move from the reference (higher: less)."
    )
    loss_type: Literal["sigmoid", "hinge", "ipo", "robust", "apo_zero", "sigmoid_norm"] = Field(
        "sigmoid", description="DPO loss variant (TRL's loss_type; sigmoid is the paper's)."
    )
    label_smoothing: Fraction = Field(
        0.0, description="robust: the probability that a preference label is flipped."
    )
    sft_weight: NonNegativeFloat = Field(
        0.0,
        description="Add TRL's sft loss on the chosen answer with this weight (RPO); a "
        "skill the base cannot do at all needs it, pure DPO mostly lowers the rejected.",
    )


class RewardArgs(_Section):
    """One GRPO reward: a registered name (exact_match, edit_similarity, regex, length) or
    `module:function`."""

    name: str = Field(
        description="exact_match | edit_similarity | regex | length, or "
        "`package.module:function` taking (prompts, completions, **columns) and returning one "
        "float per completion."
    )
    weight: FiniteFloat = Field(1.0, description="Weight of this reward in the sum.")
    column: str = Field(
        "answer",
        description="exact_match, edit_similarity: the data column holding the right answer.",
    )
    pattern: str | None = Field(None, description="regex: the pattern a completion must match.")
    target_chars: PositiveInt | None = Field(
        None, description="length: the completion length (characters) that scores 1.0."
    )


class GrpoArgs(_Section):
    """train.method: grpo – prompt rows, sampled groups scored by rewards, TRL's GRPOTrainer."""

    num_generations: Annotated[
        int, _rule(lambda v: v >= 2, "must be an integer >= 2 (a group needs two samples)")
    ] = Field(4, description="Completions sampled per prompt (the group).")
    max_completion_length: PositiveInt = Field(
        16, description="Longest generated completion, in tokens."
    )
    temperature: PositiveFloat = Field(1.0, description="Sampling temperature of the rollout.")
    top_p: PositiveFloat = Field(1.0, description="Nucleus sampling share of the rollout.")
    beta: NonNegativeFloat = Field(
        0.0,
        description="KL coefficient to the reference (the adapter disabled); 0 skips the "
        "reference pass (TRL's default).",
    )
    epsilon: PositiveFloat = Field(0.2, description="PPO-style clipping range of the ratio.")
    loss_type: Literal["grpo", "dapo", "dr_grpo", "bnpo"] = Field(
        "dapo", description="How token losses are averaged (TRL's loss_type)."
    )
    scale_rewards: Literal["group", "batch", "none"] = Field(
        "group", description="Normalise advantages by the group's (or batch's) std, or not."
    )
    sft_weight: NonNegativeFloat = Field(
        0.0,
        description="Add this weight × the NLL of a row's `completion` column (an answer to "
        "imitate; empty: the row is RL only) to the GRPO loss – an anchor for skills the "
        "reward alone erodes, e.g. replayed ones; 0 is plain GRPO.",
    )
    rewards: list[RewardArgs] = Field(
        default_factory=lambda: [RewardArgs.model_validate({"name": "exact_match"})],
        description="Reward functions, summed with their weights.",
    )
    shift_warn: Annotated[float, _rule(lambda v: 0 < v <= 1, "must be a share in (0, 1]")] = Field(
        0.2,
        description="Warn when the share of tokens whose top-k experts differ between the "
        "rollout and the training pass exceeds this in any layer.",
    )
    routing_replay: Literal["off", "replay"] = Field(
        "off",
        description="replay: the training pass routes each token the rollout saw to the "
        "experts the rollout chose, gate weights recomputed from the current router logits "
        "over them (routing replay, R3); off: the router picks again (see docs/train.md for "
        "the measured shift that chose the default).",
    )
    use_vllm: bool = Field(
        False, description="CUDA only: generate with TRL's vLLM mode (needs vllm installed)."
    )

    @field_validator("routing_replay", mode="before")
    @classmethod
    def _off_as_yaml_reads_it(cls, value: object) -> object:
        """`routing_replay: off` unquoted is YAML 1.1's false: the documented default, written
        as documented, must not be refused (true stays refused: it names no mode)."""
        return "off" if value is False else value

    vllm_mode: Literal["colocate", "server"] = Field(
        "colocate", description="vLLM in this process (colocate) or a `trl vllm-serve` server."
    )
