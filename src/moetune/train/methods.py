"""train.method: the objective, as a registry – each names its TRL trainer and config, the
data formats it reads, its own TRL arguments and the extra trainer inputs (rewards).

    sft    SFTTrainer    messages | prompt/completion | text rows
    dpo    DPOTrainer    prompt/chosen/rejected rows (plain or conversational)
    grpo   GRPOTrainer   prompt rows (other columns reach the rewards), rewards.py

The reference policy of DPO (and of GRPO with beta > 0) is the base with the adapter
disabled, inside the one model that trains: TRL copies a PeftModel's adapter into a
second "ref" adapter, which `drop_reference_copy` removes so TRL falls back to
`disable_adapter()` – the adapter starts at zero (LoRA B = 0), so both are the base.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.train.errors import DataError, TrainError

if TYPE_CHECKING:
    from torch import nn

    from moetune.config import RunConfig
    from moetune.train.data import TrainData


def _none(cfg: RunConfig, data: TrainData) -> None:
    return None


def _no_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class Method:
    """One objective: what it reads, how TRL is configured for it, what it adds."""

    name: str
    trainer: str  # the TRL trainer class
    config: str  # its TRL config class
    formats: tuple[str, ...]  # data formats (train/data.py FORMATS) it trains on
    args: Callable[[RunConfig, TrainData], dict[str, Any]]  # its own TRL config fields
    trainer_kwargs: Callable[[RunConfig], dict[str, Any]] = _no_kwargs
    check: Callable[[RunConfig, TrainData], None] = _none  # data/config checks, before writing
    tokenized_rows: bool = True  # the collator yields model inputs (routing base, ESFT)
    rollout: bool = False  # samples completions each step (routing shift, generation plan)

    def classes(self) -> tuple[type, type]:
        """(trainer class, config class) from TRL, imported on use."""
        import trl

        return getattr(trl, self.trainer), getattr(trl, self.config)


def _sft_args(cfg: RunConfig, data: TrainData) -> dict[str, Any]:
    return {"max_length": cfg.train.seq_len, "packing": cfg.data.packing, **data.loss.sft}


def _dpo_args(cfg: RunConfig, data: TrainData) -> dict[str, Any]:
    d = cfg.train.dpo
    return {
        "max_length": cfg.train.seq_len,
        "beta": d.beta,
        "loss_type": [d.loss_type],
        "label_smoothing": d.label_smoothing,
        "precompute_ref_log_probs": False,  # resume must not depend on a cached pass
    }


def _grpo_args(cfg: RunConfig, data: TrainData) -> dict[str, Any]:
    g = cfg.train.grpo
    return {
        "num_generations": g.num_generations,
        "max_completion_length": g.max_completion_length,
        "temperature": g.temperature,
        "top_p": g.top_p,
        "beta": g.beta,
        "epsilon": g.epsilon,
        "loss_type": g.loss_type,
        "scale_rewards": g.scale_rewards,
        "reward_weights": [r.weight for r in g.rewards],
        "use_vllm": g.use_vllm,
        "vllm_mode": g.vllm_mode,
        "log_completions": False,
        # the rollout's batches carry prompt/completion ids, not input_ids: TRL counts none
        "include_num_input_tokens_seen": "no",
    }


def _grpo_rewards(cfg: RunConfig) -> dict[str, Any]:
    from moetune.train.rewards import build_rewards

    funcs, _ = build_rewards(cfg.train.grpo)
    return {"reward_funcs": funcs}


def _grpo_check(cfg: RunConfig, data: TrainData) -> None:
    """The group must divide the batch, the rewards must build and find their columns."""
    from moetune.train.rewards import build_rewards, reward_columns

    g, t = cfg.train.grpo, cfg.train
    if (t.batch_size * t.grad_accum) % g.num_generations:
        raise TrainError(
            f"train.batch_size × grad_accum = {t.batch_size * t.grad_accum} is not a multiple "
            f"of train.grpo.num_generations = {g.num_generations}",
            "make the batch a multiple of the group (e.g. batch_size: 8, num_generations: 4)",
        )
    if g.use_vllm and cfg.train.device != "cuda":
        raise TrainError(
            "train.grpo.use_vllm needs CUDA", "set train.device: cuda, or use_vllm off"
        )
    if cfg.lora.expert_selection != "all":
        raise TrainError(
            "lora.expert_selection scores experts on tokenised rows; grpo rows are prompts",
            "set lora.expert_selection: all for train.method grpo",
        )
    build_rewards(g)  # a bad reward fails here, before anything is written
    columns = set(data.dataset.column_names)
    for name in reward_columns(g):
        if name not in columns:
            raise DataError(
                f"{data.path}: exact_match reads column {name!r}, which the rows lack "
                f"(columns: {', '.join(sorted(columns))})",
                f"add {name!r} to every row, or set column: in the reward entry",
            )


METHODS: dict[str, Method] = {
    m.name: m
    for m in (
        Method("sft", "SFTTrainer", "SFTConfig", ("messages", "prompt/completion", "text"),
               _sft_args),
        Method("dpo", "DPOTrainer", "DPOConfig", ("preference",), _dpo_args),
        Method("grpo", "GRPOTrainer", "GRPOConfig", ("prompt",), _grpo_args,
               trainer_kwargs=_grpo_rewards, check=_grpo_check, tokenized_rows=False,
               rollout=True),
    )
}  # fmt: skip


def method_of(cfg: RunConfig) -> Method:
    return METHODS[cfg.train.method]


def drop_reference_copy(model: nn.Module) -> bool:
    """Remove the "ref" adapter TRL adds beside a PeftModel's own; its reference pass then
    runs the base with the adapter disabled (same weights, no copy). True when removed."""
    configs = getattr(model, "peft_config", {})
    if "ref" not in configs:
        return False
    model.delete_adapter("ref")  # type: ignore[operator]
    return True
