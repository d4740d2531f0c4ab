"""The reference memory estimate: one real training step, traced on fake tensors.

The model is built from its transformers config on the `meta` device, peft is applied
there (peft cannot swap parameters under `FakeTensorMode`), and only then are the tensors
made fake with `to_empty`. The step is the real one – forward with labels (the model's
own loss), backward, a `torch.optim.AdamW` step (fused by default, as HF Trainer and TRL
run it) and zero_grad – under a `ByteTracker` that counts live tensor bytes at every aten
op. Nothing is allocated for real, so a 235B model traces in RAM a laptop has;
`fake=False` runs the same step on real tensors, which is how the trace is checked byte
for byte. Both route balanced (`plan.balanced`): every expert gets top_k × tokens / n, so
an eager expert loop that reads its routing (nonzero, `.tolist()`) traces too.

The loss is computed as moetune's trainer computes it: TRL's SFTTrainer projects through
a fused, tiled LM head (`trl.trainer.utils.add_fused_lm_head`) and never holds the
(tokens × vocab) logits. On CUDA that head folds each tile with Triton kernels that write
in place; on CPU TRL folds with torch ops that make fp32 copies of each tile. The trace
sizes the CUDA step, so the folds are replaced by in-place stand-ins (bytes, not values,
are what a trace measures). `loss="full"` traces the model's own loss on full logits
(what a plain transformers Trainer does).

The step's parts (`build_step_model`, `prepare_for_training`, `add_fused_head`,
`in_place_folds`, `TrainLoop`, `run_steps`) are public so that a real-step check
(benchmarks/gpu_validate.py) runs exactly the step that is traced.
"""

from __future__ import annotations

import contextlib
import copy
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from unittest import mock

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from moetune.config.keys import splits
from moetune.errors import ConfigError, MoetuneError, TraceError
from moetune.model.derive import causal_lm_class, ensure_backbone
from moetune.model.fixes.registry import apply_fixes
from moetune.plan.trace.balanced import BalancedRouting
from moetune.plan.trace.bytes import FROZEN, GRADIENTS, OPTIMIZER, TRAINABLE, ByteTracker

if TYPE_CHECKING:
    from peft import LoraConfig
    from transformers import PretrainedConfig


# torch.optim.AdamW flags per implementation (HF Trainer's "adamw_torch_fused" is fused=True).
_ADAMW_FLAGS: dict[str, dict[str, Any]] = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "for-loop": {"foreach": False, "fused": False},
}
LOSSES = ("fused", "full")  # TRL's fused LM head (moetune's trainer) | full logits + CE


@dataclass(frozen=True)
class TraceResult:
    """Live tensor bytes of one training step (no allocator or CUDA-context overhead)."""

    peak_bytes: int  # peak live tensor bytes during the step
    peak_op: str  # aten op at which the peak occurred, e.g. "aten._foreach_sqrt.default"
    peak_phase: str  # "forward", "backward" or "optimizer"
    at_peak: dict[str, int]  # live bytes at the peak by category (tracker.CATEGORIES)
    trainable_params: int
    total_params: int
    seconds: float
    peak_step: int = 1  # which step peaked (only >1 when traced with steps>1)
    ops: int = 0  # aten ops the step dispatched (plan.trace.duration sizes a trace's time by them)

    @property
    def peak_gib(self) -> float:
        return self.peak_bytes / 2**30


