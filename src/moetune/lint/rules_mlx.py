"""Rules for the other stacks: mlx-lm (Apple silicon and Linux CPU) and GGUF bases."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from functools import cache
from importlib import metadata, util

import moetune.lint.rules  # noqa: F401  (first: probes needs it whole; safe entry point)
from moetune.lint import probes, probes_mlx
from moetune.lint.rules import Hit, LintContext, register_rule
from moetune.model.families import ModulePaths

# Module names mlx-lm matches at model level (its second pass over model.named_modules()).
MLX_MODEL_LEVEL = ("lm_head", "model.embed_tokens")


def version_tuple(text: str) -> tuple[int, ...]:
    """'0.31.2rc1' -> (0, 31, 2); enough for the pins below."""
    parts = []
    for piece in text.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


@dataclass(frozen=True)
class PinTrap:
    """A known-bad mlx-lm/transformers combination."""

    applies: Callable[[Mapping[str, str]], bool]
    message: str
    fix: str


def _mlx_needs_tf5(v: Mapping[str, str]) -> bool:
    return version_tuple(v["mlx-lm"]) >= (0, 30, 6) and version_tuple(
        v.get("transformers", "0")
    ) < (5,)


def _tf513_breaks_mlx031(v: Mapping[str, str]) -> bool:
    return v.get("transformers") == "5.13.0" and version_tuple(v["mlx-lm"])[:2] == (0, 31)


PIN_TRAPS = (
    PinTrap(
        _mlx_needs_tf5, "mlx-lm >= 0.30.6 needs transformers >= 5", "pip install 'transformers>=5'"
    ),
    PinTrap(
        _tf513_breaks_mlx031,
        "transformers 5.13.0 breaks `import mlx_lm` 0.31.x",
        "pip install 'transformers!=5.13.0'",
    ),
)


def pin_problems(versions: Mapping[str, str]) -> list[PinTrap]:
    """The known-bad combinations `versions` hits (none when mlx-lm is absent)."""
    if "mlx-lm" not in versions or versions["mlx-lm"] == "absent":
        return []
    return [trap for trap in PIN_TRAPS if trap.applies(versions)]


@dataclass(frozen=True)
class MlxBackend:
    """Whether mlx-lm can run here: mlx-lm's version, mlx's, and the device mlx computes on
    (metal / cuda / cpu), or why there is none."""

    mlx_lm: str | None
    mlx: str | None
    backend: str | None
    device: str | None
    error: str | None = None

    def to_json(self) -> dict[str, str | None]:
        return asdict(self)


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


@cache
def mlx_backend() -> MlxBackend:
    """Import mlx.core (cheap: ~20 ms) and ask it for its device; never raises."""
    lm, core = _dist_version("mlx-lm"), _dist_version("mlx")
    if util.find_spec("mlx") is None:
        return MlxBackend(lm, core, None, None, "No module named 'mlx'")
    try:
        import mlx.core as mx  # type: ignore[import-not-found]
    except ImportError as exc:  # mlx without its backend wheel (mlx-cpu / mlx-metal)
        return MlxBackend(lm, core, None, None, str(exc).splitlines()[0])
    kinds = [("metal", mx.metal), ("cuda", getattr(mx, "cuda", None))]
    gpu = next((name for name, mod in kinds if mod is not None and mod.is_available()), None)
    return MlxBackend(lm, core, gpu or "cpu", str(mx.default_device()))


_INSTALL = "pip install 'moetune[mlx]' (mlx-lm with its backend), or use lora.stack=peft"


def backend_fix() -> str:
    """The install line that brings mlx-lm's backend on this platform."""
    if sys.platform == "darwin":
        return "pip install mlx (Apple silicon), or pip install 'moetune[mlx]'"
    return "pip install 'mlx[cpu]' (Linux x86-64, glibc >= 2.35), or pip install 'moetune[mlx]'"


def _is_mlx(ctx: LintContext) -> bool:
    return ctx.config.lora.stack == "mlx"


def mlx_paths(p: ModulePaths) -> tuple[str, ...]:
    """Every module name mlx-lm can adapt in this family (layer-relative or model-level)."""
    layer = p.mlx_attention + p.mlx_experts + p.mlx_dense + p.mlx_shared + p.mlx_router
    return layer + MLX_MODEL_LEVEL


def suggested_mlx_keys(p: ModulePaths) -> list[str]:
    """Attention + expert stack: the keys that reach the experts and leave the router alone."""
    return [*p.mlx_attention, *p.mlx_experts]


@register_rule(
    "MLX-DEFAULT-KEYS",
    "warn",
    "mlx-lm without explicit keys adapts every Linear, router included",
    probe=probes_mlx.mlx_default_keys,
    libraries=("mlx-lm",),
)
def default_keys(ctx: LintContext) -> Hit | None:
    if not _is_mlx(ctx) or ctx.config.lora.mlx_keys is not None or not ctx.is_moe:
        return None
    example = suggested_mlx_keys(ctx.paths) if ctx.paths else ["self_attn.q_proj", "…"]
    return Hit(
        "mlx-lm with no lora_parameters.keys adapts every Linear/SwitchLinear/Embedding in the "
        "layers – the router included – so routing drifts",
        f"set lora.mlx_keys explicitly, e.g. {example}",
        "lora.mlx_keys",
    )


