"""train.method: the objective, as a registry – each names its TRL trainer and config, the
data formats it reads, its own TRL arguments and the extra trainer inputs (rewards).

    sft    SFTTrainer    messages | prompt/completion | text rows
    dpo    DPOTrainer    prompt/chosen/rejected rows (plain or conversational)
    grpo   GRPOTrainer   prompt rows (other columns reach the rewards), rewards.py;
                         with sft_weight, an NLL term on rows' `completion` (grpo_sft.py)

The reference policy of DPO (and of GRPO with beta > 0) is the base with the adapter
disabled, inside the one model that trains. Given a PeftModel without a reference, TRL
1.16 would add a second "ref" adapter copied from the first (peft cannot add one beside
split/target_parameters expert LoRA, and it costs an adapter's memory); each method's
`build` keeps TRL off that path, and then TRL's reference pass is `disable_adapter()` –
the adapter starts at zero (LoRA B = 0), so that is the base. `reference_of` says which.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.registry import Registry
from moetune.train.errors import DataError, TrainError
from moetune.train.grpo.rewards import ANSWER_SCORES, build_rewards, dry_call, reward_columns
from moetune.train.routing.rows import BASE_ROWS, sampled

if TYPE_CHECKING:
    from moetune.config import RunConfig
    from moetune.data import TrainData


def _none(cfg: RunConfig, data: TrainData) -> None:
    return None


def _no_kwargs(cfg: RunConfig) -> dict[str, Any]:
    return {}


def _plain_build(trainer: type, kwargs: dict[str, Any]) -> Any:
    return trainer(**kwargs)


def _dpo_build(trainer: type, kwargs: dict[str, Any]) -> Any:
    """A reference is passed only to keep TRL from adding its "ref" adapter copy: an empty
    stand-in (no weights), cleared right after, so the reference pass runs the policy with
    its adapter disabled."""
    # lazy: heavy to import (torch)
    import torch

    stand_in = torch.nn.Module()
    stand_in.config = kwargs["model"].config  # TRL patches its forward: it reads the config
    built = trainer(**kwargs, ref_model=stand_in)
    built.ref_model = None
    return built


def _grpo_build(trainer: type, kwargs: dict[str, Any]) -> Any:
    """GRPO adds the "ref" copy only for beta > 0: build with beta 0, then set it back
    (TRL reads trainer.beta each step and, with no ref_model, disables the adapter). With
    train.grpo.sft_weight the trainer gains the SFT term on rows' completions (grpo_sft). Its
    rollouts sample each completion from a stream of its own (row_sampling.py)."""
    # lazy: heavy to import (moetune)
    from moetune.train.grpo.row_sampling import with_row_sampling
    from moetune.train.grpo.sft import with_sft_term

    kwargs = dict(kwargs)
    trainer = with_row_sampling(with_sft_term(trainer, kwargs.pop("sft_weight", 0.0)))
    args, beta = kwargs["args"], kwargs["args"].beta
    args.beta = 0.0
    try:
        built = trainer(**kwargs)
    finally:
        args.beta = beta
    built.beta = beta
    return built


def _trainer_rows(trainer: Any, tok: Any) -> tuple[Any, Callable[[list[Any]], Any]]:
    return trainer.train_dataset, trainer.data_collator


def _prompt_rows(trainer: Any, tok: Any) -> tuple[Any, Callable[[list[Any]], Any]]:
    """GRPO's rows are prompts: the base's routing is measured on them, tokenised as the
    rollout feeds them (plain text, or the chat template with a generation prompt)."""

    def ids(prompt: Any) -> dict[str, Any]:
        if isinstance(prompt, str):
            return {"input_ids": tok(prompt, add_special_tokens=False)["input_ids"]}
        out = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        return {"input_ids": list(out["input_ids"] if hasattr(out, "keys") else out)}

    dataset, _ = sampled(trainer.train_dataset, BASE_ROWS)  # streamed: its first rows
    rows = [ids(r["prompt"]) for r in dataset]
    return rows, lambda batch: dict(tok.pad(batch, return_tensors="pt"))


@dataclass(frozen=True)
class Method:
    """One objective: what it reads, how TRL is configured for it, what it adds."""

    name: str
    trainer: str  # the TRL trainer class
    config: str  # its TRL config class
    formats: tuple[str, ...]  # data formats (moetune.data FORMATS) it trains on
    args: Callable[[RunConfig, TrainData], dict[str, Any]]  # its own TRL config fields
    trainer_kwargs: Callable[[RunConfig], dict[str, Any]] = _no_kwargs
    check: Callable[[RunConfig, TrainData], None] = _none  # data/config checks, before writing
    tokenized_rows: bool = True  # the collator yields model inputs (ESFT scores them)
    rollout: bool = False  # samples completions each step (routing shift, generation plan)
    build: Callable[[type, dict[str, Any]], Any] = _plain_build  # the trainer from its kwargs
    # (rows, collate) the base's routing is measured on before the first step
    routing_rows: Callable[[Any, Any], tuple[Any, Callable[[list[Any]], Any]]] = _trainer_rows

    def classes(self) -> tuple[type, type]:
        """(trainer class, config class) from TRL, imported on use."""
        # lazy: heavy to import (trl)
        import trl

        return getattr(trl, self.trainer), getattr(trl, self.config)


def _sft_args(cfg: RunConfig, data: TrainData) -> dict[str, Any]:
    return {"max_length": cfg.train.seq_len, "packing": cfg.data.packing, **data.loss.sft}


def _dpo_args(cfg: RunConfig, data: TrainData) -> dict[str, Any]:
    d = cfg.train.dpo
    return {
        "max_length": cfg.train.seq_len,
        "beta": d.beta,
        "loss_type": [d.loss_type, "sft"] if d.sft_weight else [d.loss_type],
        "loss_weights": [1.0, d.sft_weight] if d.sft_weight else None,
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

    funcs, _ = build_rewards(cfg.train.grpo)
    return {"reward_funcs": funcs, "sft_weight": cfg.train.grpo.sft_weight}


def _grpo_check(cfg: RunConfig, data: TrainData) -> None:
    """The group must divide the batch, the rewards must build and find their columns (and
    the sft term its completions)."""
    # lazy: heavy to import (moetune)
    from moetune.train.grpo.sft import check_sft_rows

    g, t = cfg.train.grpo, cfg.train
    if (t.batch_size * t.grad_accum) % g.num_generations:
        raise TrainError(
            f"train.batch_size × grad_accum = {t.batch_size * t.grad_accum} is not a multiple "
            f"of train.grpo.num_generations = {g.num_generations}",
            "make the batch a multiple of the group (e.g. batch_size: 8, num_generations: 4)",
        )
    if g.use_vllm and "experts" in cfg.lora.targets:
        raise TrainError(
            "train.grpo.use_vllm: TRL's vLLM weight sync merges only peft's linear LoRA "
            "layers, so the rollouts would sample from the base experts, not the policy",
            "set train.grpo.use_vllm: false (TRL's own generation runs the expert LoRA)",
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
    funcs, _ = build_rewards(g)  # a bad reward fails here, before anything is written
    columns = set(data.columns())
    if g.sft_weight:
        check_sft_rows(data)
    for name in reward_columns(g):
        if name not in columns:
            raise DataError(
                f"{data.path}: a reward ({', '.join(ANSWER_SCORES)}) reads column {name!r}, "
                "which the rows lack "
                f"(columns: {', '.join(sorted(columns))})",
                f"add {name!r} to every row, or set column: in the reward entry",
            )
    if data.head(1):  # its shape on one row, before the model is built
        dry_call(funcs, data.head(1)[0], g.num_generations)


METHODS: Registry[Method] = Registry("training method")
for _method in (
    Method("sft", "SFTTrainer", "SFTConfig", ("messages", "prompt/completion", "text"),
           _sft_args),
    Method("dpo", "DPOTrainer", "DPOConfig", ("preference",), _dpo_args, build=_dpo_build),
    Method("grpo", "GRPOTrainer", "GRPOConfig", ("prompt",), _grpo_args,
           trainer_kwargs=_grpo_rewards, check=_grpo_check, tokenized_rows=False,
           rollout=True, build=_grpo_build, routing_rows=_prompt_rows),
):  # fmt: skip
    METHODS.add(_method.name, _method)


def method_of(cfg: RunConfig) -> Method:
    return METHODS.get(cfg.train.method)


def reference_of(trainer: Any) -> str:
    """How the trainer computes its reference policy: "none" (sft, grpo with beta 0),
    "adapter disabled", or what else TRL set up (a copy – never with moetune's build)."""
    if getattr(trainer, "ref_model", None) is not None:
        return "separate model"
    if "ref" in getattr(trainer.model, "peft_config", {}):
        return "ref adapter copy"
    uses = hasattr(trainer, "ref_model") and getattr(trainer, "beta", 1.0) != 0.0
    return "adapter disabled" if uses else "none"