def trace_step(
    hf_config: PretrainedConfig,
    peft_config: LoraConfig | None,
    *,
    seq_len: int,
    batch_size: int = 1,
    gradient_checkpointing: bool = True,
    dtype: torch.dtype = torch.bfloat16,
    device: str = "cpu",
    fake: bool = True,
    seed: int = 0,
    optimizer: str = "fused",
    steps: int = 1,
    engine: str = "peft",
    experts_dtype: str = "bf16",
    double_quant: bool = False,
    loss: str = "fused",
    experts_options: dict[str, Any] | None = None,
    stored_config: dict[str, Any] | None = None,
) -> TraceResult:
    """Trace one training step and return its peak live tensor bytes.

    `peft_config=None` means full fine-tuning (every parameter trainable). With
    `fake=False` the same step runs on real tensors on `device`. `optimizer` picks the
    AdamW implementation: "fused" (what HF Trainer/TRL use on torch >= 2.8: no
    temporaries), "foreach" (plain `torch.optim.AdamW` on CUDA: a full-size fp32
    temporary of the trainable weights at its peak) or "for-loop" (one tensor at a time).
    `steps=2` also covers the steady state, where the Adam moments stay live through
    forward and backward. `engine="moetune"` traces moetune's split-LoRA experts instead of
    peft's ParamWrapper; `experts_dtype` "int8"/"nf4" stores the frozen expert stacks
    quantised (engine.quant), which needs that engine; a published format's name ("fp8",
    "mxfp4" …: a base kept as stored) builds them in its layout with its own `quantize` on
    meta, at the checkpoint's blocks / groups (`experts_options`, StoredFormat.options), its
    other Linears stored but for those its `stored_config` (quantization_config) lists. `loss`
    "fused" is TRL's tiled LM head (what moetune trains with), "full" the model's own loss
    on full logits. Neither config is modified.
    """
    _check_inputs(seq_len, batch_size, steps, dtype, device, fake, optimizer)
    _check_loss(loss)
    start = time.perf_counter()
    tracker = ByteTracker()
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            torch.manual_seed(seed)
            warnings.simplefilter("ignore", FutureWarning)  # peft calls renamed transformers APIs
            # peft checks expert-rank pattern keys against module names, not the parameter
            # paths it then applies them to (recipe.targets.peft_notes)
            warnings.filterwarnings("ignore", "The following (rank|alpha)_pattern keys")
            model = build_step_model(
                copy.deepcopy(hf_config), copy.deepcopy(peft_config), dtype, device, fake,
                engine, (experts_dtype, double_quant, experts_options or {}), stored_config,
            )  # fmt: skip
            prepare_for_training(model, peft_config is None, gradient_checkpointing)
            fused = loss == "fused"
            if fused:
                add_fused_head(model)
            with _fake_mode(fake), in_place_folds(fused):
                if fake:
                    _materialize(model, device)
                loop = TrainLoop(model, optimizer, (batch_size, seq_len), device, fused)
                run_steps(tracker, loop, steps)
    except MoetuneError:
        raise
    except Exception as exc:  # anything else is a trace failure, named by where it happened
        raise _trace_failure(exc, tracker) from exc
    return _result(tracker, model, time.perf_counter() - start)


def _check_inputs(
    seq_len: int,
    batch_size: int,
    steps: int,
    dtype: torch.dtype,
    device: str,
    fake: bool,
    optimizer: str,
) -> None:
    if seq_len <= 0 or batch_size <= 0 or steps <= 0:
        raise ConfigError(
            f"seq_len={seq_len}, batch_size={batch_size} and steps={steps} must be positive.",
            "pass a sequence length, batch size and step count of at least 1.",
        )
    if optimizer not in _ADAMW_FLAGS:
        raise ConfigError(
            f"unknown optimizer implementation {optimizer!r}.",
            f"use one of {', '.join(_ADAMW_FLAGS)}.",
        )
    if not dtype.is_floating_point:
        raise ConfigError(f"dtype {dtype} is not a floating-point type.", "use torch.bfloat16.")
    try:
        device_type = torch.device(device).type
    except RuntimeError as exc:
        raise ConfigError(f"{device!r} is not a torch device.", "use 'cpu' or 'cuda'.") from exc
    if fake and device_type != "cpu":
        raise ConfigError(
            f"a fake trace runs on the 'cpu' device, not {device!r}.",
            "use device='cpu' (bytes are device-independent), or fake=False on a real device.",
        )


def _check_loss(loss: str) -> None:
    if loss not in LOSSES:
        raise ConfigError(f"unknown loss {loss!r}.", f"use one of {', '.join(LOSSES)}.")


def add_fused_head(model: Any) -> None:
    """TRL's fused LM head on the base model, as SFTTrainer adds it."""
    # lazy: heavy to import (trl)
    from trl.trainer.utils import add_fused_lm_head

    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    add_fused_lm_head(base, outputs=_SFT_OUTPUTS)


_SFT_OUTPUTS = ("log_probs", "entropy", "is_top1")  # what SFTTrainer asks the head for


def _fold_in_place(tile: torch.Tensor, *args: Any, **kwargs: Any) -> None:
    """Stands in for TRL's Triton tile kernels and fp32 GEMM-accumulate: no allocation."""