@register_rule(
    "MLX-KEYS-NO-MATCH",
    "error",
    "mlx-lm keys that match no module are silently ignored",
    probe=probes_mlx.mlx_keys_no_match,
    libraries=("mlx-lm",),
)
def keys_no_match(ctx: LintContext) -> Hit | None:
    keys, family, paths = ctx.config.lora.mlx_keys, ctx.family, ctx.paths
    if not _is_mlx(ctx) or not keys or family is None or paths is None:
        return None
    if not family.mlx_supported:
        return None  # mlx-lm cannot load this family at all; the mlx recipe says so
    unmatched = [k for k in keys if k not in mlx_paths(paths)]
    if not unmatched:
        return None
    hint = (
        " (HF per-expert names; mlx-lm stacks experts in switch_mlp)"
        if any(".experts." in k for k in unmatched)
        else ""
    )
    return Hit(
        f"{len(unmatched)} of {len(keys)} lora.mlx_keys match no {family.model_type} module in "
        f"mlx-lm and are ignored without a word: {unmatched[:4]}{hint}",
        f"use mlx-lm module names, e.g. {suggested_mlx_keys(paths)}",
        "lora.mlx_keys",
    )


@register_rule(
    "MLX-TRANSFORMERS-PIN",
    "error",
    "known-bad mlx-lm / transformers version combination",
    probe=probes_mlx.mlx_transformers_pin,
    libraries=("mlx-lm", "transformers"),
)
def transformers_pin(ctx: LintContext) -> Hit | None:
    if not _is_mlx(ctx):
        return None
    problems = pin_problems(ctx.versions)
    if not problems:
        return None
    installed = f"mlx-lm {ctx.versions['mlx-lm']}, transformers {ctx.versions.get('transformers')}"
    return Hit(
        f"{'; '.join(p.message for p in problems)} (installed: {installed}) – mlx_lm fails "
        "to import or load",
        "; ".join(p.fix for p in problems),
        None,
    )


@register_rule(
    "MLX-NO-BACKEND",
    "error",
    "mlx-lm installed without an mlx backend",
    probe=probes_mlx.mlx_no_backend,
    libraries=("mlx-lm",),
)
def no_backend(ctx: LintContext) -> Hit | None:
    if not _is_mlx(ctx):
        return None
    found = mlx_backend()
    if found.backend is not None:
        return None
    if found.mlx_lm is None:
        return Hit("lora.stack=mlx but mlx-lm is not installed", _INSTALL, "lora.stack")
    return Hit(
        f"mlx-lm {found.mlx_lm} is installed without an mlx backend ({found.error}): "
        "`import mlx_lm` fails before training (plain `pip install mlx-lm` brings mlx only "
        "on macOS)",
        backend_fix(),
        "lora.stack",
    )


@register_rule(
    "GGUF-NOT-TRAINABLE",
    "error",
    "a GGUF base cannot be fine-tuned",
    probe=probes.gguf_not_trainable,
    libraries=("transformers",),
)
def gguf(ctx: LintContext) -> Hit | None:
    model = ctx.config.model
    if not model.is_gguf:
        return None
    return Hit(
        f"{model.id} is a GGUF (llama.cpp inference format): peft and mlx-lm cannot train it, "
        "and a dequantized GGUF is a lossy copy of the original weights",
        "set model.id to the original safetensors repo (e.g. Qwen/Qwen3-30B-A3B) and "
        "model.format: hf; then moetune export RUN --format gguf (llama.cpp's own "
        "convert_lora_to_gguf.py stops on expert LoRA)",
        "model.id",
    )


def fused_mlx_keys(model_id: str) -> list[str]:
    """Stacked `switch_mlp` expert tensors in a local checkpoint (an mlx_lm.fuse output)."""
    from pathlib import Path

    root = Path(model_id)
    if not root.is_dir():
        return []
    from safetensors import safe_open

    found: list[str] = []
    for path in sorted(root.glob("*.safetensors")):
        try:
            with safe_open(str(path), "np") as fh:
                found += [k for k in fh.keys() if ".switch_mlp." in k]  # noqa: SIM118
        except Exception:  # an unreadable file is the loader's error to report
            continue
    return found


@register_rule(
    "MLX-FUSED-KEYS",
    "error",
    "an mlx_lm.fuse output loads in transformers with random experts",
    probe=probes_mlx.mlx_fused_keys,
    libraries=("transformers", "mlx-lm"),
)
def fused_keys(ctx: LintContext) -> Hit | None:
    if ctx.config.lora.stack == "mlx":  # mlx-lm reads its own layout
        return None
    stacked = fused_mlx_keys(ctx.config.model.id)
    if not stacked:
        return None
    return Hit(
        f"{ctx.config.model.id} holds mlx-lm's stacked expert tensors ({stacked[0]}, "
        f"{len(stacked)} in all): transformers loads it without an error but with every "
        "expert randomly initialised",
        "convert it first: moetune.export.mlx.fused_to_hf(FUSED_DIR, OUT_DIR) "
        "(or use lora.stack=mlx)",
        "model.id",
    )
