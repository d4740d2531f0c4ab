"""Whole models between transformers and mlx-lm, and the served == trained check.

- `hf_to_mlx`: a transformers checkpoint as an mlx-lm model dir through mlx-lm's own
  `convert`, after filling the config fields mlx-lm's `ModelArgs` needs from the spec
  (transformers 5 saves `num_local_experts` / `rope_parameters` where mlx-lm's qwen3_moe
  wants `num_experts`, `head_dim`, `rope_theta`). On mlx's CPU backend the expert matmul
  (`GatherMM`) runs in float32 only, so the weights are converted to float32 there.
- `fused_to_hf`: an `mlx_lm.fuse` output (stacked `switch_mlp.*` experts) rebuilt as
  transformers' own model and saved by transformers, so it loads exactly.
- `served_matches_trained`: the peft adapter in transformers and its mlx-lm conversion in
  mlx-lm give the same logits on the same tokens (float32, relative norm).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.export.mlx import MlxExportError, MlxNames, _commit, _fresh, mlx_names, peft_to_mlx
from moetune.model import ModelSpec, load_spec, spec_from_config

if TYPE_CHECKING:
    import torch

# Small files of a model dir that travel with it (tokenizer, generation settings).
_SIDE_FILES = re.compile(r"(tokenizer.*|special_tokens_map|generation_config|chat_template.*)\.\w+")
_LAYER_KEY = re.compile(r"^(?P<layers>.+\.layers)\.(?P<i>\d+)\.(?P<rel>.+)\.(?P<leaf>weight|bias)$")


def mlx_dtype(requested: str | None = None) -> str | None:
    """The dtype to convert to: as requested, else float32 on mlx's CPU backend (GatherMM
    is float32-only there), else the checkpoint's own."""
    from moetune.recipe.rules_mlx import backend_fix, mlx_backend

    if requested:
        return requested
    found = mlx_backend()
    if found.backend is None:
        raise MlxExportError(f"mlx-lm cannot run here: {found.error}", backend_fix())
    return "float32" if found.backend == "cpu" else None


def _rope_theta(config: dict[str, Any]) -> float | None:
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    return float(theta) if theta is not None else None