@contextlib.contextmanager
def in_place_folds(active: bool) -> Iterator[None]:
    """While `active`, TRL's LM-head tile folds are no-op stand-ins that write in place."""
    if not active:
        yield
        return
    # lazy: heavy to import (trl)
    from trl.kernels import chunked_logprob

    with contextlib.ExitStack() as stack:
        for name in ("_forward_tile", "_backward_tile", "_addmm_fp32"):
            stack.enter_context(mock.patch.object(chunked_logprob, name, _fold_in_place))
        yield


def build_step_model(
    hf_config: PretrainedConfig,
    peft_config: LoraConfig | None,
    dtype: torch.dtype,
    device: str,
    fake: bool,
    engine: str = "peft",
    experts: tuple[str, bool, dict[str, Any]] = ("bf16", False, {}),
    stored_config: dict[str, Any] | None = None,
) -> Any:
    """The model (a PeftModel when `peft_config` is given), on `meta` when fake; a stored
    base's Linears its `stored_config` lists (ignore / exclude_modules) stay float."""
    # lazy: heavy to import (peft, transformers via moetune.engine)
    from moetune.engine.quant.stacks import peft_targets

    with torch.device("meta" if fake else device):
        model = ensure_backbone(causal_lm_class(hf_config)._from_config(hf_config, dtype=dtype))
        apply_fixes(model)  # the step the trainer runs (step3p5: a window its mask needs)
        if experts[0] != "bf16":
            _quantize(model, engine, *experts, stored_config or {})
        if peft_config is not None:
            # lazy: heavy to import (peft)
            from peft import get_peft_model

            with peft_targets(model):  # peft sees quantised stacks only through stand-ins
                model = get_peft_model(model, peft_config)
            # lazy: heavy to import (peft, transformers via moetune.engine)
            from moetune.engine.forwards import apply_overrides

            apply_overrides(model)  # the experts forward the trainer runs (dbrx)
            if splits(engine) and peft_config.target_parameters:
                # lazy: heavy to import (peft, transformers via moetune.engine)
                from moetune.engine import apply_split_lora

                apply_split_lora(model)
    return model


def _quantize(model: Any, engine: str, experts_dtype: str, double_quant: bool,
              options: dict[str, Any], stored_config: dict[str, Any]) -> None:  # fmt: skip
    """Expert stacks quantised as the trainer loads them, each on the split forward."""
    # lazy: heavy to import (peft, transformers via moetune.engine)
    from moetune.engine import IMPLEMENTATION, register
    from moetune.engine.quant.stacks import quantize_experts_, require_split_engine
    from moetune.engine.stored.linear import store_float_linears_

    require_split_engine(engine, experts_dtype)
    quantize_experts_(model, experts_dtype, double_quant, error_experts=0, options=options)
    store_float_linears_(model, experts_dtype, options, stored_config)  # a stored base's Linears
    register()
    model.set_experts_implementation(IMPLEMENTATION)


def prepare_for_training(model: Any, full: bool, gradient_checkpointing: bool) -> None:
    """What a peft/TRL training run does to the model before the first step (checkpointing
    only where the class supports it: moetune trains jetmoe without, planner.as_checkpointable)."""
    if full:
        model.requires_grad_(True)
    base = model if full else model.get_base_model()
    if gradient_checkpointing and getattr(base, "supports_gradient_checkpointing", True):
        enable = getattr(base, "activation_checkpointing_enable", None)
        if enable is not None:  # transformers >= 5.24 name; the old one warns
            enable(activation_checkpointing_kwargs={"use_reentrant": False})
        else:
            base.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        if not full:  # peft and TRL do this so checkpointed blocks see a grad-requiring input
            base.enable_input_require_grads()
    model.train()


@contextlib.contextmanager
def _fake_mode(fake: bool) -> Iterator[None]:
    if not fake:
        with BalancedRouting(None):  # the real step routes as the fake one (plan.balanced)
            yield
        return
    # lazy: heavy to import (transformers)
    from transformers import masking_utils

    # A real run reads the position ids to decide whether a row packs several sequences;
    # fake tensors have no values, so transformers would assume packing and build a full
    # mask (and materialise repeated K/V for it). Our rows hold one sequence each: say so.
    # Non-fake inputs are allowed because `to_empty` reads the meta parameters.
    with (
        mock.patch.object(masking_utils, "find_packed_sequence_indices", _no_packing),
        FakeTensorMode(allow_non_fake_inputs=True) as mode,
        BalancedRouting(mode),  # below the tracker: nonzero / .item() on routing answered
    ):
        yield


