"""`load`: a base as `moetune train` would train it – placement and dtype, int8 / NF4
experts, a published quantised base as stored, offload – with the recipe's LoRA attached,
audited (every requested target adapted, the router frozen unless asked) and split by
moetune's engine. The same functions as `moetune train` (train/setup.py, train/model.py):
no second loading path."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moetune.api.configure import ConfigLike, run_config
from moetune.data.tokenizer import run_tokenizer
from moetune.train.model import finish_lora, load_model, peft_wrapped
from moetune.train.setup import resolve_placement, settle_base

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedTokenizerBase

    from moetune.config import RunConfig
    from moetune.model.spec import ModelSpec
    from moetune.recipe.audit import CoverageReport

SPEC = "_moetune_spec"  # on a loaded model: what `callbacks` records the routing by


@dataclass(frozen=True)
class Loaded:
    """What `load` returns; unpacks as `model, tokenizer = moetune.load(...)`."""

    model: PeftModel  # the base with LoRA, ready for any TRL / transformers trainer
    tokenizer: PreTrainedTokenizerBase
    config: RunConfig  # as it loaded (checkpointing off where the family refuses it)
    spec: ModelSpec
    coverage: CoverageReport  # every requested target adapted, the router untouched
    engine: str  # lora.engine as resolved: peft | split
    stored: str | None  # the format a base published quantised is read as (None: float)
    device: str  # where train.device put it: cuda | mps | cpu
    precision: str  # bf16 | fp32 (TRL's bf16 flag)
    findings: list[Any]  # the lint's findings (moetune.lint's Finding)
    notes: list[str]  # what `moetune train` would have warned about

    def __iter__(self) -> Iterator[Any]:
        return iter((self.model, self.tokenizer))


def load(config: ConfigLike = None, /, *, allow_errors: bool = False, **sections: Any) -> Loaded:
    """The base of `config` loaded as planned, with split LoRA attached and audited.

    `config`: a run.yaml path, a model id, a dict or a RunConfig; `sections`: run.yaml
    sections over it (`model={"experts_dtype": "nf4"}`). The lint's error findings refuse
    the load (as `moetune train` does) unless `allow_errors`."""
    cfg = run_config(config, **sections)
    place = resolve_placement(cfg.train)
    base = settle_base(cfg, place, allow_errors)
    cfg = base.cfg
    # checked before any weight loads, as `moetune train` does (data.chat_template applied)
    tokenizer = run_tokenizer(cfg, base.spec.vocab_size, None)
    model = load_model(cfg, place, base.engine, base.stored, base.load_dtype)
    wrapped, report, notes, built = peft_wrapped(model, cfg, base.spec)
    finish_lora(wrapped, report, cfg, base.engine, built)
    wrapped.__dict__[SPEC] = base.spec
    return Loaded(
        model=wrapped,  # type: ignore[arg-type]
        tokenizer=tokenizer,
        config=cfg,
        spec=base.spec,
        coverage=report,
        engine=base.engine,
        stored=base.stored,
        device=place.device,
        precision=place.precision,
        findings=base.findings,
        notes=base.notes + notes,
    )
