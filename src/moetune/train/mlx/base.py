"""A transformers checkpoint as an mlx-lm model dir (`hf_to_mlx`).

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

import contextlib
import dataclasses
import io
import json
import re
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from moetune.lint.mlx_env import backend_fix, mlx_backend
from moetune.model import ModelSpec, load_spec
from moetune.model.weight_files import check_weight_files, checkpoint_files
from moetune.train.mlx.format import MlxFormatError, commit_dir, fresh_dir

if TYPE_CHECKING:
    pass

# Small files of a model dir that travel with it (tokenizer, generation settings).
SIDE_FILES = re.compile(r"(tokenizer.*|special_tokens_map|generation_config|chat_template.*)\.\w+")


def mlx_dtype(requested: str | None = None) -> str | None:
    """The dtype to convert to: as requested, else float32 on mlx's CPU backend (GatherMM
    is float32-only there), else the checkpoint's own."""

    if requested:
        return requested
    found = mlx_backend()
    if found.backend is None:
        raise MlxFormatError(f"mlx-lm cannot run here: {found.error}", backend_fix())
    return "float32" if found.backend == "cpu" else None


def _rope_theta(config: dict[str, Any]) -> float | None:
    rope = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", rope.get("rope_theta"))
    return float(theta) if theta is not None else None


def mlx_config(config: dict[str, Any], spec: ModelSpec) -> dict[str, Any]:
    """`config` with the fields mlx-lm's ModelArgs for this type needs filled from the spec:
    every required field it lacks, and rope_theta (mlx-lm's defaults differ per family)."""
    # lazy: heavy to import (mlx_lm)
    from mlx_lm.utils import _get_classes  # type: ignore[import-not-found]

    try:
        _, args_class = _get_classes(config)
    except ValueError as exc:
        raise MlxFormatError(f"mlx-lm {exc}", "use lora.stack=peft for this model type") from None
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
            raise MlxFormatError(
                f"{spec.name}: mlx-lm's {config['model_type']} needs `{field.name}`, which "
                "config.json does not give",
                f"add {field.name} to config.json",
            )
        if value is not None:
            filled[field.name] = value
    return filled


def _stage(model_dir: Path, stage: Path, spec: ModelSpec) -> None:
    """A view of `model_dir` with the filled config.json (weights linked, not copied): only
    the checkpoint's files, since mlx-lm reads every model*.safetensors in the dir."""
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    (stage / "config.json").write_text(json.dumps(mlx_config(config, spec)), encoding="utf-8")
    check_weight_files(model_dir, own_reader=True)  # mlx-lm reads this view, not transformers
    weights = set(checkpoint_files(model_dir))
    for path in model_dir.iterdir():
        if path in weights or path.name.endswith(".safetensors.index.json"):
            (stage / path.name).symlink_to(path.resolve())
        elif SIDE_FILES.fullmatch(path.name):
            shutil.copy(path, stage / path.name)


def hf_to_mlx(
    model_dir: str | Path, out_dir: str | Path, *, dtype: str | None = None,
    chat_template: str | None = None, overwrite: bool = False,
) -> Path:  # fmt: skip
    """The transformers checkpoint in `model_dir` as an mlx-lm model dir (mlx_lm.convert).
    `chat_template`: set where the tokenizer has none (mlx-lm renders prompt/completion
    rows through it)."""
    # lazy: heavy to import (mlx_lm)
    from mlx_lm.convert import convert  # type: ignore[import-not-found]

    src, out = Path(model_dir), Path(out_dir)
    if not (src / "config.json").is_file():
        raise MlxFormatError(f"{src} has no config.json", "point at a transformers model dir")
    spec, dtype = load_spec(str(src)), mlx_dtype(dtype)
    tmp = fresh_dir(out, overwrite)
    with tempfile.TemporaryDirectory() as stage:
        _stage(src, Path(stage), spec)
        with _quiet_stdout():
            convert(stage, str(tmp / "model"), dtype=dtype)
    for path in (tmp / "model").iterdir():
        path.rename(tmp / path.name)
    (tmp / "model").rmdir()
    if chat_template:
        _ensure_template(tmp / "tokenizer_config.json", chat_template)
    return commit_dir(tmp, out)


def _ensure_template(path: Path, template: str) -> None:
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if not config.get("chat_template") and not (path.parent / "chat_template.jinja").exists():
        config["chat_template"] = template
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")


def set_chat_template(model_dir: Path, template: str) -> None:
    """`template` as the converted tokenizer's only chat template, replacing its own (the
    mlx stack renders with data.chat_template as the torch stack does): chat_template.jinja,
    which transformers prefers, and none left in tokenizer_config.json."""
    path = model_dir / "tokenizer_config.json"
    config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    if config.pop("chat_template", None) is not None:
        path.write_text(json.dumps(config, indent=2), encoding="utf-8")
    (model_dir / "chat_template.jinja").write_text(template, encoding="utf-8")


class _quiet_stdout:
    """mlx_lm.convert prints [INFO] lines; moetune's stdout is for its own output."""

    def __enter__(self) -> None:

        self._redirect = contextlib.redirect_stdout(io.StringIO())
        self._redirect.__enter__()

    def __exit__(self, *exc: object) -> None:
        self._redirect.__exit__(None, None, None)