def _no_packing(position_ids: torch.Tensor) -> None:
    return None  # a plain function: a Mock would keep `position_ids` alive in call_args


def _materialize(model: nn.Module, device: str) -> None:
    """Give the meta model fake storage, rotary frequencies recomputed (they are not stored).

    Fake tensors expose no values, so this changes no byte; it only keeps the buffers as a
    loaded model has them.
    """
    model.to_empty(device=device)
    found: Any = getattr(model, "get_base_model", None)
    base: Any = found() if callable(found) else model
    if getattr(base.config, "tie_word_embeddings", False) and hasattr(base, "tie_weights"):
        base.tie_weights()  # to_empty gives a tied head its own storage; a loaded model shares it
    for module in model.modules():
        has_rope = isinstance(getattr(module, "rope_type", None), str)
        if has_rope and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            fresh, _ = _rope_init(module)(module.config)
            for name in ("inv_freq", "original_inv_freq"):
                buffer = getattr(module, name, None)
                if isinstance(buffer, torch.Tensor):
                    buffer.copy_(fresh)


def _rope_init(module: Any) -> Any:
    # lazy: heavy to import (transformers)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if module.rope_type == "default" and hasattr(module, "compute_default_rope_parameters"):
        return module.compute_default_rope_parameters
    return ROPE_INIT_FUNCTIONS[module.rope_type]


class TrainLoop:
    """A training loop's parts: the model, its AdamW, and a batch maker."""

    def __init__(
        self, model: Any, adamw: str, shape: tuple[int, int], device: str, fused: bool
    ) -> None:
        self.model = model
        self.extra = {"fused_lm_head": True} if fused else {}
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-4, **_ADAMW_FLAGS[adamw])
        self.shape = shape
        self.device = device
        self.vocab = model.config.get_text_config().vocab_size

    def loss(self) -> torch.Tensor:
        """Forward on a fresh batch; only the loss is kept, as Trainer.compute_loss does."""
        input_ids = torch.randint(0, self.vocab, self.shape, device=self.device)
        labels = input_ids.clone()  # a collator's separate labels tensor
        return self.model(input_ids=input_ids, labels=labels, use_cache=False, **self.extra).loss


def run_steps(tracker: ByteTracker, loop: TrainLoop, steps: int) -> None:
    """Forward with labels, backward, AdamW step, zero_grad – under the tracker."""
    params = list(loop.model.parameters())
    tracker.register((p for p in params if not p.requires_grad), FROZEN)
    tracker.register(loop.trainable, TRAINABLE)
    tracker.register(loop.model.buffers(), FROZEN)
    with tracker:
        for step in range(1, steps + 1):
            tracker.step = step
            tracker.phase = "forward"
            loss = loop.loss()
            tracker.phase = "backward"
            loss.backward()
            del loss
            tracker.phase = "optimizer"
            loop.optimizer.step()
            # Label now: zero_grad frees the grads, and a category outlives its storage.
            tracker.classify((p.grad for p in loop.trainable if p.grad is not None), GRADIENTS)
            tracker.classify(_state_tensors(loop.optimizer), OPTIMIZER)
            loop.optimizer.zero_grad(set_to_none=True)


def _state_tensors(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for state in optimizer.state.values():
        yield from (value for value in state.values() if isinstance(value, torch.Tensor))


def _result(tracker: ByteTracker, model: nn.Module, seconds: float) -> TraceResult:
    params = list(model.parameters())
    return TraceResult(
        peak_bytes=tracker.peak.bytes,
        peak_op=tracker.peak.op,
        peak_phase=tracker.peak.phase,
        peak_step=tracker.peak.step,
        at_peak=tracker.at_peak(),
        trainable_params=sum(p.numel() for p in params if p.requires_grad),
        total_params=sum(p.numel() for p in params),
        seconds=seconds,
        ops=tracker.ops,
    )


def _trace_failure(exc: Exception, tracker: ByteTracker) -> TraceError:
    where = "while building the model"
    if tracker.phase != "setup":
        where = f"at {tracker.last_op} in the {tracker.phase} phase"
    return TraceError(
        f"the training-step trace failed {where}: {type(exc).__name__}: {exc}",
        "check that the model config and LoRA targets load in transformers/peft; "
        "a data-dependent op on values computed from weights cannot be traced (plan.balanced "
        "answers those on the routing).",
    )