def mlx_config(config: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """`config` with the fields mlx-lm's ModelArgs for this type needs filled from the spec:
    every required field it lacks, and rope_theta (mlx-lm's defaults differ per family)."""
    from mlx_lm.utils import _get_classes  # type: ignore[import-not-found]

    try:
        _, args_class = _get_classes(config)
    except ValueError as exc:
        raise MlxExportError(f"mlx-lm {exc}", "use lora.stack=peft for this model type") from None
    known = {
        "num_experts": spec.num_experts,
        "num_local_experts": spec.num_experts,
        "head_dim": spec.head_dim,
        "num_key_value_heads": spec.num_kv_heads,
        "moe_intermediate_size": spec.expert_intermediate_size,
        "rope_theta": _rope_theta(config),
    }
    filled = dict(config)
    for field in dataclasses.fields(args_class):
        required = field.default is dataclasses.MISSING and (
            field.default_factory is dataclasses.MISSING
        )
        if field.name in filled or (not required and field.name != "rope_theta"):
            continue
        value = known.get(field.name, spec.hf_config.get(field.name))
        if value is None and required:
            raise MlxExportError(
                f"{spec.name}: mlx-lm's {config['model_type']} needs `{field.name}`, which "
                "config.json does not give",
                f"add {field.name} to config.json",
            )
        if value is not None:
            filled[field.name] = value
    return filled


def _stage(model_dir: Path, stage: Path, spec: ModelSpec) -> None:
    """A view of `model_dir` with the filled config.json (weights linked, not copied)."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    (stage / "config.json").write_text(json.dumps(mlx_config(config, spec)), encoding="utf-8")
    for path in model_dir.iterdir():
        if path.suffix == ".safetensors" or path.name.endswith(".safetensors.index.json"):
            (stage / path.name).symlink_to(path.resolve())
        elif _SIDE_FILES.fullmatch(path.name):
            shutil.copy(path, stage / path.name)


def hf_to_mlx(
    model_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
    chat_template: str | None = None, overwrite: bool = False,
) -> Path:  # fmt: skip
    """The transformers checkpoint in `model_dir` as an mlx-lm model dir (mlx_lm.convert).
    `chat_template`: set where the tokenizer has none (mlx-lm renders prompt/completion
    rows through it)."""
    from mlx_lm.convert import convert  # type: ignore[import-not-found]

    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise MlxExportError(f"{src} has no config.json", "point at a transformers model dir")
    spec, dtype = load_spec(str(src)), mlx_dtype(dtype)
    tmp = _fresh(out, overwrite)
    with tempfile.TemporaryDirectory() as stage:
        _stage(src, Path(stage), spec)
        with _quiet_stdout():
            convert(stage, str(tmp / "model"), dtype=dtype)
    for path in (tmp / "model").iterdir():
        path.rename(tmp / path.name)
    (tmp / "model").rmdir()
    if chat_template:
        _ensure_template(tmp / "tokenizer_config.json", chat_template)
    return _commit(tmp, out)


def _ensure_template(path: Path, template: str) -> None:
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not config.get("chat_template") and not (path.parent / "chat_template.jinja").exists():
        config["chat_template"] = template
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")


class _quiet_stdout:
    """mlx_lm.convert prints [INFO] lines; moetune's stdout is for its own output."""

    def __enter__(self) -> None:
        import contextlib
        import io

        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._redirect.__exit__(None, None, None)


# ---------------------------------------------------------------- fused mlx -> transformers


def _hf_key(key: str, names: MlxNames) -> str:
    match = _LAYER_KEY.match(key)
    if match is None:
        return key
    return f"{match['layers']}.{match['i']}.{names.to_hf(match['rel'])}.{match['leaf']}"


def _hf_state(weights: dict[str, torch.Tensor], names: MlxNames) -> dict[str, torch.Tensor]:
    """mlx keys -> transformers state-dict keys: switch_mlp stacks joined into the fused
    expert parameters, the MoE block renamed (mixtral: block_sparse_moe -> mlp)."""
    import torch

    mlx_to_param = {t: p for p, targets in names.stacks.items() for t in targets}
    state: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key, value in weights.items():
        match = _LAYER_KEY.match(key)
        if match is None or match["rel"] not in mlx_to_param or match["leaf"] != "weight":
            state[_hf_key(key, names)] = value
            continue
        param = mlx_to_param[match["rel"]]
        slots = parts.setdefault(f"{match['layers']}.{match['i']}.{param}", {})
        slots[names.stacks[param].index(match["rel"])] = value
    for key, slots in parts.items():
        tensors = [slots[i] for i in sorted(slots)]
        if len(tensors) == 2 and names.interleaved:  # gate/up alternate along the rows
            state[key] = torch.stack(tensors, dim=2).flatten(1, 2)
        else:
            state[key] = torch.cat(tensors, dim=1)
    return state


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(model_dir.glob("model*.safetensors"))
    if not files:
        raise MlxExportError(f"{model_dir} has no model*.safetensors", "point at a model dir")
    return {k: v for f in files for k, v in load_file(str(f)).items()}


def fused_to_hf(fused_dir: str | Path, out_dir: str | Path, *, overwrite: bool = False) -> Path:
    """An `mlx_lm.fuse` output (stacked `switch_mlp.*` experts) as a transformers
    checkpoint: transformers' own model is built from the config, given these weights
    (every tensor must find its place) and saved by transformers."""
    import torch
    from transformers import AutoConfig

    from moetune.model.derive import causal_lm_class

    src, out = Path(fused_dir), Path(out_dir)
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    if "quantization" in config or "quantization_config" in config:
        raise MlxExportError(f"{src} is quantised", "fuse with `mlx_lm.fuse --dequantize` first")
    spec = spec_from_config(config, str(src))
    names = mlx_names(spec)
    if names.transposed:
        raise MlxExportError(
            f"{spec.model_type}: moetune does not rebuild transposed expert stacks from mlx",
            "merge the peft adapter in transformers instead (merge_and_unload)",
        )
    hf_config = AutoConfig.for_model(**{k: v for k, v in config.items() if k != "model_type"},
                                     model_type=config["model_type"])  # fmt: skip
    with torch.device("meta"):
        model = causal_lm_class(hf_config)(hf_config)
    state = _hf_state(_read_weights(src), names)
    if spec.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    missing = [k for k in missing if not (spec.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise MlxExportError(
            f"{src}: {len(missing)} transformers tensors not in the mlx weights "
            f"({missing[:2]}), {len(unexpected)} mlx tensors without a place ({unexpected[:2]})",
            "fuse with `mlx_lm.fuse --dequantize`, from a model moetune converted",
        )
    if spec.tie_word_embeddings:
        model.tie_weights()
    tmp = _fresh(out, overwrite)
    model.save_pretrained(str(tmp))
    for path in src.iterdir():
        if _SIDE_FILES.fullmatch(path.name):
            shutil.copy(path, tmp / path.name)
    return _commit(tmp, out)


# ---------------------------------------------------------------- served == trained


def _relative(a: Any, b: Any) -> float:
    import numpy as np

    x, y = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(x - y)) / max(float(np.linalg.norm(y)), 1e-30)


def peft_logits(base_dir: str | Path, adapter_dir: str | Path, tokens: list[list[int]]) -> Any:
    """Logits of the peft adapter on `base_dir` in transformers (float32, CPU)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base: Any = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def mlx_logits(mlx_dir: str | Path, adapter_dir: str | Path | None, tokens: list[list[int]]) -> Any:
    """Logits of the mlx-lm model (with its mlx-lm adapter) on the same tokens."""
    import mlx.core as mx  # type: ignore[import-not-found]
    import numpy as np
    from mlx_lm.utils import load  # type: ignore[import-not-found]

    model = load(str(mlx_dir), adapter_path=str(adapter_dir) if adapter_dir else None)[0]
    logits = model(mx.array(tokens)).astype(mx.float32)
    mx.eval(logits)
    return np.array(logits)


def served_matches_trained(
    base_dir: str | Path, adapter_dir: str | Path, tokens: list[list[int]],
    tolerance: float = 1e-4,
) -> dict[str, Any]:  # fmt: skip
    """Convert base and adapter for mlx-lm (float32) and compare its logits with peft's in
    transformers on `tokens`: relative norm of the difference, and whether it is within
    `tolerance`."""
    with tempfile.TemporaryDirectory() as tmp:
        mlx_base = hf_to_mlx(base_dir, Path(tmp) / "base", dtype="float32")
        mlx_adapter = peft_to_mlx(adapter_dir, Path(tmp) / "adapter", str(base_dir))
        served = mlx_logits(mlx_base, mlx_adapter, tokens)
    trained = peft_logits(base_dir, adapter_dir, tokens)
    rel = _relative(served, trained)
    return {"relative_error": rel, "tolerance": tolerance, "ok": rel <= tolerance}
